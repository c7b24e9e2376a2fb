"""Initialising a model for fine-tuning from a checkpoint of another task or resolution
(:func:`init_for_finetuning`; :func:`vit_jax.checkpoint.load` reads everything as saved)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint.mismatch import ModelMismatchError, diff, mismatch_report
from vit_jax.checkpoint.tree import describe_architecture, flatten_params, unflatten_params
from vit_jax.models import layout

#: The classifier head, re-initialised for fine-tuning (:func:`init_for_finetuning`).
HEAD_KEYS = ('params/head/kernel', 'params/head/bias')
#: ViT's optional representation layer, dropped when the model to fine-tune has none.
PRE_LOGITS_PREFIX = 'params/pre_logits/'
#: Fixed tables a model regenerates for its input size (T2T-ViT's sinusoid position table).
REGENERATED_KEYS = ('constants/pos_embed',)


def _grid_of(num_tokens: int, grid: Optional[Sequence[int]], what: str) -> Tuple[int, int]:
  """``grid`` as (gh, gw), checked against ``num_tokens``; square by default."""
  if grid is None:
    side = vit_shapes.square_side(num_tokens)
    if side is None:
      raise ValueError(f'The {what} position embedding has {num_tokens} grid tokens, not a square '
                       f'grid: pass its grid (rows, columns) explicitly.')
    return side, side
  gh, gw = (int(g) for g in grid)
  if gh * gw != num_tokens:
    raise ValueError(f'The {what} grid {gh}x{gw} does not match its {num_tokens} position '
                     'embedding rows.')
  return gh, gw


def resize_posemb(posemb: np.ndarray, num_tokens: int, *, has_class_token: bool,
                  old_grid: Optional[Sequence[int]] = None,
                  new_grid: Optional[Sequence[int]] = None) -> np.ndarray:
  """``posemb`` ``[1, T_old, D]`` resized to ``[1, num_tokens, D]`` (its dtype), as the
  official ``load_pretrained`` (docs/reference.md section 1): the class-token row (with
  ``has_class_token``) kept, the ``(rows, columns)`` grid (square when None) resampled
  bilinearly with the corners aligned (``scipy.ndimage.zoom(order=1)``). ValueError for a grid
  that does not match its row count, or is not square when not given."""
  posemb = np.asarray(posemb)
  first = 1 if has_class_token else 0
  token_rows, grid_rows = posemb[:, :first], posemb[0, first:]
  gh, gw = _grid_of(grid_rows.shape[0], old_grid, 'checkpoint')
  nh, nw = _grid_of(num_tokens - first, new_grid, "model's")
  from scipy import ndimage  # pylint: disable=g-import-not-at-top
  grid = grid_rows.reshape(gh, gw, -1)
  grid = ndimage.zoom(grid, (nh / gh, nw / gw, 1), order=1)
  grid = grid.reshape(1, nh * nw, -1)
  return np.concatenate([token_rows, grid], axis=1).astype(posemb.dtype)


def init_for_finetuning(loaded: Mapping, fresh: Mapping, *, reset_head: bool = True,
                        grid: Optional[Sequence[int]] = None,
                        checkpoint_grid: Optional[Sequence[int]] = None) -> Dict[str, Any]:
  """``fresh``'s variables (structure, plain leaves, dtypes) with the weights of ``loaded``
  (``{'params', **collections}``, NumPy or JAX, per-layer or scanned) but what fine-tuning
  changes:

  * the head takes ``fresh``'s values: always (the official ``load_pretrained``), or with
    ``reset_head=False`` only for another class count (the T2T-ViT reference);
  * ViT's ``pre_logits`` is dropped when ``fresh`` has none;
  * ViT's learned position embedding is resized (:func:`resize_posemb`; ``grid`` and
    ``checkpoint_grid``: the ``(rows, columns)`` of non-square token grids);
  * T2T-ViT's sinusoid table (``constants/pos_embed``) is regenerated (taken from ``fresh``);
    a Performer's random features ``w`` are kept.

  Raises ModelMismatchError for anything else that differs, with the checkpoint's architecture.
  """
  fresh, loaded = layout.unbox(fresh), layout.unbox(loaded)
  for name, tree in (('loaded', loaded), ('fresh', fresh)):
    if not isinstance(tree, Mapping) or 'params' not in tree:
      raise ValueError(f'init_for_finetuning: {name} must be a variables dict '
                       "{'params': ..., **collections} (as checkpoint.load and model.init "
                       f"return), not a bare params tree (top level: {sorted(tree)[:5]}).")
  fresh_flat = flatten_params(fresh)
  loaded = dict(loaded)
  fresh_scanned = layout.is_scanned(fresh.get('params', {}))
  if layout.is_scanned(loaded.get('params', {})) != fresh_scanned:
    convert = layout.scan_params if fresh_scanned else layout.unscan_params
    loaded['params'] = convert(loaded['params'])
  loaded_flat = flatten_params(loaded)
  out, notes = {}, []
  for key, want in fresh_flat.items():
    if key not in loaded_flat:
      continue
    have = loaded_flat[key]
    same_shape = tuple(np.shape(have)) == tuple(want.shape)
    change = f'{key} {tuple(np.shape(have))} -> {tuple(want.shape)}'
    if key in HEAD_KEYS and (reset_head or not same_shape):
      out[key] = np.asarray(want)
      notes.append(f're-initialised {change}')
    elif key in HEAD_KEYS:
      out[key] = np.asarray(have).astype(want.dtype)
      notes.append(f'kept {key} (reset_head=False, same class count)')
    elif same_shape:
      out[key] = np.asarray(have).astype(want.dtype)
    elif key == vit_shapes.POSEMB_KEY and np.ndim(have) == 3 and np.shape(have)[2] == want.shape[2]:
      out[key] = resize_posemb(have, want.shape[1], has_class_token='params/cls' in fresh_flat,
                               old_grid=checkpoint_grid, new_grid=grid).astype(want.dtype)
      notes.append(f'resized {change}')
    elif key in REGENERATED_KEYS:
      out[key] = np.asarray(want)
      notes.append(f'regenerated {change}')
  dropped = [] if any(k.startswith(PRE_LOGITS_PREFIX) for k in fresh_flat) else [
      k for k in loaded_flat if k.startswith(PRE_LOGITS_PREFIX)]
  notes += [f'dropped {k}' for k in dropped]
  # What is left: the loaded weights, those adapted above in their new shapes, less the dropped.
  missing, unexpected, mismatched = diff(
      {k: out.get(k, v) for k, v in loaded_flat.items() if k not in dropped}, fresh_flat)
  if missing or unexpected or mismatched:
    hint = describe_architecture(loaded)
    raise ModelMismatchError(mismatch_report(
        'The checkpoint does not fit the model to fine-tune (only the head, pre_logits, the '
        'position embedding and the T2T sinusoid table may differ):',
        missing, unexpected, mismatched,
        hint and hint + ' Set the model fields (--config.model.*) to these values.'), hint)
  if notes:
    logging.getLogger('absl').info('Fine-tuning init: %s', '; '.join(notes))
  return unflatten_params(out)
