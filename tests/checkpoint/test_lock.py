"""One run per workdir (vit_jax.checkpoint.lock): the flock of local workdirs, the heartbeat of
gs:// ones (run here on a local directory), stale locks, and what a refused run leaves."""

import json
import logging
import os
import socket
import sys
import threading
import time
import types

import pytest

from vit_jax.checkpoint import lock as lock_lib


def _record(path):
  return json.loads((path / "lock.json").read_text())


def test_a_second_lock_is_refused_naming_the_holder_and_the_release_deletes_the_file(
    tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  # As `python -m vit_jax.main --config c.py` (argv[0] is then the module's file).
  monkeypatch.setattr(sys, "argv", ["/src/vit_jax/main.py", "--config", "c.py"])
  monkeypatch.setattr(sys.modules["__main__"], "__spec__", types.SimpleNamespace(
      name="vit_jax.main"), raising=False)
  with lock_lib.WorkdirLock(str(workdir)) as first:
    record = _record(workdir)
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    assert record["command"] == "python -m vit_jax.main --config c.py"
    before = (workdir / "lock.json").read_bytes()
    with pytest.raises(lock_lib.WorkdirInUseError) as error:
      lock_lib.WorkdirLock(str(workdir)).acquire()
    message = str(error.value)
    assert message.startswith(f"--workdir {workdir} is in use by another run (host "
                              f"{socket.gethostname()}, pid {os.getpid()}, started "
                              f"{record['started']}, 0 s ago: python -m vit_jax.main "
                              "--config c.py)")
    assert message.endswith("would overwrite each other's checkpoints: wait for it to finish or "
                            "stop it, or choose another --workdir.")  # A flock: the holder lives.
    assert (workdir / "lock.json").read_bytes() == before  # The holder's record is untouched.
    assert first.held
  assert not (workdir / "lock.json").exists() and workdir.is_dir()


def test_runs_started_at_the_same_moment_get_one_lock(tmp_path):
  barrier, outcomes = threading.Barrier(8), []
  locks = [lock_lib.WorkdirLock(str(tmp_path / "run")) for _ in range(8)]

  def take(lock):
    barrier.wait()
    try:
      lock.acquire()
      outcomes.append("held")
    except lock_lib.WorkdirInUseError:
      outcomes.append("refused")

  threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert sorted(outcomes) == ["held"] + ["refused"] * 7
  holder = next(lock for lock in locks if lock.held)
  assert _record(tmp_path / "run")["token"] == holder._token  # pylint: disable=protected-access
  holder.release()


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
  workdir = tmp_path / "run"
  workdir.mkdir()
  left = {"host": "tpu-worker-0", "pid": 4242, "started": "2026-12-01T10:00:00+00:00",
          "command": "python -m vit_jax.main --config configs/vit.py:b16"}
  (workdir / "lock.json").write_text(json.dumps(left))  # The file of a run that never released.
  with caplog.at_level(logging.WARNING), lock_lib.WorkdirLock(str(workdir)):
    assert _record(workdir)["pid"] == os.getpid()
  assert ("Taking over the lock of host tpu-worker-0, pid 4242, started 2026-12-01T10:00:00+00:00:"
          " python -m vit_jax.main --config configs/vit.py:b16: a run that ended without "
          "releasing it") in caplog.text


def test_release_leaves_a_lock_file_put_there_since(tmp_path):
  """A user deleted the lock of a live run and another run took the workdir: the first run's
  release must not delete the second's lock."""
  workdir = tmp_path / "run"
  first = lock_lib.WorkdirLock(str(workdir))
  first.acquire()
  (workdir / "lock.json").unlink()
  second = lock_lib.WorkdirLock(str(workdir))
  second.acquire()
  first.release()
  assert _record(workdir)["token"] == second._token  # pylint: disable=protected-access
  second.release()
  assert not (workdir / "lock.json").exists()


def test_a_refused_run_removes_the_directories_its_lock_created(tmp_path):
  with pytest.raises(ValueError, match="refused"):
    with lock_lib.WorkdirLock(str(tmp_path / "new" / "run")):
      assert (tmp_path / "new" / "run" / "lock.json").exists()
      raise ValueError("refused")
  assert not (tmp_path / "new").exists()
  # A run that wrote something keeps its directory.
  with pytest.raises(ValueError):
    with lock_lib.WorkdirLock(str(tmp_path / "kept")):
      (tmp_path / "kept" / "config.json").write_text("{}")
      raise ValueError("refused")
  assert sorted(os.listdir(tmp_path / "kept")) == ["config.json"]


def test_folders_made_above_the_workdir_are_named_in_a_warning(tmp_path, caplog):
  """A mistyped parent is made, as `mkdir -p` would, but not silently."""
  with caplog.at_level(logging.WARNING, logger="absl"):
    with lock_lib.WorkdirLock(str(tmp_path / "runs")):
      pass
    assert not caplog.records  # Only the workdir itself was made.
    with lock_lib.WorkdirLock(str(tmp_path / "typo" / "x" / "run")):
      pass
  assert caplog.messages == [
      f"Created the workdir {tmp_path / 'typo' / 'x' / 'run'} and the folders above it, which "
      f"did not exist: {tmp_path / 'typo'}, {tmp_path / 'typo' / 'x'}."]


def test_a_lock_json_that_is_a_directory_is_named_with_the_fix(tmp_path):
  """Issue 37: an IsADirectoryError traceback (exit 1). Now a PermissionError, which the
  trainer's config phase reports as one FATAL line (exit 2); the directory is left alone."""
  (tmp_path / "run" / "lock.json" / "inside").mkdir(parents=True)
  for heartbeat in (False, True):
    with pytest.raises(PermissionError, match=(
        rf"^The workdir lock {tmp_path}/run/lock.json is a directory: remove it \(it is no run's "
        r"lock; a run writes lock.json as a file\), then rerun\.$")):
      lock_lib.WorkdirLock(str(tmp_path / "run"), heartbeat=heartbeat, settle_s=0).acquire()
  assert os.listdir(tmp_path / "run" / "lock.json") == ["inside"]


def _heartbeat_lock(path, **kwargs):
  return lock_lib.WorkdirLock(str(path), heartbeat=True, settle_s=0.01, **kwargs)


def test_a_heartbeat_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path, caplog):
  """The gs:// protocol, on a local directory: a fresh heartbeat is in use, an old one (or the
  record of a process of this host that is gone) is stale."""
  workdir = tmp_path / "run"
  with _heartbeat_lock(workdir, timeout_s=0.4) as holder:
    time.sleep(0.5)  # Longer than the timeout: the holder's heartbeat (every 0.1 s) keeps it.
    with pytest.raises(lock_lib.WorkdirInUseError, match=r"; its heartbeat is 0 s old\. .* If "
                       r"that run is gone \(e\.g\. its machine was lost\), its lock is taken over "
                       r"once its heartbeat is 0\.4 s old, or delete .*/run/lock\.json\.$"):
      _heartbeat_lock(workdir, timeout_s=0.4).acquire()
    assert _record(workdir)["token"] == holder._token  # pylint: disable=protected-access
  assert not (workdir / "lock.json").exists()

  now = time.time()
  stale = [{"host": "tpu-worker-0", "pid": 1, "heartbeat_unix": now - 700},
           {"host": socket.gethostname(), "pid": 2 ** 22 + 1, "heartbeat_unix": now}]
  for record in stale:
    (workdir / "lock.json").write_text(json.dumps(record))
    caplog.clear()
    with caplog.at_level(logging.WARNING), _heartbeat_lock(workdir):
      assert _record(workdir)["pid"] == os.getpid()
    assert f"Taking over the stale lock of host {record['host']}, pid {record['pid']}" in caplog.text
  (workdir / "lock.json").write_text(json.dumps(dict(stale[0], heartbeat_unix=now - 10)))
  with pytest.raises(lock_lib.WorkdirInUseError, match="its heartbeat is 10 s old"):
    _heartbeat_lock(workdir).acquire()


