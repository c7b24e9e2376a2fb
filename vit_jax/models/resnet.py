"""The BiT ResNet stem of the hybrids (ViT paper Sec. 3.1; Kolesnikov et al., ECCV 2020), with
the official ``models_resnet.py``'s numerics and names, so the published hybrids load::

  conv_root   StdConv 7x7/2; gn_root GroupNorm(32, eps 1e-6), ReLU; max-pool 3x3/2
  block{s}    n_s bottleneck ``unit{u}``, width 64 f 2^(s-1) (output 4x), the first strided 2
              (block1: 1); total stride 4 * 2^(S-1)

Kernels HWIO without bias, at the top of ``params`` beside ``embedding``; SAME padding as XLA.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any

WEIGHT_STANDARDIZATION_EPSILON = 1e-5

GROUPNORM_GROUPS = 32
GROUPNORM_EPSILON = 1e-6

BASE_WIDTH = 64

#: Logical axes of a conv kernel (HWIO) and of a feature map (NHWC).
KERNEL_AXES = (None, None, 'conv_in', 'conv_out')
FEATURE_AXES = ('batch', None, None, 'conv_out')


def standardize_weight(kernel: Array, eps: float = WEIGHT_STANDARDIZATION_EPSILON) -> Array:
  """``(w - mean) / (std + eps)`` of an HWIO kernel per output channel (Qiao et al. 2019; eps on
  the std, as the official ``weight_standardize``)."""
  axes = (0, 1, 2)
  centered = kernel - jnp.mean(kernel, axis=axes)
  return centered / (jnp.std(centered, axis=axes) + eps)


class StdConv(nn.Module):
  """Weight-standardised convolution (NHWC, HWIO, SAME, no bias), ``[B, H, W, C]`` -> ``[B,
  ceil(H/sh), ceil(W/sw), features]``; the raw ``kernel`` is standardised on every call."""

  features: int
  kernel_size: Tuple[int, int]
  strides: Tuple[int, int] = (1, 1)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: Array) -> Array:
    shape = (*self.kernel_size, x.shape[-1], self.features)
    kernel = self.param('kernel', nn.with_logical_partitioning(self.kernel_init, KERNEL_AXES),
                        shape, self.param_dtype)
    kernel = standardize_weight(kernel)
    x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    return jax.lax.conv_general_dilated(
        x, kernel, window_strides=tuple(self.strides), padding='SAME',
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def _group_norm(name: str, dtype: Dtype, param_dtype: Dtype, zero_scale: bool = False):
  scale_init = nn.initializers.zeros if zero_scale else nn.initializers.ones
  return nn.GroupNorm(
      num_groups=GROUPNORM_GROUPS, epsilon=GROUPNORM_EPSILON, dtype=dtype,
      param_dtype=param_dtype,
      scale_init=nn.with_logical_partitioning(scale_init, ('norm',)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)), name=name)


class BottleneckUnit(nn.Module):
  """The official ``ResidualUnit``: ``relu(residual + gn3(conv3(...conv1(x))))``, ``4 f`` out,
  ``gn3`` zero-initialised, ``conv_proj``/``gn_proj`` when channels or size change."""

  features: int
  strides: Tuple[int, int] = (1, 1)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    out_features = 4 * self.features
    strides = tuple(self.strides)
    conv = lambda features, size, strides, name: StdConv(  # pylint: disable=g-long-lambda
        features=features, kernel_size=(size, size), strides=strides, dtype=self.dtype,
        param_dtype=self.param_dtype, name=name)
    norm = lambda name, zero_scale=False: _group_norm(  # pylint: disable=g-long-lambda
        name, self.dtype, self.param_dtype, zero_scale)

    residual = x
    if x.shape[-1] != out_features or strides != (1, 1):
      residual = conv(out_features, 1, strides, 'conv_proj')(x)
      residual = norm('gn_proj')(residual)

    y = nn.relu(norm('gn1')(conv(self.features, 1, (1, 1), 'conv1')(x)))
    y = nn.relu(norm('gn2')(conv(self.features, 3, strides, 'conv2')(y)))
    y = norm('gn3', zero_scale=True)(conv(out_features, 1, (1, 1), 'conv3')(y))
    return nn.with_logical_constraint(nn.relu(residual + y), FEATURE_AXES)


class ResNetStage(nn.Module):
  """``num_units`` bottleneck units ``unit1 .. unit{n}`` of width f; only ``unit1`` is strided."""

  num_units: int
  features: int
  first_stride: Tuple[int, int] = (1, 1)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    for u in range(self.num_units):
      strides = tuple(self.first_stride) if u == 0 else (1, 1)
      x = BottleneckUnit(features=self.features, strides=strides, dtype=self.dtype,
                         param_dtype=self.param_dtype, name=f'unit{u + 1}')(x)
    return x


def resnet_stride(num_layers: Sequence[int]) -> int:
  """Total downsampling of the stem: 4 (root conv + max-pool) times 2 per stage after the first."""
  return 4 * 2 ** max(len(tuple(num_layers)) - 1, 0)


def resnet_out_channels(num_layers: Sequence[int], width_factor: float) -> int:
  """Channels of the stem output: ``w = int(64 width_factor)`` (``conv_root``'s, official) with
  no stages, else ``4 w 2^(S-1)``."""
  stages = len(tuple(num_layers))
  width = int(BASE_WIDTH * width_factor)
  return width if stages == 0 else 4 * width * 2 ** (stages - 1)


def resnet_stem(x: Array, *, num_layers: Sequence[int], width_factor: float = 1,
                dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32) -> Array:
  """The root and stages, in the calling compact ``__call__``'s scope: ``[B, H, W, C]`` -> ``[B,
  H/t, W/t, resnet_out_channels]``, ``t = resnet_stride(num_layers)``; ``()``: the root only."""
  width = int(BASE_WIDTH * width_factor)
  x = StdConv(features=width, kernel_size=(7, 7), strides=(2, 2), dtype=dtype,
              param_dtype=param_dtype, name='conv_root')(x)
  x = _group_norm('gn_root', dtype, param_dtype)(x)
  x = nn.relu(x)
  x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding='SAME')
  x = nn.with_logical_constraint(x, FEATURE_AXES)
  for s, units in enumerate(tuple(num_layers)):
    first_stride = (1, 1) if s == 0 else (2, 2)
    x = ResNetStage(num_units=int(units), features=width * 2 ** s, first_stride=first_stride,
                    dtype=dtype, param_dtype=param_dtype, name=f'block{s + 1}')(x)
  return x


def validate_resnet(num_layers: Optional[Sequence[int]], width_factor: Any) -> None:
  """ValueError: ``num_layers`` not a sequence of positive ints (None: no stem), or ``64 *
  width_factor`` not a positive multiple of 32 (the GroupNorm groups)."""
  if num_layers is None:
    return
  if isinstance(num_layers, (str, bytes)) or not isinstance(num_layers, Sequence):
    raise ValueError(f'resnet_num_layers must be a tuple of positive ints (units per stage, e.g. '
                     f'(3, 4, 9); () for the root only) or None, got {num_layers!r}')
  for units in num_layers:
    if isinstance(units, bool) or not isinstance(units, int) or units <= 0:
      raise ValueError(f'resnet_num_layers must contain positive ints (units per stage), got '
                       f'{tuple(num_layers)!r}')
  if isinstance(width_factor, bool) or not isinstance(width_factor, (int, float)):
    raise ValueError(f'resnet_width_factor must be a positive number, got {width_factor!r}')
  width = BASE_WIDTH * width_factor
  if width <= 0 or width != int(width) or int(width) % GROUPNORM_GROUPS:
    raise ValueError(
        f'resnet_width_factor={width_factor!r} gives a root width of {width} channels; it must '
        f'be a positive multiple of {GROUPNORM_GROUPS} (the GroupNorm groups): use a multiple '
        f'of 0.5, e.g. 1 or 2.')
