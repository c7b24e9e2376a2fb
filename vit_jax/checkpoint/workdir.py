"""The run directory (``--workdir``): the only code that knows its layout.

::

  WORKDIR/
    config.json               the resolved config of the run (Workdir.write_config)
    dataset.json              the training data's facts: class names in label order, class
                              count, multi-label or not, image shape (Workdir.write_dataset)
    cost.json                 the cost account so far (Workdir.write_cost; accounting.py)
    lock.json                 while a run holds the workdir: its host, pid, start, command
                              (Workdir.lock; lock.py)
    checkpoints/              an Orbax CheckpointManager directory (Checkpoints)
      <step>/                 a finalized step (a save in progress: '<step>.orbax-checkpoint-tmp*')
        state/                the train state {'step', 'params', 'opt_state', 'model_state'
                              [, 'ema_params']} (StandardSave)
        cost/                 the cost account at that step (JsonSave)
        config/               the resolved config (JsonSave; steps saved with one)
        dataset/              dataset.json's record (JsonSave; steps saved with one)
    events.out.tfevents.*     TensorBoard scalars and hparams (Workdir.metric_writer: clu's)

Local paths and ``gs://`` alike (through ``etils.epath``; local paths are made absolute, as Orbax
needs). The training loop uses :class:`Workdir` and :class:`Checkpoints`; the readers
(:func:`load_orbax`, hence ``vit_jax.checkpoint.load`` and ``python -m vit_jax.convert``) find the
train state through :func:`find_state_item`. Orbax options are the non-deprecated ones: a
preservation policy (``LatestN``) keeps the newest checkpoints.
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
  """Writing to the workdir failed (e.g. the disk is full): a checkpoint (the earlier ones are
  intact) or the TensorBoard events."""


def _epath(path: str):
  from etils import epath  # pylint: disable=g-import-not-at-top
  return epath.Path(path if paths.is_remote(path) else os.path.abspath(path))


def _is_process_0() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0


def _write_json_atomically(path, value: Dict[str, Any]) -> None:
  """``path`` (an epath) gets ``value`` as JSON, forced to disk; readers and a crash see the old
  or the new file (:func:`.durable.write_atomically`).

  Raises:
    CheckpointSaveError: the file cannot be written (e.g. a full disk); the previous version of
      the file stays (only the ``.partial`` beside it is affected).
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

  Attributes:
    path: the directory as given (a str).

  Raises:
    ValueError: an empty ``path`` (it would be the current directory).
    checkpoints_dir, cost_json, config_json: ``etils.epath.Path`` of ``checkpoints/``,
      ``cost.json`` and ``config.json`` (absolute for local paths).
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
    """Fails early when a local workdir cannot be created or written (nothing is created here).

    Raises:
      PermissionError: the directory, or its nearest existing ancestor, is not a writable
        directory (e.g. a read-only filesystem, or a file in the way), or its ``checkpoints``
        is not a directory. ``gs://`` paths are not checked.
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
    """The finalized checkpoint steps, ascending (``[]`` without ``checkpoints/``).

    From the directory listing (Orbax's finalization check: a save in progress or cut short
    is not a step), without opening a ``CheckpointManager``.
    """
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    if not self.checkpoints_dir.exists():
      return []
    return sorted(ocp.path.step.checkpoint_steps(self.checkpoints_dir))

  def check_state_fits(self, abstract_state: Any) -> None:
    """Checks the latest saved train state against the run's, from its metadata only.

    Args:
      abstract_state: the run's state tree (arrays or ``jax.ShapeDtypeStruct``); its
        ``params`` and ``model_state`` are compared by name and shape.

    Raises:
      ValueError: the checkpoint is of another model (the message lists the differences, the
        checkpoint's architecture, and what to do), or its metadata cannot be read (a damaged
        or incomplete step: the message says how to resume from the one before). Nothing
        saved: no check.
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
    """Writes ``WORKDIR/config.json`` atomically (process 0 only; the directory is created).

    Raises:
      TypeError: a value is not JSON-serialisable (resolve the config to plain values first).
      CheckpointSaveError: it cannot be written (e.g. a full disk).
    """
    if _is_process_0():
      _write_json_atomically(self.config_json, config)

  def read_config(self) -> Optional[Dict[str, Any]]:
    """``WORKDIR/config.json``, or None when there is none.

    Raises:
      ValueError: the file is not valid JSON (the message names it).
    """
    if not self.config_json.exists():
      return None
    try:
      return json.loads(self.config_json.read_text())
    except ValueError as e:
      raise ValueError(f'{self.config_json} is not valid JSON ({e}); restore it or delete '
                       'it.') from e

  def write_dataset(self, record: Dict[str, Any]) -> None:
    """Writes ``WORKDIR/dataset.json`` atomically (process 0): the training data's facts that
    a workdir needs to describe its model (``label_names``, ``num_classes``, ``multi_label``,
    ``image_shape``, ``name``; see ``vit_jax.train``).

    Raises:
      CheckpointSaveError: it cannot be written (e.g. a full disk).
    """
    if _is_process_0():
      _write_json_atomically(self.dataset_json, record)

  def write_cost(self, report: Dict[str, Any]) -> None:
    """Writes ``WORKDIR/cost.json`` atomically (``cost.json.partial`` then a rename; process 0).

    Raises:
      CheckpointSaveError: it cannot be written (e.g. a full disk).
    """
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
    """clu's TensorBoard writer into the workdir (asynchronous; process 0 writes events, the
    others only log), with ``hparams``' int, float, str and bool values written as hparams.

    Raises:
      CheckpointSaveError: the events file cannot be created (e.g. a full disk); the writer's
        methods raise it too when the events cannot be written.
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
  """The error for a saved step that cannot be read (a truncated file, a missing metadata file):
  names the step, the cause (default: the first line of ``error``) and how to resume from the
  newest step before it without empty files (:func:`.durable.damaged_files`). ``step``
  defaults to the newest of ``steps``."""
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
  """A clu metric writer whose failures to write the events (a full disk, no permission), in
  any method, are a :class:`CheckpointSaveError` that says what to do; other errors unchanged."""

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

  Keeps the newest ``keep`` finalized steps (``LatestN`` preservation policy; ``None``: all).
  On a local disk a step is finalized only once its files are on stable storage
  (:mod:`.durable`): a host crash right after a save leaves it intact.
  A save that a crash or a full disk interrupted leaves a ``<step>.orbax-checkpoint-tmp*``
  directory (never a step): it is removed when this object is created, in the background.
  Create and use it on every process of a multi-host run (Orbax coordinates them).

  Args:
    directory: the ``checkpoints`` directory (``Workdir.checkpoints_dir``).
    keep: how many of the newest checkpoints to keep (a positive int), or None for all.
    asynchronous: write checkpoints in a background thread (``save`` returns once the arrays
      are copied to host memory); :meth:`wait_until_finished` waits for the last one.

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
    """Saves ``state`` as step ``step``, with the cost account (and the resolved config and the
    dataset record).

    A step already saved is not saved again (e.g. the last step, saved by a preemption notice
    and again at the end). Items: ``state`` (StandardSave), ``cost`` (JsonSave) and, when given,
    ``config`` and ``dataset`` (JsonSave).

    Raises:
      CheckpointSaveError: the save failed (full disk, no permission; for an asynchronous save
        possibly the one before): the message names the intact checkpoint and what to do.
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
    """Refuses a save that cannot fit on a local disk, before Orbax starts writing it.

    The estimate: this process's share of the state's bytes plus 10% and 256 KiB for Orbax's
    metadata (the oldest checkpoint is deleted only after the new one is complete). Remote
    directories are not checked.

    Raises:
      CheckpointSaveError: less free space than the estimate (measured again after the save in
        flight completes), or the save in flight failed.
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
    """Restores step ``step`` onto ``abstract_state``'s shardings.

    Args:
      step: a saved step (see :meth:`all_steps`).
      abstract_state: the run's state as ``jax.ShapeDtypeStruct`` leaves with shardings.

    Returns:
      ``(state, cost)``: the train state, and the cost account saved with it (None for a
      checkpoint without one).

    Raises:
      ValueError: the state does not fit (e.g. another optimizer's state), the step's files
        are damaged (e.g. truncated), or it holds NaN or Inf values (the message names them
        and the newest step without any); the message names the fix.
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
    """Waits for a save in the background to finish.

    Raises:
      CheckpointSaveError: it failed (see :meth:`save`).
    """
    with self._save_errors(None):
      self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  @contextlib.contextmanager
  def _save_errors(self, step: Optional[int]) -> Iterator[None]:
    """Turns a failed save (full disk, no permission) into a CheckpointSaveError that says
    what is intact and what to do. ``step``: the save being made (None: the last one)."""
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


# ------------------------------------------------------------------------------------------------
# Reading: from any path a user gives to the train state item of its latest step.
# ------------------------------------------------------------------------------------------------


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

  Args:
    path: a workdir (containing ``checkpoints/``), a ``checkpoints`` directory (its latest
      finalized step), a step directory (containing ``state/``), or an item directory itself
      (a ``state`` item, or a variables checkpoint from ``python -m vit_jax.convert``).

  Raises:
    FileNotFoundError: a checkpoints directory without a finalized step.
    ValueError: a directory that is none of these.
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
  """Loads ``params`` and ``model_state`` from an Orbax checkpoint of the training loop.

  Args:
    path: see :func:`find_state_item` (a workdir, ``checkpoints`` directory, step or item).
    use_ema: return the parameter EMA (``ema_params``, saved by runs with
      ``config.ema_decay > 0``) as ``params`` when the checkpoint has one.

  Returns:
    ``{'params': ..., **model_state}`` with NumPy leaves, in the layout they were saved in.

  Raises:
    FileNotFoundError: missing path or no finalized step.
    ValueError: not an Orbax checkpoint, or one without a ``params`` entry.
  """
  path = paths.normalize(path)
  if not paths.exists(path):
    raise paths.not_found(path)
  return orbax.read_variables(find_state_item(path), use_ema=use_ema)
