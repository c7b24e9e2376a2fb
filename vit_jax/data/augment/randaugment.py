"""RandAugment as T2T-ViT and DeiT train with it (timm ``'rand-m9-mstd0.5-inc1'``): timm's level
-> argument mappings, op lists and policy over PIL's image ops, uint8 ``[H, W, 3]`` in and out.
Differences: :mod:`vit_jax.data.augment`."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from vit_jax.data.augment import stateless

# timm's fill of geometric ops, `img_mean`: round(255 * IMAGENET_DEFAULT_MEAN).
IMAGENET_FILL = (124, 116, 104)

Number = Union[int, float, tf.Tensor]
Fill = Sequence[int]


def _check_uint8_rgb(image: tf.Tensor) -> tf.Tensor:
  image = tf.convert_to_tensor(image)
  if image.dtype != tf.uint8:
    raise ValueError(f'Expected a uint8 [H, W, 3] image, got dtype {image.dtype.name}.')
  if image.shape.rank is not None and (image.shape.rank != 3 or image.shape[-1] not in (None, 3)):
    raise ValueError(f'Expected a uint8 [H, W, 3] image, got shape {image.shape}.')
  return image


def _check_fill(fill: Fill) -> Tuple[int, int, int]:
  fill = tuple(int(v) for v in fill)
  if len(fill) != 3 or not all(0 <= v <= 255 for v in fill):
    raise ValueError(f'fill must be 3 ints in [0, 255], got {fill!r}.')
  return fill


# TensorFlow's CPU kernels for `tf.where`, `tf.gather` and broadcasts over the 3 channels are
# slow on a [H, W, 3] image; the ops below avoid them where they can.


def _channel_offsets(image: tf.Tensor) -> tf.Tensor:
  """int32 [H, W, 3] of 0, 256, 512 (the channel's table in [768]); a constant if static."""
  offsets = np.array([0, 256, 512], np.int32)
  if image.shape.is_fully_defined():
    return tf.constant(np.broadcast_to(offsets, image.shape.as_list()))
  return tf.tile(tf.constant(offsets)[None, None], tf.concat([tf.shape(image)[:2], [1]], 0))


def _apply_luts(image: tf.Tensor, luts: tf.Tensor) -> tf.Tensor:
  """PIL `Image.point`: per-channel lookup in int [3, 256] (or [256]) tables, clipped to uint8."""
  luts = tf.cast(tf.clip_by_value(tf.cast(luts, tf.int32), 0, 255), tf.uint8)
  luts = tf.reshape(tf.broadcast_to(luts, [3, 256]), [-1])
  return tf.gather(luts, tf.cast(image, tf.int32) + _channel_offsets(image))


def _ramp() -> tf.Tensor:
  return tf.range(256, dtype=tf.int32)


@stateless.no_autograph
def grayscale(image: tf.Tensor) -> tf.Tensor:
  """PIL ``convert('L')``: int32 ``[H, W]``, ``(19595 R + 38470 G + 7471 B + 2**15) >> 16``."""
  x = tf.cast(image, tf.int32)
  l = x[..., 0] * 19595 + x[..., 1] * 38470 + x[..., 2] * 7471 + 32768
  return tf.bitwise.right_shift(l, 16)


def _blend(degenerate: tf.Tensor, image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL ``Image.blend(degenerate, image, factor)``: uint8 ``clip(d + f * (i - d))`` in float32,
  truncated as C's ``(UINT8)``."""
  alpha = tf.cast(factor, tf.float32)
  d = tf.cast(degenerate, tf.float32)
  blended = d + alpha * (tf.cast(image, tf.float32) - d)
  return tf.cast(tf.floor(tf.clip_by_value(blended, 0., 255.)), tf.uint8)


def _threshold(threshold: Number) -> Tuple[tf.Tensor, tf.Tensor]:
  """(uint8 min(t, 255), bool t > 255) of an integer threshold t >= 0 (truncated, as `int()`)."""
  t = tf.cast(threshold, tf.int32)
  return tf.cast(tf.clip_by_value(t, 0, 255), tf.uint8), t > 255


@stateless.no_autograph
def invert(image: tf.Tensor) -> tf.Tensor:
  """PIL `ImageOps.invert`: 255 - x (uint8 [H, W, 3] -> same)."""
  return tf.bitwise.invert(_check_uint8_rgb(image))


@stateless.no_autograph
def posterize(image: tf.Tensor, bits: Number) -> tf.Tensor:
  """PIL ``ImageOps.posterize``: the top ``bits`` (0-8) bits; 8 identity, 0 black (PIL < 9)."""
  image = _check_uint8_rgb(image)
  shift = tf.clip_by_value(8 - tf.cast(bits, tf.int32), 0, 8)
  return tf.bitwise.bitwise_and(image, tf.cast(256 - tf.bitwise.left_shift(1, shift), tf.uint8))


@stateless.no_autograph
def solarize(image: tf.Tensor, threshold: Number) -> tf.Tensor:
  """PIL ``ImageOps.solarize``: ``x < threshold ? x : 255 - x`` (int threshold; 256 identity)."""
  image = _check_uint8_rgb(image)
  t, above = _threshold(threshold)
  flip = tf.cast(image >= t, tf.uint8) * tf.cast(tf.logical_not(above), tf.uint8)
  return tf.bitwise.bitwise_xor(image, flip * 255)


@stateless.no_autograph
def solarize_add(image: tf.Tensor, addition: Number, threshold: Number = 128) -> tf.Tensor:
  """timm `solarize_add`: x < threshold ? clip(x + addition, 0, 255) : x."""
  image = _check_uint8_rgb(image)
  a = tf.cast(addition, tf.int32)
  up = tf.cast(tf.clip_by_value(a, 0, 255), tf.uint8)
  down = tf.cast(tf.clip_by_value(-a, 0, 255), tf.uint8)
  added = tf.maximum(tf.minimum(image, 255 - up) + up, down) - down  # clip(x + a, 0, 255).
  t, above = _threshold(threshold)
  below = tf.bitwise.bitwise_or(tf.cast(image < t, tf.uint8), tf.cast(above, tf.uint8))
  return image + (added - image) * below


@stateless.no_autograph
def auto_contrast(image: tf.Tensor) -> tf.Tensor:
  """PIL ``ImageOps.autocontrast`` (cutoff 0): per channel ``int(x * s - lo * s)``, ``s = 255 /
  (hi - lo)`` in float64 (``hi`` may map to 254, as PIL); constant channels unchanged."""
  image = _check_uint8_rgb(image)
  lo = tf.cast(tf.reduce_min(image, axis=[0, 1]), tf.int32)
  hi = tf.cast(tf.reduce_max(image, axis=[0, 1]), tf.int32)
  valid = hi > lo
  scale = 255. / tf.cast(tf.where(valid, hi - lo, 1), tf.float64)
  offset = -tf.cast(lo, tf.float64) * scale
  lut = tf.floor(tf.cast(_ramp(), tf.float64)[None, :] * scale[:, None] + offset[:, None])
  lut = tf.cast(tf.clip_by_value(lut, 0., 255.), tf.int32)
  return _apply_luts(image, tf.where(valid[:, None], lut, _ramp()[None, :]))


@stateless.no_autograph
def equalize(image: tf.Tensor) -> tf.Tensor:
  """PIL ``ImageOps.equalize`` per channel: ``step = (sum(h) - h[last]) // 255``, ``lut[i] =
  (step // 2 + sum(h[:i])) // step``; the identity for <= 1 distinct value or ``step == 0``."""
  image = _check_uint8_rgb(image)
  idx = tf.cast(image, tf.int32) + _channel_offsets(image)
  h = tf.reshape(tf.math.bincount(tf.reshape(idx, [-1]), minlength=768, maxlength=768,
                                  dtype=tf.int32), [3, 256])  # The per-channel histograms.
  nonzero = tf.cast(h > 0, tf.int32)
  last = 255 - tf.argmax(nonzero[:, ::-1], axis=1, output_type=tf.int32)
  step = (tf.reduce_sum(h, axis=1) - tf.gather(h, last, batch_dims=1)) // 255
  safe_step = tf.maximum(step, 1)[:, None]
  lut = (safe_step // 2 + tf.cumsum(h, axis=1, exclusive=True)) // safe_step
  identity = (tf.reduce_sum(nonzero, axis=1) <= 1) | (step == 0)
  return _apply_luts(image, tf.where(identity[:, None], _ramp()[None, :], lut))


@stateless.no_autograph
def color(image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL `ImageEnhance.Color`: blend of the grayscale image (factor 0) and the image (1)."""
  image = _check_uint8_rgb(image)
  return _blend(grayscale(image)[..., None], image, factor)


@stateless.no_autograph
def contrast(image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL `ImageEnhance.Contrast`: blend of int(mean(grayscale) + 0.5) (factor 0) and the image."""
  image = _check_uint8_rgb(image)
  gray = grayscale(image)
  total = tf.cast(tf.reduce_sum(tf.cast(gray, tf.int64)), tf.float64)
  count = tf.cast(tf.size(gray, out_type=tf.int64), tf.float64)
  return _blend(tf.floor(total / count + 0.5), image, factor)


@stateless.no_autograph
def brightness(image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL `ImageEnhance.Brightness`: (UINT8) clip(factor * x)."""
  return _blend(tf.zeros([], tf.int32), _check_uint8_rgb(image), factor)


@stateless.no_autograph
def smooth(image: tf.Tensor) -> tf.Tensor:
  """PIL ``ImageFilter.SMOOTH``: 3x3 ``[[1,1,1],[1,5,1],[1,1,1]] / 13`` rounded; border copied."""
  image = _check_uint8_rgb(image)

  def inner():
    x = tf.cast(image, tf.float32)  # Sums of at most 13 * 255: exact.
    rows = x[:, :-2] + x[:, 1:-1] + x[:, 2:]
    sums = rows[:-2] + rows[1:-1] + rows[2:] + 4. * x[1:-1, 1:-1]
    # (2 s + 13) // 26 = floor(s / 13 + 1 / 2), never within 1 / 26 of an integer.
    smoothed = tf.cast(tf.floor(sums * (1. / 13.) + 0.5), tf.uint8)
    middle = tf.concat([image[1:-1, :1], smoothed, image[1:-1, -1:]], axis=1)
    return tf.concat([image[:1], middle, image[-1:]], axis=0)

  shape = tf.shape(image)
  out = tf.cond((shape[0] > 2) & (shape[1] > 2), inner, lambda: image)
  out.set_shape(image.shape)
  return out


@stateless.no_autograph
def sharpness(image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL `ImageEnhance.Sharpness`: blend of `smooth(image)` (factor 0) and the image (1)."""
  image = _check_uint8_rgb(image)
  return _blend(smooth(image), image, factor)


def _matrix(*values) -> tf.Tensor:
  """float64 [6] PIL affine matrix from numbers / scalar tensors."""
  return tf.stack([tf.cast(v, tf.float64) for v in values])


@stateless.no_autograph
def affine(image: tf.Tensor, matrix: Union[Sequence[Number], tf.Tensor],
           fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """PIL ``transform(size, AFFINE, matrix, BILINEAR, fillcolor=fill)`` of uint8 ``[H, W, 3]``:
  output pixel centre ``(X, Y)`` samples the input at ``(a X + b Y + c, d X + e Y + f)``, outside
  gets ``fill``; ``matrix``: 6 numbers or a float ``[6]`` tensor. Coordinates in float64 as PIL,
  the blend in float32: rarely off by 1."""
  image = _check_uint8_rgb(image)
  fill = _check_fill(fill)
  if isinstance(matrix, (list, tuple)):
    matrix = _matrix(*matrix)
  out = _warp(image, tf.cast(matrix, tf.float64), tf.constant(fill, tf.uint8))
  out.set_shape(image.shape)
  return out


@tf.function(autograph=False, jit_compile=True, input_signature=(
    tf.TensorSpec([None, None, None], tf.uint8), tf.TensorSpec([6], tf.float64),
    tf.TensorSpec([3], tf.uint8)))
def _warp(image: tf.Tensor, matrix: tf.Tensor, fill: tf.Tensor) -> tf.Tensor:
  """`affine` of uint8 ``[H, W, 3]`` by PIL's float64 ``[6]`` matrix, outside filled with uint8
  ``[3]`` ``fill``: one XLA program per image shape (TF's CPU kernels are 3-4x slower)."""
  a, b, c, d, e, f = tf.unstack(matrix, num=6)
  height, width = tf.shape(image)[0], tf.shape(image)[1]
  w, h = tf.cast(width, tf.float64), tf.cast(height, tf.float64)
  # PIL's float64 coordinates of output pixel centres decide which pixels are covered.
  xs, ys = tf.range(w) + 0.5, tf.range(h)[:, None] + 0.5
  x_in = a * xs + b * ys + c
  y_in = d * xs + e * ys + f
  valid = (x_in >= 0.) & (x_in < w) & (y_in >= 0.) & (y_in < h)
  # PIL's bilinear: the 2x2 pixels around (x_in - .5, y_in - .5), clamped to the image, blended
  # as v0 + (v1 - v0) dy, v_i = p_i0 + (p_i1 - p_i0) dx, truncated.
  x_in, y_in = tf.clip_by_value(x_in - 0.5, -1., w), tf.clip_by_value(y_in - 0.5, -1., h)
  x0, y0 = tf.floor(x_in), tf.floor(y_in)
  dx, dy = tf.cast(x_in - x0, tf.float32)[..., None], tf.cast(y_in - y0, tf.float32)[..., None]
  x0, y0 = tf.cast(x0, tf.int32), tf.cast(y0, tf.int32)
  cols = (tf.maximum(x0, 0), tf.minimum(x0 + 1, width - 1))
  rows = (tf.maximum(y0, 0) * width, tf.minimum(y0 + 1, height - 1) * width)
  # Uncovered pixels read `fill`, appended at index H * W.
  pixels = tf.concat([tf.reshape(image, [-1, 3]), fill[None]], 0)
  outside = height * width
  corner = lambda r, c: tf.cast(tf.gather(pixels, tf.where(valid, r + c, outside)), tf.float32)
  p00 = corner(rows[0], cols[0])
  p01 = corner(rows[0], cols[1])
  p10 = corner(rows[1], cols[0])
  p11 = corner(rows[1], cols[1])
  v0 = p00 + (p01 - p00) * dx
  v1 = p10 + (p11 - p10) * dx
  return tf.cast(v0 + (v1 - v0) * dy + 1e-5, tf.uint8)  # 1e-5: float32 rounding (PIL float64).


def _rotate_matrix(degrees: Number, image: tf.Tensor) -> tf.Tensor:
  """PIL `Image.rotate`'s matrix (about (W / 2, H / 2), no expand)."""
  degrees = tf.math.floormod(tf.cast(degrees, tf.float64), 360.)
  angle = -degrees * (math.pi / 180.)
  cos = tf.round(tf.cos(angle) * 1e15) / 1e15
  sin = tf.round(tf.sin(angle) * 1e15) / 1e15
  cx = tf.cast(tf.shape(image)[1], tf.float64) / 2.
  cy = tf.cast(tf.shape(image)[0], tf.float64) / 2.
  return _matrix(cos, sin, cos * -cx + sin * -cy + cx, -sin, cos, -sin * -cx + cos * -cy + cy)


@stateless.no_autograph
def rotate(image: tf.Tensor, degrees: Number, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """PIL ``rotate(degrees, BILINEAR, fillcolor=fill)``: counter-clockwise about ``(W / 2, H / 2)``
  by PIL's matrix (angle mod 360, cos / sin rounded to 15 decimals: 90 degrees is ``np.rot90``)."""
  return affine(image, _rotate_matrix(degrees, image), fill)


@stateless.no_autograph
def shear_x(image: tf.Tensor, factor: Number, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `shear_x`: PIL affine (1, factor, 0, 0, 1, 0)."""
  return affine(image, [1., factor, 0., 0., 1., 0.], fill)


@stateless.no_autograph
def shear_y(image: tf.Tensor, factor: Number, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `shear_y`: PIL affine (1, 0, 0, factor, 1, 0)."""
  return affine(image, [1., 0., 0., factor, 1., 0.], fill)


@stateless.no_autograph
def translate_x(image: tf.Tensor, pixels: Number, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `translate_x_abs`: PIL affine (1, 0, pixels, 0, 1, 0): content moves left."""
  return affine(image, [1., 0., pixels, 0., 1., 0.], fill)


@stateless.no_autograph
def translate_y(image: tf.Tensor, pixels: Number, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `translate_y_abs`: PIL affine (1, 0, 0, 0, 1, pixels): content moves up."""
  return affine(image, [1., 0., 0., 0., 1., pixels], fill)


@stateless.no_autograph
def translate_x_rel(image: tf.Tensor, fraction: Number, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `translate_x_rel`: `translate_x` by fraction * W pixels."""
  width = tf.cast(tf.shape(image)[1], tf.float64)
  return translate_x(image, tf.cast(fraction, tf.float64) * width, fill)


@stateless.no_autograph
def translate_y_rel(image: tf.Tensor, fraction: Number, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `translate_y_rel`: `translate_y` by fraction * H pixels."""
  height = tf.cast(tf.shape(image)[0], tf.float64)
  return translate_y(image, tf.cast(fraction, tf.float64) * height, fill)


# timm `_LEVEL_DENOM`: magnitudes are clipped to [0, 10], divided by it for the op strength.
MAX_LEVEL = 10.

# timm `_RAND_TRANSFORMS` ('rand-...-inc0').
RAND_TRANSFORMS = (
    'AutoContrast', 'Equalize', 'Invert', 'Rotate', 'Posterize', 'Solarize', 'SolarizeAdd',
    'Color', 'Contrast', 'Brightness', 'Sharpness', 'ShearX', 'ShearY', 'TranslateXRel',
    'TranslateYRel')

# timm `_RAND_INCREASING_TRANSFORMS` ('rand-...-inc1', T2T-ViT and DeiT).
RAND_INCREASING_TRANSFORMS = (
    'AutoContrast', 'Equalize', 'Invert', 'Rotate', 'PosterizeIncreasing', 'SolarizeIncreasing',
    'SolarizeAdd', 'ColorIncreasing', 'ContrastIncreasing', 'BrightnessIncreasing',
    'SharpnessIncreasing', 'ShearX', 'ShearY', 'TranslateXRel', 'TranslateYRel')


# timm's level functions: a float64 magnitude m (and a random sign where timm calls
# `_randomly_negate`) -> the op argument.
def _sign(u: tf.Tensor) -> tf.Tensor:
  """timm `_randomly_negate` of a float64 uniform ``u``: -1 or +1 (float64)."""
  return tf.where(u > 0.5, tf.constant(-1., tf.float64), tf.constant(1., tf.float64))


def _signed_level(top: float):
  """Rotate ([-30, 30] degrees), shear, translate: ``m / 10 * top``, randomly negated."""
  return lambda m, sign: m / MAX_LEVEL * top * sign


def _integer_level(top: float, increasing: bool = False):
  """Posterize bits, solarize thresholds, solarize_add: ``floor(m / 10 * top)`` in [0, top], the
  '...Increasing' ops ``top`` minus that (severity grows with m)."""
  def level(m, sign):
    del sign
    value = tf.floor(m / MAX_LEVEL * top)
    return top - value if increasing else value
  return level


def _enhance_level(m, sign):  # [0.1, 1.9].
  del sign
  return m / MAX_LEVEL * 1.8 + 0.1


def _enhance_increasing_level(m, sign):  # 1 +- [0, 0.9], >= 0.1.
  return tf.maximum(tf.constant(0.1, tf.float64), 1. + m / MAX_LEVEL * .9 * sign)


# name: (level function or None, fn(uint8 image, float64 argument, fill) -> uint8 image).
_OPS = {
    'AutoContrast': (None, lambda im, a, fill: auto_contrast(im)),
    'Equalize': (None, lambda im, a, fill: equalize(im)),
    'Invert': (None, lambda im, a, fill: invert(im)),
    'Rotate': (_signed_level(30.), rotate),
    'Posterize': (_integer_level(4.), lambda im, a, fill: posterize(im, a)),
    'Solarize': (_integer_level(256.), lambda im, a, fill: solarize(im, a)),
    'SolarizeAdd': (_integer_level(110.), lambda im, a, fill: solarize_add(im, a)),
    'Color': (_enhance_level, lambda im, a, fill: color(im, a)),
    'Contrast': (_enhance_level, lambda im, a, fill: contrast(im, a)),
    'Brightness': (_enhance_level, lambda im, a, fill: brightness(im, a)),
    'Sharpness': (_enhance_level, lambda im, a, fill: sharpness(im, a)),
    'ShearX': (_signed_level(0.3), shear_x),
    'ShearY': (_signed_level(0.3), shear_y),
    'TranslateXRel': (_signed_level(0.45), translate_x_rel),
    'TranslateYRel': (_signed_level(0.45), translate_y_rel),
}
# timm's '...Increasing' ops: the same op, with a level that grows with the magnitude.
_OPS.update({f'{name}Increasing': (level, _OPS[name][1]) for name, level in (
    ('Posterize', _integer_level(4., increasing=True)),
    ('Solarize', _integer_level(256., increasing=True)), ('Color', _enhance_increasing_level),
    ('Contrast', _enhance_increasing_level), ('Brightness', _enhance_increasing_level),
    ('Sharpness', _enhance_increasing_level))})

OP_NAMES = tuple(_OPS)  # Every op `apply_op` knows (the union of both RandAugment lists).


def _level(name: str, magnitude: tf.Tensor, sign: tf.Tensor) -> Optional[tf.Tensor]:
  level_fn = _OPS[name][0]
  return None if level_fn is None else level_fn(magnitude, sign)


@stateless.no_autograph
def level_to_arg(name: str, magnitude: Number, seed: tf.Tensor) -> Optional[tf.Tensor]:
  """timm ``LEVEL_TO_ARG[name](magnitude)``: the op argument (float64 scalar; signed ops draw
  their sign from ``seed``), None for AutoContrast, Equalize, Invert. ValueError: unknown op."""
  if name not in _OPS:
    raise ValueError(f'Unknown augmentation op {name!r}; known: {OP_NAMES}.')
  return _level(name, tf.cast(magnitude, tf.float64), _sign(stateless.uniform(seed)))


def _op_function(name: str):
  def run(image, magnitude, sign, fill):
    return _OPS[name][1](image, _level(name, magnitude, sign), fill)
  return stateless.branch_function(run)


# The ops as the branches of `_apply_switch` call them.
_OP_FUNCTIONS = {name: _op_function(name) for name in _OPS}


def _apply_switch(image: tf.Tensor, names: Sequence[str], index: tf.Tensor,
                  magnitude: tf.Tensor, sign: tf.Tensor, fill: Tuple[int, int, int]) -> tf.Tensor:
  """The op ``names[index]`` (int32 tensor) at float64 ``magnitude`` and ``sign`` (+-1): one
  branch runs."""
  image = tf.convert_to_tensor(image)
  magnitude = tf.cast(magnitude, tf.float64)
  branches = [lambda n=n: _OP_FUNCTIONS[n](image, magnitude, sign, fill) for n in names]
  out = branches[0]() if len(branches) == 1 else tf.switch_case(index, branches)
  out.set_shape(image.shape)
  return out


@stateless.branch_function
def _layer(image: tf.Tensor, names: Tuple[str, ...], u: tf.Tensor, magnitude: float,
           magnitude_std: float, fill: Tuple[int, int, int]) -> tf.Tensor:
  """One RandAugment layer, applied: the op, its magnitude and sign from float64 ``u[0, 2, 3]``."""
  index = tf.minimum(tf.cast(u[0] * len(names), tf.int32), len(names) - 1)
  return _apply_switch(image, names, index, _magnitude(u[2], magnitude, magnitude_std),
                       _sign(u[3]), fill)


@stateless.no_autograph
def apply_op(image: tf.Tensor, name: str, magnitude: Number, seed: tf.Tensor,
             *, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """One timm RandAugment op (of ``OP_NAMES``) at ``magnitude`` (not clipped), always applied;
  ``seed`` int64 ``[2]``, ``fill`` the RGB of uncovered pixels. ValueError: unknown op, bad image
  or fill."""
  image = _check_uint8_rgb(image)
  fill = _check_fill(fill)
  arg = level_to_arg(name, magnitude, seed)
  out = _OPS[name][1](image, arg, fill)
  out.set_shape(image.shape)
  return out


def _magnitude(u: tf.Tensor, magnitude: float, magnitude_std: float) -> tf.Tensor:
  """`sample_magnitude` from one float64 uniform in [0, 1) (a Normal by its inverse CDF)."""
  m = tf.constant(float(magnitude), tf.float64)
  if magnitude_std == float('inf'):
    m = u * m
  elif magnitude_std > 0:
    m = m + magnitude_std * tf.math.ndtri(u)
  return tf.clip_by_value(m, 0., MAX_LEVEL)


@stateless.no_autograph
def sample_magnitude(seed: tf.Tensor, magnitude: float = 9.,
                     magnitude_std: float = 0.5) -> tf.Tensor:
  """timm ``AugmentOp`` magnitude, float64 in [0, 10]: fixed, uniform (std inf) or Normal."""
  return _magnitude(stateless.uniform(seed), magnitude, magnitude_std)


@stateless.no_autograph
def rand_augment(image: tf.Tensor, seed: tf.Tensor, *, num_layers: int = 2,
                 magnitude: float = 9., magnitude_std: float = 0.5, increasing: bool = True,
                 fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm RandAugment of a uint8 ``[H, W, 3]`` image (same static shape out): ``num_layers``
  times (timm 'n'; 0 = identity) an op drawn from ``RAND_INCREASING_TRANSFORMS`` ('inc1'; else
  ``RAND_TRANSFORMS``), applied with probability 0.5 at a fresh :func:`sample_magnitude` (timm
  'm', 'mstd') and random sign; all draws from one ``stateless_uniform`` of ``seed`` (int64
  ``[2]``). ValueError: bad image or fill, negative num_layers / magnitude / magnitude_std."""
  image = _check_uint8_rgb(image)
  fill = _check_fill(fill)
  if not isinstance(num_layers, int) or num_layers < 0:
    raise ValueError(f'num_layers must be an int >= 0, got {num_layers!r}.')
  if magnitude < 0 or not magnitude_std >= 0:
    raise ValueError('magnitude and magnitude_std must be >= 0, got '
                     f'{magnitude!r}, {magnitude_std!r}.')
  if not num_layers:
    return image
  names = RAND_INCREASING_TRANSFORMS if increasing else RAND_TRANSFORMS
  # Per layer: the op, whether it is applied, its magnitude and its sign.
  draws = tf.random.stateless_uniform([num_layers, 4], seed=seed, dtype=tf.float64)
  out = image
  for u in tf.unstack(draws):
    # timm AugmentOp: skipped when random() > prob (0.5).
    out = tf.cond(u[1] <= 0.5, lambda x=out, u=u: _layer(x, names, u, float(magnitude),
                                                           float(magnitude_std), fill),
                  lambda x=out: x)
    out.set_shape(image.shape)
  return out
