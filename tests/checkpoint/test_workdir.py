"""Tests of vit_jax.checkpoint.workdir: the run directory (Workdir) and its checkpoints
(Checkpoints): exact save/restore round trips, keep-K, idempotent saves, states that do not fit,
cost.json/config.json, and failed saves reported with the intact step."""

import errno
import gc
import json
import logging
import os
import re
import subprocess
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from vit_jax import checkpoint
from vit_jax import rundir
from vit_jax.checkpoint import workdir as workdir_lib


def _state(step, scale=1.0, tx=None):
  """A small train state: {'step', 'params', 'opt_state', 'model_state'} with known values."""
  params = {'dense': {'kernel': jnp.arange(6, dtype=jnp.float32).reshape(2, 3) * scale,
                      'bias': jnp.full((3,), 0.5 * scale, jnp.float32)}}
  tx = tx or optax.adam(1e-3)
  return {'step': jnp.asarray(step, jnp.int32), 'params': params, 'opt_state': tx.init(params),
          'model_state': {'constants': {'table': jnp.ones((2,), jnp.float32) * step}}}


def _abstract(state):
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def _manager(path, keep=None):
  return checkpoint.Workdir(path).checkpoints(keep=keep, asynchronous=False)


def test_layout_paths(tmp_path):
  work = checkpoint.Workdir(str(tmp_path / 'run'))
  assert work.path == str(tmp_path / 'run')
  assert str(work.checkpoints_dir) == str(tmp_path / 'run' / 'checkpoints')
  assert str(work.cost_json) == str(tmp_path / 'run' / 'cost.json')
  assert str(work.config_json) == str(tmp_path / 'run' / 'config.json')
  remote = checkpoint.Workdir('gs://bucket/run')
  assert str(remote.checkpoints_dir) == 'gs://bucket/run/checkpoints'
  # Its check_writable writes to the bucket: tests/test_gcs.py, against an emulator.
  relative = checkpoint.Workdir('relative/run')
  assert str(relative.cost_json) == os.path.abspath('relative/run/cost.json')
  assert not (tmp_path / 'run').exists()  # Nothing is created by looking.
  assert work.saved_steps() == [] and work.read_cost() is None and work.read_config() is None
  work.check_state_fits(_abstract(_state(0)))  # Nothing saved: nothing to check.


def test_save_restore_round_trip_is_exact(tmp_path):
  state = _state(7, scale=1.5)
  cost = {'attempts': 1, 'seconds': {'program': 12.5}}
  config = {'model_name': 'ViT-Ti_16', 'batch_size': 32, 'mesh': {'shape': [1, 1]}}
  saved = _manager(str(tmp_path))
  saved.save(7, state, cost=cost, config=config)
  assert saved.latest_step() == 7 and saved.all_steps() == [7]
  saved.close()
  assert sorted(os.listdir(tmp_path / 'checkpoints' / '7')) == [
      '_CHECKPOINT_METADATA', 'commit_success.txt', 'config', 'cost', 'state']

  again = _manager(str(tmp_path))
  restored, restored_cost = again.restore(7, _abstract(_state(0)))
  chex.assert_trees_all_equal(jax.device_get(restored), jax.device_get(state))
  assert int(restored['step']) == 7
  np.testing.assert_array_equal(restored['params']['dense']['kernel'],
                                [[0.0, 1.5, 3.0], [4.5, 6.0, 7.5]])
  assert restored_cost == cost
  # The resolved config is an item of the step, for later tools.
  config_item = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
      tmp_path / 'checkpoints' / '7' / 'config')
  assert config_item == config
  again.close()
  # The readers find the same parameters (and model_state) as NumPy.
  variables = checkpoint.load(str(tmp_path))
  np.testing.assert_array_equal(variables['params']['dense']['bias'], [0.75, 0.75, 0.75])
  np.testing.assert_array_equal(variables['constants']['table'], [7.0, 7.0])


