"""Tests of vit_jax.models: registry, parameter counts/names, golden logits, scan/remat/dtype."""

import dataclasses
import functools
import json
import pathlib
import subprocess
import sys

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax.checkpoint import vit_shapes
from vit_jax import models
from vit_jax.models import layout

# Outputs compared with the reference implementations' fixtures: highest matmul precision.
pytestmark = pytest.mark.golden

FIXTURES = pathlib.Path(__file__).parents[1] / 'fixtures'
GOLDEN = ('vit_tiny', 'vit_tiny_gap_repr')
RTOL = ATOL = 1e-5


# ------------------------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------------------------


def _fixture_overrides(name):
  """Registry overrides reproducing the official constructor kwargs of a fixture."""
  kwargs = json.loads((FIXTURES / name / 'config.json').read_text())['kwargs']
  t = kwargs['transformer']
  return kwargs['num_classes'], dict(
      patch_size=tuple(kwargs['patches']['size']), hidden_size=kwargs['hidden_size'],
      mlp_dim=t['mlp_dim'], num_heads=t['num_heads'], num_layers=t['num_layers'],
      dropout_rate=t['dropout_rate'], attention_dropout_rate=t['attention_dropout_rate'],
      classifier=kwargs['classifier'], representation_size=kwargs['representation_size'])


def _golden_model(name, **extra):
  num_classes, overrides = _fixture_overrides(name)
  overrides.update(extra)
  return models.create('ViT-custom', num_classes=num_classes, **overrides)


def _golden(name):
  inputs = np.load(FIXTURES / name / 'inputs.npy')
  logits = np.load(FIXTURES / name / 'logits.npy')
  variables = checkpoint.load(FIXTURES / name / 'params_linen.npz')
  return variables, inputs, logits


@functools.lru_cache(maxsize=None)
def _compiled_apply(model, train, capture_intermediates):
  # Modules are hashable dataclasses: equal models share one compilation. (On CPU, XLA
  # compilation dominates the run time of these tests; eager applies compile every op.)
  def fn(variables, inputs, rngs):
    return model.apply(variables, inputs, train=train, rngs=rngs,
                       capture_intermediates=capture_intermediates)
  return jax.jit(fn)


def _apply(model, variables, inputs, *, train, capture_intermediates=False, rngs=None):
  """Jitted ``model.apply(variables, inputs, train=train, ...)``."""
  return _compiled_apply(model, train, capture_intermediates)(variables, inputs, rngs)


def _init_and_apply(model, init_inputs, inputs):
  """``(variables, model.apply(variables, inputs, train=False))`` in one compilation."""

  def fn(key, x0, x):
    # Plain arrays: init boxes the parameters with their logical axis names.
    variables = models.unbox(model.init(key, x0, train=False))
    return variables, model.apply(variables, x, train=False)

  # An 'rbg' key compiles the initialisers about twice as fast on CPU as the default threefry.
  return jax.jit(fn)(jax.random.key(0, impl='rbg'), init_inputs, inputs)


def _param_shapes(model, size):
  return dict(_cached_param_shapes(model, size))  # A copy: the caller may change it.


@functools.lru_cache(maxsize=None)
def _cached_param_shapes(model, size):
  # Tracing a full-size init takes seconds (ViT-H/14: 1.3 s of CPU): the tests that read the
  # same (hashable) model's shapes share one trace.
  abstract = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False))
  return {k: v.shape for k, v in checkpoint.flatten_params(abstract['params']).items()}


def _count(shapes):
  return sum(int(np.prod(s)) for s in shapes.values())


# ------------------------------------------------------------------------------------------------
# Parameter counts and names (jax.eval_shape: nothing is allocated).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name,size,overrides,expected', [
    ('ViT-Ti_16', 224, {}, 5_717_416),
    # S/16 and the 24-layer L models: the same code as the others (each count traces a
    # full-size init, about a second): full suite.
    pytest.param('ViT-S_16', 224, {}, 22_050_664, marks=pytest.mark.slow),
    ('ViT-B_16', 224, {}, 86_567_656),
    ('ViT-B_32', 224, {}, 88_224_232),
    pytest.param('ViT-L_16', 224, {}, 304_326_632, marks=pytest.mark.slow),
    pytest.param('ViT-L_32', 224, {}, 306_535_400, marks=pytest.mark.slow),
    ('ViT-H_14', 224, {}, 632_045_800),  # Its shapes are test_larger_sizes_shapes' (cached).
    ('ViT-B_16', 384, {}, 86_859_496),
    ('ViT-B_16', 224, {'representation_size': 768, 'num_classes': 21_843}, 103_186_515),
])
def test_official_parameter_counts(name, size, overrides, expected):
  overrides = dict(overrides)
  num_classes = overrides.pop('num_classes', 1000)
  shapes = _param_shapes(models.create(name, num_classes=num_classes, **overrides), size)
  assert _count(shapes) == expected


def test_scan_and_remat_keep_the_parameter_count():
  shapes = _param_shapes(models.create('ViT-B/16', num_classes=1000, scan=True, remat=True), 224)
  assert _count(shapes) == 86_567_656
  assert shapes['Transformer/encoderblock/MultiHeadDotProductAttention_0/query/kernel'] == (
      12, 768, 12, 64)
  assert not any('encoderblock_' in k for k in shapes)


def test_b16_parameter_names_and_shapes():
  shapes = _param_shapes(models.create('ViT-B_16', num_classes=1000), 224)
  block = 'Transformer/encoderblock_11'
  expected = {
      'embedding/kernel': (16, 16, 3, 768),
      'embedding/bias': (768,),
      'cls': (1, 1, 768),
      'Transformer/posembed_input/pos_embedding': (1, 197, 768),
      f'{block}/LayerNorm_0/scale': (768,),
      f'{block}/LayerNorm_0/bias': (768,),
      f'{block}/MultiHeadDotProductAttention_0/query/kernel': (768, 12, 64),
      f'{block}/MultiHeadDotProductAttention_0/query/bias': (12, 64),
      f'{block}/MultiHeadDotProductAttention_0/key/kernel': (768, 12, 64),
      f'{block}/MultiHeadDotProductAttention_0/value/kernel': (768, 12, 64),
      f'{block}/MultiHeadDotProductAttention_0/out/kernel': (12, 64, 768),
      f'{block}/MultiHeadDotProductAttention_0/out/bias': (768,),
      f'{block}/LayerNorm_1/scale': (768,),
      f'{block}/MlpBlock_0/Dense_0/kernel': (768, 3072),
      f'{block}/MlpBlock_0/Dense_0/bias': (3072,),
      f'{block}/MlpBlock_0/Dense_1/kernel': (3072, 768),
      f'{block}/MlpBlock_0/Dense_1/bias': (768,),
      'Transformer/encoder_norm/scale': (768,),
      'head/kernel': (768, 1000),
      'head/bias': (1000,),
  }
  for key, shape in expected.items():
    assert shapes[key] == shape, key
  assert 'Transformer/encoderblock_12/LayerNorm_0/scale' not in shapes
  assert not any(k.startswith('pre_logits') for k in shapes)
  # 12 blocks x 16 leaves + embedding(2) + cls + pos + encoder_norm(2) + head(2).
  assert len(shapes) == 12 * 16 + 8


