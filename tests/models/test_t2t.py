"""Tests of vit_jax.models.t2t (T2T-ViT): sizes, golden logits vs the official PyTorch code,
token counts, fixed tables, state_dict conversion, float32 Performer features, registry."""

import functools
import json
import math
import pathlib

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import t2t_fixtures
from vit_jax import models
from vit_jax.models import t2t
from vit_jax.checkpoint import t2t_torch

# Outputs compared with the reference implementations' fixtures: highest matmul precision.
pytestmark = pytest.mark.golden

FIXTURES = pathlib.Path(__file__).parents[1] / 'fixtures'
GOLDEN = ('t2t_tiny_performer', 't2t_tiny_transformer')
RTOL = ATOL = 1e-5

# (name, total incl. fixed tables, trainable) at 224 px, 1000 classes: docs/reference.md section 2.
PARAM_COUNTS = (
    ('T2T-ViT-7', 4_310_222, 4_255_694),
    ('T2T-ViT-10', 5_889_230, 5_834_702),
    ('T2T-ViT-12', 6_941_902, 6_887_374),
    ('T2T-ViT-14', 21_545_550, 21_465_806),
    ('T2T-ViT-19', 39_177_422, 39_085_070),
    ('T2T-ViT-24', 64_105_934, 64_000_974),
    ('T2T-ViT_t-14', 21_541_070, 21_465_422),
    ('T2T-ViT_t-19', 39_172_942, 39_084_686),
    ('T2T-ViT_t-24', 64_101_454, 64_000_590),
)


# ------------------------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------------------------


def _golden_model(name, **extra):
  kwargs = dict(t2t_fixtures.constructor_kwargs(name))
  image_size = kwargs.pop('img_size')
  num_classes = kwargs.pop('num_classes')
  kwargs.update(extra)
  return models.create('T2T-ViT-custom', num_classes=num_classes, **kwargs), image_size


def _load_state_dict(name):
  with np.load(FIXTURES / name / 'state_dict_ema.npz', allow_pickle=False) as f:
    return {k: f[k] for k in f.files}


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _init_shapes(model, height, width=None):
  width = height if width is None else width
  return jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, height, width, 3), jnp.float32), train=False))


def _init(model, images, seed=0):
  # Jitted: eager init compiles every op separately, which is slow on CPU.
  return jax.jit(functools.partial(model.init, train=False))(jax.random.key(seed), images)


def _random_variables(model, images, seed=0):
  """Normal(0, 0.2) values of every variable (LayerNorm scales 1), no init compiled: for tests
  of behaviour, not of the initialisers (a T2T-ViT init takes seconds to compile on CPU)."""
  shapes = models.unbox(jax.eval_shape(functools.partial(model.init, train=False),
                                       jax.random.key(seed), images))
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, s: jnp.ones(s.shape, s.dtype) if path[-1].key == 'scale'
      else jnp.asarray(0.2 * rng.normal(size=s.shape), s.dtype), shapes)


@functools.lru_cache(maxsize=None)
def _jitted_apply(model):
  def fn(variables, images):
    return model.apply(variables, images, train=False, capture_intermediates=True,
                       mutable=['intermediates'])
  return jax.jit(fn)


@functools.lru_cache(maxsize=None)
def _golden_run(name):
  model, _ = _golden_model(name)
  variables = t2t_torch.from_torch_state_dict(_load_state_dict(name), model)
  inputs = np.load(FIXTURES / name / 'inputs_nhwc.npy')
  with jax.default_matmul_precision('highest'):
    logits, state = _jitted_apply(model)(variables, inputs)
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(state['intermediates']), sep='/')
  return np.asarray(logits), {k: np.asarray(v[0]) for k, v in flat.items()}


# ------------------------------------------------------------------------------------------------
# Sizes and token counts.
# ------------------------------------------------------------------------------------------------


#: Fast tier: the small and a large performer model and the transformer one (each count traces a
#: full-size init: about a second); the other sizes of the same code run in the full suite.
FAST_COUNTS = ('T2T-ViT-7', 'T2T-ViT-14', 'T2T-ViT_t-14')


@pytest.mark.parametrize('name,total,trainable', [
    c if c[0] in FAST_COUNTS else pytest.param(*c, marks=pytest.mark.slow) for c in PARAM_COUNTS])
def test_parameter_counts(name, total, trainable):
  shapes = _init_shapes(models.create(name, num_classes=1000), 224)
  assert set(shapes) == {'params', 'constants'}
  assert _count(shapes['params']) == trainable
  assert _count(shapes) == total


