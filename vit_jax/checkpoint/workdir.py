"""The run directory (``--workdir``; layout: :mod:`vit_jax.rundir`), local or ``gs://``, as a run
writes it: its files and its checkpoints (a run read back: :mod:`.saved_run`)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import shlex
import shutil
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import jax

from vit_jax import accounting
from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import durable
from vit_jax.checkpoint import lock as lock_lib
from vit_jax.checkpoint import orbax
from vit_jax.checkpoint import tree
from vit_jax.rundir import (CHECKPOINTS_DIR, CONFIG_ITEM, CONFIG_JSON, COST_ITEM, COST_JSON,
                            DATASET_ITEM, DATASET_JSON, STATE_ITEM)

_RERUN_HINT = 'Rerun with the config it was trained with, or start a new run in another --workdir.'
#: What to do after a failed write, by its cause (:func:`vit_jax.storage.write_failure`).
_FIXES = {
    'full': 'free disk space (or lower --config.keep_checkpoints)',
    'denied': 'make the checkpoint directory writable',
    'unreachable': 'wait until the storage answers again (each request was retried as '
                   'GCS_RETRY_CONFIG_MAX_RETRIES says; docs/pods.md)',
}


class CheckpointSaveError(OSError):
  """Writing to the workdir failed (e.g. a full disk); the earlier checkpoints are intact."""


@contextlib.contextmanager
def _write_failures(message: Callable[[BaseException, str], str]) -> Iterator[None]:
  """A write failed by the disk, the permissions or the storage (``why``:
  :func:`vit_jax.storage.write_failure`) -> CheckpointSaveError(``message(error, why)``)."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  (TensorFlow's are not OSErrors)
    why = storage.write_failure(e)
    if why is None:
      raise
    raise CheckpointSaveError(message(e, why)) from e


def _writing(what: str):
  """:func:`_write_failures` for a file of the workdir, ``what``."""

  def message(error: BaseException, why: str) -> str:
    fix = _FIXES[why] if why == 'unreachable' else 'free disk space (or make the workdir writable)'
    return (f'Writing {what} failed: {storage.cause(error)}. The checkpoints already saved are '
            f'intact; {fix} and rerun the same command to resume.')

  return _write_failures(message)


def _write_json_atomically(path: Any, value: Dict[str, Any]) -> None:
  """Writes ``value`` as JSON (:func:`.durable.write_atomically`) on process 0; raises as
  :func:`_writing`, the previous file kept."""
  if jax.process_index() != 0:
    return
  text = json.dumps(value, indent=1)  # A TypeError here is a bug, not the disk's.
  with _writing(str(path)):
    durable.write_atomically(path, text)


#: A step's directory in ``checkpoints/`` (``N``), also while Orbax writes it (``N.orbax-...``).
_STEP_NAME = re.compile(r'^\d+($|\.)')


def _linked_steps(checkpoints: str) -> Optional[str]:
  """Why the local ``checkpoints`` cannot be used where a step's directory is a symbolic link
  (Orbax's rmtree refuses them), with the commands that fix it; else None."""
  names = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []
  links = [os.path.join(checkpoints, n) for n in names
           if _STEP_NAME.match(n) and os.path.islink(os.path.join(checkpoints, n))]
  if not links:
    return None
  quote = shlex.quote
  first = links[0]
  target = os.path.realpath(first)
  others = f' (also {", ".join(links[1:])})' if links[1:] else ''
  if not all(os.path.isdir(link) for link in links):  # To nothing, a loop, a file: removed.
    what = (f'to nothing ({target})' if not os.path.lexists(target) else
            f'to no directory ({target})')
    fix = f'Remove it (rm {" ".join(quote(link) for link in links)}), then rerun.'
    return (f'its checkpoint step {first} is a symbolic link {what}{others}, which the run '
            f'cannot use. {fix}')
  commands = ' && '.join(f'rm {quote(link)} && cp -a {quote(os.path.realpath(link))} '
                         f'{quote(link)}' for link in links)
  return (f'its checkpoint step {first} is a symbolic link (to {target}){others}, which the run '
          'cannot remove when it deletes the steps past --config.keep_checkpoints (each rerun '
          'would save one step, then fail). Replace it by a copy of the directory it points to '
          f'({commands}), then rerun.')


def _free_name(path: Any) -> str:
  """``PATH.moved`` (or ``PATH.moved.2``, ...): a name beside ``path`` that nothing has, so the
  ``mv`` a message suggests renames it rather than moving it into a folder of that name."""
  candidates = itertools.chain([f'{path}.moved'],
                               (f'{path}.moved.{i}' for i in itertools.count(2)))
  return next(c for c in candidates if not os.path.lexists(c))


