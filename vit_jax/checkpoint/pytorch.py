"""PyTorch checkpoints (``.pth``, ``.pth.tar``, ``.pt``), read without torch and without running
code.

E.g. the released T2T-ViT files: a timm ``CheckpointSaver`` dict (``state_dict``,
``state_dict_ema``, ``epoch``, ``args``, ...) or a plain state dict. The pickle is read by a
whitelisting unpickler (:mod:`vit_jax.checkpoint.torch_pickle`): tensors become NumPy arrays and
any other global such as ``posix.system`` is refused. Only the zip format of ``torch.save``
(torch >= 1.6) is read; the legacy format is refused with the way to re-save it. A truncated,
corrupt or hand-made file (e.g. a tensor addressing more than its storage) raises
:class:`~vit_jax.checkpoint.torch_pickle.DamagedCheckpointError`. Every error is a ``ValueError``.

:func:`load_pth` returns the raw state dict (PyTorch names -> ``np.ndarray``); converting it into
Flax variables needs the model's structure and the family's name mapping
(:func:`vit_jax.models.t2t_torch.from_torch_state_dict`): :func:`load_torch_variables` (at the
model's class count and input size) and :func:`load_torch_as_saved` (at the file's own).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Dict

import numpy as np

from vit_jax.checkpoint import paths
from vit_jax.checkpoint import torch_pickle
from vit_jax.models import t2t
from vit_jax.models import t2t_torch

_STATE_DICT_KEYS = ('state_dict_ema', 'state_dict')


def _is_state_dict(obj: Any) -> bool:
  return (isinstance(obj, Mapping) and len(obj) > 0 and
          all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()))


def _read_torch_file(path: str) -> Any:
  """Loads a torch zip-format file safely (:mod:`.torch_pickle`); tensors -> ndarray."""
  if paths.is_remote(path):
    return torch_pickle.load_torch_zip(io.BytesIO(paths.read_bytes(path)), name=path)
  return torch_pickle.load_torch_zip(path)


def load_pth(path: Any, *, use_ema: bool = True) -> Dict[str, np.ndarray]:
  """Reads the PyTorch state dict of a ``torch.save`` zip-format checkpoint, without torch.

  Nothing in the file is executed: the pickle is read by a whitelisting unpickler
  (:mod:`vit_jax.checkpoint.torch_pickle`) that builds tensors as NumPy arrays and refuses any
  other global.

  Args:
    path: local or ``scheme://`` path of a ``.pth``/``.pth.tar``/``.pt`` file.
    use_ema: if the file is a training checkpoint holding ``state_dict_ema`` (timm's
      ``CheckpointSaver``, as the released T2T-ViT weights), return that; otherwise (or with
      ``use_ema=False``) return its ``state_dict``. A file that is a plain state dict (a mapping
      of names to tensors) is returned as is.

  Returns:
    ``{PyTorch name: np.ndarray}`` in the saved order and dtype (e.g. ``blocks.0.attn.qkv.weight``
    of shape ``(out, in)``), a leading ``module.`` (DataParallel / ModelEma) stripped.

  Raises:
    FileNotFoundError: missing file.
    ValueError: not a zip-format torch file (legacy torch format: re-save it with a recent torch),
      or no state dict in it (the error lists its top-level keys).
    vit_jax.checkpoint.DamagedCheckpointError: a truncated or corrupt file (its zip directory or
      a member cannot be read), or a damaged or hand-made one: a member declaring more bytes than
      the file, a tensor addressing more elements than its storage holds, tensors adding up to
      more than the file (see :mod:`.torch_pickle`). A ``ValueError``.
    vit_jax.checkpoint.torch_pickle.UnsafePickleError: the pickle names a global other than
      tensors and plain containers (a ``ValueError`` and a ``pickle.UnpicklingError``).
  """
  path = paths.normalize(path)
  if not paths.exists(path) or paths.isdir(path):
    raise paths.not_found(path, 'No PyTorch checkpoint file')
  obj = _read_torch_file(path)
  state_dict = None
  if isinstance(obj, Mapping):
    keys = _STATE_DICT_KEYS if use_ema else _STATE_DICT_KEYS[1:]
    for key in keys:
      if key in obj and obj[key] is not None:
        state_dict = obj[key]
        if not _is_state_dict(state_dict):
          raise ValueError(f'{path!r}: {key!r} is not a mapping of names to tensors '
                           f'(got {type(state_dict).__name__})')
        break
    if state_dict is None and _is_state_dict(obj):
      state_dict = obj
  if state_dict is None:
    if isinstance(obj, Mapping):
      top = ', '.join(repr(k) for k in obj)
      raise ValueError(f'{path!r} holds no state dict: expected a "state_dict_ema" (with '
                       f'use_ema=True) or "state_dict" entry, or a plain mapping of names to '
                       f'tensors; top-level keys: [{top}]')
    raise ValueError(f'{path!r} holds a {type(obj).__name__}, not a state dict')
  out: Dict[str, np.ndarray] = {}
  for key, value in state_dict.items():
    name = key[len('module.'):] if key.startswith('module.') else key
    if name in out:
      raise ValueError(f'{path!r}: duplicate parameter {name!r} after stripping "module."')
    out[name] = value
  return out


def load_torch_variables(path: Any, *, model: Any, use_ema: bool = True,
                         image_size: Any = None) -> Dict[str, Any]:
  """Converts a PyTorch T2T-ViT checkpoint into ``model``'s variables.

  Args:
    path: as for :func:`load_pth`.
    model: the :class:`~vit_jax.models.t2t.T2TViT` the weights are for (its class count and
      fields must match the file's).
    use_ema: as for :func:`load_pth`.
    image_size: ``H`` or ``(H, W)`` the model will run at (default: the checkpoint's own
      ``pos_embed`` grid, 16 px per token).

  Returns:
    ``{'params': ..., 'constants': ...}`` of NumPy arrays (see
    :func:`vit_jax.models.t2t_torch.from_torch_state_dict`).

  Raises:
    ValueError: no ``model``, a model that is not a T2T-ViT, or a file that does not fit it;
      plus the errors of :func:`load_pth`.
  """
  path = paths.normalize(path)
  if model is None:
    raise ValueError(
        f'{path!r} is a PyTorch checkpoint: converting it into Flax variables needs the model. '
        'Pass model= (e.g. load(path, model=vit_jax.models.create("T2T-ViT-14", '
        'num_classes=1000))), or use vit_jax.checkpoint.load_pth(path) for the raw PyTorch state '
        'dict (names -> np.ndarray).')
  if not isinstance(model, t2t.T2TViT):
    raise ValueError(f'load(model=...) of a PyTorch checkpoint supports T2T-ViT models only '
                     f'(vit_jax.models.t2t.T2TViT), got {type(model).__name__}')
  state_dict = load_pth(path, use_ema=use_ema)
  return t2t_torch.from_torch_state_dict(state_dict, model, image_size=image_size)


def load_torch_as_saved(path: Any, model: Any, *, use_ema: bool = True) -> Dict[str, Any]:
  """Converts a PyTorch T2T-ViT file for ``model``'s architecture at the file's own class count
  and input size (read from its ``head.weight`` and ``pos_embed``), whatever ``model``'s are.

  Returns:
    ``{'params': ..., 'constants': ...}`` of NumPy arrays.

  Raises:
    ValueError: ``model`` is not a T2T-ViT, or the file does not fit its architecture.
  """
  path = paths.normalize(path)
  if not isinstance(model, t2t.T2TViT):
    raise ValueError(f'{path!r} is a PyTorch checkpoint; only T2T-ViT models load those, '
                     f'not {type(model).__name__}.')
  state_dict = load_pth(path, use_ema=use_ema)
  head = [np.shape(v)[0] for k, v in state_dict.items() if k.split('.')[-2:] == ['head', 'weight']]
  if head:
    model = model.clone(num_classes=int(head[0]))
  return t2t_torch.from_torch_state_dict(state_dict, model)
