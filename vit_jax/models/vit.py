"""Vision Transformer (ViT; Dosovitskiy et al., ICLR 2021, eq. 1-4) in Flax linen.

  z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos;  z'_l = MSA(LN(z_{l-1})) + z_{l-1};
  z_l = MLP(LN(z'_l)) + z'_l;  y = LN(z_L^0)

Numerics and parameter names are the official ``models_vit.py``'s, so its checkpoints load::

  embedding/{kernel (P, P, 3, D), bias}   cls (1, 1, D)   head/{kernel, bias}
  Transformer/posembed_input/pos_embedding (1, N + 1, D)   Transformer/encoder_norm
  Transformer/encoderblock_{i}/{LayerNorm_0, LayerNorm_1, MultiHeadDotProductAttention_0,
      MlpBlock_0/Dense_{0,1}}   pre_logits (with representation_size)

The variants' parameters (hybrid stem, 'map' head, timm's fields, ``scan=True``'s stacked
``encoderblock``), logical axes, intermediates and the fields' sources: docs/models.md.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import attention as attention_lib
from vit_jax.models import execution
from vit_jax.models import layout
from vit_jax.models import resample
from vit_jax.models import resnet
from vit_jax.models import vit_fields
# The fields' allowed values and their checks (re-exported: models.vit.*).
from vit_jax.models.vit_fields import (  # noqa: F401
    CLASSIFIERS, LAYERNORM_EPSILON, POSEMBS, patch_pair, posemb_prefix_rows, prefix_tokens,
    validate_config)

Array = jax.Array
Dtype = Any

MLP_HIDDEN_AXES = ('batch', 'length', 'mlp')

_partitioned = nn.with_logical_partitioning


def posemb_sincos_2d(height: int, width: int, features: int, temperature: float = 10_000.0,
                     dtype: Dtype = jnp.float32) -> Array:
  """big_vision's fixed 2-D sin-cos table (MoCo v3), ``[1, height * width, features]`` in ``dtype``.

  Token ``(y, x)`` of the row-major grid gets ``[sin(x w), cos(x w), sin(y w), cos(y w)]``,
  ``w_i = temperature ** -(i / (F - 1))``, ``F = features / 4``; float32, then cast. ValueError:
  ``features`` not a multiple of 4 or under 8.
  """
  if features % 4 or features // 4 < 2:
    raise ValueError(f'The sincos2d position table needs a width that is a multiple of 4 and at '
                     f'least 8, got {features}.')
  y, x = jnp.mgrid[:height, :width]
  quarter = features // 4
  omega = jnp.arange(quarter, dtype=jnp.float32) / (quarter - 1)
  omega = 1.0 / (temperature ** omega)
  # big_vision's einsum 'm,d->md' as broadcasts: no dot_general for vit_jax.flops to count.
  y = y.reshape(-1, 1).astype(jnp.float32) * omega
  x = x.reshape(-1, 1).astype(jnp.float32) * omega
  table = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)
  return table.astype(dtype)[None]


def token_stride(model: 'VisionTransformer', height: int, width: int) -> Tuple[int, int]:
  """The pixels ``(sy, sx)`` between ``model``'s token centres on ``height x width`` images, the
  patch size times a hybrid's stem stride; ImageSizeError (what fits) unless they divide the sides.
  """
  hybrid = model.resnet_num_layers is not None
  stem = resnet.resnet_stride(model.resnet_num_layers) if hybrid else 1
  patches = patch_pair(model.patch_size)
  for side, size, patch in zip(('height', 'width'), (height, width), patches):
    stride = stem * patch
    if size % stride:
      lower = size // stride * stride
      if hybrid:
        what = (f'the total stride {stride} (ResNet stem stride {stem} x patch size {patch}; '
                f'resnet_num_layers={tuple(model.resnet_num_layers)!r}, '
                f'patch_size={model.patch_size!r}, image {height}x{width})')
        fix = 'or change patch_size / the number of ResNet stages.'
      else:
        what = f'the patch size {patch} (patch_size={model.patch_size!r}, image {height}x{width})'
        fix = f'or choose a patch size that divides {size}.'
      raise execution.ImageSizeError(
          f'Image {side} {size} is not divisible by {what}. Resize or crop the images to a '
          f'multiple of {stride} (e.g. {lower or stride} or {lower + stride}), {fix}')
  return stem * patches[0], stem * patches[1]


class IdentityLayer(nn.Module):
  """The identity: a ``pre_logits`` entry for ``capture_intermediates``, as the official model."""

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return x


class AddPositionEmbs(nn.Module):
  """Adds the learned ``pos_embedding`` ``(1, N, D)`` to ``[B, N, D]`` (eq. 1), in its dtype.

  ``grid=(gh, gw)``: the input's last ``gh * gw`` tokens, row-major (the ones before, class token
  and registers, keep their rows); a table made for another grid is resampled to it in the model
  by ``resize`` (:data:`vit_jax.models.resample.RESIZE_METHODS`; timm's ``dynamic_img_size``).
  The table's grid: ``table_grid``; else the input's when the row counts match, else square. A
  new table is made for ``table_grid`` (None: the input's grid). ValueError: a loaded table of
  another width or of a grid it cannot tell (with the fix)."""

  posemb_init: nn.initializers.Initializer = nn.initializers.normal(stddev=0.02)
  param_dtype: Dtype = jnp.float32
  resize: str = 'linear_corners'
  table_grid: Optional[Tuple[int, int]] = None

  @nn.compact
  def __call__(self, inputs: Array, grid: Tuple[int, int]) -> Array:
    tokens, width = inputs.shape[1:]
    gh, gw = (int(g) for g in grid)
    prefix = tokens - gh * gw
    if prefix < 0:
      raise ValueError(f'AddPositionEmbs: a {gh}x{gw} grid does not fit in {tokens} tokens.')
    table_grid = tuple(int(g) for g in self.table_grid) if self.table_grid else (gh, gw)
    shape = (1, prefix + table_grid[0] * table_grid[1], width)
    if self.has_variable('params', 'pos_embedding'):
      # Boxed (nn.LogicallyPartitioned) or plain, as given to apply.
      existing = tuple(layout.unbox(self.get_variable('params', 'pos_embedding')).shape)
      if existing[2] != width:
        raise ValueError(
            f'pos_embedding has shape {existing} but the input gives {shape} (tokens, width). '
            f'The parameters were made for another image size / patch size: apply the model '
            f'at the resolution the parameters were trained at, or resize the position '
            f'embedding when loading for fine-tuning.')
      if existing[1] != shape[1]:
        rows = existing[1] - prefix
        side = resample.square_side(rows)
        if self.table_grid or side is None:
          what = (f'posemb_grid={tuple(self.table_grid)}' if self.table_grid else
                  f'the {gh}x{gw} grid of the input, nor a square')
          raise ValueError(
              f'pos_embedding has shape {existing}: its {rows} grid rows (after {prefix} '
              f'class-token / register rows) are not {what}. Build the model with '
              f'posemb_grid=(rows, columns), the token grid the table was made for.')
        table_grid = (side, side)
        shape = existing
    pos_embedding = self.param('pos_embedding',
                               _partitioned(self.posemb_init, (None, 'length', 'embed')),
                               shape, self.param_dtype)
    if table_grid != (gh, gw):
      pos_embedding = resample.resample_posemb(pos_embedding, (gh, gw), num_prefix_tokens=prefix,
                                               old_grid=table_grid, method=self.resize)
    return inputs + pos_embedding.astype(inputs.dtype)


class MlpBlock(nn.Module):
  """The official ``MlpBlock`` (eq. 3): Dense(mlp_dim), GELU (``gelu_approximate``: tanh, else
  erf as timm), Dropout, Dense(out_dim or D), Dropout; in ``dtype``."""

  mlp_dim: int
  out_dim: Optional[int] = None
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  gelu_approximate: bool = True

  @nn.compact
  def __call__(self, inputs: Array, *, deterministic: bool) -> Array:
    out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
    dense = lambda features, axes: nn.Dense(  # pylint: disable=g-long-lambda
        features=features, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=_partitioned(nn.initializers.xavier_uniform(), axes),
        bias_init=_partitioned(nn.initializers.normal(stddev=1e-6), axes[1:]))
    x = dense(self.mlp_dim, ('embed', 'mlp'))(inputs)
    x = execution.constrain(x, MLP_HIDDEN_AXES)
    x = nn.gelu(x, approximate=bool(self.gelu_approximate))
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
    x = dense(out_dim, ('mlp', 'embed'))(x)
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
    return x


class LayerScale(nn.Module):
  """LayerScale (CaiT, Touvron et al. 2021; timm's ``ls1``/``ls2``): ``x [..., D]`` times a
  learned per-channel ``scale`` ``(D,)`` initialised to ``init_value``, in ``x``'s dtype."""

  init_value: float
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param('scale', _partitioned(nn.initializers.constant(self.init_value),
                                             ('norm',)), (x.shape[-1],), self.param_dtype)
    return x * scale.astype(x.dtype)


class EncoderBlock(nn.Module):
  """The official pre-LN ``Encoder1DBlock`` (eq. 2-3) of the fields ``config``
  (:class:`vit_fields.Config`), ``[B, N, D]`` in its ``dtype``; called as
  :func:`execution.blocks` calls it; sows ``tokens``."""

  config: Any
  scanned: bool = False

  @nn.compact
  def __call__(self, inputs: Array, deterministic: bool):
    c = self.config
    inputs = execution.constrain(inputs, execution.TOKENS_AXES)
    x = execution.layer_norm(c.dtype, c.param_dtype, c.layer_norm_epsilon)(inputs)
    attention_cls = attention_lib.MultiHeadDotProductAttention
    x = attention_cls(name='MultiHeadDotProductAttention_0', **execution.shared_fields(
        c, attention_cls, dropout_rate=c.attention_dropout_rate))(x, deterministic=deterministic)
    x = nn.Dropout(rate=c.dropout_rate)(x, deterministic=deterministic)
    if c.layerscale_init is not None:
      x = LayerScale(c.layerscale_init, c.param_dtype)(x)
    x = execution.constrain(x + inputs, execution.TOKENS_AXES)
    y = execution.layer_norm(c.dtype, c.param_dtype, c.layer_norm_epsilon)(x)
    y = MlpBlock(**execution.shared_fields(c, MlpBlock))(y, deterministic=deterministic)
    if c.layerscale_init is not None:
      y = LayerScale(c.layerscale_init, c.param_dtype)(y)
    out = execution.constrain(x + y, execution.TOKENS_AXES)
    self.sow(attention_lib.INTERMEDIATES, attention_lib.TOKENS, out)  # A no-op unless mutable.
    return (out, None) if self.scanned else out


class Encoder(nn.Module):
  """The official ``Encoder`` (``Transformer``) of the fields ``config``
  (:class:`vit_fields.Config`), ``[B, N, D]`` -> ``[B, N, D]`` in its ``dtype``:
  ``posembed_input`` ('learn' only; resampled to ``patch_grid`` ``(gh, gw)``:
  :class:`AddPositionEmbs`), dropout, the blocks, ``encoder_norm`` (none with ``fc_norm``)."""

  config: Any

  @nn.compact
  def __call__(self, x: Array, *, train: bool, patch_grid: Tuple[int, int]) -> Array:
    c = self.config
    deterministic = not train
    embed = lambda tokens: AddPositionEmbs(  # pylint: disable=g-long-lambda
        param_dtype=c.param_dtype, resize=c.posemb_resize, table_grid=c.posemb_grid,
        name='posembed_input')(tokens, patch_grid)
    skip = prefix_tokens(c)
    if c.posemb == 'learn' and c.no_embed_class and skip:
      # timm adds the table, then prepends: the same sums.
      x = jnp.concatenate([x[:, :skip], embed(x[:, skip:])], axis=1)
    elif c.posemb == 'learn':
      x = embed(x)
    x = nn.Dropout(rate=c.dropout_rate)(x, deterministic=deterministic)
    x = execution.constrain(x, execution.TOKENS_AXES)

    x = execution.blocks(EncoderBlock, x, deterministic, depth=c.num_layers, name='encoderblock',
                         remat=c.remat, remat_policy=c.remat_policy, scan=c.scan, config=c)
    if c.fc_norm:  # timm's fc_norm: the LayerNorm comes after the pooling.
      return x
    return execution.layer_norm(c.dtype, c.param_dtype, c.layer_norm_epsilon, 'encoder_norm')(x)


class MAPHead(nn.Module):
  """big_vision's ``MAPHead`` (``classifier='map'``): a learned ``probe`` attends to the tokens,
  then ``x + MlpBlock(LayerNorm(x))``, no dropout; ``[B, N, D]`` -> ``[B, D]`` in ``dtype``."""

  num_heads: int
  mlp_dim: int
  gelu_approximate: bool = True
  layer_norm_epsilon: float = LAYERNORM_EPSILON
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    n, _, d = x.shape
    probe = self.param('probe', _partitioned(nn.initializers.xavier_uniform(),
                                             (None, None, 'embed')), (1, 1, d), self.param_dtype)
    probe = jnp.broadcast_to(probe.astype(self.dtype), (n, 1, d))
    x = attention_lib.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype, param_dtype=self.param_dtype,
        attention='xla', name='MultiHeadDotProductAttention_0',
    )(probe, inputs_kv=x, deterministic=True)
    y = execution.layer_norm(self.dtype, self.param_dtype, self.layer_norm_epsilon)(x)
    x = x + MlpBlock(**execution.shared_fields(self, MlpBlock))(y, deterministic=True)
    return x[:, 0]


class VisionTransformer(nn.Module):
  """The ViT classifier (official ``models_vit.VisionTransformer``; sizes: ViT paper Table 1).

  The fields: :data:`vit_fields.VIT_FIELDS` (each one's help) and docs/models.md (sources).
  ``apply(variables, images [B, H, W, C] float32, train=...)`` (the published weights: C=3,
  pixels scaled to [-1, 1]) returns float32 ``[B, num_classes]`` logits (``[B, R or D]``
  features with ``num_classes=None``); H and W multiples of the patch size (of the ResNet
  stride x patch for hybrids), any other than the table's (resampled in the model); ``train``
  with dropout needs ``rngs={'dropout': key}``.

  Raises:
    ValueError: a bad field (:func:`validate_config`) at construction; at apply a non-NHWC
      input or a loaded ``pos_embedding`` of another width or of a grid it cannot tell.
    ImageSizeError: an image side the patch size (total stride) does not divide.
  """

  num_classes: Optional[int]
  patch_size: Union[int, Tuple[int, int]]
  hidden_size: int
  mlp_dim: int
  num_heads: int
  num_layers: int
  classifier: str = 'token'
  representation_size: Optional[int] = None
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  head_bias_init: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  scan: bool = False
  remat: bool = False
  remat_policy: str = 'nothing_saveable'
  resnet_num_layers: Optional[Tuple[int, ...]] = None
  resnet_width_factor: float = 1
  attention: str = 'xla'
  gelu_approximate: bool = True
  layer_norm_epsilon: float = LAYERNORM_EPSILON
  posemb: str = 'learn'
  layerscale_init: Optional[float] = None
  num_registers: int = 0
  no_embed_class: bool = False
  fc_norm: bool = False
  qk_norm: bool = False
  posemb_resize: str = 'linear_corners'
  posemb_grid: Optional[Tuple[int, int]] = None

  def __post_init__(self):
    validate_config(**execution.fields_of(self))
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs: Array, *, train: bool) -> Array:
    dtype, param_dtype = execution.check_images(self, inputs)
    token_stride(self, inputs.shape[1], inputs.shape[2])
    ph, pw = patch_pair(self.patch_size)
    x = inputs
    if self.resnet_num_layers is not None:
      x = resnet.resnet_stem(x, num_layers=self.resnet_num_layers,
                             width_factor=self.resnet_width_factor, dtype=dtype,
                             param_dtype=param_dtype)

    x = nn.Conv(features=self.hidden_size, kernel_size=(ph, pw), strides=(ph, pw),
                padding='VALID', dtype=dtype, param_dtype=param_dtype,
                kernel_init=_partitioned(nn.linear.default_kernel_init,
                                         (None, None, None, 'embed')),
                bias_init=_partitioned(nn.initializers.zeros, ('embed',)), name='embedding')(x)
    n, gh, gw, c = x.shape
    x = jnp.reshape(x, (n, gh * gw, c))  # Row-major: token index = row * gw + col.
    if self.posemb == 'sincos2d':  # big_vision: before the class token, which gets none.
      x = x + posemb_sincos_2d(gh, gw, c, dtype=x.dtype)
    x = execution.constrain(x, execution.TOKENS_AXES)

    prefix = []  # timm's order: the class token, the registers, the patches.
    if self.classifier == 'token':
      prefix.append(self.param('cls', _partitioned(nn.initializers.zeros, (None, None, 'embed')),
                               (1, 1, c), param_dtype))
    if self.num_registers:  # timm's (and DINOv2's) initialisation.
      prefix.append(self.param('registers', _partitioned(nn.initializers.normal(stddev=1e-6),
                                                         (None, None, 'embed')),
                               (1, self.num_registers, c), param_dtype))
    if prefix:
      prefix = [jnp.broadcast_to(p.astype(x.dtype), (n,) + p.shape[1:]) for p in prefix]
      x = jnp.concatenate(prefix + [x], axis=1)
    num_prefix = prefix_tokens(self)

    config = vit_fields.Config(**execution.shared_fields(self, vit_fields.Config, dtype=dtype,
                                                         param_dtype=param_dtype))
    x = Encoder(config, name='Transformer')(x, train=train, patch_grid=(gh, gw))

    if self.classifier == 'token':
      x = x[:, 0]
    elif self.classifier == 'gap':  # timm's 'avg': the registers are not averaged.
      x = jnp.mean(x[:, num_prefix:], axis=1)
      if self.fc_norm:
        x = execution.layer_norm(dtype, param_dtype, self.layer_norm_epsilon, 'fc_norm')(x)
    else:  # 'map'
      x = MAPHead(name='MAPHead_0', **execution.shared_fields(config, MAPHead))(x[:, num_prefix:])

    if self.representation_size is not None:
      x = nn.Dense(self.representation_size, dtype=dtype, param_dtype=param_dtype,
                   kernel_init=_partitioned(nn.linear.default_kernel_init, ('embed', None)),
                   bias_init=_partitioned(nn.initializers.zeros, (None,)),
                   name='pre_logits')(x)
      x = jnp.tanh(x)
    else:
      x = IdentityLayer(name='pre_logits')(x)

    if self.num_classes is not None:
      x = nn.Dense(self.num_classes, dtype=dtype, param_dtype=param_dtype,
                   kernel_init=_partitioned(nn.initializers.zeros, ('embed', 'classes')),
                   bias_init=_partitioned(nn.initializers.constant(self.head_bias_init),
                                          ('classes',)), name='head')(x)
    return x.astype(jnp.float32)
