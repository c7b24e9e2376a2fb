"""The run directory (``--workdir``; docs/checkpoints.md, "The workdir"): its layout and what the
file system tells of it, read without JAX; :mod:`vit_jax.checkpoint.workdir` writes it. A step:
``checkpoints/<step>/`` with the items ``state/`` (StandardSave), ``cost/`` [``config/``
``dataset/``] (JsonSave)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from vit_jax import storage

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
    "variables checkpoint written by python -m vit_jax.convert; or a Hub name of the "
    "transformers or timm ones, hf-hub:ORG/NAME[@REVISION]")
COMMIT_MARKER = 'commit_success.txt'


class Run(NamedTuple):
  """What a path names of a run (None for what it does not): ``workdir`` (absolute when local),
  ``checkpoints`` (the directory of numbered steps) or ``step_dir`` (one step)."""
  workdir: Optional[str]
  checkpoints: Optional[str]
  step_dir: Optional[str]


def _workdir_above(directory: str) -> Optional[str]:
  """The parent of a directory of steps (or of one step's) when it is the run's: the directory is
  named ``checkpoints`` or the parent holds ``config.json``."""
  directory = storage.absolute(directory)
  parent = storage.dirname(directory)
  is_run = (storage.basename(directory) == CHECKPOINTS_DIR
            or storage.exists(storage.join(parent, CONFIG_JSON)))
  return parent if is_run else None


def find(path: Any, names: Optional[Sequence[str]] = None) -> Run:
  """The :class:`Run` of ``path``: a workdir (it has ``checkpoints/``), its ``checkpoints`` (or
  another directory of numbered steps), one step (it has ``state/``) or a step's state item.
  ``names``: the directory's listing when the caller has read it (then not read again)."""
  directory = storage.clean(storage.normalize(path))
  if names is None and not storage.isdir(directory):
    return Run(None, None, None)
  parent = storage.dirname(directory)
  if storage.basename(directory) == STATE_ITEM and storage.basename(parent).isdigit():
    directory = parent
    names = None
  checkpoints = storage.join(directory, CHECKPOINTS_DIR)
  if (names is None or CHECKPOINTS_DIR in names) and storage.isdir(checkpoints):
    return Run(storage.absolute(directory), checkpoints, None)
  if names is None:
    names = storage.listdir(directory)
  if storage.basename(directory) == CHECKPOINTS_DIR or any(n.isdigit() for n in names):
    return Run(_workdir_above(directory), directory, None)
  if STATE_ITEM in names and storage.isdir(storage.join(directory, STATE_ITEM)):
    return Run(_workdir_above(storage.dirname(directory)), None, directory)
  return Run(None, None, None)


def saved_steps(checkpoints: Any, *, readable: bool = False) -> List[int]:
  """The finalized steps in ``checkpoints`` (digit-only names; remote: with ``COMMIT_MARKER``),
  ascending (``[]`` without the directory); ``readable``: only those whose state is complete."""
  directory = storage.clean(os.fspath(checkpoints))
  if not storage.isdir(directory):
    return []
  if readable:
    marker = f'{STATE_ITEM}/{ITEM_MARKER}'
  elif storage.is_remote(directory):
    marker = COMMIT_MARKER
  else:
    marker = None
  steps = [storage.join(directory, name) for name in storage.listdir(directory) if name.isdigit()]
  finalized = []
  for step in steps:
    if storage.isdir(step) and (marker is None or storage.exists(storage.join(step, marker))):
      finalized.append(int(storage.basename(step)))
  return sorted(finalized)


#: The bounds of any JSON file the project reads: larger or deeper is a damaged or foreign file.
MAX_JSON_BYTES = 16 << 20
MAX_JSON_DEPTH = 64
#: What to do about a refused file, unless the reader knows better.
JSON_FIX = 'restore it or delete it'
_TOO_DEEP = object()  # What json's decoder found: deeper than its recursion goes.


def _nested_deeper(value: Any, limit: int) -> bool:
  """Whether a parsed JSON ``value`` nests more than ``limit`` deep (walked without recursion)."""
  stack = [(value, 1)]
  while stack:
    value, depth = stack.pop()
    if isinstance(value, (dict, list)):
      if depth > limit:
        return True
      children = value.values() if isinstance(value, dict) else value
      stack.extend((v, depth + 1) for v in children)
  return False


def parse_json(data: Any, name: Any, *, fix: str = JSON_FIX,
               max_bytes: int = MAX_JSON_BYTES) -> Any:
  """The JSON value of ``data`` (the text of the file ``name``), of at most ``max_bytes`` and
  :data:`MAX_JSON_DEPTH` levels. Raises ValueError ``'<name> is <the problem>; <fix>.'``: too
  large, too deep, not UTF-8, not JSON."""
  value = None
  problem = None
  if len(data) > max_bytes:
    problem = (f'larger than {max_bytes:,} bytes, more than any JSON file read here (a damaged '
               'or foreign file)')
  else:
    try:
      value = json.loads(data)
    except RecursionError:  # json's decoder recurses: a far deeper file ends its recursion.
      value = _TOO_DEEP
    except ValueError as e:  # UnicodeDecodeError included.
      problem = f'not valid JSON ({str(e)[:200]})'
  if problem is None and (value is _TOO_DEEP or _nested_deeper(value, MAX_JSON_DEPTH)):
    problem = (f'nested more than {MAX_JSON_DEPTH} levels deep, deeper than any JSON file read '
               'here (a damaged or foreign file)')
  if problem is None:
    return value
  raise ValueError(f'{name} is {problem}; {fix}.')


def read_json(path: Any, *, fix: str = JSON_FIX,
              max_bytes: int = MAX_JSON_BYTES) -> Optional[Dict[str, Any]]:
  """The JSON object in the file at ``path`` (local or ``gs://``), or None without the file.
  Raises ValueError as :func:`parse_json`, and for no JSON object or a local path that is no
  regular file (never opened); OSError when it cannot be read."""
  file = os.fspath(path)
  if not storage.exists(file):
    return None
  odd = storage.not_a_file(file)  # Never blocks (a FIFO is not opened).
  if odd:
    what = 'a directory' if odd == 'a directory' else 'a special file (a FIFO, socket or device)'
    raise ValueError(f'{path} is {what}, not a JSON file: remove it (a run writes a file there).')
  with storage.open_file(file, 'rb') as f:
    value = parse_json(f.read(max_bytes + 1), path, fix=fix, max_bytes=max_bytes)
  if not isinstance(value, dict):
    raise ValueError(f'{path} is not a JSON object; {fix}.')
  return value
