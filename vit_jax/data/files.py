"""Single image files (local or ``gs://``, through :mod:`vit_jax.storage`; decoded by content)
and arrays, preprocessed as the eval pipeline does (:func:`vit_jax.data.preprocess.eval_image`),
for ``predict``."""

from __future__ import annotations

import os
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from vit_jax import storage
from vit_jax.data import preprocess
from vit_jax.data import bad_images

#: File name endings (lower case) that `list_images` takes for images.
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.gif', '.webp')


def walk(folder: str, skipped_links: Optional[list] = None
         ) -> Iterator[Tuple[str, List[str], List[str]]]:
  """``os.walk(folder, followlinks=True)`` (sorted, hidden names left out) that never enters a
  directory twice: a link to a directory inside ``folder`` is not followed (added to
  ``skipped_links``), one out of it once. Remote paths: :func:`vit_jax.storage.walk`."""
  folder = str(folder)
  if storage.is_remote(folder):
    for root, dirs, names in storage.walk(folder):
      dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
      yield root, dirs, names
    return
  try:
    info = os.stat(folder)
  except OSError:
    return
  seen = {(info.st_dev, info.st_ino)}
  inside = os.path.join(os.path.realpath(folder), '')
  for root, dirs, names in os.walk(folder, followlinks=True):
    kept = []
    for d in sorted(d for d in dirs if not d.startswith('.')):
      path = os.path.join(root, d)
      try:
        info = os.stat(path)
      except OSError:
        continue
      if (info.st_dev, info.st_ino) in seen or (
          os.path.islink(path) and os.path.join(os.path.realpath(path), '').startswith(inside)):
        if skipped_links is not None:
          skipped_links.append(path)
        continue
      seen.add((info.st_dev, info.st_ino))
      kept.append(d)
    dirs[:] = kept
    yield root, dirs, names


def list_images(folder: str, recursive: bool = True,
                skipped_links: Optional[list] = None) -> List[str]:
  """The image files in ``folder`` (and subfolders if ``recursive``, as :func:`walk`), sorted.
  Raises FileNotFoundError (not a directory) or ValueError (a non-UTF-8 file name)."""
  folder = str(folder)
  if not storage.isdir(folder):
    raise FileNotFoundError(f'{folder} is not a directory.')
  found = []
  for root, _, names in walk(folder, skipped_links):
    for n in names:
      if not n.startswith('.') and n.lower().endswith(IMAGE_EXTENSIONS):
        if any('\ud800' <= c <= '\udfff' for c in root + n):  # Not UTF-8: lone surrogates.
          raise bad_images.non_utf8_name_error(storage.join(root, n))
        found.append(storage.join(root, n))
    if not recursive:
      break
  return sorted(found)


def read_bytes(path: str) -> bytes:
  """The bytes of the image file ``path`` (:func:`vit_jax.storage.read_bytes`); each error names
  it: FileNotFoundError, IsADirectoryError, PermissionError, OSError (also for a local FIFO,
  socket or device, never opened: :func:`vit_jax.storage.not_a_file`)."""
  path = str(path)
  odd = storage.not_a_file(path)  # A FIFO's read waits forever.
  if odd and odd != 'a broken or looping symbolic link':
    error = IsADirectoryError if odd == 'a directory' else OSError
    raise error(f'{path} is {odd}, not an image file.')
  try:
    with storage.os_errors():
      is_dir = storage.is_remote(path) and storage.isdir(path)  # Local ones: `odd` above.
      data = b'' if is_dir else storage.read_bytes(path)
  except FileNotFoundError as e:
    raise FileNotFoundError(f'{path} does not exist.') from e
  except PermissionError as e:
    raise PermissionError(f'{path} cannot be read (permission denied).') from e
  except OSError as e:  # E.g. a link to itself: 'Too many levels of symbolic links'.
    reason = (e.strerror or str(e)).replace(f'{path}; ', '')
    raise OSError(f'{path} cannot be read: {reason}') from e
  if is_dir:
    raise IsADirectoryError(f'{path} is a directory, not an image file.')
  return data


def eval_input(image: Any, *, size: int, normalization: Optional[str],
               crop_pct: Optional[float] = None, name: Optional[str] = None) -> np.ndarray:
  """One image as the model's eval input, float32 ``[size, size, 3]``.

  ``image``: a path, encoded bytes, a PIL image or an array ``[H, W(, C)]`` (C in {1, 3, 4};
  uint8 or floats in [0, 1]); ``name``: how errors name it.

  Raises:
    BadImageError (a ValueError): not a decodable image. ValueError: an array of another shape.
    FileNotFoundError, IsADirectoryError, PermissionError: not a readable file.
  """
  kwargs = dict(size=int(size), normalization=normalization, crop_pct=crop_pct)
  if isinstance(image, (str, os.PathLike)):
    name = name or os.fspath(image)
    image = read_bytes(os.fspath(image))
  if isinstance(image, bytes):
    name = name or 'the image'
    try:
      return preprocess.eval_image(tf.constant(image), encoded=True, **kwargs).numpy()
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
      raise bad_images.BadImageError(
          f'{name} is not a decodable image: {bad_images.tf_message(e)}', paths=[name]) from e
  array = _as_array(image, name or 'the image')
  return preprocess.eval_image(tf.convert_to_tensor(array), encoded=False, **kwargs).numpy()


def _as_array(image: Any, name: str) -> np.ndarray:
  """A PIL image or array -> an array ``[H, W, C]``, C in {1, 3, 4}."""
  if hasattr(image, 'mode') and hasattr(image, 'convert'):  # A PIL image (PIL is optional).
    if image.mode not in ('L', 'RGB', 'RGBA'):
      alpha = 'A' in image.mode or 'transparency' in image.info
      image = image.convert('RGBA' if alpha else 'RGB')
    image = np.asarray(image)
  array = image.numpy() if isinstance(image, tf.Tensor) else np.asarray(image)
  if array.ndim == 2:
    array = array[..., None]
  if array.ndim != 3 or array.shape[-1] not in (1, 3, 4) or 0 in array.shape:
    raise ValueError(f'{name}: an array of shape {array.shape}; an image is [H, W] or '
                     '[H, W, C] with C = 1, 3 or 4 (uint8, or floats in [0, 1]).')
  if array.dtype == bool or not (np.issubdtype(array.dtype, np.integer)
                                 or np.issubdtype(array.dtype, np.floating)):
    raise ValueError(f'{name}: an array of dtype {array.dtype}; give uint8 pixels (or floats '
                     'in [0, 1]).')
  return array
