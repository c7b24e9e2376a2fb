"""timm's ViT variants as VisionTransformer fields (issue 41): LayerScale, register tokens, a
position table of the patches only, fc_norm; QK normalisation (issue 51); their parameters,
checks and computation by hand (the golden logits of timm's own models:
tests/checkpoint/test_ecosystem_variants.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.checkpoint import vit_shapes
from vit_jax.models import intermediates

TINY = dict(patch_size=8, hidden_size=16, num_layers=2, num_heads=2, mlp_dim=24)


def _shapes(model, size=16):
  abstract = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False))
  return {k: tuple(v.shape) for k, v in checkpoint.flatten_params(abstract['params']).items()}


def _random(model, size=16, seed=0):
  shapes = models.unbox(models.abstract_variables(model, (size, size)))
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: (0.5 * rng.standard_normal(x.shape)).astype(np.float32), shapes)


def _apply(model, variables, images):
  """The model's logits at inference, as NumPy."""
  return np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, images))


def ln(x, q):
  """LayerNorm by hand over the last axis, epsilon 1e-6, with ``q``'s scale and bias."""
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * q['scale'] + (
      q['bias'])


def test_defaults_add_nothing():
  config = models.model_config('ViT-B_16')
  assert (config['layerscale_init'], config['num_registers'], config['no_embed_class'],
          config['fc_norm'], config['qk_norm']) == (None, 0, False, False, False)
  plain = _shapes(models.create('ViT-custom', num_classes=3, **TINY))
  assert not any('LayerScale' in k or 'registers' in k or 'fc_norm' in k or '_ln/' in k
                 for k in plain)


def test_parameters_of_each_variant_and_their_counts():
  plain = _shapes(models.create('ViT-custom', num_classes=3, **TINY))
  model = models.create('ViT-custom', num_classes=3, **TINY, layerscale_init=1e-6,
                        num_registers=4, no_embed_class=True)
  shapes = _shapes(model)
  assert set(shapes) - set(plain) == {'registers'} | {
      f'Transformer/encoderblock_{i}/LayerScale_{j}/scale' for i in (0, 1) for j in (0, 1)}
  assert shapes['registers'] == (1, 4, 16)
  assert shapes['Transformer/encoderblock_1/LayerScale_1/scale'] == (16,)
  # The table covers the 2x2 grid only: 4 rows, not 1 + 4 + 4.
  assert shapes['Transformer/posembed_input/pos_embedding'] == (1, 4, 16)
  assert plain['Transformer/posembed_input/pos_embedding'] == (1, 5, 16)
  total = sum(np.prod(s) for s in plain.values())
  assert sum(np.prod(s) for s in shapes.values()) == total + 4 * 16 + 4 * 16 - 16
  # Covering the prefix: one row for the class token and each register.
  covered = _shapes(models.create('ViT-custom', num_classes=3, **TINY, num_registers=4))
  assert covered['Transformer/posembed_input/pos_embedding'] == (1, 9, 16)
  gap = _shapes(models.create('ViT-custom', num_classes=3, **TINY, classifier='gap',
                              fc_norm=True))
  assert 'Transformer/encoder_norm/scale' not in gap
  assert (gap['fc_norm/scale'], gap['fc_norm/bias']) == ((16,), (16,))
  initial = models.unbox(jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)),
                                                    train=False))())
  np.testing.assert_array_equal(
      initial['params']['Transformer']['encoderblock_0']['LayerScale_0']['scale'],
      np.full((16,), 1e-6, np.float32))
  registers = initial['params']['registers']
  assert 0 < np.abs(registers).max() < 1e-5  # timm's normal(std=1e-6): not all the same.


@pytest.mark.parametrize('field, value, message', [
    ('num_registers', -1, r'num_registers must be an int >= 0 .*got -1'),
    ('num_registers', True, 'num_registers must be an int >= 0'),
    ('layerscale_init', True, r'layerscale_init must be None \(no LayerScale\) or a finite float'),
    ('layerscale_init', float('nan'), 'layerscale_init must be None'),
    ('no_embed_class', 'yes', "no_embed_class must be True or False, got 'yes'"),
    ('fc_norm', True, r"fc_norm=True .* needs classifier='gap', got classifier='token'"),
    ('qk_norm', 'yes', "qk_norm must be True or False, got 'yes'"),
    ('qk_norm', None, 'qk_norm must be True or False, got None'),
])
def test_bad_values_are_refused_by_name(field, value, message):
  with pytest.raises(ValueError, match=message):
    models.create('ViT-custom', num_classes=3, **TINY, **{field: value})