def test_restore_of_a_checkpoint_without_cost(tmp_path):
  manager = ocp.CheckpointManager(tmp_path / 'checkpoints')  # As written before the cost item.
  manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(3))))
  manager.wait_until_finished()
  manager.close()
  saved = _manager(str(tmp_path))
  state, cost = saved.restore(3, _abstract(_state(0)))
  assert cost is None and int(state['step']) == 3
  saved.close()


def test_keep_preserves_the_newest_steps(tmp_path):
  saved = _manager(str(tmp_path), keep=2)
  for step in (1, 2, 3, 4):
    saved.save(step, _state(step), cost={'step': step})
  saved.wait_until_finished()
  assert saved.all_steps() == [3, 4]
  saved.close()
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['3', '4']
  assert checkpoint.Workdir(str(tmp_path)).saved_steps() == [3, 4]
  with pytest.raises(ValueError, match='keep must be a positive int or None'):
    _manager(str(tmp_path), keep=0)


def test_saving_a_saved_step_again_is_a_no_op(tmp_path):
  saved = _manager(str(tmp_path))
  saved.save(5, _state(5), cost={'n': 1})
  saved.save(5, _state(5, scale=-1.0), cost={'n': 2})
  state, cost = saved.restore(5, _abstract(_state(0)))
  assert cost == {'n': 1}
  np.testing.assert_array_equal(state['params']['dense']['bias'], [0.5, 0.5, 0.5])
  assert saved.reached_preemption(5) is False
  saved.close()


def test_a_state_that_does_not_fit(tmp_path):
  saved = _manager(str(tmp_path))
  saved.save(2, _state(2), cost={})
  other_optimizer = _abstract(_state(0, tx=optax.sgd(0.1, momentum=0.9)))
  with pytest.raises(ValueError, match=r"The checkpoint of step 2 in .*checkpoints does not fit "
                     r"this config's optimizer or state \(.*\)\. Rerun with the config it was "
                     r"trained with, or start a new run in another --workdir\."):
    saved.restore(2, other_optimizer)
  saved.close()
  # The parameters of another model: said from the metadata, before anything is restored.
  wider = _state(0)
  wider['params']['dense']['bias'] = jnp.zeros((4,), jnp.float32)
  with pytest.raises(ValueError) as info:
    checkpoint.Workdir(str(tmp_path)).check_state_fits(_abstract(wider))
  message = str(info.value)
  assert message.startswith(f'The checkpoint {tmp_path}/checkpoints/2/state does not fit this '
                            'model:\n  shape mismatches (1): params/dense/bias: saved (3,), this '
                            'run (4,)')
  assert message.endswith('\n  Rerun with the config it was trained with, or start a new run in '
                          'another --workdir.')
  checkpoint.Workdir(str(tmp_path)).check_state_fits(_abstract(_state(0)))  # The same: fine.


def test_cost_and_config_json_are_written_atomically(tmp_path, monkeypatch, caplog):
  from tests.test_accounting import _preempted_and_resumed  # pylint: disable=g-import-not-at-top
  work = checkpoint.Workdir(str(tmp_path / 'run'))
  report = _preempted_and_resumed()[1]
  work.write_cost(report)
  work.write_config({'seed': 0, 'optim': {'lr': 0.001}})
  assert sorted(os.listdir(tmp_path / 'run')) == ['config.json', 'cost.json']  # No .partial.
  assert work.read_cost() == report
  assert work.read_config() == {'seed': 0, 'optim': {'lr': 0.001}}
  assert json.loads((tmp_path / 'run' / 'cost.json').read_text()) == report
  # A write that dies half-way (a full disk is reported when the data is forced to it) leaves
  # the previous file whole.
  def dies(fd):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(os, 'fsync', dies)
  with pytest.raises(checkpoint.CheckpointSaveError) as info:  # main: one FATAL line, exit 1.
    work.write_cost({'attempts': 3})
  assert str(info.value) == (
      f"Writing {tmp_path}/run/cost.json failed: No space left on device. The checkpoints "
      'already saved are intact; free disk space (or make the workdir writable) and rerun the '
      'same command to resume.')
  monkeypatch.undo()
  assert work.read_cost() == report
  # Unreadable: the cost is ignored with a warning; the config is an error naming the file.
  (tmp_path / 'run' / 'cost.json').write_text('{"attempts": ')
  with caplog.at_level(logging.WARNING):
    assert work.read_cost() is None
  assert 'Ignoring' in caplog.text and 'cost.json' in caplog.text
  (tmp_path / 'run' / 'config.json').write_text('not json')
  with pytest.raises(ValueError, match=r'config.json is not valid JSON'):
    work.read_config()
  # Only process 0 writes.
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  other = checkpoint.Workdir(str(tmp_path / 'other'))
  other.write_cost(report)
  other.write_config({})
  assert not (tmp_path / 'other').exists()


