"""How the transformer blocks of both model families run: rematerialised (``nn.remat``, with a
``jax.checkpoint`` policy), scanned (``nn.scan``, parameters stacked along ``'layers'``), with
logical constraints on their activations; and the checks of the model fields that choose this,
with the field checks both families share (positive sizes, rates in [0, 1), float dtypes).

Used by :mod:`vit_jax.models.vit` and :mod:`vit_jax.models.t2t` alike; pure Flax.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax import kernels
from vit_jax.models import attention as attention_lib

Array = jax.Array

#: ``remat_policy`` values: names in ``jax.checkpoint_policies`` of what a rematerialised block
#: keeps from its forward pass for the backward pass (everything else is recomputed).
#: 'nothing_saveable' keeps only the block's input (full rematerialisation, least memory);
#: 'dots_with_no_batch_dims_saveable' also keeps the outputs of the dense projections (q, k, v,
#: attention output, both MLP layers) and recomputes the LayerNorms, the attention weights
#: (softmax of q k^T) and the GELU: with ``scan=True`` a quarter of the memory of no remat;
#: 'dots_and_attention_saveable' (vit_jax's own) keeps as much and, where a vit_jax attention
#: kernel runs (:data:`vit_jax.kernels.ATTENTION`), also its saved residuals, so the kernel's
#: forward is not run again in the backward pass; elsewhere it equals the previous one.
#: 'qkv_saveable' (vit_jax's own) keeps only the self-attention's query, key and value (and the
#: kernel's residuals) and recomputes the output projection and the MLP's first layer: about half
#: the memory of the previous two for about a seventh more of the step's FLOPs
#: (``nothing_saveable``: a third more).
REMAT_POLICIES = ('nothing_saveable', 'qkv_saveable', 'dots_with_no_batch_dims_saveable',
                  'dots_and_attention_saveable', 'dots_saveable', 'everything_saveable')

_KERNEL_RESIDUALS = tuple(name for k in kernels.ATTENTION for name in k.RESIDUAL_NAMES)


def remat_policy(name: str) -> Callable[..., bool]:
  """The ``jax.checkpoint`` policy called ``name``, one of :data:`REMAT_POLICIES`.

  Raises:
    ValueError: an unknown name (listing the valid ones).
  """
  if name not in REMAT_POLICIES:
    raise ValueError(f'remat_policy must be one of {REMAT_POLICIES}, got {name!r}')
  policies = jax.checkpoint_policies
  if name == 'dots_and_attention_saveable':
    return policies.save_from_both_policies(
        policies.dots_with_no_batch_dims_saveable,
        policies.save_only_these_names(*_KERNEL_RESIDUALS))
  if name == 'qkv_saveable':
    return policies.save_only_these_names(*attention_lib.QKV_NAMES, *_KERNEL_RESIDUALS)
  return getattr(policies, name)


#: Logical axes of the token sequence ``[B, N, D]`` at the block boundaries.
TOKENS_AXES = ('batch', 'length', 'embed')


def constrain(x: Array, names: Tuple[Optional[str], ...]) -> Array:
  """``nn.with_logical_constraint(x, names)`` when the ranks agree, else ``x`` unchanged.

  A no-op without ``nn.logical_axis_rules`` (and a mesh) in context.
  """
  if x.ndim != len(names):
    return x
  return nn.with_logical_constraint(x, names)


def rematerialised(block_cls: type, policy: str, *, scan: bool) -> type:
  """The block class rematerialised in the backward pass (``nn.remat``), keeping ``policy``'s saves.

  ``block_cls.__call__(x, deterministic, ...)`` must take the Python bool ``deterministic`` as
  its second positional argument (it is made static). ``policy`` is one of
  :data:`REMAT_POLICIES` (see :func:`remat_policy`). Common subexpression elimination
  is prevented only outside ``nn.scan`` (``scan``), whose loop already keeps XLA from merging
  the recomputation into the forward pass.
  """
  # static_argnums counts `self` as 0: argument 2 is `deterministic`.
  return nn.remat(block_cls, prevent_cse=not scan, static_argnums=(2,),
                  policy=remat_policy(policy))


def scanned(block_cls: type, length: int, *, in_axes: Any) -> type:
  """The block class run ``length`` times in a loop (``nn.scan``), its parameters stacked.

  The block's call must return ``(x, None)`` (carry, no output). Parameters get a leading axis
  of size ``length`` with the logical axis name ``'layers'``, and so do the values the blocks
  sow into ``'intermediates'`` when it is mutable (attention weights, tokens: layer ``i`` at
  index ``i``; :mod:`vit_jax.models.intermediates`); each copy gets its own
  ``'params'`` and ``'dropout'`` rngs. ``in_axes`` says how the call's arguments after ``x`` are
  passed: ``nn.broadcast`` the same to every copy, 0 sliced along their leading axis.
  """
  return nn.scan(block_cls,
                 variable_axes={'params': 0, 'intermediates': 0},
                 split_rngs={'params': True, 'dropout': True},
                 in_axes=in_axes,
                 length=length,
                 metadata_params={nn.PARTITION_NAME: 'layers'})


def check_positive_int(field: str, value: Any, allow_none: bool = False) -> None:
  """Raises ValueError naming ``field`` unless ``value`` is an int > 0 (not a bool), or None
  with ``allow_none``."""
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    extra = ' or None' if allow_none else ''
    raise ValueError(f'{field} must be a positive int{extra}, got {value!r}')


def check_rate(field: str, value: Any) -> None:
  """Raises ValueError naming ``field`` unless ``value`` is a number in [0, 1) (a dropout or
  drop-path rate)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
    raise ValueError(f'{field} must be a float in [0, 1), got {value!r}')


def check_float_dtypes(**dtypes: Any) -> None:
  """Raises ValueError naming each field whose value (if not None) is not a floating dtype."""
  for field, value in dtypes.items():
    if value is None:
      continue
    try:
      ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
      ok = False
    if not ok:
      raise ValueError(f'{field} must be a floating dtype (e.g. jnp.float32, jnp.bfloat16), '
                       f'got {value!r}')


def check_execution_fields(*, scan: Any, remat: Any, remat_policy: Any,
                           attention: Any = 'xla') -> None:
  """Checks the fields that choose how the blocks run (both families have them).

  Raises:
    ValueError: ``scan`` or ``remat`` not a bool (e.g. the string 'maybe', which would read as
      True), ``remat_policy`` not in :data:`REMAT_POLICIES`, or ``attention`` not in
      :data:`vit_jax.models.attention.IMPLEMENTATIONS`.
  """
  for field, value in (('scan', scan), ('remat', remat)):
    if not isinstance(value, bool):
      raise ValueError(f'{field} must be True or False, got {value!r}')
  if remat_policy not in REMAT_POLICIES:
    raise ValueError(f'remat_policy must be one of {REMAT_POLICIES}, got {remat_policy!r}')
  attention_lib.check_implementation(attention)
