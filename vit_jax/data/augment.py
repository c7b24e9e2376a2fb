"""T2T-ViT / DeiT ImageNet training augmentations (TensorFlow ops).

Reproduces, as TensorFlow ops usable eagerly and inside `tf.data` maps, the
timm (pytorch-image-models) augmentations that T2T-ViT and DeiT train with:

* `rand_augment`: timm `rand_augment_transform('rand-m9-mstd0.5-inc1')`
  (RandAugment with timm's op list, level mappings, per-op probability 0.5 and
  Gaussian magnitude noise), with every op defined as PIL's `ImageOps` /
  `ImageEnhance` / `Image.transform` define it (see the op functions below);
* `random_erasing`: timm `RandomErasing(mode='pixel')`, applied to one
  normalized image;
* `mixup_cutmix`: timm `Mixup(mode='batch', correct_lam=True)` on a batch of
  images and label vectors.

All randomness is *stateless*: every function takes an int64 [2] `seed` and its
output is a deterministic function of (inputs, seed, arguments), so that a
resumed run sees exactly the augmentations of an uninterrupted one. Random
numbers are not those of timm (which uses Python's / numpy's global RNGs), only
their distributions are.

Known differences from timm / PIL (documented where they occur):
* geometric ops always interpolate bilinearly (timm picks bilinear or bicubic
  at random when `interpolation='random'`, as in T2T-ViT; DeiT uses bicubic),
  with float32 rather than float64 arithmetic: a pixel can differ by 1 from
  PIL's;
* Posterize with 0 bits gives black (as PIL < 9 did; current PIL raises).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import tensorflow as tf

# timm `_HPARAMS_DEFAULT` uses `img_mean` as the fill of geometric ops; timm's
# `transforms_imagenet_train` sets it to round(255 * IMAGENET_DEFAULT_MEAN).
IMAGENET_FILL = (124, 116, 104)

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

Number = Union[int, float, tf.Tensor]
Fill = Sequence[int]

# ---------------------------------------------------------------- helpers

# The functions below use Python control flow only on Python values and build
# graphs directly; AutoGraph (which tf.data applies to map functions and
# everything they call) has nothing to convert and would only slow tracing.
_no_autograph = tf.autograph.experimental.do_not_convert


def _split(seed: tf.Tensor, num: int):
  """`num` independent int64 [2] seeds derived from `seed`."""
  seed = tf.convert_to_tensor(seed)
  return tf.unstack(tf.random.experimental.stateless_split(seed, num))


def _uniform(seed: tf.Tensor, dtype=tf.float64) -> tf.Tensor:
  """Scalar uniform in [0, 1)."""
  return tf.random.stateless_uniform([], seed=seed, dtype=dtype)


def _randint(seed: tf.Tensor, low, high) -> tf.Tensor:
  """Scalar int32 uniform in [low, high) (`high` > `low`, may be tensors)."""
  return tf.random.stateless_uniform([], seed=seed, minval=low, maxval=high,
                                     dtype=tf.int32)


def _check_uint8_rgb(image: tf.Tensor) -> tf.Tensor:
  image = tf.convert_to_tensor(image)
  if image.dtype != tf.uint8:
    raise ValueError(f'Expected a uint8 [H, W, 3] image, got dtype '
                     f'{image.dtype.name}.')
  if image.shape.rank is not None and (image.shape.rank != 3 or
                                       image.shape[-1] not in (None, 3)):
    raise ValueError(f'Expected a uint8 [H, W, 3] image, got shape '
                     f'{image.shape}.')
  return image


def _check_fill(fill: Fill) -> Tuple[int, int, int]:
  fill = tuple(int(v) for v in fill)
  if len(fill) != 3 or not all(0 <= v <= 255 for v in fill):
    raise ValueError(f'fill must be 3 ints in [0, 255], got {fill!r}.')
  return fill


def _to_uint8_trunc(x: tf.Tensor) -> tf.Tensor:
  """float -> uint8 like C's `(UINT8)` after clipping to [0, 255]."""
  return tf.cast(tf.floor(tf.clip_by_value(x, 0., 255.)), tf.uint8)