def test_larger_sizes_shapes():
  h14 = _param_shapes(models.create('ViT-H_14', num_classes=1000), 224)
  assert h14['Transformer/posembed_input/pos_embedding'] == (1, 257, 1280)
  assert h14['embedding/kernel'] == (14, 14, 3, 1280)
  assert 'Transformer/encoderblock_31/MlpBlock_0/Dense_0/kernel' in h14
  assert h14['Transformer/encoderblock_31/MlpBlock_0/Dense_0/kernel'] == (1280, 5120)
  gap = _param_shapes(models.create('ViT-S/16', num_classes=10, classifier='gap',
                                    representation_size=100), 64)
  assert 'cls' not in gap
  assert gap['Transformer/posembed_input/pos_embedding'] == (1, 16, 384)
  assert gap['pre_logits/kernel'] == (384, 100)
  assert gap['head/kernel'] == (100, 10)


def test_loaded_fixture_tree_matches_model_tree_exactly():
  for name in GOLDEN:
    model = _golden_model(name)
    expected = _param_shapes(model, 32)
    for fname in ('params.npz', 'params_linen.npz'):
      loaded = checkpoint.load(FIXTURES / name / fname)
      got = {k: v.shape for k, v in checkpoint.flatten_params(loaded['params']).items()}
      assert got == expected, (name, fname)


# ------------------------------------------------------------------------------------------------
# Registry.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('size,layers,hidden,mlp,heads,dropout', [
    ('Ti', 12, 192, 768, 3, 0.0),
    ('S', 12, 384, 1536, 6, 0.0),
    ('B', 12, 768, 3072, 12, 0.0),
    ('L', 24, 1024, 4096, 16, 0.1),
    ('H', 32, 1280, 5120, 16, 0.1),
    ('g', 40, 1408, 6144, 16, 0.0),
    ('G', 48, 1664, 8192, 16, 0.0),
])
def test_size_table(size, layers, hidden, mlp, heads, dropout):
  config = models.model_config(f'ViT-{size}_14')
  assert (config['num_layers'], config['hidden_size'], config['mlp_dim'], config['num_heads'],
          config['dropout_rate']) == (layers, hidden, mlp, heads, dropout)
  assert config['patch_size'] == (14, 14)
  assert config['attention_dropout_rate'] == 0.0
  assert config['classifier'] == 'token' and config['representation_size'] is None


def test_name_spellings():
  reference = models.model_config('ViT-B_16')
  for spelling in ('ViT-B/16', 'vit-b16', 'vit_b_16', 'ViT-B16', 'vit-B/16'):
    assert models.model_config(spelling) == reference, spelling
  assert models.model_config('ViT-Ti_4')['patch_size'] == (4, 4)
  assert models.model_config('vit-ti16')['hidden_size'] == 192
  assert models.model_config('ViT-g_14')['hidden_size'] == 1408
  assert models.model_config('ViT-G_14')['hidden_size'] == 1664
  for name in models.MODEL_NAMES:
    if name != 'ViT-custom':
      assert isinstance(models.create(name, num_classes=3), models.VisionTransformer)


@pytest.mark.slow
def test_example_and_official_initialisers():
  """The documented example, with the official initialisers checked on its fresh parameters."""
  model = models.create('ViT-S_32', num_classes=1000, representation_size=384, num_layers=4)
  assert isinstance(model, models.VisionTransformer)
  assert (model.num_layers, model.hidden_size, model.representation_size) == (4, 384, 384)
  images = jax.random.uniform(jax.random.key(1), (2, 64, 64, 3), minval=-1, maxval=1)
  variables, logits = _init_and_apply(model, images[:1], images)
  chex.assert_shape(logits, (2, 1000))
  chex.assert_type(logits, jnp.float32)
  np.testing.assert_array_equal(logits, 0.0)  # zero-initialised head kernel, bias 0
  params = variables['params']
  assert set(params['Transformer']) == {
      'posembed_input', 'encoder_norm', *(f'encoderblock_{i}' for i in range(4))}
  np.testing.assert_array_equal(params['head']['kernel'], 0.0)
  np.testing.assert_array_equal(params['head']['bias'], 0.0)
  np.testing.assert_array_equal(params['cls'], 0.0)
  pos = np.asarray(params['Transformer']['posembed_input']['pos_embedding'])
  assert pos.shape == (1, 5, 384) and 0.018 < pos.std() < 0.022  # normal(0.02)
  block = params['Transformer']['encoderblock_3']
  mlp_bias = np.asarray(block['MlpBlock_0']['Dense_0']['bias'])
  assert 0 < np.abs(mlp_bias).max() < 1e-5  # normal(1e-6)
  attention = block['MultiHeadDotProductAttention_0']
  np.testing.assert_array_equal(attention['query']['bias'], 0.0)
  # xavier_uniform over the (384, 6 * 64) projection: limit sqrt(6 / (384 + 384)).
  limit = np.sqrt(6 / 768)
  query = np.abs(np.asarray(attention['query']['kernel']))
  assert 0.99 * limit < query.max() <= limit
  mlp = np.abs(np.asarray(block['MlpBlock_0']['Dense_0']['kernel']))
  assert 0.99 * np.sqrt(6 / (384 + 1536)) < mlp.max() <= np.sqrt(6 / (384 + 1536))
  np.testing.assert_array_equal(block['LayerNorm_0']['scale'], 1.0)


