"""File access for the checkpoint readers: local paths with ``os``, ``scheme://`` paths
(``gs://bucket/x.npz``) with ``tf.io.gfile``, imported only for those (Orbax uses ``epath``)."""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Any, List, Optional, Tuple

from vit_jax import rundir


def is_remote(path: str) -> bool:
  """Whether ``path`` has a scheme (``gs://...``) and so goes through ``tf.io.gfile``."""
  return '://' in path


#: A Cloud Storage bucket name (https://cloud.google.com/storage/docs/buckets#naming): 3-63
#: characters of a-z, 0-9, '-', '_' and '.' (up to 222 with dots, 63 between them), beginning
#: and ending with a letter or a digit.
_BUCKET = re.compile(r'[a-z0-9](?:[a-z0-9._-]{1,220})[a-z0-9]')


def check_url(path: Any, what: str = 'The path') -> None:
  """Refuses a ``gs://`` ``path`` (``what``: the flag or field that gave it) whose bucket is
  missing or not a bucket name, before anything reads it (TensorFlow's error would be a
  traceback, a write's one blames the network). Raises ValueError naming the fix."""
  if not isinstance(path, str) or not path.startswith('gs://'):
    return
  bucket, _, rest = path[len('gs://'):].partition('/')
  example = f"gs://BUCKET/{rest.lstrip('/') or 'PATH'}"
  if not bucket:
    raise ValueError(f'{what} {path} names no bucket: write {example}.')
  parts = bucket.split('.')
  if (not _BUCKET.fullmatch(bucket) or len(bucket) > (222 if len(parts) > 1 else 63)
      or any(not 0 < len(p) <= 63 for p in parts)):
    raise ValueError(
        f'{what} {path}: {bucket!r} is not a Cloud Storage bucket name (3-63 characters of a-z, '
        "0-9, '-', '_' and '.', beginning and ending with a letter or digit): write "
        f'{example} with the name of your bucket.')


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


def not_a_file(path: str) -> Optional[str]:
  """What the local ``path`` is when it is no regular file, links followed (reading a FIFO or a
  device waits forever): e.g. 'a FIFO', 'a broken or looping symbolic link'; None
  for a regular file or nothing there."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return 'a broken or looping symbolic link' if os.path.islink(path) else None
  if stat.S_ISREG(mode):
    return None
  kinds = ((stat.S_ISFIFO, 'a FIFO'), (stat.S_ISSOCK, 'a socket'),
           (stat.S_ISCHR, 'a device'), (stat.S_ISBLK, 'a device'), (stat.S_ISDIR, 'a directory'))
  return next((kind for test, kind in kinds if test(mode)), 'not a regular file')


def read_bytes(path: str, size: int = -1) -> bytes:
  """The first ``size`` bytes of the file at ``path`` (default all; fewer if it is shorter).
  IsADirectoryError or ``rundir.NotAFileError`` for a local path that is no regular file, never
  opened."""
  odd = None if is_remote(path) else not_a_file(path)
  if odd and odd != 'a broken or looping symbolic link':  # open() names that one itself.
    error = IsADirectoryError if odd == 'a directory' else rundir.NotAFileError
    raise error(f'{path} is {odd}, not a file that can be read: give the path of a regular '
                'file.')
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
