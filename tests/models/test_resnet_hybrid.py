"""Tests of the hybrid (ResNet stem + ViT) models: golden fixture, counts, token grids, errors."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.models import resnet

# Outputs compared with the reference implementations' fixtures: highest matmul precision.
pytestmark = pytest.mark.golden

FIXTURE = pathlib.Path(__file__).parents[1] / 'fixtures' / 'vit_hybrid_tiny'
RTOL = ATOL = 1e-5


# ------------------------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------------------------


def _fixture_model(**extra):
  """Our model reproducing the official constructor kwargs stored in the fixture's config.json."""
  kwargs = json.loads((FIXTURE / 'config.json').read_text())['kwargs']
  t = kwargs['transformer']
  overrides = dict(
      patch_size=tuple(kwargs['patches']['size']), hidden_size=kwargs['hidden_size'],
      mlp_dim=t['mlp_dim'], num_heads=t['num_heads'], num_layers=t['num_layers'],
      dropout_rate=t['dropout_rate'], attention_dropout_rate=t['attention_dropout_rate'],
      classifier=kwargs['classifier'], representation_size=kwargs['representation_size'],
      resnet_num_layers=tuple(kwargs['resnet']['num_layers']),
      resnet_width_factor=kwargs['resnet']['width_factor'])
  overrides.update(extra)
  return models.create('R+ViT-custom', num_classes=kwargs['num_classes'], **overrides)


@functools.lru_cache(maxsize=None)
def _abstract_variables(model, size):
  # Unboxed: init gives the parameters boxed with their logical axis names. Cached: tracing a
  # full-size hybrid's init takes seconds; the tests that read the same (hashable) model's
  # shapes share one trace (read-only).
  return models.unbox(jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)))


def _param_shapes(model, size):
  abstract = _abstract_variables(model, size)
  return {k: v.shape for k, v in checkpoint.flatten_params(abstract['params']).items()}


def _count(shapes):
  return sum(int(np.prod(s)) for s in shapes.values())


@functools.lru_cache(maxsize=None)
def _jitted_apply(model):
  """One compilation per (hashable) model: ``apply(v, x, train=False)`` with intermediates."""
  return jax.jit(lambda v, x: model.apply(v, x, train=False, capture_intermediates=True))


def _intermediate(intermediates, path):
  node = intermediates
  for part in path.split('/'):
    node = node[part]
  return np.asarray(node['__call__'][0])


# ------------------------------------------------------------------------------------------------
# Golden fixture (official models_vit.VisionTransformer with resnet=(2, 1)).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('fname', ['params.npz', 'params_linen.npz'])
def test_golden_logits_and_intermediates(fname):
  """Pre-Linen (published, GroupNorm (1,1,1,C)) and Linen files both reproduce the official
  logits and every captured stage (conv_root .. block2, embedding, encoder) within 1e-5."""
  model = _fixture_model()
  variables = checkpoint.load(FIXTURE / fname)
  inputs = np.load(FIXTURE / 'inputs.npy')
  ref_logits = np.load(FIXTURE / 'logits.npy')
  ref = np.load(FIXTURE / 'intermediates.npz')

  with jax.default_matmul_precision('highest'):
    logits, state = _jitted_apply(model)(variables, inputs)
  assert logits.shape == (2, 10) and logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)

  intermediates = state['intermediates']
  expected_keys = {'conv_root', 'gn_root', 'block1', 'block2', 'embedding',
                   'Transformer/posembed_input', 'Transformer/encoderblock_0',
                   'Transformer/encoderblock_1', 'Transformer/encoder_norm', 'Transformer',
                   'pre_logits'}
  assert set(ref.files) == expected_keys
  # Stage by stage, in forward order, so the first failure names the first wrong stage.
  for key in ('conv_root', 'gn_root', 'block1', 'block2', 'embedding',
              'Transformer/posembed_input', 'Transformer/encoderblock_0',
              'Transformer/encoderblock_1', 'Transformer/encoder_norm', 'Transformer',
              'pre_logits'):
    got = _intermediate(intermediates, key)
    assert got.shape == ref[key].shape, key
    np.testing.assert_allclose(got, ref[key], rtol=RTOL, atol=ATOL, err_msg=key)


