"""BiT-style ResNet stem of the hybrid (R+ViT) models, in Flax linen.

The hybrid models of Dosovitskiy et al. (ICLR 2021, Sec. 3.1 "Hybrid Architecture") feed the
feature map of a ResNet to the ViT patch embedding instead of raw pixels. The ResNet is the
"Big Transfer" (BiT, Kolesnikov et al., ECCV 2020) variant: Group Normalization instead of
BatchNorm and weight-standardised convolutions. This module reproduces the numerics and the
parameter names of the official implementation (google-research/vision_transformer,
``vit_jax/models_resnet.py`` and the ResNet root in ``vit_jax/models_vit.py``), so that the
published hybrid checkpoints load unchanged.

Structure (``width = 64 * width_factor``, ``num_layers = (n_1, ..., n_S)``)::

  conv_root   StdConv 7x7, stride 2, SAME, no bias    [B, H, W, 3]      -> [B, H/2, W/2, width]
  gn_root     GroupNorm(32 groups, eps 1e-6), ReLU
              max-pool 3x3, stride 2, SAME               -> [B, H/4, W/4, width]
  block1      n_1 bottleneck units, features width, stride 1 -> [B, H/4, W/4, 4 width]
  block{s}    n_s units, features width * 2^(s-1), first unit stride 2
                                                         -> [B, H/2^(s+1), W/2^(s+1), 4 width 2^(s-1)]

so the total stride is ``4 * 2^(S-1)`` (4 when there are no stages). Each unit ``block{s}/unit{u}``
is a post-activation bottleneck (features f, output 4f, stride s on the first unit of a stage)::

  residual = gn_proj(conv_proj(x))  (1x1, stride s)   if x has != 4f channels or s != 1, else x
  y = relu(gn1(conv1(x)))           conv1 1x1, f
  y = relu(gn2(conv2(y)))           conv2 3x3, f, stride s, SAME
  y = gn3(conv3(y))                 conv3 1x1, 4f; gn3 scale initialised to zero
  out = relu(residual + y)

Parameter tree (all convolutions without bias; kernels HWIO)::

  conv_root/kernel (7, 7, 3, width)
  gn_root/{scale, bias} (width,)
  block{s}/unit{u}/conv1/kernel (1, 1, C_in, f)   gn1/{scale, bias} (f,)
  block{s}/unit{u}/conv2/kernel (3, 3, f, f)      gn2/{scale, bias} (f,)
  block{s}/unit{u}/conv3/kernel (1, 1, f, 4f)     gn3/{scale, bias} (4f,)
  block{s}/unit{u}/conv_proj/kernel (1, 1, C_in, 4f)  gn_proj/{scale, bias} (4f,)  (first units)

These names sit at the top level of the model's ``params`` (next to ``embedding``), as in the
official model: :func:`resnet_stem` creates the modules inside the calling module's scope.

Logical axes (``nn.with_logical_partitioning``; see :mod:`vit_jax.models.vit`): conv kernels
``(None, None, 'conv_in', 'conv_out')``, GroupNorm scale and bias ``('norm',)``; the feature
maps after the root and after every unit are constrained to ``('batch', None, None,
'conv_out')`` (a no-op without ``nn.logical_axis_rules`` and a mesh).

Padding: SAME follows XLA (the odd extra padding pixel goes at the end, e.g. a 3x3/2 window on
a 16-pixel side is padded (0, 1)); max-pool pads with -inf.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any

#: Epsilon added to the *standard deviation* (not the variance) in weight standardisation.
WEIGHT_STANDARDIZATION_EPSILON = 1e-5

#: GroupNorm configuration of the BiT ResNet (flax defaults, as used by the official code).
GROUPNORM_GROUPS = 32
GROUPNORM_EPSILON = 1e-6

#: Width of the root convolution for ``width_factor = 1``.
BASE_WIDTH = 64

#: Logical axes of a conv kernel (HWIO) and of a feature map (NHWC).
KERNEL_AXES = (None, None, 'conv_in', 'conv_out')
FEATURE_AXES = ('batch', None, None, 'conv_out')


def _constrain(x: Array) -> Array:
  return nn.with_logical_constraint(x, FEATURE_AXES)


def standardize_weight(kernel: Array, eps: float = WEIGHT_STANDARDIZATION_EPSILON) -> Array:
  """Weight standardisation of a conv kernel, per output channel.

  ``w = (w - mean) / (std + eps)`` with mean and (population) standard deviation over the
  spatial and input-channel axes ``(0, 1, 2)`` of an HWIO kernel (Qiao et al., 2019; BiT). The
  epsilon is added to the standard deviation, as in the official ``weight_standardize``.

  Args:
    kernel: ``(kh, kw, in, out)`` float array.
    eps: added to the standard deviation.

  Returns:
    The standardised kernel, same shape and dtype.
  """
  axes = (0, 1, 2)
  centered = kernel - jnp.mean(kernel, axis=axes)
  return centered / (jnp.std(centered, axis=axes) + eps)


class StdConv(nn.Module):
  """2-D convolution (NHWC, HWIO kernel, SAME padding, no bias) with weight standardisation.

  The stored ``kernel`` parameter is the raw one; it is standardised by
  :func:`standardize_weight` (in ``param_dtype``) on every call and then cast to ``dtype``.
  Kernel initialiser: lecun_normal (the flax ``nn.Conv`` default, as the official ``StdConv``).

  Attributes:
    features: output channels.
    kernel_size: ``(kh, kw)``.
    strides: ``(sh, sw)``.
    dtype: computation dtype; param_dtype: dtype of the stored kernel.

  Input ``[B, H, W, C]``; output ``[B, ceil(H/sh), ceil(W/sw), features]`` in ``dtype``.
  """

  features: int
  kernel_size: Tuple[int, int]
  strides: Tuple[int, int] = (1, 1)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: Array) -> Array:
    if x.ndim != 4:
      raise ValueError(f'StdConv expects [batch, height, width, channels], got shape {x.shape}')
    shape = (*self.kernel_size, x.shape[-1], self.features)
    kernel = self.param('kernel', nn.with_logical_partitioning(self.kernel_init, KERNEL_AXES),
                        shape, self.param_dtype)
    kernel = standardize_weight(kernel)
    x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    return jax.lax.conv_general_dilated(
        x, kernel, window_strides=tuple(self.strides), padding='SAME',
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def _group_norm(name: str, dtype: Dtype, param_dtype: Dtype, zero_scale: bool = False):
  return nn.GroupNorm(
      num_groups=GROUPNORM_GROUPS, epsilon=GROUPNORM_EPSILON, dtype=dtype,
      param_dtype=param_dtype,
      scale_init=nn.with_logical_partitioning(
          nn.initializers.zeros if zero_scale else nn.initializers.ones, ('norm',)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)), name=name)


class BottleneckUnit(nn.Module):
  """Post-activation bottleneck residual unit (official ``models_resnet.ResidualUnit``).

  Children ``conv1``, ``gn1``, ``conv2``, ``gn2``, ``conv3``, ``gn3`` (scale zero-init, so a
  freshly initialised unit is the identity on its residual branch) and, when the channel count
  or the spatial size changes, ``conv_proj``/``gn_proj`` on the residual path.

  Attributes:
    features: bottleneck width f; the output has ``4 f`` channels.
    strides: stride of ``conv2`` and ``conv_proj``.
    dtype: computation dtype; param_dtype: parameter dtype.

  Input ``[B, H, W, C]``; output ``[B, ceil(H/s), ceil(W/s), 4 f]`` in ``dtype``.
  """

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
    return _constrain(nn.relu(residual + y))


class ResNetStage(nn.Module):
  """``num_units`` bottleneck units ``unit1 .. unit{n}``; only the first one is strided.

  Attributes:
    num_units: number of units (>= 1).
    features: bottleneck width f of every unit (output ``4 f`` channels).
    first_stride: stride of ``unit1``.
    dtype: computation dtype; param_dtype: parameter dtype.
  """

  num_units: int
  features: int
  first_stride: Tuple[int, int] = (1, 1)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    for u in range(self.num_units):
      x = BottleneckUnit(features=self.features,
                         strides=tuple(self.first_stride) if u == 0 else (1, 1),
                         dtype=self.dtype, param_dtype=self.param_dtype, name=f'unit{u + 1}')(x)
    return x


def root_width(width_factor: float) -> int:
  """Channels of ``conv_root``: ``int(64 * width_factor)`` (official)."""
  return int(BASE_WIDTH * width_factor)


def resnet_stride(num_layers: Sequence[int]) -> int:
  """Total downsampling of the stem: 4 (root conv + max-pool) times 2 per stage after the first."""
  return 4 * 2 ** max(len(tuple(num_layers)) - 1, 0)


def resnet_out_channels(num_layers: Sequence[int], width_factor: float) -> int:
  """Channels of the stem output: ``width`` with no stages, else ``4 width 2^(S-1)``."""
  width = root_width(width_factor)
  stages = len(tuple(num_layers))
  return width if stages == 0 else 4 * width * 2 ** (stages - 1)


def resnet_stem(x: Array, *, num_layers: Sequence[int], width_factor: float = 1,
                dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32) -> Array:
  """Runs the hybrid ResNet root and stages; must be called inside a compact ``__call__``.

  The modules (``conv_root``, ``gn_root``, ``block1``, ...) are created in the scope of the
  calling module, so their parameters sit next to the caller's own (the official layout).

  Args:
    x: images ``[B, H, W, C]``.
    num_layers: units per stage, e.g. ``(3, 4, 9)``; ``()`` for the root only.
    width_factor: multiplies the base width 64.
    dtype: computation dtype; param_dtype: parameter dtype.

  Returns:
    ``[B, H/t, W/t, resnet_out_channels(...)]`` with ``t = resnet_stride(num_layers)`` (sides
    rounded up when not divisible), in ``dtype``.
  """
  width = root_width(width_factor)
  x = StdConv(features=width, kernel_size=(7, 7), strides=(2, 2), dtype=dtype,
              param_dtype=param_dtype, name='conv_root')(x)
  x = _group_norm('gn_root', dtype, param_dtype)(x)
  x = nn.relu(x)
  x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding='SAME')
  x = _constrain(x)
  for s, units in enumerate(tuple(num_layers)):
    x = ResNetStage(num_units=int(units), features=width * 2 ** s,
                    first_stride=(1, 1) if s == 0 else (2, 2), dtype=dtype,
                    param_dtype=param_dtype, name=f'block{s + 1}')(x)
  return x


def validate_resnet(num_layers: Optional[Sequence[int]], width_factor: Any) -> None:
  """Checks the stem configuration.

  Raises:
    ValueError: ``num_layers`` not a sequence of positive ints (``None`` = no stem is fine), or
      ``width_factor`` such that ``64 * width_factor`` is not a positive multiple of 32 (the
      GroupNorm group count).
  """
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
