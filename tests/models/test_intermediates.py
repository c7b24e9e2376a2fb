"""Attention weights and block outputs sown by the models (vit_jax.models.intermediates): the
logits unchanged, the weights a softmax of the parameters, scanned == per-layer, the fused CPU
kernel's models captured through XLA, T2T-ViT's backbone and T2T-module maps, nothing traced
when off."""

import functools

import flax.linen as nn
import jax
from jax.extend import core
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.kernels import cpu_attention
from vit_jax.models import attention
from vit_jax.models import intermediates
from vit_jax.models import layout
from vit_jax.models import t2t
from vit_jax.models import vit

# 8x8 images, 4x4 patches: 4 patch tokens (+ the class token), 2 heads of size 16 (the fused
# CPU kernel's minimum).
VIT = dict(num_classes=3, patch_size=4, hidden_size=32, mlp_dim=32, num_heads=2, num_layers=2)
# 32x32 images: T2T layers over 8x8 and 4x4 grids, a 2x2 backbone grid (+ the class token).
T2T = dict(num_classes=3, embed_dim=32, depth=2, num_heads=2, mlp_ratio=1.0, token_dim=8)
# NumPy draws: jax.random would compile its generator first.
IMAGES = np.random.default_rng(0).uniform(-1.0, 1.0, (2, 8, 8, 3)).astype(np.float32)
IMAGES32 = np.random.default_rng(1).uniform(-1.0, 1.0, (2, 32, 32, 3)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _variables(model, size, std=0.2):
  """Random plain variables of ``model`` for ``size`` px images, without compiling ``init``
  (a T2T-ViT init takes seconds to compile): normal(std) leaves, LayerNorm scales 1 + 0.1 n."""
  images = IMAGES if size == 8 else IMAGES32
  shapes = layout.unbox(jax.eval_shape(lambda k, x: model.init(k, x, train=False),
                                       jax.random.key(0), images))
  rng = np.random.default_rng(size)

  def draw(path, leaf):
    noise = rng.normal(size=leaf.shape).astype(leaf.dtype)
    return jnp.asarray(1.0 + 0.1 * noise if path[-1].key == 'scale' else std * noise)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _random_variables(module, *args, std=0.1):
  """normal(std) variables of ``module`` for ``args``, without compiling its ``init``."""
  shapes = layout.unbox(jax.eval_shape(module.init, jax.random.key(0), *args))
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: jnp.asarray(std * rng.normal(size=s.shape), s.dtype), shapes)


@functools.lru_cache(maxsize=None)
def _plain_apply(model):
  return jax.jit(lambda v, x: model.apply(v, x, train=False))


def _rows_sum_to_one(maps, atol=1e-6):
  for m in maps:
    assert m.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(m).sum(-1), 1.0, atol=atol)
    assert np.asarray(m).min() >= 0.0


def test_vit_capture_keeps_the_logits_and_gives_maps_and_tokens_in_depth_order():
  model = vit.VisionTransformer(**VIT)
  variables = _variables(model, 8)
  got = intermediates.capture(model, variables, IMAGES)
  np.testing.assert_array_equal(got.logits, _plain_apply(model)(variables, IMAGES))
  assert np.abs(np.asarray(got.logits)).max() > 0.1
  assert [m.shape for m in got.attention] == [(2, 2, 5, 5)] * 2
  assert [t.shape for t in got.tokens] == [(2, 5, 32)] * 2
  _rows_sum_to_one(got.attention)
  assert got.layout == intermediates.TokenLayout(prefix=1, grid=(2, 2), stride=(4, 4))
  assert got.layout.num_tokens == 5
  assert got.head_attention is None and got.t2t_attention == () and got.t2t_layouts == ()
  # The two layers differ (a layer-order mix-up cannot pass), and the lists are the helpers'.
  assert np.abs(np.asarray(got.attention[0]) - np.asarray(got.attention[1])).max() > 1e-3
  maps = intermediates.attention_maps(model, variables, IMAGES)
  np.testing.assert_array_equal(maps[1], got.attention[1])
  np.testing.assert_array_equal(intermediates.tokens(model, variables, IMAGES)[0], got.tokens[0])


