"""Variable trees: flat ``'a/b/c'`` names <-> nested dicts, whether a checkpoint fits a model,
and non-finite values (what names mean: :mod:`.vit_shapes`, :mod:`.t2t_torch`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.checkpoint import t2t_torch
from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint.mismatch import ModelMismatchError, diff, mismatch_report
from vit_jax.models import layout


def flatten_params(tree: Mapping, sep: str = '/') -> Dict[str, Any]:
  """``{'a/b/c': leaf}`` of a nested mapping (insertion order; leaves unboxed, empty
  sub-mappings dropped); ValueError for a key that is not a str or contains ``sep``."""
  flat: Dict[str, Any] = {}

  def visit(node, prefix):
    for key, value in node.items():
      if not isinstance(key, str) or sep in key:
        raise ValueError(f'Cannot flatten key {key!r} (must be a str without {sep!r})')
      path = f'{prefix}{sep}{key}' if prefix else key
      if isinstance(value, Mapping):
        visit(value, path)
      else:
        flat[path] = layout.unbox(value)

  if not isinstance(tree, Mapping):
    raise ValueError(f'flatten_params expects a mapping, got {type(tree).__name__}')
  visit(tree, '')
  return flat


def shapes(variables: Mapping) -> Dict[str, Tuple[int, ...]]:
  """``'/'``-joined variable names -> shapes."""
  return {k: tuple(np.shape(v)) for k, v in flatten_params(variables).items()}


def unflatten_params(flat: Mapping[str, Any], sep: str = '/') -> Dict[str, Any]:
  """``{'a/b': x}`` -> ``{'a': {'b': x}}``; ValueError for a path that is both a leaf and a
  prefix of another, or has empty components."""
  tree: Dict[str, Any] = {}
  for path, value in flat.items():
    parts = path.split(sep)
    if any(not p for p in parts):
      raise ValueError(f'Invalid parameter path {path!r}')
    node = tree
    for part in parts[:-1]:
      child = node.setdefault(part, {})
      if not isinstance(child, dict):
        raise ValueError(f'{path!r} conflicts with the leaf {part!r} of another path')
      node = child
    if parts[-1] in node:
      raise ValueError(f'Duplicate or conflicting parameter path {path!r}')
    node[parts[-1]] = value
  return tree


def describe_architecture(variables: Mapping) -> Optional[str]:
  """The ViT or T2T-ViT fields the shapes of ``variables`` (``{'params', **collections}``,
  arrays or ``ShapeDtypeStruct``) imply, in a sentence for error messages; None if neither."""
  shapes = {k: tuple(int(d) for d in np.shape(v))
            for k, v in flatten_params(variables).items()}
  return vit_shapes.describe_architecture(shapes) or t2t_torch.describe_architecture(shapes)


def check_fits(variables: Mapping, expected: Mapping, *, what: str = 'The checkpoint') -> None:
  """Checks that ``variables`` has exactly the keys and shapes of ``expected`` (``model.init``
  or its ``eval_shape``, boxed or plain); ``what`` names ``variables``. Raises
  ModelMismatchError (a ValueError) listing what differs, with the fix."""
  variables, expected = layout.unbox(variables), layout.unbox(expected)
  missing, unexpected, mismatched = diff(flatten_params(variables), flatten_params(expected))
  if not (missing or unexpected or mismatched):
    return
  header = f'{what} does not fit the model:'
  scanned = layout.is_scanned(variables.get('params', {}))
  if scanned != layout.is_scanned(expected.get('params', {})):
    block_layout = 'scanned' if scanned else 'per-layer'
    conversion = 'unscan_params' if scanned else 'scan_params'
    header += (f' it is in the {block_layout} block layout; convert it '
               f'with vit_jax.models.{conversion} first.')
  implied = hint = describe_architecture(variables)
  if hint:
    hint += ' Build the model with these values.'
  if not missing and not unexpected and all(vit_shapes.POSEMB_KEY in m or 'pos_embed' in m
                                            for m in mismatched):
    hint = _prefix_rows_hint(flatten_params(variables), flatten_params(expected)) or (
        'Only the position table differs: the checkpoint is for another image size. '
        'Evaluate at the size it was trained at, build the model with posemb_grid=(rows, '
        'columns) of its table to resample it in the model, or use init_for_finetuning '
        '(--config.init_from) to resize it for a new resolution.')
  raise ModelMismatchError(mismatch_report(header, missing, unexpected, mismatched, hint), implied)


def _prefix_rows_hint(have: Mapping[str, Any], want: Mapping[str, Any]) -> Optional[str]:
  """What to build where the position tables of the flat trees differ by exactly the class
  token and register rows (timm's ``no_embed_class`` on one side only); else None."""
  if vit_shapes.POSEMB_KEY not in have or vit_shapes.POSEMB_KEY not in want:
    return None
  rows, model_rows = (np.shape(t[vit_shapes.POSEMB_KEY])[1] for t in (have, want))
  registers = np.shape(want['params/registers'])[1] if 'params/registers' in want else 0
  prefix = ('params/cls' in want) + int(registers)
  if not prefix or abs(rows - model_rows) != prefix:
    return None
  covers = ('the patch grid only (no_embed_class=True)' if rows < model_rows else
            f'the patch grid and the {prefix} class-token / register rows in front '
            '(no_embed_class=False)')
  return (f'Only the position table differs, by its {prefix} class-token / register rows: '
          f"the checkpoint's covers {covers} (timm's no_embed_class), not another image size. "
          f'Build the model with no_embed_class={rows < model_rows}.')


def non_finite(tree: Any) -> List[str]:
  """The names (``'params/head/kernel'``) of the floating-point leaves of ``tree`` holding a
  NaN or an Inf, in tree order (JAX arrays checked on their devices, in one jitted call)."""
  leaves = []
  for p, x in jax.tree_util.tree_flatten_with_path(layout.unbox(tree))[0]:
    dtype = x.dtype if hasattr(x, 'dtype') else np.asarray(x).dtype
    if jnp.issubdtype(dtype, jnp.inexact):
      leaves.append((jax.tree_util.keystr(p, simple=True, separator='/'), x))
  on_devices = [(n, x) for n, x in leaves if isinstance(x, jax.Array)]
  bad = {n for n, x in leaves if not isinstance(x, jax.Array) and not np.isfinite(x).all()}
  if on_devices:
    finite = jax.jit(lambda xs: [jnp.isfinite(x).all() for x in xs])([x for _, x in on_devices])
    bad |= {n for (n, _), ok in zip(on_devices, jax.device_get(finite)) if not ok}
  return [n for n, _ in leaves if n in bad]


def non_finite_message(what: str, names: List[str]) -> str:
  """``'<what> holds NaN or Inf values in <names> (first 4 and the count)'``, for errors."""
  more = f' and {len(names) - 4} more' if len(names) > 4 else ''
  shown = ', '.join(names[:4]) + more
  arrays = 'array' if len(names) == 1 else 'arrays'
  return f'{what} holds NaN or Inf values in {shown} ({len(names)} {arrays})'