class Workdir:
  """A run directory (local or ``gs://``), created when something is written; its files as
  ``storage.Path`` (local ones absolute, as Orbax needs). ValueError for an empty ``path``."""

  def __init__(self, path: Any):
    self.path = os.fspath(path)
    if not str(self.path).strip():
      raise ValueError('--workdir is empty: give the directory of the run (local or gs://), '
                       'e.g. --workdir /tmp/vit_run; an empty one would mean the current '
                       'directory.')
    root = storage.Path(self.path)
    self.checkpoints_dir = root / CHECKPOINTS_DIR
    self.cost_json = root / COST_JSON
    self.config_json = root / CONFIG_JSON
    self.dataset_json = root / DATASET_JSON

  def __repr__(self) -> str:
    return f'Workdir({self.path!r})'

  def check_writable(self) -> None:
    """Raises PermissionError early, naming the fix, when a local workdir cannot be written or
    holds a file where the run writes a directory, a linked step (:func:`_linked_steps`) or a
    directory where it writes a file; a ``gs://`` one when its bucket cannot be written."""
    if storage.is_remote(self.path):
      return storage.check_bucket(self.path)
    refuse = lambda why: PermissionError(f'--workdir {self.path!r} cannot be used: {why}')
    path = os.path.abspath(self.path)
    while not os.path.exists(path):
      path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
      what = 'is not a directory' if not os.path.isdir(path) else 'is not writable'
      where = '' if path == os.path.abspath(self.path) else ' (where it would be created)'
      raise refuse(f'{path}{where} {what}. Choose a directory you can write to (or a gs:// '
                   'path).')
    inside = os.path.join(os.path.abspath(self.path), CHECKPOINTS_DIR)
    if os.path.lexists(inside) and not os.path.isdir(inside):
      raise refuse(f'{inside} is a file, where the run keeps its checkpoint directory. Move it '
                   f'away (mv {inside} {_free_name(inside)}) or choose another --workdir.')
    linked = _linked_steps(inside)
    if linked:
      raise refuse(linked)
    for file in (self.cost_json, self.config_json, self.dataset_json):  # Replaced as files.
      if os.path.exists(file) and not os.path.isfile(file):
        what = 'a directory' if os.path.isdir(file) else 'a special file (not a regular one)'
        raise refuse(f'{file} is {what}, where the run writes its {file.name} (a file). Move it '
                     f'away (mv {file} {_free_name(file)}) or choose another --workdir.')

  def lock(self, *, timeout_s: float) -> 'lock_lib.WorkdirLock':
    """The workdir's lock (not yet taken): see :mod:`.lock`."""
    return lock_lib.WorkdirLock(self.path, timeout_s=timeout_s)

  def saved_steps(self) -> List[int]:
    """The finalized checkpoint steps, ascending (:func:`vit_jax.rundir.saved_steps`)."""
    return rundir.saved_steps(self.checkpoints_dir)

  def check_state_fits(self, abstract_state: Any) -> None:
    """:func:`.orbax.check_state_fits` of the latest step. Raises ValueError: another model's
    checkpoint, or a damaged step."""
    steps = self.saved_steps()
    if not steps:
      return
    empty = durable.damaged_files(self.checkpoints_dir / str(steps[-1]))
    if empty:  # Data that never reached the disk: a host crash (steps of earlier versions).
      raise damaged_step_error(self.checkpoints_dir, steps, None, cause=f'{len(empty)} empty '
                               f'files, e.g. {empty[0]}: lost in a host crash')
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
    _write_json_atomically(self.config_json, config)

  def read_config(self) -> Optional[Dict[str, Any]]:
    """``config.json``, or None when absent. Raises ValueError as :func:`rundir.read_json`."""
    return rundir.read_json(self.config_json)

  def write_dataset(self, record: Dict[str, Any]) -> None:
    """Writes ``dataset.json`` (fields: see ``vit_jax.train``) as :meth:`write_config`."""
    _write_json_atomically(self.dataset_json, record)

  def read_dataset(self) -> Optional[Dict[str, Any]]:
    """The dataset record of the latest finalized step, else ``dataset.json``, or None. Raises
    ValueError: a record that cannot be read (naming it)."""
    steps = self.saved_steps()
    item = self.checkpoints_dir / str(steps[-1]) / DATASET_ITEM if steps else None
    if item is not None and item.is_dir():
      record = orbax.read_json_item(str(item))
      if not isinstance(record, dict):
        raise ValueError(f'The checkpoint item {item} is not a JSON object: restore it, or start '
                         'a new run in another --workdir.')
      return record
    return rundir.read_json(self.dataset_json)

  def write_cost(self, report: Dict[str, Any]) -> None:
    """Writes ``cost.json`` atomically (process 0). Raises CheckpointSaveError."""
    _write_json_atomically(self.cost_json, report)

  def read_cost(self) -> Optional[Dict[str, Any]]:
    """``cost.json``, or None: missing, or (with a warning) unreadable or not an account
    (:func:`vit_jax.accounting.check_report`)."""
    fix = "the run goes on from the checkpoint's cost account and writes it over this file"
    try:
      report = rundir.read_json(self.cost_json, fix=fix)
      return None if report is None else accounting.check_report(report, self.cost_json, fix)
    except (ValueError, OSError) as e:
      logging.getLogger('absl').warning("Ignoring %s (%s).", self.cost_json, e)
      return None

  def metric_writer(self, hparams: Dict[str, Any], settle: Optional[Callable[[], None]] = None):
    """clu's TensorBoard writer (process 0 writes; clu's ``AsyncWriter`` thread writes) with the
    scalar ``hparams``; CheckpointSaveError (also from its methods) when the events cannot be
    written, a failure of that thread at the next call (:class:`_Background`), after ``settle()``
    (``Checkpoints.wait_until_finished``: a failed save's error, naming the intact step, first)."""
    from clu import metric_writers  # pylint: disable=g-import-not-at-top  (TensorFlow)
    try:
      writer = metric_writers.create_default_writer(
          self.path, just_logging=jax.process_index() > 0, asynchronous=False)
    except Exception as e:  # pylint: disable=broad-except  (TensorFlow's are not OSErrors)
      raise CheckpointSaveError(
          f'Cannot write the TensorBoard events to {self.path}: {storage.first_line(e)}. Free disk '
          'space or fix the permissions there, then rerun the same command.') from e
    background = _Background(writer)
    writer = _EventsWriter(metric_writers.AsyncWriter(background), self.path, background,
                           settle)
    writer.write_hparams({k: v for k, v in hparams.items()
                          if isinstance(v, (int, float, str, bool))})
    return writer

  def checkpoints(self, *, keep: Optional[int], asynchronous: bool) -> 'Checkpoints':
    return Checkpoints(self.checkpoints_dir, keep=keep, asynchronous=asynchronous)