@pytest.mark.slow
def test_head_bias_init():
  model = models.create('ViT-custom', num_classes=7, patch_size=4, hidden_size=16, mlp_dim=32,
                        num_heads=2, num_layers=1, head_bias_init=-10.0)
  # An 'rbg' key compiles the initialisers about twice as fast on CPU.
  fn = jax.jit(lambda k, x: model.apply(model.init(k, x, train=False), x, train=False))
  logits = fn(jax.random.key(0, impl='rbg'), jnp.ones((2, 8, 8, 3)))
  np.testing.assert_array_equal(logits, -10.0)


def test_config_overrides():
  config = models.model_config('ViT-B_16', patch_size=(8, 4), dtype='bfloat16', scan=True)
  assert config['patch_size'] == (8, 4) and config['scan'] is True
  assert config['dtype'] == 'bfloat16' and config['hidden_size'] == 768
  assert set(config) == set(models.OVERRIDE_KEYS)
  model = models.create('ViT-B_16', num_classes=5, **{**config, 'num_layers': 2})
  shapes = _param_shapes(model, 32)
  assert shapes['embedding/kernel'] == (8, 4, 3, 768)
  assert shapes['Transformer/posembed_input/pos_embedding'] == (1, 4 * 8 + 1, 768)
  assert shapes['Transformer/encoderblock/LayerNorm_0/scale'] == (2, 768)


@pytest.mark.parametrize('family, module, declared', [
    ('ViT', models.VisionTransformer,
     models.vit_fields.VIT_FIELDS + models.vit_fields.HYBRID_FIELDS),
    ('T2T-ViT', models.T2TViT, models.t2t.T2T_FIELDS),
])
def test_each_field_is_declared_once_and_the_module_takes_exactly_those(family, module, declared):
  """The declaration is the modules' fields, their defaults the modules' (dtypes as names; T2T's
  registry drop_path_rate is the reference's training 0.1), and the config derives from it."""
  names = [f.name for f in declared]
  assert len(names) == len(set(names)), family
  module_fields = {f.name: f.default for f in dataclasses.fields(module)
                   if f.name not in ('parent', 'name', 'num_classes')}
  assert set(module_fields) == set(names), family
  for field in declared:
    expected = module_fields[field.name]
    if field.name == 'resnet_num_layers':  # The module's None: no stem (a plain ViT).
      assert expected is None
    elif field.default is models.fields.REQUIRED:
      assert expected is dataclasses.MISSING, field.name
    elif field.name in ('dtype', 'param_dtype'):
      assert jnp.dtype(expected) == jnp.dtype(field.default), field.name
    elif (family, field.name) != ('T2T-ViT', 'drop_path_rate'):
      assert expected == field.default, field.name
    assert models.FIELD_TYPES[field.name] is field.type
  custom = models.model_config(f'{family}-custom', **{
      f.name: {int: 4, float: 2.0, tuple: (2, 2)}[f.type] for f in declared
      if f.default is models.fields.REQUIRED and f.name != 'resnet_num_layers'})
  assert set(custom) == set(models.fields.names(
      models.vit_fields.VIT_FIELDS if family == 'ViT' else declared))


def test_custom_name_needs_the_architecture():
  model = models.create('ViT-custom', num_classes=2, patch_size=2, hidden_size=8, mlp_dim=16,
                        num_heads=2, num_layers=1)
  assert model.hidden_size == 8
  with pytest.raises(ValueError, match='mlp_dim'):
    models.create('ViT-custom', num_classes=2, patch_size=2, hidden_size=8, num_heads=2,
                  num_layers=1)


def test_headless_model_returns_features():
  model = models.create('ViT-custom', num_classes=None, patch_size=4, hidden_size=16, mlp_dim=32,
                        num_heads=2, num_layers=1, representation_size=12)
  shapes = _param_shapes(model, 8)
  assert not any(k.startswith('head/') for k in shapes)
  rng = np.random.default_rng(0)
  params = checkpoint.unflatten_params(
      {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()})
  features = _apply(model, {'params': params}, jnp.ones((3, 8, 8, 3)), train=False)
  chex.assert_shape(features, (3, 12))
  chex.assert_type(features, jnp.float32)
  assert np.all(np.abs(features) <= 1.0) and np.abs(features).max() > 0.1  # tanh(pre_logits)


def test_unknown_name():
  with pytest.raises(ValueError, match=r"(?s)Unknown model name 'ViT-Q_16'.*ViT-B_16"):
    models.create('ViT-Q_16', num_classes=10)
  with pytest.raises(ValueError, match='Valid forms'):
    models.model_config('ResNet50')


def test_unknown_override_key():
  with pytest.raises(TypeError, match=r"(?s)\['hidden_dim'\].*hidden_size.*mlp_dim.*remat"):
    models.create('ViT-B_16', num_classes=10, hidden_dim=768)


def test_invalid_values():
  with pytest.raises(ValueError, match="classifier must be one of \\('token', 'gap', 'map'\\)"):
    models.create('ViT-B_16', num_classes=10, classifier='unpooled')
  with pytest.raises(ValueError, match='classifier'):  # Direct construction is checked too.
    models.VisionTransformer(num_classes=10, patch_size=4, hidden_size=8, mlp_dim=8,
                             num_heads=2, num_layers=1, classifier='cls')
  with pytest.raises(ValueError, match='divisible by num_heads'):
    models.create('ViT-B_16', num_classes=10, num_heads=5)
  with pytest.raises(ValueError, match='patch_size'):
    models.create('ViT-B_16', num_classes=10, patch_size=0)
  with pytest.raises(ValueError, match='dropout_rate'):
    models.create('ViT-B_16', num_classes=10, dropout_rate=1.5)
  with pytest.raises(ValueError, match='num_classes'):
    models.create('ViT-B_16', num_classes=0)
  with pytest.raises(ValueError, match='dtype must be a floating dtype'):
    models.create('ViT-B_16', num_classes=10, dtype='bfloat17')
  with pytest.raises(ValueError, match='param_dtype'):
    models.create('ViT-B_16', num_classes=10, param_dtype=jnp.int32)