@pytest.mark.parametrize('size,tokens', [(224, 196), (384, 576), (200, 169)])
def test_token_counts(size, tokens):
  model = models.create('T2T-ViT_t-14', num_classes=7, embed_dim=96, depth=1, num_heads=3,
                        token_dim=32)
  shapes = _init_shapes(model, size)
  assert shapes['constants']['pos_embed'].shape == (1, tokens + 1, 96)
  side = math.isqrt(tokens)
  assert t2t.token_grid(size, size) == (side, side)
  out = jax.eval_shape(lambda: model.apply(
      jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
      jnp.zeros((2, size, size, 3)), train=False))
  assert out.shape == (2, 7) and out.dtype == jnp.float32


def test_non_square_image_and_too_small_image():
  model = models.create('T2T-ViT-7', num_classes=5, depth=1)
  shapes = _init_shapes(model, 224, 160)
  assert shapes['constants']['pos_embed'].shape == (1, 14 * 10 + 1, 256)
  with pytest.raises(models.ImageSizeError, match='too small'):
    _init_shapes(model, 2)


def test_registry_names_and_overrides():
  model = models.create('T2T-ViT_t-14', num_classes=7, embed_dim=96, depth=3, num_heads=3,
                        token_dim=32)
  assert isinstance(model, t2t.T2TViT)
  assert (model.tokens_type, model.embed_dim, model.depth, model.num_heads, model.mlp_ratio,
          model.token_dim, model.qk_scale) == ('transformer', 96, 3, 3, 3.0, 32, None)
  config = models.model_config('t2t_vit_7')
  assert (config['tokens_type'], config['embed_dim'], config['depth'], config['num_heads'],
          config['mlp_ratio'], config['token_dim']) == ('performer', 256, 7, 4, 2.0, 64)
  assert models.model_config('T2T-ViT-24', qk_scale=512**-0.5)['qk_scale'] == 512**-0.5
  with pytest.raises(ValueError, match='Unknown model name'):
    models.create('T2T-ViT_t-7', num_classes=10)  # No Transformer-T2T version of depth 7.
  with pytest.raises(TypeError, match='embed_dim'):
    models.create('T2T-ViT-14', num_classes=10, hidden_size=384)
  with pytest.raises(ValueError, match='mlp_ratio'):
    models.create('T2T-ViT-custom', num_classes=10, embed_dim=64, depth=2, num_heads=2)
  with pytest.raises(ValueError, match='tokens_type'):
    models.create('T2T-ViT-14', num_classes=10, tokens_type='conv')
  with pytest.raises(ValueError, match='divisible'):
    models.create('T2T-ViT-14', num_classes=10, num_heads=5)


