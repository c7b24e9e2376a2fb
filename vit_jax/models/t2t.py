"""Tokens-to-Token ViT (Yuan et al., ICCV 2021) in Flax linen, numerics of the official PyTorch
code (yitu-opensource/T2T-ViT; docs/reference.md section 2):

  T2T module   soft split 0 (k7/s4/p2) -> ``attention1`` -> soft split 1 (k3/s2/p1)
               -> ``attention2`` -> soft split 2 (k3/s2/p1) -> ``project`` (9 token_dim -> D)
  backbone     [cls_token; tokens] + pos_embed (fixed sinusoid) -> ``blocks_{i}`` -> ``norm``
               -> ``head`` on token 0

``init`` returns ``'params'`` and ``'constants'`` (``pos_embed``, the Performer ``w``; never
trained, ``apply`` needs both). Names map one-to-one to the reference's state_dict
(:mod:`vit_jax.checkpoint.t2t_torch`). LayerNorm eps 1e-5 (two-pass), exact GELU, softmax and
the Performer in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models import attention as attention_lib
from vit_jax.models import execution
from vit_jax.models import fields
from vit_jax.models.fields import REQUIRED, Field

Array = jax.Array
Dtype = Any

#: T2T module types accepted by :class:`T2TViT` (the reference's ``tokens_type``).
TOKENS_TYPES = ('performer', 'transformer')

#: LayerNorm epsilon of the reference (PyTorch default).
LAYERNORM_EPSILON = 1e-5

#: Soft split stages: (kernel, stride, padding), as the reference's three ``nn.Unfold``.
SOFT_SPLITS: Tuple[Tuple[int, int, int], ...] = ((7, 4, 2), (3, 2, 1), (3, 2, 1))

#: Performer: random features m = int(token_dim * PERFORMER_KERNEL_RATIO); eps of the normaliser.
PERFORMER_KERNEL_RATIO = 0.5
PERFORMER_EPSILON = 1e-8

_linear_init = nn.initializers.truncated_normal(stddev=0.02)

_partitioned = nn.with_logical_partitioning

Axes = Tuple[Optional[str], ...]

#: Logical (input, output) axes of the T2T layers' kernels: fused q/k/v, and the others.
_T2T_QKV_AXES: Axes = (None, 'qkv')
_T2T_AXES: Axes = (None, 'tokens')


def layer_norm(name: str, dtype: Dtype, param_dtype: Dtype) -> nn.LayerNorm:
  """T2T-ViT's LayerNorm: PyTorch's epsilon and two-pass variance."""
  return execution.layer_norm(dtype, param_dtype, LAYERNORM_EPSILON, name, fast_variance=False)


def _dense(features: int, name: str, dtype: Dtype, param_dtype: Dtype, axes: Axes,
           use_bias: bool = True) -> nn.Dense:
  """A reference Linear; ``axes`` are the kernel's logical (input, output) axis names."""
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=_partitioned(_linear_init, axes),
                  bias_init=_partitioned(nn.initializers.zeros, axes[1:]), name=name)


def soft_split_size(size: int, kernel: int, stride: int, padding: int) -> int:
  """One unfold's output length along a side, ``floor((size + 2p - k)/s) + 1``; ImageSizeError
  when it is not positive."""
  out = (size + 2 * padding - kernel) // stride + 1
  if out <= 0:
    raise execution.ImageSizeError(f'Image side {size} is too small for an unfold with kernel '
                                   f'{kernel}, stride {stride}, padding {padding}')
  return out


def stage_grids(height: int, width: int) -> Tuple[Tuple[int, int], ...]:
  """The token grid ``(h, w)`` after each soft split (224: (56, 56), (28, 28), (14, 14)); as
  :func:`soft_split_size`."""
  grids = []
  for kernel, stride, padding in SOFT_SPLITS:
    height, width = (soft_split_size(s, kernel, stride, padding) for s in (height, width))
    grids.append((height, width))
  return tuple(grids)


def token_grid(height: int, width: int) -> Tuple[int, int]:
  """Token grid ``(h, w)`` after the soft splits (224 -> (14, 14)); as :func:`soft_split_size`."""
  return stage_grids(height, width)[-1]