def test_layerscale_registers_and_pooling_by_hand():
  """One block by hand in NumPy: the class token, the registers (after it), a table of the
  patches only, LayerScale on both residual branches; 'gap' over the patches then fc_norm."""
  model = models.create('ViT-custom', num_classes=3, **dict(TINY, num_layers=1),
                        classifier='gap', fc_norm=True, num_registers=2, no_embed_class=True,
                        layerscale_init=0.1, gelu_approximate=False)
  variables = _random(model)
  p = variables['params']
  images = np.random.RandomState(1).uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
  got = _apply(model, variables, images)

  x = images.astype(np.float64).reshape(2, 2, 8, 2, 8, 3).transpose(0, 1, 3, 2, 4, 5)
  x = x.reshape(2, 4, -1) @ p['embedding']['kernel'].reshape(-1, 16) + p['embedding']['bias']
  x = x + p['Transformer']['posembed_input']['pos_embedding']
  x = np.concatenate([np.broadcast_to(p['registers'], (2, 2, 16)), x], axis=1)
  block = p['Transformer']['encoderblock_0']
  attn = block['MultiHeadDotProductAttention_0']
  y = ln(x, block['LayerNorm_0'])
  q, k, v = (np.einsum('bnd,dhk->bnhk', y, attn[n]['kernel']) + attn[n]['bias']
             for n in ('query', 'key', 'value'))
  logits = np.einsum('bqhk,bphk->bhqp', q / np.sqrt(8), k)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  y = np.einsum('bhqp,bphk,hkd->bqd', weights, v, attn['out']['kernel']) + attn['out']['bias']
  x = x + y * block['LayerScale_0']['scale']
  mlp = block['MlpBlock_0']
  y = ln(x, block['LayerNorm_1']) @ mlp['Dense_0']['kernel'] + mlp['Dense_0']['bias']
  y = 0.5 * y * (1 + np.vectorize(math.erf)(y / np.sqrt(2)))
  y = y @ mlp['Dense_1']['kernel'] + mlp['Dense_1']['bias']
  x = x + y * block['LayerScale_1']['scale']
  pooled = ln(x[:, 2:].mean(1), p['fc_norm'])
  expected = pooled @ p['head']['kernel'] + p['head']['bias']
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  # What a pooling that averaged the registers too would give: far off.
  wrong = ln(x.mean(1), p['fc_norm']) @ p['head']['kernel'] + p['head']['bias']
  assert np.abs(wrong - got).max() > 1e-2


def test_token_order_and_scan_equivalence():
  model = models.create('ViT-custom', num_classes=3, **TINY, num_registers=3,
                        layerscale_init=1e-5)
  variables = _random(model)
  images = np.random.RandomState(2).uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
  tokens = intermediates.tokens(model, variables, images)
  assert tokens[0].shape == (2, 1 + 3 + 4, 16)  # class token, 3 registers, the 2x2 grid.
  scanned = model.clone(scan=True)
  stacked = models.scan_params(variables, num_layers=2)
  assert stacked['params']['Transformer']['encoderblock']['LayerScale_1']['scale'].shape == (
      2, 16)
  out = jax.jit(lambda m, v: m.apply(v, images, train=False), static_argnums=0)
  np.testing.assert_allclose(np.asarray(out(scanned, stacked)), np.asarray(out(model, variables)),
                             rtol=1e-6, atol=1e-6)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, images, train=False) ** 2)))(
      variables)
  assert np.abs(grads['params']['registers']).min() > 0  # Every register is used.
  axes = models.logical_axes(model, (16, 16))['params']
  assert axes['registers'] == jax.sharding.PartitionSpec(None, None, 'embed')
  assert axes['Transformer']['encoderblock_0']['LayerScale_0']['scale'] == (
      jax.sharding.PartitionSpec('norm'))


