"""Multi-head attention of both families, one function over its implementations (the
``attention`` field, :data:`IMPLEMENTATIONS`; chosen by ``vit_jax.dispatch``, never here); they
differ by rounding only. With 'intermediates' mutable the modules sow their float32 weights
``[B, heads, Nq, Nk]`` (:data:`ATTENTION_WEIGHTS`), computed on the 'xla' path.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from vit_jax import kernels
from vit_jax.models import execution

Array = jax.Array
Dtype = Any

#: Values of the models' ``attention`` field.
IMPLEMENTATIONS = ('xla', 'cudnn', *(k.NAME for k in kernels.ATTENTION))

#: The Flax collection the models sow into, and the names they sow under.
INTERMEDIATES = 'intermediates'
ATTENTION_WEIGHTS = 'attention_weights'
TOKENS = 'tokens'

WeightsFn = Callable[[Array], Any]

#: The functions applied to the queries and the keys ``[..., Dh]`` after the projections.
QKNorm = Tuple[Callable[[Array], Array], Callable[[Array], Array]]


def sow_weights(module: nn.Module) -> WeightsFn:
  """Sows its argument as ``module``'s :data:`ATTENTION_WEIGHTS` (a no-op when not mutable)."""
  return lambda weights: module.sow(INTERMEDIATES, ATTENTION_WEIGHTS, weights)


def capturing(module: nn.Module) -> bool:
  """Whether ``module`` runs with :data:`INTERMEDIATES` mutable (a Python bool at trace time)."""
  return module.is_mutable_collection(INTERMEDIATES)


def dot_product_attention(query: Array, key: Array, value: Array, *,
                          logits_scale: Optional[float] = None, dropout_rate: float = 0.0,
                          dropout_rng: Optional[Array] = None,
                          weights_fn: Optional[WeightsFn] = None) -> Array:
  """``softmax(q k^T * logits_scale) v``, softmax in float32 (the official ViT's
  ``force_fp32_for_softmax``): query ``[B, heads, Nq, Dh]``, key, value ``[B, heads, Nk, Dh]`` ->
  ``[B, heads, Nq, Dh]`` in their dtype. ``logits_scale`` None: the caller scaled the query.
  Dropout (``dropout_rng`` None: off) is not broadcast, as flax's; ``weights_fn`` receives the
  float32 weights before dropout."""
  logits = jnp.einsum('bhqd,bhkd->bhqk', query, key).astype(jnp.float32)
  if logits_scale is not None:
    logits = logits * logits_scale
  weights = jax.nn.softmax(logits, axis=-1)
  if weights_fn is not None:
    weights_fn(weights)
  weights = weights.astype(value.dtype)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep_prob = 1.0 - dropout_rate
    keep = jax.random.bernoulli(dropout_rng, keep_prob, weights.shape)
    weights = jnp.where(keep, weights / jnp.asarray(keep_prob, weights.dtype),
                        jnp.zeros((), weights.dtype))
  return jnp.einsum('bhqk,bhkd->bhqd', weights, value)


def _flat_init(init: nn.initializers.Initializer, fan_in_axes: int) -> nn.initializers.Initializer:
  """``init`` of the 2-D ``(prod(shape[:fan_in_axes]), prod(rest))`` matrix, reshaped (as
  ``nn.DenseGeneral``: the fans of the ``(D, D)`` projection)."""

  def flat(rng: Array, shape: Tuple[int, ...], dtype: Any = jnp.float32) -> Array:
    matrix = (int(np.prod(shape[:fan_in_axes])), int(np.prod(shape[fan_in_axes:])))
    return jnp.reshape(init(rng, matrix, dtype), shape)

  return flat


class _Projection(nn.Module):
  """Holds one projection's ``kernel`` and ``bias`` (created as ``nn.DenseGeneral`` would)."""

  kernel_shape: Tuple[int, ...]
  kernel_axes: Tuple[Optional[str], ...]
  bias_shape: Tuple[int, ...]
  bias_axes: Tuple[Optional[str], ...]
  fan_in_axes: int
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self) -> Tuple[Array, Array]:
    kernel_init = _flat_init(nn.initializers.xavier_uniform(), self.fan_in_axes)
    kernel = self.param('kernel', nn.with_logical_partitioning(kernel_init, self.kernel_axes),
                        self.kernel_shape, self.param_dtype)
    bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, self.bias_axes),
                      self.bias_shape, self.param_dtype)
    return kernel, bias