def soft_split(x: Array, kernel: int, stride: int, padding: int) -> Array:
  """``nn.Unfold`` (zero padding): ``[B, H, W, C]`` -> ``[B, h * w, C * k * k]``, tokens row-major,
  features channel-major (``c*k*k + i*k + j``); strided slices only, so exact."""
  b, height, width, c = x.shape
  oh = soft_split_size(height, kernel, stride, padding)
  ow = soft_split_size(width, kernel, stride, padding)
  x = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
  taps = [
      x[:, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride, :]
      for i in range(kernel) for j in range(kernel)
  ]
  patches = jnp.stack(taps, axis=-1)  # [B, oh, ow, C, k*k]: channel-major flattening below.
  return patches.reshape(b, oh * ow, c * kernel * kernel)


def sinusoid_table(num_positions: int, width: int) -> np.ndarray:
  """The reference's sinusoid table ``(1, num_positions, width)`` float32, bit for bit: sin/cos
  of ``pos / 10000**(2*(j//2)/width)`` on even/odd ``j``, in float64."""
  pos = np.arange(num_positions, dtype=np.float64)[:, None]
  j = np.arange(width)
  angle = pos / np.power(10000.0, 2 * (j // 2) / width)[None, :]
  table = np.where(j % 2 == 0, np.sin(angle), np.cos(angle))
  return table[None].astype(np.float32)


def performer_features(x: Array, w: Array) -> Array:
  """Performer features ``exp(x w^T - |x|^2/2) / sqrt(m)``: ``x [..., d]``, ``w (m, d)`` -> float32
  ``[..., m]``."""
  x = x.astype(jnp.float32)
  w = w.astype(jnp.float32)
  m = w.shape[0]
  half_sq_norm = jnp.sum(x * x, axis=-1, keepdims=True) / 2
  wx = jnp.einsum('...d,md->...m', x, w, precision=jax.lax.Precision.HIGHEST)
  return jnp.exp(wx - half_sq_norm) / math.sqrt(m)


def _require_constant(module: nn.Module, name: str) -> None:
  # Outside init a missing fixed table means the caller passed only {'params': ...}.
  if not module.has_variable('constants', name) and not module.is_mutable_collection('constants'):
    raise ValueError(
        f"The variables lack the fixed table 'constants/{'/'.join(module.path + (name,))}'. "
        f"T2T-ViT keeps its sinusoid table and Performer features in the 'constants' collection: "
        f"pass both collections, model.apply({{'params': ..., 'constants': ...}}, ...), as "
        f"returned by init or vit_jax.checkpoint.t2t_torch.from_torch_state_dict.")


def _orthogonal_features(key: Array, m: int, dim: int) -> Array:
  # Rows orthonormal (m <= dim), scaled by sqrt(m): the reference's orthogonal_(randn) * sqrt(m).
  return nn.initializers.orthogonal()(key, (m, dim), jnp.float32) * math.sqrt(m)


class DropPath(nn.Module):
  """Stochastic depth on ``[B, ...]`` (the ``'dropout'`` rng); a call's ``rate`` (traced, per
  scanned block) replaces the attribute."""

  rate: float = 0.0

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool, rate: Optional[Array] = None) -> Array:
    if deterministic or (rate is None and self.rate == 0.0):
      return x
    keep = 1.0 - (self.rate if rate is None else rate)
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    mask = jax.random.bernoulli(self.make_rng('dropout'), keep, shape)
    divisor = keep if rate is None else jnp.asarray(keep, x.dtype)  # Keep x's dtype (bfloat16).
    return jnp.where(mask, x / divisor, jnp.zeros_like(x))


class Mlp(nn.Module):
  """``fc1`` -> exact GELU -> ``fc2`` (reference ``Mlp``); ``[..., D]`` -> ``[..., out_dim]``."""

  hidden_dim: int
  out_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  fc1_axes: Axes = ('embed', 'mlp')
  fc2_axes: Axes = ('mlp', 'embed')

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x = _dense(self.hidden_dim, 'fc1', self.dtype, self.param_dtype, self.fc1_axes)(x)
    x = execution.constrain(x, ('batch', 'length', self.fc1_axes[1]))
    x = nn.gelu(x, approximate=False)
    return _dense(self.out_dim, 'fc2', self.dtype, self.param_dtype, self.fc2_axes)(x)


class TokenTransformerAttention(nn.Module):
  """The Transformer T2T layer's one head, ``[B, L, in]`` -> ``[B, L, token_dim]``: ``v +
  proj(softmax((q * in**-0.5) k^T) v)`` (the scale of the INPUT width, as the reference)."""

  token_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = x.shape[-1] ** -0.5
    qkv = _dense(3 * self.token_dim, 'qkv', self.dtype, self.param_dtype, _T2T_QKV_AXES,
                 use_bias=False)(x)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    logits = jnp.einsum('bqd,bkd->bqk', q * scale, k).astype(jnp.float32)
    attn = jax.nn.softmax(logits, axis=-1)
    if attention_lib.capturing(self):  # One head: [B, 1, L, L] float32.
      attention_lib.sow_weights(self)(attn[:, None])
    attn = attn.astype(v.dtype)
    y = jnp.einsum('bqk,bkd->bqd', attn, v)
    y = _dense(self.token_dim, 'proj', self.dtype, self.param_dtype, _T2T_AXES)(y)
    return v + y


class TokenTransformer(nn.Module):
  """Reference ``Token_transformer``: ``y = attn(norm1(x)); y + mlp(norm2(y))``."""

  token_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    y = layer_norm('norm1', self.dtype, self.param_dtype)(x)
    y = TokenTransformerAttention(self.token_dim, self.dtype, self.param_dtype, name='attn')(y)
    z = layer_norm('norm2', self.dtype, self.param_dtype)(y)
    return y + Mlp(self.token_dim, self.token_dim, self.dtype, self.param_dtype,
                   fc1_axes=_T2T_AXES, fc2_axes=_T2T_AXES, name='mlp')(z)


class TokenPerformer(nn.Module):
  """Reference ``Token_performer``: ``y = v + proj(phi(q) (phi(k)^T v) / (phi(q) . sum_t phi(k_t)
  + 1e-8))`` in float32 (``phi``: :func:`performer_features`, ``w`` fixed), then ``y +
  mlp_2(gelu(mlp_0(norm2(y))))``."""

  token_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    m = int(self.token_dim * PERFORMER_KERNEL_RATIO)
    _require_constant(self, 'w')
    w = self.variable('constants', 'w', lambda: _orthogonal_features(
        self.make_rng('params'), m, self.token_dim)).value
    if tuple(w.shape) != (m, self.token_dim):
      raise ValueError(f'Performer w has shape {tuple(w.shape)}, expected {(m, self.token_dim)}')
    h = layer_norm('norm1', self.dtype, self.param_dtype)(x)
    kqv = _dense(3 * self.token_dim, 'kqv', self.dtype, self.param_dtype, _T2T_QKV_AXES)(h)
    k, q, v = jnp.split(kqv, 3, axis=-1)
    kp = performer_features(k, w)  # [B, T, m] float32
    qp = performer_features(q, w)
    hi = jax.lax.Precision.HIGHEST
    v32 = v.astype(jnp.float32)
    denom = jnp.einsum('btm,bm->bt', qp, jnp.sum(kp, axis=1), precision=hi)[..., None]
    if attention_lib.capturing(self):  # The implied [B, 1, L, L] matrix, formed only now.
      implied = jnp.einsum('bqm,bkm->bqk', qp, kp, precision=hi) / (denom + PERFORMER_EPSILON)
      attention_lib.sow_weights(self)(implied[:, None])
    kptv = jnp.einsum('btd,btm->bdm', v32, kp, precision=hi)
    y = jnp.einsum('btm,bdm->btd', qp, kptv, precision=hi) / (denom + PERFORMER_EPSILON)
    y = _dense(self.token_dim, 'proj', self.dtype, self.param_dtype,
               _T2T_AXES)(y.astype(self.dtype))
    y = v + y
    z = layer_norm('norm2', self.dtype, self.param_dtype)(y)
    z = _dense(self.token_dim, 'mlp_0', self.dtype, self.param_dtype, _T2T_AXES)(z)
    z = execution.constrain(z, ('batch', 'length', 'tokens'))
    z = nn.gelu(z, approximate=False)
    z = _dense(self.token_dim, 'mlp_2', self.dtype, self.param_dtype, _T2T_AXES)(z)
    return y + z


class TokensToToken(nn.Module):
  """Reference ``T2T_module`` of the fields ``config`` (:data:`Config`): ``[B, H, W, C]`` ->
  ``[B, h * w, D]`` (:func:`token_grid`)."""

  config: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    layer_cls = TokenPerformer if c.tokens_type == 'performer' else TokenTransformer
    grids = stage_grids(x.shape[1], x.shape[2])
    for stage, (kernel, stride, padding) in enumerate(SOFT_SPLITS):
      x = soft_split(x, kernel, stride, padding)
      self.sow('intermediates', f'soft_split{stage}', x)
      if stage < 2:
        x = layer_cls(c.token_dim, c.dtype, c.param_dtype, name=f'attention{stage + 1}')(x)
        x = x.reshape(x.shape[0], *grids[stage], x.shape[-1])  # A row-major (h, w, c) map.
    x = _dense(c.embed_dim, 'project', c.dtype, c.param_dtype, (None, 'embed'))(x)
    return execution.constrain(x, execution.TOKENS_AXES)


class _QkvKernel(nn.Module):
  """The reference's fused ``qkv`` Linear without bias: only its ``kernel`` ``(D, 3 D)``."""

  features: int
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, width: int) -> Array:
    return self.param('kernel', _partitioned(_linear_init, ('embed', 'qkv')),
                      (width, self.features), self.param_dtype)


