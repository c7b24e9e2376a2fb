"""How the blocks of both families run (remat, scan, logical constraints), and the input checks,
errors and LayerNorm both families share."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax import kernels

Array = jax.Array

#: ``remat_policy`` values: what a rematerialised block keeps for the backward pass. Names of
#: ``jax.checkpoint_policies``, plus vit_jax's 'dots_and_attention_saveable' (the dense
#: projections' outputs and a vit_jax kernel's residuals) and 'qkv_saveable' (only q, k, v and
#: those residuals). Memory and FLOPs of each: docs/pods.md.
REMAT_POLICIES = ('nothing_saveable', 'qkv_saveable', 'dots_with_no_batch_dims_saveable',
                  'dots_and_attention_saveable', 'dots_saveable', 'everything_saveable')

#: ``checkpoint_name``s of the attention's projections (a fused kernel's stacked input: 'qkv').
QKV_NAMES = ('query', 'key', 'value', 'qkv')

_KERNEL_RESIDUALS = tuple(name for k in kernels.ATTENTION for name in k.RESIDUAL_NAMES)


class ImageSizeError(ValueError):
  """An image size the model cannot take (a patch size or stride that does not divide it, or
  too small for T2T-ViT's soft splits); the message says what fits."""


def _remat_policy(name: str) -> Callable[..., bool]:
  """The ``jax.checkpoint`` policy called ``name`` (:data:`REMAT_POLICIES`); ValueError else."""
  if name not in REMAT_POLICIES:
    raise ValueError(f'remat_policy must be one of {REMAT_POLICIES}, got {name!r}')
  policies = jax.checkpoint_policies
  if name == 'dots_and_attention_saveable':
    return policies.save_from_both_policies(
        policies.dots_with_no_batch_dims_saveable,
        policies.save_only_these_names(*_KERNEL_RESIDUALS))
  if name == 'qkv_saveable':
    return policies.save_only_these_names(*QKV_NAMES, *_KERNEL_RESIDUALS)
  return getattr(policies, name)


#: Logical axes of the token sequence ``[B, N, D]`` at the block boundaries.
TOKENS_AXES = ('batch', 'length', 'embed')


def constrain(x: Array, names: Tuple[Optional[str], ...]) -> Array:
  """``nn.with_logical_constraint(x, names)`` when the ranks agree (a no-op without rules)."""
  return nn.with_logical_constraint(x, names) if x.ndim == len(names) else x


def layer_norm(dtype: Any, param_dtype: Any, epsilon: float, name: Optional[str] = None,
               fast_variance: bool = True) -> nn.LayerNorm:
  """A LayerNorm in ``dtype`` (``fast_variance`` False: the two-pass variance, as PyTorch), its
  parameters on the logical axis 'norm'."""
  return nn.LayerNorm(epsilon=epsilon, use_fast_variance=fast_variance, dtype=dtype,
                      param_dtype=param_dtype,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)),
                      name=name)


def check_images(model: nn.Module, inputs: Array) -> Tuple[Any, Any]:
  """The model's ``(dtype, param_dtype)`` (None: float32); ValueError unless ``inputs`` are
  NHWC images."""
  if inputs.ndim != 4:
    raise ValueError(f'{type(model).__name__} expects images of shape [batch, height, width, '
                     f'channels] (NHWC), got shape {inputs.shape}')
  return jnp.dtype(model.dtype or jnp.float32), jnp.dtype(model.param_dtype or jnp.float32)


def blocks(block_cls: type, x: Array, deterministic: bool, *, depth: int, name: str, remat: bool,
           remat_policy: str, scan: bool, scanned_args: Tuple[Array, ...] = (),
           layer_kwargs: Callable[[int], dict] = lambda i: {}, **kwargs: Any) -> Array:
  """``depth`` blocks ``block_cls(**kwargs)`` on ``x`` in the calling compact scope, each called
  ``(x, deterministic, ...)`` (``deterministic`` static under ``nn.remat`` with ``remat_policy``).

  ``scan``: one ``nn.scan`` stack called ``name`` (the block's call returns ``(x, None)``;
  parameters and sown intermediates stacked on a leading ``'layers'`` axis, own rngs per copy;
  ``scanned_args`` scanned with them); else ``{name}_{i}`` with ``layer_kwargs(i)`` too.
  """
  if remat:  # static_argnums counts `self` as 0; CSE is prevented only outside nn.scan's loop.
    block_cls = nn.remat(block_cls, prevent_cse=not scan, static_argnums=(2,),
                         policy=_remat_policy(remat_policy))
  if scan:
    stack = nn.scan(block_cls, variable_axes={'params': 0, 'intermediates': 0},
                    split_rngs={'params': True, 'dropout': True},
                    in_axes=(nn.broadcast,) + (0,) * len(scanned_args), length=depth,
                    metadata_params={nn.PARTITION_NAME: 'layers'})
    return stack(scanned=True, name=name, **kwargs)(x, deterministic, *scanned_args)[0]
  for i in range(depth):
    x = block_cls(name=f'{name}_{i}', **kwargs, **layer_kwargs(i))(x, deterministic)
  return x


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