#: What a failed read of a saved step says when its files are damaged (tensorstore's errors).
_DAMAGE = re.compile(r'OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|Error reading|error while reading|'
                     r'not valid for value|No such file|Unexpected end|checksum', re.IGNORECASE)


def damaged_step_error(directory: Any, steps: List[int], error: Optional[Exception],
                       step: Optional[int] = None, cause: Optional[str] = None) -> ValueError:
  """The ValueError for an unreadable step (default the newest of ``steps``): ``cause``
  (default ``error``'s first line) and the newest intact step to resume from."""
  step = max(steps) if step is None else step
  intact = [s for s in steps
            if s < step and not durable.damaged_files(storage.join(os.fspath(directory), str(s)))]
  cause = cause or storage.first_line(error)
  resume = (f'to resume from step {max(intact)}' if intact else 'to start afresh')
  return ValueError(
      f'The checkpoint of step {step} in {directory} cannot be read ({cause}): it is damaged or '
      f'incomplete. Move it away (mv {directory}/{step} {directory}/{step}.damaged) {resume}, '
      'then rerun the same command.')


class _Background:
  """A clu metric writer called in clu's ``AsyncWriter`` thread that keeps its first failure for
  :class:`_EventsWriter` to raise in the caller's thread (raised here, clu's pool would log it
  with a traceback: e.g. a stopped storage's 'Could not flush events file'); the calls after it
  do nothing."""

  def __init__(self, writer: Any):
    self._writer = writer
    self.failure: Optional[Exception] = None

  def __getattr__(self, name: str) -> Any:
    method = getattr(self._writer, name)

    def call(*args, **kwargs):
      if self.failure is None:
        try:
          method(*args, **kwargs)
        except Exception as e:  # pylint: disable=broad-except  (raised by _EventsWriter)
          self.failure = e

    return call


class _EventsWriter:
  """A clu metric writer whose disk/permission/storage failures become
  :class:`CheckpointSaveError`, also those ``background`` kept (raised at the next call, after
  ``settle()``)."""

  def __init__(self, writer: Any, path: str, background: Optional[_Background] = None,
               settle: Optional[Callable[[], None]] = None):
    self._writer = writer
    self._path = path
    self._background = background
    self._settle = settle

  def __getattr__(self, name: str) -> Any:
    method = getattr(self._writer, name)
    if not callable(method):
      return method
    what = f'the TensorBoard events to {self._path}'

    def call(*args, **kwargs):
      with _writing(what):
        result = method(*args, **kwargs)
      failure = self._background.failure if self._background is not None else None
      if failure is None:
        return result
      if self._settle is not None:  # The storage failed the save in flight too: its error.
        self._settle()
      with _writing(what):
        raise failure

    return call