@pytest.mark.parametrize('overrides, described', [
    (dict(layerscale_init=1e-6, num_registers=4, no_embed_class=True),
     'layerscale_init=1e-05, num_registers=4, no_embed_class=True'),
    (dict(num_registers=4), 'num_registers=4'),
    (dict(classifier='gap', fc_norm=True, num_registers=1, no_embed_class=True),
     'num_registers=1, no_embed_class=True, fc_norm=True'),
    (dict(classifier='map', num_registers=2, scan=True), 'num_registers=2'),
    (dict(qk_norm=True, scan=True), 'qk_norm=True'),
    (dict(qk_norm=True, classifier='map', num_registers=1), 'num_registers=1, qk_norm=True'),
])
def test_the_shapes_tell_the_variant(overrides, described):
  model = models.create('ViT-custom', num_classes=3, **TINY, **overrides)
  shapes = {f'params/{k}': v for k, v in _shapes(model, 32).items()}
  fields = vit_shapes.architecture_fields(shapes)
  for key in ('layerscale_init', 'num_registers', 'no_embed_class', 'fc_norm', 'qk_norm'):
    expected = overrides.get(key, models.model_config('ViT-B_16')[key])
    if key == 'layerscale_init' and expected is not None:
      expected = vit_shapes.LAYERSCALE_INIT  # The initial value leaves no trace.
    assert fields.get(key, models.model_config('ViT-B_16')[key]) == expected, key
  assert described in vit_shapes.describe_architecture(shapes)
  assert vit_shapes.image_size(shapes, fields) == 32


def test_qk_norm_parameters_and_one_block_by_hand():
  """QK normalisation (ViT-22B, timm's qk_norm): a LayerNorm with bias over each head's 8
  channels of q and k, before the scaled product; the MAP head's attention has none."""
  model = models.create('ViT-custom', num_classes=3, **dict(TINY, num_layers=1), qk_norm=True)
  shapes = _shapes(model)
  plain = _shapes(models.create('ViT-custom', num_classes=3, **dict(TINY, num_layers=1)))
  attn = 'Transformer/encoderblock_0/MultiHeadDotProductAttention_0'
  assert set(shapes) - set(plain) == {f'{attn}/{n}_ln/{p}' for n in ('query', 'key')
                                      for p in ('scale', 'bias')}
  assert shapes[f'{attn}/query_ln/scale'] == (8,)
  mapped = _shapes(models.create('ViT-custom', num_classes=3, **TINY, qk_norm=True,
                                 classifier='map'))
  assert not any(k.startswith('MAPHead_0/') and '_ln/' in k for k in mapped)
  variables = _random(model)
  p = variables['params']
  images = np.random.RandomState(3).uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
  got = _apply(model, variables, images)

  def forward(qk_norm):
    x = images.astype(np.float64).reshape(2, 2, 8, 2, 8, 3).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(2, 4, -1) @ p['embedding']['kernel'].reshape(-1, 16) + p['embedding']['bias']
    x = np.concatenate([np.broadcast_to(p['cls'], (2, 1, 16)), x], axis=1)
    x = x + p['Transformer']['posembed_input']['pos_embedding']
    block = p['Transformer']['encoderblock_0']
    a = block['MultiHeadDotProductAttention_0']
    y = ln(x, block['LayerNorm_0'])
    q, k, v = (np.einsum('bnd,dhk->bnhk', y, a[n]['kernel']) + a[n]['bias']
               for n in ('query', 'key', 'value'))
    if qk_norm:
      q, k = ln(q, a['query_ln']), ln(k, a['key_ln'])
    logits = np.einsum('bqhk,bphk->bhqp', q / np.sqrt(8), k)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    x = x + np.einsum('bhqp,bphk,hkd->bqd', weights, v, a['out']['kernel']) + a['out']['bias']
    mlp = block['MlpBlock_0']
    y = ln(x, block['LayerNorm_1']) @ mlp['Dense_0']['kernel'] + mlp['Dense_0']['bias']
    y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))
    x = x + y @ mlp['Dense_1']['kernel'] + mlp['Dense_1']['bias']
    pooled = ln(x[:, 0], p['Transformer']['encoder_norm'])
    return pooled @ p['head']['kernel'] + p['head']['bias']

  np.testing.assert_allclose(got, forward(True), rtol=1e-5, atol=1e-5)
  assert np.abs(forward(False) - got).max() > 1e-2  # Without the normalisation: far off.
