"""Mixup and CutMix as T2T-ViT and DeiT train with them: timm's `Mixup(mode='batch',
correct_lam=True)` on a batch of images and label vectors."""

from __future__ import annotations

import tensorflow as tf

from vit_jax.data.augment import stateless


def _beta(seed: tf.Tensor, alpha: tf.Tensor) -> tf.Tensor:
  """Beta(alpha, alpha) float64 scalar from two stateless Gamma(alpha) draws."""
  seed_a, seed_b = stateless.split(seed, 2)
  a = tf.random.stateless_gamma([], seed_a, alpha, dtype=tf.float64)
  b = tf.random.stateless_gamma([], seed_b, alpha, dtype=tf.float64)
  total = a + b
  # Both can underflow to 0 only for tiny alpha, where Beta is ~Bernoulli.
  return tf.where(total > 0., a / tf.where(total > 0., total, 1.),
                  tf.cast(a >= b, tf.float64))


@stateless.no_autograph
def mixup_cutmix(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor, *,
                 mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0,
                 switch_prob: float = 0.5, prob: float = 1.0,
                 return_lam: bool = False):
  """timm `Mixup(mode='batch', correct_lam=True)` on one batch.

  One decision per batch: with probability `prob` mix, else leave the batch
  unchanged (lam = 1). If both alphas are > 0, CutMix with probability
  `switch_prob`, else Mixup; if only one is > 0, that one. lam ~ Beta(alpha,
  alpha) of the chosen method. The partner of example i is example B - 1 - i.

  * Mixup: x = lam * x + (1 - lam) * x_partner.
  * CutMix: timm `rand_bbox`: cut h, w = int(H * sqrt(1 - lam)), int(W *
    sqrt(1 - lam)); centre (cy, cx) uniform integers in [0, H) x [0, W); rows
    clip(cy -+ h // 2, 0, H), columns likewise; the box is copied from the
    partner and lam becomes 1 - box_area / (H * W).
  * labels = lam * labels + (1 - lam) * labels_partner (timm mixes smoothed
    one-hot targets; mixing is linear, so smoothing before or after is the
    same).

  Mixing is linear, so it commutes with normalization up to rounding: T2T-ViT
  (timm's prefetcher path, `FastCollateMixup`) mixes uint8 images, rounding
  Mixup blends to integers, before normalizing and random erasing; to
  reproduce that, mix float images in [0, 255] and round.

  Args:
    images: float [B, H, W, C].
    labels: float [B, K] label vectors (one-hot, smoothed or multi-hot).
    seed: int64 [2] stateless seed of this batch.
    mixup_alpha, cutmix_alpha: Beta parameters; a method is on if its alpha
      is > 0 (at least one must be).
    switch_prob: probability of CutMix when both are on.
    prob: probability of mixing a batch at all.
    return_lam: also return the (corrected) lam, float32 scalar.
  Returns:
    (images, labels), or (images, labels, lam) if `return_lam`; same dtypes
    and shapes as the inputs.
  Raises:
    ValueError: a negative alpha, both alphas 0, or switch_prob / prob
      outside [0, 1].
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
  lam = tf.where(do_mix, _beta(lam_seed, tf.maximum(alpha, 1e-12)),
                 tf.constant(1., tf.float64))
  reversed_images = images[::-1]

  def cutmix():
    shape = tf.shape(images)
    height, width = shape[1], shape[2]
    ratio = tf.sqrt(1. - lam)
    cut_h = tf.cast(tf.floor(tf.cast(height, tf.float64) * ratio), tf.int32)
    cut_w = tf.cast(tf.floor(tf.cast(width, tf.float64) * ratio), tf.int32)
    cy = stateless.randint(cy_seed, 0, height)
    cx = stateless.randint(cx_seed, 0, width)
    y0 = tf.clip_by_value(cy - cut_h // 2, 0, height)
    y1 = tf.clip_by_value(cy + cut_h // 2, 0, height)
    x0 = tf.clip_by_value(cx - cut_w // 2, 0, width)
    x1 = tf.clip_by_value(cx + cut_w // 2, 0, width)
    rows = tf.range(height)[:, None]
    cols = tf.range(width)[None, :]
    box = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)
    mixed = tf.where(box[None, :, :, None], reversed_images, images)
    box_area = tf.cast((y1 - y0) * (x1 - x0), tf.float64)
    return mixed, 1. - box_area / tf.cast(height * width, tf.float64)

  def mixup():
    lam_x = tf.cast(lam, images.dtype)
    return (images * lam_x + reversed_images * tf.cast(1. - lam, images.dtype),
            lam)

  mixed, lam = tf.cond(do_mix & use_cutmix, cutmix, mixup)
  mixed.set_shape(images.shape)
  lam_y = tf.cast(lam, labels.dtype)
  mixed_labels = labels * lam_y + labels[::-1] * tf.cast(1. - lam, labels.dtype)
  if return_lam:
    return mixed, mixed_labels, tf.cast(lam, tf.float32)
  return mixed, mixed_labels
