"""The run directory (``--workdir``): the only code that knows its layout.

::

  WORKDIR/
    config.json            the resolved config (Workdir.write_config)
    dataset.json           the training data's facts (Workdir.write_dataset)
    cost.json              the cost account so far (Workdir.write_cost; accounting.py)
    lock.json              the holder of the workdir (Workdir.lock; lock.py)
    checkpoints/           an Orbax CheckpointManager directory (Checkpoints)
      <step>/              a finalized step (in progress: '<step>.orbax-checkpoint-tmp*')
        state/ cost/ [config/ dataset/]   train state (StandardSave), the rest JsonSave
    events.out.tfevents.*  TensorBoard scalars and hparams (Workdir.metric_writer)

Local paths and ``gs://`` alike (``etils.epath``; local paths made absolute, as Orbax needs).
Readers find the train state through :func:`find_state_item`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from typing import Any, Dict, Iterator, List, Optional, Tuple

from vit_jax.checkpoint import durable
from vit_jax.checkpoint import lock as lock_lib
from vit_jax.checkpoint import orbax
from vit_jax.checkpoint import paths
from vit_jax.checkpoint import tree

#: Names inside WORKDIR.
CHECKPOINTS_DIR = 'checkpoints'
CONFIG_JSON = 'config.json'
COST_JSON = 'cost.json'
DATASET_JSON = 'dataset.json'
#: Items of one checkpoint step.
STATE_ITEM = 'state'
COST_ITEM = 'cost'
CONFIG_ITEM = 'config'
DATASET_ITEM = 'dataset'

#: The Orbax paths that the readers accept, in words (for error messages).
ORBAX_PATHS = (f"a workdir containing '{CHECKPOINTS_DIR}/', a '{CHECKPOINTS_DIR}' directory of "
               f"numbered steps, or one step directory containing '{STATE_ITEM}/'")

_RERUN_HINT = 'Rerun with the config it was trained with, or start a new run in another --workdir.'


class CheckpointSaveError(OSError):
  """Writing to the workdir failed (e.g. a full disk); the earlier checkpoints are intact."""


def _epath(path: str):
  from etils import epath  # pylint: disable=g-import-not-at-top
  return epath.Path(path if paths.is_remote(path) else os.path.abspath(path))


def _is_process_0() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0


def _write_json_atomically(path, value: Dict[str, Any]) -> None:
  """Writes ``value`` as JSON to ``path`` (an epath) with :func:`.durable.write_atomically`.

  Raises CheckpointSaveError when it cannot be written; the previous file stays.
  """
  text = json.dumps(value, indent=1)  # A TypeError here is a bug, not the disk's.
  try:
    durable.write_atomically(path, text)
  except OSError as e:
    cause = 'No space left on device' if e.errno == errno.ENOSPC else (e.strerror or str(e))
    raise CheckpointSaveError(
        f'Writing {path} failed: {cause}. The checkpoints already saved are intact; free disk '
        'space (or make the workdir writable) and rerun the same command to resume.') from e


class Workdir:
  """A run directory (local or ``gs://``); nothing is created until something is written.

  Attributes ``path`` (str as given) and ``checkpoints_dir``, ``cost_json``, ``config_json``,
  ``dataset_json`` (``etils.epath.Path``). Raises ValueError for an empty ``path``.
  """

  def __init__(self, path: Any):
    self.path = os.fspath(path)
    if not str(self.path).strip():
      raise ValueError('--workdir is empty: give the directory of the run (local or gs://), '
                       'e.g. --workdir /tmp/vit_run; an empty one would mean the current '
                       'directory.')
    root = _epath(self.path)
    self.checkpoints_dir = root / CHECKPOINTS_DIR
    self.cost_json = root / COST_JSON
    self.config_json = root / CONFIG_JSON
    self.dataset_json = root / DATASET_JSON

  def __repr__(self) -> str:
    return f'Workdir({self.path!r})'

  def check_writable(self) -> None:
    """Fails early when a local workdir cannot be created or written (``gs://`` is not checked).

    Raises PermissionError: the directory (or its nearest existing ancestor) is not a writable
    directory, or its ``checkpoints`` is not a directory.
    """
    if paths.is_remote(self.path):
      return
    path = os.path.abspath(self.path)
    while not os.path.exists(path):
      path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
      what = 'is not a directory' if not os.path.isdir(path) else 'is not writable'
      where = '' if path == os.path.abspath(self.path) else ' (where it would be created)'
      raise PermissionError(f'--workdir {self.path!r} cannot be used: {path}{where} {what}. '
                            'Choose a directory you can write to (or a gs:// path).')
    inside = os.path.join(os.path.abspath(self.path), CHECKPOINTS_DIR)
    if os.path.lexists(inside) and not os.path.isdir(inside):
      raise PermissionError(
          f'--workdir {self.path!r} cannot be used: {inside} is a file, where the run keeps '
          f'its checkpoint directory. Move it away (mv {inside} {inside}.moved) or choose '
          'another --workdir.')

  def lock(self, *, timeout_s: float) -> 'lock_lib.WorkdirLock':
    """The workdir's lock (``WORKDIR/lock.json``; not yet taken): see :mod:`.lock`."""
    return lock_lib.WorkdirLock(self.path, timeout_s=timeout_s)

  def saved_steps(self) -> List[int]:
    """The finalized checkpoint steps, ascending (``[]`` without ``checkpoints/``), by listing."""
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    if not self.checkpoints_dir.exists():
      return []
    return sorted(ocp.path.step.checkpoint_steps(self.checkpoints_dir))

  def check_state_fits(self, abstract_state: Any) -> None:
    """Checks the latest saved state's ``params`` / ``model_state`` against ``abstract_state``.

    From metadata only; no check when nothing is saved. Raises ValueError: another model's
    checkpoint, or a damaged step (the message says how to resume).
    """
    steps = self.saved_steps()
    if not steps:
      return
    empty = durable.damaged_files(self.checkpoints_dir / str(steps[-1]))
    if empty:  # Data that never reached the disk: a host crash (steps of earlier versions).
      raise damaged_step_error(
          self.checkpoints_dir, steps, None,
          cause=f'{len(empty)} empty files, e.g. {empty[0]}: lost in a host crash')
    state_dir = self.checkpoints_dir / str(steps[-1]) / STATE_ITEM
    try:
      orbax.check_state_fits(state_dir, abstract_state)
    except OSError as e:  # No readable metadata (orbax.check_state_fits), or unreadable files.
      cause = e.strerror if isinstance(e, FileNotFoundError) and e.strerror else None
      raise damaged_step_error(self.checkpoints_dir, steps, e, cause=cause) from e
    except ValueError as e:
      if _DAMAGE.search(str(e)):  # Tensorstore's read errors of damaged files.
        raise damaged_step_error(self.checkpoints_dir, steps, e) from e
      raise ValueError(f'{e}\n  {_RERUN_HINT}') from e

  def write_config(self, config: Dict[str, Any]) -> None:
    """Writes ``config.json`` atomically (process 0). Raises TypeError, CheckpointSaveError."""
    if _is_process_0():
      _write_json_atomically(self.config_json, config)

  def read_config(self) -> Optional[Dict[str, Any]]:
    """``config.json``, or None when absent. Raises ValueError for invalid JSON."""
    if not self.config_json.exists():
      return None
    try:
      return json.loads(self.config_json.read_text())
    except ValueError as e:
      raise ValueError(f'{self.config_json} is not valid JSON ({e}); restore it or delete '
                       'it.') from e

  def write_dataset(self, record: Dict[str, Any]) -> None:
    """Writes ``dataset.json`` atomically (process 0; fields: see ``vit_jax.train``).

    Raises CheckpointSaveError.
    """
    if _is_process_0():
      _write_json_atomically(self.dataset_json, record)

  def write_cost(self, report: Dict[str, Any]) -> None:
    """Writes ``cost.json`` atomically (process 0). Raises CheckpointSaveError."""
    if _is_process_0():
      _write_json_atomically(self.cost_json, report)

  def read_cost(self) -> Optional[Dict[str, Any]]:
    """``WORKDIR/cost.json``, or None when it is missing or unreadable (with a warning)."""
    try:
      return json.loads(self.cost_json.read_text()) if self.cost_json.exists() else None
    except (ValueError, OSError) as e:
      logging.getLogger('absl').warning(
          "Ignoring %s (%s); the checkpoint's cost account is used.", self.cost_json, e)
      return None

  def metric_writer(self, hparams: Dict[str, Any]):
    """clu's asynchronous TensorBoard writer (process 0 writes; scalar ``hparams`` as hparams).

    Raises CheckpointSaveError (also from its methods) when the events cannot be written.
    """
    import jax  # pylint: disable=g-import-not-at-top
    from clu import metric_writers  # pylint: disable=g-import-not-at-top
    try:
      writer = metric_writers.create_default_writer(
          self.path, just_logging=jax.process_index() > 0, asynchronous=True)
    except Exception as e:  # pylint: disable=broad-except  (TensorFlow's are not OSErrors)
      raise CheckpointSaveError(
          f'Cannot write the TensorBoard events to {self.path}: '
          f'{str(e).splitlines()[0][:300]}. Free disk space or fix the permissions there, then '
          'rerun the same command.') from e
    writer = _EventsWriter(writer, self.path)
    writer.write_hparams({k: v for k, v in hparams.items()
                          if isinstance(v, (int, float, str, bool))})
    return writer

  def checkpoints(self, *, keep: Optional[int], asynchronous: bool) -> 'Checkpoints':
    """The run's checkpoints (``WORKDIR/checkpoints``); see :class:`Checkpoints`."""
    return Checkpoints(self.checkpoints_dir, keep=keep, asynchronous=asynchronous)


#: What a failed write says when the disk or the permissions are the cause (TensorFlow's and
#: orbax's errors are not OSErrors).
_DISK_ERROR = re.compile(r'No space left|RESOURCE_EXHAUSTED|Permission denied|PERMISSION_DENIED|'
                         r'os_error')


#: What a failed read of a saved step says when its files are damaged (tensorstore's errors).
_DAMAGE = re.compile(r'OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|Error reading|error while reading|'
                     r'not valid for value|No such file|Unexpected end|checksum', re.IGNORECASE)


def damaged_step_error(directory: Any, steps: List[int], error: Optional[Exception],
                       step: Optional[int] = None, cause: Optional[str] = None) -> ValueError:
  """The ValueError for an unreadable saved step (default: the newest of ``steps``).

  Names the cause (default: ``error``'s first line) and the newest intact step to resume from.
  """
  step = max(steps) if step is None else step
  intact = [s for s in steps if s < step and not durable.damaged_files(_join(directory, s))]
  cause = cause or (str(error).splitlines()[0][:300] if str(error) else type(error).__name__)
  resume = (f'to resume from step {max(intact)}' if intact else 'to start afresh')
  return ValueError(
      f'The checkpoint of step {step} in {directory} cannot be read ({cause}): it is damaged '
      'or incomplete. '
      f'Move it away (mv {directory}/{step} {directory}/{step}.damaged) {resume}, then rerun '
      'the same command.')


def _join(directory: Any, step: int) -> str:
  return paths.join(os.fspath(directory), str(step))


class _EventsWriter:
  """A clu metric writer whose disk/permission failures become :class:`CheckpointSaveError`."""

  def __init__(self, writer: Any, path: str):
    self._writer, self._path = writer, path

  def __getattr__(self, name: str) -> Any:
    method = getattr(self._writer, name)
    if not callable(method):
      return method

    def call(*args, **kwargs):
      try:
        return method(*args, **kwargs)
      except Exception as e:  # pylint: disable=broad-except
        if not isinstance(e, OSError) and not _DISK_ERROR.search(str(e)):
          raise
        raise CheckpointSaveError(
            f'Writing the TensorBoard events to {self._path} failed: '
            f'{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}. The checkpoints '
            'already saved are intact; free disk space (or make the workdir writable) and rerun '
            'the same command to resume.') from e

    return call


class Checkpoints:
  """The numbered checkpoints of a run: an ``orbax.checkpoint.CheckpointManager``.

  Keeps the newest ``keep`` finalized steps (``None``: all). Local steps are finalized only once
  on stable storage (:mod:`.durable`); interrupted saves (``*.orbax-checkpoint-tmp*``) are
  removed in the background. Create it on every process (Orbax coordinates them).
  ``asynchronous``: save in a background thread (:meth:`wait_until_finished`).

  Raises:
    ValueError: ``keep`` is not a positive int or None.
  """

  def __init__(self, directory: Any, *, keep: Optional[int], asynchronous: bool):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
      raise ValueError(f'keep must be a positive int or None (keep all), got {keep!r}.')
    local = not paths.is_remote(os.fspath(directory))
    self._manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=bool(asynchronous),
            cleanup_tmp_directories=True,
            temporary_path_class=durable.rename_class() if local else None,
        ),
    )

  @property
  def directory(self):
    """The ``checkpoints`` directory (an ``etils.epath.Path``)."""
    return self._manager.directory

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> List[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, *, cost: Dict[str, Any],
           config: Optional[Dict[str, Any]] = None,
           dataset: Optional[Dict[str, Any]] = None) -> None:
    """Saves ``state`` as ``step`` with ``cost`` (``config``, ``dataset``); skips a saved step.

    Raises CheckpointSaveError (full disk, no permission; async: possibly the save before).
    """
    if step in self._manager.all_steps():
      return
    self._check_free_space(step, state)
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    items = {STATE_ITEM: ocp.args.StandardSave(state), COST_ITEM: ocp.args.JsonSave(cost)}
    if config is not None:
      items[CONFIG_ITEM] = ocp.args.JsonSave(config)
    if dataset is not None:
      items[DATASET_ITEM] = ocp.args.JsonSave(dataset)
    with self._save_errors(step):
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def _check_free_space(self, step: int, state: Any) -> None:
    """Refuses a local save that cannot fit: this process's share of the state + 10% + 256 KiB.

    Raises CheckpointSaveError.
    """
    import jax  # pylint: disable=g-import-not-at-top
    directory = str(self.directory)
    if paths.is_remote(directory):
      return
    state_bytes = sum(int(getattr(x, 'nbytes', 0)) for x in jax.tree.leaves(state))
    needed = int(state_bytes / jax.process_count() * 1.1) + (256 << 10)
    probe = directory
    while not os.path.isdir(probe):
      probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if free < needed:  # Once the save in flight (if any) is complete, for the real figures.
      self.wait_until_finished()
      free = shutil.disk_usage(probe).free
    if free < needed:
      kept = self._manager.all_steps()
      intact = (f'The checkpoint of step {max(kept)} is intact' if kept else
                'There is no earlier checkpoint')
      raise CheckpointSaveError(
          f'Not enough disk space for the checkpoint of step {step} in {directory}: it needs '
          f'about {_mib(needed)}, {_mib(free)} are free (No space left on device). {intact}; '
          'free disk space (or lower --config.keep_checkpoints) and rerun the same command to '
          'resume.')

  def restore(self, step: int, abstract_state: Any) -> Tuple[Any, Optional[Dict[str, Any]]]:
    """Restores ``step`` onto ``abstract_state``'s shardings; returns ``(state, cost or None)``.

    Raises ValueError: the state does not fit, the files are damaged, or it holds NaN/Inf (the
    message names the newest finite step).
    """
    state, cost = self._restore(step, abstract_state, with_cost=True)
    bad = tree.non_finite(state)
    if bad:
      del state  # The search below restores the earlier steps one at a time.
      finite = next((s for s in sorted(self.all_steps(), reverse=True)
                     if s < step and self._is_finite(s, abstract_state)), None)
      resume = f'to resume from step {finite}' if finite is not None else 'to start afresh'
      raise ValueError(
          f'{tree.non_finite_message(f"The checkpoint of step {step} in {self.directory}", bad)}'
          f': it cannot be trained from. Move it away (mv {self.directory}/{step} '
          f'{self.directory}/{step}.non_finite) {resume} (the newest step whose values are '
          'finite), then rerun the same command.')
    return state, cost

  def _is_finite(self, step: int, abstract_state: Any) -> bool:
    """Whether step ``step`` restores, and without NaN or Inf values."""
    try:
      return not tree.non_finite(self._restore(step, abstract_state)[0])
    except ValueError:  # Damaged, or of another shape.
      return False

  def _restore(self, step: int, abstract_state: Any, with_cost: bool = False
               ) -> Tuple[Any, Optional[Dict[str, Any]]]:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    items = {STATE_ITEM: ocp.args.StandardRestore(abstract_state)}
    has_cost = with_cost and (self.directory / str(step) / COST_ITEM).exists()
    if has_cost:
      items[COST_ITEM] = ocp.args.JsonRestore()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-except
      if _DAMAGE.search(str(e)) or not isinstance(e, (ValueError, KeyError, TypeError)):
        raise damaged_step_error(self.directory, self.all_steps(), e, step) from e
      raise ValueError(  # E.g. another optimizer's state.
          f"The checkpoint of step {step} in {self.directory} does not fit this config's "
          f'optimizer or state ({str(e).splitlines()[0][:300] if str(e) else type(e).__name__}). '
          f'{_RERUN_HINT}') from e
    return restored[STATE_ITEM], (restored[COST_ITEM] if has_cost else None)

  def reached_preemption(self, step: int) -> bool:
    """Whether a preemption notice reached this step (the same step on every host)."""
    return self._manager.reached_preemption(step)

  def wait_until_finished(self) -> None:
    """Waits for a background save. Raises CheckpointSaveError if it failed."""
    with self._save_errors(None):
      self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  @contextlib.contextmanager
  def _save_errors(self, step: Optional[int]) -> Iterator[None]:
    """A failed save (full disk, no permission) -> CheckpointSaveError; ``step`` None: the last."""
    try:
      yield
    except (OSError, ValueError, RuntimeError) as e:
      text = str(e)
      if not isinstance(e, OSError) and not _DISK_ERROR.search(text):
        raise
      kept = [s for s in self._manager.all_steps() if s != step]
      which = 'the last save' if step is None else f'step {step}'
      intact = (f'the checkpoint of step {max(kept)} is intact' if kept else
                'there is no earlier checkpoint')
      full = 'No space left' in text or 'RESOURCE_EXHAUSTED' in text
      cause = 'No space left on device' if full else text.splitlines()[0][:300] if text else (
          type(e).__name__)
      raise CheckpointSaveError(
          f'Saving a checkpoint in {self.directory} failed ({which}, or the save before '
          f'it, which runs in the background): {cause}. {intact.capitalize()} (the partial save '
          'is removed at the next start); '
          + ('free disk space (or lower --config.keep_checkpoints)' if full else
             'make the checkpoint directory writable')
          + ' and rerun the same command to resume.') from e


