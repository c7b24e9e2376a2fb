"""What the models compute, read back: every block's attention weights and output tokens, which
the modules sow into ``'intermediates'`` only when the caller makes it mutable (the paths:
:func:`unpack`). :func:`capture` runs one jitted forward, :func:`unpack` reads a
``state['intermediates']`` (also under ``jit``). Names, shapes, token order, memory: docs/models.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple

import jax
import jax.numpy as jnp

from vit_jax.models import attention as attention_lib
from vit_jax.models import execution
from vit_jax.models import layout as layout_lib
from vit_jax.models import t2t
from vit_jax.models import vit

Array = jax.Array

COLLECTION = attention_lib.INTERMEDIATES
ATTENTION_WEIGHTS = attention_lib.ATTENTION_WEIGHTS
TOKENS = attention_lib.TOKENS


@dataclasses.dataclass(frozen=True)
class TokenLayout:
  """The token order of a map: ``prefix`` tokens (the class token, then the registers:
  :func:`vit_jax.models.vit.prefix_tokens`), then the ``grid`` ``(rows, cols)`` row-major,
  centres ``stride`` ``(sy, sx)`` input pixels apart."""

  prefix: int
  grid: Tuple[int, int]
  stride: Tuple[int, int]

  @property
  def num_tokens(self) -> int:
    return self.prefix + self.grid[0] * self.grid[1]


@dataclasses.dataclass(frozen=True)
class Captured:
  """One forward pass: float32 ``logits``; per block, block 0 first, float32 ``attention`` ``[B,
  heads, N, N]`` and ``tokens`` ``[B, N, D]``; the 'map' head's ``[B, heads, 1, gh * gw]`` (it
  pools the patches: N without registers); T2T-ViT's two T2T layers' ``[B, 1, L, L]`` and their
  layouts."""

  logits: Array
  attention: Tuple[Array, ...]
  tokens: Tuple[Array, ...]
  layout: TokenLayout
  head_attention: Optional[Array] = None
  t2t_attention: Tuple[Array, ...] = ()
  t2t_layouts: Tuple[TokenLayout, ...] = ()


def _check_model(model: Any) -> None:
  if not isinstance(model, (vit.VisionTransformer, t2t.T2TViT)):
    raise TypeError(f'Expected a vit_jax VisionTransformer or T2TViT (e.g. from '
                    f'vit_jax.models.create), got {type(model).__name__}.')


def token_layout(model: Any, height: int, width: int) -> TokenLayout:
  """The token order of ``model``'s encoder / backbone for ``height x width`` images.
  TypeError: not a ViT or T2T-ViT; ImageSizeError: a size the model cannot take."""
  _check_model(model)
  if isinstance(model, t2t.T2TViT):
    stride = math.prod(step for _, step, _ in t2t.SOFT_SPLITS)
    return TokenLayout(1, t2t.token_grid(height, width), (stride, stride))
  sy, sx = vit.token_stride(model, height, width)
  return TokenLayout(vit.prefix_tokens(model),
                     (height // sy, width // sx), (sy, sx))


def t2t_layouts(model: Any, height: int, width: int) -> Tuple[TokenLayout, ...]:
  """The token orders of T2T-ViT's two T2T layers; ``()`` for ViT. Raises as :func:`token_layout`.
  """
  _check_model(model)
  if not isinstance(model, t2t.T2TViT):
    return ()
  layouts = []
  stride = 1
  for (_, step, _), grid in zip(t2t.SOFT_SPLITS[:2], t2t.stage_grids(height, width)):
    stride *= step
    layouts.append(TokenLayout(0, grid, (stride, stride)))
  return tuple(layouts)


def _leaf(node: Any, path: Tuple[str, ...]) -> Optional[Array]:
  """The sown value at ``path`` (the last of its tuple), or None if absent."""
  for part in path:
    if not isinstance(node, Mapping) or part not in node:
      return None
    node = node[part]
  return node[-1] if isinstance(node, (tuple, list)) else node


def _per_block(parent: Any, prefix: str, path: Tuple[str, ...], depth: int,
               what: str) -> Tuple[Array, ...]:
  """``depth`` values at ``{prefix}_{i}/path`` (per-layer) or ``{prefix}/path`` (scanned)."""
  parent = parent if isinstance(parent, Mapping) else {}
  stacked = _leaf(parent, (prefix,) + path)
  if stacked is not None:  # nn.scan: one value with a leading layer axis.
    values = tuple(stacked[i] for i in range(stacked.shape[0]))
  else:
    blocks = layout_lib.block_indices(parent, prefix)  # Numeric order: _10 after _9.
    values = tuple(v for v in (_leaf(parent[blocks[i]], path) for i in sorted(blocks))
                   if v is not None)
  if len(values) != depth:
    raise ValueError(
        f'Found {len(values)} sown {what} for a model of {depth} blocks: the intermediates '
        f"must come from model.apply(variables, images, train=False, mutable=['{COLLECTION}']) "
        f'(or capture_intermediates=True) of this same model.')
  return values


def unpack(model: Any, intermediates: Any) -> dict:
  """``state['intermediates']`` of ``model`` as :class:`Captured`'s fields (not the logits and
  layouts), depth order. TypeError: another model class; ValueError: nothing sown."""
  _check_model(model)
  if isinstance(model, t2t.T2TViT):
    root = intermediates
    prefix = 'blocks'
    attn = ('attn',)
    depth = model.depth
  else:
    root = intermediates.get('Transformer') if isinstance(intermediates, Mapping) else None
    prefix = 'encoderblock'
    attn = ('MultiHeadDotProductAttention_0',)
    depth = model.num_layers
  out = dict(
      attention=_per_block(root, prefix, attn + (ATTENTION_WEIGHTS,), depth, 'attention weights'),
      tokens=_per_block(root, prefix, (TOKENS,), depth, 'block outputs (tokens)'),
      head_attention=None, t2t_attention=())
  if isinstance(model, vit.VisionTransformer) and model.classifier == 'map':
    out['head_attention'] = _leaf(intermediates, ('MAPHead_0', 'MultiHeadDotProductAttention_0',
                                                  ATTENTION_WEIGHTS))
  if isinstance(model, t2t.T2TViT):
    sub = ('attn',) if model.tokens_type == 'transformer' else ()
    maps = tuple(_leaf(intermediates, ('tokens_to_token', f'attention{i}') + sub
                       + (ATTENTION_WEIGHTS,)) for i in (1, 2))
    if any(m is None for m in maps):
      raise ValueError('The intermediates lack the T2T layers\' attention weights: apply the '
                       f"model with mutable=['{COLLECTION}'].")
    out['t2t_attention'] = maps
  return out


@functools.lru_cache(maxsize=16)
def _forward(model: Any):
  return jax.jit(lambda variables, images: model.apply(variables, images, train=False,
                                                       mutable=[COLLECTION]))


def capture(model: Any, variables: Any, images: Any) -> Captured:
  """Runs ``model`` once (jitted, eval) on ``images [B, H, W, C]``. TypeError: another model
  class; ValueError: bad images or variables."""
  _check_model(model)
  if getattr(images, 'ndim', None) != 4:
    raise ValueError(f'images must be [batch, height, width, channels] (NHWC), got shape '
                     f'{getattr(images, "shape", type(images).__name__)}.')
  height = int(images.shape[1])
  width = int(images.shape[2])
  logits, state = _forward(model)(variables, images)
  parts = unpack(model, state[COLLECTION])
  return Captured(logits=logits, layout=token_layout(model, height, width),
                  t2t_layouts=t2t_layouts(model, height, width), **parts)


def attention_maps(model: Any, variables: Any, images: Any) -> List[Array]:
  """:func:`capture`'s ``attention`` as a list."""
  return list(capture(model, variables, images).attention)


