"""RandAugment as T2T-ViT and DeiT train with it (timm ``'rand-m9-mstd0.5-inc1'``).

timm's level -> argument mappings, op lists and policy over the PIL ops of
:mod:`vit_jax.data.augment.pil_ops`. Differences from timm / PIL: :mod:`vit_jax.data.augment`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import tensorflow as tf

from vit_jax.data.augment import stateless
from vit_jax.data.augment.pil_ops import (  # The ops and the helpers their table uses.
    affine, _apply_luts, _auto_contrast_lut, _black_degenerate, _blend, _check_fill,
    _check_uint8_rgb, _equalize_lut, IMAGENET_FILL, Fill, _gray_degenerate, _invert_lut, _matrix, _mean_degenerate, Number,
    _posterize_lut, _rotate_matrix, _size, smooth, _solarize_add_lut, _solarize_lut)

# timm `_LEVEL_DENOM` (`_MAX_LEVEL` in older versions): magnitudes are clipped
# to [0, 10] and divided by 10 to get the op strength.
MAX_LEVEL = 10.

# timm `_RAND_TRANSFORMS` ('rand-...-inc0').
RAND_TRANSFORMS = (
    'AutoContrast', 'Equalize', 'Invert', 'Rotate', 'Posterize', 'Solarize',
    'SolarizeAdd', 'Color', 'Contrast', 'Brightness', 'Sharpness', 'ShearX',
    'ShearY', 'TranslateXRel', 'TranslateYRel')

# timm `_RAND_INCREASING_TRANSFORMS` ('rand-...-inc1', T2T-ViT and DeiT).
RAND_INCREASING_TRANSFORMS = (
    'AutoContrast', 'Equalize', 'Invert', 'Rotate', 'PosterizeIncreasing',
    'SolarizeIncreasing', 'SolarizeAdd', 'ColorIncreasing',
    'ContrastIncreasing', 'BrightnessIncreasing', 'SharpnessIncreasing',
    'ShearX', 'ShearY', 'TranslateXRel', 'TranslateYRel')


# ------------------------------------------------- timm level -> argument
# Level functions map a float64 magnitude m (and a random sign, +-1, used by
# the ops where timm calls `_randomly_negate`) to the op argument.


def _random_sign(seed: tf.Tensor) -> tf.Tensor:
  """timm `_randomly_negate`: -1 or +1 with probability 1/2 (float64)."""
  return tf.where(stateless.uniform(seed) > 0.5, tf.constant(-1., tf.float64),
                  tf.constant(1., tf.float64))


def _rotate_level(m, sign):  # [-30, 30] degrees.
  return m / MAX_LEVEL * 30. * sign


def _enhance_level(m, sign):  # [0.1, 1.9].
  del sign
  return m / MAX_LEVEL * 1.8 + 0.1


def _enhance_increasing_level(m, sign):  # 1 +- [0, 0.9], >= 0.1.
  return tf.maximum(tf.constant(0.1, tf.float64),
                    1. + m / MAX_LEVEL * .9 * sign)


def _shear_level(m, sign):  # [-0.3, 0.3].
  return m / MAX_LEVEL * 0.3 * sign


def _translate_rel_level(m, sign):  # [-0.45, 0.45] of the image size.
  return m / MAX_LEVEL * 0.45 * sign


def _posterize_level(m, sign):  # bits in [0, 4], decreasing severity.
  del sign
  return tf.floor(m / MAX_LEVEL * 4.)


def _posterize_increasing_level(m, sign):  # bits in [4, 0].
  return 4. - _posterize_level(m, sign)


def _solarize_level(m, sign):  # threshold in [0, 256], decreasing severity.
  del sign
  return tf.floor(m / MAX_LEVEL * 256.)


def _solarize_increasing_level(m, sign):  # threshold in [256, 0].
  return 256. - _solarize_level(m, sign)


def _solarize_add_level(m, sign):  # addition in [0, 110].
  del sign
  return tf.floor(m / MAX_LEVEL * 110.)


# Every op is one of three kinds, which share the expensive image work:
#   'lut':    fn(image, arg) -> int [3, 256] per-channel lookup tables;
#   'blend':  fn(image) -> degenerate image (broadcastable), blended with the
#             image by factor `arg` (PIL ImageEnhance);
#   'affine': fn(arg, height, width) -> float64 [6] PIL affine matrix.
_OPS = {
    # name: (level function or None, kind, fn)
    'AutoContrast': (None, 'lut', lambda im, a: _auto_contrast_lut(im)),
    'Equalize': (None, 'lut', lambda im, a: _equalize_lut(im)),
    'Invert': (None, 'lut', lambda im, a: _invert_lut()),
    'Rotate': (_rotate_level, 'affine', _rotate_matrix),
    'Posterize': (_posterize_level, 'lut', lambda im, a: _posterize_lut(a)),
    'PosterizeIncreasing': (_posterize_increasing_level, 'lut',
                            lambda im, a: _posterize_lut(a)),
    'Solarize': (_solarize_level, 'lut', lambda im, a: _solarize_lut(a)),
    'SolarizeIncreasing': (_solarize_increasing_level, 'lut',
                           lambda im, a: _solarize_lut(a)),
    'SolarizeAdd': (_solarize_add_level, 'lut',
                    lambda im, a: _solarize_add_lut(a)),
    'Color': (_enhance_level, 'blend', _gray_degenerate),
    'ColorIncreasing': (_enhance_increasing_level, 'blend', _gray_degenerate),
    'Contrast': (_enhance_level, 'blend', _mean_degenerate),
    'ContrastIncreasing': (_enhance_increasing_level, 'blend',
                           _mean_degenerate),
    'Brightness': (_enhance_level, 'blend', _black_degenerate),
    'BrightnessIncreasing': (_enhance_increasing_level, 'blend',
                             _black_degenerate),
    'Sharpness': (_enhance_level, 'blend', smooth),
    'SharpnessIncreasing': (_enhance_increasing_level, 'blend', smooth),
    'ShearX': (_shear_level, 'affine',
               lambda a, h, w: _matrix(1., a, 0., 0., 1., 0.)),
    'ShearY': (_shear_level, 'affine',
               lambda a, h, w: _matrix(1., 0., 0., a, 1., 0.)),
    'TranslateXRel': (_translate_rel_level, 'affine',
                      lambda a, h, w: _matrix(
                          1., 0., a * tf.cast(w, tf.float64), 0., 1., 0.)),
    'TranslateYRel': (_translate_rel_level, 'affine',
                      lambda a, h, w: _matrix(
                          1., 0., 0., 0., 1., a * tf.cast(h, tf.float64))),
}

# Every op `apply_op` knows (the union of both RandAugment lists).
OP_NAMES = tuple(_OPS)


def _check_op_name(name: str) -> None:
  if name not in _OPS:
    raise ValueError(f'Unknown augmentation op {name!r}; known: {OP_NAMES}.')


def _level(name: str, magnitude: tf.Tensor, sign: tf.Tensor) -> tf.Tensor:
  level_fn = _OPS[name][0]
  if level_fn is None:
    return tf.zeros([], tf.float64)  # Unused.
  return level_fn(magnitude, sign)


@stateless.no_autograph
def level_to_arg(name: str, magnitude: Number,
                 seed: tf.Tensor) -> Optional[tf.Tensor]:
  """timm ``LEVEL_TO_ARG[name](magnitude)``: the op argument (float64 scalar), or None.

  None for AutoContrast, Equalize, Invert; signed ops draw their sign from ``seed``. Raises
  ValueError for an unknown op name.
  """
  _check_op_name(name)
  if _OPS[name][0] is None:
    return None
  return _level(name, tf.cast(magnitude, tf.float64), _random_sign(seed))


def _switch(index: tf.Tensor, fns):
  return fns[0]() if len(fns) == 1 else tf.switch_case(index, fns)


def _apply_indexed(image: tf.Tensor, names: Sequence[str], index: tf.Tensor,
                   magnitude: tf.Tensor, seed: tf.Tensor,
                   fill: Tuple[int, int, int]) -> tf.Tensor:
  """``apply_op(image, names[index], ...)`` for an int32 tensor ``index``, with one shared lookup,
  blend and affine transform instead of one graph branch per op (half the graph).
  """
  magnitude = tf.cast(magnitude, tf.float64)
  sign = _random_sign(seed)
  arg = tf.gather(tf.stack([_level(n, magnitude, sign) for n in names]),
                  index)
  # names[index] is op number `position` of group number `group`.
  groups = {'lut': [], 'blend': [], 'affine': []}
  positions = []
  for name in names:
    members = groups[_OPS[name][1]]
    positions.append(len(members))
    members.append(name)
  present = [kind for kind, members in groups.items() if members]
  group = tf.gather(
      tf.constant([present.index(_OPS[n][1]) for n in names], tf.int32), index)
  position = tf.gather(tf.constant(positions, tf.int32), index)

  def lut_op():
    luts = _switch(position, [
        lambda n=n: tf.broadcast_to(_OPS[n][2](image, arg), [3, 256])
        for n in groups['lut']])
    return _apply_luts(image, luts)

  def blend_op():
    degenerate = _switch(position, [
        lambda n=n: tf.broadcast_to(
            tf.cast(_OPS[n][2](image), tf.float32), tf.shape(image))
        for n in groups['blend']])
    return _blend(degenerate, image, arg)

  def affine_op():
    height, width = _size(image)
    matrices = tf.stack([_OPS[n][2](arg, height, width)
                         for n in groups['affine']])
    return affine(image, tf.gather(matrices, position), fill)

  fns = {'lut': lut_op, 'blend': blend_op, 'affine': affine_op}
  out = _switch(group, [fns[kind] for kind in present])
  out.set_shape(image.shape)
  return out


@stateless.no_autograph
def apply_op(image: tf.Tensor, name: str, magnitude: Number, seed: tf.Tensor,
             *, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """Applies one timm RandAugment op (one of ``OP_NAMES``) at a sampled magnitude, always.

  uint8 ``[H, W, 3]`` in and out; ``magnitude`` not clipped; ``seed`` int64 ``[2]``; ``fill``
  the RGB of uncovered pixels. Raises ValueError: unknown op, bad image or fill.
  """
  image = _check_uint8_rgb(image)
  fill = _check_fill(fill)
  _check_op_name(name)
  arg = _level(name, tf.cast(magnitude, tf.float64), _random_sign(seed))
  kind, fn = _OPS[name][1:]
  if kind == 'lut':
    out = _apply_luts(image, fn(image, arg))
  elif kind == 'blend':
    out = _blend(fn(image), image, arg)
  else:
    out = affine(image, fn(arg, *_size(image)), fill)
  out.set_shape(image.shape)
  return out


@stateless.no_autograph
def sample_magnitude(seed: tf.Tensor, magnitude: float = 9.,
                     magnitude_std: float = 0.5) -> tf.Tensor:
  """timm ``AugmentOp`` magnitude, float64 in [0, 10]: fixed, uniform (std inf) or Normal, clipped.
  """
  m = tf.constant(float(magnitude), tf.float64)
  if magnitude_std == float('inf'):
    m = stateless.uniform(seed) * m
  elif magnitude_std > 0:
    m = m + magnitude_std * tf.random.stateless_normal([], seed=seed,
                                                       dtype=tf.float64)
  return tf.clip_by_value(m, 0., MAX_LEVEL)


@stateless.no_autograph
def rand_augment(image: tf.Tensor, seed: tf.Tensor, *, num_layers: int = 2,
                 magnitude: float = 9., magnitude_std: float = 0.5,
                 increasing: bool = True,
                 fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm RandAugment of a uint8 ``[H, W, 3]`` image (same static shape out).

  ``num_layers`` times (timm 'n'; 0 = identity): an op drawn with replacement from
  ``RAND_INCREASING_TRANSFORMS`` ('inc1'; else ``RAND_TRANSFORMS``), applied with probability
  0.5 at a fresh :func:`sample_magnitude` (timm 'm', 'mstd'). ``fill``: timm's ``img_mean``.

  Raises:
    ValueError: bad image or fill, negative num_layers / magnitude / magnitude_std.
  """
  image = _check_uint8_rgb(image)
  fill = _check_fill(fill)
  if not isinstance(num_layers, int) or num_layers < 0:
    raise ValueError(f'num_layers must be an int >= 0, got {num_layers!r}.')
  if magnitude < 0 or not magnitude_std >= 0:
    raise ValueError('magnitude and magnitude_std must be >= 0, got '
                     f'{magnitude!r}, {magnitude_std!r}.')
  names = RAND_INCREASING_TRANSFORMS if increasing else RAND_TRANSFORMS
  out = image
  for layer_seed in (stateless.split(seed, num_layers) if num_layers else []):
    choice_seed, prob_seed, mag_seed, op_seed = stateless.split(layer_seed, 4)
    index = stateless.randint(choice_seed, 0, len(names))

    def augment(x=out, index=index, mag_seed=mag_seed, op_seed=op_seed):
      m = sample_magnitude(mag_seed, magnitude, magnitude_std)
      return _apply_indexed(x, names, index, m, op_seed, fill)

    # timm AugmentOp: skipped when random() > prob (0.5).
    out = tf.cond(stateless.uniform(prob_seed) <= 0.5, augment, lambda x=out: x)
    out.set_shape(image.shape)
  return out
