"""Which checkpoint format a path holds: :func:`detect`, called once per load.

* a directory with ``config.json`` and ``model.safetensors`` (or its shard index) -> ``'hf'``
  (a transformers ViT, :mod:`.hf_vit`);
* a ``.safetensors`` file -> ``'hf'`` (transformers names, ``config.json`` beside it) or
  ``'timm'`` (timm's names, :mod:`.timm_vit`), from the names in its header;
* another directory -> ``'orbax'`` (a training workdir, its ``checkpoints`` directory, one step, or a
  variables checkpoint written by ``python -m vit_jax.convert``; see :mod:`.workdir`);
* a file that is a torch zip (one ``<name>/data.pkl``), a raw pickle, or a non-zip file named
  ``.pth``/``.pth.tar``/``.pt`` -> ``'pytorch'`` (:mod:`.pytorch`; the legacy torch format is
  refused there with the reason);
* any other zip archive -> ``'npz'`` (:mod:`.npz`; official or big_vision layout).

Only the first bytes of a file are read (and, for a zip, its member list); nothing is unpickled.
A file that starts as a zip but whose directory cannot be read (a truncated download) raises
:class:`DamagedCheckpointError`, whatever its name.
"""

from __future__ import annotations

import io
from typing import Any

from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import paths
from vit_jax.checkpoint import safetensors_file
from vit_jax.checkpoint import torch_pickle
from vit_jax.checkpoint import workdir
from vit_jax.checkpoint.torch_pickle import DamagedCheckpointError  # noqa: F401 (raised by detect)

ACCEPTED_FORMATS = (
    "an official ViT '.npz' file (flat '/'-joined parameter names, Linen or pre-Linen numbering) "
    "or a big_vision one, a Hugging Face transformers ViT directory (config.json and "
    "model.safetensors), a timm VisionTransformer '.safetensors' file, "
    f"an Orbax checkpoint written by the training loop ({workdir.ORBAX_PATHS}), "
    "or a PyTorch T2T-ViT checkpoint ('.pth', '.pth.tar', '.pt' in the zip format of torch.save "
    ">= 1.6; load(path, model=t2t_model))")

#: File names treated as PyTorch checkpoints (a zip with '<name>/data.pkl' is one whatever its
#: name).
TORCH_SUFFIXES = ('.pth', '.pth.tar', '.pt')

#: The values :func:`detect` returns.
NPZ, PYTORCH, ORBAX = 'npz', 'pytorch', 'orbax'
HF, TIMM = ecosystem.HF, ecosystem.TIMM

_NPY_MAGIC = b'\x93NUMPY'
_PICKLE_MAGIC = b'\x80'


def detect(path: Any) -> str:
  """The format of the checkpoint at ``path``: ``'npz'``, ``'pytorch'``, ``'orbax'``, ``'hf'`` or
  ``'timm'``.

  Args:
    path: local or ``scheme://`` path (str or ``os.PathLike``).

  Raises:
    FileNotFoundError: nothing exists at ``path``.
    DamagedCheckpointError: a zip archive (by its first bytes) whose directory cannot be read,
      e.g. a truncated download (a ``ValueError``; the message names the file, its size and the
      fix).
    ValueError: a file of no accepted format (the message names it and lists the accepted ones),
      e.g. a single-array ``.npy`` file or text; a ``.safetensors`` file of another model, or
      with transformers names but no ``config.json`` beside it.
  """
  path = paths.normalize(path)
  if not paths.exists(path):
    raise paths.not_found(path)
  if paths.isdir(path):
    return HF if ecosystem.hf_directory(path) else ORBAX
  head = paths.read_head(path, 9)
  if safetensors_file.is_safetensors(head) or path.endswith(safetensors_file.SUFFIX):
    return ecosystem.detect_file(path)
  magic = head[:6]
  if _is_torch(path, magic):
    return PYTORCH
  if magic[:4] in torch_pickle.ZIP_MAGICS:
    return NPZ
  if magic == _NPY_MAGIC:
    raise ValueError(f'{path!r} is a single-array .npy file, not a checkpoint. '
                     f'Accepted formats: {ACCEPTED_FORMATS}')
  raise ValueError(f'Unrecognised checkpoint format at {path!r}. Accepted formats: '
                   f'{ACCEPTED_FORMATS}')


def is_torch_checkpoint(path: Any) -> bool:
  """Whether the file at ``path`` is read as a PyTorch checkpoint (see the module docstring).

  Raises:
    OSError: the file cannot be read (e.g. ``FileNotFoundError``, or a directory).
    DamagedCheckpointError: a zip archive whose directory cannot be read.
  """
  path = paths.normalize(path)
  return _is_torch(path, paths.read_head(path, 6))


def _is_torch(path: str, magic: bytes) -> bool:
  if magic[:4] in torch_pickle.ZIP_MAGICS:
    source = io.BytesIO(paths.read_bytes(path)) if paths.is_remote(path) else path
    with torch_pickle.open_zip(source, path) as archive:
      return torch_pickle.has_torch_layout(archive.namelist())
  return path.lower().endswith(TORCH_SUFFIXES) or magic[:1] == _PICKLE_MAGIC