def test_image_size_not_divisible_by_patch():
  model = models.create('ViT-Ti_16', num_classes=10, num_layers=1)
  with pytest.raises(models.ImageSizeError, match=r'(?s)Image height 200 is not divisible by the '
                                               r'patch size 16.*multiple of 16 \(e\.g\. 192 or '
                                               r'208\).*patch'):
    model.init(jax.random.key(0), jnp.zeros((1, 200, 224, 3)), train=False)
  with pytest.raises(models.ImageSizeError,
                     match='Image width 30 is not divisible by the patch size 16'):
    model.init(jax.random.key(0), jnp.zeros((1, 32, 30, 3)), train=False)
  with pytest.raises(ValueError, match=r'\[batch, height, width, channels\]'):
    model.init(jax.random.key(0), jnp.zeros((32, 32, 3)), train=False)


def test_loaded_params_at_another_resolution_resample_their_table():
  """The 32 px fixture (8x8 grid) at 16 px (4x4): the table resampled in the model as the
  fine-tuning resize does (corners aligned); a table of another width is refused."""
  variables, inputs, _ = _golden('vit_tiny')
  model = _golden_model('vit_tiny')
  apply = jax.jit(lambda v, x: model.apply(v, x, train=False))
  small = inputs[:, :16, :16]
  resized = jax.tree.map(lambda x: x, variables)
  entry = resized['params']['Transformer']['posembed_input']
  entry['pos_embedding'] = checkpoint.resize_posemb(entry['pos_embedding'], 17,
                                                    has_class_token=True)
  with jax.default_matmul_precision('highest'):
    np.testing.assert_allclose(apply(variables, small), apply(resized, small), rtol=0, atol=2e-6)
  assert np.abs(np.asarray(apply(variables, small)) -
                np.asarray(apply(variables, inputs))).max() > 1e-3
  narrow = jax.tree.map(lambda x: x, variables)
  narrow['params']['Transformer']['posembed_input']['pos_embedding'] = np.zeros((1, 65, 16),
                                                                               np.float32)
  with pytest.raises(ValueError, match=r'pos_embedding has shape \(1, 65, 16\) but the input '
                     r'gives \(1, 17, 32\)'):
    model.apply(narrow, small, train=False)


def test_posemb_fields_are_overrides_and_the_grid_a_tuple():
  """--config.model.posemb_resize / posemb_grid reach the model (ml_collections gives lists)."""
  config = models.model_config('ViT-Ti_16', posemb_resize='bicubic', posemb_grid=[14, 14])
  assert config['posemb_resize'] == 'bicubic' and config['posemb_grid'] == (14, 14)
  defaults = models.model_config('ViT-Ti_16')
  assert defaults['posemb_resize'] == 'linear_corners' and defaults['posemb_grid'] is None
  assert models.create('ViT-Ti_16', num_classes=2, posemb_grid=[7, 7]).posemb_grid == (7, 7)
  with pytest.raises(ValueError, match='posemb_resize must be one of'):
    models.model_config('ViT-Ti_16', posemb_resize='nearest')


@pytest.mark.parametrize('classifier, prefix', [('token', 3), ('gap', 2), ('map', 2)])
def test_intermediates_of_a_model_with_registers(classifier, prefix):
  """The token layout counts the class token and the 2 registers in front of the 2x2 grid; the
  'map' head attends to the patches only (what the model gives it)."""
  from vit_jax import analysis  # pylint: disable=g-import-not-at-top
  from vit_jax.models import intermediates  # pylint: disable=g-import-not-at-top
  model = models.create('ViT-custom', num_classes=3, patch_size=4, hidden_size=16, mlp_dim=16,
                        num_heads=2, num_layers=2, classifier=classifier, num_registers=2)
  images = np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 3)).astype(np.float32)
  shapes = models.unbox(models.abstract_variables(model, (8, 8)))
  rng = np.random.default_rng(1)
  variables = jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype), shapes)
  got = intermediates.capture(model, variables, images)
  assert got.layout == intermediates.TokenLayout(prefix=prefix, grid=(2, 2), stride=(4, 4))
  assert [a.shape for a in got.attention] == [(2, 2, prefix + 4, prefix + 4)] * 2
  assert [t.shape for t in got.tokens] == [(2, prefix + 4, 16)] * 2
  np.testing.assert_allclose(np.asarray(got.attention[0]).sum(-1), 1.0, atol=1e-6)
  if classifier == 'map':
    assert got.head_attention.shape == (2, 2, 1, 4)
  # The layout is what the analysis needs: the class token's (or the mean) row over the patches.
  maps = analysis.layer_class_token_maps(got.attention, got.layout.grid,
                                         num_prefix_tokens=got.layout.prefix, num_registers=2)
  assert maps.shape == (2, 2, 2, 2)
  heads = np.asarray(got.attention[1])[0].mean(0)  # [N, N], the heads fused by their mean.
  rows = heads[0] if classifier == 'token' else heads[prefix:].mean(0)  # No class token: all.
  row = rows[prefix:]
  np.testing.assert_allclose(maps[1, 0].reshape(-1), row / row.max(), rtol=1e-5)


@pytest.mark.slow
def test_models_package_has_no_training_imports():
  code = ('import sys, vit_jax.models, vit_jax.checkpoint as c;'
          'c.load("%s");'
          'bad = [m for m in ("optax", "tensorflow", "tensorflow_datasets") if m in sys.modules];'
          'assert not bad, bad' % (FIXTURES / 'vit_tiny' / 'params.npz'))
  subprocess.run([sys.executable, '-c', code], check=True, timeout=120)


# ------------------------------------------------------------------------------------------------
# Golden numerics against the official implementation.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', GOLDEN)
@pytest.mark.parametrize('fname', ['params.npz', 'params_linen.npz'])
def test_golden_logits(name, fname):
  model = _golden_model(name)
  variables = checkpoint.load(FIXTURES / name / fname)
  inputs = np.load(FIXTURES / name / 'inputs.npy')
  reference = np.load(FIXTURES / name / 'logits.npy')
  logits = model.apply(variables, inputs, train=False)
  chex.assert_type(logits, jnp.float32)
  np.testing.assert_allclose(logits, reference, rtol=RTOL, atol=ATOL)
  jitted = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, inputs)
  np.testing.assert_allclose(jitted, reference, rtol=RTOL, atol=ATOL)
  # The two samples differ, so a batch-mixing bug cannot pass.
  assert np.abs(reference[0] - reference[1]).max() > 0.1