def test_loaded_fixture_tree_matches_model_tree_exactly():
  """Names and shapes: the official layout (ResNet at the top level, GroupNorm (C,)); the
  568,810 parameters of config.json."""
  expected = _param_shapes(_fixture_model(), 32)
  assert _count(expected) == json.loads((FIXTURE / 'config.json').read_text())['num_params']
  assert _count(expected) == 568_810
  for fname in ('params.npz', 'params_linen.npz'):
    loaded = checkpoint.load(FIXTURE / fname)
    got = {k: v.shape for k, v in checkpoint.flatten_params(loaded['params']).items()}
    assert got == expected, fname
  # The three residual-unit kinds: projection at stride 1, identity, projection at stride 2.
  assert expected['block1/unit1/conv_proj/kernel'] == (1, 1, 64, 256)
  assert 'block1/unit2/conv_proj/kernel' not in expected
  assert expected['block2/unit1/conv_proj/kernel'] == (1, 1, 256, 512)
  assert expected['block2/unit1/conv2/kernel'] == (3, 3, 128, 128)
  assert expected['embedding/kernel'] == (1, 1, 512, 32)
  assert not any(k.startswith(('conv_root/bias', 'ResNet', 'resnet')) for k in expected)


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params_and_logits():
  model = _fixture_model(dtype='bfloat16')
  variables = checkpoint.load(FIXTURE / 'params.npz')
  logits, state = _jitted_apply(model)(variables, np.load(FIXTURE / 'inputs.npy'))
  assert logits.dtype == jnp.float32
  assert state['intermediates']['block2']['__call__'][0].dtype == jnp.bfloat16
  # Measured 0.024 on logits of magnitude up to 1.76 (bf16 through 7 convolutions).
  np.testing.assert_allclose(logits, np.load(FIXTURE / 'logits.npy'), atol=0.1)


@pytest.mark.slow
def test_fresh_initialisation_follows_the_official_one():
  """StdConv kernels lecun_normal without bias, GroupNorm scale 1 / bias 0, gn3 scale 0."""
  model = _fixture_model(num_layers=1)
  variables = jax.jit(lambda k: model.init(k, jnp.zeros((1, 32, 32, 3)), train=False))(
      jax.random.key(0, impl='rbg'))
  flat = checkpoint.flatten_params(variables['params'])
  for key, value in flat.items():
    value = np.asarray(value)
    assert value.dtype == np.float32, key
    parts = ['', *key.split('/')]
    if parts[-2].startswith('gn'):
      if parts[-1] == 'scale':
        np.testing.assert_array_equal(value, 0.0 if parts[-2] == 'gn3' else 1.0, err_msg=key)
      else:
        np.testing.assert_array_equal(value, 0.0, err_msg=key)
    elif parts[-2].startswith('conv'):
      assert parts[-1] == 'kernel', key
  # lecun_normal (truncated normal with std 1/sqrt(fan_in)) over 1,152 fan-in values.
  conv2 = np.asarray(flat['block2/unit1/conv2/kernel'])
  assert abs(conv2.std() * np.sqrt(3 * 3 * 128) - 1.0) < 0.05


# ------------------------------------------------------------------------------------------------
# The ResNet pieces.
# ------------------------------------------------------------------------------------------------


