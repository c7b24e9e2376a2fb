"""Checkpoints: loading every supported format, fine-tuning from them, and the run directory.

:func:`load` detects a path's format once (:func:`detect`) and reads it:

* **official ViT ``.npz``** (google-research/vision_transformer releases), pre-Linen names
  renumbered, never unpickled: :mod:`.npz` (also :func:`save_npz`);
* **PyTorch** ``.pth``/``.pth.tar``/``.pt`` (the released T2T-ViT weights), read without torch
  by a whitelisting unpickler (:mod:`.torch_pickle`) and converted with the T2T-ViT name
  mapping (:mod:`vit_jax.models.t2t_torch`); needs ``model=``: :mod:`.pytorch`;
* **Orbax**: a training workdir, its ``checkpoints`` directory (latest finalized step), one
  step, or a variables checkpoint from ``python -m vit_jax.convert``: :mod:`.orbax` reads the
  items, :mod:`.workdir` knows where they are.

::

  model = models.create('T2T-ViT-14', num_classes=1000)
  variables = load('81.5_T2T_ViT_14.pth.tar', model=model)   # {'params', 'constants'}
  logits = model.apply(variables, images, train=False)

The package: :mod:`.workdir` (the run directory's layout: ``Workdir``, ``Checkpoints``, the
training loop's saves and restores), :mod:`.lock` (one run per workdir), :mod:`.finetune`
(:func:`init_for_finetuning`, :func:`resize_posemb`), :mod:`.tree` (flat names,
:func:`check_fits`), :mod:`.formats` (:func:`detect`), :mod:`.paths` (local and ``gs://``
files).

Paths may be local or ``scheme://`` (``gs://bucket/x.npz``; files go through ``tf.io.gfile``,
imported only for such paths; Orbax reads remote directories itself).

Layout: ``load`` never changes the encoder layout. ``.npz`` files are always in the unrolled
``encoderblock_{i}`` layout; an Orbax checkpoint of a ``scan=True`` model holds a stacked
``encoderblock`` (T2T-ViT: ``blocks``; a ``.pth.tar`` converts into the layout of the ``model``
given). Convert explicitly::

  from vit_jax.models import scan_params, unscan_params
  variables = load('ViT-B_16.npz')
  variables = scan_params(variables, num_layers=12)   # for create(..., scan=True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence

from vit_jax import models
from vit_jax.checkpoint import finetune
from vit_jax.checkpoint import formats
from vit_jax.checkpoint import npz
from vit_jax.checkpoint import orbax
from vit_jax.checkpoint import paths
from vit_jax.checkpoint import pytorch
from vit_jax.checkpoint import tree
from vit_jax.checkpoint import workdir
from vit_jax.checkpoint.finetune import (HEAD_KEYS, POSEMB_KEY, PRE_LOGITS_PREFIX,
                                         REGENERATED_KEYS, init_for_finetuning, resize_posemb)
from vit_jax.checkpoint.formats import (ACCEPTED_FORMATS, TORCH_SUFFIXES, detect,
                                        is_torch_checkpoint)
from vit_jax.checkpoint.npz import convert_pre_linen, fix_groupnorm, load_npz, save_npz
from vit_jax.checkpoint.orbax import check_state_fits, save_orbax
from vit_jax.checkpoint.pytorch import load_pth, load_torch_as_saved
from vit_jax.checkpoint.torch_pickle import DamagedCheckpointError
from vit_jax.checkpoint.tree import (check_fits, describe_architecture, flatten_params,
                                     mismatch_report, unflatten_params)
from vit_jax.checkpoint.lock import WorkdirInUseError, WorkdirLock, acquire_on_all_processes
from vit_jax.checkpoint.workdir import CheckpointSaveError, Checkpoints, Workdir, load_orbax

__all__ = [
    'ACCEPTED_FORMATS', 'CheckpointSaveError', 'Checkpoints', 'DamagedCheckpointError',
    'TORCH_SUFFIXES', 'Workdir',
    'WorkdirInUseError', 'WorkdirLock', 'acquire_on_all_processes',
    'check_fits', 'check_state_fits', 'convert_pre_linen', 'describe_architecture', 'detect',
    'fix_groupnorm', 'flatten_params', 'init_for_finetuning', 'is_torch_checkpoint', 'load',
    'load_for_finetuning', 'load_npz', 'load_orbax', 'load_pth', 'load_torch_as_saved',
    'mismatch_report', 'resize_posemb', 'save_npz', 'save_orbax', 'unflatten_params',
]


def _read(path: str, fmt: str, *, model: Any, use_ema: bool, image_size: Any) -> Dict[str, Any]:
  if fmt == formats.PYTORCH:
    return pytorch.load_torch_variables(path, model=model, use_ema=use_ema,
                                        image_size=image_size)
  if fmt == formats.ORBAX:
    variables = workdir.load_orbax(path, use_ema=use_ema)
  else:
    variables = npz.load_npz(path)
  if model is not None and image_size is not None:
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    check_fits(variables, models.abstract_variables(model, (int(height), int(width))), what=path)
  return variables


def load(path: Any, *, model: Any = None, use_ema: bool = True,
         image_size: Any = None) -> Dict[str, Any]:
  """Loads model variables from an official ``.npz``, an Orbax checkpoint or a PyTorch file.

  Args:
    path: local or ``scheme://`` path (``gs://``) of a ``.npz`` file, a training workdir, its
      ``checkpoints`` directory (the latest finalized step is used), one step directory, or a
      PyTorch ``.pth``/``.pth.tar``/``.pt`` checkpoint (zip format).
    model: the model (from ``vit_jax.models.create``) the weights are for. Required for PyTorch
      checkpoints (a :class:`~vit_jax.models.t2t.T2TViT`; the state dict is converted with
      :func:`vit_jax.models.t2t_torch.from_torch_state_dict`). For ``.npz`` and Orbax
      checkpoints, given together with ``image_size``, the restored variables are checked
      against the model (restore for evaluation: everything must fit as saved, the head
      included).
    use_ema: prefer the parameter EMA: ``state_dict_ema`` of a PyTorch checkpoint (see
      :func:`load_pth`), ``ema_params`` of an Orbax checkpoint (see :func:`load_orbax`).
    image_size: ``H`` or ``(H, W)`` the model will run at. PyTorch checkpoints: passed to
      ``from_torch_state_dict`` (default: the checkpoint's own ``pos_embed`` grid). Others: see
      ``model``.

  Returns:
    ``{'params': nested dict of np.ndarray, **other collections}`` ready for ``model.apply``
    (Linen names, unchanged encoder layout; see the module docstring to convert layouts). For a
    PyTorch checkpoint: ``{'params': ..., 'constants': ...}``.

  Raises:
    FileNotFoundError: nothing exists at ``path`` (or a checkpoint directory holds no step).
    ValueError: the file/directory is not one of the accepted formats, an ``.npz`` contains
      object (pickled) arrays, a PyTorch file is given without ``model``, the variables do not
      fit ``model`` (see :func:`check_fits`), or a torch file is in the legacy (non-zip) format.
    DamagedCheckpointError: a truncated, corrupt or hand-made file (a ValueError; the message
      names the file, the damage and the fix).
    vit_jax.checkpoint.torch_pickle.UnsafePickleError: a PyTorch file's pickle names a global
      other than tensors and plain containers (nothing is executed; also a ValueError).
  """
  path = paths.normalize(path)
  return _read(path, detect(path), model=model, use_ema=use_ema, image_size=image_size)


def load_for_finetuning(path: Any, model: Any, fresh: Mapping, *, use_ema: bool = True,
                        reset_head: bool = True,
                        grid: Optional[Sequence[int]] = None) -> Dict[str, Any]:
  """:func:`load` a checkpoint of any class count and resolution, then :func:`init_for_finetuning`.

  A PyTorch T2T-ViT file is converted for a copy of ``model`` with the checkpoint's own class
  count and input size (read from its ``head.weight`` and ``pos_embed``), so that a released
  1000-class, 224 px file initialises e.g. a 10-class model at 384 px.

  Args:
    path: as for :func:`load`.
    model: the model to fine-tune (from ``vit_jax.models.create``).
    fresh: its initial variables (see :func:`init_for_finetuning`).
    use_ema: prefer the checkpoint's parameter EMA when it has one.
    reset_head, grid: see :func:`init_for_finetuning`.

  Raises:
    The errors of :func:`load` and :func:`init_for_finetuning`.
  """
  path = paths.normalize(path)
  fmt = detect(path)
  if fmt == formats.PYTORCH:
    loaded = load_torch_as_saved(path, model, use_ema=use_ema)
  else:
    loaded = _read(path, fmt, model=model, use_ema=use_ema, image_size=None)
  return init_for_finetuning(loaded, fresh, reset_head=reset_head, grid=grid)