@pytest.mark.parametrize('name', GOLDEN)
def test_golden_intermediates(name):
  model = _golden_model(name)
  variables, inputs, _ = _golden(name)
  _, state = _apply(model, variables, inputs, train=False, capture_intermediates=True)
  captured = {k[:-len('/__call__')]: v[0] for k, v in
              checkpoint.flatten_params(state['intermediates']).items()}
  with np.load(FIXTURES / name / 'intermediates.npz') as reference:
    assert set(reference.files) <= set(captured)
    for key in reference.files:
      np.testing.assert_allclose(captured[key], reference[key], rtol=RTOL, atol=ATOL,
                                 err_msg=key)


def test_gap_pooling_uses_all_tokens_after_encoder_norm():
  model = _golden_model('vit_tiny_gap_repr')
  variables, inputs, _ = _golden('vit_tiny_gap_repr')
  _, state = _apply(model, variables, inputs, train=False, capture_intermediates=True)
  encoded = state['intermediates']['Transformer']['encoder_norm']['__call__'][0]
  dense = variables['params']['pre_logits']
  pre = np.asarray(encoded).mean(axis=1) @ dense['kernel'] + dense['bias']
  head = variables['params']['head']
  np.testing.assert_allclose(np.tanh(pre) @ head['kernel'] + head['bias'],
                             np.load(FIXTURES / 'vit_tiny_gap_repr' / 'logits.npy'),
                             rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------------------------------
# scan / remat / dtype / dropout.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', GOLDEN)
def test_scan_matches_unrolled(name):
  variables, inputs, reference = _golden(name)
  scanned = layout.scan_params(variables, num_layers=2)
  block = scanned['params']['Transformer']['encoderblock']
  assert block['MlpBlock_0']['Dense_0']['kernel'].shape == (2, 32, 64)
  assert 'encoderblock_0' not in scanned['params']['Transformer']
  model = _golden_model(name, scan=True)
  # The scanned model creates exactly this tree.
  init_shapes = _param_shapes(model, 32)
  got = {k: v.shape for k, v in checkpoint.flatten_params(scanned['params']).items()}
  assert got == init_shapes
  logits = _apply(model, scanned, inputs, train=False)
  np.testing.assert_allclose(logits, reference, rtol=RTOL, atol=ATOL)
  # Round trip is exact.
  back = layout.unscan_params(scanned)
  chex.assert_trees_all_equal(back, variables)


@pytest.mark.slow
@pytest.mark.parametrize('scan', [False, True])
def test_remat_matches(scan):
  variables, inputs, reference = _golden('vit_tiny')
  if scan:
    variables = layout.scan_params(variables, 2)
  plain = _golden_model('vit_tiny', scan=scan)
  remat = _golden_model('vit_tiny', scan=scan, remat=True)

  def loss(model, params):
    logits = model.apply({'params': params}, inputs, train=False)
    return jnp.sum(logits ** 2), logits

  def value_and_grad(model):
    return jax.jit(jax.value_and_grad(functools.partial(loss, model), has_aux=True))(
        variables['params'])

  (_, logits), g_remat = value_and_grad(remat)
  np.testing.assert_allclose(logits, reference, rtol=RTOL, atol=ATOL)
  _, g_plain = value_and_grad(plain)
  chex.assert_trees_all_close(g_remat, g_plain, rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(g_plain['embedding']['kernel']).max()) > 0


def test_bfloat16_compute():
  variables, inputs, reference = _golden('vit_tiny')
  model = _golden_model('vit_tiny', dtype=jnp.bfloat16)
  logits, state = _apply(model, variables, inputs, train=False, capture_intermediates=True)
  chex.assert_type(logits, jnp.float32)
  error = np.abs(np.asarray(logits) - reference).max()
  assert 1e-5 < error < 0.1, error  # bf16 really used, and still close.
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), inputs, train=False))['params']
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  hidden = state['intermediates']['Transformer']['encoderblock_0']['__call__'][0]
  assert hidden.dtype == jnp.bfloat16
  # Also with scan and a string dtype.
  scanned = _golden_model('vit_tiny', dtype='bfloat16', scan=True)
  logits_scan = _apply(scanned, layout.scan_params(variables), inputs, train=False)
  assert np.abs(np.asarray(logits_scan) - reference).max() < 0.1


@pytest.mark.parametrize('scan', [False, True])
def test_dropout_only_in_training(scan):
  variables, inputs, reference = _golden('vit_tiny')
  if scan:
    variables = layout.scan_params(variables)
  model = _golden_model('vit_tiny', dropout_rate=0.1, attention_dropout_rate=0.1, scan=scan)
  # train=False: dropout off, golden logits.
  np.testing.assert_allclose(_apply(model, variables, inputs, train=False), reference,
                             rtol=RTOL, atol=ATOL)
  with pytest.raises(flax.errors.InvalidRngError, match='dropout'):
    model.apply(variables, inputs, train=True)
  train = jax.jit(lambda v, x, key: model.apply(v, x, train=True, rngs={'dropout': key}))
  a = train(variables, inputs, jax.random.key(1))
  a2 = train(variables, inputs, jax.random.key(1))
  b = train(variables, inputs, jax.random.key(2))
  np.testing.assert_array_equal(a, a2)
  assert np.abs(np.asarray(a) - reference).max() > 1e-3
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3


def test_attention_dropout_alone_changes_outputs():
  variables, inputs, reference = _golden('vit_tiny')
  model = _golden_model('vit_tiny', attention_dropout_rate=0.2)
  out = _apply(model, variables, inputs, train=True, rngs={'dropout': jax.random.key(0)})
  assert np.abs(np.asarray(out) - reference).max() > 1e-3


# ------------------------------------------------------------------------------------------------
# Layout conversion.
# ------------------------------------------------------------------------------------------------


def test_scan_unscan_errors_and_variants():
  variables, _, _ = _golden('vit_tiny')
  with pytest.raises(ValueError, match='Expected 3'):
    layout.scan_params(variables, num_layers=3)
  scanned = layout.scan_params(variables['params'])  # params tree, not variables
  assert layout.is_scanned(scanned) and not layout.is_scanned(variables)
  with pytest.raises(ValueError, match='already in the scanned'):
    layout.scan_params(scanned)
  with pytest.raises(ValueError, match='already in the\\s+unrolled'):
    layout.unscan_params(variables)
  frozen = flax.core.freeze(variables)
  chex.assert_trees_all_equal(layout.scan_params(frozen)['params'], scanned)
  gap = {'Transformer': {'encoderblock_0': {'w': np.zeros(2)},
                         'encoderblock_2': {'w': np.zeros(2)}}}
  with pytest.raises(ValueError, match='0..1'):
    layout.scan_params(gap)
  # NumPy leaves stay NumPy.
  assert isinstance(scanned['Transformer']['encoderblock']['LayerNorm_0']['scale'], np.ndarray)