def tokens(model: Any, variables: Any, images: Any) -> List[Array]:
  """:func:`capture`'s ``tokens`` as a list."""
  return list(capture(model, variables, images).tokens)


def t2t_attention_maps(model: Any, variables: Any, images: Any) -> List[Array]:
  """:func:`capture`'s ``t2t_attention``; TypeError if ``model`` is not a T2T-ViT."""
  if not isinstance(model, t2t.T2TViT):
    raise TypeError(f'T2T-module attention exists for T2TViT models only, got '
                    f'{type(model).__name__}; use attention_maps for the encoder.')
  return list(capture(model, variables, images).t2t_attention)


def final_norm(model: Any, params: Mapping[str, Any], tokens: Array) -> Array:
  """``tokens`` ``[B, N, D]`` through the LayerNorm ``model`` applies to its encoder's output
  (timm's ``norm``), with its parameters in ``params``: ViT's ``Transformer/encoder_norm``,
  T2T-ViT's ``norm``; unchanged for a ViT with ``fc_norm`` (its LayerNorm follows the pooling;
  timm's ``norm`` is an Identity). Returns ``[B, N, D]`` in the model's ``dtype`` (default
  float32); KeyError: ``params`` lacks that LayerNorm."""
  dtype = jnp.dtype(model.dtype or jnp.float32)
  param_dtype = jnp.dtype(model.param_dtype or jnp.float32)
  if isinstance(model, t2t.T2TViT):
    return t2t.layer_norm('norm', dtype, param_dtype).apply({'params': params['norm']}, tokens)
  if model.fc_norm:
    return tokens
  norm = execution.layer_norm(dtype, param_dtype, model.layer_norm_epsilon)
  return norm.apply({'params': params['Transformer']['encoder_norm']}, tokens)
