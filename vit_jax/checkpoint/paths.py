"""File access for reading checkpoints: local paths with ``os``, ``scheme://`` paths with gfile.

Any path containing ``://`` (``gs://bucket/x.npz``) goes through ``tf.io.gfile``; TensorFlow is
imported only for such paths. Orbax reads and writes remote directories itself (through
``etils.epath``), so this module serves the ``.npz`` and PyTorch readers and the detection of a
path's format.
"""

from __future__ import annotations

import errno
import os
from typing import Any, List


def is_remote(path: str) -> bool:
  """Whether ``path`` has a scheme (``gs://...``) and so goes through ``tf.io.gfile``."""
  return '://' in path


def _gfile():
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - tensorflow is a project dependency.
    raise ImportError('Reading remote paths (e.g. gs://) needs TensorFlow (tf.io.gfile)') from e
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
  """Deletes the file at ``path``."""
  if is_remote(path):
    _gfile().remove(path)
  else:
    os.remove(path)


def read_head(path: str, size: int) -> bytes:
  """The first ``size`` bytes of the file at ``path`` (fewer if it is shorter)."""
  with open_file(path, 'rb') as f:
    return f.read(size)


def read_bytes(path: str) -> bytes:
  with open_file(path, 'rb') as f:
    return f.read()


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


def not_found(path: str, what: str = 'No checkpoint') -> FileNotFoundError:
  """The error for a missing ``path``: ``FileNotFoundError(ENOENT, "<what> at '<path>'")``."""
  return FileNotFoundError(errno.ENOENT, f'{what} at {path!r}', path)