def _layer_norm(x, p, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p['scale'] + p['bias']


def _hand_weights(tokens, block):
  """softmax(q k^T / sqrt(dh)) from the block's parameters, float64."""
  x = _layer_norm(tokens, block['LayerNorm_0'])
  mha = block['MultiHeadDotProductAttention_0']
  q, k = (np.einsum('bnd,dhk->bhnk', x, mha[n]['kernel']) + mha[n]['bias'][:, None]
          for n in ('query', 'key'))
  logits = np.einsum('bhqd,bhkd->bhqk', q, k) / np.sqrt(q.shape[-1])
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_vit_weights_are_the_softmax_of_the_parameters_with_capture_intermediates():
  model = vit.VisionTransformer(**VIT)
  variables = _variables(model, 8)
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), variables['params'])
  _, state = jax.jit(lambda v, x: model.apply(v, x, train=False, capture_intermediates=True))(
      variables, IMAGES)
  got = intermediates.unpack(model, state['intermediates'])
  assert '__call__' in state['intermediates']['Transformer']['encoderblock_0']  # Both kinds.
  # The encoder's input by hand: 4x4 patches (row-major), the class token, the position table.
  x = np.asarray(IMAGES, np.float64).reshape(2, 2, 4, 2, 4, 3).transpose(0, 1, 3, 2, 4, 5)
  kernel = params['embedding']['kernel'].reshape(48, 32)
  x = x.reshape(2, 4, 48) @ kernel + params['embedding']['bias']
  x = np.concatenate([np.broadcast_to(params['cls'], (2, 1, 32)), x], axis=1)
  x = x + params['Transformer']['posembed_input']['pos_embedding']
  for i, inputs in enumerate([x, np.asarray(got['tokens'][0], np.float64)]):
    expected = _hand_weights(inputs, params['Transformer'][f'encoderblock_{i}'])
    np.testing.assert_allclose(got['attention'][i], expected, rtol=1e-5, atol=1e-6)


