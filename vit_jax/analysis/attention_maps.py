"""Attention rollout (Abnar & Zuidema, ACL 2020, sec. 3; ViT paper Fig. 6 / 14) and mean attention
distance (ViT paper Fig. 7 right, App. D.7, as Gosthipaty & Paul's keras.io reproduction), arrays
in, NumPy out. Attention weights are as the models sow them: per layer ``[B, heads, N, N]``
(queries x keys), ``N = num_prefix_tokens + gh * gw``, prefix tokens first (the class token if
any, then ``num_registers`` registers: timm's ``num_prefix_tokens``, ``num_reg_tokens``), then
the grid.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence, Tuple, Union

import numpy as np
from scipy import ndimage

#: How :func:`rollout` fuses a layer's heads: their mean (the paper's), maximum or minimum.
HEAD_FUSIONS = ('mean', 'max', 'min')

AttentionStack = Union[Sequence[Any], np.ndarray]


def as_pair(value: Any, name: str) -> Tuple[int, int]:
  """``value`` (a positive int or a pair of them) as ``(rows, columns)``; ValueError otherwise."""
  items = tuple(value) if isinstance(value, (tuple, list, np.ndarray)) else (value, value)
  if len(items) != 2 or not all(
      isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in items):
    raise ValueError(f'{name} must be a positive int or a pair (rows, columns) of positive ints, '
                     f'got {value!r}')
  return int(items[0]), int(items[1])


def as_prefix(value: Any, name: str = 'num_prefix_tokens') -> int:
  """``num_prefix_tokens`` (or ``name``) checked: a non-negative int."""
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
    raise ValueError(f'{name} must be a non-negative int (num_prefix_tokens: 1 for a class '
                     f"token, 0 for classifier='gap'/'map', plus the registers), got {value!r}")
  return int(value)


def has_class_token(num_prefix_tokens: int, num_registers: int) -> bool:
  """Whether the prefix holds a class token: ``num_prefix_tokens`` is ``num_registers`` (False)
  or one more (True); ValueError otherwise."""
  num_prefix_tokens = as_prefix(num_prefix_tokens)
  num_registers = as_prefix(num_registers, 'num_registers')
  if num_prefix_tokens - num_registers not in (0, 1):
    raise ValueError(f'num_prefix_tokens={num_prefix_tokens} with num_registers={num_registers}: '
                     'the prefix is the class token (if any) and the registers, so '
                     f'num_prefix_tokens must be {num_registers} or {num_registers + 1}.')
  return num_prefix_tokens > num_registers


def check_tokens(tokens: int, grid: Tuple[int, int], num_prefix_tokens: int, what: str) -> None:
  """ValueError unless ``tokens == num_prefix_tokens + gh * gw``, with the likely fix."""
  gh, gw = grid
  if tokens != num_prefix_tokens + gh * gw:
    hint = ''
    for count in (0, 1):  # A square grid that the token count fits, if any.
      side = int(round(max(tokens - count, 0) ** 0.5))
      if side and side * side == tokens - count:
        hint = f' ({tokens} tokens fit grid ({side}, {side}) with num_prefix_tokens={count})'
        break
    raise ValueError(
        f'{what} has {tokens} tokens but grid {gh}x{gw} with num_prefix_tokens='
        f'{num_prefix_tokens} needs {num_prefix_tokens + gh * gw}{hint}. Pass the token grid of '
        f'the input (image size / patch size) and the prefix tokens: 1 for a class token, 0 '
        f"for classifier='gap'/'map', plus the registers.")


def check_finite(array: np.ndarray, what: str) -> None:
  """ValueError if ``array`` holds a NaN or an infinity."""
  if not np.all(np.isfinite(array)):
    raise ValueError(f'{what} contains NaN or infinite values; check the model and its inputs.')


def _layers(attentions: AttentionStack) -> list:
  """The per-layer ``[B, H, N, N]`` arrays of a list or of a stacked ``[L, B, H, N, N]`` array."""
  if isinstance(attentions, (list, tuple)):
    layers = [np.asarray(a) for a in attentions]
  else:
    stacked = np.asarray(attentions)
    if stacked.ndim != 5:
      raise ValueError(f'attentions must be a list of per-layer [B, heads, N, N] arrays or one '
                       f'[layers, B, heads, N, N] array, got shape {stacked.shape}')
    layers = list(stacked)
  if not layers:
    raise ValueError('attentions is empty: pass the attention weights of at least one layer.')
  for i, layer in enumerate(layers):
    _check_attention(layer, f'attentions[{i}]')
    if layer.shape != layers[0].shape:
      raise ValueError(f'attentions[{i}] has shape {layer.shape} but attentions[0] has '
                       f'{layers[0].shape}; every layer must have the same [B, heads, N, N].')
  return layers


def _check_attention(attention: np.ndarray, what: str) -> None:
  if attention.ndim != 4 or attention.shape[-1] != attention.shape[-2]:
    raise ValueError(f'{what} must have shape [batch, heads, N, N] (queries x keys), got '
                     f'{attention.shape}')
  check_finite(attention, what)
  if attention.size and attention.min() < -1e-6:
    raise ValueError(f'{what} has negative weights (min {attention.min():.3g}); pass the softmax '
                     f'attention probabilities, not the logits.')


def _fuse(attention: np.ndarray, head_fusion: str) -> np.ndarray:
  """``[B, H, N, N]`` -> ``[B, N, N]`` float64; ValueError: an unknown ``head_fusion``."""
  if head_fusion not in HEAD_FUSIONS:
    raise ValueError(f'head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}')
  return getattr(attention.astype(np.float64), head_fusion)(axis=1)


def rollout(attentions: AttentionStack, *, residual: bool = True,
            head_fusion: str = 'mean') -> np.ndarray:
  """Attention rollout ``[B, N, N]`` float32 of ``L`` layers ``[B, heads, N, N]`` (a list or one
  ``[L, ...]`` array): heads fused into ``A_l``, with ``residual`` ``0.5 A_l + 0.5 I``, rows
  normalised, ``R = A_L @ ... @ A_1`` in float64. ValueError: bad layers, weights or fusion.
  """
  layers = _layers(attentions)
  b, _, n, _ = layers[0].shape
  eye = np.eye(n)
  result = np.broadcast_to(eye, (b, n, n))
  for i, layer in enumerate(layers):
    fused = _fuse(layer, head_fusion)
    if residual:
      fused = 0.5 * fused + 0.5 * eye
    sums = fused.sum(axis=-1, keepdims=True)
    if np.any(sums <= 0):
      raise ValueError(f'attentions[{i}] has a query row whose fused weights sum to 0; rollout '
                       f'needs attention probabilities (use residual=True or head_fusion="mean").')
    result = (fused / sums) @ result
  return result.astype(np.float32)


def _token_maps(matrices: np.ndarray, grid: Tuple[int, int], num_prefix_tokens: int,
                num_registers: int, what: str) -> np.ndarray:
  """``[..., N, N]`` -> ``[..., gh, gw]``: over the patch keys, the class token's row, or without
  one the mean of the patch rows (never a register's), each map divided by its maximum."""
  check_tokens(matrices.shape[-1], grid, num_prefix_tokens, what)
  patches = matrices[..., num_prefix_tokens:]
  rows = (patches[..., 0, :] if has_class_token(num_prefix_tokens, num_registers)
          else patches[..., num_prefix_tokens:, :].mean(axis=-2)).astype(np.float64)
  peak = rows.max(axis=-1, keepdims=True)
  rows = np.divide(rows, peak, out=np.zeros_like(rows), where=peak > 0)
  return rows.reshape(*rows.shape[:-1], *grid).astype(np.float32)


def class_token_map(rollout_matrix: Any, grid: Any, *, num_prefix_tokens: int = 1,
                    num_registers: int = 0) -> np.ndarray:
  """``[B, N, N]`` -> ``[B, gh, gw]`` float32 in [0, 1]: the class token's row (token 0) over the
  patches; without a class token (``num_prefix_tokens == num_registers``) the mean of the patch
  rows; divided by its maximum. ValueError: mismatched shapes or prefix counts.
  """
  matrix = np.asarray(rollout_matrix)
  if matrix.ndim != 3 or matrix.shape[1] != matrix.shape[2]:
    raise ValueError(f'rollout_matrix must have shape [B, N, N] (from rollout()), got '
                     f'{matrix.shape}')
  return _token_maps(matrix, as_pair(grid, 'grid'), as_prefix(num_prefix_tokens),
                     num_registers, 'rollout_matrix')


def layer_class_token_maps(attentions: AttentionStack, grid: Any, *, num_prefix_tokens: int = 1,
                           num_registers: int = 0, head_fusion: str = 'mean') -> np.ndarray:
  """The class token's attention per layer, ``[L, B, gh, gw]`` float32 in [0, 1] (heads fused as
  :func:`rollout`, rows as :func:`class_token_map`)."""
  grid = as_pair(grid, 'grid')
  num_prefix_tokens = as_prefix(num_prefix_tokens)
  return np.stack([_token_maps(_fuse(layer, head_fusion), grid, num_prefix_tokens, num_registers,
                               f'attentions[{i}]') for i, layer in enumerate(_layers(attentions))])


def upsample(maps: Any, size: Any) -> np.ndarray:
  """Bilinear upsampling ``[..., gh, gw]`` -> ``[..., H, W]`` float32, values at cell centres."""
  maps = np.asarray(maps, dtype=np.float32)
  if maps.ndim < 2:
    raise ValueError(f'maps must have shape [..., gh, gw], got {maps.shape}')
  height, width = as_pair(size, 'size')
  zoom = (1.0,) * (maps.ndim - 2) + (height / maps.shape[-2], width / maps.shape[-1])
  out = ndimage.zoom(maps, zoom, order=1, mode='nearest', grid_mode=True)
  return out[..., :height, :width]


def patch_distances(grid: Any, patch_size: Any) -> np.ndarray:
  """``[gh * gw, gh * gw]`` float64 pixel distances between patch centres."""
  gh, gw = as_pair(grid, 'grid')
  ph, pw = as_pair(patch_size, 'patch_size')
  rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing='ij')
  centres = np.stack([(rows.ravel() + 0.5) * ph, (cols.ravel() + 0.5) * pw], axis=-1)
  return np.sqrt(((centres[:, None, :] - centres[None, :, :]) ** 2).sum(-1))


