"""How the blocks of both families run (remat, scan, logical constraints), and the field checks
and errors both families share."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax import kernels
from vit_jax.models import attention as attention_lib

Array = jax.Array

#: ``remat_policy`` values: what a rematerialised block keeps for the backward pass. Names of
#: ``jax.checkpoint_policies``, plus vit_jax's 'dots_and_attention_saveable' (the dense
#: projections' outputs and a vit_jax kernel's residuals) and 'qkv_saveable' (only q, k, v and
#: those residuals). Memory and FLOPs of each: docs/pods.md.
REMAT_POLICIES = ('nothing_saveable', 'qkv_saveable', 'dots_with_no_batch_dims_saveable',
                  'dots_and_attention_saveable', 'dots_saveable', 'everything_saveable')

_KERNEL_RESIDUALS = tuple(name for k in kernels.ATTENTION for name in k.RESIDUAL_NAMES)


class ImageSizeError(ValueError):
  """An image size the model cannot take (a patch size or stride that does not divide it, or
  too small for T2T-ViT's soft splits); the message says what fits."""


def remat_policy(name: str) -> Callable[..., bool]:
  """The ``jax.checkpoint`` policy called ``name`` (:data:`REMAT_POLICIES`); ValueError else."""
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
  """``nn.with_logical_constraint(x, names)`` when the ranks agree (a no-op without rules)."""
  if x.ndim != len(names):
    return x
  return nn.with_logical_constraint(x, names)


def rematerialised(block_cls: type, policy: str, *, scan: bool) -> type:
  """``nn.remat`` of ``block_cls`` with ``policy``; its call takes ``(x, deterministic, ...)``,
  ``deterministic`` static. CSE is prevented only outside ``nn.scan``, whose loop does it."""
  # static_argnums counts `self` as 0: argument 2 is `deterministic`.
  return nn.remat(block_cls, prevent_cse=not scan, static_argnums=(2,),
                  policy=remat_policy(policy))


def scanned(block_cls: type, length: int, *, in_axes: Any) -> type:
  """``nn.scan`` of ``block_cls`` (its call returns ``(x, None)``) ``length`` times: parameters
  and sown intermediates stacked on a leading ``'layers'`` axis, own rngs per copy; ``in_axes``
  for the arguments after ``x`` (``nn.broadcast`` or 0)."""
  return nn.scan(block_cls, variable_axes={'params': 0, 'intermediates': 0},
                 split_rngs={'params': True, 'dropout': True}, in_axes=in_axes, length=length,
                 metadata_params={nn.PARTITION_NAME: 'layers'})


def fields_of(module: Any) -> dict[str, Any]:
  """A model's (or any dataclass's, e.g. a :class:`vit_jax.models.vit_fields.Config`) fields by
  name (a module's ``parent`` and ``name`` included), for its checks."""
  return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)}


def shared_fields(module: Any, cls: type, **overrides: Any) -> dict[str, Any]:
  """The fields of ``cls`` that ``module`` (a module or a fields dataclass) has too, by name,
  then ``overrides``: what a module passes on to a submodule of class ``cls``."""
  own = fields_of(module)
  return {**{f.name: own[f.name] for f in dataclasses.fields(cls)
             if f.name in own and f.name not in ('parent', 'name')}, **overrides}


def check_positive_int(field: str, value: Any, allow_none: bool = False) -> None:
  """ValueError naming ``field`` unless an int > 0 (not a bool), or None with ``allow_none``."""
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    extra = ' or None' if allow_none else ''
    raise ValueError(f'{field} must be a positive int{extra}, got {value!r}')


def check_rate(field: str, value: Any) -> None:
  """ValueError naming ``field`` unless ``value`` is a number in [0, 1) (a rate)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
    raise ValueError(f'{field} must be a float in [0, 1), got {value!r}')


def check_float_dtypes(**dtypes: Any) -> None:
  """ValueError naming each field whose value (if not None) is not a floating dtype."""
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


def check_bool(field: str, value: Any) -> None:
  """ValueError naming ``field`` unless ``value`` is a Python bool (an execution switch)."""
  if not isinstance(value, bool):
    raise ValueError(f'{field} must be True or False, got {value!r}')