def test_weight_standardisation_adds_epsilon_to_the_std():
  """w = (w - mean) / (std + 1e-5), per output channel over (kh, kw, in)."""
  rng = np.random.default_rng(0)
  kernel = rng.normal(size=(3, 3, 4, 2)).astype(np.float32)
  c1 = kernel[..., 1] - kernel[..., 1].mean()
  kernel[..., 1] = 1e-5 * c1 / c1.std()  # std 1e-5
  out = np.asarray(resnet.standardize_weight(jnp.asarray(kernel)))
  np.testing.assert_allclose(out.mean(axis=(0, 1, 2)), 0.0, atol=1e-6)
  c0 = kernel[..., 0]
  np.testing.assert_allclose(out[..., 0], (c0 - c0.mean()) / (c0.std() + 1e-5), rtol=1e-5,
                             atol=1e-6)
  # With the epsilon on the std, a channel of std 1e-5 comes out with std 0.5 (an epsilon on
  # the variance would give sqrt(1e-10 / (1e-10 + 1e-5)) ~ 0.003).
  assert abs(out[..., 1].std() - 0.5) < 1e-2


def test_stem_strides_and_widths():
  assert resnet.resnet_stride(()) == 4
  assert resnet.resnet_stride((2, 1)) == 8
  assert resnet.resnet_stride((3, 4, 9)) == 16
  assert resnet.resnet_stride((2, 2, 2, 2)) == 32
  assert resnet.resnet_out_channels((), 1) == 64
  assert resnet.resnet_out_channels((3, 4, 9), 1) == 1024
  assert resnet.resnet_out_channels((3, 4, 6, 3), 1) == 2048
  assert resnet.resnet_out_channels((3, 4, 9), 2) == 2048


# ------------------------------------------------------------------------------------------------
# Official hybrids: parameter counts, names, token grids (jax.eval_shape: nothing allocated).
# ------------------------------------------------------------------------------------------------
#
# Hand arithmetic (224 px, 1000 classes, classifier 'token', no representation layer).
# ResNet (width 64; StdConv without bias; every GroupNorm has 2C values):
#   root: conv_root 7*7*3*64 = 9,408 + gn_root 128                                   = 9,536
#   A unit with input C_in, features f (output 4f) has conv1 C_in*f, conv2 9f^2, conv3 4f^2 and
#   GroupNorms 2f + 2f + 8f; the first unit of a stage adds conv_proj C_in*4f + gn_proj 8f.
#   stage 1 (f=64):   unit1 (C_in 64)    75,008;  others (C_in 256)    70,400
#   stage 2 (f=128):  unit1 (C_in 256)  379,392;  others (C_in 512)   280,064
#   stage 3 (f=256):  unit1 (C_in 512) 1,512,448; others (C_in 1024) 1,117,184
#   stage 4 (f=512):  unit1 (C_in 1024) 6,039,552; others (C_in 2048) 4,462,592
#   R50 (3,4,9):    9,536 + (75,008 + 2*70,400) + (379,392 + 3*280,064)
#                   + (1,512,448 + 8*1,117,184)                                    = 11,894,848
#   R26 (2,2,2,2):  9,536 + 145,408 + 659,456 + 2,629,632 + 10,502,144              = 13,946,176
#   R50 (3,4,6,3):  9,536 + 215,808 + 1,219,584 + (1,512,448 + 5*1,117,184)
#                   + (6,039,552 + 2*4,462,592)                                    = 23,508,032
# ViT part = the plain ViT count (docs/reference.md section 1 / tests/models/test_vit.py) with the embedding and
# position-embedding sizes replaced:
#   R50+ViT-B/16: B/16 86,567,656 - 16*16*3*768 + 1024*768 (1x1 patch on 1024 channels,
#     196 tokens as B/16)  = 86,764,264;  + 11,894,848                              = 98,659,112
#     (the published count, docs/reference.md section 1).
#   R26+ViT-B/32: B/32 88,224,232 - 32*32*3*768 + 2048*768 (7x7 = 49 tokens as B/32)
#                      = 87,437,800;  + 13,946,176                                  = 101,383,976
#   R26+ViT-S/32: S/16 22,050,664 - 16*16*3*384 + 2048*384 - (197 - 50)*384         = 22,485,736;
#                      + 13,946,176                                                  = 36,431,912
#   R50+ViT-L/32: L/32 306,535,400 - 32*32*3*1024 + 2048*1024                       = 305,486,824;
#                      + 23,508,032                                                  = 328,994,856
#   R+ViT-Ti/16:  Ti/16 5,717,416 - 16*16*3*192 + 8*8*64*192 (8x8 patches on the 64-channel
#                 stem output) - (197 - 50)*192 (7x7 grid) = 6,328,168;  + 9,536     = 6,337,704
# timm's ports of the same models report 98.7M, 101.4M, 36.4M, 329.0M and 6.3M.


