"""Multi-head self-attention of both model families, one function over its implementations.

:class:`MultiHeadDotProductAttention` computes what ``flax.linen.MultiHeadDotProductAttention``
computes for self-attention (the MSA of ViT eq. 2, Vaswani et al. eq. 1) and stores the same
parameters under the same names and shapes, so the official checkpoints load unchanged::

  {query,key,value}/kernel (D, heads, D/heads)   {query,key,value}/bias (heads, D/heads)
  out/kernel (heads, D/heads, D)                 out/bias (D,)

T2T-ViT's backbone attention (``vit_jax.models.t2t.Attention``) goes through the same
:func:`self_attention`. The model field ``attention`` (:data:`IMPLEMENTATIONS`) says which
implementation runs; ``vit_jax.dispatch`` chooses it, the models never look at the machine:

* ``'xla'``: ``q, k, v`` in the ``[B, heads, N, D/heads]`` layout of
  :func:`dot_product_attention`'s two batched products (no transposes). Attention dropout.
* ``'cudnn'``: ``jax.nn.dot_product_attention(implementation='cudnn')`` on ``[B, N, heads, Dh]``.
* a vit_jax kernel (:data:`vit_jax.kernels.ATTENTION`): the three projections as one product
  into ``[B, N, 3, heads, Dh]``, the kernel's input; its ``[B, N, heads, Dh]`` output feeds
  the output projection.

They differ by floating-point rounding only. Cross-attention (big_vision's ``MAPHead``:
:func:`cross_attention`, through ``inputs_kv``) has the XLA path only.

Intermediates: with Flax's ``'intermediates'`` collection mutable, the attention modules sow
their float32 weights ``[B, heads, Nq, Nk]`` (softmax before dropout) as
:data:`ATTENTION_WEIGHTS`, computed by the XLA path whatever ``attention`` says (the fused
kernels do not return them); decided at trace time (:func:`capturing`), so without the
collection the traced program is unchanged. :mod:`vit_jax.models.intermediates` reads them.
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

Array = jax.Array
Dtype = Any

#: Values of the models' ``attention`` field (see the module docstring).
IMPLEMENTATIONS = ('xla', 'cudnn', *(k.NAME for k in kernels.ATTENTION))

#: ``checkpoint_name``s of the self-attention's projections (XLA and cuDNN paths: 'query',
#: 'key', 'value'; a fused kernel's stacked input: 'qkv'), for remat policies.
QKV_NAMES = ('query', 'key', 'value', 'qkv')

#: The Flax collection the models sow what they compute into (see the module docstring).
INTERMEDIATES = 'intermediates'
#: Name of the sown attention weights, float32 ``[B, heads, Nq, Nk]``, in every attention module.
ATTENTION_WEIGHTS = 'attention_weights'
#: Name of the sown output ``[B, N, D]`` (compute dtype) of every encoder / backbone block.
TOKENS = 'tokens'

#: Receives the float32 attention weights ``[B, heads, Nq, Nk]`` (before dropout).
WeightsFn = Callable[[Array], Any]


def sow_weights(module: nn.Module) -> WeightsFn:
  """The function that sows its argument (float32 weights) as ``module``'s
  :data:`ATTENTION_WEIGHTS` in :data:`INTERMEDIATES` (``module.sow``: a no-op when not mutable).
  """
  return lambda weights: module.sow(INTERMEDIATES, ATTENTION_WEIGHTS, weights)


def capturing(module: nn.Module) -> bool:
  """Whether ``module`` runs with :data:`INTERMEDIATES` mutable, i.e. should sow what it computes.

  A Python bool at trace time (False during ``init`` and a plain ``apply``; True with
  ``mutable=['intermediates']`` or ``capture_intermediates=True``). Raises ValueError for an
  unbound module (flax).
  """
  return module.is_mutable_collection(INTERMEDIATES)


def dot_product_attention(query: Array, key: Array, value: Array, *,
                          logits_scale: Optional[float] = None, dropout_rate: float = 0.0,
                          dropout_rng: Optional[Array] = None,
                          weights_fn: Optional[WeightsFn] = None) -> Array:
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
    weights_fn: called (at trace time) with the float32 softmax weights ``[B, heads, Nq, Nk]``
      before dropout, e.g. to sow them; None: nothing more is done.

  Returns:
    ``[B, heads, Nq, Dh]`` in the input dtype.
  """
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