# ------------------------------------------------------------------------------------------------
# Golden logits and intermediates (official PyTorch code, tests/fixtures/t2t_tiny_*).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', GOLDEN)
def test_golden_logits(name):
  logits, _ = _golden_run(name)
  ref = np.load(FIXTURES / name / 'logits.npy')
  assert logits.dtype == np.float32 and logits.shape == ref.shape
  np.testing.assert_allclose(logits, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('name', GOLDEN)
def test_golden_intermediates(name):
  _, ours = _golden_run(name)
  with np.load(FIXTURES / name / 'intermediates.npz', allow_pickle=False) as f:
    ref = {k: f[k] for k in f.files}
  depth = t2t_fixtures.constructor_kwargs(name)['depth']
  pairs = {
      # nn.Unfold gives (B, C*k*k, L); our tokens are (B, L, C*k*k).
      'tokens_to_token.soft_split0': 'tokens_to_token/soft_split0',
      'tokens_to_token.attention1': 'tokens_to_token/attention1/__call__',
      'tokens_to_token.soft_split1': 'tokens_to_token/soft_split1',
      'tokens_to_token.attention2': 'tokens_to_token/attention2/__call__',
      'tokens_to_token.soft_split2': 'tokens_to_token/soft_split2',
      'tokens_to_token.project': 'tokens_to_token/project/__call__',
      'tokens_to_token': 'tokens_to_token/__call__',
      'pos_drop': 'pos_drop',
      'norm': 'norm/__call__',
      **{f'blocks.{i}': f'blocks_{i}/__call__' for i in range(depth)},
  }
  assert set(pairs) == set(ref)
  for torch_name, our_name in pairs.items():
    value = ours[our_name]
    if 'soft_split' in torch_name:
      value = value.transpose(0, 2, 1)
    np.testing.assert_allclose(value, ref[torch_name], rtol=RTOL, atol=ATOL,
                               err_msg=torch_name)


@pytest.mark.slow
def test_fixed_tables_live_in_constants():
  model, image_size = _golden_model('t2t_tiny_performer')
  variables = _init(model, jnp.zeros((1, image_size, image_size, 3)), seed=3)
  assert set(variables) == {'params', 'constants'}
  constants = flax.traverse_util.flatten_dict(variables['constants'], sep='/')
  assert set(constants) == {'pos_embed', 'tokens_to_token/attention1/w',
                            'tokens_to_token/attention2/w'}
  params = flax.traverse_util.flatten_dict(variables['params'], sep='/')
  assert not any(k.endswith(('pos_embed', '/w')) for k in params)
  # The sinusoid table is bit-for-bit the one stored by the official code.
  stored = _load_state_dict('t2t_tiny_performer')
  np.testing.assert_array_equal(constants['pos_embed'], stored['pos_embed'])
  # Performer w: (m, token_dim), m = token_dim / 2, orthogonal rows of norm sqrt(m).
  w = np.asarray(constants['tokens_to_token/attention1/w'])
  m = model.token_dim // 2
  assert w.shape == (m, model.token_dim)
  np.testing.assert_allclose(w @ w.T, m * np.eye(m), atol=1e-4)
  assert not np.allclose(w, constants['tokens_to_token/attention2/w'])

  transformer, _ = _golden_model('t2t_tiny_transformer')
  shapes = _init_shapes(transformer, image_size)
  assert list(shapes['constants']) == ['pos_embed']
  assert np.allclose(t2t.sinusoid_table(17, 64),
                     _load_state_dict('t2t_tiny_transformer')['pos_embed'], rtol=0, atol=0)


def test_missing_constants_or_wrong_image_size_are_rejected():
  model, _ = _golden_model('t2t_tiny_transformer')
  variables = t2t_torch.from_torch_state_dict(_load_state_dict('t2t_tiny_transformer'), model)
  with pytest.raises(ValueError, match=r"lack the fixed table 'constants/pos_embed'"):
    jax.eval_shape(functools.partial(model.apply, train=False),
                   {'params': variables['params']}, jnp.zeros((1, 64, 64, 3)))
  with pytest.raises(ValueError, match=r'pos_embed has shape \(1, 17, 64\).*sinusoid_table'):
    jax.eval_shape(functools.partial(model.apply, train=False), variables,
                   jnp.zeros((1, 96, 96, 3)))


# ------------------------------------------------------------------------------------------------
# State_dict conversion.
# ------------------------------------------------------------------------------------------------


def test_converter_names_layout_and_module_prefix():
  model, _ = _golden_model('t2t_tiny_performer')
  state_dict = _load_state_dict('t2t_tiny_performer')
  variables = t2t_torch.from_torch_state_dict(
      {f'module.{k}': v for k, v in state_dict.items()}, model)
  params = variables['params']
  np.testing.assert_array_equal(params['blocks_1']['attn']['qkv']['kernel'],
                                state_dict['blocks.1.attn.qkv.weight'].T)
  np.testing.assert_array_equal(params['tokens_to_token']['attention2']['mlp_2']['bias'],
                                state_dict['tokens_to_token.attention2.mlp.2.bias'])
  np.testing.assert_array_equal(params['norm']['scale'], state_dict['norm.weight'])
  np.testing.assert_array_equal(variables['constants']['tokens_to_token']['attention1']['w'],
                                state_dict['tokens_to_token.attention1.w'])
  n_params = _count(variables['params'])
  assert n_params == json.loads(
      (FIXTURES / 't2t_tiny_performer' / 'config.json').read_text())['num_params_trainable']
  assert t2t_torch.torch_key_to_flax('blocks.3.mlp.fc1.weight') == (
      'params', ('blocks_3', 'mlp', 'fc1', 'kernel'))
  assert t2t_torch.torch_key_to_flax('tokens_to_token.attention1.norm1.weight') == (
      'params', ('tokens_to_token', 'attention1', 'norm1', 'scale'))


def test_converter_reports_bad_keys_and_shapes():
  model, _ = _golden_model('t2t_tiny_performer')
  state_dict = _load_state_dict('t2t_tiny_performer')
  del state_dict['blocks.0.mlp.fc1.bias']
  state_dict['blocks.0.attn.qkv.bias'] = np.zeros(192, np.float32)
  state_dict['head.weight'] = np.zeros((1000, 64), np.float32)
  with pytest.raises(ValueError) as info:
    t2t_torch.from_torch_state_dict(state_dict, model)
  message = str(info.value)
  assert 'missing keys (1): blocks.0.mlp.fc1.bias' in message
  assert 'unexpected keys (1): blocks.0.attn.qkv.bias (192,)' in message
  assert 'head.weight: checkpoint (1000, 64), model (10, 64)' in message
  assert 'head.bias' not in message  # Present with the right shape.

  # A Performer checkpoint does not fit a Transformer-T2T model.
  transformer, _ = _golden_model('t2t_tiny_transformer')
  with pytest.raises(ValueError, match=r'(?s)missing keys.*attention1\.attn\.qkv\.weight.*'
                                       r'unexpected keys.*attention1\.kqv\.weight'):
    t2t_torch.from_torch_state_dict(_load_state_dict('t2t_tiny_performer'), transformer)


# ------------------------------------------------------------------------------------------------
# Numerics: soft split, float32 Performer features, drop path.
# ------------------------------------------------------------------------------------------------


def test_soft_split_is_channel_major_unfold():
  x = np.arange(2 * 5 * 6 * 3, dtype=np.float32).reshape(2, 5, 6, 3)
  out = np.asarray(t2t.soft_split(jnp.asarray(x), 3, 2, 1))
  oh, ow = 3, 3
  assert out.shape == (2, oh * ow, 3 * 9)
  padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  for r in range(oh):
    for c in range(ow):
      patch = padded[:, 2 * r:2 * r + 3, 2 * c:2 * c + 3, :]  # [B, i, j, ch]
      np.testing.assert_array_equal(out[:, r * ow + c], patch.transpose(0, 3, 1, 2).reshape(2, -1))


@pytest.mark.slow
def test_performer_features_stay_float32_under_bfloat16():
  w = t2t._orthogonal_features(jax.random.key(0), 4, 8)  # pylint: disable=protected-access
  x = jax.random.normal(jax.random.key(1), (2, 5, 8)).astype(jnp.bfloat16)
  features = t2t.performer_features(x, w.astype(jnp.bfloat16))
  assert features.dtype == jnp.float32
  ref = np.exp(np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
               - (np.asarray(x, np.float32) ** 2).sum(-1, keepdims=True) / 2) / 2.0
  np.testing.assert_allclose(features, ref, rtol=2e-2, atol=1e-6)

  # In a whole bfloat16 model every exp (Performer features and softmax) runs in float32.
  model = models.create('T2T-ViT-custom', num_classes=3, embed_dim=32, depth=1, num_heads=2,
                        mlp_ratio=2.0, token_dim=8, dtype=jnp.bfloat16)
  images = jnp.zeros((1, 32, 32, 3))
  variables = _init(model, images)
  jaxpr = jax.make_jaxpr(lambda v, x: model.apply(v, x, train=False))(variables, images)

  def exp_dtypes(jaxpr_):
    for eqn in jaxpr_.eqns:
      if eqn.primitive.name == 'exp':
        yield eqn.outvars[0].aval.dtype
      for param in eqn.params.values():
        inner = getattr(param, 'jaxpr', param)
        if hasattr(inner, 'eqns'):
          yield from exp_dtypes(inner)

  dtypes = list(exp_dtypes(jaxpr.jaxpr))
  assert len(dtypes) >= 5  # 2 performer layers x (k, q) + 1 softmax.
  assert all(d == jnp.float32 for d in dtypes), dtypes
  logits = jax.jit(functools.partial(model.apply, train=False))(
      variables, jax.random.normal(jax.random.key(2), (2, 32, 32, 3)))
  assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))


