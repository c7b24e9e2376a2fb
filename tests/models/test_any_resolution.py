"""Any resolution (issue 41): the learned position table resampled in the model at any input
size (timm's ``dynamic_img_size``; vit_jax.models.resample), and FlexiViT's pseudo-inverse
resize of the patch-embedding kernel (vit_jax.checkpoint.resample_patchemb)."""

import json
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax.checkpoint import finetune
from vit_jax import models
from vit_jax.models import resample
from vit_jax.models import vit

FIXTURES = pathlib.Path(__file__).parents[1] / 'fixtures' / 'any_resolution'
TIMM_METHOD = {'aa': 'bicubic_antialias', 'noaa': 'bicubic'}
# A tiny ViT: 7 px patches, 28 px -> a 4x4 grid (17 table rows with the class token).
TINY = dict(num_classes=5, patch_size=7, hidden_size=16, mlp_dim=32, num_heads=2, num_layers=1)


def _timm():
  with np.load(FIXTURES / 'timm_resample.npz', allow_pickle=False) as f:
    arrays = dict(f)
  return arrays, json.loads((FIXTURES / 'checks.json').read_text())


def _cases():
  _, checks = _timm()
  return [(case, aa) for case in checks['cases'] for aa in TIMM_METHOD]


def _apply(model, variables, images, **kwargs):
  return np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, images),
                    **kwargs)


def _tiny_variables(model, size=(28, 28), seed=0):
  """``model``'s variables at ``size`` re-drawn from a seeded N(0, 0.5^2): nothing zero, a table
  large enough that any resampling error moves the logits."""
  shapes = models.unbox(models.abstract_variables(model, size))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.normal(scale=0.5, size=s.shape).astype(np.float32), shapes)


def _images(*shape, seed=1):
  return np.random.default_rng(seed).uniform(-1, 1, size=(2, *shape, 3)).astype(np.float32)


def _with_table(variables, table):
  out = jax.tree.map(lambda x: x, variables)
  out['params']['Transformer']['posembed_input']['pos_embedding'] = table
  return out


# ------------------------------------------------------------------------------ interpolation


@pytest.mark.parametrize('case,aa', _cases())
def test_posemb_resize_matches_timm(case, aa):
  """timm's resample_abs_pos_embed (bicubic, antialias or not; up, down, non-square, no prefix,
  class token + 4 registers from a 2x3 grid): the model's resize within 1e-6."""
  arrays, checks = _timm()
  table_key, new, old, prefix = checks['cases'][case]
  table, want = arrays[table_key], arrays[f'pos/{case}/{aa}']
  method = TIMM_METHOD[aa]
  kwargs = dict(num_prefix_tokens=prefix, old_grid=old, method=method)
  np.testing.assert_allclose(resample.resample_posemb(table, new, **kwargs), want, rtol=0,
                             atol=1e-6)  # NumPy (the loaders): float64 maths.
  # In the model: AddPositionEmbs adds the table resampled to the input's grid to zeros.
  module = vit.AddPositionEmbs(resize=method, table_grid=old)
  tokens = jnp.zeros((1, prefix + new[0] * new[1], table.shape[2]))
  got = jax.jit(lambda t, x: module.apply({'params': {'pos_embedding': t}}, x, new))(table, tokens)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(got[:, :prefix], table[:, :prefix])  # Prefix rows kept.


def test_resize_matrices():
  """Rows sum to 1; 'linear_corners' keeps the corners and is scipy's zoom(order=1) except
  where scipy's default mode returns 0 for the last sample (32 -> 16); identity at one size."""
  from scipy import ndimage  # pylint: disable=g-import-not-at-top
  for method in resample.RESIZE_METHODS:
    for old, new in ((4, 6), (6, 4), (5, 2), (1, 3), (3, 1), (7, 7)):
      weights = resample.resize_matrix(old, new, method)
      assert weights.shape == (new, old)
      np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-12)
      if old == new:
        np.testing.assert_array_equal(weights, np.eye(old))
  x = np.random.default_rng(0).normal(size=(8, 3))
  for old, new in ((8, 12), (8, 5), (8, 1)):
    got = resample.resize_matrix(old, new, 'linear_corners') @ x[:old]
    np.testing.assert_allclose(got, ndimage.zoom(x[:old], (new / old, 1), order=1), atol=1e-12)
  ramp = np.arange(32, dtype=np.float64)
  assert ndimage.zoom(ramp, 0.5, order=1)[-1] == 0.0  # scipy 1.17: 15 * (31 / 15) > 31.
  got = resample.resize_matrix(32, 16, 'linear_corners') @ ramp
  np.testing.assert_allclose(got, np.arange(16) * 31 / 15, atol=1e-12)
  # torch's bicubic, upsampling 2x: a = -0.75 at half-pixel centres (output 3 at input 1.25),
  # the tap left of the edge clamped onto sample 0 (output 2 at 0.75).
  np.testing.assert_allclose(resample.resize_matrix(4, 8, 'bicubic')[2:4], [
      [-0.03515625 + 0.26171875, 0.87890625, -0.10546875, 0],
      [-0.10546875, 0.87890625, 0.26171875, -0.03515625]], atol=1e-12)
  with pytest.raises(ValueError, match=r"Unknown resize method 'cubic': use one of "
                     r"\('linear_corners', 'bicubic', 'bicubic_antialias'\)"):
    resample.resize_matrix(4, 8, 'cubic')


