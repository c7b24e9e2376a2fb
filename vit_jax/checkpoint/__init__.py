"""Checkpoints: loading every supported format, fine-tuning from them, and the run directory.

:func:`load` detects a path's format once (:func:`detect`) and reads it:

* **official ViT ``.npz``** (google-research/vision_transformer releases), pre-Linen names
  renumbered, never unpickled: :mod:`.npz` (also :func:`save_npz`);
* **big_vision ViT ``.npz``** (``params/`` prefix or not, per-layer or scanned, the position
  table of the patch tokens only, ``MAPHead_0``, ``sincos2d`` without a table): read as the
  official layout by :mod:`.npz` (:mod:`.big_vision`);
* **Hugging Face transformers ViT** (a directory with ``config.json`` and ``model.safetensors``,
  transformers 4 or 5 names) and **timm VisionTransformer** ``.safetensors``, read without torch
  by :mod:`.ecosystem` (:mod:`.hf_vit`, :mod:`.timm_vit`; the name mapping in
  :mod:`.torch_layout`), which also writes them (``python -m vit_jax.convert --to hf|timm``).
  Their numerics (GELU, LayerNorm epsilon) are model fields: :func:`model_fields` gives them;
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
import math
from typing import Any, Dict, Optional, Sequence

from absl import logging
import numpy as np

from vit_jax import models
from vit_jax.checkpoint import ecosystem
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
                                     mismatch_report, non_finite, non_finite_message,
                                     unflatten_params)
from vit_jax.checkpoint.lock import WorkdirInUseError, WorkdirLock, acquire_on_all_processes
from vit_jax.checkpoint.workdir import CheckpointSaveError, Checkpoints, Workdir, load_orbax

__all__ = [
    'ACCEPTED_FORMATS', 'CheckpointSaveError', 'Checkpoints', 'DamagedCheckpointError',
    'TORCH_SUFFIXES', 'Workdir',
    'WorkdirInUseError', 'WorkdirLock', 'acquire_on_all_processes',
    'check_fits', 'check_state_fits', 'convert_pre_linen', 'describe_architecture', 'detect',
    'fix_groupnorm', 'flatten_params', 'init_for_finetuning', 'is_torch_checkpoint', 'load',
    'load_for_finetuning', 'load_npz', 'load_orbax', 'load_pth', 'load_torch_as_saved',
    'mismatch_report', 'model_fields', 'non_finite', 'non_finite_message', 'resize_posemb',
    'save_npz', 'save_orbax', 'unflatten_params',
]


def _read(path: str, fmt: str, *, model: Any, use_ema: bool, image_size: Any,
          evaluate: bool = True) -> Dict[str, Any]:
  if fmt == formats.PYTORCH:
    return pytorch.load_torch_variables(path, model=model, use_ema=use_ema,
                                        image_size=image_size)
  if fmt in (formats.HF, formats.TIMM):
    foreign = ecosystem.read(path, fmt, num_heads=getattr(model, 'num_heads', None))
    variables = foreign.variables
    if model is not None and evaluate:
      ecosystem.check_numerics(foreign.fields, model, path)
      image_size = image_size or foreign.image_size
  elif fmt == formats.ORBAX:
    variables = workdir.load_orbax(path, use_ema=use_ema)
  else:
    variables = npz.load_npz(path)
  if model is not None and image_size is not None and evaluate:
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    check_fits(variables, models.abstract_variables(model, (int(height), int(width))), what=path)
  return variables


def load(path: Any, *, model: Any = None, use_ema: bool = True,
         image_size: Any = None) -> Dict[str, Any]:
  """Loads model variables from any supported checkpoint (see the module docstring).

  Args:
    path: local or ``scheme://`` path (``gs://``) of an official or big_vision ``.npz`` file, a
      transformers ViT directory (or its ``model.safetensors``), a timm ``.safetensors`` file, a
      training workdir, its ``checkpoints`` directory (the latest finalized step is used), one
      step directory, or a PyTorch ``.pth``/``.pth.tar``/``.pt`` checkpoint (zip format).
    model: the model (from ``vit_jax.models.create``) the weights are for. Required for PyTorch
      checkpoints (a :class:`~vit_jax.models.t2t.T2TViT`; the state dict is converted with
      :func:`vit_jax.models.t2t_torch.from_torch_state_dict`). For transformers and timm files
      its ``num_heads`` splits the attention (timm files do not record it) and its numerics
      (``gelu_approximate``, ``layer_norm_epsilon``, ``classifier``, ``posemb``) must be the
      file's, and the variables are checked against it at the file's image size. For ``.npz``
      and Orbax checkpoints, given together with ``image_size``, the restored variables are
      checked against the model (restore for evaluation: everything must fit as saved, the head
      included).
    use_ema: prefer the parameter EMA: ``state_dict_ema`` of a PyTorch checkpoint (see
      :func:`load_pth`), ``ema_params`` of an Orbax checkpoint (see :func:`load_orbax`).
    image_size: ``H`` or ``(H, W)`` the model will run at. PyTorch checkpoints: passed to
      ``from_torch_state_dict`` (default: the checkpoint's own ``pos_embed`` grid). Others: see
      ``model``.

  Returns:
    ``{'params': nested dict of np.ndarray, **other collections}`` ready for ``model.apply``
    (Linen names; the encoder layout of Orbax checkpoints unchanged, every file format
    per-layer; see the module docstring to convert layouts). For a PyTorch checkpoint:
    ``{'params': ..., 'constants': ...}``.

  Raises:
    FileNotFoundError: nothing exists at ``path`` (or a checkpoint directory holds no step, or a
      transformers directory lacks its weights).
    ValueError: the file/directory is not one of the accepted formats, an ``.npz`` contains
      object (pickled) arrays, a PyTorch file is given without ``model``, the variables do not
      fit ``model`` (see :func:`check_fits`), a model whose numerics differ from a transformers
      or timm file's (named), a timm variant without an equivalent here (named), or a torch file
      in the legacy (non-zip) format.
    DamagedCheckpointError: a truncated, corrupt or hand-made file (a ValueError; the message
      names the file, the damage and the fix).
    vit_jax.checkpoint.torch_pickle.UnsafePickleError: a PyTorch file's pickle names a global
      other than tensors and plain containers (nothing is executed; also a ValueError).
  """
  path = paths.normalize(path)
  return _read(path, detect(path), model=model, use_ema=use_ema, image_size=image_size)


def model_fields(path: Any, *, num_heads: Optional[int] = None) -> Dict[str, Any]:
  """The ViT fields the weights at ``path`` need (:func:`vit_jax.models.create` keywords).

  Read from the files' headers and shapes only. Transformers and timm files: the architecture,
  ``num_heads`` (transformers' config; timm: ``num_heads`` or the standard ViT's of the width),
  ``classifier``, ``posemb``, ``gelu_approximate``, ``layer_norm_epsilon``, ``num_classes``
  (None without a head) and ``image_size`` (not a model field: the side the position table is
  for). ``.npz`` (official or big_vision) and Orbax variables checkpoints: the architecture from
  the shapes (:func:`vit_jax.models.vit.architecture_fields`) with the official numerics, and
  ``image_size`` from a square position table (None without one).

  Raises:
    FileNotFoundError, ValueError, DamagedCheckpointError: as :func:`load`; ValueError for a
    PyTorch (T2T-ViT) file, whose variant the file does not name.
  """
  path = paths.normalize(path)
  fmt = detect(path)
  if fmt in (formats.HF, formats.TIMM):
    return ecosystem.read_fields(path, fmt, num_heads)
  if fmt == formats.PYTORCH:
    raise ValueError(f'{path} is a PyTorch (T2T-ViT) checkpoint: its variant is not recorded; '
                     'name the model (e.g. T2T-ViT-14).')
  variables = load(path)
  shapes = {k: tuple(np.shape(v)) for k, v in flatten_params(variables).items()}
  fields = models.vit.architecture_fields(shapes)
  if fields is None:
    raise ValueError(f'{path} holds no ViT parameters (no embedding/kernel).')
  fields.update(gelu_approximate=True, layer_norm_epsilon=models.vit.LAYERNORM_EPSILON,
                image_size=None)
  table = shapes.get(POSEMB_KEY)
  if table:  # The side of the square grid of patch tokens, times the total stride.
    tokens = table[1] - (1 if 'params/cls' in shapes else 0)
    stride = models.patch_pair(fields['patch_size'])[0]
    if fields.get('resnet_num_layers') is not None:
      stride *= models.resnet.resnet_stride(fields['resnet_num_layers'])
    side = math.isqrt(tokens)
    fields['image_size'] = side * stride if side * side == tokens else None
  return fields


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
  path = paths.normalize(path)
  fmt = detect(path)
  if fmt == formats.PYTORCH:
    loaded = load_torch_as_saved(path, model, use_ema=use_ema)
  else:
    if fmt in (formats.HF, formats.TIMM):
      try:
        ecosystem.check_numerics(ecosystem.read_fields(path, fmt, getattr(model, 'num_heads',
                                                                          None)), model, path)
      except ValueError as e:
        logging.warning('Fine-tuning with other numerics than the weights were trained with: %s',
                        e)
    loaded = _read(path, fmt, model=model, use_ema=use_ema, image_size=None, evaluate=False)
  bad = tree.non_finite(loaded)
  if bad:
    raise ValueError(f'{tree.non_finite_message(f"The fine-tuning checkpoint {path}", bad)}: '
                     'fine-tune from other weights (or a step of the run before it diverged).')
  return init_for_finetuning(loaded, fresh, reset_head=reset_head, grid=grid)
