"""What the attention weights of a ViT say: attention rollout and mean attention distance.

Everything here takes arrays (NumPy or JAX; converted with ``np.asarray``) and returns NumPy
arrays; nothing calls a model. The attention weights are those the models sow in
``'intermediates'``: per encoder layer ``[B, heads, N, N]`` (rows are the queries, columns the
keys; each row sums to 1), with ``N = num_prefix_tokens + gh * gw`` tokens: the prefix tokens
(the class token of ``classifier='token'`` ViTs and of T2T-ViT) first, then the patch tokens
of the ``gh x gw`` token grid flattened row-major (token ``num_prefix_tokens + r * gw + c`` is
grid row ``r``, column ``c``).

Sources:

* Attention rollout: Abnar & Zuidema, "Quantifying Attention Flow in Transformers" (ACL 2020),
  section 3, as the ViT paper (Dosovitskiy et al., ICLR 2021) uses it for Fig. 6 and 14
  (appendix D.8: attention averaged over the heads, then the layers' matrices multiplied).
* Mean attention distance: the ViT paper's Fig. 7 (right) and appendix D.7: "the distance
  between the query pixel and all other pixels, weighted by the attention weight", averaged over
  128 images, per head and layer, in pixels. The paper gives no code; this follows the common
  reproduction (Gosthipaty & Paul, "Investigating Vision Transformer representations",
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
  """Attention rollout (Abnar & Zuidema 2020, eq. in section 3; the ViT paper's Fig. 6/14).

  For every layer ``l`` (bottom first): the heads are fused into ``A_l`` ``[B, N, N]`` (their
  mean by default); with ``residual`` the residual connection is accounted for as
  ``A_l <- 0.5 A_l + 0.5 I``; each row is divided by its sum (a no-op for the mean of softmax
  rows, needed after 'max'/'min'); then ``R = A_L @ ... @ A_2 @ A_1``. ``R[b, i, j]`` is how much
  of output token ``i`` of the top layer comes from input token ``j`` (rows sum to 1). Computed
  in float64.

  Args:
    attentions: the per-layer attention weights, a sequence of ``L`` arrays ``[B, heads, N, N]``
      (queries x keys, rows summing to 1) in layer order, or one ``[L, B, heads, N, N]`` array.
    residual: add the identity (residual-aware rollout, as the paper); False multiplies the raw
      fused attention matrices.
    head_fusion: one of :data:`HEAD_FUSIONS`.

  Returns:
    ``[B, N, N]`` float32, rows summing to 1.

  Raises:
    ValueError: no layers, layers of different shapes, a layer not ``[B, H, N, N]``, NaN/inf or
      negative weights, an unknown ``head_fusion``, or (without ``residual``) a fused row that
      sums to 0.
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
  """The rollout's map over the image: what the output attends to, per patch.

  With a class token (``num_prefix_tokens >= 1``; it is token 0) the class token's row of the
  rollout over the patch tokens (prefix columns dropped); without one (``classifier='gap'`` or
  ``'map'``, ``num_prefix_tokens=0``) the mean of all rows (every output token, as the mean
  pooling sees them). Each map is divided by its maximum (max 1; an all-zero map stays zero).

  Args:
    rollout_matrix: ``[B, N, N]`` from :func:`rollout`.
    grid: the token grid ``(gh, gw)`` (or one int for a square grid), ``gh * gw`` patch tokens.
    num_prefix_tokens: tokens before the patch tokens (1: class token; 0: none).

  Returns:
    ``[B, gh, gw]`` float32 in [0, 1], row-major as the tokens.

  Raises:
    ValueError: ``rollout_matrix`` not ``[B, N, N]``, a bad ``grid`` / ``num_prefix_tokens``, or
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
  """The class token's attention in every layer (no rollout), as maps over the patch grid.

  Per layer the heads are fused (:func:`rollout`'s ``head_fusion``); the class token's row over
  the patch tokens (or, with ``num_prefix_tokens=0``, the mean of all rows) is laid out on the
  grid and divided by its maximum.

  Args:
    attentions: as for :func:`rollout`: ``L`` arrays ``[B, heads, N, N]`` or ``[L, B, heads, N,
      N]``.
    grid: the token grid ``(gh, gw)`` or one int.
    num_prefix_tokens: 1 with a class token, 0 without.
    head_fusion: one of :data:`HEAD_FUSIONS`.

  Returns:
    ``[L, B, gh, gw]`` float32 in [0, 1].

  Raises:
    ValueError: as :func:`rollout` and :func:`class_token_map`.
  """
  _check_fusion(head_fusion)
  grid, num_prefix_tokens = _checks.pair(grid, 'grid'), _checks.prefix(num_prefix_tokens)
  layers = _layers(attentions)
  return np.stack([_token_maps(_fuse(layer, head_fusion), grid, num_prefix_tokens,
                               f'attentions[{i}]') for i, layer in enumerate(layers)])


def upsample(maps: Any, size: Any) -> np.ndarray:
  """Bilinear upsampling of token maps to the image: ``[..., gh, gw]`` -> ``[..., H, W]``.

  Each map value sits at the centre of its ``H/gh x W/gw`` cell (``scipy.ndimage.zoom``,
  ``order=1, grid_mode=True``), edges held constant. Used to overlay maps on images.

  Args:
    maps: ``[..., gh, gw]`` float.
    size: ``(H, W)`` in pixels, or one int.

  Returns:
    ``[..., H, W]`` float32.
  """
  maps = np.asarray(maps, dtype=np.float32)
  if maps.ndim < 2:
    raise ValueError(f'maps must have shape [..., gh, gw], got {maps.shape}')
  height, width = _checks.pair(size, 'size')
  zoom = (1.0,) * (maps.ndim - 2) + (height / maps.shape[-2], width / maps.shape[-1])
  out = ndimage.zoom(maps, zoom, order=1, mode='nearest', grid_mode=True)
  return out[..., :height, :width]


def patch_distances(grid: Any, patch_size: Any) -> np.ndarray:
  """Euclidean distances in pixels between the centres of the grid's patches.

  Patch ``(r, c)`` (token ``r * gw + c``) has its centre at ``((r + 0.5) ph, (c + 0.5) pw)``
  pixels, ``(ph, pw) = patch_size`` (the stride of the token grid in pixels).

  Returns:
    ``[gh * gw, gh * gw]`` float64, in pixels.
  """
  gh, gw = _checks.pair(grid, 'grid')
  ph, pw = _checks.pair(patch_size, 'patch_size')
  rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing='ij')
  centres = np.stack([(rows.ravel() + 0.5) * ph, (cols.ravel() + 0.5) * pw], axis=-1)
  return np.sqrt(((centres[:, None, :] - centres[None, :, :]) ** 2).sum(-1))


def mean_attention_distance(attention: Any, grid: Any, patch_size: Any, num_prefix_tokens: int,
                            *, per_image: bool = False) -> np.ndarray:
  """Mean attention distance of every head of one layer, in pixels (ViT paper Fig. 7 right).

  Precisely: the prefix tokens (class token) are dropped as queries and as keys. For each image
  ``b``, head ``h`` and patch query ``q``, the weights ``a[b, h, q, k]`` over the ``gh * gw``
  patch keys are divided by their sum (so they sum to 1 over the patches), and
  ``d[b, h, q] = sum_k a[b, h, q, k] * dist(q, k)``, with ``dist`` the Euclidean distance in
  pixels between the patch centres (:func:`patch_distances`: patch ``(r, c)`` at
  ``((r + 0.5) ph, (c + 0.5) pw)``; a query's own patch counts at distance 0). The result is the
  mean of ``d`` over the queries and the images. Computed in float64, one image at a time.

  Args:
    attention: ``[B, heads, N, N]`` attention weights of one layer (queries x keys), ``N =
      num_prefix_tokens + gh * gw``.
    grid: the token grid ``(gh, gw)`` or one int.
    patch_size: the pixel stride of the token grid, ``(ph, pw)`` or one int: the patch size for
      a ViT, ResNet stride x patch size for a hybrid, 16 for a T2T-ViT backbone (soft splits of
      stride 4, 2, 2). Distances scale with it.
    num_prefix_tokens: tokens before the patches (1: class token; 0: ``'gap'``/``'map'``).
    per_image: return ``[B, heads]`` (mean over queries only), e.g. to average several batches.

  Returns:
    ``[heads]`` float64 in pixels (``[B, heads]`` with ``per_image``).

  Raises:
    ValueError: ``attention`` not ``[B, H, N, N]``, NaN/inf or negative weights, a bad
      ``grid``/``patch_size``/``num_prefix_tokens``, ``N`` not matching them, or a patch query
      with zero total weight on the patches.
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
  """:func:`mean_attention_distance` of every layer: ``[L, heads]`` float64 pixels.

  Args:
    attentions: ``L`` arrays ``[B, heads, N, N]`` or one ``[L, B, heads, N, N]``.
    grid, patch_size, num_prefix_tokens: as :func:`mean_attention_distance`.
  """
  return np.stack([mean_attention_distance(layer, grid, patch_size, num_prefix_tokens)
                   for layer in _layers(attentions)])
