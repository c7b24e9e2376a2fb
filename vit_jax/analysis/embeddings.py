"""Position-embedding similarity and the patch-embedding filters' principal components (ViT
paper, section 4.5, Fig. 7 centre and left); arrays in, NumPy out."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from vit_jax.analysis import attention_maps


def posemb_similarity(pos_embedding: Any, grid: Any, num_prefix_tokens: int) -> np.ndarray:
  """``[gh, gw, gh, gw]`` float32 cosine similarities of the patches' position embeddings
  (``[1, T, D]`` or ``[T, D]``, ``num_prefix_tokens`` rows first: one per class token and
  register, none with timm's ``no_embed_class``, :func:`vit_jax.models.vit.posemb_prefix_rows`).
  ValueError: bad shapes, values, zero rows."""
  table = np.asarray(pos_embedding)
  if table.ndim == 3 and table.shape[0] == 1:
    table = table[0]
  if table.ndim != 2:
    raise ValueError(f'pos_embedding must have shape [1, T, D] or [T, D], got '
                     f'{np.shape(pos_embedding)}')
  grid = attention_maps.as_pair(grid, 'grid')
  num_prefix_tokens = attention_maps.as_prefix(num_prefix_tokens)
  attention_maps.check_tokens(table.shape[0], grid, num_prefix_tokens, 'pos_embedding')
  attention_maps.check_finite(table, 'pos_embedding')
  patches = table[num_prefix_tokens:].astype(np.float64)
  norms = np.linalg.norm(patches, axis=-1, keepdims=True)
  if np.any(norms == 0):
    zero = np.flatnonzero(norms[:, 0] == 0)[:5].tolist()
    raise ValueError(f'pos_embedding has all-zero rows for patches {zero} (row-major); their '
                     f'cosine similarity is undefined.')
  unit = patches / norms
  similarity = np.clip(unit @ unit.T, -1.0, 1.0)
  return similarity.reshape(*grid, *grid).astype(np.float32)


def embedding_filter_components(kernel: Any, n: int = 28) -> Tuple[np.ndarray, np.ndarray]:
  """``(components [k, Ph, Pw, C] float32, explained variance ratio [k])`` of the centred
  filters ``[Ph, Pw, C, D]`` by SVD, each signed so its largest entry is positive, ``k <= n``.
  ValueError: not rank 4, NaN/inf, ``n`` not a positive int."""
  kernel = np.asarray(kernel)
  if kernel.ndim != 4:
    raise ValueError(f'kernel must be the patch-embedding kernel [Ph, Pw, C, D], got shape '
                     f'{kernel.shape}')
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
    raise ValueError(f'n must be a positive int, got {n!r}')
  attention_maps.check_finite(kernel, 'kernel')
  ph, pw, c, d = kernel.shape
  filters = kernel.reshape(ph * pw * c, d).T.astype(np.float64)  # [D, P*P*C]
  filters = filters - filters.mean(axis=0, keepdims=True)
  _, singular, vt = np.linalg.svd(filters, full_matrices=False)
  k = min(int(n), vt.shape[0])
  variance = singular ** 2
  total = variance.sum()
  ratio = variance[:k] / total if total > 0 else np.zeros(k)
  components = vt[:k]
  peaks = components[np.arange(k), np.abs(components).argmax(axis=1)]
  components = components * np.where(peaks < 0, -1.0, 1.0)[:, None]
  return components.reshape(k, ph, pw, c).astype(np.float32), ratio