def _histograms(image: tf.Tensor) -> tf.Tensor:
  """int32 [3, 256] per-channel histograms of a uint8 [H, W, 3] image."""
  idx = tf.cast(image, tf.int32) + tf.constant([0, 256, 512], tf.int32)
  hist = tf.math.bincount(tf.reshape(idx, [-1]), minlength=768, maxlength=768,
                          dtype=tf.int32)
  return tf.reshape(hist, [3, 256])


def _apply_luts(image: tf.Tensor, luts: tf.Tensor) -> tf.Tensor:
  """PIL `Image.point`: per-channel lookup in int [3, 256] (or [256]) tables,
  whose values are clipped to [0, 255] as PIL does."""
  luts = tf.clip_by_value(tf.cast(luts, tf.int32), 0, 255)
  luts = tf.reshape(tf.broadcast_to(luts, [3, 256]), [-1])
  idx = tf.cast(image, tf.int32) + tf.constant([0, 256, 512], tf.int32)
  return tf.cast(tf.gather(luts, idx), tf.uint8)


def _ramp() -> tf.Tensor:
  return tf.range(256, dtype=tf.int32)


@_no_autograph
def grayscale(image: tf.Tensor) -> tf.Tensor:
  """PIL `convert('L')` of a uint8 [H, W, 3] image -> int32 [H, W] in [0, 255].

  ITU-R 601-2 luma in PIL's fixed point:
  (19595 R + 38470 G + 7471 B + 2**15) >> 16.
  """
  x = tf.cast(image, tf.int32)
  l = x[..., 0] * 19595 + x[..., 1] * 38470 + x[..., 2] * 7471 + 32768
  return tf.bitwise.right_shift(l, 16)


def _blend(degenerate: tf.Tensor, image: tf.Tensor,
           factor: Number) -> tf.Tensor:
  """PIL `Image.blend(degenerate, image, factor)` (as `ImageEnhance` uses it).

  float32 arithmetic as in PIL's C code: out = (UINT8) clip(d + f * (i - d))
  (truncation; clipping only matters when extrapolating, factor > 1 or < 0).
  `degenerate` broadcasts against `image`.
  """
  alpha = tf.cast(factor, tf.float32)
  d = tf.cast(degenerate, tf.float32)
  return _to_uint8_trunc(d + alpha * (tf.cast(image, tf.float32) - d))


# ------------------------------------------- lookup-table (pixel) op tables


def _invert_lut() -> tf.Tensor:
  return 255 - _ramp()


def _posterize_lut(bits: Number) -> tf.Tensor:
  shift = tf.clip_by_value(8 - tf.cast(bits, tf.int32), 0, 8)
  return tf.bitwise.bitwise_and(_ramp(), 256 - tf.bitwise.left_shift(1, shift))


def _solarize_lut(threshold: Number) -> tf.Tensor:
  ramp = _ramp()
  return tf.where(ramp < tf.cast(threshold, tf.int32), ramp, 255 - ramp)


def _solarize_add_lut(addition: Number, threshold: Number = 128) -> tf.Tensor:
  ramp = _ramp()
  added = tf.minimum(ramp + tf.cast(addition, tf.int32), 255)
  return tf.where(ramp < tf.cast(threshold, tf.int32), added, ramp)


def _auto_contrast_lut(image: tf.Tensor) -> tf.Tensor:
  nonzero = tf.cast(_histograms(image) > 0, tf.int32)
  lo = tf.argmax(nonzero, axis=1, output_type=tf.int32)
  hi = 255 - tf.argmax(nonzero[:, ::-1], axis=1, output_type=tf.int32)
  valid = hi > lo
  scale = 255. / tf.cast(tf.where(valid, hi - lo, 1), tf.float64)
  offset = -tf.cast(lo, tf.float64) * scale
  lut = tf.floor(tf.cast(_ramp(), tf.float64)[None, :] * scale[:, None] +
                 offset[:, None])
  lut = tf.cast(tf.clip_by_value(lut, 0., 255.), tf.int32)
  return tf.where(valid[:, None], lut, _ramp()[None, :])