@pytest.mark.parametrize('name,expected', [
    ('R50+ViT-B_16', 98_659_112),  # Its shapes are test_r50_b16_parameter_names_and_shapes'.
    # The same code as R26+ViT-S_32 and R50+ViT-B_16 (each count traces a full-size init):
    # full suite.
    pytest.param('R26+ViT-B_32', 101_383_976, marks=pytest.mark.slow),
    ('R26+ViT-S_32', 36_431_912),
    pytest.param('R50+ViT-L_32', 328_994_856, marks=pytest.mark.slow),
    ('R+ViT-Ti_16', 6_337_704),
])
def test_official_hybrid_parameter_counts(name, expected):
  assert _count(_param_shapes(models.create(name, num_classes=1000), 224)) == expected


def test_scan_and_remat_keep_the_hybrid_parameter_count():
  shapes = _param_shapes(models.create('R50+ViT-B/16', num_classes=1000, scan=True, remat=True),
                         224)
  assert _count(shapes) == 98_659_112
  assert shapes['Transformer/encoderblock/LayerNorm_0/scale'] == (12, 768)
  assert shapes['block3/unit9/conv3/kernel'] == (1, 1, 256, 1024)


def test_r50_b16_parameter_names_and_shapes():
  shapes = _param_shapes(models.create('R50+ViT-B_16', num_classes=1000), 224)
  expected = {
      'conv_root/kernel': (7, 7, 3, 64),
      'gn_root/scale': (64,),
      'gn_root/bias': (64,),
      'block1/unit1/conv1/kernel': (1, 1, 64, 64),
      'block1/unit1/gn1/scale': (64,),
      'block1/unit1/conv2/kernel': (3, 3, 64, 64),
      'block1/unit1/conv3/kernel': (1, 1, 64, 256),
      'block1/unit1/gn3/scale': (256,),
      'block1/unit1/conv_proj/kernel': (1, 1, 64, 256),
      'block1/unit1/gn_proj/bias': (256,),
      'block1/unit3/conv1/kernel': (1, 1, 256, 64),
      'block2/unit1/conv_proj/kernel': (1, 1, 256, 512),
      'block2/unit4/conv2/kernel': (3, 3, 128, 128),
      'block3/unit1/conv_proj/kernel': (1, 1, 512, 1024),
      'block3/unit9/conv3/kernel': (1, 1, 256, 1024),
      'block3/unit9/gn3/bias': (1024,),
      'embedding/kernel': (1, 1, 1024, 768),
      'embedding/bias': (768,),
      'cls': (1, 1, 768),
      'Transformer/posembed_input/pos_embedding': (1, 197, 768),
      'head/kernel': (768, 1000),
  }
  for key, shape in expected.items():
    assert shapes[key] == shape, key
  for absent in ('block1/unit4/conv1/kernel', 'block1/unit2/conv_proj/kernel',
                 'block3/unit10/conv1/kernel', 'block4/unit1/conv1/kernel', 'conv_root/bias'):
    assert absent not in shapes, absent
  resnet_keys = [k for k in shapes if k.startswith(('conv_root', 'gn_root', 'block'))]
  # root 3 + 16 units x 9 leaves + 3 projections x 3 leaves.
  assert len(resnet_keys) == 3 + 16 * 9 + 3 * 3


