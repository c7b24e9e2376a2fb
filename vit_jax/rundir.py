"""The run directory (``--workdir``; its files: docs/checkpoints.md, "The workdir"): its layout
and what the file system tells of it, read without JAX (the tools check a SOURCE before their
set-up), local or ``gs://`` (``etils.epath``); :mod:`vit_jax.checkpoint.workdir` writes it and
reads its checkpoints. A step is ``checkpoints/<step>/`` (being written:
``<step>.orbax-checkpoint-tmp*``) with the items ``state/`` (the train state, StandardSave) and
``cost/`` ``[config/ dataset/]`` (JsonSave)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from etils import epath

CHECKPOINTS_DIR = 'checkpoints'
CONFIG_JSON = 'config.json'
COST_JSON = 'cost.json'
COMPILATION_CACHE_DIR = 'compilation_cache'  # JAX's persistent cache (configs.md).
DATASET_JSON = 'dataset.json'
LOCK_JSON = 'lock.json'  # The run holding the workdir (checkpoint/lock.py).
#: Items of one checkpoint step.
STATE_ITEM = 'state'
COST_ITEM = 'cost'
CONFIG_ITEM = 'config'
DATASET_ITEM = 'dataset'
#: Orbax's markers: of a complete item, and of a committed step on remote storage.
ITEM_MARKER = '_METADATA'
#: In the name of a step Orbax is still writing: '<step>.orbax-checkpoint-tmp-<n>'.
TMP_MARKER = '.orbax-checkpoint-tmp'

#: The Orbax paths that the readers accept, in words (for error messages).
ORBAX_PATHS = (f"a workdir containing '{CHECKPOINTS_DIR}/', a '{CHECKPOINTS_DIR}' directory of "
               f"numbered steps, or one step directory containing '{STATE_ITEM}/'")
#: Every source a model is read from (`vit_jax.checkpoint.open`), the one text that lists them.
ACCEPTED_FORMATS = (
    f"a training workdir ({ORBAX_PATHS}), an official ViT '.npz' file (flat "
    "'/'-joined parameter names, Linen or pre-Linen numbering) or a big_vision one, a Hugging "
    "Face transformers ViT directory (config.json and model.safetensors), a timm "
    "VisionTransformer '.safetensors' file, a PyTorch T2T-ViT checkpoint ('.pth', '.pth.tar', "
    "'.pt' in the zip format of torch.save >= 1.6; load(path, model=t2t_model)), or an Orbax "
    "variables checkpoint written by python -m vit_jax.convert")
COMMIT_MARKER = 'commit_success.txt'


class Run(NamedTuple):
  """What a path names of a run (None for what it does not): ``workdir`` (absolute when local),
  ``checkpoints`` (the directory of numbered steps) or ``step_dir`` (one step)."""
  workdir: Optional[str]
  checkpoints: Optional[str]
  step_dir: Optional[str]


def _workdir_above(directory: epath.Path) -> Optional[str]:
  """The parent of a directory of steps (or of one step's) when it is the run's: the directory is
  named ``checkpoints`` or the parent holds ``config.json``."""
  if '://' not in str(directory):
    directory = epath.Path(os.path.abspath(directory))
  is_run = directory.name == CHECKPOINTS_DIR or (directory.parent / CONFIG_JSON).exists()
  return str(directory.parent) if is_run else None


def find(path: Any, names: Optional[Sequence[str]] = None) -> Run:
  """The :class:`Run` of ``path``: a workdir (it has ``checkpoints/``), its ``checkpoints`` (or
  another directory of numbered steps), one step (it has ``state/``) or a step's state item.
  ``names``: the directory's listing when the caller has read it (then not read again)."""
  path = os.fspath(path)
  directory = epath.Path(path if '://' in path else os.path.expanduser(path))
  if names is None and not directory.is_dir():
    return Run(None, None, None)
  if directory.name == STATE_ITEM and directory.parent.name.isdigit():
    directory, names = directory.parent, None
  if (names is None or CHECKPOINTS_DIR in names) and (directory / CHECKPOINTS_DIR).is_dir():
    root = str(directory) if '://' in str(directory) else os.path.abspath(directory)
    return Run(root, str(directory / CHECKPOINTS_DIR), None)
  if names is None:
    names = [p.name for p in directory.iterdir()]
  if directory.name == CHECKPOINTS_DIR or any(n.isdigit() for n in names):
    return Run(_workdir_above(directory), str(directory), None)
  if STATE_ITEM in names and (directory / STATE_ITEM).is_dir():
    return Run(_workdir_above(directory.parent), None, str(directory))
  return Run(None, None, None)


def saved_steps(checkpoints: Any, *, readable: bool = False) -> List[int]:
  """The finalized steps in ``checkpoints``, ascending (``[]`` without the directory).

  Orbax writes a step as ``<step>.orbax-checkpoint-tmp-*`` and renames it when complete (remote:
  with ``commit_success.txt``), so the digit-only names are finalized. ``readable``: only those
  whose state item is complete, as the readers need."""
  directory = epath.Path(checkpoints)
  if not directory.is_dir():
    return []
  marker = (f'{STATE_ITEM}/{ITEM_MARKER}' if readable else
            COMMIT_MARKER if '://' in str(checkpoints) else None)
  return sorted(int(d.name) for d in directory.iterdir()
                if d.name.isdigit() and d.is_dir() and (marker is None or (d / marker).exists()))


def read_json(path: Any) -> Optional[Dict[str, Any]]:
  """The JSON object in a run's file (e.g. ``WORKDIR/config.json``), or None without the file.
  Raises ValueError (naming the file and the fix) when it is not a JSON object; OSError."""
  file = epath.Path(path)
  if not file.exists():
    return None
  try:
    value = json.loads(file.read_text())
  except ValueError as e:
    value = e
  if not isinstance(value, dict):
    what = f'not valid JSON ({value})' if isinstance(value, ValueError) else 'not a JSON object'
    raise ValueError(f'{path} is {what}; restore it or delete it.')
  return value