@pytest.mark.slow
def test_drop_path_only_in_training():
  model, image_size = _golden_model('t2t_tiny_transformer', drop_path_rate=0.5, depth=4)
  images = jax.random.normal(jax.random.key(0), (8, image_size, image_size, 3))
  variables = _random_variables(model, images, seed=1)
  evaluate = jax.jit(functools.partial(model.apply, train=False))
  train = jax.jit(lambda v, x, key: model.apply(v, x, train=True, rngs={'dropout': key}))
  eval_a = evaluate(variables, images)
  np.testing.assert_array_equal(eval_a, evaluate(variables, images))
  train_a = train(variables, images, jax.random.key(2))
  train_b = train(variables, images, jax.random.key(3))
  assert not np.allclose(train_a, eval_a) and not np.allclose(train_a, train_b)
  with pytest.raises(Exception, match='dropout'):
    jax.eval_shape(functools.partial(model.apply, train=True), variables, images)


# ------------------------------------------------------------------------------------------------
# Scanned and rematerialised backbone (the training default, models.TRAINING_DEFAULTS).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', GOLDEN)
def test_scanned_backbone_loads_the_reference_weights(name):
  model, _ = _golden_model(name, scan=True, remat=True,
                           remat_policy='dots_with_no_batch_dims_saveable')
  variables = t2t_torch.from_torch_state_dict(_load_state_dict(name), model)
  params = variables['params']
  depth = model.depth
  assert 'blocks' in params and not any(k.startswith('blocks_') for k in params)
  assert params['blocks']['attn']['qkv']['kernel'].shape == (depth, model.embed_dim,
                                                             3 * model.embed_dim)
  unrolled, _ = _golden_model(name)
  assert _count(params) == _count(_init_shapes(unrolled, 32)['params'])
  inputs = np.load(FIXTURES / name / 'inputs_nhwc.npy')
  with jax.default_matmul_precision('highest'):
    logits = jax.jit(functools.partial(model.apply, train=False))(variables, inputs)
  np.testing.assert_allclose(logits, np.load(FIXTURES / name / 'logits.npy'), rtol=RTOL,
                             atol=ATOL)
  # The layout converts both ways; the unrolled tree is the reference's blocks.i.
  back = models.unscan_params(params)
  assert models.is_scanned(params) and not models.is_scanned(back)
  assert [f'blocks_{i}' for i in range(depth)] == sorted(k for k in back if k.startswith('blocks'))
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top
  assert f'depth={depth}' in checkpoint.describe_architecture(variables)


