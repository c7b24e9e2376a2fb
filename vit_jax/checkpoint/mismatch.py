"""Variables that do not fit a model: :class:`ModelMismatchError` and its message
(:func:`mismatch_report`), the same for every reader."""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

#: Entries listed per kind of problem; the rest are counted.
MAX_LISTED = 8


class ModelMismatchError(ValueError):
  """Variables that do not fit a model (message: :func:`mismatch_report`); ``implied``: the
  architecture they imply, in words (``describe_architecture``), or None."""

  def __init__(self, message: str, implied: Optional[str] = None):
    super().__init__(message)
    self.implied = implied


def diff(have: Mapping[str, Any], want: Mapping[str, Any],
         names: Tuple[str, str] = ('checkpoint', 'model')) -> Tuple[List[str], ...]:
  """``(missing, unexpected, mismatched)`` of flat trees ``{'a/b': array or ShapeDtypeStruct}``
  for :func:`mismatch_report`, ``names`` naming ``have`` and ``want`` in the mismatches."""
  shape = lambda tree, k: tuple(np.shape(tree[k]))
  return ([k for k in want if k not in have],
          [f'{k} {shape(have, k)}' for k in have if k not in want],
          [f'{k}: {names[0]} {shape(have, k)}, {names[1]} {shape(want, k)}'
           for k in want if k in have and shape(have, k) != shape(want, k)])


def mismatch_report(header: str, missing: Sequence[str], unexpected: Sequence[str],
                    mismatched: Sequence[str], hint: Optional[str] = None, *,
                    mismatched_kind: str = 'shape mismatches') -> str:
  """``header`` (what does not fit what), then per kind (as :func:`diff` gives them; or
  ``mismatched_kind``, e.g. 'field mismatches') its count and first :data:`MAX_LISTED`
  entries; then ``hint``."""
  lines = [header]
  for kind, items, sep in (('missing keys', missing, ', '), ('unexpected keys', unexpected, ', '),
                           (mismatched_kind, mismatched, '; ')):
    if items:
      more = f'{sep}... and {len(items) - MAX_LISTED} more' if len(items) > MAX_LISTED else ''
      lines.append(f'  {kind} ({len(items)}): {sep.join(items[:MAX_LISTED])}{more}')
  return '\n'.join(lines + ([f'  {hint}'] if hint else []))
