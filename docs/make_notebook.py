"""Runs docs/notebook.ipynb top to bottom and stores its outputs, text and pictures, in it (so
that GitHub shows them), each code cell with the hash of the source that made them.

  python docs/make_notebook.py          # after editing a cell; about a minute on 2 CPU cores
  python docs/make_notebook.py --check  # exit 1 naming the cells edited since they ran

The cells are the notebook's own (edit them in Jupyter or VS Code, then run this). It runs them
in a fresh kernel of this Python (nbclient), offline, with the README's set-up: the
`dataset-fashion-mnist` files, prepared on first use into $TFDS_DATA_DIR (default
~/tensorflow_datasets). tests/test_notebook.py runs `--check`'s test in the fast tier and, once,
the notebook itself (`execute`), checking what both the stored and the fresh outputs say."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import pathlib
import sys
import tempfile
from typing import Iterator

NOTEBOOK = pathlib.Path(__file__).resolve().with_name("notebook.ipynb")
#: Where a code cell keeps the hash of the source its outputs came from.
METADATA_KEY = "vit_jax"
#: A hang guard per cell, seconds (the whole notebook takes about a minute on 2 CPU cores).
CELL_TIMEOUT = 300
KERNEL_NAME = "vit_jax_notebook"


def source_hash(source: str) -> str:
  """The first 16 hex digits of the SHA-256 of a cell's source."""
  return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def stale_cells(notebook) -> list[str]:
  """The code cells whose stored outputs are not of their source: none at all (a fresh cell,
  or the notebook stored without outputs), or made by a source since edited. Each as
  'cell N (first line)', N counting code cells from 1."""
  stale = []
  cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
  for number, cell in enumerate(cells, 1):
    made_by = cell.metadata.get(METADATA_KEY, {}).get("source_sha256")
    if not cell.outputs or made_by != source_hash(cell.source):
      stale.append(f"cell {number} ({cell.source.splitlines()[0] if cell.source else ''})")
  return stale


@contextlib.contextmanager
def _kernel() -> Iterator[str]:
  """A kernelspec of this Python (sys.executable, whatever `python3` kernels Jupyter knows),
  found through a temporary JUPYTER_PATH; yields its name."""
  from ipykernel import kernelspec  # pylint: disable=g-import-not-at-top
  previous = os.environ.get("JUPYTER_PATH")
  with tempfile.TemporaryDirectory(prefix="vit_jax_kernel_") as path:
    kernelspec.write_kernel_spec(os.path.join(path, "kernels", KERNEL_NAME))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (path, previous) if p)
    try:
      yield KERNEL_NAME
    finally:
      if previous is None:
        os.environ.pop("JUPYTER_PATH", None)
      else:
        os.environ["JUPYTER_PATH"] = previous


def execute(notebook, cell_timeout: int = CELL_TIMEOUT):
  """Runs `notebook` (an nbformat NotebookNode, changed in place and returned) in a fresh kernel
  of this Python with this process's environment, in docs/; its code cells get their outputs
  and `source_hash`. Raises nbclient's CellExecutionError, naming the cell, if one fails."""
  import nbclient  # pylint: disable=g-import-not-at-top
  with _kernel() as kernel_name:
    client = nbclient.NotebookClient(notebook, timeout=cell_timeout, kernel_name=kernel_name,
                                     record_timing=False,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
  for cell in notebook.cells:
    if cell.cell_type == "code":
      cell.metadata[METADATA_KEY] = {"source_sha256": source_hash(cell.source)}
  # The kernel this ran in is ours; a reader opens it in theirs.
  notebook.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)",
                                     "language": "python", "name": "python3"}
  return notebook


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true",
                      help="run nothing; exit 1 if a code cell's stored outputs are not of its "
                      "source")
  args = parser.parse_args(argv)
  import nbformat  # pylint: disable=g-import-not-at-top
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  if args.check:
    stale = stale_cells(notebook)
    for cell in stale:
      print(f"{NOTEBOOK}: {cell}: its outputs are not of its source; run python "
            "docs/make_notebook.py", file=sys.stderr)
    return 1 if stale else 0
  execute(notebook)
  nbformat.validate(notebook)
  nbformat.write(notebook, NOTEBOOK)
  print(f"Wrote {NOTEBOOK} with the outputs of its {len(notebook.cells)} cells.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
