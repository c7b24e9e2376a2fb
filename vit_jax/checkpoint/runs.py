"""A training run read back from its directory: its step, train state, config and dataset record,
so that a workdir alone rebuilds its model. Layout: :mod:`.workdir` (older steps fall back to
``WORKDIR/config.json`` and ``dataset.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

from vit_jax.checkpoint import orbax
from vit_jax.checkpoint import paths
from vit_jax.checkpoint import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class SavedRun:
  """One step of a training run (or a variables checkpoint), as found on disk.

  Attributes:
    state_item: the Orbax item holding ``params`` (and ``ema_params``, ``model_state``).
    step: the step; None for a ``python -m vit_jax.convert`` variables checkpoint.
    config: the resolved config saved with the step, else ``config.json``; or None.
    dataset: the data record (``vit_jax.train.dataset_record``), same fallback; or None.
    has_ema: the item holds ``ema_params``.
    steps: every finalized step, ascending (``[]`` for a variables checkpoint).
  """

  state_item: str
  step: Optional[int]
  config: Optional[Dict[str, Any]]
  dataset: Optional[Dict[str, Any]]
  has_ema: bool
  steps: List[int]


def _finalized_steps(checkpoints_dir: str) -> Dict[int, str]:
  """{step: step directory} of the steps whose state item is complete."""
  found = {}
  for name in paths.listdir(checkpoints_dir):
    step_dir = paths.join(checkpoints_dir, name)
    if name.isdigit() and orbax.is_item(paths.join(step_dir, workdir_lib.STATE_ITEM)):
      found[int(name)] = step_dir
  return found


def _read_json_file(path: str) -> Optional[Dict[str, Any]]:
  if not paths.exists(path):
    return None
  try:
    return json.loads(paths.read_bytes(path))
  except ValueError as e:
    raise ValueError(f'{path} is not valid JSON ({e}); restore it or delete it.') from e


def _json_item(step_dir: str, item: str, fallback: Optional[str]) -> Optional[Dict[str, Any]]:
  if paths.isdir(paths.join(step_dir, item)):
    return orbax.read_json_item(paths.join(step_dir, item))
  return _read_json_file(fallback) if fallback else None


def _parent_with_config(path: str, levels: int) -> Optional[str]:
  """The directory ``levels`` above ``path`` when it holds a ``config.json`` (a workdir)."""
  parent = path.rstrip('/') if paths.is_remote(path) else os.path.abspath(path)
  for _ in range(levels):
    parent = posixpath.dirname(parent)
  has_config = parent and paths.exists(paths.join(parent, workdir_lib.CONFIG_JSON))
  return parent if has_config else None


def read_run(path: Any, *, step: Optional[int] = None) -> SavedRun:
  """The :class:`SavedRun` of ``path`` (see ``workdir.find_state_item``; local or ``gs://``).

  ``step``: default the latest finalized one; not allowed with a step directory or a variables
  checkpoint.

  Raises:
    FileNotFoundError: nothing at ``path``, no finalized step, or ``step`` not saved (listed).
    ValueError: an unrecognised ``path``, or an unreadable config / dataset record.
  """
  path = paths.normalize(path)
  if not paths.exists(path):
    raise paths.not_found(path)
  parent = posixpath.dirname(path.rstrip('/'))
  if paths.basename(path) == workdir_lib.STATE_ITEM and paths.basename(parent).isdigit():
    path = parent  # A step's state item: read as its step (with its config and class names).
  root = None  # The workdir, when known: its config.json and dataset.json are the fallback.
  if paths.isdir(paths.join(path, workdir_lib.CHECKPOINTS_DIR)):
    root, checkpoints_dir = path, paths.join(path, workdir_lib.CHECKPOINTS_DIR)
  elif paths.basename(path) == workdir_lib.CHECKPOINTS_DIR or any(
      n.isdigit() for n in paths.listdir(path)):
    checkpoints_dir = path
    root = _parent_with_config(path, 1)
  else:
    checkpoints_dir = None

  if checkpoints_dir is not None:
    found = _finalized_steps(checkpoints_dir)
    if not found:
      config_json = paths.join(root, workdir_lib.CONFIG_JSON) if root else None
      raise paths.not_found(checkpoints_dir, 'No finalized checkpoint step',
                            paths.nothing_saved_yet(checkpoints_dir, config_json))
    if step is None:
      step = max(found)
    elif step not in found:
      raise FileNotFoundError(
          f'Step {step} is not saved in {checkpoints_dir}; the saved steps are '
          f'{sorted(found)}: choose one of them (or leave out --step for the latest).')
    step_dir = found[step]
    steps = sorted(found)
  elif paths.isdir(paths.join(path, workdir_lib.STATE_ITEM)):  # One step directory.
    step_dir, steps = path, []
    name = paths.basename(path)
    if step is not None and (not name.isdigit() or int(name) != step):
      raise ValueError(f'{path} is one checkpoint step: leave out --step (or give the workdir).')
    step = int(name) if name.isdigit() else None
    root = _parent_with_config(path, 2)
  else:  # A variables checkpoint (or not a checkpoint at all: find_state_item says so).
    item = workdir_lib.find_state_item(path)
    if step is not None:
      raise ValueError(f'{path} is a variables checkpoint without steps: leave out --step.')
    tree = orbax.item_tree(item)
    return SavedRun(item, None, None, None,
                    isinstance(tree, Mapping) and isinstance(tree.get('ema_params'), Mapping), [])

  item = paths.join(step_dir, workdir_lib.STATE_ITEM)
  tree = orbax.item_tree(item)
  fallback = lambda name: paths.join(root, name) if root else None
  return SavedRun(
      state_item=item, step=step,
      config=_json_item(step_dir, workdir_lib.CONFIG_ITEM, fallback(workdir_lib.CONFIG_JSON)),
      dataset=_json_item(step_dir, workdir_lib.DATASET_ITEM, fallback(workdir_lib.DATASET_JSON)),
      has_ema=isinstance(tree, Mapping) and isinstance(tree.get('ema_params'), Mapping),
      steps=steps)
