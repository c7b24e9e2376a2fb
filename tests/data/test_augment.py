"""Tests of vit_jax.data.augment (RandAugment ops, random erasing, Mixup /
CutMix). Fast, CPU only, tiny images.

Every op is checked for its exact effect, both eagerly and inside
`tf.data.Dataset.map` (graph mode). Where PIL is importable the colour ops are
also compared with PIL itself (exactly) and the geometric ones within 1.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from vit_jax.data import augment as aug
from vit_jax.data.augment import randaugment

SEED = tf.constant([1, 2], tf.int64)
# The functions under test need no AutoGraph; converting the test lambdas
# would only cost time (and warnings about lambdas it cannot parse).
_no_autograph = tf.autograph.experimental.do_not_convert
FILL = aug.IMAGENET_FILL


def _seed(i):
  return tf.constant([i, 7], tf.int64)


def _forget_shape(t):
  """`t` with every static dimension unknown (as after decoding / cropping)."""
  t = tf.convert_to_tensor(t)
  return tf.raw_ops.PlaceholderWithDefault(input=t, shape=[None] * t.shape.rank)


def run_both(fn, *args):
  """fn(*args) eagerly and inside tf.data.Dataset.map; asserts both agree.

  In tf.data (graph mode) the inputs have unknown static shapes. Returns the
  eager result as numpy (same nesting as fn's output).
  """
  eager = tf.nest.map_structure(np.asarray, fn(*args))
  ds = tf.data.Dataset.from_tensors(tuple(args)).map(
      _no_autograph(lambda *a: fn(*[_forget_shape(t) for t in a])))
  graph = tf.nest.map_structure(np.asarray, next(iter(ds)))
  tf.nest.map_structure(np.testing.assert_array_equal, eager, graph)
  return eager


def eager(fn, *args, **kwargs):
  """fn(*args, **kwargs) eagerly, as numpy (where run_both would be slow)."""
  return tf.nest.map_structure(np.asarray, fn(*args, **kwargs))


def _image(h=8, w=8, low=0, high=256, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(low, high, (h, w, 3), dtype=np.uint8)


def _graph_map(fn, seeds):
  """[fn(seed) for seed in seeds] computed in one tf.data pipeline."""
  ds = tf.data.Dataset.from_tensor_slices(
      tf.stack([_seed(i) for i in seeds])).map(_no_autograph(fn)).batch(
          len(seeds))
  return tf.nest.map_structure(np.asarray, next(iter(ds)))


def check(x, *cases):
  """Asserts fn(image) == expected for each case (fn, expected) or (fn,
  expected, image) (default image: x), eagerly and inside tf.data (one
  pipeline for all cases). Returns the outputs; expected None: not checked."""
  images = [case[2] if len(case) > 2 else x for case in cases]
  outs = run_both(
      lambda *ims: tuple(case[0](im) for case, im in zip(cases, ims)), *images)
  for i, (case, image, out) in enumerate(zip(cases, images, outs)):
    expected = case[1]
    assert out.dtype == np.uint8 and out.shape == image.shape, i
    if expected is not None:
      np.testing.assert_array_equal(out, expected, err_msg=f'case {i}')
  return outs


# ------------------------------------------------------------- pixel ops


def test_invert():
  x = _image()
  check(x, (aug.invert, 255 - x),
        (lambda im: aug.apply_op(im, 'Invert', 3., SEED), 255 - x))


def test_posterize():
  x = _image()
  # timm level mappings: Posterize int(m / 10 * 4) bits, PosterizeIncreasing
  # 4 - that.
  check(x, (lambda im: aug.posterize(im, 4), x & 0xF0),
        (lambda im: aug.posterize(im, 1), x & 0x80),
        (lambda im: aug.posterize(im, 8), x),
        (lambda im: aug.posterize(im, 0), np.zeros_like(x)),
        (lambda im: aug.apply_op(im, 'Posterize', 10, SEED), x & 0xF0),
        (lambda im: aug.apply_op(im, 'Posterize', 7.4, SEED), x & 0xC0),
        (lambda im: aug.apply_op(im, 'PosterizeIncreasing', 5, SEED),
         x & 0xC0),
        (lambda im: aug.apply_op(im, 'PosterizeIncreasing', 10, SEED),
         np.zeros_like(x)))


def test_solarize():
  x = _image()
  solarized = np.where(x < 128, x, 255 - x)
  check(x, (lambda im: aug.solarize(im, 128), solarized),
        (lambda im: aug.solarize(im, 256), x),
        (lambda im: aug.solarize(im, 0), 255 - x),
        # SolarizeIncreasing: threshold 256 - int(m / 10 * 256): 128 at m = 5.
        (lambda im: aug.apply_op(im, 'SolarizeIncreasing', 5, SEED),
         solarized),
        # Solarize: threshold int(m / 10 * 256): 256 (identity) at m = 10.
        (lambda im: aug.apply_op(im, 'Solarize', 10, SEED), x))


def test_solarize_add():
  x = _image()
  def added(k):
    return np.where(x < 128, np.minimum(x.astype(int) + k, 255), x)
  # SolarizeAdd: int(m / 10 * 110) added below 128, clipped at 255.
  check(x, (lambda im: aug.apply_op(im, 'SolarizeAdd', 10, SEED), added(110)),
        (lambda im: aug.apply_op(im, 'SolarizeAdd', 5, SEED), added(55)),
        (lambda im: aug.solarize_add(im, 50), added(50)),
        # Clipped at 0 below, and a threshold above 255 takes every pixel.
        (lambda im: aug.solarize_add(im, -70), added(-70).clip(0)),
        (lambda im: aug.solarize_add(im, 30, 300),
         np.minimum(x.astype(int) + 30, 255)))


def test_auto_contrast():
  x = _image(low=50, high=101)
  x[0, 0] = 50
  x[0, 1] = 100
  x[..., 2] = 77  # A constant channel is left alone.
  # PIL: int(x * s - lo * s), s = 255 / (hi - lo), in float64. For [50, 100]
  # the top value lands on 254.99999999999997, so it maps to 254, not 255.
  scale = 255. / 50.
  expected = x.copy()
  expected[..., :2] = np.floor(x[..., :2] * scale - 50 * scale)
  # [60, 120] stretches to exactly [0, 255].
  y = np.array([[[60] * 3, [75] * 3, [120] * 3]], np.uint8)
  out, _ = check(x, (aug.auto_contrast, expected),
                 (aug.auto_contrast, [[[0] * 3, [63] * 3, [255] * 3]], y))
  assert out[..., :2].min() == 0 and out[..., :2].max() == 254


def test_equalize():
  # 32 x 32: channel 0 has 512 x 10, 256 x 20, 256 x 30, so PIL's
  # step = (1024 - 256) // 255 = 3 and lut[v] = (1 + #pixels below v) // 3:
  # 10 -> 0, 20 -> 513 // 3 = 171, 30 -> 769 // 3 = 256, clipped to 255.
  # Channel 1 is constant (identity); channel 2 has 1000 x 3 and 24 x 9:
  # step = 1000 // 255 = 3, 3 -> 0, 9 -> 1001 // 3 = 333 -> 255.
  x = np.zeros((32, 32, 3), np.uint8)
  x[:16, :, 0] = 10
  x[16:24, :, 0] = 20
  x[24:, :, 0] = 30
  x[..., 1] = 42
  x[..., 2] = 3
  x[0, :24, 2] = 9
  expected = np.stack([
      np.select([x[..., 0] == 10, x[..., 0] == 20], [0, 171], 255),
      x[..., 1], np.where(x[..., 2] == 3, 0, 255)], axis=-1)
  # Too few pixels for a step (step == 0): identity.
  small = _image(15, 15)
  check(x, (aug.equalize, expected),
        (lambda im: aug.apply_op(im, 'Equalize', 0., SEED), expected),
        (aug.equalize, small, small))


def test_brightness():
  x = _image()
  check(x, (lambda im: aug.brightness(im, 1.), x),
        (lambda im: aug.brightness(im, 0.), np.zeros_like(x)),
        (lambda im: aug.brightness(im, 0.5), x // 2),
        (lambda im: aug.brightness(im, 2.), np.minimum(2 * x.astype(int), 255)))


def _luma(x):
  x = x.astype(np.int64)
  return (19595 * x[..., 0] + 38470 * x[..., 1] + 7471 * x[..., 2] +
          32768) >> 16


def test_color():
  x = _image()
  gray = np.repeat(_luma(x)[..., None], 3, axis=-1)
  # factor 2 extrapolates away from gray: clip(2 x - gray).
  check(x, (lambda im: aug.color(im, 0.), gray),
        (lambda im: aug.color(im, 1.), x),
        (lambda im: aug.color(im, 2.), np.clip(2 * x.astype(int) - gray, 0,
                                               255)))


def test_contrast():
  x = _image()
  mean = math.floor(_luma(x).mean() + 0.5)
  check(x, (lambda im: aug.contrast(im, 0.), np.full_like(x, mean)),
        (lambda im: aug.contrast(im, 1.), x),
        (lambda im: aug.contrast(im, 2.),
         np.clip(2 * x.astype(int) - mean, 0, 255)))


def test_sharpness():
  x = _image(5, 6)
  smoothed = x.copy()
  kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]])
  for i in range(1, 4):
    for j in range(1, 5):
      for c in range(3):
        s = (kernel * x[i - 1:i + 2, j - 1:j + 2, c]).sum()
        smoothed[i, j, c] = math.floor(s / 13 + 0.5)
  tiny = _image(2, 5)
  check(x, (aug.smooth, smoothed),
        (lambda im: aug.sharpness(im, 0.), smoothed),
        (lambda im: aug.sharpness(im, 1.), x),
        (lambda im: aug.sharpness(im, 2.),
         np.clip(2 * x.astype(int) - smoothed, 0, 255)),
        # Images too small for the 3x3 kernel are unchanged.
        (aug.smooth, tiny, tiny))


def test_enhance_level_mapping():
  x = _image()
  # Non-increasing: factor m / 10 * 1.8 + 0.1; increasing: 1 +- m / 10 * 0.9
  # with a random sign, so 1 (identity) at m = 0.
  cases = [(lambda im: aug.apply_op(im, 'Brightness', 5, SEED), x),
           (lambda im: aug.apply_op(im, 'Brightness', 0, SEED),
            np.floor(x * np.float32(0.1)))]
  for name in ('ColorIncreasing', 'ContrastIncreasing', 'BrightnessIncreasing',
               'SharpnessIncreasing'):
    cases.append((lambda im, n=name: aug.apply_op(im, n, 0, SEED), x))
  check(x, *cases)
  factors = {float(aug.level_to_arg('BrightnessIncreasing', 10, _seed(i)))
             for i in range(8)}
  np.testing.assert_allclose(sorted(factors), [0.1, 1.9])
  np.testing.assert_allclose(float(aug.level_to_arg('Sharpness', 9, SEED)),
                             1.72)


# --------------------------------------------------------- geometric ops


def test_rotate():
  x = _image(7, 7)
  y = _image(4, 6)
  # Counter-clockwise, like PIL's Image.rotate and np.rot90.
  # 90 degrees on a non-square image: rotated core, fill elsewhere.
  expected = np.empty_like(y)
  expected[:] = FILL
  expected[:, 1:5] = np.rot90(y)[1:5]
  outs = check(x, (lambda im: aug.rotate(im, 0.), x),
               (lambda im: aug.rotate(im, 360.), x),
               (lambda im: aug.rotate(im, 90.), np.rot90(x)),
               (lambda im: aug.rotate(im, -90.), np.rot90(x, -1)),
               (lambda im: aug.rotate(im, 180.), np.rot90(x, 2)),
               (lambda im: aug.rotate(im, 450.), np.rot90(x)),
               (lambda im: aug.rotate(im, 90.), expected, y),
               (lambda im: aug.rotate(im, 45., fill=(1, 2, 3)), None,
                _image(16, 16)))
  # Corners of a 45-degree rotation are uncovered.
  out = outs[-1]
  for i, j in ((0, 0), (0, 15), (15, 0), (15, 15)):
    np.testing.assert_array_equal(out[i, j], [1, 2, 3])
  # Rotate level: +-m / 10 * 30 degrees, both signs occur.
  args = {float(aug.level_to_arg('Rotate', 10, _seed(i))) for i in range(8)}
  assert args == {-30., 30.}
  assert abs(float(aug.level_to_arg('Rotate', 5, SEED))) == 15.
  deg = aug.level_to_arg('Rotate', 9, SEED)
  assert abs(float(deg)) == pytest.approx(27.)
  np.testing.assert_array_equal(eager(aug.apply_op, x, 'Rotate', 9, SEED),
                                eager(aug.rotate, x, deg))


def test_translate():
  x = _image(8, 10)
  def shifted(dx=0, dy=0, fill=FILL):
    out = np.empty_like(x)
    out[:] = fill
    src = x[max(dy, 0):8 + min(dy, 0), max(dx, 0):10 + min(dx, 0)]
    out[max(-dy, 0):max(-dy, 0) + src.shape[0],
        max(-dx, 0):max(-dx, 0) + src.shape[1]] = src
    return out
  # PIL's (1, 0, k, 0, 1, 0) samples x + k: the content moves k to the left.
  check(x, (lambda im: aug.translate_x(im, 3.), shifted(dx=3)),
        (lambda im: aug.translate_x(im, -2.), shifted(dx=-2)),
        (lambda im: aug.translate_y(im, 2., fill=(9, 9, 9)),
         shifted(dy=2, fill=9)),
        (lambda im: aug.translate_x_rel(im, 0.5), shifted(dx=5)),
        (lambda im: aug.translate_y_rel(im, -0.25), shifted(dy=-2)),
        # Fractional shifts interpolate bilinearly (PIL truncates).
        (lambda im: aug.translate_x(im, 0.75),
         [[[75] * 3, [175] * 3, [87] * 3, list(FILL)]],
         np.array([[[0] * 3, [100] * 3, [200] * 3, [50] * 3]], np.uint8)))
  # TranslateXRel / YRel at m = 10: +-0.45 of the width / height (9 of 20).
  x = _image(20, 20)
  for name in ('TranslateXRel', 'TranslateYRel'):
    signs = set()
    for i in range(4):
      pct = float(aug.level_to_arg(name, 10, _seed(i)))
      assert abs(pct) == pytest.approx(0.45)
      signs.add(pct > 0)
      move = (aug.translate_x if name == 'TranslateXRel' else aug.translate_y)
      np.testing.assert_array_equal(
          eager(aug.apply_op, x, name, 10, _seed(i)),
          eager(move, x, 9. if pct > 0 else -9.))
    assert signs == {True, False}


def test_shear_constant_image():
  x = np.full((12, 16, 3), 77, np.uint8)
  xs, ys = np.meshgrid(np.arange(16) + 0.5, np.arange(12) + 0.5)
  cases = []
  for name, factor in (('x', 0.3), ('x', -0.3), ('y', 0.25)):
    # Covered pixels keep the constant; the rest get the fill.
    if name == 'x':
      inside = (xs + factor * ys >= 0) & (xs + factor * ys < 16)
    else:
      inside = (ys + factor * xs >= 0) & (ys + factor * xs < 12)
    assert inside.mean() > 0.7
    fn = aug.shear_x if name == 'x' else aug.shear_y
    cases.append((lambda im, fn=fn, f=factor: fn(im, f),
                  np.where(inside[..., None], x, FILL)))
  check(x, *cases)
  args = {float(aug.level_to_arg('ShearY', 10, _seed(i))) for i in range(8)}
  np.testing.assert_allclose(sorted(args), [-0.3, 0.3])


def test_ops_against_pil():
  pil_image = pytest.importorskip('PIL.Image')
  ops = pytest.importorskip('PIL.ImageOps')
  enhance = pytest.importorskip('PIL.ImageEnhance')
  rng = np.random.default_rng(3)
  mismatched = total = 0
  for trial in range(8):
    h, w = rng.integers(3, 14, 2)
    x = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    if trial % 3 == 1:
      x = (x // 4 + 90).astype(np.uint8)  # Narrow range.
    im = pil_image.fromarray(x)
    f = float(rng.uniform(0.1, 1.9))
    exact = {
        'autocontrast': (aug.auto_contrast(x), ops.autocontrast(im)),
        'equalize': (aug.equalize(x), ops.equalize(im)),
        'posterize': (aug.posterize(x, 3), ops.posterize(im, 3)),
        'solarize': (aug.solarize(x, 100), ops.solarize(im, 100)),
        'color': (aug.color(x, f), enhance.Color(im).enhance(f)),
        'contrast': (aug.contrast(x, f), enhance.Contrast(im).enhance(f)),
        'brightness': (aug.brightness(x, f), enhance.Brightness(im).enhance(f)),
        'sharpness': (aug.sharpness(x, f), enhance.Sharpness(im).enhance(f)),
    }
    for name, (ours, theirs) in exact.items():
      np.testing.assert_array_equal(ours.numpy(), np.asarray(theirs),
                                    err_msg=name)
    deg, sh, tr = (float(v) for v in rng.uniform(-1, 1, 3) * [30, .3, .45])
    kw = dict(resample=pil_image.BILINEAR, fillcolor=FILL)
    affine = pil_image.AFFINE
    close = {
        'rotate': (aug.rotate(x, deg), im.rotate(deg, **kw)),
        'shear_x': (aug.shear_x(x, sh),
                    im.transform((w, h), affine, (1, sh, 0, 0, 1, 0), **kw)),
        'shear_y': (aug.shear_y(x, sh),
                    im.transform((w, h), affine, (1, 0, 0, sh, 1, 0), **kw)),
        'translate_x': (aug.translate_x_rel(x, tr),
                        im.transform((w, h), affine, (1, 0, tr * w, 0, 1, 0),
                                     **kw)),
        'translate_y': (aug.translate_y_rel(x, tr),
                        im.transform((w, h), affine, (1, 0, 0, 0, 1, tr * h),
                                     **kw)),
    }
    for name, (ours, theirs) in close.items():
      diff = np.abs(ours.numpy().astype(int) - np.asarray(theirs).astype(int))
      assert diff.max() <= 1, name
      mismatched += (diff > 0).sum()
      total += diff.size
  assert mismatched <= 0.0005 * total  # float64 coordinates: 0 here (float32 ones: 8).


# ------------------------------------------------------------ RandAugment


def test_op_lists():
  assert len(aug.RAND_INCREASING_TRANSFORMS) == 15
  assert len(aug.RAND_TRANSFORMS) == 15
  assert set(aug.RAND_TRANSFORMS) | set(aug.RAND_INCREASING_TRANSFORMS) == set(
      aug.OP_NAMES)
  assert aug.level_to_arg('Invert', 9, SEED) is None
  with pytest.raises(ValueError, match='Unknown augmentation op'):
    aug.apply_op(_image(), 'Cutout', 5, SEED)


def test_apply_every_op():
  x = _image(20, 20)  # Equalize needs > 256 pixels to do anything.
  outs = run_both(
      lambda im: tuple(aug.apply_op(im, n, 9., SEED) for n in aug.OP_NAMES), x)
  for name, out in zip(aug.OP_NAMES, outs):
    assert out.shape == x.shape and out.dtype == np.uint8, name
    assert not np.array_equal(out, x), name  # m = 9 changes a noise image.


def test_sample_magnitude():
  np.testing.assert_equal(float(aug.sample_magnitude(SEED, 9., 0.)), 9.)
  m = _graph_map(lambda s: aug.sample_magnitude(s, 9., 0.5), range(400))
  assert m.min() >= 0. and m.max() == 10.  # Clipped at 10 (~2% of draws).
  assert abs(m.mean() - 9.) < 0.1 and 0.4 < m.std() < 0.55
  m = _graph_map(lambda s: aug.sample_magnitude(s, 2., 5.), range(400))
  assert m.min() == 0. and m.max() == 10.
  m = _graph_map(lambda s: aug.sample_magnitude(s, 4., float('inf')),
                 range(400))
  assert 0. <= m.min() and m.max() < 4. and abs(m.mean() - 2.) < 0.2


def test_rand_augment():
  x = _image(20, 20, low=60, high=190)
  # The default (2 layers) for 200 seeds in one tf.data pipeline, with
  # unknown static shapes.
  outs = _graph_map(lambda s: aug.rand_augment(_forget_shape(x), s),
                    range(200))
  assert outs.shape == (200,) + x.shape and outs.dtype == np.uint8
  for i in range(3):  # Same results eagerly.
    np.testing.assert_array_equal(eager(aug.rand_augment, x, _seed(i)),
                                  outs[i])
  np.testing.assert_array_equal(eager(aug.rand_augment, x, SEED, num_layers=0),
                                x)
  # Every op changes this image, so it is unchanged only when both ops are
  # skipped (op probability 0.5 each).
  unchanged = np.mean([np.array_equal(o, x) for o in outs])
  assert 0.17 < unchanged < 0.33
  # Different seeds, different results.
  assert len({o.tobytes() for o in outs}) > 80


def test_rand_augment_uses_apply_op():
  # rand_augment applies the chosen op through one shared LUT / blend / affine
  # graph; it must equal apply_op for every op of both lists.
  x = _image(20, 20)
  for names in (aug.RAND_INCREASING_TRANSFORMS, aug.RAND_TRANSFORMS):
    for i, name in enumerate(names):
      seed = _seed(i)
      np.testing.assert_array_equal(
          randaugment._apply_switch(x, names, tf.constant(i), 7.3, randaugment._sign(
              tf.random.stateless_uniform([], seed, dtype=tf.float64)), FILL),
          aug.apply_op(x, name, 7.3, seed), err_msg=name)


def test_rand_augment_options_and_errors():
  x = _image(6, 9)
  differ = [
      not np.array_equal(
          eager(aug.rand_augment, x, _seed(i)),
          eager(aug.rand_augment, x, _seed(i), increasing=False,
                magnitude=10, magnitude_std=0, fill=(0, 0, 0)))
      for i in range(6)]
  assert any(differ)
  # A plain function in ds.map goes through AutoGraph, as in real pipelines.
  def augment(image):
    return aug.rand_augment(image, SEED, num_layers=1)
  out = next(iter(tf.data.Dataset.from_tensors(x).map(augment)))
  np.testing.assert_array_equal(
      out, eager(aug.rand_augment, x, SEED, num_layers=1))
  with pytest.raises(ValueError, match='uint8'):
    aug.rand_augment(x.astype(np.float32), SEED)
  with pytest.raises(ValueError, match='num_layers'):
    aug.rand_augment(x, SEED, num_layers=-1)
  with pytest.raises(ValueError, match='fill'):
    aug.rand_augment(x, SEED, fill=(1, 2))


# --------------------------------------------------------- random erasing


def _erased_box(x, out):
  """(top, left, h, w) of the changed pixels, asserting they form a box."""
  changed = np.any(out != x, axis=-1)
  if not changed.any():
    return None
  rows = np.flatnonzero(changed.any(axis=1))
  cols = np.flatnonzero(changed.any(axis=0))
  top, left = rows[0], cols[0]
  h, w = rows[-1] - top + 1, cols[-1] - left + 1
  assert changed[top:top + h, left:left + w].all()
  assert changed.sum() == h * w
  return top, left, h, w


def test_random_erasing():
  x = np.random.default_rng(0).normal(size=(16, 16, 3)).astype(np.float32)
  for i in range(3):
    run = run_both if i == 0 else eager
    np.testing.assert_array_equal(
        run(lambda im, s: aug.random_erasing(im, s, probability=0.),
            x, _seed(i)), x)
  areas = []
  for i in range(12):
    run = run_both if i == 0 else eager
    out = run(lambda im, s: aug.random_erasing(im, s, probability=1.),
              x, _seed(i))
    assert out.dtype == np.float32 and out.shape == x.shape
    box = _erased_box(x, out)
    if box is None:  # No attempt fitted (rare): nothing changed.
      continue
    top, left, h, w = box
    assert h < 16 and w < 16
    # h, w are rounded from a target area in [min_area, max_area] * H * W.
    assert (h + .5) * (w + .5) >= 0.02 * 256
    assert (h - .5) * (w - .5) <= 256 / 3
    areas.append(h * w / 256)
    erased = out[top:top + h, left:left + w]
    assert np.all(erased != x[top:top + h, left:left + w])
    # Per pixel and per channel values.
    assert not np.allclose(erased[..., 0], erased[..., 1])
    assert len(np.unique(erased)) == erased.size
  assert len(areas) >= 10 and len(set(areas)) > 3
  # The erasing probability (timm T2T-ViT / DeiT default 0.25).
  outs = _graph_map(lambda s: aug.random_erasing(x, s), range(400))
  erased = np.mean([_erased_box(x, o) is not None for o in outs])
  assert 0.18 < erased < 0.32
  noise = np.concatenate([o[o != x] for o in outs])
  assert abs(noise.mean()) < 0.1 and abs(noise.std() - 1.) < 0.1


def test_random_erasing_options_and_errors():
  x = np.zeros((16, 16, 3), np.float32)
  # Several boxes (count uniform in [1, 3], area split between them).
  outs = _graph_map(
      lambda s: aug.random_erasing(x, s, probability=1., max_count=3),
      range(20))
  assert all(np.any(o != 0) for o in outs)
  # Nothing fits (min area ~ the whole image): unchanged.
  out = aug.random_erasing(x, SEED, probability=1., min_area=0.99,
                           max_area=1., min_aspect=0.99)
  np.testing.assert_array_equal(out.numpy(), x)
  for kwargs in (dict(probability=1.5), dict(probability=-0.1),
                 dict(min_area=0.5, max_area=0.2), dict(min_aspect=0.),
                 dict(max_count=0)):
    with pytest.raises(ValueError):
      aug.random_erasing(x, SEED, **kwargs)
  with pytest.raises(ValueError, match='float'):
    aug.random_erasing(x.astype(np.uint8), SEED)


# ----------------------------------------------------------- mixup/cutmix


def _batch(b=4, h=8, w=8, k=5):
  images = np.broadcast_to(np.arange(1, b + 1, dtype=np.float32)[:, None, None,
                                                                   None],
                           (b, h, w, 3)).copy()
  labels = np.eye(k, dtype=np.float32)[np.arange(b) % k]
  return images, labels


def test_cutmix():
  images, labels = _batch()
  b = len(images)
  fractions = []
  for i in range(12):
    run = run_both if i == 0 else eager
    out, y, lam = run(
        lambda x, l, s: aug.mixup_cutmix(x, l, s, mixup_alpha=0.,
                                         return_lam=True),
        images, labels, _seed(i))
    boxes = set()
    for j in range(b):
      partner = b - j
      from_partner = out[j] == partner
      assert np.all(from_partner | (out[j] == j + 1))
      frac = from_partner[..., 0].mean()
      np.testing.assert_allclose(frac, 1. - lam, atol=1e-6)
      np.testing.assert_allclose(y[j], lam * labels[j] + (1 - lam) *
                                 labels[b - 1 - j], atol=1e-6)
      np.testing.assert_allclose(y[j, (b - 1 - j) % 5], frac, atol=1e-6)
      if frac:
        boxes.add(_erased_box(images[j], out[j]))
    assert len(boxes) <= 1  # One box for the whole batch.
    for top, left, h, w in boxes:
      # timm rand_bbox: rows cy -+ cut // 2 (cut = int(8 sqrt(1 - lam)) for
      # both sides of this square image), clipped to the image; an unclipped
      # side is therefore even, and two unclipped sides are equal.
      clipped_y = top == 0 or top + h == 8
      clipped_x = left == 0 or left + w == 8
      assert clipped_y or h % 2 == 0
      assert clipped_x or w % 2 == 0
      assert clipped_y or clipped_x or h == w
    fractions.append(1. - lam)
  assert len(set(fractions)) > 3 and max(fractions) > 0


def test_mixup():
  images, labels = _batch()
  for i in range(4):
    run = run_both if i == 0 else eager
    out, y, lam = run(
        lambda x, l, s: aug.mixup_cutmix(x, l, s, cutmix_alpha=0.,
                                         return_lam=True),
        images, labels, _seed(i))
    assert 0. < lam < 1.
    np.testing.assert_allclose(out, lam * images + (1 - lam) * images[::-1],
                               rtol=1e-6)
    np.testing.assert_allclose(y, lam * labels + (1 - lam) * labels[::-1],
                               rtol=1e-6)
    np.testing.assert_allclose(y.sum(-1), 1., rtol=1e-6)
  # Two-value result without return_lam.
  out, y = aug.mixup_cutmix(images, labels, SEED)
  assert out.shape == images.shape and y.shape == labels.shape


def test_mixup_cutmix_choice_probability_and_determinism():
  images, labels = _batch()
  # prob = 0: unchanged, lam = 1.
  out, y, lam = run_both(
      lambda x, l, s: aug.mixup_cutmix(x, l, s, prob=0., return_lam=True),
      images, labels, SEED)
  np.testing.assert_array_equal(out, images)
  np.testing.assert_array_equal(y, labels)
  assert lam == 1.
  # switch_prob 1: always CutMix (only values of the two images); 0: Mixup.
  # lam ~ Beta(0.8, 0.8) for Mixup: mean 1/2, variance 1 / (4 (2 a + 1)).
  def per_seed(s):
    return tuple(aug.mixup_cutmix(images, labels, s, switch_prob=p)[0]
                 for p in (1., 0., 0.5)) + (
                     aug.mixup_cutmix(images, labels, s, cutmix_alpha=0.,
                                      return_lam=True)[2],)
  always, never, half, lams = _graph_map(per_seed, range(400))
  def is_cutmix(outs):
    return [bool(np.all(np.isin(o, images))) for o in outs[:100]]
  assert all(is_cutmix(always))
  assert not any(is_cutmix(never))
  assert 0.3 < np.mean(is_cutmix(half)) < 0.7
  assert abs(lams.mean() - 0.5) < 0.05
  assert abs(lams.var() - 1 / (4 * 2.6)) < 0.02
  # Same seed, same result; different seeds, different results.
  a = aug.mixup_cutmix(images, labels, SEED, return_lam=True)
  b = aug.mixup_cutmix(images, labels, SEED, return_lam=True)
  tf.nest.map_structure(np.testing.assert_array_equal, a, b)
  c = aug.mixup_cutmix(images, labels, _seed(99), return_lam=True)
  assert float(a[2]) != float(c[2])


def test_mixup_cutmix_odd_batch_and_errors():
  images, labels = _batch(b=3, h=6, w=10)  # Odd batch: middle with itself.
  out, y, lam = run_both(
      lambda x, l, s: aug.mixup_cutmix(x, l, s, mixup_alpha=0.,
                                       return_lam=True),
      images, labels, SEED)
  np.testing.assert_array_equal(out[1], images[1])
  np.testing.assert_array_equal(y[1], labels[1])
  assert not np.array_equal(out, images)  # lam < 1 for this seed.
  for kwargs, match in ((dict(mixup_alpha=-1.), 'alpha'),
                        (dict(cutmix_alpha=-0.1), 'alpha'),
                        (dict(mixup_alpha=0., cutmix_alpha=0.), 'alpha'),
                        (dict(prob=1.5), 'prob'),
                        (dict(switch_prob=-0.5), 'switch_prob')):
    with pytest.raises(ValueError, match=match):
      aug.mixup_cutmix(images, labels, SEED, **kwargs)


def test_imagenet_normalization_same_with_static_and_unknown_shapes():
  from vit_jax.data import preprocess  # pylint: disable=g-import-not-at-top
  x = np.random.default_rng(0).uniform(0, 255, (2, 5, 4, 3)).astype(np.float32)
  expected = (x / 255. - np.float32(preprocess.IMAGENET_MEAN)) / np.float32(
      preprocess.IMAGENET_STD)
  static = preprocess.normalize(tf.constant(x), 'imagenet')
  dynamic = run_both(lambda im: preprocess.normalize(im, 'imagenet'), x)
  np.testing.assert_allclose(static, expected, rtol=1e-6)
  np.testing.assert_array_equal(static, dynamic)