@pytest.mark.slow
@pytest.mark.parametrize('policy', ['nothing_saveable', 'dots_with_no_batch_dims_saveable'])
def test_scanned_rematerialised_gradients_equal_the_unrolled_ones(policy):
  plain, image_size = _golden_model('t2t_tiny_performer', drop_path_rate=0.0)
  fast = plain.clone(scan=True, remat=True, remat_policy=policy)
  images = jax.random.normal(jax.random.key(0), (2, image_size, image_size, 3))
  variables = _init(plain, images)

  def grads(model, params):
    loss = lambda p: jnp.sum(model.apply(dict(variables, params=p), images, train=True) ** 2)
    return jax.jit(jax.grad(loss))(params)

  expected = grads(plain, variables['params'])
  got = models.unscan_params(grads(fast, models.scan_params(variables['params'])))
  assert jax.tree.structure(got) == jax.tree.structure(models.unbox(expected))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               got, models.unbox(expected))
  with pytest.raises(ValueError, match='remat_policy must be one of'):
    plain.clone(remat_policy='dots')


@pytest.mark.slow
def test_scanned_blocks_keep_their_own_drop_path_rate():
  # Rates are linspace(0, rate, depth): one block gets 0 (no drop path at all), two blocks get
  # 0 and the full rate. A scanned stack must give each block its rate, not one shared value.
  model, image_size = _golden_model('t2t_tiny_transformer', drop_path_rate=0.5, depth=1,
                                    scan=True)
  images = jax.random.normal(jax.random.key(0), (8, image_size, image_size, 3))

  def train_and_eval(model):
    variables = _random_variables(model, images, seed=1)
    train = jax.jit(lambda v, key: model.apply(v, images, train=True, rngs={'dropout': key}))
    evaluate = jax.jit(lambda v: model.apply(v, images, train=False))  # Eager is slow on CPU.
    return train(variables, jax.random.key(2)), evaluate(variables)

  trained, evaluated = train_and_eval(model)
  np.testing.assert_allclose(trained, evaluated, rtol=1e-6, atol=1e-6)
  trained, evaluated = train_and_eval(model.clone(depth=2))
  assert not np.allclose(trained, evaluated)
  # A traced rate must not promote bfloat16 activations (the scan carry keeps its dtype).
  trained, _ = train_and_eval(model.clone(depth=2, dtype='bfloat16'))
  assert trained.dtype == jnp.float32 and np.all(np.isfinite(trained))
  # The dynamic rate of DropPath: whole samples dropped with that probability, the rest scaled.
  x = jnp.ones((4000, 3))
  y = t2t.DropPath().apply({}, x, deterministic=False, rate=jnp.float32(0.25),
                           rngs={'dropout': jax.random.key(4)})
  kept = np.asarray(y[:, 0] != 0)
  assert abs(kept.mean() - 0.75) < 0.03
  np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.75, rtol=1e-6)