# ------------------------------------------------------------------------------------------------
# The other ecosystems' options: 'map' pooling and 'sincos2d' (big_vision), the exact GELU (timm,
# transformers) and the LayerNorm epsilon (transformers: 1e-12).
# ------------------------------------------------------------------------------------------------

TINY = dict(hidden_size=16, mlp_dim=24, num_heads=2, num_layers=1, patch_size=8)


def _random_variables(model, height, width, seed=0):
  """Plain float32 variables of ``model`` for ``height x width`` images, every value random
  (normal, std 0.5: the zero/one initialisers would hide a wrong bias or LayerNorm)."""
  abstract = models.unbox(jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, height, width, 3)), train=False)))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.normal(0, 0.5, x.shape).astype(np.float32), abstract)


def _capture_encoder(module, method_name):
  return isinstance(module, models.vit.Encoder) and method_name == '__call__'


def _np_layer_norm(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p['scale'] + p['bias']


def _np_gelu(x, approximate):
  if approximate:  # Hendrycks & Gimpel's tanh approximation.
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
  from scipy import special  # pylint: disable=g-import-not-at-top
  return 0.5 * x * (1 + special.erf(x / np.sqrt(2)))


def _np_mlp(x, p, approximate):
  hidden = _np_gelu(x @ p['Dense_0']['kernel'] + p['Dense_0']['bias'], approximate)
  return hidden @ p['Dense_1']['kernel'] + p['Dense_1']['bias']


def _np_map_head(tokens, p, eps, approximate):
  """big_vision's MAPHead written out: the probe attends to the tokens, then LN + MLP residual."""
  att = p['MultiHeadDotProductAttention_0']
  head_dim = att['query']['bias'].shape[1]
  probe = np.broadcast_to(p['probe'], (tokens.shape[0], 1, tokens.shape[2]))

  def proj(x, name):
    return np.einsum('bnd,dhk->bhnk', x, att[name]['kernel']) + att[name]['bias'][:, None, :]

  q, k, v = proj(probe, 'query'), proj(tokens, 'key'), proj(tokens, 'value')
  logits = np.einsum('bhqk,bhnk->bhqn', q, k) / np.sqrt(head_dim)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  x = np.einsum('bhqn,bhnk,hkd->bqd', weights, v, att['out']['kernel']) + att['out']['bias']
  x = x + _np_mlp(_np_layer_norm(x, p['LayerNorm_0'], eps), p['MlpBlock_0'], approximate)
  return x[:, 0]


def _np_sincos(height, width, width_d):
  """MoCo v3 / big_vision's 2-D sin-cos table, token by token (row-major), in float64."""
  quarter = width_d // 4
  omega = 1.0 / 10000.0 ** (np.arange(quarter) / (quarter - 1))
  rows = [np.concatenate([np.sin(c * omega), np.cos(c * omega), np.sin(r * omega),
                          np.cos(r * omega)]) for r in range(height) for c in range(width)]
  return np.stack(rows)[None]


def test_map_head_parameter_tree_count_and_architecture_fields():
  model = models.create('ViT-custom', num_classes=3, classifier='map', **TINY)
  shapes = _param_shapes(model, 16)
  attn = 'MultiHeadDotProductAttention_0/'
  assert {k[len('MAPHead_0/'):]: v for k, v in shapes.items() if k.startswith('MAPHead_0/')} == {
      'probe': (1, 1, 16),
      attn + 'query/kernel': (16, 2, 8), attn + 'query/bias': (2, 8),
      attn + 'key/kernel': (16, 2, 8), attn + 'key/bias': (2, 8),
      attn + 'value/kernel': (16, 2, 8), attn + 'value/bias': (2, 8),
      attn + 'out/kernel': (2, 8, 16), attn + 'out/bias': (16,),
      'LayerNorm_0/scale': (16,), 'LayerNorm_0/bias': (16,),
      'MlpBlock_0/Dense_0/kernel': (16, 24), 'MlpBlock_0/Dense_0/bias': (24,),
      'MlpBlock_0/Dense_1/kernel': (24, 16), 'MlpBlock_0/Dense_1/bias': (16,)}
  assert 'cls' not in shapes
  assert shapes['Transformer/posembed_input/pos_embedding'] == (1, 4, 16)  # No class row.
  # embedding 8*8*3*16 + 16 = 3088; position table 4*16 = 64; the block: 2 LayerNorms 2*32,
  # attention 4*(16*16 + 16) = 1088, MLP 16*24 + 24 + 24*16 + 16 = 808, so 1960; encoder_norm 32;
  # MAP head: probe 16 + attention 1088 + LayerNorm 32 + MLP 808 = 1944; head 16*3 + 3 = 51.
  assert _count(shapes) == 3088 + 64 + 1960 + 32 + 1944 + 51 == 7139
  sincos = _param_shapes(models.create('ViT-custom', num_classes=3, classifier='map',
                                       posemb='sincos2d', **TINY), 16)
  assert set(shapes) - set(sincos) == {'Transformer/posembed_input/pos_embedding'}
  assert _count(sincos) == 7139 - 64
  fields = vit_shapes.architecture_fields({f'params/{k}': v for k, v in sincos.items()})
  assert fields == dict(patch_size=8, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=24,
                        representation_size=None, classifier='map', posemb='sincos2d',
                        num_classes=3)
  assert vit_shapes.describe_architecture({f'params/{k}': v for k, v in sincos.items()}) == (
      'The checkpoint is a ViT with patch_size=8, hidden_size=16, num_layers=1, num_heads=2, '
      "mlp_dim=24, representation_size=None, classifier='map', posemb='sincos2d', 3 classes.")
  learn = vit_shapes.architecture_fields({f'params/{k}': v for k, v in shapes.items()})
  assert (learn['classifier'], learn['posemb']) == ('map', 'learn')
  # Without the probe: 'token' with a class token, else 'gap'.
  plain = {f'params/{k}': v for k, v in shapes.items() if not k.startswith('MAPHead_0/')}
  assert vit_shapes.architecture_fields(plain)['classifier'] == 'gap'
  assert vit_shapes.architecture_fields({**plain, 'params/cls': (1, 1, 16)})['classifier'] == (
      'token')
  assert 'classifier' not in vit_shapes.describe_architecture(plain)


def test_map_head_is_attention_pooling_by_hand_with_the_exact_gelu_and_epsilon():
  eps = 0.1  # Far from 1e-6: a LayerNorm that ignored it would be off by ~5%.
  model = models.create('ViT-custom', num_classes=None, classifier='map', gelu_approximate=False,
                        layer_norm_epsilon=eps, **TINY)
  variables = _random_variables(model, 16, 16)
  images = np.random.default_rng(1).uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
  features, state = _apply(model, variables, images, train=False,
                           capture_intermediates=_capture_encoder)
  # The encoder's output, after encoder_norm: the head's input.
  encoded = np.asarray(state['intermediates']['Transformer']['__call__'][0], np.float64)
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), variables['params'])
  expected = _np_map_head(encoded, p['MAPHead_0'], eps, approximate=False)
  assert features.shape == (2, 16)
  np.testing.assert_allclose(features, expected, rtol=1e-5, atol=1e-5)
  assert np.abs(expected - _np_map_head(encoded, p['MAPHead_0'], eps, True)).max() > 1e-4
  assert np.abs(expected - _np_map_head(encoded, p['MAPHead_0'], 1e-6, False)).max() > 1e-3
  # The layout conversions leave the head alone (it has no encoderblock_{i}).
  scanned = layout.scan_params(variables)
  chex.assert_trees_all_equal(scanned['params']['MAPHead_0'], variables['params']['MAPHead_0'])
  chex.assert_trees_all_equal(layout.unscan_params(scanned), variables)


