"""The message for variables that do not fit a model: counts, the first entries, and a hint.

Shared by the model families' converters (:mod:`.t2t_torch`) and the checkpoint
readers (:mod:`vit_jax.checkpoint`), so that every "does not fit" error reads the same::

  The checkpoint does not fit the model:
    missing keys (2): params/head/kernel, params/head/bias
    shape mismatches (1): params/cls: checkpoint (1, 1, 64), model (1, 1, 32)
    The checkpoint is a ViT with patch_size=16, hidden_size=64, ...
"""

from __future__ import annotations

from typing import Optional, Sequence

#: Entries listed per kind of problem; the rest are counted.
MAX_LISTED = 8


def _listing(items: Sequence[str], sep: str) -> str:
  shown = sep.join(items[:MAX_LISTED])
  return shown + (f'{sep}... and {len(items) - MAX_LISTED} more' if len(items) > MAX_LISTED
                  else '')


def mismatch_report(header: str, missing: Sequence[str], unexpected: Sequence[str],
                    mismatched: Sequence[str], hint: Optional[str] = None) -> str:
  """The message of a checkpoint that does not fit: counts, the first entries, and a hint.

  Args:
    header: the first line (what does not fit what).
    missing: names the model has and the checkpoint lacks.
    unexpected: names (with shapes) the checkpoint has and the model lacks.
    mismatched: ``'<name>: checkpoint <shape>, model <shape>'`` entries.
    hint: a last line, e.g. the architecture the checkpoint implies and what to do.

  Returns:
    The lines joined with newlines; each kind shows its count and its first
    :data:`MAX_LISTED` entries.
  """
  lines = [header]
  if missing:
    lines.append(f'  missing keys ({len(missing)}): {_listing(missing, ", ")}')
  if unexpected:
    lines.append(f'  unexpected keys ({len(unexpected)}): {_listing(unexpected, ", ")}')
  if mismatched:
    lines.append(f'  shape mismatches ({len(mismatched)}): {_listing(mismatched, "; ")}')
  if hint:
    lines.append(f'  {hint}')
  return '\n'.join(lines)