class Attention(nn.Module):
  """Reference ``Attention`` of the fields ``config`` (:data:`Config`; bias-free ``qkv`` ``(D,
  3 D)``) through :func:`vit_jax.models.attention.self_attention`; scale ``qk_scale`` or
  ``head_dim**-0.5``."""

  config: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    b, n, d = x.shape
    head_dim = d // c.num_heads
    scale = c.qk_scale if c.qk_scale is not None else head_dim ** -0.5
    kernel = _QkvKernel(3 * d, c.param_dtype, name='qkv')(d)
    kernel = kernel.reshape(d, 3, c.num_heads, head_dim)
    projections = [(kernel[:, i], None) for i in range(3)]
    weights_fn = attention_lib.sow_weights(self) if attention_lib.capturing(self) else None
    y, layout_ = attention_lib.self_attention(x.astype(c.dtype), projections,
                                              implementation=c.attention, logits_scale=scale,
                                              weights_fn=weights_fn)
    if layout_ == 'bhnk':
      y = y.transpose(0, 2, 1, 3)
    y = y.reshape(b, n, d)
    return _dense(d, 'proj', c.dtype, c.param_dtype, ('qkv', 'embed'))(y)


class Block(nn.Module):
  """Reference ``Block`` of the fields ``config`` (:data:`Config`), ``[B, N, D]``;
  ``deterministic`` positional (static under remat); ``drop_path_rate`` (traced, under
  ``nn.scan``) replaces ``drop_path``."""

  config: Any
  drop_path: float = 0.0
  scanned: bool = False

  @nn.compact
  def __call__(self, x: Array, deterministic: bool, drop_path_rate: Optional[Array] = None):
    c = self.config
    d = x.shape[-1]
    drop = functools.partial(DropPath(self.drop_path, name='drop_path'),
                             deterministic=deterministic, rate=drop_path_rate)
    x = execution.constrain(x, execution.TOKENS_AXES)
    y = layer_norm('norm1', c.dtype, c.param_dtype)(x)
    y = Attention(c, name='attn')(y)
    x = execution.constrain(x + drop(y), execution.TOKENS_AXES)
    y = layer_norm('norm2', c.dtype, c.param_dtype)(x)
    y = Mlp(int(d * c.mlp_ratio), d, c.dtype, c.param_dtype, name='mlp')(y)
    x = execution.constrain(x + drop(y), execution.TOKENS_AXES)
    self.sow(attention_lib.INTERMEDIATES, attention_lib.TOKENS, x)  # A no-op unless mutable.
    return (x, None) if self.scanned else x


