"""Initialising a model for fine-tuning from a checkpoint of another task or resolution
(:func:`init_for_finetuning`; :func:`vit_jax.checkpoint.load` reads everything as saved)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint.mismatch import ModelMismatchError, diff, mismatch_report
from vit_jax.checkpoint.tree import describe_architecture, flatten_params, unflatten_params
from vit_jax.models import layout
from vit_jax.models import resample
from vit_jax.models.vit_fields import patch_pair

#: The classifier head, re-initialised for fine-tuning (:func:`init_for_finetuning`).
HEAD_KEYS = ('params/head/kernel', 'params/head/bias')
#: ViT's optional representation layer, dropped when the model to fine-tune has none.
PRE_LOGITS_PREFIX = 'params/pre_logits/'
#: Fixed tables a model regenerates for its input size (T2T-ViT's sinusoid position table).
REGENERATED_KEYS = ('constants/pos_embed',)
#: ViT's patch-embedding kernel ``(Ph, Pw, C, D)``, resampled for another patch size.
PATCHEMB_KEY = 'params/embedding/kernel'


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
                  new_grid: Optional[Sequence[int]] = None,
                  method: str = 'linear_corners') -> np.ndarray:
  """``posemb`` ``[1, T_old, D]`` resized to ``[1, num_tokens, D]`` (its dtype) as the official
  ``load_pretrained`` (docs/checkpoints.md, "Fine-tuning from a checkpoint"): the class-token
  row (with ``has_class_token``) kept, the ``(rows, columns)`` grid (None: square) resampled by
  ``method`` (:func:`vit_jax.models.resample.resample_posemb`). ValueError for a grid that does
  not match its row count, or is not square when not given; an unknown method."""
  posemb = np.asarray(posemb)
  first = 1 if has_class_token else 0
  old = _grid_of(posemb.shape[1] - first, old_grid, 'checkpoint')
  new = _grid_of(num_tokens - first, new_grid, "model's")
  return resample.resample_posemb(posemb, new, num_prefix_tokens=first, old_grid=old,
                                  method=method)


def resample_patchemb(kernel: np.ndarray, new_hw: Union[int, Sequence[int]], *,
                      method: str = 'bicubic_antialias') -> np.ndarray:
  """FlexiViT's pseudo-inverse resize ("PI-resize", Beyer et al., CVPR 2023; big_vision
  ``resample_patchemb``, timm ``resample_patch_embed``) of a patch-embedding kernel ``(Ph, Pw,
  C, D)`` to ``(Ph', Pw', C, D)`` (``new_hw``: ``P'`` or ``(Ph', Pw')``), in its dtype, computed
  in float64. With ``B`` the ``[Ph' Pw', Ph Pw]`` resize of a patch by ``method`` (default
  timm's), each ``(C, D)`` filter ``w`` becomes ``pinv(B^T) w``: upsampling, ``<B x, w'> = <x,
  w>`` for every patch ``x``; downsampling, the least-squares fit. ValueError: not a 4-D kernel,
  a bad size or method."""
  kernel = np.asarray(kernel)
  if kernel.ndim != 4:
    raise ValueError(f'A patch-embedding kernel is (height, width, channels, width D), got shape '
                     f'{kernel.shape}')
  new_h, new_w = patch_pair(new_hw)
  old_h, old_w = kernel.shape[:2]
  if (new_h, new_w) == (old_h, old_w):
    return kernel
  # Separable: B = kron(B_rows, B_columns), row-major patches as the kernel's (h, w) axes.
  resize = np.kron(resample.resize_matrix(old_h, new_h, method),
                   resample.resize_matrix(old_w, new_w, method))
  flat = kernel.astype(np.float64).reshape(old_h * old_w, -1)
  out = np.linalg.pinv(resize.T) @ flat
  return out.reshape(new_h, new_w, *kernel.shape[2:]).astype(kernel.dtype)


def _resampled_patchemb(have: np.ndarray, want: np.ndarray, fresh_flat: Mapping) -> np.ndarray:
  """:func:`resample_patchemb` of ``have`` to ``want``'s patch size, logged;
  ModelMismatchError for a hybrid (its stem's stride is not resized)."""
  old, new = tuple(np.shape(have)[:2]), tuple(want.shape[:2])
  sizes = f'{old[0]}x{old[1]} (checkpoint) -> {new[0]}x{new[1]} (model)'
  if 'params/conv_root/kernel' in fresh_flat:
    kept_patch = old[0] if old[0] == old[1] else old
    raise ModelMismatchError(
        f'The patch size differs, {sizes}, and the model is a hybrid (ResNet stem): the '
        'patch-embedding resize (FlexiViT) is for plain ViTs. Keep the checkpoint\'s patch size '
        f'(--config.model.patch_size={kept_patch}).')
  logging.getLogger('absl').info(
      'Fine-tuning init: patch size %s: %s resampled by the FlexiViT pseudo-inverse.', sizes,
      PATCHEMB_KEY)
  return resample_patchemb(have, new).astype(want.dtype)


def _posemb_prefix_rows(flat: Mapping[str, Any], rows: int, grid: Optional[Sequence[int]],
                        what: str, likely: Optional[int] = None) -> int:
  """The rows before the grid of the ``rows``-row learned table of the flat variables ``flat``:
  ``rows`` less the ``grid`` when given, else ``likely`` (the model's) where the rest make a
  square grid, else :func:`vit_shapes.table_prefix_rows`. ValueError: a grid that leaves
  neither none nor one per class token and register."""
  shapes = {k: tuple(np.shape(v)) for k, v in flat.items()}
  registers = shapes.get('params/registers')
  tokens = ('params/cls' in shapes) + (int(registers[1]) if registers else 0)
  if grid is None:
    if likely in (0, tokens) and vit_shapes.square_side(rows - likely):
      return int(likely)
    return vit_shapes.table_prefix_rows(shapes)
  gh, gw = (int(g) for g in grid)
  if rows - gh * gw not in (0, tokens):
    raise ValueError(f'The {what} grid {gh}x{gw} does not match its {rows} position embedding '
                     f'rows ({tokens} class-token / register rows or none before the grid).')
  return rows - gh * gw


def _prefix_hint(have: int, want: int) -> str:
  return (f'The position tables have {have} (checkpoint) and {want} (model) rows before the '
          'grid, one per class token and register unless the table covers the patches only '
          "(timm's no_embed_class): build the model with the checkpoint's classifier, "
          'num_registers and no_embed_class.')


def _unrecorded_grid_message(grid: Tuple[int, int]) -> str:
  """Why a table of ``gh * gw`` grid rows of unknown grid is refused for a model of the
  non-square ``grid``, and how to say which it is (the model's ``posemb_grid``)."""
  gh, gw = grid
  side = vit_shapes.square_side(gh * gw)
  square, other = ((f'{side}x{side} (square images)', f'({side}, {side})') if side else
                   (f'made for another grid of {gh * gw} tokens', '(rows, columns)'))
  shown = f'the {side}x{side} table' if side else 'the table'
  return (f'The fine-tuning checkpoint records no token grid for its position table of {gh * gw} '
          f"grid rows, and the model's grid is {gh}x{gw}, not square: whether the table is "
          f'{square}, to be resampled, or already {gh}x{gw} cannot be told from its shape. Say '
          f'which with --config.model.posemb_grid={other} (the model keeps {shown} and '
          f'resamples it to {gh}x{gw} as it runs) or --config.model.posemb_grid=({gh}, {gw}).')


def init_for_finetuning(loaded: Mapping, fresh: Mapping, *, reset_head: bool = True,
                        grid: Optional[Sequence[int]] = None,
                        checkpoint_grid: Optional[Sequence[int]] = None,
                        posemb_resize: str = 'linear_corners',
                        prefix_rows: Optional[int] = None) -> Dict[str, Any]:
  """``fresh``'s variables (structure, plain leaves, dtypes) with the weights of ``loaded``
  (``{'params', **collections}``, NumPy or JAX, per-layer or scanned) but what fine-tuning
  changes (docs/checkpoints.md, "Fine-tuning from a checkpoint"): the head takes ``fresh``'s
  values (with ``reset_head=False`` only for another class count or none in ``loaded``);
  ``pre_logits`` is dropped when ``fresh`` has none; ViT's learned position table is resized
  from ``checkpoint_grid`` to ``grid`` (``(rows, columns)``, None: square) by ``posemb_resize``
  whenever the grids differ, its rows before the grid kept (as many in both; ``prefix_rows``:
  the model's, where a table's rows with and without them could both be square grids); the
  patch-embedding kernel is resampled (:func:`resample_patchemb`); T2T-ViT's sinusoid table is
  regenerated.

  Raises ModelMismatchError for anything else that differs (and a hybrid's other patch size),
  with the checkpoint's architecture; ValueError for a table as large as the model's, of no
  given grid, where the model's grid is not square (naming ``posemb_grid``).
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
  out = {}
  notes = []
  posemb_hint = None
  for key, want in fresh_flat.items():
    if key in HEAD_KEYS and not any(k in loaded_flat for k in HEAD_KEYS):
      out[key] = np.asarray(want)  # A backbone without a head (DINOv2): a new one.
      notes.append(f'initialised {key} {tuple(want.shape)} (the checkpoint has no head)')
      continue
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
    elif same_shape and (key != vit_shapes.POSEMB_KEY
                         or grid is None and checkpoint_grid is None):  # (Both square.)
      out[key] = np.asarray(have).astype(want.dtype)
    elif (key == PATCHEMB_KEY and np.ndim(have) == 4 and want.ndim == 4
          and tuple(np.shape(have)[2:]) == tuple(want.shape[2:])):
      out[key] = _resampled_patchemb(have, want, fresh_flat)
      notes.append(f'resampled {change}')
    elif key == vit_shapes.POSEMB_KEY and np.ndim(have) == 3 and np.shape(have)[2] == want.shape[2]:
      fresh_prefix = (_posemb_prefix_rows(fresh_flat, want.shape[1], grid, "model's")
                      if prefix_rows is None or grid is not None else int(prefix_rows))
      unknown = same_shape and checkpoint_grid is None  # Its grid: the model's if square.
      prefix = fresh_prefix if unknown else _posemb_prefix_rows(
          loaded_flat, np.shape(have)[1], checkpoint_grid, 'checkpoint', fresh_prefix)
      if prefix != fresh_prefix:  # Left to the mismatch report below (unless the same shape).
        posemb_hint = _prefix_hint(prefix, fresh_prefix)
        if same_shape:
          raise ModelMismatchError(posemb_hint)
        continue
      new = _grid_of(want.shape[1] - prefix, grid, "model's")
      if unknown and new[0] != new[1]:
        raise ValueError(_unrecorded_grid_message(new))
      old = new if unknown else _grid_of(np.shape(have)[1] - prefix, checkpoint_grid, 'checkpoint')
      if old == new:  # The same grid: kept as it is.
        out[key] = np.asarray(have).astype(want.dtype)
        continue
      out[key] = resample.resample_posemb(np.asarray(have), new, num_prefix_tokens=prefix,
                                          old_grid=old, method=posemb_resize).astype(want.dtype)
      notes.append(f'resized {change} ({old[0]}x{old[1]} -> {new[0]}x{new[1]} grid, {prefix} '
                   f'class-token / register rows kept, {posemb_resize})')
    elif key in REGENERATED_KEYS:
      out[key] = np.asarray(want)
      notes.append(f'regenerated {change}')
  dropped = [] if any(k.startswith(PRE_LOGITS_PREFIX) for k in fresh_flat) else [
      k for k in loaded_flat if k.startswith(PRE_LOGITS_PREFIX)]
  notes += [f'dropped {k}' for k in dropped]
  # What is left: the loaded weights, those adapted above in their new shapes, less the dropped.
  kept = {k: out.get(k, v) for k, v in loaded_flat.items() if k not in dropped}
  missing, unexpected, mismatched = diff(
      {**kept, **{k: out[k] for k in HEAD_KEYS if k in out}}, fresh_flat)
  if missing or unexpected or mismatched:
    hint = describe_architecture(loaded)
    fix = hint and hint + ' Set the model fields (--config.model.*) to these values.'
    fix = ' '.join(filter(None, (posemb_hint, fix)))
    raise ModelMismatchError(mismatch_report(
        'The checkpoint does not fit the model to fine-tune (only the head, pre_logits, the '
        'position embedding, the patch size and the T2T sinusoid table may differ):',
        missing, unexpected, mismatched, fix or None), hint)
  if notes:
    logging.getLogger('absl').info('Fine-tuning init: %s', '; '.join(notes))
  return unflatten_params(out)