def test_a_full_disk_names_the_intact_checkpoint(tmp_path, monkeypatch):
  real_save = ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    if step == 4:  # The disk fills up during the second save.
      raise OSError(errno.ENOSPC, 'No space left on device')
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, 'save', save)
  saved = _manager(str(tmp_path))
  saved.save(2, _state(2), cost={})
  with pytest.raises(checkpoint.CheckpointSaveError) as info:
    saved.save(4, _state(4), cost={})
  assert str(info.value) == (
      f'Saving a checkpoint in {tmp_path}/checkpoints failed (step 4, or the save before it, '
      'which runs in the background): No space left on device. The checkpoint of step 2 is '
      'intact (the partial save is removed at the next start); free disk space (or lower '
      '--config.keep_checkpoints) and rerun the same command to resume.')
  assert isinstance(info.value, OSError)

  def wait(self):
    raise RuntimeError('Async save failed: Permission denied: /x')

  monkeypatch.setattr(ocp.CheckpointManager, 'wait_until_finished', wait)
  with pytest.raises(checkpoint.CheckpointSaveError,
                     match=r'\(the last save, .*Permission denied.* The checkpoint of step 2 is '
                     r'intact .*make the checkpoint directory writable'):
    saved.wait_until_finished()

  def other_failure(self):
    raise RuntimeError('some bug')

  monkeypatch.setattr(ocp.CheckpointManager, 'wait_until_finished', other_failure)
  with pytest.raises(RuntimeError, match='^some bug$'):  # Not a disk problem: unchanged.
    saved.wait_until_finished()
  monkeypatch.undo()
  saved.close()


def test_a_save_that_cannot_fit_is_refused_before_it_starts(tmp_path, monkeypatch):
  saved = _manager(str(tmp_path))
  saved.save(2, _state(2), cost={})
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(_state(4)))
  needed = int(state_bytes * 1.1) + (256 << 10)
  usage = workdir_lib.shutil.disk_usage(tmp_path)
  monkeypatch.setattr(workdir_lib.shutil, 'disk_usage',
                      lambda path: usage._replace(free=needed - 1))
  with pytest.raises(checkpoint.CheckpointSaveError) as info:
    saved.save(4, _state(4), cost={})
  assert str(info.value) == (
      f'Not enough disk space for the checkpoint of step 4 in {tmp_path}/checkpoints: it needs '
      f'about {needed / 2**20:.2f} MiB, {(needed - 1) / 2**20:.2f} MiB are free (No space left on '
      'device). The checkpoint of step 2 is intact; free disk space (or lower '
      '--config.keep_checkpoints) and rerun the same command to resume.')
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2']  # Nothing of step 4 written.
  monkeypatch.setattr(workdir_lib.shutil, 'disk_usage', lambda path: usage._replace(free=needed))
  saved.save(4, _state(4), cost={})
  assert saved.all_steps() == [2, 4]
  saved.close()