class T2TViT(nn.Module):
  """The T2T-ViT classifier (reference ``T2T_ViT``); the released weights need ``qk_scale =
  embed_dim**-0.5``; drop path rises linearly to ``drop_path_rate``; the T2T module stays
  unrolled, on XLA's attention.

  ``apply({'params', 'constants'}, images [B, H, W, C] float32, train=...)`` (the released
  weights: ImageNet mean/std normalised) -> float32 ``[B, num_classes]`` (``[B, D]`` without a
  head). ValueError: bad fields, a non-NHWC input, a
  ``pos_embed`` of another size; ImageSizeError: an image too small for the soft splits.
  """

  num_classes: Optional[int]
  embed_dim: int
  depth: int
  num_heads: int
  mlp_ratio: float
  token_dim: int = 64
  tokens_type: str = 'performer'
  qk_scale: Optional[float] = None
  drop_path_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  scan: bool = False
  remat: bool = False
  remat_policy: str = 'nothing_saveable'
  attention: str = 'xla'

  def __post_init__(self):
    validate_config(**execution.fields_of(self))
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs: Array, *, train: bool) -> Array:
    dtype, param_dtype = execution.check_images(self, inputs)
    config = Config(**execution.shared_fields(self, Config, dtype=dtype, param_dtype=param_dtype))
    x = TokensToToken(config, name='tokens_to_token')(inputs.astype(dtype))
    b, n, d = x.shape
    cls = self.param('cls_token', _partitioned(_linear_init, (None, None, 'embed')), (1, 1, d),
                     param_dtype)
    x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (b, 1, d)), x], axis=1)
    _require_constant(self, 'pos_embed')
    pos = self.variable('constants', 'pos_embed', lambda: jnp.asarray(sinusoid_table(n + 1, d)))
    if tuple(pos.value.shape) != (1, n + 1, d):
      raise ValueError(
          f'pos_embed has shape {tuple(pos.value.shape)} but the image {inputs.shape[1]}x'
          f'{inputs.shape[2]} gives {(1, n + 1, d)} (tokens + class token, width). The table is '
          f'fixed: rebuild it with sinusoid_table({n + 1}, {d}) (or init) for this image size.')
    x = execution.constrain(x + pos.value.astype(x.dtype), execution.TOKENS_AXES)
    self.sow('intermediates', 'pos_drop', x)

    rates = np.linspace(0.0, self.drop_path_rate, self.depth)  # As torch.linspace.
    # Scanned: the per-block rates scanned with the parameters; none: skipped statically.
    scanned = self.scan and self.drop_path_rate and train
    scanned_rates = (jnp.asarray(rates, jnp.float32),) if scanned else ()
    x = execution.blocks(
        Block, x, not train, depth=self.depth, name='blocks', remat=self.remat,
        remat_policy=self.remat_policy, scan=self.scan, scanned_args=scanned_rates,
        layer_kwargs=lambda i: {'drop_path': float(rates[i])}, config=config)
    x = layer_norm('norm', dtype, param_dtype)(x)[:, 0]
    if self.num_classes is not None:
      x = _dense(self.num_classes, 'head', dtype, param_dtype, ('embed', 'classes'))(x)
    return x.astype(jnp.float32)


