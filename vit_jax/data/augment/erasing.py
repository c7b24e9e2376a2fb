"""Random erasing as T2T-ViT and DeiT train with it: timm's `RandomErasing(mode='pixel')`."""

from __future__ import annotations

import math

import tensorflow as tf

from vit_jax.data.augment import stateless


@stateless.no_autograph
def random_erasing(image: tf.Tensor, seed: tf.Tensor, *,
                   probability: float = 0.25, min_area: float = 0.02,
                   max_area: float = 1 / 3, min_aspect: float = 0.3,
                   max_count: int = 1) -> tf.Tensor:
  """timm ``RandomErasing(mode='pixel')`` of one normalized float ``[H, W, C]`` image (same out).

  With probability ``probability`` erase ``count`` rectangles (1, or uniform in [1, max_count]),
  each with up to 10 attempts as timm (area uniform in [min_area, max_area] * H * W / count,
  log-uniform aspect, Python rounding); erased pixels get N(0, 1). ``seed``: int64 ``[2]``.

  Raises:
    ValueError: probability outside [0, 1], not 0 < min_area <= max_area, min_aspect <= 0 or
      max_count < 1.
  """
  if not 0. <= probability <= 1.:
    raise ValueError(f'probability must be in [0, 1], got {probability!r}.')
  if not 0. < min_area <= max_area:
    raise ValueError('Need 0 < min_area <= max_area, got '
                     f'{min_area!r}, {max_area!r}.')
  if not min_aspect > 0.:
    raise ValueError(f'min_aspect must be > 0, got {min_aspect!r}.')
  if not isinstance(max_count, int) or max_count < 1:
    raise ValueError(f'max_count must be an int >= 1, got {max_count!r}.')
  image = tf.convert_to_tensor(image)
  if not image.dtype.is_floating:
    raise ValueError('random_erasing expects a float (normalized) image, got '
                     f'{image.dtype.name}.')
  prob_seed, count_seed, boxes_seed = stateless.split(seed, 3)
  log_aspect = (math.log(min_aspect), math.log(1. / min_aspect))

  def erase():
    shape = tf.shape(image)
    height, width = shape[0], shape[1]
    area = tf.cast(height * width, tf.float64)
    if max_count > 1:
      count = stateless.randint(count_seed, 1, max_count + 1)
    else:
      count = tf.constant(1, tf.int32)
    rows = tf.range(height)[:, None]
    cols = tf.range(width)[None, :]
    out = image
    for k, box_seed in enumerate(stateless.split(boxes_seed, max_count)):
      area_seed, aspect_seed, top_seed, left_seed, noise_seed = stateless.split(
          box_seed, 5)
      target = tf.random.stateless_uniform(
          [10], area_seed, min_area, max_area, tf.float64) * area / tf.cast(
              count, tf.float64)
      aspect = tf.exp(tf.random.stateless_uniform(
          [10], aspect_seed, log_aspect[0], log_aspect[1], tf.float64))
      hs = tf.cast(tf.round(tf.sqrt(target * aspect)), tf.int32)
      ws = tf.cast(tf.round(tf.sqrt(target / aspect)), tf.int32)
      fits = (hs < height) & (ws < width)
      first = tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32)
      found = tf.reduce_any(fits) & (k < count)
      h = tf.where(found, hs[first], 0)
      w = tf.where(found, ws[first], 0)
      top = stateless.randint(top_seed, 0, height - h + 1)
      left = stateless.randint(left_seed, 0, width - w + 1)
      box = ((rows >= top) & (rows < top + h) & (cols >= left) &
             (cols < left + w))
      noise = tf.random.stateless_normal(shape, noise_seed, dtype=image.dtype)
      out = tf.where(box[..., None], noise, out)
    return out

  out = tf.cond(stateless.uniform(prob_seed) < probability, erase, lambda: image)
  out.set_shape(image.shape)
  return out
