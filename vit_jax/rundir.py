"""The run directory (``--workdir``; its files: docs/checkpoints.md, "The workdir"): its layout
and what the file system tells of it, read without JAX (the tools check a SOURCE before their
set-up), local or ``gs://`` (``etils.epath``); :mod:`vit_jax.checkpoint.workdir` writes it and
reads its checkpoints. A step is ``checkpoints/<step>/`` (being written:
``<step>.orbax-checkpoint-tmp*``) with the items ``state/`` (the train state, StandardSave) and
``cost/`` ``[config/ dataset/]`` (JsonSave)."""

from __future__ import annotations

import json
import os
import stat
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


#: The bounds of any JSON file the project reads (its run files, transformers' and convert's
#: metadata, lock.json): larger or deeper is no such file, and is refused (a deep one would end
#: Python's recursion in the parser or in its readers, a huge one the memory).
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
      stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
  return False


def parse_json(data: Any, name: Any, *, fix: str = JSON_FIX,
               max_bytes: int = MAX_JSON_BYTES) -> Any:
  """The JSON value of ``data`` (bytes or str: the text of the file ``name``), of at most
  ``max_bytes`` and :data:`MAX_JSON_DEPTH` levels of arrays and objects. Raises ValueError
  ``'<name> is <the problem>; <fix>.'``: too large, too deep (told without recursion, in time
  linear in the size), not UTF-8, not JSON."""
  value, problem = None, None
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


class NotAFileError(OSError):
  """A path given as a file is a FIFO, socket or device: bad input (the tools exit 2); raised
  before it is opened (reading one waits forever)."""


def read_json(path: Any, *, fix: str = JSON_FIX,
              max_bytes: int = MAX_JSON_BYTES) -> Optional[Dict[str, Any]]:
  """The JSON object in the file at ``path`` (local or ``gs://``; e.g. ``WORKDIR/config.json``),
  or None without the file; read as :func:`parse_json` (at most ``max_bytes + 1`` bytes read).
  Raises ValueError ``'<path> is <the problem>; <fix>.'`` for a file that is too large, too deep,
  not JSON or not a JSON object, or a local path that is no regular file (a directory, a FIFO:
  never opened); OSError when it cannot be read."""
  file = epath.Path(path)
  if not file.exists():
    return None
  if '://' not in str(path) and not stat.S_ISREG(os.stat(path).st_mode):  # Never blocks (FIFO).
    what = 'a directory' if file.is_dir() else 'a special file (a FIFO, socket or device)'
    raise ValueError(f'{path} is {what}, not a JSON file: remove it (a run writes a file there).')
  with file.open('rb') as f:
    value = parse_json(f.read(max_bytes + 1), path, fix=fix, max_bytes=max_bytes)
  if not isinstance(value, dict):
    raise ValueError(f'{path} is not a JSON object; {fix}.')
  return value
