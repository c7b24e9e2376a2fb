"""docs/notebook.ipynb, the official vit_jax.ipynb's steps with this project's API: stored with
the outputs that docs/make_notebook.py made of its current cells (checked here, fast, with what
they say), and run top to bottom in a fresh kernel of this interpreter by that script's
`execute` (slow: once per test run), every cell without error and its printed numbers checked
(load, predict, attention, fine-tuning)."""

import importlib.util
import os
import pathlib
import re

import nbformat
import pytest

from vit_jax.data import fashion_mnist_local

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "notebook.ipynb"

#: tests/conftest.py's XLA flags for every process the tests start.
CONFTEST_FAST_COMPILE = ("--xla_backend_optimization_level=0",
                         "--xla_cpu_use_fusion_emitters=false")


def _make_notebook():
  """docs/make_notebook.py as a module (docs/ is no package)."""
  path = ROOT / "docs" / "make_notebook.py"
  spec = importlib.util.spec_from_file_location("make_notebook", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _code_cells(notebook):
  return [cell for cell in notebook.cells if cell.cell_type == "code"]


def test_the_notebook_is_stored_with_the_outputs_of_its_cells():
  """Every code cell has the outputs its current source made (`make_notebook.py --check`), and
  they say what a run says (`_check_outputs`), pictures included: GitHub shows them."""
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(notebook)
  cells = _code_cells(notebook)
  assert len(cells) == 9
  for cell in notebook.cells:  # Only the public API: no private names of ours.
    assert not re.search(r"\b_[a-z]\w*|\._[a-z]", cell.source), cell.source[:200]
  make_notebook = _make_notebook()
  assert make_notebook.stale_cells(notebook) == [], (
      "Run python docs/make_notebook.py: these cells changed since their outputs were made")
  _check_outputs(cells)
  assert make_notebook.main(["--check"]) == 0
  cells[3].source += "\n# edited"
  assert make_notebook.stale_cells(notebook) == [f"cell 4 ({cells[3].source.splitlines()[0]})"]


def _text(cell) -> str:
  """What a cell printed (stdout), after every cell ran without error."""
  return "".join(out.text for out in cell.outputs
                 if out.output_type == "stream" and out.name == "stdout")


def _images(cell) -> int:
  return sum(1 for out in cell.outputs
             if out.output_type == "display_data" and "image/png" in out.data)


def _percent(pattern: str, text: str) -> float:
  match = re.search(pattern + r"(\d+\.\d+)%", text)
  assert match, (pattern, text)
  return float(match.group(1))


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(fashion_mnist_dir, tmp_path, monkeypatch):
  """In a kernel of this Python (`make_notebook.execute`), offline, on the prepared
  Fashion-MNIST; the training runs in tmp_path (the notebook's tempfile)."""
  monkeypatch.setenv("TFDS_DATA_DIR", fashion_mnist_dir)
  # The kernel compiles as a user's would: conftest's faster-compiling, slower-running
  # settings made the notebook's first training 30 -> 47 s (measured on 2 cores).
  monkeypatch.setenv("XLA_FLAGS", " ".join(
      f for f in os.environ.get("XLA_FLAGS", "").split() if f not in CONFTEST_FAST_COMPILE))
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  for cell in _code_cells(notebook):
    cell.outputs = []
  _make_notebook().execute(notebook)  # Raises CellExecutionError, naming the cell, if one fails.
  cells = _code_cells(notebook)
  assert str(tmp_path) in _text(cells[0])
  _check_outputs(cells)


def _check_outputs(cells) -> None:
  """What the notebook's cells printed and drew, stored or fresh: nothing on stderr (no library
  noise, no warning), the numbers of every step."""
  for cell in cells:
    errors = [out for out in cell.outputs if out.output_type == "error"
              or out.output_type == "stream" and out.name == "stderr"]
    assert not errors, (cell.source[:100], errors)
  (_, official, timm, inference, pretrain, predict, attention, finetune, controls) = cells

  # 1. Loading: the official code's and timm's outputs, the fixture's exact parameter count.
  text = _text(official)
  assert "21,162 parameters" in text and "32 px, logits (2, 10)" in text, text
  assert float(re.search(r"from the official code: (\S+)\n", text).group(1)) < 1e-5, text
  text = _text(timm)
  differences = [float(x) for x in re.findall(r"px: max difference from timm (\S+)\n", text)]
  assert len(differences) == 2 and max(differences) < 1e-5, text
  assert "ViT-custom 32 px, 10 classes" in _text(inference)

  # 2. The 28 px model: 80.9% measured (chance: 10%).
  pretrained = _percent(r"Trained at 28 px for 400 steps: test accuracy ", _text(pretrain))
  assert pretrained > 70, pretrained

  # 3. Predictions: class names of Fashion-MNIST, most of them right (7 of 8 measured).
  lines = re.findall(r"image \d: (.+) \d+\.\d%, (.+) \d+\.\d% \(true: (.+)\)",
                     _text(predict))
  assert len(lines) == 8, _text(predict)
  assert all(name in fashion_mnist_local.LABEL_NAMES for line in lines for name in line)
  assert sum(first == true for first, _, true in lines) >= 5, lines
  assert _images(predict) == 1

  # 4. Attention: the distances of 2 layers x 4 heads in pixels (a 4x4 grid of 7 px patches:
  # from 0, attention on itself, to 30 px, the far corner), and the two figures.
  text = _text(attention)
  assert "token grid [4, 4]" in text, text
  distances = [float(x) for x in re.findall(r"\d+\.\d", text.split("layers x heads:")[1])]
  assert len(distances) == 8 and all(5 < d < 25 for d in distances), text
  assert _images(attention) == 2

  # 5. Fine-tuning at 42 px wins back most of what the resolution change lost (48.9% -> 74.0%
  # measured).
  text = _text(finetune)
  before = _percent(r"not fine-tuned: ", text)
  after = _percent(r"Fine-tuned at 42 px for 200 steps: test accuracy ", text)
  assert after > 60 and after > before + 10, text
  # The fine-tuning controls' groups of the pretrained model (width 64, 2 blocks, 7 px patches):
  # the patch embedding (7 * 7 * 3 * 64 + 64 parameters) frozen, lr 0.75^(3 - layer).
  text = _text(controls)
  assert "68,874 of 78,346 parameters trained; L=2 blocks." in text, text
  assert re.search(r"embedding/\*\s+0\s+2\s+9,472\s+-\s+-\s+yes", text), text
  assert re.search(r"head/\*\s+3\s+2\s+650\s+1\s+0\s+no\s+step 0", text), text