def mean_attention_distance(attention: Any, grid: Any, patch_size: Any, num_prefix_tokens: int,
                            *, per_image: bool = False) -> np.ndarray:
  """Mean attention distance of one layer's heads (``attention`` ``[B, heads, N, N]``),
  ``[heads]`` float64 pixels (``per_image``: ``[B, heads]``): each patch query's weights
  renormalised over the patches, times the distance, averaged. ``patch_size``: the grid's pixel
  stride. ValueError: bad shapes or weights.
  """
  attention = np.asarray(attention)
  _check_attention(attention, 'attention')
  grid = as_pair(grid, 'grid')
  num_prefix_tokens = as_prefix(num_prefix_tokens)
  check_tokens(attention.shape[-1], grid, num_prefix_tokens, 'attention')
  weights = attention[:, :, num_prefix_tokens:, num_prefix_tokens:].astype(np.float64)
  sums = weights.sum(axis=-1)
  if np.any(sums <= 0):
    raise ValueError('attention has a patch query with zero weight on every patch key; the '
                     'mean distance over patches is undefined for it.')
  out = ((weights * patch_distances(grid, patch_size)).sum(axis=-1) / sums).mean(axis=-1)
  return out if per_image else out.mean(axis=0)


def mean_attention_distances(attentions: AttentionStack, grid: Any, patch_size: Any,
                             num_prefix_tokens: int) -> np.ndarray:
  """:func:`mean_attention_distance` of every layer: ``[L, heads]`` float64 pixels."""
  return np.stack([mean_attention_distance(layer, grid, patch_size, num_prefix_tokens)
                   for layer in _layers(attentions)])