def test_events_that_cannot_be_written_are_a_checkpoint_save_error(tmp_path):
  class Full:  # What clu's writer raises from TensorFlow's file writer on a full disk.
    def write_scalars(self, step, scalars):
      raise RuntimeError('RESOURCE_EXHAUSTED: /run/events.out.tfevents.1; No space left on device')

    def flush(self):
      raise KeyError('a bug')

  writer = workdir_lib._EventsWriter(Full(), str(tmp_path))  # pylint: disable=protected-access
  with pytest.raises(checkpoint.CheckpointSaveError) as info:
    writer.write_scalars(2, {'loss': 1.0})
  assert str(info.value) == (
      f'Writing the TensorBoard events to {tmp_path} failed: RESOURCE_EXHAUSTED: '
      '/run/events.out.tfevents.1; No space left on device. The checkpoints already saved are '
      'intact; free disk space (or make the workdir writable) and rerun the same command to '
      'resume.')
  with pytest.raises(KeyError, match='a bug'):  # Not the disk's: unchanged.
    writer.flush()


def test_events_failing_in_the_writer_thread_fail_the_next_call_without_a_traceback(
    tmp_path, monkeypatch, caplog):
  """The storage stops answering while clu's writer thread flushes the events: nothing logged
  there (was: clu's 'Error in producer thread' with TensorFlow's traceback, beside the run's
  FATAL line); the next call raises CheckpointSaveError naming the cause, after `settle` (the
  save in flight: its failure is raised instead); later writes are not attempted."""
  from clu.metric_writers import utils  # pylint: disable=g-import-not-at-top
  stopped = ('All 5 retry attempts failed. The last failure: Error executing an HTTP request: '
             "libcurl code 7 meaning 'Couldn't connect to server'\n\tCould not flush events file.")
  written = []

  class Stopped:  # clu's SummaryWriter once the storage stopped answering at step 2.
    def __init__(self, logdir):
      assert logdir == str(tmp_path)

    def write_hparams(self, hparams):
      written.append(hparams)

    def write_scalars(self, step, scalars):
      if step >= 2:
        raise RuntimeError(stopped)
      written.append(step)

    def flush(self):
      pass

    def close(self):
      pass

  monkeypatch.setattr(utils, 'SummaryWriter', Stopped)  # In clu's create_default_writer.
  settled = []

  def settle():  # Checkpoints.wait_until_finished in a run.
    settled.append(len(written))
    if len(settled) == 3:
      raise checkpoint.CheckpointSaveError('Saving a checkpoint ... failed (step 2, ...')

  writer = checkpoint.Workdir(str(tmp_path)).metric_writer({'lr': 0.5, 'name': 'x', 'd': {}},
                                                           settle=settle)
  writer.write_scalars(1, {'loss': 1.0})
  writer.flush()
  caplog.set_level(logging.DEBUG)
  with pytest.raises(checkpoint.CheckpointSaveError) as info:
    writer.write_scalars(2, {'loss': 1.0})  # Fails in the thread: raised here or by the flush.
    writer.flush()
  assert str(info.value) == (
      f'Writing the TensorBoard events to {tmp_path} failed: All 5 retry attempts failed. The '
      "last failure: Error executing an HTTP request: libcurl code 7 meaning 'Couldn't connect "
      "to server'. The checkpoints already saved are intact; wait until the storage answers "
      'again (each request was retried as GCS_RETRY_CONFIG_MAX_RETRIES says; docs/pods.md) and '
      'rerun the same command to resume.')
  with pytest.raises(checkpoint.CheckpointSaveError):
    writer.write_scalars(3, {'loss': 1.0})
  with pytest.raises(checkpoint.CheckpointSaveError, match=r'^Saving a checkpoint .* \(step 2, '):
    writer.close()
  assert written == [{'lr': 0.5, 'name': 'x'}, 1] and settled == [2, 2, 2]
  assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []


