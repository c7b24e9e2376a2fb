"""What the embeddings of a ViT learned: position-embedding similarity and the principal
components of the patch-embedding filters (the ViT paper's Fig. 7, centre and left).

Sources: Dosovitskiy et al., "An Image is Worth 16x16 Words" (ICLR 2021), section 4.5 and Fig. 7:
"the top principal components of the learned embedding filters" (left, ViT-L/32) and "similarity
of position embeddings ... cosine similarity between the position embedding of the patch with
the indicated row and column and the position embeddings of all other patches" (centre).
Arrays in (NumPy or JAX), NumPy arrays out; nothing calls a model.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from vit_jax.analysis import _checks


def posemb_similarity(pos_embedding: Any, grid: Any, num_prefix_tokens: int) -> np.ndarray:
  """Cosine similarity of every patch's position embedding with every other's (Fig. 7 centre).

  The first ``num_prefix_tokens`` rows (the class token's) are left out; the remaining
  ``gh * gw`` rows are the patches in row-major order. ``S[r, c, r2, c2]`` is the cosine
  similarity of patch ``(r, c)``'s embedding with patch ``(r2, c2)``'s, computed in float64.

  Args:
    pos_embedding: ``[1, T, D]`` or ``[T, D]``, ``T = num_prefix_tokens + gh * gw``: e.g.
      ``Transformer/posembed_input/pos_embedding`` of a ViT (``num_prefix_tokens=1`` with
      ``classifier='token'``, else 0), :func:`vit_jax.models.vit.posemb_sincos_2d` (0), or a
      T2T-ViT's ``constants/pos_embed`` (1).
    grid: the token grid ``(gh, gw)`` or one int.
    num_prefix_tokens: rows before the patches.

  Returns:
    ``[gh, gw, gh, gw]`` float32 in [-1, 1]; the diagonal ``S[r, c, r, c]`` is 1.

  Raises:
    ValueError: a bad shape, ``T`` not matching ``grid`` and ``num_prefix_tokens``, NaN/inf, or
      a patch whose embedding is all zeros (no direction: cosine undefined).
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
  """Principal components of the patch-embedding filters (Fig. 7 left).

  The ``D`` filters of the embedding convolution, each flattened to a ``P*P*C`` vector, are
  centred (their mean filter subtracted) and decomposed by SVD (``X = U S V^T``, ``X`` the
  ``[D, P*P*C]`` centred filters); the components are the rows of ``V^T`` (unit norm, in order
  of decreasing variance), each given the sign that makes its largest-magnitude entry positive
  (the SVD's sign is arbitrary). Computed in float64.

  Args:
    kernel: ``[Ph, Pw, C, D]`` (``embedding/kernel`` of a ViT: ``C`` is 3 for RGB, 1 for
      grayscale, the ResNet's width for a hybrid).
    n: how many components; fewer are returned when ``min(D, Ph*Pw*C) < n``.

  Returns:
    ``(components [k, Ph, Pw, C] float32, explained_variance_ratio [k] float64)``,
    ``k = min(n, D, Ph*Pw*C)``; a ratio is the component's share ``s_i^2 / sum_j s_j^2`` of the
    filters' total variance (the ratios of all components sum to 1; zero when the filters are
    all equal).

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
