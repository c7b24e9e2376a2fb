"""A run read back for the trainer and every tool (:func:`read_run`): one step's state item, config
and dataset record (layout: :mod:`vit_jax.rundir`)."""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import orbax
from vit_jax.rundir import CONFIG_ITEM, CONFIG_JSON, DATASET_ITEM, DATASET_JSON, STATE_ITEM


@dataclasses.dataclass(frozen=True)
class SavedRun:
  """One step of a run (or a convert directory: ``step`` None): the ``config`` and ``dataset``
  record saved with it (else the workdir's JSON files, or None), and the run's finalized
  ``steps`` ([]: one step given)."""

  state_item: str
  step: Optional[int]
  config: Optional[Dict[str, Any]]
  dataset: Optional[Dict[str, Any]]
  has_ema: bool
  steps: List[int]

  def dataset_source(self) -> Tuple[str, bool]:
    """Where ``dataset`` comes from: ``(the step's item, True)``, else ``(dataset.json, False)``."""
    step_dir = posixpath.dirname(self.state_item.rstrip('/'))
    item = storage.join(step_dir, DATASET_ITEM)
    if storage.isdir(item):
      return item, True
    return storage.join(step_dir.rsplit('/', 2)[0], DATASET_JSON), False


def _nothing_saved_yet(checkpoints: str, workdir: Optional[str]) -> str:
  """What to do about a run's ``checkpoints`` without a finalized step: wait for the save being
  written, or the first (``checkpoint_every_steps`` of its config.json), or train."""
  names = storage.listdir(checkpoints) if storage.isdir(checkpoints) else []
  writing = sorted(int(n.split('.')[0]) for n in names
                   if rundir.TMP_MARKER in n and n.split('.')[0].isdigit())
  try:
    config = rundir.read_json(storage.join(workdir, CONFIG_JSON)) if workdir else None
  except (ValueError, OSError):
    config = None
  every = (config or {}).get('checkpoint_every_steps')
  state = (f'the save of step {writing[-1]} is being written (or was cut off; the next start '
           'of the run removes it)' if writing else 'the run has saved no checkpoint yet')
  first = (f' (it saves every {every} steps, checkpoint_every_steps in its config.json, and at '
           'its end)' if isinstance(every, int) and not writing else '')
  return (f'{state}. Wait for its first checkpoint{first}, or train it first (python -m '
          'vit_jax.main --config ... --workdir '
          f"{posixpath.dirname(checkpoints.rstrip('/')) or '.'}); then give the workdir again, "
          'or one step directory <workdir>/checkpoints/<step>.')


def _locate(path: Any, step: Optional[int], missing: str, names: Optional[Sequence[str]] = None
            ) -> Tuple[str, Optional[str], Optional[int], List[int], Optional[str]]:
  """``(state item, step directory or None, step, steps, workdir)`` of ``path`` (as
  :func:`read_run`); ``missing`` names a run without steps; ``names``: the listing of ``path``
  that detection read (it is then normalized and exists)."""
  if names is None:
    path = storage.normalize(path)
    if not storage.exists(path):
      raise storage.not_found(path)
  run = rundir.find(path, names)
  if run.checkpoints is not None:
    steps = rundir.saved_steps(run.checkpoints, readable=True)
    if not steps:
      raise storage.not_found(run.checkpoints, missing,
                            _nothing_saved_yet(run.checkpoints, run.workdir))
    if step is not None and step not in steps:
      raise FileNotFoundError(
          f'Step {step} is not saved in {run.checkpoints}; the saved steps are {steps}: choose '
          'one of them (or leave out --step for the latest).')
    step = steps[-1] if step is None else step
    step_dir = storage.join(run.checkpoints, str(step))
    return storage.join(step_dir, STATE_ITEM), step_dir, step, steps, run.workdir
  if run.step_dir is not None:
    name = storage.basename(run.step_dir)
    if step is not None and (not name.isdigit() or int(name) != step):
      raise ValueError(f'{path} is one checkpoint step: leave out --step (or give the workdir).')
    return (storage.join(run.step_dir, STATE_ITEM), run.step_dir,
            int(name) if name.isdigit() else None, [], run.workdir)
  if not orbax.is_item(path):
    raise ValueError(f'Unrecognised checkpoint directory {path!r}. Accepted formats: '
                     f'{rundir.ACCEPTED_FORMATS}')
  if step is not None:
    raise ValueError(f'{path} is a variables checkpoint without steps: leave out --step.')
  return path, None, None, [], None


def find_state_item(path: Any, step: Optional[int] = None,
                    names: Optional[Sequence[str]] = None) -> str:
  """The Orbax item of the model variables for ``path`` (as :func:`_locate`; nothing read)."""
  return _locate(path, step, 'No finalized Orbax checkpoint step', names)[0]


def read_run(path: Any, *, step: Optional[int] = None) -> SavedRun:
  """The :class:`SavedRun` of ``path`` (local or ``gs://``): a workdir or its ``checkpoints``
  (``step``: default the latest finalized), one step directory or its state item, or a variables
  checkpoint (these two without ``step``). Raises FileNotFoundError (nothing at ``path``, no
  finalized step, ``step`` not saved) or ValueError (unrecognised, an unreadable JSON record)."""
  item, step_dir, step, steps, workdir = _locate(path, step, 'No finalized checkpoint step')
  saved = orbax.item_tree(item)
  has_ema = isinstance(saved, Mapping) and isinstance(saved.get('ema_params'), Mapping)
  if step_dir is None:  # A variables checkpoint: no config, no record.
    return SavedRun(item, None, None, None, has_ema, [])

  def record(name: str, file: str) -> Optional[Dict[str, Any]]:
    if storage.isdir(storage.join(step_dir, name)):
      return orbax.read_json_item(storage.join(step_dir, name))
    return rundir.read_json(storage.join(workdir, file)) if workdir else None

  return SavedRun(item, step, record(CONFIG_ITEM, CONFIG_JSON),
                  record(DATASET_ITEM, DATASET_JSON), has_ema, steps)


def load_orbax(path: Any, *, use_ema: bool = True) -> Dict[str, Any]:
  """``{'params': ..., **model_state}`` (NumPy, saved layout) of ``path`` (as :func:`read_run`);
  ``ema_params`` as ``params`` when saved and ``use_ema``. Raises FileNotFoundError, ValueError."""
  return orbax.read_variables(find_state_item(path), use_ema=use_ema)