# tensorstore's threads report the failed restore's pending callbacks as bare "Event loop is
# closed" errors that no Python object raises; the program logs them at DEBUG
# (vit_jax.platform.quiet_unraisable_hook), pytest's own hook would warn.
@pytest.mark.filterwarnings('ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning')
# Orbax leaves the failed restore's metadata coroutine unawaited (seen under pytest-xdist).
@pytest.mark.filterwarnings('ignore:coroutine .* was never awaited:RuntimeWarning')
def test_a_damaged_step_names_itself_and_the_step_to_resume_from(tmp_path):
  saved = _manager(str(tmp_path))
  for step in (2, 4):
    saved.save(step, _state(step), cost={})
  saved.close()
  data = [p for p in (tmp_path / 'checkpoints' / '4' / 'state').rglob('*')
          if p.is_file() and '/d/' in str(p)]
  assert data
  for path in data:  # Truncated, as by a copy cut short.
    path.write_bytes(path.read_bytes()[:100])
  with pytest.raises(ValueError) as info:
    _manager(str(tmp_path)).restore(4, _abstract(_state(4)))
  directory = tmp_path / 'checkpoints'
  assert str(info.value).startswith(f'The checkpoint of step 4 in {directory} cannot be read (')
  assert str(info.value).endswith(
      f'): it is damaged or incomplete. Move it away (mv {directory}/4 {directory}/4.damaged) to resume from '
      'step 2, then rerun the same command.')
  # A step directory without its metadata (an interrupted copy): refused from the metadata.
  (directory / '6' / 'state').mkdir(parents=True)
  with pytest.raises(ValueError, match=r'^The checkpoint of step 6 in .* cannot be read \(its '
                     r'metadata cannot be read\): '
                     r'it is damaged or incomplete\. Move it away \(mv .*/6 .*/6\.damaged\) to resume from '
                     r'step 4, then rerun the same command\.$'):
    checkpoint.Workdir(str(tmp_path)).check_state_fits(_abstract(_state(6)))
  gc.collect()  # The failed restore's reports arrive here, under this test's filter.


def test_an_empty_workdir_is_refused():
  for path in ('', '  '):
    with pytest.raises(ValueError, match=r"^--workdir is empty: give the directory of the run "
                       r"\(local or gs://\), e\.g\. --workdir /tmp/vit_run; an empty one would "
                       r"mean the current directory\.$"):
      checkpoint.Workdir(path)


def test_saved_steps_are_finalized_steps_only(tmp_path):
  saved = _manager(str(tmp_path))
  saved.save(2, _state(2), cost={})
  saved.close()
  (tmp_path / 'checkpoints' / '6.orbax-checkpoint-tmp-123').mkdir()
  (tmp_path / 'checkpoints' / 'notes').mkdir()
  assert checkpoint.Workdir(str(tmp_path)).saved_steps() == [2]