def test_sincos2d_table_and_model():
  table = jax.jit(models.vit.posemb_sincos_2d, static_argnums=(0, 1, 2))(3, 5, 32)
  assert table.shape == (1, 15, 32) and table.dtype == jnp.float32
  np.testing.assert_allclose(table, _np_sincos(3, 5, 32), rtol=0, atol=3e-6)
  assert jax.eval_shape(lambda: models.vit.posemb_sincos_2d(2, 2, 8, dtype=jnp.bfloat16)
                        ).dtype == jnp.bfloat16
  for bad in (6, 4):
    with pytest.raises(ValueError, match=f'multiple of 4 and at least 8, got {bad}'):
      models.vit.posemb_sincos_2d(2, 2, bad)
  # A 2x3 grid (16x24 px): rows and columns are not interchangeable.
  sincos = models.create('ViT-custom', num_classes=None, posemb='sincos2d', **TINY)
  variables = _random_variables(sincos, 16, 24)
  assert 'posembed_input' not in variables['params']['Transformer']
  learn = models.create('ViT-custom', num_classes=None, **TINY)
  learned = jax.tree.map(lambda x: x, variables)
  learned['params']['Transformer']['posembed_input'] = {'pos_embedding': np.concatenate(
      [np.zeros((1, 1, 16), np.float32), _np_sincos(2, 3, 16).astype(np.float32)], axis=1)}
  images = np.random.default_rng(2).uniform(-1, 1, (2, 16, 24, 3)).astype(np.float32)
  both = jax.jit(lambda v, w, x: (sincos.apply(v, x, train=False),  # One compilation.
                                  learn.apply(w, x, train=False)))
  np.testing.assert_allclose(*both(variables, learned, images), rtol=1e-5, atol=1e-5)
  # No parameter depends on the grid: any resolution applies (traced only).
  out = jax.eval_shape(lambda v, x: sincos.apply(v, x, train=False), variables,
                       jax.ShapeDtypeStruct((1, 40, 32, 3), jnp.float32))
  assert out.shape == (1, 16)


def _walk(jaxpr):
  from jax.extend import core as jax_core  # pylint: disable=g-import-not-at-top
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          yield from _walk(sub.jaxpr)
        elif isinstance(sub, jax_core.Jaxpr):
          yield from _walk(sub)


def test_gelu_and_epsilon_reach_every_mlp_and_layer_norm():
  """Traced only: 2 blocks x 2 LayerNorms + encoder_norm + the head's = 6 epsilons (one
  add of the literal each); 2 blocks' MLPs + the head's = 3 GELUs (erfc exact, tanh otherwise).
  (The scanned and rematerialised blocks take the same keyword arguments.)"""
  from jax.extend import core as jax_core  # pylint: disable=g-import-not-at-top

  def counts(**fields):
    model = models.create('ViT-custom', num_classes=3, classifier='map',
                          **dict(TINY, num_layers=2), **fields)
    variables = models.unbox(models.abstract_variables(model, (16, 16)))
    jaxpr = jax.make_jaxpr(lambda v, x: model.apply(v, x, train=False))(
        variables, jax.ShapeDtypeStruct((1, 16, 16, 3), jnp.float32)).jaxpr
    eqns = list(_walk(jaxpr))
    names = [e.primitive.name for e in eqns]
    epsilons = sum(e.primitive.name == 'add' and any(
        isinstance(v, jax_core.Literal) and np.isclose(float(v.val), 0.0123, rtol=1e-6)
        for v in e.invars) for e in eqns)
    # jax.nn.gelu(approximate=False) computes x/2 * erfc(-x/sqrt(2)).
    return names.count('erf') + names.count('erfc'), names.count('tanh'), epsilons

  exact = counts(gelu_approximate=False, layer_norm_epsilon=0.0123)
  default = counts(layer_norm_epsilon=0.0123)
  assert exact == (3, 0, 6) and default == (0, 3, 6)


def test_gelu_approximate_false_is_the_exact_erf_gelu():
  x = np.random.default_rng(3).normal(0, 2, (2, 3, 8)).astype(np.float32)
  exact = models.vit.MlpBlock(mlp_dim=16, gelu_approximate=False)
  shapes = jax.eval_shape(lambda: exact.init(jax.random.key(0), x, deterministic=True))
  rng = np.random.default_rng(4)
  variables = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(np.float32),
                           models.unbox(shapes))
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), variables['params'])
  both = jax.jit(lambda v, x: (exact.apply(v, x, deterministic=True),  # One compilation.
                               models.vit.MlpBlock(mlp_dim=16).apply(v, x, deterministic=True)))
  got, tanh = both(variables, x)
  np.testing.assert_allclose(got, _np_mlp(x.astype(np.float64), p, approximate=False),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tanh, _np_mlp(x.astype(np.float64), p, approximate=True),
                             rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(tanh) - np.asarray(got)).max() > 1e-4


