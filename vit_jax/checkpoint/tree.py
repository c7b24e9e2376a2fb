"""Variable trees: flat ``'a/b/c'`` names <-> nested dicts, and whether a checkpoint fits a model.

What names mean is owned by :mod:`.vit_shapes` (ViT) and :mod:`.t2t_torch` (T2T-ViT).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.checkpoint import t2t_torch
from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint.mismatch import mismatch_report
from vit_jax.models import layout

__all__ = ['check_fits', 'describe_architecture', 'flatten_params', 'mismatch_report',
           'non_finite', 'non_finite_message', 'unflatten_params']


def flatten_params(tree: Mapping, sep: str = '/') -> Dict[str, Any]:
  """Flattens a nested mapping into ``{'a/b/c': leaf}`` (keys in insertion order).

  Args:
    tree: nested ``dict``/``FrozenDict`` (e.g. ``variables['params']``); leaves are anything that
      is not a mapping. Empty sub-mappings are dropped (they cannot be represented). Leaves
      boxed with logical axis names (``nn.LogicallyPartitioned``, as ``model.init`` returns
      them) are unboxed (:func:`vit_jax.models.layout.unbox`).
    sep: separator.

  Returns:
    A flat dict of plain (unboxed) leaves.

  Raises:
    ValueError: if a key contains ``sep`` (the flattening would be ambiguous) or is not a str.
  """
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


def unflatten_params(flat: Mapping[str, Any], sep: str = '/') -> Dict[str, Any]:
  """Inverse of :func:`flatten_params`: ``{'a/b': x}`` -> ``{'a': {'b': x}}``.

  Raises:
    ValueError: if a path is both a leaf and a prefix of another path, or has empty components.
  """
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
  """The architecture fields a checkpoint's shapes imply, for error messages (None if unknown).

  ViT: ``patch_size``, ``hidden_size``, ``num_layers``, ``num_heads``, ``mlp_dim``,
  ``representation_size`` and the class count, read from ``embedding``, the encoder blocks,
  ``pre_logits`` and ``head``; T2T-ViT: ``embed_dim``, ``depth``, ``mlp_ratio``, ``token_dim``,
  ``tokens_type`` and the class count.

  Args:
    variables: ``{'params': ..., **collections}`` with array or ``jax.ShapeDtypeStruct``
      leaves (only shapes are read).
  """
  shapes = {k: tuple(int(d) for d in np.shape(v))
            for k, v in flatten_params(variables).items()}
  return vit_shapes.describe_architecture(shapes) or t2t_torch.describe_architecture(shapes)


def check_fits(variables: Mapping, expected: Mapping, *, what: str = 'The checkpoint') -> None:
  """Checks that ``variables`` has exactly the keys and shapes of ``expected``.

  Args:
    variables: ``{'params': ..., **collections}`` (e.g. from :func:`vit_jax.checkpoint.load`).
    expected: the same from ``model.init`` or its ``jax.eval_shape`` (boxed with logical axis
      names or plain). A scanned checkpoint for an unrolled model (or the reverse) is reported
      as such, with the conversion to use.
    what: how the message calls ``variables`` (e.g. its path).

  Raises:
    ValueError: with the counts of missing keys, unexpected keys and shape mismatches, the first
      entries of each (:func:`mismatch_report`) and the architecture the checkpoint implies; or,
      when only the position table differs, that the checkpoint is for another image size.
  """
  variables, expected = layout.unbox(variables), layout.unbox(expected)
  have, want = flatten_params(variables), flatten_params(expected)
  missing = [k for k in want if k not in have]
  unexpected = [f'{k} {tuple(np.shape(v))}' for k, v in have.items() if k not in want]
  mismatched = [f'{k}: checkpoint {tuple(np.shape(have[k]))}, model {tuple(want[k].shape)}'
                for k in want if k in have and tuple(np.shape(have[k])) != tuple(want[k].shape)]
  if not (missing or unexpected or mismatched):
    return
  header = f'{what} does not fit the model:'
  scanned = layout.is_scanned(variables.get('params', {}))
  if scanned != layout.is_scanned(expected.get('params', {})):
    header += (' it is in the ' + ('scanned' if scanned else 'per-layer') + ' block layout; '
               'convert it with vit_jax.models.' + ('unscan_params' if scanned else
                                                    'scan_params') + ' first.')
  hint = describe_architecture(variables)
  if hint:
    hint += ' Build the model with these values.'
  if not missing and not unexpected and all(vit_shapes.POSEMB_KEY in m or 'pos_embed' in m
                                            for m in mismatched):
    hint = ('Only the position table differs: the checkpoint is for another image size. '
            'Evaluate at the size it was trained at, or use init_for_finetuning '
            '(--config.init_from) to resize it for a new resolution.')
  raise ValueError(mismatch_report(header, missing, unexpected, mismatched, hint))


def _name(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def non_finite(tree: Any) -> List[str]:
  """The names (``'params/head/kernel'``) of the floating-point leaves of ``tree`` that hold a
  NaN or an Inf, in tree order. NumPy leaves are checked on the host; JAX arrays (sharded ones
  too, on any number of processes) on their devices, in one jitted reduction."""
  leaves = [(_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(layout.unbox(tree))[0]
            if jnp.issubdtype(x.dtype if hasattr(x, 'dtype') else np.asarray(x).dtype,
                              jnp.inexact)]
  on_devices = [(n, x) for n, x in leaves if isinstance(x, jax.Array)]
  bad = {n for n, x in leaves if not isinstance(x, jax.Array) and not np.isfinite(x).all()}
  if on_devices:
    finite = jax.jit(lambda xs: [jnp.isfinite(x).all() for x in xs])([x for _, x in on_devices])
    bad |= {n for (n, _), ok in zip(on_devices, jax.device_get(finite)) if not ok}
  return [n for n, _ in leaves if n in bad]


def non_finite_message(what: str, names: List[str]) -> str:
  """``'<what> holds NaN or Inf values in <names> (first 4 and the count)'``, for errors."""
  shown = ', '.join(names[:4]) + (f' and {len(names) - 4} more' if len(names) > 4 else '')
  return (f'{what} holds NaN or Inf values in {shown} ({len(names)} '
          f'{"array" if len(names) == 1 else "arrays"})')
