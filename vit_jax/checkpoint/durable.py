"""Writes that survive a host crash: files and directory entries forced to stable storage.

A file the kernel has only in its page cache is lost when the host crashes (or the filesystem
errors) before writeback, typically within 30 s of the write; a rename can reach the disk before
the data it names, leaving an empty file under its final name. Orbax renames a finished
checkpoint step into place without forcing anything to disk, so here:

* :func:`rename_class`, Orbax's rename commit with fsync: every file and directory of the step,
  then the rename, then the step and the ``checkpoints`` directory (the step's own
  ``_CHECKPOINT_METADATA`` and ``commit_success.txt``, which Orbax writes just before its
  rename, are forced just after it: a crash in between leaves them empty, which Orbax reads
  past with an error line; the arrays and JSON items are on disk before the step has its name);
* :func:`write_atomically`: a small file written beside its destination, forced, renamed over
  it, and the directory forced (``config.json``, ``dataset.json``, ``cost.json``);
* :func:`damaged_files`: the empty files of a step (what a crash leaves of unforced data).

Remote paths (``gs://``) need none of it: an object exists only once its upload completed.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any, List

from vit_jax.checkpoint import paths

#: Files of a step that Orbax rewrites in its finalization, after :func:`rename_class`'s has
#: forced the rest; empty after a crash within that moment, and not needed to restore the step.
FINALIZATION_FILES = ('_CHECKPOINT_METADATA', 'commit_success.txt')


def _sync(path: str, directory: bool) -> None:
  fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def sync_tree(root: Any) -> None:
  """Forces every file and directory under ``root`` (a local directory), and ``root``, to disk.

  Raises:
    OSError: a file cannot be opened or forced (e.g. an I/O error of the disk).
  """
  root = os.fspath(root)
  for directory, _, names in os.walk(root, topdown=False):
    for name in names:
      path = os.path.join(directory, name)
      if not os.path.islink(path):
        _sync(path, directory=False)
    _sync(directory, directory=True)


def sync_directory(path: Any) -> None:
  """Forces the entries of the local directory ``path`` (its renames and new names) to disk."""
  _sync(os.fspath(path), directory=True)


def write_atomically(path: Any, text: str) -> None:
  """Writes ``text`` to ``path`` so that readers, and a crash, see the old or the new content.

  Local: ``<path>.partial`` written and forced, renamed over ``path``, the directory forced.
  ``gs://``: one object write. Creates the parent directory.

  Raises:
    OSError: it cannot be written (``path`` is then unchanged).
  """
  from etils import epath  # pylint: disable=g-import-not-at-top
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if paths.is_remote(os.fspath(path)):
    path.write_text(text)
    return
  partial = f'{path}.partial'
  with open(partial, 'w', encoding='utf-8') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(partial, path)
  sync_directory(path.parent)


def damaged_files(step_dir: Any) -> List[str]:
  """The empty files of a local checkpoint step (relative names; :data:`FINALIZATION_FILES`
  excepted): what a crash leaves of data that was never forced to disk. ``[]`` for a remote
  step, and for an intact one (no file Orbax writes is empty)."""
  root = os.fspath(step_dir)
  if paths.is_remote(root):
    return []
  empty = []
  for directory, _, names in os.walk(root):
    for name in names:
      path = os.path.join(directory, name)
      if name not in FINALIZATION_FILES and not os.path.islink(path) and (
          os.path.getsize(path) == 0):
        empty.append(os.path.relpath(path, root))
  return sorted(empty)


@functools.lru_cache(maxsize=None)
def rename_class() -> type:
  """``DurableRename``: Orbax's atomic-rename commit of a checkpoint step, forced to disk (see
  the module), for ``CheckpointManagerOptions(temporary_path_class=...)`` on local directories
  (Orbax commits ``gs://`` steps with a marker file instead). Made on first use: importing
  Orbax costs about a second that the readers of other formats do not need to pay."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  class DurableRename(ocp.path.atomicity.AtomicRenameTemporaryPath):

    async def finalize(self, *args, **kwargs) -> None:
      await asyncio.to_thread(sync_tree, self.get())
      await super().finalize(*args, **kwargs)
      final = self.get_final()
      await asyncio.to_thread(sync_tree, final)
      await asyncio.to_thread(sync_directory, final.parent)

  return DurableRename
