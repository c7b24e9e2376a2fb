"""Resampling a grid of vectors to another grid size, one separable interpolation for the
learned position table (in the model and when loading) and FlexiViT's patch-embedding resize:
each axis by a ``[new, old]`` float64 matrix built in NumPy from the static sizes
(:func:`resize_matrix`), a constant inside ``jit``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: Interpolations of :func:`resize_matrix` (each one's source there): the official fine-tuning
#: resize, and torch's bicubic without and with antialias (timm's resampling; its default: with).
RESIZE_METHODS = ('linear_corners', 'bicubic', 'bicubic_antialias')


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
  """Keys' cubic convolution kernel with parameter ``a`` (torch: -0.75, PIL and antialias: -0.5)."""
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def resize_matrix(old: int, new: int, method: str) -> np.ndarray:
  """The float64 ``[new, old]`` matrix ``W`` with ``W @ x`` the 1-D resize of ``x`` ``[old]`` to
  ``[new]`` by ``method`` (:data:`RESIZE_METHODS`); each row sums to 1.

  'linear_corners': sample ``i`` at ``i (old - 1) / (new - 1)`` (0 for ``new=1``), linear
  between the two nearest (``scipy.ndimage.zoom(order=1)``, which in its default mode returns 0
  where the product rounds past the last sample, e.g. 32 -> 16: clamped here). 'bicubic':
  torch's ``F.interpolate(mode='bicubic', align_corners=False)``: its kernel (``a = -0.75``) at
  the half-pixel centres ``(i + 0.5) old / new - 0.5``, indices clamped at the edges.
  'bicubic_antialias': the same with ``antialias=True`` (PIL's filter): ``a = -0.5``, widened by
  ``old / new`` when downsampling, the taps outside the input dropped and the rest renormalised.
  ValueError: an unknown method or a size < 1.
  """
  if method not in RESIZE_METHODS:
    raise ValueError(f'Unknown resize method {method!r}: use one of {RESIZE_METHODS}.')
  old, new = int(old), int(new)
  if old < 1 or new < 1:
    raise ValueError(f'Cannot resize {old} samples to {new}: both sizes must be at least 1.')
  weights = np.zeros((new, old), np.float64)
  rows = np.arange(new)
  if method == 'linear_corners':
    step = (old - 1) / (new - 1) if new > 1 else 0.0
    coord = np.minimum(rows * step, old - 1)
    low = np.floor(coord).astype(np.int64)
    frac = coord - low
    np.add.at(weights, (rows, low), 1.0 - frac)
    np.add.at(weights, (rows, np.minimum(low + 1, old - 1)), frac)
  elif method == 'bicubic':
    coord = (rows + 0.5) * (old / new) - 0.5
    low = np.floor(coord)
    for tap in range(-1, 3):
      np.add.at(weights, (rows, np.clip(low + tap, 0, old - 1).astype(np.int64)),
                _cubic(coord - low - tap, -0.75))
  else:  # 'bicubic_antialias'
    scale = old / new
    support, stretch = (2.0 * scale, 1.0 / scale) if scale >= 1.0 else (2.0, 1.0)
    for i in range(new):
      centre = scale * (i + 0.5)
      lo = max(int(centre - support + 0.5), 0)  # int(): truncation, as torch's cast.
      hi = min(int(centre + support + 0.5), old)
      taps = _cubic((np.arange(lo, hi) - centre + 0.5) * stretch, -0.5)
      total = taps.sum()
      weights[i, lo:hi] = taps / total if total != 0.0 else taps
  return weights


def resize_grid(grid, new_hw: Sequence[int], method: str):
  """``grid`` ``[h, w, ...]`` resampled to ``[new_h, new_w, ...]`` by ``method``
  (:data:`RESIZE_METHODS`), rows then columns, in ``grid``'s dtype. A NumPy array is computed in
  float64 (the loaders); a JAX array (traced or not) in float32 or wider at the highest matmul
  precision. ValueError: not at least 2-D, a bad size or method."""
  new_h, new_w = (int(s) for s in new_hw)
  if not isinstance(grid, jax.Array):
    grid = np.asarray(grid)
  if grid.ndim < 2:
    raise ValueError(f'resize_grid expects [height, width, ...], got shape {grid.shape}')
  h, w = grid.shape[:2]
  wy = resize_matrix(h, new_h, method)
  wx = resize_matrix(w, new_w, method)
  numpy = isinstance(grid, np.ndarray)
  xp = np if numpy else jnp
  dtype = np.float64 if numpy else jnp.promote_types(grid.dtype, jnp.float32)
  precision = {} if numpy else {'precision': jax.lax.Precision.HIGHEST}
  out = grid.astype(dtype)
  if new_h != h:
    out = xp.tensordot(wy.astype(dtype), out, axes=(1, 0), **precision)
  if new_w != w:
    out = xp.moveaxis(xp.tensordot(wx.astype(dtype), out, axes=(1, 1), **precision), 0, 1)
  return out.astype(grid.dtype)


def square_side(tokens: int) -> Optional[int]:
  """The side of a square grid of ``tokens`` tokens, or None when they make none."""
  side = math.isqrt(max(int(tokens), 0))
  return side if tokens > 0 and side * side == tokens else None


def resample_posemb(posemb, new_grid: Sequence[int], *, num_prefix_tokens: int,
                    old_grid: Optional[Sequence[int]] = None, method: str = 'linear_corners'):
  """A position table ``[1, P + h * w, D]`` (``P = num_prefix_tokens`` rows first: class token,
  registers; kept) with its row-major ``(h, w)`` grid resampled (:func:`resize_grid`) to
  ``new_grid`` ``(rows, columns)``: ``[1, P + rows * columns, D]``, in its dtype (NumPy: float64
  maths, JAX: float32). ``old_grid`` None: square. ValueError: a grid that does not match the
  rows, or is not square when not given; a bad method."""
  if np.ndim(posemb) != 3 or posemb.shape[0] != 1:
    raise ValueError(f'A position table is [1, tokens, width], got shape {np.shape(posemb)}')
  prefix = int(num_prefix_tokens)
  tokens = posemb.shape[1] - prefix
  if old_grid is None:
    side = square_side(tokens)
    if side is None:
      raise ValueError(f'The position table has {tokens} grid rows (after {prefix} prefix '
                       'rows), not a square grid: give its grid (rows, columns).')
    old_grid = (side, side)
  gh, gw = (int(g) for g in old_grid)
  if gh * gw != tokens:
    raise ValueError(f'The position table grid {gh}x{gw} does not match its {tokens} grid rows '
                     f'(after {prefix} prefix rows).')
  new_h, new_w = (int(g) for g in new_grid)
  grid = posemb[0, prefix:].reshape(gh, gw, -1)
  grid = resize_grid(grid, (new_h, new_w), method).reshape(1, new_h * new_w, -1)
  concat = np.concatenate if isinstance(posemb, np.ndarray) else jnp.concatenate
  return concat([posemb[:, :prefix], grid], axis=1) if prefix else grid