def test_scanned_and_rematerialised_encoder_gives_the_per_layer_maps():
  per_layer = vit.VisionTransformer(**VIT)
  variables = _variables(per_layer, 8)
  expected = intermediates.capture(per_layer, variables, IMAGES)
  model = vit.VisionTransformer(**VIT, scan=True, remat=True)
  scanned = layout.scan_params(variables)
  got = intermediates.capture(model, scanned, IMAGES)
  np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
  for name in ('attention', 'tokens'):
    assert len(getattr(got, name)) == 2
    for a, b in zip(getattr(got, name), getattr(expected, name)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def loss(params):  # Differentiated through nn.remat inside nn.scan, the collection mutable.
    logits, state = model.apply({'params': params}, IMAGES, train=False,
                                mutable=['intermediates'])
    return logits.sum(), state['intermediates']

  # Traced only (compiling the backward pass would take seconds): the shapes of both outputs.
  grads, state = jax.eval_shape(jax.grad(loss, has_aux=True), scanned['params'])
  stacked = state['Transformer']['encoderblock']
  assert stacked['MultiHeadDotProductAttention_0']['attention_weights'][0].shape == (2, 2, 2, 5, 5)
  assert stacked['tokens'][0].shape == (2, 2, 5, 32)
  assert jax.tree.map(lambda a: a.shape, grads) == jax.tree.map(jnp.shape, scanned['params'])


def _shapes(jaxpr):
  """Every value's (shape, dtype) and every primitive name, sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    found.append(eqn.primitive.name)
    found.extend((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, core.ClosedJaxpr):
          found.extend(_shapes(sub.jaxpr))
        elif isinstance(sub, core.Jaxpr):
          found.extend(_shapes(sub))
  return found


def _jaxpr(model, variables, images, **kwargs):
  return jax.make_jaxpr(lambda v, x: model.apply(v, x, train=False, **kwargs))(variables, images)


def test_free_when_off(monkeypatch):
  """Off, the traced forward is the one without the feature: no extra outputs, no weights."""
  model = vit.VisionTransformer(**VIT)
  variables = _variables(model, 8)
  off = _jaxpr(model, variables, IMAGES)
  on = _jaxpr(model, variables, IMAGES, mutable=['intermediates'])
  assert len(off.jaxpr.outvars) == 1 and len(on.jaxpr.outvars) == 1 + 2 * 2
  # On the XLA path the weights are the ones the attention computes anyway: same equations.
  assert str(off.jaxpr).rsplit('in (', 1)[0] == str(on.jaxpr).rsplit('in (', 1)[0]
  # The hooks disabled altogether change nothing in the traced program.
  monkeypatch.setattr(attention, 'capturing', lambda module: False)
  monkeypatch.setattr(nn.Module, 'sow', lambda self, *args, **kwargs: False)
  assert str(_jaxpr(model, variables, IMAGES)) == str(off)
  monkeypatch.undo()
  # The fused kernel's model: off, the kernel runs and no [B, heads, N, N] array is formed.
  fused = vit.VisionTransformer(**VIT, attention='cpu_kernel')
  off, on = (_shapes(_jaxpr(fused, variables, IMAGES, **kw).jaxpr)
             for kw in ({}, {'mutable': ['intermediates']}))
  assert 'ffi_call' in off and 'ffi_call' not in on
  assert ((2, 2, 5, 5), 'float32') not in off and ((2, 2, 5, 5), 'float32') in on
  # The Performer forms its [B, L, L] matrix only when captured.
  performer = t2t.T2TViT(**T2T, tokens_type='performer')
  t2t_variables = _variables(performer, 32, 0.05)
  off, on = (_shapes(_jaxpr(performer, t2t_variables, IMAGES32, **kw).jaxpr)
             for kw in ({}, {'mutable': ['intermediates']}))
  assert ((2, 64, 64), 'float32') not in off and ((2, 64, 64), 'float32') in on


def test_cpu_kernel_model_captures_through_the_xla_path():
  reference = vit.VisionTransformer(**VIT)
  variables = _variables(reference, 8)
  expected = intermediates.capture(reference, variables, IMAGES)
  fused = vit.VisionTransformer(**VIT, attention='cpu_kernel')
  lowered = [jax.jit(lambda v, x, kw=kw: fused.apply(v, x, train=False, **kw)).lower(
      variables, IMAGES).as_text() for kw in ({}, {'mutable': ['intermediates']})]
  assert [cpu_attention.FORWARD_TARGET in text for text in lowered] == [True, False]
  got = intermediates.capture(fused, variables, IMAGES)
  np.testing.assert_array_equal(got.logits, expected.logits)
  for a, b in zip(got.attention, expected.attention):
    np.testing.assert_array_equal(a, b)


def test_map_head_attention_over_the_patch_tokens():
  model = vit.VisionTransformer(**VIT, classifier='map', posemb='sincos2d')
  shapes = jax.eval_shape(lambda k, x: model.init(k, x, train=False), jax.random.key(0), IMAGES)

  def run(variables, images):
    _, state = model.apply(variables, images, train=False, mutable=['intermediates'])
    return intermediates.unpack(model, state['intermediates'])

  got = jax.eval_shape(run, shapes, IMAGES)  # Traced only; the head's values below.
  assert [m.shape for m in got['attention']] == [(2, 2, 4, 4)] * 2
  assert got['head_attention'].shape == (2, 2, 1, 4)
  assert intermediates.token_layout(model, 8, 8) == intermediates.TokenLayout(
      prefix=0, grid=(2, 2), stride=(4, 4))
  head = vit.MAPHead(num_heads=2, mlp_dim=32)
  tokens = np.random.default_rng(5).normal(size=(2, 4, 32)).astype(np.float32)
  variables = _random_variables(head, tokens, std=0.3)
  _, state = jax.jit(lambda v, x: head.apply(v, x, mutable=['intermediates']))(variables, tokens)
  (weights,) = state['intermediates']['MultiHeadDotProductAttention_0']['attention_weights']
  assert weights.shape == (2, 2, 1, 4)
  _rows_sum_to_one([weights])
  params = layout.unbox(variables['params'])
  mha = params['MultiHeadDotProductAttention_0']
  q = np.einsum('bnd,dhk->bhnk', np.broadcast_to(params['probe'], (2, 1, 32)),
                mha['query']['kernel']) + mha['query']['bias'][:, None]
  k = np.einsum('bnd,dhk->bhnk', tokens, mha['key']['kernel']) + mha['key']['bias'][:, None]
  logits = np.einsum('bhqd,bhkd->bhqk', q, k) / 4.0
  e = np.exp(logits - logits.max(-1, keepdims=True))
  np.testing.assert_allclose(weights, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('tokens_type,scan', [('performer', False), ('transformer', True)])
def test_t2t_backbone_and_t2t_module_map_shapes(tokens_type, scan):
  """Traced only (a T2T-ViT takes seconds to compile); the values: the two tests below."""
  model = t2t.T2TViT(**T2T, tokens_type=tokens_type, scan=scan)
  shapes = jax.eval_shape(lambda k, x: model.init(k, x, train=False), jax.random.key(0),
                          IMAGES32)

  def run(variables, images):
    _, state = model.apply(variables, images, train=False, mutable=['intermediates'])
    return intermediates.unpack(model, state['intermediates'])

  got = jax.eval_shape(run, shapes, IMAGES32)
  assert [(m.shape, m.dtype) for m in got['attention']] == [((2, 2, 5, 5), jnp.float32)] * 2
  assert [m.shape for m in got['tokens']] == [(2, 5, 32)] * 2
  assert [(m.shape, m.dtype) for m in got['t2t_attention']] == [
      ((2, 1, 64, 64), jnp.float32), ((2, 1, 16, 16), jnp.float32)]
  assert got['head_attention'] is None
  assert intermediates.token_layout(model, 32, 32) == intermediates.TokenLayout(
      prefix=1, grid=(2, 2), stride=(16, 16))
  assert intermediates.t2t_layouts(model, 32, 32) == (
      intermediates.TokenLayout(0, (8, 8), (4, 4)), intermediates.TokenLayout(0, (4, 4), (8, 8)))


def _layer(layer, x):
  """``(state['intermediates'], params)`` of one T2T layer applied to ``x``, random variables."""
  variables = _random_variables(layer, x)
  _, state = jax.jit(lambda v, x: layer.apply(v, x, capture_intermediates=True))(variables, x)
  return state['intermediates'], variables['params']


X_T2T = np.random.default_rng(4).normal(size=(2, 16, 12)).astype(np.float32)  # 16 tokens.


def test_t2t_transformer_layer_weights_are_its_softmax():
  state, _ = _layer(t2t.TokenTransformer(token_dim=8), X_T2T)
  (weights,) = state['attn'][intermediates.ATTENTION_WEIGHTS]
  q, k, _ = np.split(np.asarray(state['attn']['qkv']['__call__'][0], np.float64), 3, axis=-1)
  logits = q * 12 ** -0.5 @ k.transpose(0, 2, 1)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  assert weights.shape == (2, 1, 16, 16) and weights.dtype == jnp.float32
  np.testing.assert_allclose(weights[:, 0], e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_t2t_performer_layer_weights_are_the_matrix_its_features_imply():
  """A = phi(q) phi(k)^T / (phi(q) . sum phi(k) + 1e-8): rows sum to 1 and proj(A v) is the
  layer's projected attention output."""
  state, params = _layer(t2t.TokenPerformer(token_dim=8), X_T2T)
  (weights,) = state[intermediates.ATTENTION_WEIGHTS]
  assert weights.shape == (2, 1, 16, 16) and weights.dtype == jnp.float32
  _rows_sum_to_one([weights], atol=1e-6)
  _, _, v = np.split(np.asarray(state['kqv']['__call__'][0], np.float64), 3, axis=-1)
  projected = (np.asarray(weights[:, 0], np.float64) @ v @ np.asarray(params['proj']['kernel'])
               + np.asarray(params['proj']['bias']))
  np.testing.assert_allclose(state['proj']['__call__'][0], projected, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_named():
  model = vit.VisionTransformer(**VIT)
  with pytest.raises(TypeError, match='VisionTransformer or T2TViT'):
    intermediates.capture(nn.Dense(3), {}, IMAGES)
  with pytest.raises(TypeError, match='T2TViT models only'):
    intermediates.t2t_attention_maps(model, {}, IMAGES)
  with pytest.raises(ValueError, match=r"Found 0 sown attention weights for a model of 2 "
                                       r"blocks: .*mutable=\['intermediates'\]"):
    intermediates.unpack(model, {})
  with pytest.raises(ValueError, match=r'images must be \[batch, height, width, channels\]'):
    intermediates.capture(model, {}, IMAGES[0])
