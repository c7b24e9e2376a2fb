"""The fused CPU attention kernel (vit_jax/csrc/fused_attention.cc) against XLA's attention."""

import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import models
from vit_jax.models import attention
from vit_jax.models import fused_attention
from vit_jax.models import vit


def _reference(qkv, scale):
  """XLA's core on the [B, heads, N, Dh] transposes, moved back to [B, N, heads, Dh]."""
  q, k, v = jnp.transpose(qkv, (2, 0, 3, 1, 4))
  return jnp.swapaxes(attention.dot_product_attention(q, k, v, logits_scale=scale), 1, 2)


def _qkv(shape, seed=0, magnitude=1.0):
  return magnitude * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_the_kernel_was_built_where_a_compiler_is():
  path, reason = fused_attention.library()
  if shutil.which('g++') or shutil.which('c++'):
    assert path is not None, reason
    assert fused_attention.enabled()
  else:  # Without a compiler the install skips the extension and says how to get it.
    assert path is None and 'g++' in reason


needs_kernel = pytest.mark.skipif(fused_attention.library()[0] is None,
                                  reason='the fused attention kernel was not built')


@needs_kernel
@pytest.mark.parametrize('shape,scale,magnitude,rtol', [
    ((2, 13, 3, 2, 16), 0.25, 1.0, 1e-5),   # N below one 16-lane vector, 2 heads.
    ((3, 16, 3, 1, 32), 1.0, 1.0, 1e-5),    # N exactly one vector, one head.
    ((2, 50, 3, 3, 64), 0.125, 1.0, 1e-5),  # ViT-Ti's head size, N with a tail of 2.
    ((1, 1, 3, 2, 16), 0.5, 1.0, 1e-5),     # A single token: the weights are exactly 1.
    # Logits of magnitude ~1e4, which overflow exp unless the row maximum is taken out; their
    # own float32 rounding (ulp ~1e-3) then bounds the agreement of any two implementations.
    ((2, 37, 3, 2, 16), 1.0, 30.0, 1e-3),
])
def test_forward_and_gradients_equal_xla(shape, scale, magnitude, rtol):
  qkv = _qkv(shape, magnitude=magnitude)
  cotangent = _qkv((shape[0], shape[1], shape[3], shape[4]), seed=1)
  ours = jax.jit(lambda a: fused_attention.attention(a, logits_scale=scale))(qkv)
  theirs = _reference(qkv, scale)
  assert np.all(np.isfinite(ours))
  np.testing.assert_allclose(ours, theirs, atol=rtol * float(jnp.max(jnp.abs(theirs))))

  def loss(fn, a):
    return jnp.sum(fn(a) * cotangent)

  grad_ours = jax.jit(jax.grad(functools.partial(
      loss, lambda a: fused_attention.attention(a, logits_scale=scale))))(qkv)
  grad_theirs = jax.jit(jax.grad(functools.partial(
      loss, lambda a: _reference(a, scale))))(qkv)
  np.testing.assert_allclose(grad_ours, grad_theirs,
                             atol=rtol * float(jnp.max(jnp.abs(grad_theirs))))


@needs_kernel
def test_many_items_over_the_thread_pool_and_vmap():
  qkv = _qkv((8, 197, 3, 3, 64))  # 24 (image, head) items at ViT's 197 tokens.
  ours = jax.jit(lambda a: fused_attention.attention(a, logits_scale=0.125))(qkv)
  np.testing.assert_allclose(ours, _reference(qkv, 0.125), atol=2e-6)
  stacked = qkv.reshape(2, 4, *qkv.shape[1:])
  mapped = jax.vmap(lambda a: fused_attention.attention(a, logits_scale=0.125))(stacked)
  np.testing.assert_allclose(mapped.reshape(ours.shape), ours, atol=1e-7)