def _equalize_lut(image: tf.Tensor) -> tf.Tensor:
  h = _histograms(image)
  nonzero = tf.cast(h > 0, tf.int32)
  last = 255 - tf.argmax(nonzero[:, ::-1], axis=1, output_type=tf.int32)
  step = (tf.reduce_sum(h, axis=1) - tf.gather(h, last, batch_dims=1)) // 255
  safe_step = tf.maximum(step, 1)[:, None]
  lut = (safe_step // 2 + tf.cumsum(h, axis=1, exclusive=True)) // safe_step
  identity = (tf.reduce_sum(nonzero, axis=1) <= 1) | (step == 0)
  return tf.where(identity[:, None], _ramp()[None, :], lut)


@_no_autograph
def invert(image: tf.Tensor) -> tf.Tensor:
  """PIL `ImageOps.invert`: 255 - x (uint8 [H, W, 3] -> same)."""
  return _apply_luts(_check_uint8_rgb(image), _invert_lut())


@_no_autograph
def posterize(image: tf.Tensor, bits: Number) -> tf.Tensor:
  """PIL `ImageOps.posterize`: keep the top `bits` bits of every channel.

  Args:
    image: uint8 [H, W, 3].
    bits: int in [0, 8]; >= 8 is the identity (timm skips PIL then), 0 gives
      black (PIL < 9 behaviour; current PIL rejects 0).
  """
  return _apply_luts(_check_uint8_rgb(image), _posterize_lut(bits))


@_no_autograph
def solarize(image: tf.Tensor, threshold: Number) -> tf.Tensor:
  """PIL `ImageOps.solarize`: x < threshold ? x : 255 - x.

  `threshold` is an int; 256 is the identity, 0 inverts everything.
  """
  return _apply_luts(_check_uint8_rgb(image), _solarize_lut(threshold))


@_no_autograph
def solarize_add(image: tf.Tensor, addition: Number,
                 threshold: Number = 128) -> tf.Tensor:
  """timm `solarize_add`: x < threshold ? min(255, x + addition) : x."""
  return _apply_luts(_check_uint8_rgb(image),
                     _solarize_add_lut(addition, threshold))


@_no_autograph
def auto_contrast(image: tf.Tensor) -> tf.Tensor:
  """PIL `ImageOps.autocontrast` (cutoff 0): per-channel min/max stretch.

  For each channel with min `lo` < max `hi`, x -> int(x * s - lo * s) with
  s = 255 / (hi - lo) (float64, truncated, clipped to [0, 255]), so that `lo`
  maps to 0 and `hi` to 255 (or 254: e.g. for [50, 100] the float64 value is
  254.99999999999997, PIL's result too); constant channels are unchanged.
  """
  image = _check_uint8_rgb(image)
  return _apply_luts(image, _auto_contrast_lut(image))


@_no_autograph
def equalize(image: tf.Tensor) -> tf.Tensor:
  """PIL `ImageOps.equalize`: per-channel histogram equalisation.

  Per channel with histogram h: step = (sum(h) - h[last non-empty bin]) // 255;
  lut[i] = (step // 2 + sum(h[:i])) // step (integer arithmetic, clipped to
  255 like `Image.point`); the identity if the channel has <= 1 distinct value
  or step == 0 (so always for images of <= 256 pixels).
  """
  image = _check_uint8_rgb(image)
  return _apply_luts(image, _equalize_lut(image))


# ----------------------------------------------- blend (ImageEnhance) ops


def _gray_degenerate(image: tf.Tensor) -> tf.Tensor:
  return grayscale(image)[..., None]


def _mean_degenerate(image: tf.Tensor) -> tf.Tensor:
  gray = grayscale(image)
  total = tf.cast(tf.reduce_sum(tf.cast(gray, tf.int64)), tf.float64)
  count = tf.cast(tf.size(gray, out_type=tf.int64), tf.float64)
  return tf.floor(total / count + 0.5)


def _black_degenerate(image: tf.Tensor) -> tf.Tensor:
  del image
  return tf.zeros([], tf.int32)


@_no_autograph
def color(image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL `ImageEnhance.Color`: blend of the grayscale image (factor 0) and
  the image (factor 1); see `grayscale` and `_blend`."""
  image = _check_uint8_rgb(image)
  return _blend(_gray_degenerate(image), image, factor)


@_no_autograph
def contrast(image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL `ImageEnhance.Contrast`: blend of a constant image (factor 0) with
  the image (factor 1). The constant is int(mean(grayscale) + 0.5)."""
  image = _check_uint8_rgb(image)
  return _blend(_mean_degenerate(image), image, factor)


@_no_autograph
def brightness(image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL `ImageEnhance.Brightness`: blend of black (factor 0) with the image
  (factor 1): (UINT8) clip(factor * x)."""
  image = _check_uint8_rgb(image)
  return _blend(_black_degenerate(image), image, factor)


@_no_autograph
def smooth(image: tf.Tensor) -> tf.Tensor:
  """PIL `image.filter(ImageFilter.SMOOTH)` of a uint8 [H, W, 3] image.

  3x3 kernel [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13, rounded to nearest (the
  exact sum / 13 is never a half-integer); the one-pixel border is copied
  unchanged, as PIL does (images smaller than 3x3 are returned unchanged).
  """
  image = _check_uint8_rgb(image)
  kernel = tf.constant([[1., 1., 1.], [1., 5., 1.], [1., 1., 1.]])
  kernel = tf.tile(kernel[:, :, None, None], [1, 1, 3, 1])
  sums = tf.nn.depthwise_conv2d(tf.cast(image, tf.float32)[None], kernel,
                                [1, 1, 1, 1], 'SAME')[0]
  smoothed = (2 * tf.cast(sums, tf.int32) + 13) // 26
  shape = tf.shape(image)
  rows = tf.range(shape[0])[:, None]
  cols = tf.range(shape[1])[None, :]
  inner = ((rows > 0) & (rows < shape[0] - 1) & (cols > 0) &
           (cols < shape[1] - 1))
  out = tf.where(inner[..., None], smoothed, tf.cast(image, tf.int32))
  return tf.cast(out, tf.uint8)


@_no_autograph
def sharpness(image: tf.Tensor, factor: Number) -> tf.Tensor:
  """PIL `ImageEnhance.Sharpness`: blend of `smooth(image)` (factor 0) with
  the image (factor 1); factor 2 sharpens."""
  image = _check_uint8_rgb(image)
  return _blend(smooth(image), image, factor)


# ---------------------------------------------------------- geometric ops


def _matrix(*values) -> tf.Tensor:
  """float64 [6] PIL affine matrix from numbers / scalar tensors."""
  return tf.stack([tf.cast(v, tf.float64) for v in values])


def _rotate_matrix(degrees: Number, height: tf.Tensor,
                   width: tf.Tensor) -> tf.Tensor:
  """PIL `Image.rotate`'s matrix (about (W / 2, H / 2), no expand)."""
  degrees = tf.math.floormod(tf.cast(degrees, tf.float64), 360.)
  angle = -degrees * (math.pi / 180.)
  cos = tf.round(tf.cos(angle) * 1e15) / 1e15
  sin = tf.round(tf.sin(angle) * 1e15) / 1e15
  cx = tf.cast(width, tf.float64) / 2.
  cy = tf.cast(height, tf.float64) / 2.
  return _matrix(cos, sin, cos * -cx + sin * -cy + cx,
                 -sin, cos, -sin * -cx + cos * -cy + cy)


@_no_autograph
def affine(image: tf.Tensor, matrix: Union[Sequence[Number], tf.Tensor],
           fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """PIL `img.transform(size, Image.AFFINE, matrix, BILINEAR, fillcolor=fill)`.

  Output pixel (x, y) (centre at (X, Y) = (x + .5, y + .5), PIL's convention)
  samples the input at (a X + b Y + c, d X + e Y + f) with (a, b, c, d, e, f)
  = `matrix`. Points outside [0, W) x [0, H) get `fill`; inside, bilinear
  interpolation with edge clamping, truncated to uint8 like PIL.

  Implemented with `ImageProjectiveTransformV3` (float32; PIL uses float64:
  a pixel can differ from PIL's by 1 where the interpolated value is within
  ~1e-3 of an integer).

  Args:
    image: uint8 [H, W, 3].
    matrix: 6 numbers / scalar tensors, or a float [6] tensor.
    fill: RGB fill of uncovered pixels.
  Returns:
    uint8 [H, W, 3].
  """
  image = _check_uint8_rgb(image)
  fill = _check_fill(fill)
  if isinstance(matrix, (list, tuple)):
    matrix = _matrix(*matrix)
  a, b, c, d, e, f = tf.unstack(tf.cast(matrix, tf.float64), num=6)
  shape = tf.shape(image)
  height, width = shape[0], shape[1]
  # PIL's coordinates of output pixel centres (float64 as in PIL) decide which
  # pixels are covered.
  xs = tf.range(tf.cast(width, tf.float64)) + 0.5
  ys = tf.range(tf.cast(height, tf.float64))[:, None] + 0.5
  x_in = a * xs + b * ys + c
  y_in = d * xs + e * ys + f
  valid = ((x_in >= 0.) & (x_in < tf.cast(width, tf.float64)) &
           (y_in >= 0.) & (y_in < tf.cast(height, tf.float64)))
  # The same map in TF's integer pixel-centre coordinates (PIL's - 0.5).
  # fill_mode NEAREST clamps coordinates to the image, which is PIL's edge
  # clamping of bilinear neighbours; uncovered pixels are filled below.
  zero = tf.zeros([], tf.float64)
  transform = tf.stack([a, b, c + 0.5 * (a + b) - 0.5,
                        d, e, f + 0.5 * (d + e) - 0.5, zero, zero])
  out = tf.raw_ops.ImageProjectiveTransformV3(
      images=tf.cast(image, tf.float32)[None],
      transforms=tf.cast(transform, tf.float32)[None],
      output_shape=shape[:2],
      fill_value=tf.constant(0., tf.float32),
      interpolation='BILINEAR',
      fill_mode='NEAREST')[0]
  # PIL truncates its float64 result; 1e-3 absorbs float32 rounding (e.g.
  # interpolating between equal values must give that value).
  out = _to_uint8_trunc(out + 1e-3)
  out = tf.where(valid[..., None], out, tf.constant(fill, tf.uint8))
  out.set_shape(image.shape)
  return out


def _size(image: tf.Tensor):
  shape = tf.shape(image)
  return shape[0], shape[1]


@_no_autograph
def rotate(image: tf.Tensor, degrees: Number,
           fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """PIL `img.rotate(degrees, BILINEAR, fillcolor=fill)`: counter-clockwise
  about the image centre (W / 2, H / 2), same size, uncovered pixels `fill`.

  The matrix is PIL's (angle taken mod 360, cos / sin rounded to 15
  decimals), so 90 degrees on a square image is exactly np.rot90.
  """
  return affine(image, _rotate_matrix(degrees, *_size(image)), fill)


@_no_autograph
def shear_x(image: tf.Tensor, factor: Number,
            fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `shear_x`: PIL affine (1, factor, 0, 0, 1, 0)."""
  return affine(image, [1., factor, 0., 0., 1., 0.], fill)


@_no_autograph
def shear_y(image: tf.Tensor, factor: Number,
            fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `shear_y`: PIL affine (1, 0, 0, factor, 1, 0)."""
  return affine(image, [1., 0., 0., factor, 1., 0.], fill)


@_no_autograph
def translate_x(image: tf.Tensor, pixels: Number,
                fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `translate_x_abs`: PIL affine (1, 0, pixels, 0, 1, 0), i.e. the
  content moves `pixels` to the left (right if negative)."""
  return affine(image, [1., 0., pixels, 0., 1., 0.], fill)


@_no_autograph
def translate_y(image: tf.Tensor, pixels: Number,
                fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `translate_y_abs`: PIL affine (1, 0, 0, 0, 1, pixels), i.e. the
  content moves `pixels` up (down if negative)."""
  return affine(image, [1., 0., 0., 0., 1., pixels], fill)


@_no_autograph
def translate_x_rel(image: tf.Tensor, fraction: Number,
                    fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `translate_x_rel`: `translate_x` by fraction * W pixels."""
  width = tf.cast(_size(image)[1], tf.float64)
  return translate_x(image, tf.cast(fraction, tf.float64) * width, fill)


@_no_autograph
def translate_y_rel(image: tf.Tensor, fraction: Number,
                    fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm `translate_y_rel`: `translate_y` by fraction * H pixels."""
  height = tf.cast(_size(image)[0], tf.float64)
  return translate_y(image, tf.cast(fraction, tf.float64) * height, fill)


# ------------------------------------------------- timm level -> argument
# Level functions map a float64 magnitude m (and a random sign, +-1, used by
# the ops where timm calls `_randomly_negate`) to the op argument.


def _random_sign(seed: tf.Tensor) -> tf.Tensor:
  """timm `_randomly_negate`: -1 or +1 with probability 1/2 (float64)."""
  return tf.where(_uniform(seed) > 0.5, tf.constant(-1., tf.float64),
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


@_no_autograph
def level_to_arg(name: str, magnitude: Number,
                 seed: tf.Tensor) -> Optional[tf.Tensor]:
  """timm `LEVEL_TO_ARG[name](magnitude)`: the op argument (float64 scalar).

  Rotate: +-m/10 * 30 degrees; ShearX/Y: +-m/10 * 0.3; TranslateX/YRel:
  +-m/10 * 0.45 of the width / height; Color/Contrast/Brightness/Sharpness:
  factor m/10 * 1.8 + 0.1; their *Increasing variants: max(0.1, 1 +- m/10 *
  0.9); Posterize: int(m/10 * 4) bits, PosterizeIncreasing: 4 - that;
  Solarize: threshold int(m/10 * 256), SolarizeIncreasing: 256 - that;
  SolarizeAdd: int(m/10 * 110). '+-' is a random sign drawn from `seed`.
  Returns None for AutoContrast, Equalize and Invert (no argument).

  Raises:
    ValueError: unknown op name.
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
  """Applies op `names[index]` (index: int32 scalar tensor) at `magnitude`.

  Equal to `apply_op(image, names[index], magnitude, seed, fill=fill)`, but
  builds one table lookup, one blend and one affine transform shared by the
  ops, instead of one full graph branch per op (about half the graph, and
  faster tracing, for `rand_augment`).
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


@_no_autograph
def apply_op(image: tf.Tensor, name: str, magnitude: Number, seed: tf.Tensor,
             *, fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """Applies one timm RandAugment op at a given (already sampled) magnitude.

  Always applies the op (no probability) and does not clip `magnitude`
  (`rand_augment` does both).

  Args:
    image: uint8 [H, W, 3].
    name: one of `OP_NAMES` (a Python string).
    magnitude: level, normally in [0, 10] (Python number or scalar tensor).
    seed: int64 [2] stateless seed (used for the random sign of some ops).
    fill: RGB fill of pixels uncovered by geometric ops.
  Returns:
    uint8 [H, W, 3].
  Raises:
    ValueError: unknown op name, bad image dtype / shape or fill.
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


@_no_autograph
def sample_magnitude(seed: tf.Tensor, magnitude: float = 9.,
                     magnitude_std: float = 0.5) -> tf.Tensor:
  """timm `AugmentOp` magnitude: float64 scalar in [0, 10].

  magnitude_std == 0: `magnitude`; inf: uniform in [0, magnitude); otherwise
  Normal(magnitude, magnitude_std); then clipped to [0, 10].
  """
  m = tf.constant(float(magnitude), tf.float64)
  if magnitude_std == float('inf'):
    m = _uniform(seed) * m
  elif magnitude_std > 0:
    m = m + magnitude_std * tf.random.stateless_normal([], seed=seed,
                                                       dtype=tf.float64)
  return tf.clip_by_value(m, 0., MAX_LEVEL)


@_no_autograph
def rand_augment(image: tf.Tensor, seed: tf.Tensor, *, num_layers: int = 2,
                 magnitude: float = 9., magnitude_std: float = 0.5,
                 increasing: bool = True,
                 fill: Fill = IMAGENET_FILL) -> tf.Tensor:
  """timm RandAugment, e.g. `rand_augment_transform('rand-m9-mstd0.5-inc1')`.

  `num_layers` times: pick an op uniformly (with replacement) from
  `RAND_INCREASING_TRANSFORMS` (or `RAND_TRANSFORMS` if not `increasing`);
  with probability 0.5 apply it at a magnitude drawn by `sample_magnitude`
  (fresh for every op), mapped to the op argument by `level_to_arg`.

  Args:
    image: uint8 [H, W, 3].
    seed: int64 [2] stateless seed.
    num_layers: ops per image (timm 'n', default 2); 0 is the identity.
    magnitude: timm 'm'; magnitude_std: timm 'mstd' (inf: uniform in
      [0, magnitude)).
    increasing: timm 'inc1' op list (severity increases with magnitude).
    fill: RGB fill of pixels uncovered by geometric ops (timm `img_mean`).
  Returns:
    uint8 [H, W, 3], same static shape.
  Raises:
    ValueError: bad image, negative num_layers / magnitude / magnitude_std,
      bad fill.
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
  for layer_seed in (_split(seed, num_layers) if num_layers else []):
    choice_seed, prob_seed, mag_seed, op_seed = _split(layer_seed, 4)
    index = _randint(choice_seed, 0, len(names))

    def augment(x=out, index=index, mag_seed=mag_seed, op_seed=op_seed):
      m = sample_magnitude(mag_seed, magnitude, magnitude_std)
      return _apply_indexed(x, names, index, m, op_seed, fill)

    # timm AugmentOp: skipped when random() > prob (0.5).
    out = tf.cond(_uniform(prob_seed) <= 0.5, augment, lambda x=out: x)
    out.set_shape(image.shape)
  return out


# --------------------------------------------------------- random erasing


@_no_autograph
def random_erasing(image: tf.Tensor, seed: tf.Tensor, *,
                   probability: float = 0.25, min_area: float = 0.02,
                   max_area: float = 1 / 3, min_aspect: float = 0.3,
                   max_count: int = 1) -> tf.Tensor:
  """timm `RandomErasing(mode='pixel')` on one normalized image.

  With probability `probability` erase `count` rectangles (count = 1 if
  max_count == 1, else uniform in [1, max_count]). Each is looked for with up
  to 10 attempts: target area uniform in [min_area, max_area] * H * W / count,
  aspect ratio log-uniform in [min_aspect, 1 / min_aspect], h =
  round(sqrt(area * aspect)), w = round(sqrt(area / aspect)) (round half to
  even, as Python's round), accepted if h < H and w < W; top-left uniform in
  [0, H - h] x [0, W - w]. Erased pixels get independent N(0, 1) values per
  pixel and channel. A rectangle with no accepted attempt is skipped.

  Args:
    image: float [H, W, C] (already normalized).
    seed: int64 [2] stateless seed.
  Returns:
    Same dtype and shape as `image`.
  Raises:
    ValueError: probability outside [0, 1], not 0 < min_area <= max_area,
      min_aspect <= 0 or max_count < 1.
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
  prob_seed, count_seed, boxes_seed = _split(seed, 3)
  log_aspect = (math.log(min_aspect), math.log(1. / min_aspect))

  def erase():
    shape = tf.shape(image)
    height, width = shape[0], shape[1]
    area = tf.cast(height * width, tf.float64)
    if max_count > 1:
      count = _randint(count_seed, 1, max_count + 1)
    else:
      count = tf.constant(1, tf.int32)
    rows = tf.range(height)[:, None]
    cols = tf.range(width)[None, :]
    out = image
    for k, box_seed in enumerate(_split(boxes_seed, max_count)):
      area_seed, aspect_seed, top_seed, left_seed, noise_seed = _split(
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
      top = _randint(top_seed, 0, height - h + 1)
      left = _randint(left_seed, 0, width - w + 1)
      box = ((rows >= top) & (rows < top + h) & (cols >= left) &
             (cols < left + w))
      noise = tf.random.stateless_normal(shape, noise_seed, dtype=image.dtype)
      out = tf.where(box[..., None], noise, out)
    return out

  out = tf.cond(_uniform(prob_seed) < probability, erase, lambda: image)
  out.set_shape(image.shape)
  return out


# ---------------------------------------------------------- mixup / cutmix


def _beta(seed: tf.Tensor, alpha: tf.Tensor) -> tf.Tensor:
  """Beta(alpha, alpha) float64 scalar from two stateless Gamma(alpha) draws."""
  seed_a, seed_b = _split(seed, 2)
  a = tf.random.stateless_gamma([], seed_a, alpha, dtype=tf.float64)
  b = tf.random.stateless_gamma([], seed_b, alpha, dtype=tf.float64)
  total = a + b
  # Both can underflow to 0 only for tiny alpha, where Beta is ~Bernoulli.
  return tf.where(total > 0., a / tf.where(total > 0., total, 1.),
                  tf.cast(a >= b, tf.float64))


@_no_autograph
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
  apply_seed, switch_seed, lam_seed, cy_seed, cx_seed = _split(seed, 5)

  do_mix = _uniform(apply_seed) < prob
  if mixup_alpha > 0 and cutmix_alpha > 0:
    use_cutmix = _uniform(switch_seed) < switch_prob
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
    cy = _randint(cy_seed, 0, height)
    cx = _randint(cx_seed, 0, width)
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