def test_json_the_project_reads_is_bounded_in_depth_and_size_and_never_blocks(tmp_path):
  """`rundir.read_json`, the reader of every JSON file: a file nested 300,000 deep is refused at
  once (was: RecursionError), one over the size cap unparsed, a directory or FIFO unopened; each
  a ValueError naming the file, the problem and the fix."""
  deep = tmp_path / 'deep.json'
  deep.write_text('[' * 300_000)
  start = time.monotonic()
  with pytest.raises(ValueError) as info:
    rundir.read_json(deep)
  assert time.monotonic() - start < 1.0
  assert str(info.value) == (
      f'{deep} is nested more than 64 levels deep, deeper than any JSON file read here (a damaged '
      'or foreign file); restore it or delete it.')
  # Deeper than the bound but within Python's recursion, and the bound itself.
  nested = lambda depth: '{"a": ' * depth + '1' + '}' * depth
  with pytest.raises(ValueError, match='nested more than 64 levels deep'):
    rundir.parse_json(nested(65), 'x.json')
  assert rundir.parse_json(nested(64), 'x.json')['a']['a']['a']
  with pytest.raises(ValueError, match=r'^x.json is larger than 1,000 bytes, more than any JSON '
                     r'file read here \(a damaged or foreign file\); fix it.$'):
    rundir.parse_json(b'[' + b'0,' * 600 + b'0]', 'x.json', fix='fix it', max_bytes=1000)
  big = tmp_path / 'big.json'
  big.write_bytes(b' ' * rundir.MAX_JSON_BYTES + b'{}')
  with pytest.raises(ValueError, match=f'big.json is larger than {rundir.MAX_JSON_BYTES:,} bytes'):
    rundir.read_json(big)
  for text, problem in (('[1, 2]', 'is not a JSON object'), (b'{"a": "\xff"}', 'not valid JSON')):
    (tmp_path / 'bad.json').write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=problem):
      rundir.read_json(tmp_path / 'bad.json')
  (tmp_path / 'dir.json').mkdir()
  with pytest.raises(ValueError, match=r'dir.json is a directory, not a JSON file: remove it'):
    rundir.read_json(tmp_path / 'dir.json')
  os.mkfifo(tmp_path / 'fifo.json')  # Opening it would block until a writer comes.
  with pytest.raises(ValueError, match=r'fifo.json is a special file \(a FIFO, socket or device'):
    rundir.read_json(tmp_path / 'fifo.json')
  assert rundir.read_json(tmp_path / 'none.json') is None


def test_a_cost_json_too_deep_or_of_another_shape_is_ignored_with_a_warning(tmp_path, caplog):
  """The run continues the checkpoint's account, naming the file and why (was: RecursionError
  or KeyError at every rerun)."""
  work = checkpoint.Workdir(str(tmp_path))
  for text, why in (('[' * 300_000, 'nested more than 64 levels deep'),
                    ('{"attempts": [{"x": 1}], "seconds": {"program": 5e9}}',
                     'hardware is missing'),
                    ('{"attempts": 3}', 'hardware is missing')):
    (tmp_path / 'cost.json').write_text(text)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      assert work.read_cost() is None
    assert f'Ignoring {tmp_path}/cost.json ' in caplog.text and why in caplog.text, caplog.text
    assert ("the run goes on from the checkpoint's cost account and writes it over this file"
            in caplog.text)


def test_check_writable(tmp_path):
  checkpoint.Workdir(str(tmp_path / 'new' / 'run')).check_writable()  # Created later.
  blocker = tmp_path / 'file'
  blocker.write_text('')
  with pytest.raises(PermissionError, match=r"--workdir '.*file/run' cannot be used: .*file "
                     r'\(where it would be created\) is not a directory'):
    checkpoint.Workdir(str(blocker / 'run')).check_writable()
  assert not (tmp_path / 'new').exists()
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'checkpoints').write_text('not a directory')
  with pytest.raises(PermissionError) as info:
    checkpoint.Workdir(str(run)).check_writable()
  assert str(info.value) == (
      f"--workdir '{run}' cannot be used: {run}/checkpoints is a file, where the run keeps its "
      f'checkpoint directory. Move it away (mv {run}/checkpoints {run}/checkpoints.moved) or '
      'choose another --workdir.')
  # The files the run replaces as it goes, directories here: refused before the run trains (was:
  # cost.json, the first time the run wrote it, failed with "free disk space").
  (run / 'checkpoints').unlink()
  for name in ('cost.json', 'config.json', 'dataset.json'):
    (run / name).mkdir()
    with pytest.raises(PermissionError) as info:
      checkpoint.Workdir(str(run)).check_writable()
    assert str(info.value) == (
        f"--workdir '{run}' cannot be used: {run}/{name} is a directory, where the run writes its "
        f'{name} (a file). Move it away (mv {run}/{name} {run}/{name}.moved) or choose another '
        '--workdir.')
    (run / name).rmdir()
  checkpoint.Workdir(str(run)).check_writable()
  # The suggested name is one nothing has: an earlier cost.json.moved is not moved into.
  (run / 'cost.json').mkdir()
  (run / 'cost.json.moved').mkdir()
  with pytest.raises(PermissionError, match=re.escape(
      f'(mv {run}/cost.json {run}/cost.json.moved.2)')):
    checkpoint.Workdir(str(run)).check_writable()
  (run / 'cost.json').rename(run / 'cost.json.moved.2')
  checkpoint.Workdir(str(run)).check_writable()


