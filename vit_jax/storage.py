"""Storage: every path a user gives (local, or ``scheme://``: ``gs://bucket/x.npz``), the one file
API over both, and what a storage error means; the only module that checks a path's scheme or
calls a file-system library (tests/test_imports.py). Local paths go through ``os`` and ``open``;
``scheme://`` ones through ``tf.io.gfile``, imported only for them."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import shutil
import socket
import stat
from typing import Any, Iterator, List, Optional, Tuple

from vit_jax import hub

#: A path's scheme prefix (``gs://``): such paths are remote.
_SCHEME = re.compile(r'^[a-zA-Z][a-zA-Z0-9+.-]*://')


def is_remote(path: Any) -> bool:
  """Whether ``path`` (str or ``os.PathLike``) has a scheme (``gs://...``)."""
  return '://' in str(os.fspath(path))


def scheme(path: str) -> str:
  """The scheme prefix of ``path`` (``'gs://'``), or ``''`` for a local path."""
  match = _SCHEME.match(path)
  return match.group(0) if match else ''


#: A Cloud Storage bucket name (https://cloud.google.com/storage/docs/buckets#naming; up to 222
#: characters with dots, 63 between them).
_BUCKET = re.compile(r'[a-z0-9](?:[a-z0-9._-]{1,220})[a-z0-9]')


def check_url(path: Any, what: str = 'The path') -> None:
  """Refuses a ``gs://`` ``path`` (``what``: the flag or field that gave it) whose bucket is
  missing or not a bucket name: ValueError naming the fix. Other values pass."""
  if not isinstance(path, str) or scheme(path) != 'gs://':
    return
  bucket, _, rest = path[len('gs://'):].partition('/')
  example = f"gs://BUCKET/{rest.lstrip('/') or 'PATH'}"
  if not bucket:
    raise ValueError(f'{what} {path} names no bucket: write {example}.')
  parts = bucket.split('.')
  too_long = len(bucket) > (222 if len(parts) > 1 else 63)
  if (not _BUCKET.fullmatch(bucket) or too_long
      or any(not 0 < len(p) <= 63 for p in parts)):
    raise ValueError(
        f'{what} {path}: {bucket!r} is not a Cloud Storage bucket name (3-63 characters of a-z, '
        "0-9, '-', '_' and '.', beginning and ending with a letter or digit): write "
        f'{example} with the name of your bucket.')


def join(path: str, *names: str) -> str:
  if is_remote(path):
    return '/'.join([path.rstrip('/'), *names])
  return os.path.join(path, *names)


def basename(path: str) -> str:
  if is_remote(path):
    return path.rstrip('/').rsplit('/', 1)[-1]
  return os.path.basename(path.rstrip(os.sep))


def dirname(path: str) -> str:
  """The parent of ``path`` (a remote one: up to its bucket, ``gs://bucket``)."""
  if not is_remote(path):
    return os.path.dirname(path)
  prefix = scheme(path)
  rest = path[len(prefix):].rstrip('/')
  return prefix + (rest.rsplit('/', 1)[0] if '/' in rest else rest)


def is_hub_name(path: Any) -> bool:
  """Whether ``path`` is a Hub name, a str ``hf-hub:ORG/NAME[@REVISION]`` (:mod:`vit_jax.hub`)."""
  return isinstance(path, str) and path.startswith(hub.PREFIX)


def normalize(path: Any) -> str:
  """``path`` (str, bytes or ``os.PathLike``) as a str; ``~`` expanded for local paths; a Hub
  name as its local path in the Hugging Face cache (raises as :func:`vit_jax.hub.resolve`)."""
  path = os.fspath(path)
  if not isinstance(path, str):
    path = os.fsdecode(path)
  if is_hub_name(path):
    return hub.resolve(path)
  return path if is_remote(path) else os.path.expanduser(path)


def clean(path: str) -> str:
  """``path`` as :mod:`pathlib` writes it (no trailing ``/``, ``//`` or ``/./``)."""
  return path.rstrip('/') if is_remote(path) else str(pathlib.PurePath(path))


def absolute(path: Any) -> str:
  """``path`` as a str, a local one absolute (``~`` not expanded); a remote one unchanged."""
  path = os.fspath(path)
  return path if is_remote(path) else os.path.abspath(path)


def resolve(path: str) -> str:
  """``path`` absolute, links followed; a remote one without its trailing ``/``."""
  return path.rstrip('/') if is_remote(path) else os.path.realpath(path)


def overlap(a: str, b: str) -> bool:
  """Whether ``a`` is, contains or is inside ``b`` (as :func:`resolve` spells them)."""
  a, b = resolve(a), resolve(b)
  sep = '/' if is_remote(a) else os.sep
  return a == b or a.startswith(b + sep) or b.startswith(a + sep)


def parents(path: str) -> List[str]:
  """:func:`resolve` of ``path`` and each folder above it (up to a bucket), innermost first."""
  if is_remote(path):
    prefix = scheme(path)
    parts = path[len(prefix):].rstrip('/').split('/')
    return [prefix + '/'.join(parts[:n]) for n in range(len(parts), 0, -1)]
  found = [resolve(path)]
  while os.path.dirname(found[-1]) != found[-1]:
    found.append(os.path.dirname(found[-1]))
  return found


def Path(path: Any):  # pylint: disable=invalid-name  (a type's constructor, as epath's)
  """``path`` as an ``etils.epath.Path`` (the type Orbax takes; local paths made absolute)."""
  from etils import epath  # pylint: disable=g-import-not-at-top  (a quarter of a second)
  return epath.Path(absolute(path))


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


def walk(path: str) -> Iterator[Tuple[str, List[str], List[str]]]:
  """``os.walk(path)`` for local and remote paths (``dirs`` pruned in place are not entered)."""
  if not is_remote(path):
    yield from os.walk(path)
    return
  for root, dirs, names in _gfile().walk(path):
    dirs[:] = [d.rstrip('/') for d in dirs]  # The same list: gfile enters what stays in it.
    yield root, dirs, names


def glob(pattern: str) -> List[str]:
  """The paths that match ``pattern`` (``*``, ``?``, ``[...]`` within one name), unsorted."""
  if is_remote(pattern):
    return _gfile().glob(pattern)
  import glob as glob_lib  # pylint: disable=g-import-not-at-top
  return glob_lib.glob(pattern)


def open_file(path: str, mode: str):
  """A file object for ``path`` (``mode`` as for :func:`open`, e.g. ``'rb'``)."""
  return _gfile().GFile(path, mode) if is_remote(path) else open(path, mode)


def makedirs(path: str) -> None:
  """The folder ``path`` and its parents (nothing for what exists); NotADirectoryError naming
  the file that is where a folder should be."""
  if is_remote(path):
    _gfile().makedirs(path)
    return
  try:
    os.makedirs(path, exist_ok=True)
  except (NotADirectoryError, FileExistsError) as e:  # A file where a folder should be.
    blocker = next((p for p in reversed(parents(path)) if os.path.lexists(p) and
                    not os.path.isdir(p)), path)
    raise NotADirectoryError(f'{blocker} is not a directory') from e


def write_bytes(path: str, data: bytes) -> None:
  """Writes ``data`` to the file ``path``, its folders created (not atomic)."""
  path = os.fspath(path)
  makedirs(dirname(path) or '.')
  with open_file(path, 'wb') as f:
    f.write(data)


def remove(path: str) -> None:
  if is_remote(path):
    _gfile().remove(path)
  else:
    os.remove(path)


def copy(source: str, target: str, *, overwrite: bool = False) -> None:
  """Copies the file ``source`` to ``target``; FileExistsError unless ``overwrite``."""
  if is_remote(source) or is_remote(target):
    _gfile().copy(source, target, overwrite=overwrite)
    return
  if not overwrite and os.path.lexists(target):
    raise FileExistsError(errno.EEXIST, 'File exists', target)
  shutil.copyfile(source, target)


def rename(source: str, target: str, *, overwrite: bool = False) -> None:
  """Renames ``source`` to ``target`` (on the same storage; remote: a copy, then a delete)."""
  if is_remote(source) or is_remote(target):
    _gfile().rename(source, target, overwrite=overwrite)
  elif overwrite:
    os.replace(source, target)
  elif os.path.lexists(target):
    raise FileExistsError(errno.EEXIST, 'File exists', target)
  else:
    os.rename(source, target)


def size(path: str) -> int:
  """The size in bytes of a local or remote file (remote: its metadata, nothing read)."""
  return _gfile().stat(path).length if is_remote(path) else os.path.getsize(path)


def mtime(path: str) -> float:
  """When the file ``path`` was last modified, in seconds since the epoch."""
  if is_remote(path):
    return _gfile().stat(path).mtime_nsec / 1e9
  return os.path.getmtime(path)


class NotAFileError(OSError):
  """A path given as a file is a FIFO, socket or device (reading one waits forever)."""


def not_a_file(path: str) -> Optional[str]:
  """What the local ``path`` is when it is no regular file, links followed: e.g. 'a FIFO', 'a
  broken or looping symbolic link'; None for a regular file, nothing there, or a remote path."""
  if is_remote(path):
    return None
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return 'a broken or looping symbolic link' if os.path.islink(path) else None
  if stat.S_ISREG(mode):
    return None
  kinds = ((stat.S_ISFIFO, 'a FIFO'), (stat.S_ISSOCK, 'a socket'),
           (stat.S_ISCHR, 'a device'), (stat.S_ISBLK, 'a device'), (stat.S_ISDIR, 'a directory'))
  return next((kind for test, kind in kinds if test(mode)), 'not a regular file')


def read_bytes(path: str, size: int = -1) -> bytes:  # pylint: disable=redefined-outer-name
  """The first ``size`` bytes of the file at ``path`` (default all). IsADirectoryError or
  :class:`NotAFileError` for a local path that is no regular file, never opened."""
  odd = not_a_file(path)
  if odd and odd != 'a broken or looping symbolic link':  # open() names that one itself.
    error = IsADirectoryError if odd == 'a directory' else NotAFileError
    raise error(f'{path} is {odd}, not a file that can be read: give the path of a regular '
                'file.')
  with open_file(path, 'rb') as f:
    return f.read(size)


def probe(path: Any, size: int, what: str = 'No checkpoint'  # pylint: disable=redefined-outer-name
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
  """``FileNotFoundError(ENOENT, "<what> at '<path>'[: <fix>]")``."""
  message = f'{what} at {path!r}' + (f': {fix}' if fix else '')
  return FileNotFoundError(errno.ENOENT, message, path)


def first_line(error: BaseException) -> str:
  """The first line of ``error``'s message (at most 300 characters), else its type's name."""
  return str(error).splitlines()[0][:300] if str(error) else type(error).__name__


#: A failed write's message when the disk or permissions are the cause (not always an OSError).
_DISK_ERROR = re.compile(r'No space left|RESOURCE_EXHAUSTED|Permission denied|PERMISSION_DENIED|'
                         r'os_error')
#: ... when the storage did not answer: TensorFlow's retries spent (an AbortedError, no OSError),
#: TensorStore's UNAVAILABLE or DEADLINE_EXCEEDED, a refused or timed-out connection.
_UNREACHABLE = re.compile(r'retry attempts failed|UNAVAILABLE|DEADLINE_EXCEEDED|HTTP request|'
                          r'Connection refused|timed out', re.IGNORECASE)


def failure(error: BaseException) -> Optional[Tuple[str, int]]:
  """(the FATAL line's text, the exit status) for ``error`` when the storage answered 'Not
  Found' (2) or did not answer (1: :func:`unreachable`), else None."""
  if re.search(r'response code 404', str(error)):
    return (f"The storage answered 'Not Found' ({first_line(error)}): a bucket or path that the "
            'command names does not exist. Check its gs:// paths (gcloud storage ls gs://BUCKET); '
            'a new bucket: gcloud storage buckets create gs://BUCKET --location=REGION.', 2)
  text = unreachable(error)
  return None if text is None else (text, 1)


def unreachable(error: BaseException) -> Optional[str]:
  """The FATAL line's text for ``error`` when the storage did not answer, else None (also for a
  pod's collectives, whose lost peer reads alike: 'Gloo ... UNAVAILABLE')."""
  if not _UNREACHABLE.search(str(error)) or re.search(r'\bgloo\b', str(error), re.IGNORECASE):
    return None
  return (f'The storage did not answer ({first_line(error)}). Check this machine\'s network and '
          'credentials (gcloud auth application-default login), then rerun the same command.')


def write_failure(error: BaseException) -> Optional[str]:
  """Why a write failed: 'full' (no space), 'denied' (permissions, or another OSError),
  'unreachable' (the storage did not answer), or None (a bug: re-raise it)."""
  text = str(error)
  if _UNREACHABLE.search(text):
    return 'unreachable'
  if getattr(error, 'errno', None) == errno.ENOSPC or re.search('No space left|RESOURCE_EXHAUSTED',
                                                                text):
    return 'full'
  return 'denied' if isinstance(error, OSError) or _DISK_ERROR.search(text) else None


def cause(error: BaseException) -> str:
  """A failed write's cause in words: the OSError's text, or the message's first line."""
  if getattr(error, 'errno', None) == errno.ENOSPC:
    return 'No space left on device'
  return getattr(error, 'strerror', None) or first_line(error)


@contextlib.contextmanager
def os_errors() -> Iterator[None]:
  """TensorFlow's file-system errors raised inside as FileNotFoundError, PermissionError, else
  OSError, each with the first line of TensorFlow's message as its ``strerror``."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  (tf.errors.OpError, imported lazily)
    if not hasattr(e, 'error_code') or not hasattr(e, 'message'):
      raise  # No TensorFlow error (an OSError of a local path passes unchanged).
    kind = type(e).__name__
    text = str(e.message).strip()
    error, code = {'NotFoundError': (FileNotFoundError, errno.ENOENT),
                   'PermissionDeniedError': (PermissionError, errno.EACCES)}.get(
                       kind, (OSError, errno.EIO))
    first_line = text.splitlines()[0] if text else kind
    raise error(code, first_line) from e


def check_bucket(path: str, flag: str = '--workdir') -> None:
  """That the bucket of the remote ``path`` (given as ``flag``) exists and can be written: an
  empty object written and removed. Raises PermissionError naming the fix."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (loaded by gs:// access anyway)
  bucket = '/'.join(path.split('/', 3)[:3])
  probe_file = join(path, f'.write_check.{socket.gethostname()}.{os.getpid()}')
  try:
    with open_file(probe_file, 'wb') as f:
      f.write(b'')
    remove(probe_file)
    return
  except tf.errors.NotFoundError:
    problem = (f'the bucket {bucket} does not exist (or these credentials cannot see it). Create '
               f"it (gcloud storage buckets create {bucket} --location=REGION, the TPUs' region) "
               f'or choose another {flag}.')
  except tf.errors.PermissionDeniedError:
    problem = (f'these credentials cannot write to {bucket} (PermissionDenied). Grant the '
               "machine's service account a role that writes objects (gcloud storage buckets "
               f'add-iam-policy-binding {bucket} --member=serviceAccount:ACCOUNT '
               f'--role=roles/storage.objectUser) or choose another {flag}.')
  except tf.errors.OpError as e:  # E.g. no network: 'Could not resolve host'.
    problem = (f'Cloud Storage did not answer ({first_line(e)}). Check this machine\'s network '
               'and credentials (gcloud auth application-default login), or choose another '
               f'{flag}.')
  raise PermissionError(f'{flag} {path!r} cannot be used: {problem}')
