"""What the attention weights of a ViT say: attention rollout and mean attention distance.

Arrays in (NumPy or JAX), NumPy out; nothing calls a model. Attention weights are as the
models sow them: per layer ``[B, heads, N, N]`` (queries x keys, rows sum to 1),
``N = num_prefix_tokens + gh * gw``, prefix (class) tokens first, then the grid row-major.

Sources: rollout, Abnar & Zuidema, "Quantifying Attention Flow in Transformers" (ACL 2020)
section 3, as the ViT paper's Fig. 6 / 14 (appendix D.8). Mean attention distance: the ViT
paper's Fig. 7 (right) and appendix D.7, following the common reproduction (Gosthipaty & Paul,
keras.io 2022): distances between patch centres in pixels, class token left out.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple, Union

import numpy as np
from scipy import ndimage

from vit_jax.analysis import _checks

#: How :func:`rollout` fuses the heads of a layer: their mean (Abnar & Zuidema, the ViT paper),
#: or their element-wise maximum / minimum (as some rollout reproductions offer).
HEAD_FUSIONS = ('mean', 'max', 'min')

AttentionStack = Union[Sequence[Any], np.ndarray]


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
  _checks.finite(attention, what)
  if attention.size and attention.min() < -1e-6:
    raise ValueError(f'{what} has negative weights (min {attention.min():.3g}); pass the softmax '
                     f'attention probabilities, not the logits.')


def _fuse(attention: np.ndarray, head_fusion: str) -> np.ndarray:
  """``[B, H, N, N]`` -> ``[B, N, N]`` float64."""
  if head_fusion == 'mean':
    return attention.mean(axis=1, dtype=np.float64)
  if head_fusion == 'max':
    return attention.max(axis=1).astype(np.float64)
  return attention.min(axis=1).astype(np.float64)


def _check_fusion(head_fusion: str) -> None:
  if head_fusion not in HEAD_FUSIONS:
    raise ValueError(f'head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}')


def rollout(attentions: AttentionStack, *, residual: bool = True,
            head_fusion: str = 'mean') -> np.ndarray:
  """Attention rollout ``[B, N, N]`` float32 (rows sum to 1), computed in float64.

  Per layer, bottom first: heads fused into ``A_l`` (``head_fusion``, :data:`HEAD_FUSIONS`);
  with ``residual``, ``A_l <- 0.5 A_l + 0.5 I``; rows normalised; ``R = A_L @ ... @ A_1``.
  ``attentions``: ``L`` arrays ``[B, heads, N, N]`` in layer order, or one ``[L, B, heads, N, N]``.

  Raises:
    ValueError: no layers, mismatched or non-``[B, H, N, N]`` layers, NaN/inf or negative
      weights, an unknown ``head_fusion``, or (without ``residual``) a row summing to 0.
  """
  _check_fusion(head_fusion)
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
                what: str) -> np.ndarray:
  """``[..., N, N]`` -> ``[..., gh, gw]``: the class token's row (or the mean row) over the
  patch tokens, each map divided by its maximum."""
  _checks.tokens_match(matrices.shape[-1], grid, num_prefix_tokens, what)
  if num_prefix_tokens:
    rows = matrices[..., 0, num_prefix_tokens:]
  else:
    rows = matrices.mean(axis=-2)
  rows = rows.astype(np.float64)
  peak = rows.max(axis=-1, keepdims=True)
  rows = np.divide(rows, peak, out=np.zeros_like(rows), where=peak > 0)
  return rows.reshape(*rows.shape[:-1], *grid).astype(np.float32)


def class_token_map(rollout_matrix: Any, grid: Any, *, num_prefix_tokens: int = 1) -> np.ndarray:
  """The rollout's map over the patch grid: ``[B, N, N]`` -> ``[B, gh, gw]`` float32 in [0, 1].

  The class token's row (token 0) over the patch tokens, or with ``num_prefix_tokens=0`` the
  mean of all rows; each map divided by its maximum. ``grid``: ``(gh, gw)`` or one int.

  Raises:
    ValueError: not ``[B, N, N]``, a bad ``grid`` / ``num_prefix_tokens``, or
      ``N != num_prefix_tokens + gh * gw``.
  """
  matrix = np.asarray(rollout_matrix)
  if matrix.ndim != 3 or matrix.shape[1] != matrix.shape[2]:
    raise ValueError(f'rollout_matrix must have shape [B, N, N] (from rollout()), got '
                     f'{matrix.shape}')
  return _token_maps(matrix, _checks.pair(grid, 'grid'), _checks.prefix(num_prefix_tokens),
                     'rollout_matrix')


def layer_class_token_maps(attentions: AttentionStack, grid: Any, *, num_prefix_tokens: int = 1,
                           head_fusion: str = 'mean') -> np.ndarray:
  """The class token's attention per layer (no rollout) as ``[L, B, gh, gw]`` float32 in [0, 1].

  Heads fused as :func:`rollout`, rows chosen and normalised as :func:`class_token_map`, whose
  errors (and :func:`rollout`'s) it raises.
  """
  _check_fusion(head_fusion)
  grid, num_prefix_tokens = _checks.pair(grid, 'grid'), _checks.prefix(num_prefix_tokens)
  layers = _layers(attentions)
  return np.stack([_token_maps(_fuse(layer, head_fusion), grid, num_prefix_tokens,
                               f'attentions[{i}]') for i, layer in enumerate(layers)])


def upsample(maps: Any, size: Any) -> np.ndarray:
  """Bilinear upsampling ``[..., gh, gw]`` -> ``[..., H, W]`` float32; ``size``: ``(H, W)`` or int.

  Values sit at cell centres (``scipy.ndimage.zoom``, ``order=1, grid_mode=True``).
  """
  maps = np.asarray(maps, dtype=np.float32)
  if maps.ndim < 2:
    raise ValueError(f'maps must have shape [..., gh, gw], got {maps.shape}')
  height, width = _checks.pair(size, 'size')
  zoom = (1.0,) * (maps.ndim - 2) + (height / maps.shape[-2], width / maps.shape[-1])
  out = ndimage.zoom(maps, zoom, order=1, mode='nearest', grid_mode=True)
  return out[..., :height, :width]


def patch_distances(grid: Any, patch_size: Any) -> np.ndarray:
  """``[gh * gw, gh * gw]`` float64 pixel distances between patch centres.

  Patch ``(r, c)`` is centred at ``((r + 0.5) ph, (c + 0.5) pw)``.
  """
  gh, gw = _checks.pair(grid, 'grid')
  ph, pw = _checks.pair(patch_size, 'patch_size')
  rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing='ij')
  centres = np.stack([(rows.ravel() + 0.5) * ph, (cols.ravel() + 0.5) * pw], axis=-1)
  return np.sqrt(((centres[:, None, :] - centres[None, :, :]) ** 2).sum(-1))


def mean_attention_distance(attention: Any, grid: Any, patch_size: Any, num_prefix_tokens: int,
                            *, per_image: bool = False) -> np.ndarray:
  """Mean attention distance of every head of one layer: ``[heads]`` float64 pixels (ViT Fig. 7).

  Prefix tokens are dropped as queries and keys; each patch query's weights are renormalised
  over the patches and weight :func:`patch_distances` (own patch at 0); the mean over queries
  and images (``per_image``: ``[B, heads]``). ``patch_size``: the grid's pixel stride (patch;
  ResNet stride x patch for hybrids; 16 for T2T-ViT).

  Raises:
    ValueError: not ``[B, H, N, N]``, NaN/inf or negative weights, bad
      ``grid``/``patch_size``/``num_prefix_tokens``, ``N`` not matching, or a query with zero
      weight on the patches.
  """
  attention = np.asarray(attention)
  _check_attention(attention, 'attention')
  grid, num_prefix_tokens = _checks.pair(grid, 'grid'), _checks.prefix(num_prefix_tokens)
  _checks.tokens_match(attention.shape[-1], grid, num_prefix_tokens, 'attention')
  distances = patch_distances(grid, patch_size)
  out = np.empty(attention.shape[:2], dtype=np.float64)
  for b in range(attention.shape[0]):
    weights = attention[b, :, num_prefix_tokens:, num_prefix_tokens:].astype(np.float64)
    sums = weights.sum(axis=-1)
    if np.any(sums <= 0):
      raise ValueError('attention has a patch query with zero weight on every patch key; the '
                       'mean distance over patches is undefined for it.')
    out[b] = ((weights * distances).sum(axis=-1) / sums).mean(axis=-1)
  return out if per_image else out.mean(axis=0)


def mean_attention_distances(attentions: AttentionStack, grid: Any, patch_size: Any,
                             num_prefix_tokens: int) -> np.ndarray:
  """:func:`mean_attention_distance` of every layer: ``[L, heads]`` float64 pixels."""
  return np.stack([mean_attention_distance(layer, grid, patch_size, num_prefix_tokens)
                   for layer in _layers(attentions)])
