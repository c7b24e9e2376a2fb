"""The per-batch augmentations of T2T-ViT and DeiT, after normalization."""

from __future__ import annotations

import math

import tensorflow as tf

from vit_jax.data.augment import stateless


def _beta(seed: tf.Tensor, alpha: tf.Tensor) -> tf.Tensor:
  """Beta(alpha, alpha) float64 scalar from two stateless Gamma(alpha) draws."""
  seed_a, seed_b = stateless.split(seed, 2)
  a = tf.random.stateless_gamma([], seed_a, alpha, dtype=tf.float64)
  b = tf.random.stateless_gamma([], seed_b, alpha, dtype=tf.float64)
  total = a + b
  # Both can underflow to 0 only for tiny alpha, where Beta is ~Bernoulli.
  return tf.where(total > 0., a / tf.where(total > 0., total, 1.), tf.cast(a >= b, tf.float64))


@stateless.no_autograph
def mixup_cutmix(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor, *,
                 mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0,
                 switch_prob: float = 0.5, prob: float = 1.0, return_lam: bool = False):
  """timm ``Mixup(mode='batch', correct_lam=True)`` of images ``[B, H, W, C]``, labels ``[B, K]``.

  With probability ``prob`` mix the batch (else lam = 1): CutMix with probability ``switch_prob``
  when both alphas are > 0, else the one that is; lam ~ Beta(alpha, alpha); example i's partner is
  B - 1 - i. CutMix boxes as timm's ``rand_bbox``, lam corrected to ``1 - box_area / (H * W)``;
  labels mixed by lam (linear: it commutes with smoothing and normalization; for timm's uint8
  ``FastCollateMixup``, mix [0, 255] floats and round). ``seed``: int64 ``[2]``. Returns
  ``(images, labels)`` (plus lam, float32, with ``return_lam``), dtypes and shapes kept.
  ValueError: a negative alpha, both alphas 0, or switch_prob / prob outside [0, 1].
  """
  if mixup_alpha < 0 or cutmix_alpha < 0:
    raise ValueError('mixup_alpha and cutmix_alpha must be >= 0, got '
                     f'{mixup_alpha!r}, {cutmix_alpha!r}.')
  if mixup_alpha == 0 and cutmix_alpha == 0:
    raise ValueError('One of mixup_alpha, cutmix_alpha must be > 0 (to '
                     'disable mixing, use prob=0 or do not call this).')
  for arg_name, value in (('switch_prob', switch_prob), ('prob', prob)):
    if not 0. <= value <= 1.:
      raise ValueError(f'{arg_name} must be in [0, 1], got {value!r}.')
  images = tf.convert_to_tensor(images)
  labels = tf.convert_to_tensor(labels)
  apply_seed, switch_seed, lam_seed, cy_seed, cx_seed = stateless.split(seed, 5)

  do_mix = stateless.uniform(apply_seed) < prob
  if mixup_alpha > 0 and cutmix_alpha > 0:
    use_cutmix = stateless.uniform(switch_seed) < switch_prob
  else:
    use_cutmix = tf.constant(cutmix_alpha > 0)
  alpha = tf.where(use_cutmix, tf.constant(float(cutmix_alpha), tf.float64),
                   tf.constant(float(mixup_alpha), tf.float64))
  # A disabled method's alpha is 0; it is never selected (avoid Gamma(0)).
  lam = tf.where(do_mix, _beta(lam_seed, tf.maximum(alpha, 1e-12)), tf.constant(1., tf.float64))
  reversed_images = tf.reverse(images, [0])  # (images[::-1] is 10x slower on CPU.)

  def cutmix():
    height, width = tf.unstack(tf.shape(images)[1:3])
    ratio = tf.sqrt(1. - lam)
    cut_h = tf.cast(tf.floor(tf.cast(height, tf.float64) * ratio), tf.int32)
    cut_w = tf.cast(tf.floor(tf.cast(width, tf.float64) * ratio), tf.int32)
    cy = stateless.randint(cy_seed, 0, height)
    cx = stateless.randint(cx_seed, 0, width)
    y0 = tf.clip_by_value(cy - cut_h // 2, 0, height)
    y1 = tf.clip_by_value(cy + cut_h // 2, 0, height)
    x0 = tf.clip_by_value(cx - cut_w // 2, 0, width)
    x1 = tf.clip_by_value(cx + cut_w // 2, 0, width)
    # The box pasted by slices (TF's `where` and broadcasts are slow on CPU).
    middle = tf.concat([images[:, y0:y1, :x0], reversed_images[:, y0:y1, x0:x1],
                        images[:, y0:y1, x1:]], axis=2)
    mixed = tf.concat([images[:, :y0], middle, images[:, y1:]], axis=1)
    box_area = tf.cast((y1 - y0) * (x1 - x0), tf.float64)
    return mixed, 1. - box_area / tf.cast(height * width, tf.float64)

  def mixup():
    lam_x = tf.cast(lam, images.dtype)
    return (images * lam_x + reversed_images * tf.cast(1. - lam, images.dtype), lam)

  mixed, lam = tf.cond(do_mix & use_cutmix, cutmix, mixup)
  mixed.set_shape(images.shape)
  lam_y = tf.cast(lam, labels.dtype)
  mixed_labels = labels * lam_y + tf.reverse(labels, [0]) * tf.cast(1. - lam, labels.dtype)
  if return_lam:
    return mixed, mixed_labels, tf.cast(lam, tf.float32)
  return mixed, mixed_labels


@stateless.no_autograph
def random_erasing(image: tf.Tensor, seed: tf.Tensor, *,
                   probability: float = 0.25, min_area: float = 0.02,
                   max_area: float = 1 / 3, min_aspect: float = 0.3,
                   max_count: int = 1) -> tf.Tensor:
  """timm ``RandomErasing(mode='pixel')`` of one normalized float ``[H, W, C]`` image (same out):
  with probability ``probability`` ``count`` rectangles (1, or uniform in [1, max_count]), each
  with up to 10 attempts as timm (area uniform in [min_area, max_area] * H * W / count,
  log-uniform aspect, Python rounding), get N(0, 1) noise. ``seed``: int64 ``[2]``. ValueError:
  probability outside [0, 1], not 0 < min_area <= max_area, min_aspect <= 0, max_count < 1."""
  if not 0. <= probability <= 1.:
    raise ValueError(f'probability must be in [0, 1], got {probability!r}.')
  if not 0. < min_area <= max_area:
    raise ValueError(f'Need 0 < min_area <= max_area, got {min_area!r}, {max_area!r}.')
  if not min_aspect > 0.:
    raise ValueError(f'min_aspect must be > 0, got {min_aspect!r}.')
  if not isinstance(max_count, int) or max_count < 1:
    raise ValueError(f'max_count must be an int >= 1, got {max_count!r}.')
  image = tf.convert_to_tensor(image)
  if not image.dtype.is_floating:
    raise ValueError(f'random_erasing expects a float (normalized) image, got {image.dtype.name}.')
  # All the decisions from one draw: [erase?, count, per box 10 areas, 10 aspects, top, left].
  draws = tf.random.stateless_uniform([2 + 22 * max_count], seed, dtype=tf.float64)
  out = tf.cond(draws[0] < probability,
                lambda: _erase(image, seed, draws, float(min_area), float(max_area),
                               float(min_aspect), max_count),
                lambda: image)
  out.set_shape(image.shape)
  return out


@stateless.branch_function
def _erase(image: tf.Tensor, seed: tf.Tensor, draws: tf.Tensor, min_area: float, max_area: float,
           min_aspect: float, max_count: int) -> tf.Tensor:
  """`random_erasing`'s rectangles, from its float64 `draws` (noise from `seed`)."""
  shape = tf.shape(image)
  height, width = shape[0], shape[1]
  area = tf.cast(height * width, tf.float64)
  log_aspect = (math.log(min_aspect), math.log(1. / min_aspect))
  count = tf.minimum(tf.cast(draws[1] * max_count, tf.int32), max_count - 1) + 1
  out = image
  for k, noise_seed in enumerate(stateless.split(seed, max_count)):
    box = draws[2 + 22 * k:2 + 22 * (k + 1)]
    target = (min_area + box[:10] * (max_area - min_area)) * area / tf.cast(count, tf.float64)
    aspect = tf.exp(log_aspect[0] + box[10:20] * (log_aspect[1] - log_aspect[0]))
    hs = tf.cast(tf.round(tf.sqrt(target * aspect)), tf.int32)
    ws = tf.cast(tf.round(tf.sqrt(target / aspect)), tf.int32)
    fits = (hs < height) & (ws < width)
    first = tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32)
    found = tf.reduce_any(fits) & (k < count)
    h = tf.where(found, hs[first], 0)
    w = tf.where(found, ws[first], 0)
    top = tf.cast(box[20] * tf.cast(height - h + 1, tf.float64), tf.int32)
    left = tf.cast(box[21] * tf.cast(width - w + 1, tf.float64), tf.int32)
    # Noise for the box only, pasted by slices.
    noise = tf.random.stateless_normal(tf.stack([h, w, shape[2]]), noise_seed, dtype=image.dtype)
    middle = tf.concat([out[top:top + h, :left], noise, out[top:top + h, left + w:]], axis=1)
    out = tf.concat([out[:top], middle, out[top + h:]], axis=0)
  return out
