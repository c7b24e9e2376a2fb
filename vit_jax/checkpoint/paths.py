"""File access for the checkpoint readers: local paths with ``os``, ``scheme://`` paths
(``gs://bucket/x.npz``) with ``tf.io.gfile``, imported only for those (Orbax uses ``epath``)."""

from __future__ import annotations

import errno
import os
from typing import Any, List, Optional, Tuple


def is_remote(path: str) -> bool:
  """Whether ``path`` has a scheme (``gs://...``) and so goes through ``tf.io.gfile``."""
  return '://' in path


def _gfile():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (seconds; remote paths only)
  return tf.io.gfile


def exists(path: str) -> bool:
  return _gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return _gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def listdir(path: str) -> List[str]:
  if is_remote(path):
    return [name.rstrip('/') for name in _gfile().listdir(path)]
  return os.listdir(path)


def open_file(path: str, mode: str):
  """A file object for ``path`` (``mode`` as for :func:`open`, e.g. ``'rb'``)."""
  return _gfile().GFile(path, mode) if is_remote(path) else open(path, mode)


def remove(path: str) -> None:
  if is_remote(path):
    _gfile().remove(path)
  else:
    os.remove(path)


def read_bytes(path: str, size: int = -1) -> bytes:
  """The first ``size`` bytes of the file at ``path`` (default all; fewer if it is shorter)."""
  with open_file(path, 'rb') as f:
    return f.read(size)


def size(path: str) -> int:
  """The size in bytes of a local or remote file (remote: its metadata, nothing read)."""
  return _gfile().stat(path).length if is_remote(path) else os.path.getsize(path)


def join(path: str, *names: str) -> str:
  if is_remote(path):
    return '/'.join([path.rstrip('/'), *names])
  return os.path.join(path, *names)


def basename(path: str) -> str:
  return path.rstrip('/').rsplit('/', 1)[-1] if is_remote(path) else os.path.basename(
      path.rstrip(os.sep))


def normalize(path: Any) -> str:
  """``path`` (str, bytes or ``os.PathLike``) as a str; ``~`` expanded for local paths."""
  path = os.fspath(path)
  if not isinstance(path, str):
    path = os.fsdecode(path)
  return path if is_remote(path) else os.path.expanduser(path)


def probe(path: Any, size: int, what: str = 'No checkpoint'
          ) -> Tuple[str, Optional[List[str]], bytes]:
  """``(path normalized, a directory's listing or None for a file, a file's first size bytes
  or b'')``. Raises FileNotFoundError (:func:`not_found`, ``what``) when nothing is there."""
  path = normalize(path)
  if not exists(path):
    raise not_found(path, what)
  if isdir(path):
    return path, listdir(path), b''
  return path, None, read_bytes(path, size)


def not_found(path: str, what: str = 'No checkpoint', fix: str = '') -> FileNotFoundError:
  """The error for a missing ``path``: ``FileNotFoundError(ENOENT, "<what> at '<path>'")``,
  then ``: <fix>`` when given."""
  return FileNotFoundError(errno.ENOENT, f'{what} at {path!r}' + (f': {fix}' if fix else ''),
                           path)
