"""Checkpoints: reading every accepted format (:data:`ACCEPTED_FORMATS`; :func:`open` and the
registry in :mod:`.formats`), fine-tuning from them, and the run directory. Files are read
per-layer (``encoderblock_{i}``); an Orbax checkpoint of a ``scan=True`` model stays stacked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence

from vit_jax import models
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import formats  # noqa: F401 (checkpoint.formats)
from vit_jax.checkpoint import orbax  # noqa: F401 (checkpoint.orbax)
from vit_jax.checkpoint import saved_run  # noqa: F401 (checkpoint.saved_run)
from vit_jax.checkpoint import tree
from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint import workdir  # noqa: F401 (checkpoint.workdir)
from vit_jax.checkpoint.archive import DamagedCheckpointError
from vit_jax.checkpoint.finetune import init_for_finetuning, resample_patchemb, resize_posemb
from vit_jax.checkpoint.formats import (ACCEPTED_FORMATS, TORCH_SUFFIXES, Checkpoint,
                                        Contents, detect, is_torch_checkpoint, open)  # noqa: A004
from vit_jax.checkpoint.npz import convert_pre_linen, fix_groupnorm, load_npz, save_npz
from vit_jax.checkpoint.orbax import check_state_fits, save_orbax
from vit_jax.checkpoint.torch_pickle import load_pth
from vit_jax.checkpoint.mismatch import mismatch_report
from vit_jax.checkpoint.tree import (check_fits, describe_architecture, flatten_params,
                                     non_finite, non_finite_message, unflatten_params)
from vit_jax.checkpoint.lock import WorkdirInUseError, WorkdirLock, acquire_on_all_processes
from vit_jax.checkpoint.saved_run import load_orbax
from vit_jax.checkpoint.workdir import CheckpointSaveError, Checkpoints, Workdir

__all__ = [
    'ACCEPTED_FORMATS', 'Checkpoint', 'CheckpointSaveError', 'Checkpoints', 'Contents',
    'DamagedCheckpointError', 'TORCH_SUFFIXES', 'Workdir', 'WorkdirInUseError', 'WorkdirLock',
    'acquire_on_all_processes', 'check_fits', 'check_state_fits', 'convert_pre_linen',
    'describe_architecture', 'detect', 'fix_groupnorm', 'flatten_params', 'init_for_finetuning',
    'is_torch_checkpoint', 'load', 'load_for_finetuning', 'load_npz', 'load_orbax', 'load_pth',
    'mismatch_report', 'model_fields', 'non_finite', 'non_finite_message', 'open',
    'posemb_resize', 'resample_patchemb', 'resize_posemb', 'save_npz', 'save_orbax',
    'unflatten_params',
]


def load(path: Any, *, model: Any = None, use_ema: bool = True,
         image_size: Any = None) -> Dict[str, Any]:
  """``{'params': nested dict of np.ndarray, **collections}`` of the checkpoint at ``path``
  (``{'params', 'constants'}`` for a PyTorch file; a workdir: its latest finalized step).
  ``model`` (required for PyTorch files) is checked to fit at ``image_size`` (``H`` or
  ``(H, W)``; transformers / timm: the file's, with their numerics); ``use_ema``: prefer the EMA.
  Raises FileNotFoundError (nothing at ``path``, no finalized step) and ValueError: as
  :func:`open`, a PyTorch file without ``model``, variables that do not fit (:func:`check_fits`),
  other numerics, :class:`DamagedCheckpointError`, ``torch_pickle.UnsafePickleError``."""
  return open(path).read(model=model, use_ema=use_ema, image_size=image_size)


def model_fields(path: Any, *, num_heads: Optional[int] = None) -> Dict[str, Any]:
  """The :func:`vit_jax.models.create` keywords the weights at ``path`` need, with
  ``image_size`` (the square position table's side, or None): transformers / timm from the
  headers, numerics included; ``.npz`` and Orbax from the shapes, with the official numerics.
  Raises as :func:`load`, and ValueError for a PyTorch file (its variant is not recorded)."""
  return open(path).fields(num_heads)


def posemb_resize(ckpt: Checkpoint, model: Any = None) -> str:
  """How a learned position table read from ``ckpt`` (:func:`open`) is resampled to another
  token grid: ``model``'s ``posemb_resize`` where it is not the default, else the weights'
  library's (:data:`ecosystem.RESAMPLING`), else the default. Raises as
  :meth:`Checkpoint.numerics`."""
  chosen = getattr(model, 'posemb_resize', None) or ecosystem.DEFAULT_POSEMB_RESIZE
  if chosen != ecosystem.DEFAULT_POSEMB_RESIZE:
    return chosen
  found = ckpt.numerics(getattr(model, 'num_heads', None))
  return (found and found[0].get('posemb_resize')) or chosen


def load_for_finetuning(path: Any, model: Any, fresh: Mapping, *, use_ema: bool = True,
                        reset_head: bool = True, grid: Optional[Sequence[int]] = None,
                        image_size: Any = None) -> Dict[str, Any]:
  """:func:`init_for_finetuning` from the checkpoint at ``path``, read at its own class count
  and input size (other numerics than ``model``'s: a warning), its position table resized by
  :func:`posemb_resize` from the grid the checkpoint records (:meth:`Checkpoint.table_grid`;
  else, for a table as large as the model's, ``model.posemb_grid``) to ``grid`` (default:
  ``model.posemb_grid``, else the token grid of ``image_size``); ``fresh``: ``model``'s initial
  variables. Raises ValueError: NaN or Inf weights; as :func:`load` and
  :func:`init_for_finetuning`."""
  ckpt = open(path)
  loaded = ckpt.read_for_finetuning(model, use_ema)
  bad = tree.non_finite(loaded)
  if bad:
    raise ValueError(f'{tree.non_finite_message(f"The fine-tuning checkpoint {ckpt.path}", bad)}: '
                     'fine-tune from other weights (or a step of the run before it diverged).')
  is_vit = isinstance(model, models.VisionTransformer)
  prefix_rows = models.vit.posemb_prefix_rows(model) if is_vit else None
  stated = getattr(model, 'posemb_grid', None)
  if grid is None and is_vit:
    grid = stated or vit_shapes.token_grid(image_size, {
        'patch_size': model.patch_size, 'resnet_num_layers': model.resnet_num_layers})
  shapes = tree.shapes(loaded)
  checkpoint_grid = ckpt.table_grid(shapes) if vit_shapes.POSEMB_KEY in shapes else None
  if (checkpoint_grid is None and stated and shapes.get(vit_shapes.POSEMB_KEY)
      == tree.shapes(models.unbox(fresh)).get(vit_shapes.POSEMB_KEY)):
    checkpoint_grid = tuple(stated)  # What the model is told its table is.
  return init_for_finetuning(loaded, fresh, reset_head=reset_head, grid=grid,
                             checkpoint_grid=checkpoint_grid,
                             posemb_resize=posemb_resize(ckpt, model), prefix_rows=prefix_rows)