def test_loader_resize_is_the_models():
  """checkpoint.resize_posemb (the official fine-tuning resize) = the model's resize."""
  table = np.random.default_rng(3).normal(size=(1, 1 + 16, 8)).astype(np.float32)
  loader = checkpoint.resize_posemb(table, 1 + 5 * 7, has_class_token=True, new_grid=(5, 7))
  in_model = resample.resample_posemb(jnp.asarray(table), (5, 7), num_prefix_tokens=1)
  np.testing.assert_allclose(loader, in_model, rtol=0, atol=1e-6)
  assert loader.dtype == np.float32
  np.testing.assert_array_equal(loader[0, [1, 7, 29, 35]], table[0, [1, 4, 13, 16]])  # Corners.


# --------------------------------------------------------------------- the model at any size


class _AddPositionEmbsBefore(nn.Module):
  """AddPositionEmbs as it was before issue 41 (commit 77d4c39), taking the new arguments."""

  posemb_init: Any = nn.initializers.normal(stddev=0.02)
  param_dtype: Any = jnp.float32
  resize: str = 'linear_corners'
  table_grid: Any = None

  @nn.compact
  def __call__(self, inputs, grid=None):
    del grid
    shape = (1, inputs.shape[1], inputs.shape[2])
    pos_embedding = self.param('pos_embedding', nn.with_logical_partitioning(
        self.posemb_init, (None, 'length', 'embed')), shape, self.param_dtype)
    return inputs + pos_embedding.astype(inputs.dtype)


def test_init_size_logits_are_bit_identical_to_before(monkeypatch):
  """At the size the table was made for nothing is resampled: bit for bit the logits of the
  position embedding before issue 41, whatever posemb_resize says; within 1e-6 of the fixture
  the code before issue 41 computed (bit for bit on the jax 0.10.2 CPU it was made on)."""
  model = models.VisionTransformer(**TINY)
  variables = _tiny_variables(model)
  images = _images(28, 28)
  logits = {m: _apply(models.VisionTransformer(**TINY, posemb_resize=m), variables, images)
            for m in resample.RESIZE_METHODS}
  monkeypatch.setattr(vit, 'AddPositionEmbs', _AddPositionEmbsBefore)
  before = _apply(models.VisionTransformer(**TINY), variables, images)
  for method in resample.RESIZE_METHODS:
    np.testing.assert_array_equal(logits[method], before, err_msg=method)
  with np.load(FIXTURES / 'before_issue41.npz', allow_pickle=False) as fixture:
    np.testing.assert_array_equal(variables['params']['embedding']['kernel'],
                                  fixture['embedding_kernel'])  # The same weights drawn.
    np.testing.assert_allclose(before, fixture['logits_28'], rtol=0, atol=1e-6)


@pytest.mark.parametrize('method', ['linear_corners', 'bicubic_antialias'])
def test_a_model_made_at_28px_applies_at_56px_and_28x42px(method):
  """Trained at 28 px (4x4 grid), applied at 56 px (8x8) and 28x42 px (4x6): the logits of the
  same weights with the table resized explicitly by the same function."""
  model = models.VisionTransformer(**TINY, posemb_resize=method)
  variables = _tiny_variables(model)
  table = variables['params']['Transformer']['posembed_input']['pos_embedding']
  for shape, grid in (((56, 56), (8, 8)), ((28, 42), (4, 6))):
    images = _images(*shape)
    logits = _apply(model, variables, images)
    assert logits.shape == (2, 5) and np.isfinite(logits).all()
    resized = resample.resample_posemb(jnp.asarray(table), grid, num_prefix_tokens=1,
                                       method=method)
    explicit = _apply(model, _with_table(variables, np.asarray(resized)), images)
    np.testing.assert_allclose(logits, explicit, rtol=0, atol=1e-6)
    # Not the logits of another resize: the method matters.
    other = 'bicubic' if method == 'linear_corners' else 'linear_corners'
    assert np.abs(_apply(models.VisionTransformer(**TINY, posemb_resize=other), variables,
                         images) - logits).max() > 1e-3


