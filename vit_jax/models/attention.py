"""Multi-head self-attention of ViT, with the official parameter names and a faster layout.

:class:`MultiHeadDotProductAttention` computes what ``flax.linen.MultiHeadDotProductAttention``
computes for self-attention (the MSA of ViT eq. 2, Vaswani et al. eq. 1) and stores the same
parameters under the same names and shapes, so the official checkpoints load unchanged::

  {query,key,value}/kernel (D, heads, D/heads)   {query,key,value}/bias (heads, D/heads)
  out/kernel (heads, D/heads, D)                 out/bias (D,)

What differs is the order of the computation, chosen by measurement (README "Benchmarks"),
along one of three paths:

* **CPU, the fused kernel** (:mod:`vit_jax.models.fused_attention`; float32, one device, no
  attention dropout, head size divisible by 16): the three kernels are stacked at compute time
  into one ``[D, 3, heads, D/heads]`` product that writes ``[B, N, 3, heads, D/heads]``, the
  kernel's input; its output ``[B, N, heads, D/heads]`` feeds the output projection. Both
  projections are then plain matrix products without transposes. ViT-Ti/16 training at batch 32
  on 2 cores: 12% shorter steps than the next path.
* **Otherwise on CPU and on TPU**: the projections write ``q, k, v`` directly in the
  ``[B, heads, N, D/heads]`` layout that XLA's two batched matrix products of
  :func:`dot_product_attention` want (``einsum('bnd,dhk->bhnk')``), and the output projection
  reads it (``einsum('bhqk,hkd->bqd')``), so XLA inserts no transposes between them (flax's
  ``[B, N, heads, D/heads]`` made XLA:CPU transpose around every batched product; ViT-B/16
  attention layer forward at batch 8: 91 ms with the flax module, 52 ms here). A fused QKV
  product gained nothing on this path, so it keeps three, which also keeps their sharding over
  the ``'heads'`` logical axis free of communication.
* **GPU**, when no attention dropout is active: ``jax.nn.dot_product_attention`` (cuDNN's fused
  flash-attention kernel for bfloat16/float16 inputs, XLA otherwise).

The paths differ by float32 rounding only (the tests compare them and the official logits).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models import fused_attention

Array = jax.Array
Dtype = Any


def dot_product_attention(query: Array, key: Array, value: Array, *,
                          logits_scale: Optional[float] = None, dropout_rate: float = 0.0,
                          dropout_rng: Optional[Array] = None) -> Array:
  """Softmax attention over the last two axes in the ``[B, heads, N, D/heads]`` layout.

  ``softmax(q k^T * logits_scale) v``, the softmax computed in float32 and cast back to the
  input dtype (the official ViT's ``force_fp32_for_softmax``; T2T-ViT's reference does the same).

  Args:
    query: ``[B, heads, Nq, Dh]``; key, value: ``[B, heads, Nk, Dh]``, one float dtype.
    logits_scale: multiplies the float32 logits; None multiplies by nothing (the caller scaled
      the query, as flax and the official ViT do: ``q / sqrt(Dh)``).
    dropout_rate: dropout on the attention weights, not broadcast over any axis (each weight is
      kept with probability ``1 - rate`` and scaled by ``1 / (1 - rate)``, as flax).
    dropout_rng: PRNG key, required when ``dropout_rate > 0``; None disables dropout.

  Returns:
    ``[B, heads, Nq, Dh]`` in the input dtype.
  """
  logits = jnp.einsum('bhqd,bhkd->bhqk', query, key).astype(jnp.float32)
  if logits_scale is not None:
    logits = logits * logits_scale
  weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep_prob = 1.0 - dropout_rate
    keep = jax.random.bernoulli(dropout_rng, keep_prob, weights.shape)
    weights = jnp.where(keep, weights / jnp.asarray(keep_prob, weights.dtype),
                        jnp.zeros((), weights.dtype))
  return jnp.einsum('bhqk,bhkd->bhqd', weights, value)


def _flat_init(init: nn.initializers.Initializer, fan_in_axes: int) -> nn.initializers.Initializer:
  """``init`` applied to the 2-D ``(prod(shape[:fan_in_axes]), prod(rest))`` matrix, reshaped.

  This is what ``nn.DenseGeneral`` does, so that e.g. ``xavier_uniform`` of a ``(D, heads, Dh)``
  kernel has the fans of the ``(D, D)`` projection, as in the official model.
  """

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


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention, the ``MultiHeadDotProductAttention_0`` of the official ViT blocks.

  ``q = x W_q + b_q`` (scaled by ``1/sqrt(D/heads)``), ``k``, ``v`` likewise,
  ``y = concat_heads(softmax(q k^T) v) W_out + b_out``. Kernels xavier_uniform over the
  flattened ``(D, D)`` projections, biases zero, softmax in float32, attention dropout not
  broadcast: the official ``Encoder1DBlock``'s ``nn.MultiHeadDotProductAttention`` with
  ``broadcast_dropout=False``.

  Attributes:
    num_heads: heads; must divide the input width D.
    dropout_rate: dropout on the attention weights (needs the ``'dropout'`` rng when active).
    dtype: computation dtype; param_dtype: parameter dtype.

  Input ``[B, N, D]``; output ``[B, N, D]`` in ``dtype``. ``deterministic`` disables dropout.
  Logical axes: kernels ``('embed', 'heads', 'kv')`` / ``('heads', 'kv', 'embed')``, biases
  ``('heads', 'kv')`` / ``('embed',)``. Raises ValueError if ``num_heads`` does not divide D.
  """

  num_heads: int
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool) -> Array:
    width = x.shape[-1]
    if width % self.num_heads:
      raise ValueError(f'The token width {width} is not divisible by num_heads='
                       f'{self.num_heads}.')
    heads, head_dim = self.num_heads, width // self.num_heads
    x = x.astype(self.dtype)
    dropout = self.dropout_rate > 0.0 and not deterministic
    fused = fused_attention.usable((*x.shape[:2], 3, heads, head_dim), self.dtype,
                                   dropout=dropout)
    kernels, biases = {}, {}
    for name in ('query', 'key', 'value'):
      kernels[name], biases[name] = _Projection(
          (width, heads, head_dim), ('embed', 'heads', 'kv'), (heads, head_dim), ('heads', 'kv'),
          fan_in_axes=1, param_dtype=self.param_dtype, name=name)()
    if fused:
      # One [D, 3 * D] product writes q, k, v as [B, N, 3, heads, Dh], the fused CPU kernel's
      # input, and its output [B, N, heads, Dh] feeds the output projection: no transposes.
      kernel = jnp.stack([kernels[n] for n in ('query', 'key', 'value')], axis=1)
      bias = jnp.stack([biases[n] for n in ('query', 'key', 'value')], axis=0)
      qkv = (jnp.einsum('bnd,dthk->bnthk', x, kernel.astype(self.dtype))
             + bias.astype(self.dtype))
      y = fused_attention.attention(qkv, logits_scale=1.0 / math.sqrt(head_dim))
      layout = 'bnhk'
    else:
      # XLA's batched products want [B, heads, N, Dh]; the projections write it directly.
      query, key, value = (
          jnp.einsum('bnd,dhk->bhnk', x, kernels[n].astype(self.dtype))
          + biases[n].astype(self.dtype)[:, None, :] for n in ('query', 'key', 'value'))
      query = query / jnp.asarray(math.sqrt(head_dim), self.dtype)
      layout = 'bhnk'
      if not dropout and jax.default_backend() == 'gpu':
        # [B, N, heads, Dh] for jax.nn.dot_product_attention; scale=1: the query is scaled.
        to_bnhd = lambda a: jnp.swapaxes(a, 1, 2)  # pylint: disable=g-long-lambda
        y = jnp.swapaxes(jax.nn.dot_product_attention(
            to_bnhd(query), to_bnhd(key), to_bnhd(value), scale=1.0), 1, 2)
      else:
        y = dot_product_attention(
            query, key, value, dropout_rate=self.dropout_rate if dropout else 0.0,
            dropout_rng=self.make_rng('dropout') if dropout else None)

    kernel, bias = _Projection((heads, head_dim, width), ('heads', 'kv', 'embed'), (width,),
                               ('embed',), fan_in_axes=2, param_dtype=self.param_dtype,
                               name='out')()
    return (jnp.einsum(f'{layout},hkd->bnd', y, kernel.astype(self.dtype))
            + bias.astype(self.dtype))
