"""PyTorch checkpoints (``.pth``, ``.pth.tar``, ``.pt``; e.g. the released T2T-ViT files), read
without torch and without running code (:mod:`.torch_pickle`: tensors become NumPy arrays, any
other global is refused; only the zip format of torch >= 1.6). Every error is a ``ValueError``.

:func:`load_pth` gives the raw state dict; :func:`load_torch_variables` converts it for a model
(:func:`.t2t_torch.from_torch_state_dict`), :func:`load_torch_as_saved` at the file's own class
count and input size.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Dict

import numpy as np

from vit_jax.checkpoint import paths
from vit_jax.checkpoint import torch_pickle
from vit_jax.checkpoint import t2t_torch
from vit_jax.models import t2t

_STATE_DICT_KEYS = ('state_dict_ema', 'state_dict')


def _is_state_dict(obj: Any) -> bool:
  return (isinstance(obj, Mapping) and len(obj) > 0 and
          all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()))


def _read_torch_file(path: str, source: Any = None) -> Any:
  """Loads a torch zip-format file safely (:mod:`.torch_pickle`); tensors -> ndarray.
  ``source``: the file's path or a ``BytesIO`` of it, when already read."""
  if source is None:
    source = io.BytesIO(paths.read_bytes(path)) if paths.is_remote(path) else path
  elif hasattr(source, 'seek'):
    source.seek(0)
  return torch_pickle.load_torch_zip(source, name=path)


def load_pth(path: Any, *, use_ema: bool = True, source: Any = None) -> Dict[str, np.ndarray]:
  """The state dict of a ``torch.save`` zip-format checkpoint, read without torch or unpickling.

  Args:
    path: local or ``scheme://`` path of a ``.pth``/``.pth.tar``/``.pt`` file.
    use_ema: return a training checkpoint's ``state_dict_ema`` (timm's ``CheckpointSaver``)
      when it has one, else its ``state_dict``; a plain state dict is returned as is.
    source: the file, already found (:func:`vit_jax.checkpoint.open`): a path or ``BytesIO``.

  Returns:
    ``{PyTorch name: np.ndarray}`` in the saved order and dtype, ``module.`` prefixes stripped.

  Raises:
    FileNotFoundError: missing file.
    ValueError: a legacy (non-zip) torch file, or no state dict in it (its keys listed).
    DamagedCheckpointError: a truncated, corrupt or hand-made file (:mod:`.torch_pickle`).
    UnsafePickleError: the pickle names a global other than tensors and plain containers.
  """
  if source is None:
    path = paths.normalize(path)
    if not paths.exists(path) or paths.isdir(path):
      raise paths.not_found(path, 'No PyTorch checkpoint file')
  obj = _read_torch_file(path, source)
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
                         image_size: Any = None, source: Any = None) -> Dict[str, Any]:
  """A PyTorch T2T-ViT checkpoint as ``model``'s ``{'params', 'constants'}`` (NumPy).

  Args:
    path, source, use_ema: as for :func:`load_pth`.
    model: the :class:`~vit_jax.models.t2t.T2TViT` the weights are for.
    image_size: ``H`` or ``(H, W)`` (default: the file's ``pos_embed`` grid, 16 px per token).

  Raises:
    ValueError: no ``model``, not a T2T-ViT, a file that does not fit it; as :func:`load_pth`.
  """
  path = path if source is not None else paths.normalize(path)
  if model is None:
    raise ValueError(
        f'{path!r} is a PyTorch checkpoint: converting it into Flax variables needs the model. '
        'Pass model= (e.g. load(path, model=vit_jax.models.create("T2T-ViT-14", '
        'num_classes=1000))), or use vit_jax.checkpoint.load_pth(path) for the raw PyTorch state '
        'dict (names -> np.ndarray).')
  if not isinstance(model, t2t.T2TViT):
    raise ValueError(f'load(model=...) of a PyTorch checkpoint supports T2T-ViT models only '
                     f'(vit_jax.models.t2t.T2TViT), got {type(model).__name__}')
  state_dict = load_pth(path, use_ema=use_ema, source=source)
  return t2t_torch.from_torch_state_dict(state_dict, model, image_size=image_size)


def load_torch_as_saved(path: Any, model: Any, *, use_ema: bool = True,
                        source: Any = None) -> Dict[str, Any]:
  """As :func:`load_torch_variables`, at the file's own class count and input size (its
  ``head.weight`` and ``pos_embed``) whatever ``model``'s are."""
  path = path if source is not None else paths.normalize(path)
  if not isinstance(model, t2t.T2TViT):
    raise ValueError(f'{path!r} is a PyTorch checkpoint; only T2T-ViT models load those, '
                     f'not {type(model).__name__}.')
  state_dict = load_pth(path, use_ema=use_ema, source=source)
  head = [np.shape(v)[0] for k, v in state_dict.items() if k.split('.')[-2:] == ['head', 'weight']]
  if head:
    model = model.clone(num_classes=int(head[0]))
  return t2t_torch.from_torch_state_dict(state_dict, model)
