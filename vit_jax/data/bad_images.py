"""Bad image files (``config.data.bad_images``): undecodable ones found
(:func:`find_undecodable`), named in a :class:`BadImageError` ('fail') or left out with one
warning ('skip'); an image folder's entries that are no regular file; file names that are not
UTF-8."""

from __future__ import annotations

import functools
import os
import re
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import logging
import numpy as np
import tensorflow as tf

from vit_jax import storage

#: Bad files named in a `BadImageError` message / the 'skip' warning.
MAX_NAMED_FILES = 8
# TensorFlow errors from decoding an image (node / op names, the decoders' messages).
_DECODE_ERROR_RE = re.compile(r'decode|jpeg|png|gif|bmp|webp|image file format|input is empty',
                              re.IGNORECASE)


class BadImageError(ValueError):
  """Images cannot be decoded (``bad_images='fail'``); the message names the files and the fix.
  Attributes: ``paths`` (the split's undecodable files; [] for tfds), ``dataset``, ``split``."""

  def __init__(self, message: str, *, paths: Sequence[str] = (), dataset: str = '',
               split: str = ''):
    super().__init__(message)
    self.paths = list(paths)
    self.dataset = dataset
    self.split = split


def tf_message(error: Exception) -> str:
  """The first line of a TensorFlow error, without its function prefix and op name."""
  text = (getattr(error, 'message', None) or str(error)).strip()
  text = re.sub(r'^\{\{function_node [^}]*\}\}\s*', '', text)
  text = re.sub(r'^Error in user-defined function passed to \S+ transformation '
                r'with iterator: \S+: ', '', text)
  text = text.splitlines()[0] if text else ''
  return re.sub(r'\s*\[Op:\w+\]( name:.*)?$', '', text).strip() or type(error).__name__


def _name_files(paths: Sequence[str], root: Optional[str] = None, sep: str = '\n  ') -> str:
  """The first MAX_NAMED_FILES paths (relative to `root`), '... and N more'."""
  shown = [os.path.relpath(p, root) if root else p for p in paths[:MAX_NAMED_FILES]]
  more = len(paths) - len(shown)
  if more:
    shown.append(f'... and {more} more')
  return sep.join(shown)


def _decode_check(contents: tf.Tensor) -> tf.Tensor:
  """int32 ``[2]`` (H, W) of image bytes decoded as the pipelines do (and the fused crop's JPEG
  header parse); raises inside tf.data when either fails."""
  image = tf.io.decode_image(contents, channels=3, expand_animations=False)
  hw = tf.shape(image)[:2]
  jpeg_hw = tf.cond(tf.io.is_jpeg(contents), lambda: tf.image.extract_jpeg_shape(contents)[:2],
                    lambda: hw)
  return tf.minimum(hw, jpeg_hw)