def test_a_step_that_is_a_symbolic_link_is_refused_with_a_fix_that_works(tmp_path):
  """WORKDIR/checkpoints/<step> -> elsewhere: the run, which deletes the steps past
  keep_checkpoints, cannot remove a link (Orbax: 'Cannot call rmtree on a symbolic link' after
  every save). Refused at the start, naming the link and commands that replace it by a copy of
  its directory, which work; a link to nothing is to be removed. The linked data is untouched."""
  run, elsewhere = tmp_path / 'run', tmp_path / 'elsewhere'
  saved = _manager(str(run))
  for step in (1, 2):
    saved.save(step, _state(step), cost={'step': step})
  saved.close()
  steps = run / 'checkpoints'
  elsewhere.mkdir()
  os.rename(steps / '1', elsewhere / '1')
  os.symlink(elsewhere / '1', steps / '1')
  linked = sorted(os.listdir(elsewhere / '1'))
  with pytest.raises(PermissionError) as info:
    checkpoint.Workdir(str(run)).check_writable()
  fix = f'rm {steps}/1 && cp -a {elsewhere}/1 {steps}/1'
  assert str(info.value) == (
      f"--workdir '{run}' cannot be used: its checkpoint step {steps}/1 is a symbolic link (to "
      f'{elsewhere}/1), which the run cannot remove when it deletes the steps past '
      '--config.keep_checkpoints (each rerun would save one step, then fail). Replace it by a '
      f'copy of the directory it points to ({fix}), then rerun.')
  assert sorted(os.listdir(elsewhere / '1')) == linked and os.path.islink(steps / '1')
  subprocess.run(fix, shell=True, check=True)
  checkpoint.Workdir(str(run)).check_writable()
  saved = _manager(str(run), keep=2)  # Deletes step 1, the copy, as it saves step 3.
  saved.save(3, _state(3), cost={'step': 3})
  saved.close()
  assert sorted(os.listdir(steps)) == ['2', '3'] and sorted(os.listdir(elsewhere / '1')) == linked
  os.symlink(tmp_path / 'nothing', steps / '4')
  with pytest.raises(PermissionError, match=(
      rf'its checkpoint step {steps}/4 is a symbolic link to nothing \({tmp_path}/nothing\), '
      rf'.*Remove it \(rm {steps}/4\), then rerun\.$')):
    checkpoint.Workdir(str(run)).check_writable()

def test_only_workdir_spells_the_layout():
  """The layout's names live in vit_jax/rundir.py; workdir.py, the other checkpoint modules and
  the tools that read runs use its constants."""
  names = ("'checkpoints'", "'state'", "'cost'", "'cost.json'", "'config.json'",
           '"checkpoints"', '"state"', '"cost"', '"cost.json"', '"config.json"')
  package = os.path.dirname(workdir_lib.__file__)
  root = os.path.dirname(package)
  others = [os.path.join(root, f) for f in ('convert.py', 'inference.py', 'tools/eval_report.py')]
  for path in [os.path.join(package, f) for f in os.listdir(package) if f.endswith('.py')] + (
      others):
    with open(path) as f:
      text = f.read()
    if path.endswith('hf_vit.py'):  # A transformers directory's config.json, not the workdir's.
      text = text.replace("CONFIG_FILE = 'config.json'", '')
    if path.endswith('timm_vit.py'):  # A timm Hub repository's config.json.
      text = text.replace("HUB_CONFIG = 'config.json'", '')
    assert not [n for n in names if n in text], path
