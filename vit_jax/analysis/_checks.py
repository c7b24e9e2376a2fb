"""Input checks shared by the analysis functions: token grids, patch sizes, prefix tokens."""

from __future__ import annotations

import numbers
from typing import Any, Tuple

import numpy as np


def pair(value: Any, name: str) -> Tuple[int, int]:
  """``value`` (a positive int or a pair of them) as ``(rows, columns)``; ValueError otherwise."""
  items = tuple(value) if isinstance(value, (tuple, list, np.ndarray)) else (value, value)
  if len(items) != 2 or not all(
      isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in items):
    raise ValueError(f'{name} must be a positive int or a pair (rows, columns) of positive ints, '
                     f'got {value!r}')
  return int(items[0]), int(items[1])


def prefix(value: Any) -> int:
  """``num_prefix_tokens`` checked: a non-negative int."""
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
    raise ValueError(f'num_prefix_tokens must be a non-negative int (1 for a class token, 0 for '
                     f"classifier='gap'/'map'), got {value!r}")
  return int(value)


def tokens_match(tokens: int, grid: Tuple[int, int], num_prefix_tokens: int, what: str) -> None:
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
        f'the input (image size / patch size) and 1 prefix token for a class token, 0 for '
        f"classifier='gap'/'map'.")


def finite(array: np.ndarray, what: str) -> None:
  """ValueError if ``array`` holds a NaN or an infinity."""
  if not np.all(np.isfinite(array)):
    raise ValueError(f'{what} contains NaN or infinite values; check the model and its inputs.')