def test_training_at_another_size_updates_the_init_table():
  """At 56 px with dropout: the gradient reaches the 28 px table through the resize (the class
  row's own gradient included), in its own shape."""
  model = models.VisionTransformer(**TINY, dropout_rate=0.1)
  variables = _tiny_variables(model)
  images, labels = _images(56, 56), jax.nn.one_hot(jnp.array([1, 3]), 5)

  def loss(params, table_fn=lambda t: t):
    params = jax.tree.map(lambda x: x, params)
    entry = params['Transformer']['posembed_input']
    entry['pos_embedding'] = table_fn(entry['pos_embedding'])
    logits = model.apply({'params': params}, images, train=True,
                         rngs={'dropout': jax.random.key(0)})
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))

  grads = jax.jit(jax.grad(loss))(variables['params'])
  got = grads['Transformer']['posembed_input']['pos_embedding']
  assert got.shape == (1, 17, 16) and np.isfinite(got).all() and np.abs(got).min() > 0
  explicit = jax.jit(jax.grad(lambda p: loss(p, lambda t: resample.resample_posemb(
      t, (8, 8), num_prefix_tokens=1))))(variables['params'])
  np.testing.assert_allclose(got, explicit['Transformer']['posembed_input']['pos_embedding'],
                             rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('classifier', ['gap', 'map'])
def test_tables_without_a_class_row(classifier):
  """'gap' / 'map': no prefix row; the whole table is the grid."""
  model = models.VisionTransformer(**TINY, classifier=classifier)
  variables = _tiny_variables(model)
  table = variables['params']['Transformer']['posembed_input']['pos_embedding']
  assert table.shape == (1, 16, 16)
  images = _images(42, 35)
  resized = resample.resample_posemb(jnp.asarray(table), (6, 5), num_prefix_tokens=0)
  np.testing.assert_allclose(_apply(model, variables, images),
                             _apply(model, _with_table(variables, np.asarray(resized)), images),
                             rtol=0, atol=1e-6)


def test_a_non_square_table_needs_its_grid():
  """A table made at 28x42 px (4x6 grid): with posemb_grid=(4, 6) it applies at any size, the
  same as a square-init model's table resized; without, the error names the fix."""
  model = models.VisionTransformer(**TINY, posemb_grid=(4, 6))
  variables = _tiny_variables(model, (56, 56))  # posemb_grid fixes the table, not the init size.
  table = variables['params']['Transformer']['posembed_input']['pos_embedding']
  assert table.shape == (1, 1 + 24, 16)
  np.testing.assert_array_equal(_apply(model, variables, _images(28, 42)),
                                _apply(models.VisionTransformer(**TINY), variables,
                                       _images(28, 42)))  # At its own grid, nothing resampled.
  resized = resample.resample_posemb(jnp.asarray(table), (8, 8), num_prefix_tokens=1,
                                     old_grid=(4, 6))
  np.testing.assert_allclose(
      _apply(model, variables, _images(56, 56)),
      _apply(models.VisionTransformer(**TINY), _with_table(variables, np.asarray(resized)),
             _images(56, 56)), rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match=r'pos_embedding has shape \(1, 25, 16\): its 24 grid rows '
                     r'\(after 1 class-token / register rows\) are not the 8x8 grid of the '
                     r'input, nor a square. Build the model with posemb_grid=\(rows, columns\)'):
    _apply(models.VisionTransformer(**TINY), variables, _images(56, 56))
  with pytest.raises(ValueError, match=r'its 24 grid rows .* are not posemb_grid=\(5, 5\)'):
    _apply(models.VisionTransformer(**TINY, posemb_grid=(5, 5)), variables, _images(56, 56))
  # A table of another width is not resampled.
  with pytest.raises(ValueError, match=r'pos_embedding has shape \(1, 25, 8\) but the input '
                     r'gives \(1, 25, 16\)'):
    _apply(model, _with_table(variables, np.zeros((1, 25, 8), np.float32)), _images(28, 42))


def test_scan_and_hybrid_and_sincos_at_another_size():
  """scan=True resamples the same; a hybrid's grid counts its stem's stride (token_stride keeps
  checking divisibility); sincos2d has no table to resample."""
  scanned = models.VisionTransformer(**TINY, scan=True)
  plain = models.VisionTransformer(**TINY)
  variables = _tiny_variables(plain)
  np.testing.assert_allclose(_apply(scanned, models.scan_params(variables), _images(56, 56)),
                             _apply(plain, variables, _images(56, 56)), rtol=0, atol=1e-6)
  with pytest.raises(models.ImageSizeError, match='Image width 30 is not divisible by the patch '
                     'size 7'):
    _apply(plain, variables, _images(28, 30))
  hybrid = models.VisionTransformer(**dict(TINY, patch_size=1), resnet_num_layers=(1,))
  hybrid_vars = _tiny_variables(hybrid, (16, 16))  # Stem stride 4: a 4x4 grid.
  assert hybrid_vars['params']['Transformer']['posembed_input']['pos_embedding'].shape[1] == 17
  assert np.isfinite(_apply(hybrid, hybrid_vars, _images(24, 32))).all()  # 6x8.
  sincos = models.VisionTransformer(**TINY, posemb='sincos2d')
  assert np.isfinite(_apply(sincos, _tiny_variables(sincos), _images(56, 42))).all()


@pytest.mark.parametrize('field,value,message', [
    ('posemb_resize', 'cubic', r"posemb_resize must be one of \('linear_corners', 'bicubic', "
                               r"'bicubic_antialias'\), got 'cubic'"),
    ('posemb_grid', (0, 3), r'posemb_grid must be None or the \(rows, columns\).*got \(0, 3\)'),
    ('posemb_grid', 16, r'posemb_grid must be None or .*got 16'),
    ('posemb_grid', (4, 4.0), r'posemb_grid must be None or .*got \(4, 4.0\)'),
])
def test_bad_resize_fields(field, value, message):
  with pytest.raises(ValueError, match=message):
    models.VisionTransformer(**TINY, **{field: value})


def test_posemb_grid_needs_a_learned_table():
  with pytest.raises(ValueError, match=r"posemb_grid=\(4, 4\) is the learned table's grid: it "
                     r"needs posemb='learn', got posemb='sincos2d'"):
    models.VisionTransformer(**TINY, posemb='sincos2d', posemb_grid=(4, 4))


# ---------------------------------------------------------- FlexiViT's patch-embedding resize


@pytest.mark.parametrize('new', [(8, 8), (6, 10), (5, 4)])
def test_pi_resize_keeps_every_token_when_upsampling(new):
  """<resize(x, P'), PI(w)> = <x, w> for random patches x and kernels w (P = 4 -> P', up)."""
  rng = np.random.default_rng(5)
  kernel = rng.normal(size=(4, 4, 3, 6)).astype(np.float32)
  patches = rng.normal(size=(10, 4, 4, 3)).astype(np.float32)
  resized = finetune.resample_patchemb(kernel, new)
  assert resized.shape == (*new, 3, 6) and resized.dtype == np.float32
  upsampled = np.stack([resample.resize_grid(p, new, 'bicubic_antialias') for p in patches])
  want = np.einsum('nhwc,hwcd->nd', patches.astype(np.float64), kernel.astype(np.float64))
  got = np.einsum('nhwc,hwcd->nd', upsampled.astype(np.float64), resized.astype(np.float64))
  scale = np.einsum('nhwc,hwcd->nd', np.abs(patches), np.abs(kernel))
  assert np.abs(got - want).max() < 1e-5 * scale.max()  # float32 rounding of the two arrays.
  assert np.abs(want).max() > 1.0


@pytest.mark.parametrize('size', ['2x2', '8x8', '3x5', '6x4'])
def test_pi_resize_matches_timm(size):
  """timm's resample_patch_embed (bicubic, antialias; its pseudo-inverse in float32)."""
  arrays, _ = _timm()
  kernel = arrays['patch_weight'].transpose(2, 3, 1, 0)  # OIHW -> HWIO.
  want = arrays[f'patch/{size}'].transpose(2, 3, 1, 0)
  got = finetune.resample_patchemb(kernel, tuple(int(s) for s in size.split('x')))
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_pi_resize_errors_and_identity():
  kernel = np.ones((4, 4, 3, 2), np.float32)
  assert finetune.resample_patchemb(kernel, 4) is kernel
  with pytest.raises(ValueError, match=r'A patch-embedding kernel is \(height, width, channels, '
                     r'width D\), got shape \(4, 4, 3\)'):
    finetune.resample_patchemb(kernel[..., 0], 8)
  with pytest.raises(ValueError, match='Unknown resize method'):
    finetune.resample_patchemb(kernel, 8, method='area')