def test_ecosystem_fields_in_the_registry():
  config = models.model_config('ViT-custom', classifier='map', posemb='sincos2d',
                               gelu_approximate=False, layer_norm_epsilon=1e-12, **TINY)
  assert {k: config[k] for k in ('classifier', 'posemb', 'gelu_approximate',
                                 'layer_norm_epsilon')} == dict(
      classifier='map', posemb='sincos2d', gelu_approximate=False, layer_norm_epsilon=1e-12)
  model = models.create('ViT-custom', num_classes=3, **config)
  assert (model.classifier, model.posemb, model.gelu_approximate,
          model.layer_norm_epsilon) == ('map', 'sincos2d', False, 1e-12)
  defaults = models.model_config('ViT-B_16')
  assert (defaults['classifier'], defaults['posemb'], defaults['gelu_approximate'],
          defaults['layer_norm_epsilon']) == ('token', 'learn', True, 1e-6)
  hybrid = models.create('R50+ViT-B_16', num_classes=3, classifier='map', posemb='sincos2d',
                         gelu_approximate=False, layer_norm_epsilon=1e-12)
  assert (hybrid.classifier, hybrid.posemb) == ('map', 'sincos2d')
  with pytest.raises(TypeError, match=r"Unknown override\(s\) \['gelu_approximate'\]"):
    models.create('T2T-ViT-14', num_classes=3, gelu_approximate=False)


@pytest.mark.parametrize('field,value,message', [
    ('classifier', 'MAP', r"classifier must be one of \('token', 'gap', 'map'\), got 'MAP'"),
    ('posemb', 'sincos', r"posemb must be one of \('learn', 'sincos2d'\), got 'sincos'"),
    ('gelu_approximate', 'yes', r"gelu_approximate must be a bool \(True: tanh approximation, "
                                r"False: exact erf GELU\), got 'yes'"),
    ('gelu_approximate', 1, 'gelu_approximate must be a bool .*, got 1'),
    ('layer_norm_epsilon', 0.0, r'layer_norm_epsilon must be a positive float \(e.g. 1e-6\), '
                                'got 0.0'),
    ('layer_norm_epsilon', -1e-6, 'layer_norm_epsilon must be a positive float .*got -1e-06'),
    ('layer_norm_epsilon', '1e-6', "layer_norm_epsilon must be a positive float .*got '1e-6'"),
    ('layer_norm_epsilon', True, 'layer_norm_epsilon must be a positive float .*got True'),
    ('layer_norm_epsilon', float('nan'), 'layer_norm_epsilon must be a positive float .*got nan'),
    ('layer_norm_epsilon', float('inf'), 'layer_norm_epsilon must be a positive float .*got inf'),
])
def test_ecosystem_fields_bad_values(field, value, message):
  with pytest.raises(ValueError, match=message):
    models.create('ViT-custom', num_classes=3, **TINY, **{field: value})
  with pytest.raises(ValueError, match=message):  # Direct construction is checked too.
    models.VisionTransformer(num_classes=3, **TINY, **{field: value})


@pytest.mark.parametrize('hidden_size', [4, 6, 12 + 2])
def test_sincos2d_needs_a_width_divisible_by_4(hidden_size):
  with pytest.raises(ValueError, match=(
      r"posemb='sincos2d' needs a hidden_size that is a multiple of 4 and at least 8, got "
      rf"hidden_size={hidden_size}; use posemb='learn' or another width")):
    models.create('ViT-custom', num_classes=3, **dict(TINY, hidden_size=hidden_size),
                  posemb='sincos2d')
  models.create('ViT-custom', num_classes=3, **dict(TINY, hidden_size=hidden_size))  # 'learn'.


def test_finetuning_init_of_map_and_sincos2d_models():
  def zeros(model, side):  # A fresh init's structure (the head's values are those taken).
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                        models.unbox(models.abstract_variables(model, (side, side))))

  # sincos2d: nothing to resize, at any resolution; the head is re-initialised.
  sincos = models.create('ViT-custom', num_classes=3, classifier='map', posemb='sincos2d', **TINY)
  loaded = _random_variables(sincos, 16, 16)
  fresh_model = models.create('ViT-custom', num_classes=5, classifier='map', posemb='sincos2d',
                              **TINY)
  out = checkpoint.init_for_finetuning(loaded, zeros(fresh_model, 24))
  assert out['params']['head']['kernel'].shape == (16, 5)
  assert not np.any(out['params']['head']['kernel'])
  del out['params']['head'], loaded['params']['head']
  chex.assert_trees_all_equal(out, loaded)
  # 'map' with a learned table: no class-token row, the 2x2 grid resized to 3x3.
  learn = models.create('ViT-custom', num_classes=3, classifier='map', **TINY)
  loaded = _random_variables(learn, 16, 16)
  out = checkpoint.init_for_finetuning(loaded, zeros(learn, 24))
  table = loaded['params']['Transformer']['posembed_input']['pos_embedding']
  resized = out['params']['Transformer']['posembed_input']['pos_embedding']
  assert resized.shape == (1, 9, 16)
  np.testing.assert_array_equal(resized, checkpoint.resize_posemb(table, 9,
                                                                  has_class_token=False))
  np.testing.assert_array_equal(resized[0, [0, 2, 6, 8]], table[0, [0, 1, 2, 3]])  # Corners.
  # The two position embeddings do not mix: the report names the parameter and the checkpoint.
  with pytest.raises(ValueError, match=r'(?s)unexpected keys \(1\): '
                     r'params/Transformer/posembed_input/pos_embedding \(1, 4, 16\)'):
    checkpoint.init_for_finetuning(loaded, zeros(fresh_model, 16))
  with pytest.raises(ValueError, match=r"(?s)missing keys \(1\): params/Transformer/posembed_"
                     r"input/pos_embedding.*classifier='map', posemb='sincos2d', 3 classes"):
    checkpoint.init_for_finetuning(_random_variables(sincos, 16, 16), zeros(learn, 16))
