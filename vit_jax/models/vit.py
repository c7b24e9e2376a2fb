"""Vision Transformer (ViT; Dosovitskiy et al., ICLR 2021, eq. 1-4) in Flax linen.

  z_0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos     (eq. 1)
  z'_l = MSA(LN(z_{l-1})) + z_{l-1}                  (eq. 2)
  z_l  = MLP(LN(z'_l)) + z'_l                         (eq. 3)
  y    = LN(z_L^0)                                    (eq. 4)

Numerics and parameter names are the official implementation's (google-research/
vision_transformer ``models_vit.py``), so its checkpoints load without renaming. With
``classifier='token'`` and ``representation_size=R``::

  embedding/{kernel (P, P, 3, D), bias (D,)}          cls (1, 1, D)
  Transformer/posembed_input/pos_embedding (1, N + 1, D)
  Transformer/encoderblock_{i}/LayerNorm_{0,1}/{scale, bias} (D,)
  Transformer/encoderblock_{i}/MultiHeadDotProductAttention_0/
      {query,key,value}/kernel (D, heads, D/heads), {query,key,value}/bias (heads, D/heads),
      out/kernel (heads, D/heads, D), out/bias (D,)
  Transformer/encoderblock_{i}/MlpBlock_0/Dense_0/{kernel (D, MLP), bias (MLP,)}
  Transformer/encoderblock_{i}/MlpBlock_0/Dense_1/{kernel (MLP, D), bias (D,)}
  Transformer/encoder_norm/{scale, bias} (D,)
  pre_logits/{kernel (D, R), bias (R,)}                (only with representation_size)
  head/{kernel (R or D, num_classes), bias (num_classes,)}

``classifier='gap'``/``'map'``: no ``cls``, a ``(1, N, D)`` table; 'map' adds big_vision's
``MAPHead_0/{probe (1, 1, D), MultiHeadDotProductAttention_0, LayerNorm_0, MlpBlock_0}``.
``posemb='sincos2d'``: no ``posembed_input``; the fixed table (:func:`posemb_sincos_2d`) is added
to the patch tokens only. Hybrids (``resnet_num_layers``): the BiT stem of
:mod:`vit_jax.models.resnet` (``conv_root``, ``gn_root``, ``block{s}/unit{u}``) feeds
``embedding/kernel (P, P, C_resnet, D)``. ``scan=True``: one ``encoderblock`` with a leading
``num_layers`` axis (:func:`vit_jax.models.layout.scan_params` / ``unscan_params`` convert).

Parameters are ``nn.LogicallyPartitioned`` boxes (names in
:data:`vit_jax.models.layout.LOGICAL_AXIS_NAMES`; :func:`vit_jax.models.unbox`,
:func:`vit_jax.models.logical_axes`); ``apply`` takes boxed or plain variables::

  embedding/kernel (None, None, None, 'embed')    cls, probe (None, None, 'embed')
  pos_embedding (None, 'length', 'embed')         LayerNorm scale, bias ('norm',)
  {query,key,value}/kernel ('embed', 'heads', 'kv'), bias ('heads', 'kv')
  out/kernel ('heads', 'kv', 'embed')             Dense_0 ('embed', 'mlp'); Dense_1 ('mlp', 'embed')
  pre_logits ('embed', None)                      head ('embed', 'classes')
  ResNet conv kernels (None, None, 'conv_in', 'conv_out'); 'layers' first with scan=True

Activations are constrained to ``('batch', 'length', 'embed')`` (tokens), ``('batch',
'length', 'mlp')`` and ``('batch', None, None, 'conv_out')`` (no-ops without a mesh).

With ``mutable=['intermediates']`` the model also returns each block's float32 attention
weights ``[B, heads, N, N]`` (``.../MultiHeadDotProductAttention_0/attention_weights``, computed
on the 'xla' path whatever ``attention`` is), its output ``tokens`` ``[B, N, D]``, and the 'map'
head's ``[B, heads, 1, N]``; tokens are the class token (if 'token') then the patches row-major.
:mod:`vit_jax.models.intermediates` reads them back in depth order.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import attention as attention_lib
from vit_jax.models import execution
from vit_jax.models import layout
from vit_jax.models import resnet
# The fields' allowed values and their checks (re-exported: models.vit.*).
from vit_jax.models.vit_fields import (  # noqa: F401
    CLASSIFIERS, LAYERNORM_EPSILON, POSEMBS, patch_pair, validate_config)

Array = jax.Array
Dtype = Any

#: Logical axes of the token sequence (as in `execution`) and of the MLP hidden activations.
TOKENS_AXES = execution.TOKENS_AXES
MLP_HIDDEN_AXES = ('batch', 'length', 'mlp')

_partitioned = nn.with_logical_partitioning


def _layer_norm(dtype: Dtype, param_dtype: Dtype, name: Optional[str] = None,
                epsilon: float = LAYERNORM_EPSILON) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                      scale_init=_partitioned(nn.initializers.ones, ('norm',)),
                      bias_init=_partitioned(nn.initializers.zeros, ('norm',)), name=name)


def posemb_sincos_2d(height: int, width: int, features: int, temperature: float = 10_000.0,
                     dtype: Dtype = jnp.float32) -> Array:
  """big_vision's fixed 2-D sin-cos position table (MoCo v3, Chen et al. 2021), ``'sincos2d'``.

  For the ``height x width`` token grid flattened row-major (token ``r * width + c`` at
  ``y = r``, ``x = c``), with ``F = features / 4`` and
  ``omega_i = 1 / temperature ** (i / (F - 1))`` for ``i = 0 .. F-1``, token ``(y, x)`` gets
  ``[sin(x omega), cos(x omega), sin(y omega), cos(y omega)]``. Computed in float32 as big_vision
  does, then cast.

  Args:
    height, width: the token grid (rows, columns).
    features: the token width D; a multiple of 4, at least 8.
    temperature: the base of the frequencies (10000 in big_vision).
    dtype: the dtype of the result.

  Returns:
    ``[1, height * width, features]`` in ``dtype``.

  Raises:
    ValueError: ``features`` not a multiple of 4 or under 8.
  """
  if features % 4 or features // 4 < 2:
    raise ValueError(f'The sincos2d position table needs a width that is a multiple of 4 and at '
                     f'least 8, got {features}.')
  y, x = jnp.mgrid[:height, :width]
  quarter = features // 4
  omega = jnp.arange(quarter, dtype=jnp.float32) / (quarter - 1)
  omega = 1.0 / (temperature ** omega)
  # Outer products (big_vision's einsum 'm,d->md'), written as broadcasts: one float32 multiply
  # per entry either way, and no dot_general for the FLOP counter (vit_jax.flops) to count.
  y = y.reshape(-1, 1).astype(jnp.float32) * omega
  x = x.reshape(-1, 1).astype(jnp.float32) * omega
  table = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)
  return table.astype(dtype)[None]


class IdentityLayer(nn.Module):
  """Returns its input unchanged (float array of any shape, same dtype).

  Exists only so that ``capture_intermediates`` records a ``pre_logits`` entry when there is no
  representation layer, as in the official ``models_vit.py``. Has no parameters; raises nothing.
  """

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return x


class AddPositionEmbs(nn.Module):
  """Adds a learned position embedding ``pos_embedding`` of shape ``(1, N, D)`` (ViT eq. 1).

  Attributes:
    posemb_init: initialiser of the embedding; officially ``normal(stddev=0.02)``.
    param_dtype: dtype of the stored parameter (float32).

  Input ``[B, N, D]`` in any float dtype; output ``[B, N, D]`` in the input's dtype (the embedding
  is cast to it). Raises ValueError if the input is not rank 3, or if an existing (loaded)
  ``pos_embedding`` has a different token count or width than the input, with a hint on how to
  resize it.
  """

  posemb_init: nn.initializers.Initializer = nn.initializers.normal(stddev=0.02)
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    if inputs.ndim != 3:
      raise ValueError(f'AddPositionEmbs expects [batch, tokens, width], got shape {inputs.shape}')
    shape = (1, inputs.shape[1], inputs.shape[2])
    if self.has_variable('params', 'pos_embedding'):
      # Boxed (nn.LogicallyPartitioned) or plain, as given to apply.
      existing = layout.unbox(self.get_variable('params', 'pos_embedding'))
      if tuple(existing.shape) != shape:
        raise ValueError(
            f'pos_embedding has shape {tuple(existing.shape)} but the input gives {shape} '
            f'(tokens, width). The parameters were made for another image size / patch size: '
            f'apply the model at the resolution the parameters were trained at, or resize the '
            f'position embedding when loading for fine-tuning.')
    pos_embedding = self.param('pos_embedding',
                               _partitioned(self.posemb_init, (None, 'length', 'embed')),
                               shape, self.param_dtype)
    return inputs + pos_embedding.astype(inputs.dtype)


class MlpBlock(nn.Module):
  """Transformer MLP: Dense(mlp_dim) -> GELU -> Dropout -> Dense(out) -> Dropout.

  Kernels xavier_uniform, biases normal(stddev=1e-6), as the official ``models_vit.MlpBlock``
  (the MLP of ViT eq. 3). Raises nothing itself.

  Attributes:
    mlp_dim: hidden width.
    out_dim: output width; ``None`` means the input width.
    dropout_rate: dropout probability after the activation and after the output projection.
    dtype: computation dtype; param_dtype: parameter dtype.
    gelu_approximate: True (default) for the tanh approximation of GELU (the official ViT,
      big_vision, flax's ``nn.gelu``); False for the exact erf GELU (timm, transformers).

  Input ``[..., D]``, output ``[..., out_dim or D]`` in ``dtype``. Needs the ``'dropout'`` rng
  when ``deterministic=False`` and ``dropout_rate > 0``. Kernels ``('embed', 'mlp')`` /
  ``('mlp', 'embed')``; a rank-3 hidden activation is constrained to ``('batch', 'length',
  'mlp')``.
  """

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
        features=features,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=_partitioned(nn.initializers.xavier_uniform(), axes),
        bias_init=_partitioned(nn.initializers.normal(stddev=1e-6), axes[1:]))
    x = dense(self.mlp_dim, ('embed', 'mlp'))(inputs)
    x = execution.constrain(x, MLP_HIDDEN_AXES)
    x = nn.gelu(x, approximate=bool(self.gelu_approximate))
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
    x = dense(out_dim, ('mlp', 'embed'))(x)
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
    return x


class EncoderBlock(nn.Module):
  """Pre-LN Transformer encoder block (ViT eq. 2-3).

  ``x = x + Dropout(MHA(LN_0(x)))``; ``x = x + MLP(LN_1(x))``. Attention kernels xavier_uniform,
  attention dropout not broadcast over heads, LayerNorm eps 1e-6 and tanh GELU by default: as the
  official ``Encoder1DBlock``.

  Attributes:
    mlp_dim, num_heads: MLP width and number of attention heads.
    dropout_rate: dropout after attention and inside the MLP.
    attention_dropout_rate: dropout on the attention weights.
    dtype: computation dtype; param_dtype: parameter dtype.
    scanned: if True, ``__call__`` returns ``(x, None)`` (the carry/output pair ``nn.scan`` needs).
    attention: the attention implementation (:data:`vit_jax.models.attention.IMPLEMENTATIONS`).
    gelu_approximate: the MLP's GELU (:class:`MlpBlock`).
    layer_norm_epsilon: the epsilon of both LayerNorms.

  Input ``[B, N, D]``, output ``[B, N, D]`` in ``dtype``. ``deterministic`` (a Python bool,
  positional so that ``nn.remat`` can make it static) disables dropout. With ``'intermediates'``
  mutable it sows its output as ``tokens`` and its attention's weights as
  ``MultiHeadDotProductAttention_0/attention_weights`` (:mod:`vit_jax.models.intermediates`).
  """

  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  scanned: bool = False
  attention: str = 'xla'
  gelu_approximate: bool = True
  layer_norm_epsilon: float = LAYERNORM_EPSILON

  @nn.compact
  def __call__(self, inputs: Array, deterministic: bool):
    if inputs.ndim != 3:
      raise ValueError(f'EncoderBlock expects [batch, tokens, width], got shape {inputs.shape}')
    inputs = execution.constrain(inputs, TOKENS_AXES)
    x = _layer_norm(self.dtype, self.param_dtype, epsilon=self.layer_norm_epsilon)(inputs)
    x = attention_lib.MultiHeadDotProductAttention(
        num_heads=self.num_heads,
        dropout_rate=self.attention_dropout_rate,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        attention=self.attention,
        name='MultiHeadDotProductAttention_0',
    )(x, deterministic=deterministic)
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
    x = execution.constrain(x + inputs, TOKENS_AXES)
    y = _layer_norm(self.dtype, self.param_dtype, epsilon=self.layer_norm_epsilon)(x)
    y = MlpBlock(mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate, dtype=self.dtype,
                 param_dtype=self.param_dtype,
                 gelu_approximate=self.gelu_approximate)(y, deterministic=deterministic)
    out = execution.constrain(x + y, TOKENS_AXES)
    self.sow(attention_lib.INTERMEDIATES, attention_lib.TOKENS, out)  # A no-op unless mutable.
    return (out, None) if self.scanned else out


class Encoder(nn.Module):
  """Position embedding, dropout, ``num_layers`` encoder blocks and the final LayerNorm (eq. 1-4).

  Mirrors the official ``models_vit.Encoder``.

  Named ``Transformer`` inside :class:`VisionTransformer`; children ``posembed_input`` (only with
  ``posemb='learn'``; with 'sincos2d' the model adds the fixed table before the class token),
  ``encoderblock_{i}`` (or one stacked ``encoderblock`` with ``scan=True``) and ``encoder_norm``.

  Attributes:
    num_layers, mlp_dim, num_heads, dropout_rate, attention_dropout_rate: see
      :class:`VisionTransformer`.
    dtype: computation dtype; param_dtype: parameter dtype.
    scan: run the blocks with ``nn.scan`` (one compiled block body, stacked parameters).
    remat: rematerialise each block in the backward pass (``nn.remat``).
    remat_policy: what a rematerialised block keeps, one of
      :data:`vit_jax.models.execution.REMAT_POLICIES`.
    attention: the attention implementation (:data:`vit_jax.models.attention.IMPLEMENTATIONS`).
    gelu_approximate, layer_norm_epsilon: the blocks' GELU and every LayerNorm's epsilon.
    posemb: 'learn' adds the learned ``posembed_input``; 'sincos2d' adds nothing here.

  Input ``[B, N, D]`` (any float dtype), output ``[B, N, D]`` in ``dtype``. With ``train=True``
  and a dropout rate > 0 the ``'dropout'`` rng is required. Raises ValueError for a non-rank-3
  input or a loaded ``pos_embedding`` of the wrong shape.
  """

  num_layers: int
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  scan: bool = False
  remat: bool = False
  remat_policy: str = 'nothing_saveable'
  attention: str = 'xla'
  gelu_approximate: bool = True
  layer_norm_epsilon: float = LAYERNORM_EPSILON
  posemb: str = 'learn'

  @nn.compact
  def __call__(self, x: Array, *, train: bool) -> Array:
    deterministic = not train
    if self.posemb == 'learn':
      x = AddPositionEmbs(param_dtype=self.param_dtype, name='posembed_input')(x)
    x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
    x = execution.constrain(x, TOKENS_AXES)

    block_cls = (execution.rematerialised(EncoderBlock, self.remat_policy, scan=self.scan)
                 if self.remat else EncoderBlock)
    block_kwargs = dict(
        mlp_dim=self.mlp_dim,
        num_heads=self.num_heads,
        dropout_rate=self.dropout_rate,
        attention_dropout_rate=self.attention_dropout_rate,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        attention=self.attention,
        gelu_approximate=self.gelu_approximate,
        layer_norm_epsilon=self.layer_norm_epsilon,
    )
    if self.scan:
      stack = execution.scanned(block_cls, self.num_layers, in_axes=nn.broadcast)
      x, _ = stack(scanned=True, name='encoderblock', **block_kwargs)(x, deterministic)
    else:
      for i in range(self.num_layers):
        x = block_cls(name=f'encoderblock_{i}', **block_kwargs)(x, deterministic)
    return _layer_norm(self.dtype, self.param_dtype, name='encoder_norm',
                       epsilon=self.layer_norm_epsilon)(x)


class MAPHead(nn.Module):
  """Multihead attention pooling, big_vision's ``MAPHead`` (``classifier='map'``).

  A learned probe ``[1, 1, D]`` (xavier_uniform), tiled over the batch, is the single query of a
  multi-head attention over the encoder's output tokens (keys and values; flax's
  ``MultiHeadDotProductAttention`` math: ``q / sqrt(D/heads)``, float32 softmax, no dropout);
  then ``x = x + MlpBlock(LayerNorm(x))`` (no dropout, as big_vision) and the one token is
  returned. Parameters ``probe``, ``MultiHeadDotProductAttention_0/{query,key,value,out}``,
  ``LayerNorm_0``, ``MlpBlock_0/Dense_{0,1}``: big_vision's names and shapes.

  Attributes:
    num_heads: attention heads (the model's); mlp_dim: the MLP's hidden width (the model's).
    gelu_approximate, layer_norm_epsilon: as the encoder's.
    dtype: computation dtype; param_dtype: parameter dtype.

  Input ``[B, N, D]`` (after the encoder's final LayerNorm), output ``[B, D]`` in ``dtype``.
  Raises ValueError for an input that is not rank 3, or ``num_heads`` not dividing D.
  """

  num_heads: int
  mlp_dim: int
  gelu_approximate: bool = True
  layer_norm_epsilon: float = LAYERNORM_EPSILON
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    if x.ndim != 3:
      raise ValueError(f'MAPHead expects [batch, tokens, width], got shape {x.shape}')
    n, _, d = x.shape
    probe = self.param('probe', _partitioned(nn.initializers.xavier_uniform(),
                                             (None, None, 'embed')), (1, 1, d), self.param_dtype)
    probe = jnp.broadcast_to(probe.astype(self.dtype), (n, 1, d))
    x = attention_lib.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype, param_dtype=self.param_dtype,
        attention='xla', name='MultiHeadDotProductAttention_0',
    )(probe, inputs_kv=x, deterministic=True)
    y = _layer_norm(self.dtype, self.param_dtype, epsilon=self.layer_norm_epsilon)(x)
    x = x + MlpBlock(mlp_dim=self.mlp_dim, dtype=self.dtype, param_dtype=self.param_dtype,
                     gelu_approximate=self.gelu_approximate)(y, deterministic=True)
    return x[:, 0]


class VisionTransformer(nn.Module):
  """Vision Transformer classifier (ViT paper eq. 1-4, official ``models_vit.VisionTransformer``).

  The image is cut into ``Ph x Pw`` patches by a stride-P convolution ``embedding``, the grid is
  flattened row-major into ``N = (H/Ph)(W/Pw)`` tokens, a zero-initialised class token ``cls`` is
  prepended (``classifier='token'``), a learned position embedding is added (``posemb='learn'``;
  with ``'sincos2d'`` a fixed table is added to the patch tokens before the class token is
  prepended), the tokens go through the pre-LN encoder, and the class token (``'token'``), the
  mean of all tokens after the final LayerNorm (``'gap'``, no class token) or their multihead
  attention pooling (``'map'``, :class:`MAPHead`, no class token) is pooled, optionally passed
  through ``pre_logits`` = Dense(representation_size) + tanh, and classified by a
  zero-initialised ``head`` whose bias starts at ``head_bias_init``.

  Attributes:
    num_classes: classes of the ``head``; ``None`` returns the pooled features (no head).
    patch_size: int or ``(Ph, Pw)``.
    hidden_size: token width D.
    mlp_dim: MLP hidden width.
    num_heads: attention heads (must divide ``hidden_size``).
    num_layers: encoder blocks.
    classifier: ``'token'``, ``'gap'`` or ``'map'`` (:data:`CLASSIFIERS`; 'map' is big_vision's
      ``MAPHead`` pooling, with the model's ``num_heads`` and ``mlp_dim``).
    representation_size: width of the ``pre_logits`` layer, or ``None`` for none.
    dropout_rate: dropout after the position embedding, after attention and in the MLPs.
    attention_dropout_rate: dropout on attention weights.
    head_bias_init: initial value of the head bias (official pretraining: -10 with sigmoid loss).
    dtype: computation dtype (e.g. ``jnp.bfloat16``); activations are kept in this dtype.
    param_dtype: parameter dtype (float32).
    scan: run the blocks with ``nn.scan`` (parameters stacked under ``Transformer/encoderblock``).
    remat: rematerialise every block in the backward pass. On XLA:CPU the memory saving was
      measured only with ``scan=True`` (unrolled, the temporaries stayed the same size).
    remat_policy: what a rematerialised block keeps for the backward pass, a name in
      :data:`vit_jax.models.execution.REMAT_POLICIES` (``jax.checkpoint_policies``); default
      'nothing_saveable'.
    resnet_num_layers: ``None`` for a plain ViT; for a hybrid (R+ViT), the number of bottleneck
      units of each ResNet stage, e.g. ``(3, 4, 9)`` for R50+ViT-B/16, ``()`` for the root
      (conv + max-pool, stride 4) only. The stem's total stride is ``4 * 2^(stages - 1)``.
    resnet_width_factor: ResNet width multiplier (root width ``64 * resnet_width_factor``);
      ignored without ``resnet_num_layers``.
    attention: how attention runs, one of :data:`vit_jax.models.attention.IMPLEMENTATIONS`
      ('xla' by default; the training config chooses from the target devices). The 'map' head's
      cross-attention always runs the 'xla' path, and so does every attention while the
      intermediates are captured (``mutable=['intermediates']``).
    gelu_approximate: the GELU of every MLP (encoder blocks and the 'map' head): True (default)
      the tanh approximation (official JAX ViT, big_vision, flax's ``nn.gelu``), False the exact
      erf GELU (timm, transformers ``hidden_act='gelu'``).
    layer_norm_epsilon: epsilon of every LayerNorm (blocks, ``encoder_norm``, the 'map' head); a
      positive float, 1e-6 by default (transformers' ``google/vit-*`` configs: 1e-12).
    posemb: ``'learn'`` (default; ``Transformer/posembed_input/pos_embedding``, class token row
      included) or ``'sincos2d'`` (big_vision's fixed table, :func:`posemb_sincos_2d`: no
      parameter, works at any resolution; needs ``hidden_size`` a multiple of 4, at least 8).

  Call ``model.apply(variables, images, train=False)``:
    images: ``[B, H, W, C]`` (C=3 for the published weights), float32 in [-1, 1] as the official
      preprocessing; H and W must be multiples of the patch size (of the total stride, ResNet
      stride x patch size, for hybrids).
    train: enables dropout; then ``rngs={'dropout': key}`` is required if any rate is > 0.
    Returns ``[B, num_classes]`` float32 logits (``[B, representation_size or D]`` features if
    ``num_classes is None``), whatever ``dtype`` is.
    With ``mutable=['intermediates']`` it returns ``(logits, state)``, ``state['intermediates']``
    holding the attention weights and block outputs (see the module docstring).

  Raises:
    ValueError: at construction for an unknown ``classifier`` or ``posemb``, a non-positive size,
      a ``hidden_size`` not divisible by ``num_heads`` (or, with 'sincos2d', by 4), a bad
      ``patch_size``, dropout rate, ``gelu_approximate``, ``layer_norm_epsilon`` or
      ``resnet_num_layers``/``resnet_width_factor``; at apply time for a non-rank-4 input, an
      image side not divisible by the patch size (the total stride for hybrids), or loaded
      ``pos_embedding`` of the wrong shape.
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

  def __post_init__(self):
    validate_config(
        num_classes=self.num_classes, patch_size=self.patch_size, hidden_size=self.hidden_size,
        mlp_dim=self.mlp_dim, num_heads=self.num_heads, num_layers=self.num_layers,
        classifier=self.classifier, representation_size=self.representation_size,
        dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
        dtype=self.dtype, param_dtype=self.param_dtype, scan=self.scan, remat=self.remat,
        remat_policy=self.remat_policy, attention=self.attention,
        resnet_num_layers=self.resnet_num_layers, resnet_width_factor=self.resnet_width_factor,
        gelu_approximate=self.gelu_approximate, layer_norm_epsilon=self.layer_norm_epsilon,
        posemb=self.posemb)
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs: Array, *, train: bool) -> Array:
    if inputs.ndim != 4:
      raise ValueError(
          f'VisionTransformer expects images of shape [batch, height, width, channels] (NHWC), '
          f'got shape {inputs.shape}')
    dtype = jnp.dtype(self.dtype or jnp.float32)
    param_dtype = jnp.dtype(self.param_dtype or jnp.float32)
    ph, pw = patch_pair(self.patch_size)
    _, height, width, _ = inputs.shape
    hybrid = self.resnet_num_layers is not None
    stem = resnet.resnet_stride(self.resnet_num_layers) if hybrid else 1
    for side, size, patch in (('height', height, ph), ('width', width, pw)):
      stride = stem * patch
      if size % stride:
        lower = size // stride * stride
        if hybrid:
          what = (f'the total stride {stride} (ResNet stem stride {stem} x patch size {patch}; '
                  f'resnet_num_layers={tuple(self.resnet_num_layers)!r}, '
                  f'patch_size={self.patch_size!r}, image {height}x{width})')
          fix = 'or change patch_size / the number of ResNet stages.'
        else:
          what = (f'the patch size {patch} (patch_size={self.patch_size!r}, image '
                  f'{height}x{width})')
          fix = f'or choose a patch size that divides {size}.'
        raise ValueError(
            f'Image {side} {size} is not divisible by {what}. Resize or crop the images to a '
            f'multiple of {stride} (e.g. {lower or stride} or {lower + stride}), {fix}')

    x = inputs
    if hybrid:
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
    x = execution.constrain(x, TOKENS_AXES)

    if self.classifier == 'token':
      cls = self.param('cls', _partitioned(nn.initializers.zeros, (None, None, 'embed')),
                       (1, 1, c), param_dtype)
      cls = jnp.broadcast_to(cls.astype(x.dtype), (n, 1, c))
      x = jnp.concatenate([cls, x], axis=1)

    x = Encoder(num_layers=self.num_layers, mlp_dim=self.mlp_dim, num_heads=self.num_heads,
                dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate, dtype=dtype,
                param_dtype=param_dtype, scan=self.scan, remat=self.remat,
                remat_policy=self.remat_policy, attention=self.attention,
                gelu_approximate=self.gelu_approximate,
                layer_norm_epsilon=self.layer_norm_epsilon, posemb=self.posemb,
                name='Transformer')(x, train=train)

    if self.classifier == 'token':
      x = x[:, 0]
    elif self.classifier == 'gap':
      x = jnp.mean(x, axis=1)
    else:  # 'map'
      x = MAPHead(num_heads=self.num_heads, mlp_dim=self.mlp_dim,
                  gelu_approximate=self.gelu_approximate,
                  layer_norm_epsilon=self.layer_norm_epsilon, dtype=dtype,
                  param_dtype=param_dtype, name='MAPHead_0')(x)

    if self.representation_size is not None:
      x = nn.Dense(self.representation_size, dtype=dtype, param_dtype=param_dtype,
                   kernel_init=_partitioned(nn.linear.default_kernel_init, ('embed', None)),
                   bias_init=_partitioned(nn.initializers.zeros, (None,)),
                   name='pre_logits')(x)
      x = jnp.tanh(x)
    else:
      x = IdentityLayer(name='pre_logits')(x)

    if self.num_classes is None:
      return x.astype(jnp.float32)
    x = nn.Dense(self.num_classes, dtype=dtype, param_dtype=param_dtype,
                 kernel_init=_partitioned(nn.initializers.zeros, ('embed', 'classes')),
                 bias_init=_partitioned(nn.initializers.constant(self.head_bias_init),
                                        ('classes',)),
                 name='head')(x)
    return x.astype(jnp.float32)