def find_undecodable(paths: Sequence[str]) -> List[str]:
  """The files among ``paths`` (local or ``gs://``) that cannot be read and decoded, in order."""
  paths = list(paths)
  ds = tf.data.Dataset.from_tensor_slices(
      (tf.range(len(paths), dtype=tf.int64), tf.constant(paths, tf.string)))
  ds = ds.map(lambda i, p: (i, _decode_check(tf.io.read_file(p))),
              num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
  ds = ds.ignore_errors().map(lambda i, _: i).batch(4096)
  ok = np.zeros(len(paths), bool)
  for ids in ds.as_numpy_iterator():
    ok[ids] = True
  return [p for p, good in zip(paths, ok) if not good]


def decoding_error(error: Exception, dataset: str, split: str, mode: str,
                   folder_paths: Optional[Sequence[str]] = None) -> Optional[BadImageError]:
  """``error`` (a ``tf.errors.OpError`` reading ``split`` of ``dataset``) as a ``BadImageError``
  naming the fix, or None if not a decoding one; an image folder's (its split's
  ``folder_paths``) names the undecodable files (None if :func:`find_undecodable` finds none)."""
  if not _DECODE_ERROR_RE.search(str(error)):
    return None
  message = tf_message(error)
  if folder_paths is None:
    return BadImageError(
        f'An image of split {split!r} of dataset {dataset!r} cannot be decoded '
        f'(TensorFlow: {message}). tfds records have no file name: rebuild the dataset without '
        'it, or set --config.data.bad_images=skip to skip undecodable images.',
        dataset=dataset, split=split)
  logging.warning('Decoding an image of split %r of %s failed (%s); looking for the '
                  'undecodable files among its %d images.', split, dataset, message,
                  len(folder_paths))
  bad = find_undecodable(folder_paths)
  if not bad:
    return None
  note = (' They could be decoded when the folder was validated: did they change since?'
          if mode == 'skip' else '')
  return BadImageError(
      f'{len(bad)} of {len(folder_paths)} images of split {split!r} of image folder {dataset} '
      f'cannot be decoded (corrupt, truncated, empty or not an image):\n  {_name_files(bad)}\n'
      f'Remove or replace them, or set --config.data.bad_images=skip to skip undecodable '
      f'images.{note} (TensorFlow: {message})', paths=bad, dataset=dataset, split=split)


def non_utf8_name_error(path: Any) -> ValueError:
  """The ValueError for a file name that is not UTF-8 (TensorFlow cannot open it), with the fix."""
  raw = path if isinstance(path, bytes) else os.fsencode(path)
  return ValueError(f'The file name {raw!r} is not UTF-8, which TensorFlow cannot open: rename '
                    'it (e.g. convmv -f latin1 -t utf8 --notest <file>) or move it away.')


def first_non_utf8_path(folder: str) -> Optional[bytes]:
  """The first path (bytes) under a local ``folder`` whose name is not UTF-8, else None."""
  for root, dirs, names in os.walk(os.fsencode(folder)):
    for name in sorted(dirs + names):
      try:
        name.decode('utf-8')
      except UnicodeDecodeError:
        return os.path.join(root, name)
  return None


def non_utf8_folder_error(root: str) -> ValueError:
  """The ValueError for an image folder holding a name that is not UTF-8 (named if local)."""
  raw = None if storage.is_remote(root) else first_non_utf8_path(root)
  if raw is None:
    return ValueError(f'A file name under {root} is not UTF-8, which TensorFlow cannot open: '
                      'rename it.')
  return non_utf8_name_error(raw)


def _not_files(paths: Sequence[str]) -> Dict[str, str]:
  """The local `paths` that are no regular file (`storage.not_a_file`), in order, with what each
  is; one directory listing per folder (a stat per link and odd entry only)."""
  odd = set()
  for folder in dict.fromkeys(os.path.dirname(p) for p in paths):
    try:
      with os.scandir(folder or '.') as entries:
        odd.update(e.path for e in entries if not e.is_file(follow_symlinks=False))
    except OSError:
      continue
  kinds = {p: storage.not_a_file(p) for p in paths if p in odd}
  return {p: kind for p, kind in kinds.items() if kind}


@functools.lru_cache(maxsize=None)  # 'skip' validates a folder once per process.
def _undecodable(root: str, paths: Tuple[str, ...]) -> Tuple[str, ...]:
  """The undecodable files among an image folder's ``paths`` (validated once, one warning)."""
  logging.info("Validating the %d images under %s (data.bad_images='skip')...", len(paths), root)
  start = time.perf_counter()
  bad = tuple(find_undecodable(paths))
  seconds = time.perf_counter() - start
  logging.info('Validated %d images in %.1f s (%.0f images/s).', len(paths), seconds,
               len(paths) / max(seconds, 1e-9))
  if bad:
    logging.warning("Skipping %d of %d images that cannot be decoded (data.bad_images='skip') "
                    'under %s: %s', len(bad), len(paths), root, _name_files(bad, root, sep=', '))
  return bad


def folder_skips(root: str, paths: Sequence[str], mode: str) -> Tuple[str, ...]:
  """The image folder's ``paths`` to leave out in ``mode`` ('fail' or 'skip'): the local entries
  that are no regular file (FileNotFoundError naming them and the fix in 'fail' mode), then in
  'skip' mode the undecodable files."""
  odd = {} if storage.is_remote(root) else _not_files(paths)
  named = _name_files([f'{os.path.relpath(p, root)} ({kind})' for p, kind in odd.items()],
                      sep=', ')
  if odd and mode != 'skip':
    raise FileNotFoundError(
        f'{len(odd)} image file(s) of image folder {root} are not files that can be read '
        f'(reading a FIFO or a device waits forever): {named}. Remove them or replace them '
        'with images, or set --config.data.bad_images=skip to skip them.')
  if odd:
    logging.warning("Skipping %d image file(s) of image folder %s that are not files that can "
                    "be read (data.bad_images='skip'): %s", len(odd), root, named)
  skipped = tuple(odd)
  if mode == 'skip':  # The others, left out when they cannot be decoded.
    skipped += _undecodable(root, tuple(p for p in paths if p not in odd))
  return skipped