@pytest.mark.parametrize('name,size,grid', [
    ('R50+ViT-B_16', 224, 14),  # stride 16 * patch 1
    ('R50+ViT-B_16', 384, 24),
    ('R+ViT-Ti_16', 224, 7),    # stem stride 4 * patch 8 = 32, whatever the name says
    ('R26+ViT-S_32', 224, 7),
    ('R50+ViT-L_32', 384, 12),
])
def test_token_grid(name, size, grid):
  model = models.create(name, num_classes=10, num_layers=1)  # The depth does not change the grid.
  abstract = _abstract_variables(model, size)
  _, state = jax.eval_shape(
      lambda v, x: model.apply(v, x, train=False, capture_intermediates=True),
      abstract, jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32))
  embedding = state['intermediates']['embedding']['__call__'][0]
  assert embedding.shape == (2, grid, grid, model.hidden_size)
  pos = abstract['params']['Transformer']['posembed_input']['pos_embedding']
  assert pos.shape == (1, grid * grid + 1, model.hidden_size)


def test_non_square_images():
  model = models.create('R50+ViT-B_16', num_classes=10, num_layers=1)
  shapes = _param_shapes(model, 224)
  assert shapes['Transformer/posembed_input/pos_embedding'] == (1, 197, 768)
  abstract = models.unbox(jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 320, 3)), train=False)))
  assert abstract['params']['Transformer']['posembed_input']['pos_embedding'].shape == (
      1, 14 * 20 + 1, 768)


# ------------------------------------------------------------------------------------------------
# Registry.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name,size,resnet_layers,patch,dropout', [
    ('R50+ViT-B_16', 'B', (3, 4, 9), 1, 0.1),
    ('R50+ViT-L_32', 'L', (3, 4, 6, 3), 1, 0.1),
    ('R26+ViT-B_32', 'B', (2, 2, 2, 2), 1, 0.0),
    ('R26+ViT-S_32', 'S', (2, 2, 2, 2), 1, 0.0),
    ('R+ViT-Ti_16', 'Ti', (), 8, 0.0),
])
def test_official_hybrid_configs(name, size, resnet_layers, patch, dropout):
  """As the official configs/models.py (dropout 0.1 where it derives from L/16 or sets it)."""
  config = models.model_config(name)
  layers, hidden, mlp, heads, _ = models.VIT_SIZES[size]
  assert (config['num_layers'], config['hidden_size'], config['mlp_dim'],
          config['num_heads']) == (layers, hidden, mlp, heads)
  assert config['resnet_num_layers'] == resnet_layers
  assert config['resnet_width_factor'] == 1
  assert config['patch_size'] == (patch, patch)
  assert config['dropout_rate'] == dropout and config['attention_dropout_rate'] == 0.0
  assert config['classifier'] == 'token' and config['representation_size'] is None
  assert set(config) == set(models.HYBRID_OVERRIDE_KEYS)
  assert name in models.HYBRID_MODEL_NAMES
  assert isinstance(models.create(name, num_classes=3), models.VisionTransformer)


def test_hybrid_name_spellings():
  reference = models.model_config('R50+ViT-B_16')
  for spelling in ('R50+ViT-B/16', 'r50+vit-b16', 'R50+ViT_B_16', 'R50+vit-b/16', 'R50_B_16'):
    assert models.model_config(spelling) == reference, spelling
  assert models.model_config('R+ViT-Ti/16') == models.model_config('R_Ti_16')
  assert models.model_config('R26_S_32') == models.model_config('R26+ViT-S/32')


def test_overrides_and_ml_collections_round_trip():
  """The resolved config is flat: it lives in a ConfigDict, is overridden there, and builds."""
  config = ml_collections.ConfigDict(models.model_config('R50+ViT-B_16'))
  config.resnet_num_layers = (3, 4, 6, 3)
  config.num_layers = 1
  model = models.create('R50+ViT-B_16', num_classes=10, **config.to_dict())
  shapes = _param_shapes(model, 64)
  assert shapes['block4/unit3/conv3/kernel'] == (1, 1, 512, 2048)
  assert shapes['embedding/kernel'] == (1, 1, 2048, 768)
  assert shapes['Transformer/posembed_input/pos_embedding'] == (1, 2 * 2 + 1, 768)
  # Lists (e.g. from JSON) become tuples; width factor 2 doubles every width.
  config = models.model_config('R26+ViT-S_32', resnet_num_layers=[1, 1], resnet_width_factor=2)
  assert config['resnet_num_layers'] == (1, 1)
  shapes = _param_shapes(models.create('R26+ViT-S_32', num_classes=10, num_layers=1,
                                       **{k: config[k] for k in ('resnet_num_layers',
                                                                 'resnet_width_factor')}), 32)
  assert shapes['conv_root/kernel'] == (7, 7, 3, 128)
  assert shapes['block2/unit1/conv3/kernel'] == (1, 1, 256, 1024)


