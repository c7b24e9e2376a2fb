"""Per-example preprocessing (TensorFlow ops) as the official vit_jax ``input_pipeline``: an
Inception crop (area in [min_area, 1], aspect in [3/4, 4/3]) or a random shift, bilinear resize,
random flip; eval a resize; pixels to [-1, 1] or ImageNet mean/std. Randomness is stateless."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import tensorflow as tf

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def to_rgb(image: tf.Tensor) -> tf.Tensor:
  """[H, W, C] image tensor with C in {1, 3, 4} -> [H, W, 3] (gray tiled, alpha dropped)."""
  channels = image.shape[-1]
  if channels == 3:
    return image
  if channels == 1:
    return tf.image.grayscale_to_rgb(image)
  if channels == 4:
    return image[..., :3]
  if channels is None:  # Unknown statically: handle 1/3/4 dynamically.
    c = tf.shape(image)[-1]
    image = tf.cond(c == 1, lambda: tf.tile(image, [1, 1, 3]), lambda: image[..., :3])
    return tf.ensure_shape(image, [None, None, 3])
  raise ValueError(f'Images must have 1, 3 or 4 channels, got {channels}.')


def decode_rgb(image: tf.Tensor, encoded: bool) -> tf.Tensor:
  """uint8 ``[H, W, 3]`` from encoded bytes (if ``encoded``; recognised by content; else
  ``InvalidArgumentError``) or an ``[H, W, C]`` tensor (C in {1, 3, 4}, floats in [0, 1])."""
  if encoded:
    img = tf.io.decode_image(image, channels=3, expand_animations=False)
    return tf.ensure_shape(img, [None, None, 3])
  if image.dtype != tf.uint8:
    image = tf.image.convert_image_dtype(image, tf.uint8, saturate=True)
  return to_rgb(image)


def _crop_window(shape: tf.Tensor, seed: tf.Tensor, min_area: float) -> tf.Tensor:
  """Inception crop window [y, x, h, w] for an image of `shape` [H, W, C]."""
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, bounding_boxes=tf.zeros([1, 0, 4], tf.float32), seed=seed, min_object_covered=0.0,
      aspect_ratio_range=(3. / 4., 4. / 3.), area_range=(min_area, 1.0), max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  return tf.stack([begin[0], begin[1], size[0], size[1]])


def inception_crop(image: tf.Tensor, encoded: bool, seed: tf.Tensor, min_area: float) -> tf.Tensor:
  """Inception-style random crop (``seed`` ``[2]``, ``min_area`` in (0, 1]), uint8 ``[h, w, 3]``,
  fused with JPEG decoding."""

  def crop():
    img = decode_rgb(image, encoded)
    w = _crop_window(tf.shape(img), seed, min_area)
    return img[w[0]:w[0] + w[2], w[1]:w[1] + w[3]]

  def jpeg():
    w = _crop_window(tf.image.extract_jpeg_shape(image), seed, min_area)
    return tf.image.decode_and_crop_jpeg(image, w, channels=3)

  if not encoded:
    return crop()
  return tf.ensure_shape(tf.cond(tf.io.is_jpeg(image), jpeg, crop), [None, None, 3])


def resize(image: tf.Tensor, size: int) -> tf.Tensor:
  """Bilinear resize of ``[(B,) H, W, 3]`` to float32 ``[(B,) size, size, 3]`` in [0, 255]."""
  if tuple(image.shape[-3:-1]) == (size, size):
    return tf.cast(image, tf.float32)
  image = tf.image.resize(image, [size, size], method='bilinear')
  return tf.clip_by_value(image, 0., 255.)


def normalize(image: tf.Tensor, normalization: str) -> tf.Tensor:
  """Pixels in [0, 255] to model inputs: 'minus_one_to_one' ``x / 127.5 - 1`` (ViT) or 'imagenet'
  ``(x / 255 - mean) / std`` (T2T-ViT); ValueError for another name."""
  if normalization == 'minus_one_to_one':
    return image / 127.5 - 1.
  if normalization == 'imagenet':
    image = tf.convert_to_tensor(image)
    # Full-size constants where the shape is known: TF broadcasts [3] slowly.
    shape = image.shape[-3:] if image.shape[-3:].is_fully_defined() else [3]
    mean = tf.constant(np.broadcast_to(np.float32(IMAGENET_MEAN), shape))
    std = tf.constant(np.broadcast_to(np.float32(IMAGENET_STD), shape))
    return (image / 255. - mean) / std
  raise ValueError(f'Unknown config.data.normalization={normalization!r}; '
                   "use 'minus_one_to_one' or 'imagenet'.")


def pad_crop(images: tf.Tensor, seed: tf.Tensor, pixels: int) -> tf.Tensor:
  """Random shift of ``[(B,) H, W, C]`` by up to ``pixels`` per axis (torchvision's
  ``RandomCrop(size, padding=pixels)``), per image."""
  single = images.shape.rank == 3
  if single:
    images = images[None]
  shape = tf.shape(images)
  padded = tf.pad(images, [[0, 0], [pixels, pixels], [pixels, pixels], [0, 0]])
  offsets = tf.random.stateless_uniform([shape[0], 2], seed, minval=0, maxval=2 * pixels + 1,
                                        dtype=tf.int32)
  rows = offsets[:, :1] + tf.range(shape[1])[None]  # [B, H] row indices into the padding.
  cols = offsets[:, 1:] + tf.range(shape[2])[None]
  out = tf.gather(tf.gather(padded, rows, axis=1, batch_dims=1), cols, axis=2, batch_dims=1)
  return out[0] if single else out


def train_image(image: tf.Tensor, *, encoded: bool,
                seed: Optional[tf.Tensor], size: int, augment: str,
                min_area: float, normalization: Optional[str], pad_pixels: int = 4) -> tf.Tensor:
  """One training image decoded and augmented (``seed`` int64 ``[2]``, None for 'none') ->
  float32 ``[size, size, 3]`` (in [0, 255] with ``normalization=None``); ValueError: bad names."""
  if augment not in ('inception_crop', 'pad_crop', 'flip', 'none'):
    raise ValueError(f'Unknown config.data.augment={augment!r}; use '
                     "'inception_crop', 'pad_crop', 'flip' or 'none'.")
  if augment != 'none':
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  if augment == 'inception_crop':
    image = inception_crop(image, encoded, crop_seed, min_area)
  else:
    image = decode_rgb(image, encoded)
  if augment == 'pad_crop':
    image = pad_crop(image, crop_seed, pad_pixels)
  image = resize(image, size)
  if augment != 'none':
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
  return image if normalization is None else normalize(image, normalization)


def resize_and_center_crop(image: tf.Tensor, size: int, crop_pct: Optional[float]) -> tf.Tensor:
  """timm's eval transform, ``[(B,) H, W, 3]`` -> float32 ``[(B,) size, size, 3]`` in [0, 255]:
  the shorter side to ``floor(size / crop_pct)`` (bicubic), the central crop (torchvision's
  rounding); ``crop_pct=None``: :func:`resize` (official ViT). ValueError: ``crop_pct`` not in
  (0, 1]."""
  if crop_pct is None:
    return resize(image, size)
  if not 0. < crop_pct <= 1.:
    raise ValueError(f'config.data.eval_crop_pct={crop_pct} must be in (0, 1].')
  scale = math.floor(size / crop_pct)
  shape = tf.shape(image)
  h, w = tf.cast(shape[-3], tf.float64), tf.cast(shape[-2], tf.float64)
  short = tf.minimum(h, w)
  scale_t = tf.constant(scale, tf.float64)
  new_h = tf.cast(tf.where(h <= w, scale_t, tf.floor(scale_t * h / short)), tf.int32)
  new_w = tf.cast(tf.where(w < h, scale_t, tf.floor(scale_t * w / short)), tf.int32)
  image = tf.image.resize(tf.cast(image, tf.float32), tf.stack([new_h, new_w]),
                          method='bicubic', antialias=True)
  top = tf.cast(tf.round((new_h - size) / 2), tf.int32)
  left = tf.cast(tf.round((new_w - size) / 2), tf.int32)
  image = tf.clip_by_value(image[..., top:top + size, left:left + size, :], 0., 255.)
  return tf.ensure_shape(image, image.shape[:-3].concatenate([size, size, 3]))


def eval_image(image: tf.Tensor, *, encoded: bool, size: int, normalization: Optional[str],
               crop_pct: Optional[float] = None) -> tf.Tensor:
  """One eval image -> float32 ``[size, size, 3]`` (:func:`resize_and_center_crop`);
  ``normalization=None``: in [0, 255]."""
  image = resize_and_center_crop(decode_rgb(image, encoded), size, crop_pct)
  return image if normalization is None else normalize(image, normalization)


def targets(label: tf.Tensor, num_classes: int, multi_label: bool) -> tf.Tensor:
  """float32 ``[num_classes]`` one-hot (int label) or multi-hot (int ``[n]``; empty: zeros)."""
  hot = tf.one_hot(tf.cast(label, tf.int32), num_classes, dtype=tf.float32)
  return tf.minimum(tf.reduce_sum(hot, 0), 1.) if multi_label else hot


def fold_in(key: tf.Tensor, data) -> tf.Tensor:
  """New int64 ``[2]`` key from ``key`` and an integer; both halves random (unlike tf's fold_in)."""
  folded = tf.random.experimental.stateless_fold_in(key, data)
  return tf.random.stateless_uniform([2], seed=folded, minval=None, maxval=None, dtype=tf.int64)
