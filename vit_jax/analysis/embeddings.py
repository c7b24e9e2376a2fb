"""What the embeddings of a ViT learned: position-embedding similarity and the principal
components of the patch-embedding filters (ViT paper, section 4.5 and Fig. 7 centre and left).

Arrays in (NumPy or JAX), NumPy out; nothing calls a model.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from vit_jax.analysis import _checks


def posemb_similarity(pos_embedding: Any, grid: Any, num_prefix_tokens: int) -> np.ndarray:
  """Cosine similarity of every patch's position embedding with every other's (Fig. 7 centre).

  ``pos_embedding``: ``[1, T, D]`` or ``[T, D]``, ``T = num_prefix_tokens + gh * gw`` (the
  prefix rows are left out; patches row-major). Returns ``[gh, gw, gh, gw]`` float32 in [-1, 1]
  (float64 inside).

  Raises:
    ValueError: a bad shape, ``T`` not matching, NaN/inf, or an all-zero patch embedding.
  """
  table = np.asarray(pos_embedding)
  if table.ndim == 3 and table.shape[0] == 1:
    table = table[0]
  if table.ndim != 2:
    raise ValueError(f'pos_embedding must have shape [1, T, D] or [T, D], got '
                     f'{np.shape(pos_embedding)}')
  grid, num_prefix_tokens = _checks.pair(grid, 'grid'), _checks.prefix(num_prefix_tokens)
  _checks.tokens_match(table.shape[0], grid, num_prefix_tokens, 'pos_embedding')
  _checks.finite(table, 'pos_embedding')
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
  """Principal components of the patch-embedding filters ``[Ph, Pw, C, D]`` (Fig. 7 left).

  The ``D`` flattened filters are centred and decomposed by SVD (float64); components are rows
  of ``V^T``, signed so the largest-magnitude entry is positive. Returns ``(components
  [k, Ph, Pw, C] float32, explained_variance_ratio [k] float64)``, ``k = min(n, D, Ph*Pw*C)``.

  Raises:
    ValueError: ``kernel`` not rank 4, NaN/inf, or ``n`` not a positive int.
  """
  kernel = np.asarray(kernel)
  if kernel.ndim != 4:
    raise ValueError(f'kernel must be the patch-embedding kernel [Ph, Pw, C, D], got shape '
                     f'{kernel.shape}')
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
    raise ValueError(f'n must be a positive int, got {n!r}')
  _checks.finite(kernel, 'kernel')
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