def test_custom_hybrid_needs_the_architecture():
  with pytest.raises(ValueError, match='resnet_num_layers'):
    models.create('R+ViT-custom', num_classes=2, patch_size=1, hidden_size=8, mlp_dim=16,
                  num_heads=2, num_layers=1)
  model = models.create('R+ViT-custom', num_classes=2, patch_size=1, hidden_size=32, mlp_dim=16,
                        num_heads=2, num_layers=1, resnet_num_layers=())
  assert model.resnet_num_layers == () and model.resnet_width_factor == 1


def test_unknown_hybrid_names_list_the_accepted_forms():
  with pytest.raises(ValueError, match=r"(?s)'R50\+ViT-S_16' is not one of the official hybrid.*"
                                       r"R50\+ViT-B_16.*R\+ViT-custom"):
    models.create('R50+ViT-S_16', num_classes=10)
  with pytest.raises(ValueError, match=r"(?s)Unknown model name 'R50\+ViT-Q_16'.*"
                                       r"R50\+ViT-B/16.*R\+ViT-custom"):
    models.create('R50+ViT-Q_16', num_classes=10)


def test_invalid_resnet_overrides():
  with pytest.raises(ValueError, match='resnet_num_layers must contain positive ints'):
    models.model_config('R50+ViT-B_16', resnet_num_layers=(3, 0, 9))
  with pytest.raises(ValueError, match='resnet_num_layers must be a tuple'):
    models.model_config('R50+ViT-B_16', resnet_num_layers='3,4,9')
  with pytest.raises(ValueError, match='multiple of 32'):
    models.model_config('R50+ViT-B_16', resnet_width_factor=0.3)
  with pytest.raises(TypeError, match=r"(?s)\['resnet'\].*resnet_num_layers.*resnet_width"):
    models.create('R50+ViT-B_16', num_classes=10, resnet={'num_layers': (3, 4, 9)})
  with pytest.raises(ValueError, match='resnet_num_layers'):  # Direct construction is checked.
    models.VisionTransformer(num_classes=10, patch_size=1, hidden_size=8, mlp_dim=8, num_heads=2,
                             num_layers=1, resnet_num_layers=(-1,))
  # The plain ViT family does not take the ResNet keys.
  with pytest.raises(TypeError, match='resnet_num_layers'):
    models.create('ViT-B_16', num_classes=10, resnet_num_layers=(3, 4, 9))


@pytest.mark.parametrize('name,size,message', [
    ('R50+ViT-B_16', 200, r'Image height 200 is not divisible by the total stride 16 \(ResNet '
                          r'stem stride 16 x patch size 1.*multiple of 16 \(e\.g\. 192 or 208\)'),
    ('R+ViT-Ti_16', 240, r'not divisible by the total stride 32 \(ResNet stem stride 4 x patch '
                         r'size 8.*multiple of 32 \(e\.g\. 224 or 256\)'),
])
def test_image_size_not_divisible_by_the_total_stride(name, size, message):
  model = models.create(name, num_classes=10, num_layers=1)
  with pytest.raises(models.ImageSizeError, match=message):
    jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, size, 224, 3)),
                                      train=False))


def test_image_width_not_divisible_by_the_total_stride():
  model = models.create('R50+ViT-B_16', num_classes=10, num_layers=1)
  with pytest.raises(models.ImageSizeError,
                     match='width 200 is not divisible by the total stride 16'):
    jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 200, 3)),
                                      train=False))
