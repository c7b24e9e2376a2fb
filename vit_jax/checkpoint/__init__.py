"""Checkpoints: loading every accepted format, fine-tuning from them, and the run directory.

:func:`open` detects a source's format once and returns a :class:`Checkpoint` that reads its
variables and the model fields it implies; every format is a :class:`~.formats.Format` in
:mod:`.formats` (add one there): official and big_vision ``.npz`` (:mod:`.npz`,
:mod:`.big_vision`), transformers directories and timm ``.safetensors`` (:mod:`.ecosystem`),
PyTorch T2T-ViT files read without torch (:mod:`.pytorch`, :mod:`.torch_pickle`,
:mod:`.t2t_torch`), Orbax checkpoints and workdirs (:mod:`.orbax`, :mod:`.workdir`). Paths may
be local or ``scheme://`` (:mod:`.paths`).

::

  model = models.create('T2T-ViT-14', num_classes=1000)
  variables = load('81.5_T2T_ViT_14.pth.tar', model=model)   # {'params', 'constants'}

``load`` never changes the encoder layout: files are per-layer (``encoderblock_{i}``); an Orbax
checkpoint of a ``scan=True`` model is stacked (``vit_jax.models.scan_params`` converts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence

from vit_jax.checkpoint import ecosystem  # noqa: F401 (checkpoint.ecosystem)
from vit_jax.checkpoint import formats  # noqa: F401 (checkpoint.formats)
from vit_jax.checkpoint import orbax  # noqa: F401 (checkpoint.orbax)
from vit_jax.checkpoint import tree
from vit_jax.checkpoint import workdir  # noqa: F401 (checkpoint.workdir)
from vit_jax.checkpoint.finetune import (HEAD_KEYS, POSEMB_KEY, PRE_LOGITS_PREFIX,
                                         REGENERATED_KEYS, init_for_finetuning, resize_posemb)
from vit_jax.checkpoint.formats import (ACCEPTED_FORMATS, TORCH_SUFFIXES, Checkpoint,
                                        detect, is_torch_checkpoint, open)  # noqa: A004
from vit_jax.checkpoint.npz import convert_pre_linen, fix_groupnorm, load_npz, save_npz
from vit_jax.checkpoint.orbax import check_state_fits, save_orbax
from vit_jax.checkpoint.pytorch import load_pth, load_torch_as_saved
from vit_jax.checkpoint.torch_pickle import DamagedCheckpointError
from vit_jax.checkpoint.tree import (check_fits, describe_architecture, flatten_params,
                                     mismatch_report, non_finite, non_finite_message,
                                     unflatten_params)
from vit_jax.checkpoint.lock import WorkdirInUseError, WorkdirLock, acquire_on_all_processes
from vit_jax.checkpoint.workdir import CheckpointSaveError, Checkpoints, Workdir, load_orbax

__all__ = [
    'ACCEPTED_FORMATS', 'Checkpoint', 'CheckpointSaveError', 'Checkpoints',
    'DamagedCheckpointError', 'TORCH_SUFFIXES', 'Workdir', 'WorkdirInUseError', 'WorkdirLock',
    'acquire_on_all_processes',
    'check_fits', 'check_state_fits', 'convert_pre_linen', 'describe_architecture', 'detect',
    'fix_groupnorm', 'flatten_params', 'init_for_finetuning', 'is_torch_checkpoint', 'load',
    'load_for_finetuning', 'load_npz', 'load_orbax', 'load_pth', 'load_torch_as_saved',
    'mismatch_report', 'model_fields', 'non_finite', 'non_finite_message', 'open',
    'resize_posemb', 'save_npz', 'save_orbax', 'unflatten_params',
]


def load(path: Any, *, model: Any = None, use_ema: bool = True,
         image_size: Any = None) -> Dict[str, Any]:
  """Loads model variables from any accepted checkpoint (:data:`ACCEPTED_FORMATS`).

  Args:
    path: local or ``scheme://`` (``gs://``) path; a training workdir or ``checkpoints``
      directory gives its latest finalized step.
    model: the model (``vit_jax.models.create``) the weights are for. Required for PyTorch
      (T2T-ViT) files (converted by :func:`.t2t_torch.from_torch_state_dict`). transformers /
      timm: its ``num_heads`` splits the attention and its numerics must be the file's
      (:func:`model_fields`); checked to fit at the file's image size. ``.npz`` / Orbax: checked
      to fit when ``image_size`` is given.
    use_ema: prefer the parameter EMA (``state_dict_ema``, ``ema_params``).
    image_size: ``H`` or ``(H, W)`` the model runs at (PyTorch: default the ``pos_embed`` grid).

  Returns:
    ``{'params': nested dict of np.ndarray, **other collections}`` for ``model.apply``; files
    per-layer, Orbax in the layout saved (PyTorch: ``{'params', 'constants'}``).

  Raises:
    FileNotFoundError: nothing at ``path`` (or no step, or a transformers directory without its
      weights).
    ValueError: no accepted format, object arrays, a PyTorch file without ``model``, variables
      that do not fit ``model`` (:func:`check_fits`), other numerics (named), a timm variant
      without an equivalent, a legacy torch file; :class:`DamagedCheckpointError` and
      :class:`~.torch_pickle.UnsafePickleError` are ValueErrors.
  """
  return open(path).read(model=model, use_ema=use_ema, image_size=image_size)


def model_fields(path: Any, *, num_heads: Optional[int] = None) -> Dict[str, Any]:
  """The :func:`vit_jax.models.create` keywords the weights at ``path`` need, with
  ``image_size`` (the side the position table is for; None without a square one).

  transformers / timm: from the headers, numerics included; ``.npz`` and Orbax: the architecture
  from the shapes (:func:`.vit_shapes.architecture_fields`) with the official numerics.

  Raises:
    FileNotFoundError, ValueError, DamagedCheckpointError: as :func:`load`; ValueError for a
    PyTorch (T2T-ViT) file, whose variant the file does not name.
  """
  return open(path).fields(num_heads)


def load_for_finetuning(path: Any, model: Any, fresh: Mapping, *, use_ema: bool = True,
                        reset_head: bool = True,
                        grid: Optional[Sequence[int]] = None) -> Dict[str, Any]:
  """:func:`load` a checkpoint of any class count and resolution, then :func:`init_for_finetuning`.

  A PyTorch T2T-ViT file is converted for a copy of ``model`` with the checkpoint's own class
  count and input size (read from its ``head.weight`` and ``pos_embed``), so that a released
  1000-class, 224 px file initialises e.g. a 10-class model at 384 px. A transformers or timm
  file whose numerics differ from ``model``'s is used with a warning (the training config sets
  them from the file: ``vit_jax.config``).

  Args:
    path: as for :func:`load`.
    model: the model to fine-tune (from ``vit_jax.models.create``).
    fresh: its initial variables (see :func:`init_for_finetuning`).
    use_ema: prefer the checkpoint's parameter EMA when it has one.
    reset_head, grid: see :func:`init_for_finetuning`.

  Raises:
    ValueError: the weights hold NaN or Inf values (named); the errors of :func:`load` and
      :func:`init_for_finetuning`.
  """
  ckpt = open(path)
  loaded = ckpt.read_for_finetuning(model, use_ema)
  bad = tree.non_finite(loaded)
  if bad:
    raise ValueError(f'{tree.non_finite_message(f"The fine-tuning checkpoint {ckpt.path}", bad)}: '
                     'fine-tune from other weights (or a step of the run before it diverged).')
  return init_for_finetuning(loaded, fresh, reset_head=reset_head, grid=grid)