def test_usable_only_where_the_kernel_applies(monkeypatch):
  built = fused_attention.library()[0] is not None
  shape = (2, 197, 3, 3, 64)
  assert fused_attention.usable(shape, jnp.float32, dropout=False) == built
  assert not fused_attention.usable(shape, jnp.bfloat16, dropout=False)
  assert not fused_attention.usable(shape, jnp.float32, dropout=True)
  assert not fused_attention.usable((2, 197, 3, 3, 24), jnp.float32, dropout=False)
  monkeypatch.setenv(fused_attention.SWITCH, 'off')
  assert not fused_attention.usable(shape, jnp.float32, dropout=False)
  assert fused_attention.status() == f'off ({fused_attention.SWITCH}=off)'
  monkeypatch.setenv(fused_attention.SWITCH, 'fast')  # Neither on nor off: refused, not guessed.
  with pytest.raises(ValueError, match='VIT_JAX_FUSED_ATTENTION=.fast. is neither on'):
    fused_attention.usable(shape, jnp.float32, dropout=False)


@needs_kernel
def test_bad_input_is_refused_with_the_reason():
  with pytest.raises(ValueError, match=r'\[B, N, 3, heads, Dh\]'):
    fused_attention.attention(jnp.zeros((2, 5, 2, 16)), logits_scale=1.0)
  with pytest.raises(ValueError, match='divisible by 16'):
    fused_attention.attention(jnp.zeros((2, 5, 3, 1, 24)), logits_scale=1.0)
  with pytest.raises(ValueError, match='float32'):
    fused_attention.attention(jnp.zeros((2, 5, 3, 1, 16), jnp.bfloat16), logits_scale=1.0)


def _tiny_vit(**overrides):
  return models.create('ViT-custom', num_classes=5, hidden_size=64, mlp_dim=128, num_heads=2,
                       num_layers=2, patch_size=8, **overrides)


@needs_kernel
def test_vit_with_and_without_the_kernel_agree(monkeypatch):
  """The same parameters give the same logits and gradients on either attention path."""
  model = _tiny_vit()
  images = jax.random.normal(jax.random.key(1), (3, 32, 32, 3))
  variables = model.init(jax.random.key(0), images, train=False)

  def logits_and_grads():
    def loss(params):
      return jnp.sum(model.apply({'params': params}, images, train=True) ** 2)
    logits = jax.jit(lambda v: model.apply(v, images, train=False))(variables)
    return logits, jax.jit(jax.grad(loss))(variables['params'])

  fused_logits, fused_grads = logits_and_grads()
  monkeypatch.setenv(fused_attention.SWITCH, '0')
  xla_logits, xla_grads = logits_and_grads()
  np.testing.assert_allclose(fused_logits, xla_logits, atol=2e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(xla_grads)):
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(jnp.max(jnp.abs(b)))))


def _kernel_calls(policy):
  """How often the compiled training gradient runs the kernel's forward and backward."""
  model = _tiny_vit(scan=True, remat=True, remat_policy=policy)
  images = jnp.ones((2, 32, 32, 3))
  params = model.init(jax.random.key(0), images, train=False)['params']
  loss = lambda p: jnp.sum(model.apply({'params': p}, images, train=True))  # pylint: disable=g-long-lambda
  text = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  return (len(re.findall(r'custom_call_target="vit_jax_attention_forward"', text)),
          len(re.findall(r'custom_call_target="vit_jax_attention_backward"', text)))


@needs_kernel
def test_the_default_policy_saves_the_kernels_output_for_the_backward():
  assert models.TRAINING_DEFAULTS['remat_policy'] == 'dots_and_attention_saveable'
  assert _kernel_calls('dots_and_attention_saveable') == (1, 1)  # Forward once, in the scan.
  assert _kernel_calls('dots_with_no_batch_dims_saveable') == (2, 1)  # Run again by the remat.


def test_remat_policy_names():
  assert vit.remat_policy('nothing_saveable') is jax.checkpoint_policies.nothing_saveable
  assert callable(vit.remat_policy('dots_and_attention_saveable'))
  with pytest.raises(ValueError, match='remat_policy must be one of'):
    vit.remat_policy('dots_and_everything')
