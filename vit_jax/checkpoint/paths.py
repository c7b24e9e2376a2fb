"""File access for reading checkpoints: local paths with ``os``, ``scheme://`` paths with gfile.

Any path containing ``://`` (``gs://bucket/x.npz``) goes through ``tf.io.gfile``; TensorFlow is
imported only for such paths. Orbax reads and writes remote directories itself (through
``etils.epath``), so this module serves the ``.npz`` and PyTorch readers and the detection of a
path's format.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
from typing import Any, List, Optional, Tuple


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


def probe(path: Any, size: int) -> Tuple[str, bool, bytes]:
  """``(path normalized, is a directory, a file's first size bytes or b'')``.

  Raises:
    FileNotFoundError: nothing exists at ``path`` (:func:`not_found`).
  """
  path = normalize(path)
  if not exists(path):
    raise not_found(path)
  if isdir(path):
    return path, True, b''
  return path, False, read_head(path, size)


def not_found(path: str, what: str = 'No checkpoint', fix: str = '') -> FileNotFoundError:
  """The error for a missing ``path``: ``FileNotFoundError(ENOENT, "<what> at '<path>'")``,
  then ``: <fix>`` when given."""
  return FileNotFoundError(errno.ENOENT, f'{what} at {path!r}' + (f': {fix}' if fix else ''),
                           path)


def nothing_saved_yet(checkpoints_dir: str, config_json: Optional[str]) -> str:
  """What to do about a run's ``checkpoints`` directory without a finalized step: whether a
  save is being written (Orbax's ``<step>.orbax-checkpoint-tmp-*``), when the first save comes
  (``checkpoint_every_steps`` of ``config_json``, the run's ``config.json``, when readable)."""
  names = listdir(checkpoints_dir) if isdir(checkpoints_dir) else []
  writing = sorted(int(n.split('.')[0]) for n in names
                   if '.orbax-checkpoint-tmp' in n and n.split('.')[0].isdigit())
  every = None
  if config_json and exists(config_json):
    try:
      every = json.loads(read_bytes(config_json)).get('checkpoint_every_steps')
    except (ValueError, AttributeError, OSError):
      every = None
  state = (f'the save of step {writing[-1]} is being written (or was cut off; the next start '
           'of the run removes it)' if writing else 'the run has saved no checkpoint yet')
  first = (f' (it saves every {every} steps, checkpoint_every_steps in its config.json, and at '
           'its end)' if isinstance(every, int) and not writing else '')
  workdir = posixpath.dirname(checkpoints_dir.rstrip('/')) or '.'
  return (f'{state}. Wait for its first checkpoint{first}, or train it first (python -m '
          f'vit_jax.main --config ... --workdir {workdir}); then give the workdir again, or one '
          'step directory <workdir>/checkpoints/<step>.')