def _mib(num_bytes: int) -> str:
  return f'{num_bytes / 2**20:.2f} MiB'


# Reading: from any path a user gives to the train state item of its latest step.


def _latest_step_dir(path: str) -> Optional[str]:
  """Newest numbered step directory of ``path`` holding a finalized item, or None."""
  # Orbax writes into '<step>.orbax-checkpoint-tmp-*' and renames when done, so digit-only names
  # are finalized steps (on GCS the item's commit marker is checked through '_METADATA').
  steps = {int(n): n for n in paths.listdir(path) if n.isdigit()}
  for step in sorted(steps, reverse=True):
    candidate = paths.join(path, steps[step])
    if orbax.is_item(candidate) or orbax.is_item(paths.join(candidate, STATE_ITEM)):
      return candidate
  return None


def find_state_item(path: Any) -> str:
  """The Orbax item holding the model variables for ``path``.

  ``path``: a workdir, a ``checkpoints`` directory (its latest finalized step), a step directory
  or an item (a ``state`` item, or a ``python -m vit_jax.convert`` variables checkpoint).
  Raises FileNotFoundError (no finalized step) or ValueError (none of these).
  """
  path = paths.normalize(path)
  if paths.isdir(paths.join(path, CHECKPOINTS_DIR)):  # A workdir.
    path = paths.join(path, CHECKPOINTS_DIR)
  for candidate in (path, paths.join(path, STATE_ITEM)):
    if orbax.is_item(candidate):
      return candidate
  step_dir = _latest_step_dir(path)
  if step_dir is not None:
    for candidate in (step_dir, paths.join(step_dir, STATE_ITEM)):
      if orbax.is_item(candidate):
        return candidate
  is_manager_dir = paths.basename(path) == CHECKPOINTS_DIR
  if is_manager_dir or any(n.isdigit() for n in paths.listdir(path)):
    parent = os.path.dirname(path.rstrip('/'))
    raise paths.not_found(path, 'No finalized Orbax checkpoint step', paths.nothing_saved_yet(
        path, paths.join(parent or '.', CONFIG_JSON) if is_manager_dir else None))
  raise ValueError(f'Unrecognised checkpoint directory {path!r}: a directory is read as an Orbax '
                   f'checkpoint, {ORBAX_PATHS}, or a variables checkpoint written by '
                   'python -m vit_jax.convert, or as a Hugging Face transformers ViT when it '
                   'holds config.json and model.safetensors.')


def load_orbax(path: Any, *, use_ema: bool = True) -> Dict[str, Any]:
  """``{'params': ..., **model_state}`` (NumPy, saved layout) from a training-loop Orbax checkpoint.

  ``path``: see :func:`find_state_item`. ``use_ema``: return ``ema_params`` as ``params`` when
  saved. Raises FileNotFoundError or ValueError (not Orbax, or no ``params``).
  """
  path = paths.normalize(path)
  if not paths.exists(path):
    raise paths.not_found(path)
  return orbax.read_variables(find_state_item(path), use_ema=use_ema)
