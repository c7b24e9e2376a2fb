"""Writes that survive a kill and a host crash: written beside and renamed into place, files and
directory entries forced to stable storage (unforced data is lost in a crash, and a rename can
reach the disk before the data it names). ``gs://`` needs none of it (an object appears whole)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import io
import os
import shutil
import stat
from typing import Any, BinaryIO, Callable, List, Union

from vit_jax import storage

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


def write_atomically(path: Any, content: Union[str, bytes, Callable[[BinaryIO], None]],
                     partial: str = '.partial') -> None:
  """Writes ``content`` (text, bytes, or a function writing to a binary file) to ``path``
  (parent created) so that readers, a crash and a kill see the old or the new content:
  ``<path><partial>`` forced and renamed, with an old file's permissions; ``gs://``: one object
  write. Raises OSError, ``path`` then unchanged."""
  path = os.fspath(path)
  if isinstance(content, str):
    content = content.encode('utf-8')
  if storage.is_remote(path):
    if callable(content):
      buffer = io.BytesIO()
      content(buffer)
      content = buffer.getvalue()
    storage.write_bytes(path, content)
    return
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  partial = f'{path}{partial}'
  try:
    with open(partial, 'wb') as f:
      if callable(content):
        content(f)
      else:
        f.write(content)
      f.flush()
      os.fsync(f.fileno())
    with contextlib.suppress(FileNotFoundError):
      os.chmod(partial, stat.S_IMODE(os.stat(path).st_mode))
    os.replace(partial, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(partial)
    raise
  _sync(os.path.dirname(os.path.abspath(path)), directory=True)


def move_into_place(staging: Any, target: Any) -> None:
  """Moves the local file or directory ``staging`` (forced to disk) to ``target``, deleting what
  was there, swapped in one step where the system can, so that a kill leaves the old or the new
  at ``target``. Raises OSError."""
  staging, target = os.fspath(staging), os.fspath(target)
  if os.path.isdir(staging):
    sync_tree(staging)
  else:
    _sync(staging, directory=False)
  if not os.path.lexists(target):
    os.rename(staging, target)
  elif not _exchange(staging, target):
    old = f'{target}.replaced'
    _remove(old)
    os.rename(target, old)
    os.rename(staging, target)
    staging = old
  _sync(os.path.dirname(os.path.abspath(target)), directory=True)
  _remove(staging)  # Now the old one.


def _exchange(a: str, b: str) -> bool:
  """Swaps ``a`` and ``b`` atomically (Linux ``renameat2``); False where the system cannot."""
  try:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
  except (AttributeError, OSError):
    return False
  at_fdcwd = -100
  rename_exchange = 2
  if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
    return False
  raise OSError(code, os.strerror(code), b)


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.remove(path)


def damaged_files(step_dir: Any) -> List[str]:
  """The empty files of a local step (relative; :data:`FINALIZATION_FILES` excepted), ``[]`` remote.
  """
  root = os.fspath(step_dir)
  if storage.is_remote(root):
    return []
  files = [os.path.join(directory, name) for directory, _, names in os.walk(root)
           for name in names if name not in FINALIZATION_FILES]
  return sorted(os.path.relpath(path, root) for path in files
                if not os.path.islink(path) and os.path.getsize(path) == 0)


@functools.lru_cache(maxsize=None)
def rename_class() -> type:
  """``DurableRename`` (``CheckpointManagerOptions(temporary_path_class=...)``, local paths):
  Orbax's rename commit with the step's files, the rename and the directories forced (made on
  first use, as Orbax's import is slow)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  class DurableRename(ocp.path.atomicity.AtomicRenameTemporaryPath):

    async def finalize(self, *args, **kwargs) -> None:
      await asyncio.to_thread(sync_tree, self.get())
      await super().finalize(*args, **kwargs)
      final = self.get_final()
      await asyncio.to_thread(sync_tree, final)
      await asyncio.to_thread(_sync, os.fspath(final.parent), True)

  return DurableRename