class Checkpoints:
  """A run's numbered checkpoints (an Orbax ``CheckpointManager``; create it on every process):
  the newest ``keep`` steps (None: all; else a positive int, or ValueError), finalized locally
  once on stable storage (:mod:`.durable`)."""

  def __init__(self, directory: Any, *, keep: Optional[int], asynchronous: bool):
    ocp = orbax.import_orbax()
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
      raise ValueError(f'keep must be a positive int or None (keep all), got {keep!r}.')
    local = not storage.is_remote(os.fspath(directory))
    temporary_path_class = durable.rename_class() if local else None
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
        enable_async_checkpointing=bool(asynchronous), cleanup_tmp_directories=True,
        temporary_path_class=temporary_path_class)
    self._manager = ocp.CheckpointManager(directory, options=options)
    # For a failed save's message, which must not call on the storage that failed it.
    self._finalized = list(self._manager.all_steps())
    self._saving = None

  @property
  def directory(self) -> Any:  # storage.Path
    return self._manager.directory

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> List[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, *, cost: Dict[str, Any],
           config: Optional[Dict[str, Any]] = None,
           dataset: Optional[Dict[str, Any]] = None) -> None:
    """Saves ``state`` as ``step`` with ``cost`` (``config``, ``dataset``); skips a saved step.
    Raises CheckpointSaveError (full disk, no permission; async: possibly the save before)."""
    if step in self._manager.all_steps():
      return
    self._check_free_space(step, state)
    ocp = orbax.import_orbax()
    items = {STATE_ITEM: ocp.args.StandardSave(state), COST_ITEM: ocp.args.JsonSave(cost),
             **{k: ocp.args.JsonSave(v) for k, v in ((CONFIG_ITEM, config), (DATASET_ITEM, dataset))
                if v is not None}}
    with self._save_errors(step):
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
      self._saved(step)  # Orbax's save waits for the one before to finish first.

  def _check_free_space(self, step: int, state: Any) -> None:
    """Raises CheckpointSaveError when the local disk lacks this process's share of the state
    + 10% + 256 KiB."""
    directory = str(self.directory)
    if storage.is_remote(directory):
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
          f'about {needed / 2**20:.2f} MiB, {free / 2**20:.2f} MiB are free (No space left on '
          f'device). {intact}; free disk space (or lower --config.keep_checkpoints) and rerun the '
          'same command to resume.')

  def restore(self, step: int, abstract_state: Any) -> Tuple[Any, Optional[Dict[str, Any]]]:
    """``(state, cost or None)`` of ``step`` on ``abstract_state``'s shardings. Raises ValueError:
    the state does not fit, is damaged, or holds NaN/Inf (naming the newest finite step)."""
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
    try:
      return not tree.non_finite(self._restore(step, abstract_state)[0])
    except ValueError:  # Damaged, or of another shape.
      return False

  def _restore(self, step: int, abstract_state: Any, with_cost: bool = False
               ) -> Tuple[Any, Optional[Dict[str, Any]]]:
    ocp = orbax.import_orbax()
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
          f'optimizer or state ({storage.first_line(e)}). {_RERUN_HINT}') from e
    return restored[STATE_ITEM], (restored[COST_ITEM] if has_cost else None)

  def reached_preemption(self, step: int) -> bool:
    return self._manager.reached_preemption(step)

  def wait_until_finished(self) -> None:
    """Waits for a background save. Raises CheckpointSaveError if it failed."""
    with self._save_errors(None):
      self._manager.wait_until_finished()
      self._saved(None)

  def close(self) -> None:
    self._manager.close()

  def _saved(self, step: Optional[int]) -> None:
    """The save in the background (if any) is finalized; ``step`` is saving now (None: none)."""
    self._finalized += [self._saving] if self._saving is not None else []
    self._saving = step

  def _save_errors(self, step: Optional[int]):
    """:func:`_write_failures` of a save, naming the intact step; ``step`` None: the last."""

    def message(error: BaseException, why: str) -> str:
      kept = [s for s in self._finalized if s != step]
      directory = os.fspath(self.directory)  # Read if local (a remote one may have failed).
      if (self._saving not in (None, step) and not storage.is_remote(directory)
          and self._saving in rundir.saved_steps(directory)):
        kept.append(self._saving)
      failed = step if step is not None or self._saving in kept else self._saving
      which = 'the last save' if failed is None else f'step {failed}'
      intact = (f'the checkpoint of step {max(kept)} is intact' if kept else
                'there is no earlier checkpoint')
      cause = 'No space left on device' if why == 'full' else storage.first_line(error)
      return (
          f'Saving a checkpoint in {self.directory} failed ({which}, or the save before '
          f'it, which runs in the background): {cause}. {intact.capitalize()} (the partial save '
          f'is removed at the next start); {_FIXES[why]} and rerun the same command to '
          'resume.')

    return _write_failures(message)