def test_a_heartbeat_lock_written_at_the_same_moment_by_two_runs_goes_to_the_last(tmp_path,
                                                                              monkeypatch):
  workdir = tmp_path / "run"
  other = {"host": "tpu-worker-1", "pid": 77, "started": "2026-12-02T05:00:00+00:00",
           "command": "python -m vit_jax.main", "heartbeat_unix": time.time(), "token": "x"}
  real_sleep = time.sleep

  def settle(seconds):  # While this run waits, another one writes its record over it.
    (workdir / "lock.json").write_text(json.dumps(other))
    real_sleep(seconds)

  monkeypatch.setattr(lock_lib.time, "sleep", settle)
  with pytest.raises(lock_lib.WorkdirInUseError, match=r"in use by another run \(host "
                     r"tpu-worker-1, pid 77, started 2026-12-02T05:00:00\+00:00: python -m "
                     r"vit_jax.main\), which wrote the lock at the same moment"):
    _heartbeat_lock(workdir).acquire()
  assert _record(workdir) == other  # The winner's record stays.


@pytest.mark.parametrize("process", [0, 1])
def test_on_a_pod_process_0_takes_the_lock_and_every_process_gets_its_outcome(
    tmp_path, monkeypatch, process):
  """Two processes as two hosts of a pod see them: process 0 is refused (another run holds the
  workdir) and broadcasts the refusal; process 1 never touches the file and raises it too."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"
  holder = lock_lib.WorkdirLock(str(workdir))
  holder.acquire()
  refusal = {}

  def broadcast(buffer):  # Process 0's buffer reaches every process.
    if jax.process_index() == 0:
      refusal["buffer"] = buffer.copy()
    return refusal["buffer"]

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
  with pytest.raises(lock_lib.WorkdirInUseError) as on_0:
    lock_lib.acquire_on_all_processes(lock_lib.WorkdirLock(str(workdir)))
  if process == 1:  # The same buffer, received by a process that does not read the file.
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    other = lock_lib.WorkdirLock(str(tmp_path / "elsewhere"))
    with pytest.raises(lock_lib.WorkdirInUseError) as on_1:
      lock_lib.acquire_on_all_processes(other)
    assert str(on_1.value) == str(on_0.value) and not other.held
    assert not (tmp_path / "elsewhere").exists()
  assert str(on_0.value).startswith(f"--workdir {workdir} is in use by another run (host ")
  holder.release()
  # Free: process 0 takes it, nothing is broadcast as a refusal.
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  refusal.clear()
  taken = lock_lib.WorkdirLock(str(workdir))
  lock_lib.acquire_on_all_processes(taken)
  assert taken.held and not bytes(refusal["buffer"]).rstrip(b"\0")
  taken.release()


def test_live_holder_names_a_live_run_and_passes_over_a_stale_lock_taking_nothing(tmp_path):
  """What `python -m vit_jax.convert` asks before writing into a workdir (issue 50): the live
  holder's record, or None for no lock and a stale one (the rules of acquire, with the holder's
  own staleness age where longer); the lock file is left as it was."""
  workdir = tmp_path / "run"
  assert lock_lib.WorkdirLock(str(workdir)).live_holder() is None and not workdir.exists()
  with lock_lib.WorkdirLock(str(workdir)):  # A flock.
    record = _record(workdir)
    assert record["timeout_s"] == 600
    assert lock_lib.WorkdirLock(str(workdir)).live_holder() == record
  workdir.mkdir(exist_ok=True)
  (workdir / "lock.json").write_text(json.dumps(record))  # Its run killed: no flock.
  assert lock_lib.WorkdirLock(str(workdir)).live_holder() is None

  now = time.time()
  for record, live in (({"host": "tpu-worker-0", "pid": 1, "heartbeat_unix": now - 10}, True),
                       ({"host": "tpu-worker-0", "pid": 1, "heartbeat_unix": now - 700}, False),
                       ({"host": "tpu-worker-0", "pid": 1, "heartbeat_unix": now - 700,
                         "timeout_s": 3600}, True),  # Its run beats every 15 min.
                       ({"host": socket.gethostname(), "pid": 2 ** 22 + 1,
                         "heartbeat_unix": now}, False)):  # Gone from this host.
    (workdir / "lock.json").write_text(json.dumps(record))
    assert _heartbeat_lock(workdir).live_holder() == (record if live else None), record
    assert _record(workdir) == record