def check_implementation(implementation: Any) -> None:
  """Raises ValueError unless ``implementation`` is one of :data:`IMPLEMENTATIONS`."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'attention must be one of {IMPLEMENTATIONS}, got {implementation!r} (a '
                     "training config's 'auto' is resolved by vit_jax.dispatch.choose_attention "
                     'from the target devices).')


def self_attention(x: Array, projections: Sequence[Tuple[Array, Optional[Array]]], *,
                   implementation: str, logits_scale: float, scale_query: bool = False,
                   dropout_rate: float = 0.0, dropout_rng: Optional[Array] = None,
                   weights_fn: Optional[WeightsFn] = None,
                   x_kv: Optional[Array] = None,
                   qk_norm: Optional[QKNorm] = None) -> Tuple[Array, str]:
  """``softmax(logits_scale q k^T) v`` per head of ``x [B, N, D]`` by ``implementation``.

  ``projections``: ``(kernel [D, heads, Dh], bias [heads, Dh] or None)`` of q, k, v;
  ``qk_norm``: the functions applied to q and k after them (None: none).
  ``scale_query``: scale q before the product, as flax (the official ViT), not the float32 logits
  (T2T-ViT). Dropout on 'xla' only; a ``weights_fn`` or ``x_kv [B, Nk, D]`` (keys and values of
  another sequence: flax's ``inputs_kv``) runs the 'xla' path. Returns ``(y, layout)``, layout
  ``'bhnk'`` or ``'bnhk'``. ValueError: an unknown implementation, or dropout asked of one that
  has none.
  """
  check_implementation(implementation)
  if dropout_rate > 0.0 and dropout_rng is not None and implementation != 'xla':
    raise ValueError(f"attention={implementation!r} has no attention dropout; use 'xla' for a "
                     'model with attention_dropout_rate > 0 in training.')
  if weights_fn is not None or x_kv is not None:
    implementation = 'xla'
  dtype = x.dtype
  fused = next((k for k in kernels.ATTENTION if k.NAME == implementation), None)
  if fused is not None:
    kernel = jnp.stack([k.astype(dtype) for k, _ in projections], axis=1)
    qkv = jnp.einsum('bnd,dthk->bnthk', x, kernel)
    if projections[0][1] is not None:
      qkv = qkv + jnp.stack([b.astype(dtype) for _, b in projections], axis=0)
    if qk_norm is not None:
      qkv = jnp.stack([qk_norm[0](qkv[:, :, 0]), qk_norm[1](qkv[:, :, 1]), qkv[:, :, 2]], axis=2)
    qkv = checkpoint_name(qkv, execution.QKV_NAMES[-1])
    return fused.attention(qkv, logits_scale=logits_scale), 'bnhk'
  layout = 'bnhk' if implementation == 'cudnn' else 'bhnk'
  x_kv = x if x_kv is None else x_kv.astype(dtype)
  projected = []
  for t, (k, b) in zip((x, x_kv, x_kv), projections):
    bias = 0 if b is None else b.astype(dtype)
    if b is not None and layout == 'bhnk':  # [heads, 1, Dh]: broadcast over the tokens.
      bias = bias[:, None]
    projected.append(jnp.einsum(f'bnd,dhk->{layout}', t, k.astype(dtype)) + bias)
  query, key, value = projected
  if qk_norm is not None:
    query, key = qk_norm[0](query), qk_norm[1](key)
  # Named for the remat policy 'qkv_saveable', which keeps only these.
  names = execution.QKV_NAMES
  query, key, value = (checkpoint_name(t, n) for t, n in zip((query, key, value), names))
  if implementation == 'cudnn':
    return jax.nn.dot_product_attention(query, key, value, scale=logits_scale,
                                        implementation='cudnn'), layout
  if scale_query:  # As flax: q / sqrt(Dh), a division (the same float32 rounding).
    query = query / jnp.asarray(1.0 / logits_scale, dtype)
    logits_scale = None  # Applied to the query.
  return dot_product_attention(query, key, value, logits_scale=logits_scale,
                               dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                               weights_fn=weights_fn), layout


class MultiHeadDotProductAttention(nn.Module):
  """The official blocks' ``MultiHeadDotProductAttention_0`` (flax's, ``broadcast_dropout=False``;
  its parameters, so the official checkpoints load: ``{query,key,value}/kernel (D, heads, Dh)``,
  ``bias (heads, Dh)``, ``out/kernel (heads, Dh, D)``), ``[B, N, D]`` -> ``[B, N, D]`` in
  ``dtype``; with ``inputs_kv [B, Nk, D]`` cross-attention (big_vision's ``MAPHead_0``, 'xla'
  only); ``qk_norm`` (ViT-22B): ``query_ln``, ``key_ln`` LayerNorms ``(Dh,)`` of each head's q and
  k. ValueError: ``num_heads`` not dividing D, ``inputs_kv`` with another ``attention``, or as
  :func:`self_attention`."""

  num_heads: int
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  attention: str = 'xla'
  qk_norm: bool = False
  layer_norm_epsilon: float = 1e-6

  def _qk_norm(self) -> Optional[QKNorm]:
    """The ``query_ln`` and ``key_ln`` LayerNorms (with a bias, as timm's), or None."""
    if not self.qk_norm:
      return None
    return tuple(execution.layer_norm(self.dtype, self.param_dtype, self.layer_norm_epsilon, name)
                 for name in ('query_ln', 'key_ln'))

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool, inputs_kv: Optional[Array] = None
               ) -> Array:
    width = x.shape[-1]
    if width % self.num_heads:
      raise ValueError(f'The token width {width} is not divisible by num_heads='
                       f'{self.num_heads}.')
    if inputs_kv is not None and self.attention != 'xla':
      raise ValueError(f"Cross-attention (inputs_kv) runs with attention='xla' only, got "
                       f'{self.attention!r}.')
    heads = self.num_heads
    head_dim = width // heads
    x = x.astype(self.dtype)
    projections = [
        _Projection((width, heads, head_dim), ('embed', 'heads', 'kv'), (heads, head_dim),
                    ('heads', 'kv'), fan_in_axes=1, param_dtype=self.param_dtype, name=name)()
        for name in ('query', 'key', 'value')]
    dropout = self.dropout_rate > 0.0 and not deterministic
    rng = self.make_rng('dropout') if dropout else None  # None: no dropout.
    weights_fn = sow_weights(self) if capturing(self) else None
    y, layout = self_attention(
        x, projections, implementation=self.attention, logits_scale=1.0 / math.sqrt(head_dim),
        scale_query=True, dropout_rate=self.dropout_rate, dropout_rng=rng,
        weights_fn=weights_fn, x_kv=inputs_kv, qk_norm=self._qk_norm())
    kernel, bias = _Projection((heads, head_dim, width), ('heads', 'kv', 'embed'), (width,),
                               ('embed',), fan_in_axes=2, param_dtype=self.param_dtype,
                               name='out')()
    return (jnp.einsum(f'{layout},hkd->bnd', y, kernel.astype(self.dtype))
            + bias.astype(self.dtype))
