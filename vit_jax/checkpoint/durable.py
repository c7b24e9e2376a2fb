"""Writes that survive a host crash: files and directory entries forced to stable storage
(unforced data is lost in a crash, and a rename can reach the disk before the data it names).
``gs://`` needs none of it."""

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
  """Forces every file and directory under the local ``root``, and ``root``, to disk (OSError)."""
  root = os.fspath(root)
  for directory, _, names in os.walk(root, topdown=False):
    for name in names:
      path = os.path.join(directory, name)
      if not os.path.islink(path):
        _sync(path, directory=False)
    _sync(directory, directory=True)


def write_atomically(path: Any, text: str, partial: str = '.partial') -> None:
  """Writes ``text`` to ``path`` (parent created) so that readers and a crash see the old or
  the new content: ``<path><partial>`` forced and renamed (``gs://``: one object write). Raises
  OSError, ``path`` then unchanged."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if paths.is_remote(os.fspath(path)):
    path.write_text(text)
    return
  partial = f'{path}{partial}'
  with open(partial, 'w', encoding='utf-8') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(partial, path)
  _sync(os.fspath(path.parent), directory=True)


def damaged_files(step_dir: Any) -> List[str]:
  """The empty files of a local step (relative; :data:`FINALIZATION_FILES` excepted), ``[]`` remote.
  """
  root = os.fspath(step_dir)
  if paths.is_remote(root):
    return []
  files = [os.path.join(directory, name) for directory, _, names in os.walk(root)
           for name in names if name not in FINALIZATION_FILES]
  return sorted(os.path.relpath(path, root) for path in files
                if not os.path.islink(path) and os.path.getsize(path) == 0)


@functools.lru_cache(maxsize=None)
def rename_class() -> type:
  """``DurableRename`` (``CheckpointManagerOptions(temporary_path_class=...)``, local paths):
  Orbax's rename commit with the step's files, the rename and the directories forced. Made on
  first use: importing Orbax costs about a second other readers need not pay."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  class DurableRename(ocp.path.atomicity.AtomicRenameTemporaryPath):

    async def finalize(self, *args, **kwargs) -> None:
      await asyncio.to_thread(sync_tree, self.get())
      await super().finalize(*args, **kwargs)
      final = self.get_final()
      await asyncio.to_thread(sync_tree, final)
      await asyncio.to_thread(_sync, os.fspath(final.parent), True)

  return DurableRename
