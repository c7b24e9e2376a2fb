"""The checkpoint formats, and :func:`open`, which detects a path's format once.

Each format is a :class:`Format` in :data:`FORMATS` (tried in that order): ``sniff`` tells it from
a :class:`Probe` (a file's first bytes and zip member list, or a directory's listing; nothing is
unpickled), ``fields`` gives the model fields the file implies, ``read`` its variables. To add a
format, add one here. A zip whose directory cannot be read raises
:class:`DamagedCheckpointError`, whatever its name.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Dict, Optional, Tuple

from absl import logging
import numpy as np

from vit_jax import models
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import npz
from vit_jax.checkpoint import paths
from vit_jax.checkpoint import pytorch
from vit_jax.checkpoint import safetensors_file
from vit_jax.checkpoint import torch_pickle
from vit_jax.checkpoint import tree
from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint import workdir
from vit_jax.checkpoint.torch_pickle import DamagedCheckpointError  # noqa: F401 (raised by open)

#: What a checkpoint source can be: the one list, quoted by every error and help text.
ACCEPTED_FORMATS = (
    f"a training workdir ({workdir.ORBAX_PATHS}), an official ViT '.npz' file (flat "
    "'/'-joined parameter names, Linen or pre-Linen numbering) or a big_vision one, a Hugging "
    "Face transformers ViT directory (config.json and model.safetensors), a timm "
    "VisionTransformer '.safetensors' file, a PyTorch T2T-ViT checkpoint ('.pth', '.pth.tar', "
    "'.pt' in the zip format of torch.save >= 1.6; load(path, model=t2t_model)), or an Orbax "
    "variables checkpoint written by python -m vit_jax.convert")

#: File names treated as PyTorch checkpoints (a zip with '<name>/data.pkl' is one whatever its
#: name).
TORCH_SUFFIXES = ('.pth', '.pth.tar', '.pt')

#: The format names (:attr:`Checkpoint.name`).
NPZ, PYTORCH, ORBAX = 'npz', 'pytorch', 'orbax'
HF, TIMM = ecosystem.HF, ecosystem.TIMM

_NPY_MAGIC = b'\x93NUMPY'
_PICKLE_MAGIC = b'\x80'


@dataclasses.dataclass
class Probe:
  """What detection reads of a path, once, and hands on to the reader: ``path`` (normalized),
  ``is_dir``, ``head`` (a file's first 9 bytes), ``source`` (a zip's local path, or a
  ``BytesIO`` of a remote zip), ``zip_names`` (its members), ``hf_directory`` (the transformers
  directory of the path, else None), ``safetensors`` (``'hf'``/``'timm'`` for such a file)."""
  path: str
  is_dir: bool
  head: bytes = b''
  source: Any = None
  zip_names: Optional[Tuple[str, ...]] = None
  hf_directory: Optional[str] = None
  safetensors: Optional[str] = None


def _probe(path: Any) -> Probe:
  path, is_dir, head = paths.probe(path, 9)
  if is_dir:
    return Probe(path, True, hf_directory=ecosystem.hf_directory(path, is_dir=True))
  probe = Probe(path, False, head)
  if safetensors_file.is_safetensors(head) or path.endswith(safetensors_file.SUFFIX):
    probe.hf_directory = ecosystem.hf_directory(path, is_dir=False)
    probe.safetensors = ecosystem.detect_file(path, probe.hf_directory)
  elif head[:4] in torch_pickle.ZIP_MAGICS:
    # Read once, for detection and the reader.
    probe.source = io.BytesIO(paths.read_bytes(path)) if paths.is_remote(path) else path
    with torch_pickle.open_zip(probe.source, path) as archive:
      probe.zip_names = tuple(archive.namelist())
  return probe


def _fitted(ckpt: 'Checkpoint', variables: Dict[str, Any], model: Any, image_size: Any,
            evaluate: bool) -> Dict[str, Any]:
  """``variables``, checked to fit ``model`` at ``image_size`` when both are given."""
  if model is not None and image_size is not None and evaluate:
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    tree.check_fits(variables, models.abstract_variables(model, (int(height), int(width))),
                    what=ckpt.path)
  return variables


class Format:
  """One checkpoint format. ``name``: its :attr:`Checkpoint.name`; ``family``: for logs."""
  name = family = ''

  def sniff(self, probe: Probe) -> bool:
    raise NotImplementedError

  def fields(self, ckpt: 'Checkpoint', num_heads: Optional[int]) -> Dict[str, Any]:
    """The ViT fields the weights need (:func:`vit_jax.checkpoint.model_fields`)."""
    shapes = {k: tuple(np.shape(v)) for k, v in tree.flatten_params(ckpt.read()).items()}
    fields = vit_shapes.architecture_fields(shapes)
    if fields is None:
      raise ValueError(f'{ckpt.path} holds no ViT parameters (no embedding/kernel).')
    fields.update(gelu_approximate=True, layer_norm_epsilon=models.vit.LAYERNORM_EPSILON,
                  image_size=vit_shapes.image_size(shapes, fields))
    return fields

  def numerics(self, ckpt: 'Checkpoint', num_heads: Optional[int]
               ) -> Optional[Tuple[Dict[str, Any], str]]:
    """``(numerics fields, family)`` read from the headers only, or None when the format
    records none (``vit_jax.config`` sets a fine-tuning model's numerics from them)."""
    return None

  def read(self, ckpt: 'Checkpoint', *, model: Any, use_ema: bool, image_size: Any,
           evaluate: bool) -> Dict[str, Any]:
    raise NotImplementedError

  def read_for_finetuning(self, ckpt: 'Checkpoint', model: Any, use_ema: bool) -> Dict[str, Any]:
    return self.read(ckpt, model=model, use_ema=use_ema, image_size=None, evaluate=False)


class _Npz(Format):
  name, family = NPZ, 'an official .npz'

  def sniff(self, probe):
    return probe.zip_names is not None

  def numerics(self, ckpt, num_heads):
    names = [k[len('params/'):] if k.startswith('params/') else k
             for k in npz.read_npz_index(ckpt.path, ckpt.probe.source)]
    if 'embedding/kernel' not in names:  # Not a ViT's .npz: left to the load's checks.
      return None
    # The raw names of an official or big_vision file (`vit_jax.checkpoint.big_vision`).
    fields = {'posemb': 'learn' if any(k.endswith('pos_embedding') for k in names)
                        else 'sincos2d',
              'classifier': 'map' if any(k.startswith(('MAPHead_0/', 'probe')) for k in names)
                            else 'token' if 'cls' in names else 'gap'}
    big_vision = (fields['posemb'] == 'sincos2d' or 'pos_embedding' in names
                  or fields['classifier'] == 'map')
    return fields, 'a big_vision .npz' if big_vision else self.family

  def read(self, ckpt, *, model, use_ema, image_size, evaluate):
    return _fitted(ckpt, npz.load_npz(ckpt.path, ckpt.probe.source), model, image_size,
                   evaluate)


class _PyTorch(Format):
  name, family = PYTORCH, 'a PyTorch T2T-ViT checkpoint'

  def sniff(self, probe):
    if probe.zip_names is not None:
      return torch_pickle.has_torch_layout(probe.zip_names)
    return (not probe.is_dir and probe.path.lower().endswith(TORCH_SUFFIXES)
            or probe.head[:1] == _PICKLE_MAGIC)

  def fields(self, ckpt, num_heads):
    raise ValueError(f'{ckpt.path} is a PyTorch (T2T-ViT) checkpoint: its variant is not '
                     'recorded; name the model (e.g. T2T-ViT-14).')

  def read(self, ckpt, *, model, use_ema, image_size, evaluate):
    return pytorch.load_torch_variables(ckpt.path, model=model, use_ema=use_ema,
                                        image_size=image_size, source=ckpt.probe.source)

  def read_for_finetuning(self, ckpt, model, use_ema):
    return pytorch.load_torch_as_saved(ckpt.path, model, use_ema=use_ema,
                                       source=ckpt.probe.source)


class _Orbax(Format):
  name, family = ORBAX, 'an Orbax checkpoint'

  def sniff(self, probe):
    return probe.is_dir

  def read(self, ckpt, *, model, use_ema, image_size, evaluate):
    return _fitted(ckpt, workdir.load_orbax(ckpt.path, use_ema=use_ema), model, image_size,
                   evaluate)


class _Foreign(Format):
  """transformers (``hf``) or timm ViT weights (:mod:`.ecosystem`)."""

  def __init__(self, name: str, family: str):
    self.name, self.family = name, family

  def sniff(self, probe):
    if probe.is_dir:
      return self.name == HF and probe.hf_directory is not None
    return probe.safetensors == self.name

  def fields(self, ckpt, num_heads):
    return ecosystem.read_fields(ckpt.path, self.name, num_heads, ckpt.probe.hf_directory)

  def numerics(self, ckpt, num_heads):
    return self.fields(ckpt, num_heads), self.family

  def read(self, ckpt, *, model, use_ema, image_size, evaluate):
    foreign = ckpt.foreign(getattr(model, 'num_heads', None))
    if model is not None and evaluate:
      ecosystem.check_numerics(foreign.fields, model, ckpt.path)
    return _fitted(ckpt, foreign.variables, model, image_size or foreign.image_size, evaluate)

  def read_for_finetuning(self, ckpt, model, use_ema):
    foreign = ckpt.foreign(getattr(model, 'num_heads', None))
    try:
      ecosystem.check_numerics(foreign.fields, model, ckpt.path)
    except ValueError as e:
      logging.warning('Fine-tuning with other numerics than the weights were trained with: %s',
                      e)
    return foreign.variables


#: Every format, in detection order (a torch zip before any zip, transformers before Orbax).
FORMATS = (_Foreign(HF, 'a transformers ViT'), _Foreign(TIMM, 'a timm ViT'), _PyTorch(),
           _Npz(), _Orbax())


@dataclasses.dataclass
class Checkpoint:
  """A checkpoint opened by :func:`open`: its path, format and what detection read."""
  path: str
  format: Format
  probe: Probe

  @property
  def name(self) -> str:
    """``'npz'``, ``'pytorch'``, ``'orbax'``, ``'hf'`` or ``'timm'``."""
    return self.format.name

  def fields(self, num_heads: Optional[int] = None) -> Dict[str, Any]:
    return self.format.fields(self, num_heads)

  def numerics(self, num_heads: Optional[int] = None):
    return self.format.numerics(self, num_heads)

  def foreign(self, num_heads: Optional[int] = None) -> ecosystem.Foreign:
    """transformers / timm weights with their fields and class names (:func:`ecosystem.read`)."""
    return ecosystem.read(self.path, self.name, num_heads, self.probe.hf_directory)

  def read(self, *, model: Any = None, use_ema: bool = True, image_size: Any = None,
           evaluate: bool = True) -> Dict[str, Any]:
    """The variables (:func:`vit_jax.checkpoint.load`); with ``model`` and an image size (given,
    or the file's) and ``evaluate``, checked to fit ``model``."""
    return self.format.read(self, model=model, use_ema=use_ema, image_size=image_size,
                            evaluate=evaluate)

  def read_for_finetuning(self, model: Any, use_ema: bool = True) -> Dict[str, Any]:
    """The variables at the file's own class count and size, for ``init_for_finetuning``."""
    return self.format.read_for_finetuning(self, model, use_ema)


def open(source: Any) -> Checkpoint:  # pylint: disable=redefined-builtin
  """Detects the format of the checkpoint at ``source`` (local or ``scheme://``), once.

  Raises:
    FileNotFoundError: nothing exists at ``source``.
    DamagedCheckpointError: a zip archive whose directory cannot be read (a ``ValueError``).
    ValueError: no accepted format (named, with :data:`ACCEPTED_FORMATS`), e.g. a single-array
      ``.npy`` file or text; a ``.safetensors`` file of another model, or with transformers
      names but no ``config.json`` beside it.
  """
  probe = _probe(source)
  path = probe.path
  for fmt in FORMATS:
    if fmt.sniff(probe):
      return Checkpoint(path, fmt, probe)
  what = 'a single-array .npy file, not a checkpoint' if probe.head[:6] == _NPY_MAGIC else None
  raise ValueError(f'{path!r} is {what}. Accepted formats: {ACCEPTED_FORMATS}' if what else
                   f'Unrecognised checkpoint format at {path!r}. Accepted formats: '
                   f'{ACCEPTED_FORMATS}')


def detect(path: Any) -> str:
  """The format name of the checkpoint at ``path`` (:func:`open`'s ``name``); raises as it."""
  return open(path).name


def is_torch_checkpoint(path: Any) -> bool:
  """Whether the file at ``path`` is read as a PyTorch checkpoint.

  Raises:
    OSError: the file cannot be read (e.g. ``FileNotFoundError``, or a directory).
    DamagedCheckpointError: a zip archive whose directory cannot be read.
  """
  probe = _probe(path)
  if probe.is_dir:
    raise IsADirectoryError(probe.path)
  return FORMATS[2].sniff(probe)