def check_implementation(implementation: Any) -> None:
  """Raises ValueError unless ``implementation`` is one of :data:`IMPLEMENTATIONS`."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'attention must be one of {IMPLEMENTATIONS}, got {implementation!r} (a '
                     "training config's 'auto' is resolved by vit_jax.dispatch.choose_attention "
                     'from the target devices).')


def self_attention(x: Array, projections: Sequence[Tuple[Array, Optional[Array]]], *,
                   implementation: str, logits_scale: float, scale_query: bool = False,
                   dropout_rate: float = 0.0, dropout_rng: Optional[Array] = None,
                   weights_fn: Optional[WeightsFn] = None) -> Tuple[Array, str]:
  """The attention core of both families, ``softmax(scale q k^T) v`` per head, by the
  implementation the model's ``attention`` field names.

  Args:
    x: ``[B, N, D]`` tokens in the compute dtype.
    projections: ``(kernel [D, heads, Dh], bias [heads, Dh] or None)`` of the query, key and
      value, in that order, cast to ``x``'s dtype.
    implementation: one of :data:`IMPLEMENTATIONS` (see the module docstring).
    logits_scale: the factor of ``q . k`` (``Dh ** -0.5`` by default in both families).
    scale_query: apply the scale to the query before the product on the 'xla' path, as the
      official ViT (flax) does, instead of to the float32 logits as T2T-ViT's reference does.
    dropout_rate: attention dropout on the weights (the 'xla' path only; 0 elsewhere).
    dropout_rng: its key; None disables dropout.
    weights_fn: given, the 'xla' path runs whatever ``implementation`` is (the fused kernels
      do not return the weights) and calls it with the float32 weights ``[B, heads, N, N]``
      (:func:`dot_product_attention`).

  Returns:
    ``(y, layout)``: the per-head outputs and their layout, ``'bhnk'`` (``[B, heads, N, Dh]``)
    or ``'bnhk'`` (``[B, N, heads, Dh]``), for the output projection's einsum.

  Raises:
    ValueError: an unknown implementation, or dropout asked of one that has none.
  """
  check_implementation(implementation)
  if dropout_rate > 0.0 and dropout_rng is not None and implementation != 'xla':
    raise ValueError(f"attention={implementation!r} has no attention dropout; use 'xla' for a "
                     'model with attention_dropout_rate > 0 in training.')
  if weights_fn is not None:
    implementation = 'xla'
  dtype = x.dtype
  fused = next((k for k in kernels.ATTENTION if k.NAME == implementation), None)
  if fused is not None:
    kernel = jnp.stack([k.astype(dtype) for k, _ in projections], axis=1)
    qkv = jnp.einsum('bnd,dthk->bnthk', x, kernel)
    if projections[0][1] is not None:
      qkv = qkv + jnp.stack([b.astype(dtype) for _, b in projections], axis=0)
    qkv = checkpoint_name(qkv, QKV_NAMES[-1])
    return fused.attention(qkv, logits_scale=logits_scale), 'bnhk'
  layout = 'bnhk' if implementation == 'cudnn' else 'bhnk'
  query, key, value = (
      jnp.einsum(f'bnd,dhk->{layout}', x, k.astype(dtype))
      + (0 if b is None else b.astype(dtype)[:, None, :] if layout == 'bhnk'
         else b.astype(dtype)) for k, b in projections)
  # Named for the remat policy 'qkv_saveable' (vit_jax.models.execution), which keeps only these.
  query, key, value = (checkpoint_name(t, n) for t, n in zip((query, key, value), QKV_NAMES))
  if implementation == 'cudnn':
    return jax.nn.dot_product_attention(query, key, value, scale=logits_scale,
                                        implementation='cudnn'), layout
  if scale_query:  # As flax: q / sqrt(Dh), a division (the same float32 rounding).
    query = query / jnp.asarray(1.0 / logits_scale, dtype)
  return dot_product_attention(query, key, value,
                               logits_scale=None if scale_query else logits_scale,
                               dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                               weights_fn=weights_fn), layout


def cross_attention(x_q: Array, x_kv: Array, projections: Sequence[Tuple[Array, Array]], *,
                    logits_scale: float, dropout_rate: float = 0.0,
                    dropout_rng: Optional[Array] = None,
                    weights_fn: Optional[WeightsFn] = None) -> Array:
  """Multi-head attention of ``x_q``'s tokens over ``x_kv``'s, as flax's
  ``MultiHeadDotProductAttention(inputs_q, inputs_kv)`` computes it (XLA only).

  ``q = x_q W_q + b_q`` divided by ``1 / logits_scale`` (flax's ``q / sqrt(Dh)``), ``k``, ``v``
  from ``x_kv`` likewise, then :func:`dot_product_attention` (float32 softmax).

  Args:
    x_q: ``[B, Nq, D]`` query tokens in the compute dtype; x_kv: ``[B, Nk, D]``, same dtype.
    projections: ``(kernel [D, heads, Dh], bias [heads, Dh])`` of the query, key and value, in
      that order, cast to ``x_q``'s dtype.
    logits_scale: the factor of ``q . k`` (``Dh ** -0.5``).
    dropout_rate, dropout_rng, weights_fn: attention dropout and the weights' receiver
      (``[B, heads, Nq, Nk]`` float32), as :func:`dot_product_attention`.

  Returns:
    ``[B, heads, Nq, Dh]`` (layout ``'bhnk'``) in ``x_q``'s dtype.

  Raises:
    ValueError: ``x_q`` and ``x_kv`` of another rank than 3 or of different batch or width.
  """
  if x_q.ndim != 3 or x_kv.ndim != 3 or x_q.shape[0] != x_kv.shape[0] or (
      x_q.shape[-1] != x_kv.shape[-1]):
    raise ValueError(f'cross_attention expects queries [batch, Nq, D] and keys/values [batch, Nk, '
                     f'D] of one batch and width, got {x_q.shape} and {x_kv.shape}')
  dtype = x_q.dtype
  query, key, value = (jnp.einsum('bnd,dhk->bhnk', x.astype(dtype), k.astype(dtype))
                       + b.astype(dtype)[:, None, :]
                       for x, (k, b) in zip((x_q, x_kv, x_kv), projections))
  query = query / jnp.asarray(1.0 / logits_scale, dtype)  # As flax: q / sqrt(Dh).
  return dot_product_attention(query, key, value, dropout_rate=dropout_rate,
                               dropout_rng=dropout_rng, weights_fn=weights_fn)


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention, the ``MultiHeadDotProductAttention_0`` of the official ViT blocks
  (and, with ``inputs_kv``, cross-attention: big_vision's ``MAPHead_0``).

  ``q = x W_q + b_q`` (scaled by ``1/sqrt(D/heads)``), ``k``, ``v`` likewise,
  ``y = concat_heads(softmax(q k^T) v) W_out + b_out``. Kernels xavier_uniform over the
  flattened ``(D, D)`` projections, biases zero, softmax in float32, attention dropout not
  broadcast: the official ``Encoder1DBlock``'s ``nn.MultiHeadDotProductAttention`` with
  ``broadcast_dropout=False``.

  Attributes:
    num_heads: heads; must divide the input width D.
    dropout_rate: dropout on the attention weights (needs the ``'dropout'`` rng when active).
    dtype: computation dtype; param_dtype: parameter dtype.
    attention: the implementation, one of :data:`IMPLEMENTATIONS`.

  Input ``[B, N, D]``; output ``[B, N, D]`` in ``dtype``. ``deterministic`` disables dropout.
  With ``inputs_kv`` ``[B, Nk, D]`` the queries come from the input and the keys and values from
  ``inputs_kv`` (:func:`cross_attention`, the 'xla' path only; same parameters); the output is
  ``[B, N, D]``.
  Sows :data:`ATTENTION_WEIGHTS`, float32 ``[B, heads, N, N]`` (``[B, heads, N, Nk]`` with
  ``inputs_kv``), softmax before dropout, when :data:`INTERMEDIATES` is mutable; then the 'xla'
  path runs whatever ``attention`` is (see the module docstring).
  Logical axes: kernels ``('embed', 'heads', 'kv')`` / ``('heads', 'kv', 'embed')``, biases
  ``('heads', 'kv')`` / ``('embed',)``. Raises ValueError if ``num_heads`` does not divide D,
  for ``inputs_kv`` with ``attention`` other than 'xla', or as :func:`self_attention` /
  :func:`cross_attention`.
  """

  num_heads: int
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  attention: str = 'xla'

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
    heads, head_dim = self.num_heads, width // self.num_heads
    x = x.astype(self.dtype)
    dropout = self.dropout_rate > 0.0 and not deterministic
    projections = [
        _Projection((width, heads, head_dim), ('embed', 'heads', 'kv'), (heads, head_dim),
                    ('heads', 'kv'), fan_in_axes=1, param_dtype=self.param_dtype, name=name)()
        for name in ('query', 'key', 'value')]
    rate = self.dropout_rate if dropout else 0.0
    rng = self.make_rng('dropout') if dropout else None
    weights_fn = sow_weights(self) if capturing(self) else None
    if inputs_kv is None:
      y, layout = self_attention(
          x, projections, implementation=self.attention, logits_scale=1.0 / math.sqrt(head_dim),
          scale_query=True, dropout_rate=rate, dropout_rng=rng, weights_fn=weights_fn)
    else:
      y, layout = cross_attention(x, inputs_kv.astype(self.dtype), projections,
                                  logits_scale=1.0 / math.sqrt(head_dim), dropout_rate=rate,
                                  dropout_rng=rng, weights_fn=weights_fn), 'bhnk'
    kernel, bias = _Projection((heads, head_dim, width), ('heads', 'kv', 'embed'), (width,),
                               ('embed',), fan_in_axes=2, param_dtype=self.param_dtype,
                               name='out')()
    return (jnp.einsum(f'{layout},hkd->bnd', y, kernel.astype(self.dtype))
            + bias.astype(self.dtype))