#: T2T-ViT's fields (:mod:`vit_jax.models.fields`), the reference's constructor names; the
#: registry's defaults (drop_path_rate 0.1, the reference's training default).
T2T_FIELDS: Tuple[Field, ...] = (
    Field('embed_dim', REQUIRED, int, 'D, the backbone width', True, check=fields.positive()),
    Field('depth', REQUIRED, int, 'the backbone blocks', True, check=fields.positive()),
    Field('num_heads', REQUIRED, int, "the backbone's attention heads", check=fields.positive()),
    Field('mlp_ratio', REQUIRED, float, "the backbone MLP's width over D", True,
          check=fields.positive(float)),
    Field('token_dim', 64, int, "the T2T module's token width", True, check=fields.positive()),
    Field('tokens_type', 'performer', str, f'the T2T module: one of {TOKENS_TYPES}', True,
          check=fields.one_of(TOKENS_TYPES)),
    Field('qk_scale', None, float, "the attention's scale (None: head size ** -0.5)",
          check=fields.positive(float, allow_none=True)),
    Field('drop_path_rate', 0.1, float, 'stochastic depth, rising linearly over the blocks',
          check=fields.rate),
    *fields.EXECUTION_FIELDS,
)

#: T2T-ViT's field values (:data:`T2T_FIELDS`) as one frozen object: what the T2T module and the
#: blocks take whole, as ViT's encoder takes :data:`vit_jax.models.vit_fields.Config`.
Config = fields.frozen_config(T2T_FIELDS)


def validate_config(*, num_classes: Any = None, **config: Any) -> None:
  """Checks the :class:`T2TViT` fields (the declared ones, :data:`T2T_FIELDS`, each by its
  ``check``, then together; extras ignored); ValueError naming the field, TypeError for a
  missing required one."""
  fields.validate(T2T_FIELDS, config, num_classes)
  embed_dim = config['embed_dim']
  num_heads = config['num_heads']
  if embed_dim % num_heads:
    raise ValueError(f'embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})')
  token_dim = config.get('token_dim', 64)
  performer = config.get('tokens_type', 'performer') == 'performer'
  if performer and int(token_dim * PERFORMER_KERNEL_RATIO) < 1:
    raise ValueError(f'token_dim must be >= 2 for the performer T2T module, got {token_dim}')
