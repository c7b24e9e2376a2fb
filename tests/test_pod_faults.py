"""Stops and pod faults of `python -m vit_jax.main` (issue 37): a stop notice during the set-up
stops at once (exit 75 / 130, nothing saved, the lock released); a process of a pod that never
registers, or dies, ends the others within --distributed_timeout with one FATAL line (exit 1)."""

import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests import data_utils
from tests.test_train_failures import _folder, _main_args, _main_config, _main_overrides
from vit_jax import checkpoint
from vit_jax import pod
from vit_jax import stops
from vit_jax import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")
_SET_UP_STOP = ("Preempted (SIGTERM) during the set-up, before the first step: stopped at once "
                "with nothing saved or half-written; rerun the same command.")


def _communicate_all(procs, timeout: float) -> tuple[list[str], float]:
  """Every process's stderr once it exits, and the seconds until the last one did."""
  start = time.monotonic()
  stderrs = [proc.communicate(timeout=timeout)[1] for proc in procs]
  return stderrs, time.monotonic() - start


def _reap(procs) -> None:
  """Ends what is left of `procs` (a failed test leaves no process behind)."""
  for proc in procs:
    proc.kill()
    proc.wait()


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _pod_args(workdir, folder, port, process_id, timeout_s):
  return [*_main_args(workdir, _main_overrides(folder, total_steps=1000000)),
          f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
          f"--process_id={process_id}", f"--distributed_timeout={timeout_s}"]


def _fatal_lines(stderr):
  return [line for line in stderr.splitlines() if line.startswith("FATAL:")]


def test_a_stop_while_the_lock_is_taken_stops_once_it_is_held_and_releases_it(
    tmp_path, monkeypatch):
  """SIGTERM inside a `deferred_stop()` section of the set-up (taking the workdir's lock): the
  section completes, then `StopRequested` (exit code 75) stops the run; the lock is released and
  nothing else is written."""
  data_utils.skip_cpu_peak_measurement(monkeypatch)
  acquire = checkpoint.acquire_on_all_processes

  def acquire_then_sigterm(lock):
    os.kill(os.getpid(), signal.SIGTERM)
    return acquire(lock)

  monkeypatch.setattr(checkpoint, "acquire_on_all_processes", acquire_then_sigterm)
  workdir, handler = tmp_path / "workdir", signal.getsignal(signal.SIGTERM)
  overrides = _main_overrides(_folder(tmp_path), total_steps=5)
  with pytest.raises(stops.StopRequested) as stop:
    train.train_and_evaluate(_main_config(overrides), str(workdir))
  assert stop.value.exit_code == 75 and stop.value.signal == "SIGTERM"
  assert str(stop.value).startswith("Preempted (SIGTERM) during the set-up, before the first "
                                    "step: stopped at once")
  assert not workdir.exists() or os.listdir(workdir) == []  # No lock.json, nothing else.
  assert signal.getsignal(signal.SIGTERM) is handler  # Restored.


def _catches(pid: int, signum: int) -> bool:
  """Whether process `pid` has a handler for `signum` (Linux: SigCgt of /proc/PID/status)."""
  with open(f"/proc/{pid}/status") as f:
    caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
  return bool(int(caught, 16) >> (signum - 1) & 1)


@pytest.mark.slow
def test_sigterm_during_the_imports_exits_75_at_once(tmp_path):
  workdir = tmp_path / "workdir"
  proc = subprocess.Popen(_main_args(workdir, _main_overrides(str(tmp_path / "none"))),
                          cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 60  # Until its handler is in (a loaded machine: seconds),
  while not _catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
    assert proc.poll() is None
    time.sleep(0.01)
  time.sleep(0.5)  # then into the imports of JAX and TensorFlow (about 8 s here).
  proc.send_signal(signal.SIGTERM)
  sent = time.monotonic()
  _, stderr = proc.communicate(timeout=60)
  elapsed = time.monotonic() - sent
  assert proc.returncode == 75, stderr[-3000:]
  assert elapsed < 2.0, elapsed  # Measured: 0.0-0.1 s.
  assert stderr.splitlines()[-1] == _SET_UP_STOP
  assert "Traceback" not in stderr and not workdir.exists()


@pytest.mark.slow
def test_a_process_that_never_registers_ends_its_peer_within_the_timeout(tmp_path):
  """Process 0 of 2 alone: one FATAL line and exit 1, --distributed_timeout (3 s) after it
  started to wait (was: jax's C++ abort, exit 134, after 300 s)."""
  port, folder = _free_port(), _folder(tmp_path)
  start = time.monotonic()
  proc = subprocess.run(_pod_args(tmp_path / "workdir", folder, port, 0, 3), cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=120)
  elapsed = time.monotonic() - start
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert _fatal_lines(proc.stderr) == [
      f"FATAL: Process 0 of 2: not all 2 processes registered with the coordinator "
      f"127.0.0.1:{port} within 3 s (--distributed_timeout): start every process with the same "
      "--coordinator_address and --num_processes=2 and its own --process_id (or raise "
      "--distributed_timeout), then rerun."]
  assert elapsed < 3 + 45, elapsed  # The imports (8 s here; 25 s beside other tests), then 3 s.
  assert not (tmp_path / "workdir").exists()


def _kill_once_registered(tmp_path, workdir, killed):
  """A pod of 2 (--distributed_timeout=5) whose process `killed` is SIGKILLed once both
  registered (process 0 took the workdir's lock): the other's exit code, stderr and seconds from
  the kill to its end."""
  port, folder = _free_port(), _folder(tmp_path)
  procs = [subprocess.Popen(_pod_args(workdir, folder, port, i, 5), cwd=ROOT, env=ENV,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    deadline = time.monotonic() + 120
    while not (workdir / "lock.json").exists() and time.monotonic() < deadline:
      time.sleep(0.05)
    procs[killed].kill()
    start = time.monotonic()
    _, stderr = procs[1 - killed].communicate(timeout=120)
    return procs[1 - killed].returncode, stderr, time.monotonic() - start
  finally:
    _reap(procs)


@pytest.mark.slow
def test_the_coordinator_killed_ends_the_other_with_one_fatal_line(tmp_path):
  """SIGKILL of process 0, the coordinator: jax's client in process 1 aborts in C++ within a
  second, before Python can run (was: exit 134 and no FATAL line); its supervisor
  (`pod.supervise`) writes the one FATAL line and exits 1. Either may come first when a
  collective is under way: gloo's error, also one FATAL line."""
  returncode, stderr, elapsed = _kill_once_registered(tmp_path, tmp_path / "workdir", killed=0)
  assert returncode == pod.POD_FAULT_EXIT_CODE == 1, stderr[-3000:]
  fatal = _fatal_lines(stderr)
  assert len(fatal) == 1, stderr[-3000:]
  assert fatal[0] in (
      "FATAL: This process was aborted by JAX's distributed runtime (SIGABRT; the lines above "
      "say why: on a pod, the coordinator, process 0, or another process died). Stopped; rerun "
      "the same command on every process to resume from the latest checkpoint.") or (
      fatal[0].startswith("FATAL: Process 1 of 2: the run lost another process ("))
  assert elapsed < 5 + 15, elapsed  # Measured: 0.1-0.3 s.


_ABORTS_ON_SIGTERM = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from vit_jax import pod
pod.supervise(sys.argv + ["--coordinator_address=127.0.0.1:1"])
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.2), os.abort()))  # JAX's abort, later.
print("ready", flush=True)
time.sleep(60)
os.abort()
"""


@pytest.mark.parametrize("sigterm", [True, False])
def test_a_supervised_process_aborted_after_a_sigterm_is_preempted_not_a_fault(tmp_path, sigterm):
  """A pod's child that JAX aborts (SIGABRT) after this host's SIGTERM (forwarded by its
  supervisor) because the others stopped first: exit 75 and a line saying so (was: a FATAL
  line, exit 1); aborted with no SIGTERM: the FATAL line, exit 1."""
  script = tmp_path / "child.py"
  script.write_text(_ABORTS_ON_SIGTERM.format(root=ROOT))
  proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=ENV)
  try:
    assert proc.stdout.readline() == "ready\n"
    if sigterm:
      proc.send_signal(signal.SIGTERM)
    else:
      psutil.Process(proc.pid).children()[0].send_signal(signal.SIGABRT)
    _, stderr = proc.communicate(timeout=30)
  finally:
    proc.kill()
    proc.wait()
  last = stderr.splitlines()[-1]
  if sigterm:
    assert proc.returncode == stops.PREEMPTED_EXIT_CODE == 75, stderr
    assert last == (
        "Preempted (SIGTERM): stopped; JAX's distributed runtime then ended this process "
        "(SIGABRT) as the other processes had stopped too. Rerun the same command on every "
        "process to resume from the latest checkpoint."), stderr
  else:
    assert proc.returncode == pod.POD_FAULT_EXIT_CODE == 1, stderr
    assert last.startswith("FATAL: This process was aborted by JAX's distributed runtime"), stderr


def test_supervision_is_for_several_processes_only(monkeypatch):
  """`pod.supervise` starts a child for a pod's command line or environment only."""
  for name in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE"):
    monkeypatch.delenv(name, raising=False)
  several = pod._several_processes  # pylint: disable=protected-access
  assert not several(["main.py", "--workdir=/tmp/x", "--num_processes=2"])
  assert several(["main.py", "--coordinator_address=10.0.0.1:1234"])
  assert several(["main.py", "--coordinator_address", "10.0.0.1:1234"])
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v3-8")
  assert not several(["main.py"])
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v3-32")
  assert several(["main.py"])


@pytest.mark.slow
def test_a_process_killed_during_the_set_up_ends_the_other_within_the_timeout(tmp_path):
  """SIGKILL of process 1 once both registered: process 0 ends with one FATAL line naming
  itself and the lost peer, exit 1, within --distributed_timeout (5 s) plus its next
  collective; the workdir's lock is released."""
  workdir = tmp_path / "workdir"
  returncode, stderr, elapsed = _kill_once_registered(tmp_path, workdir, killed=1)
  assert returncode == pod.POD_FAULT_EXIT_CODE == 1, stderr[-3000:]
  fatal = _fatal_lines(stderr)
  assert len(fatal) == 1, stderr[-3000:]
  # Its next collective fails at once (gloo: connection closed), or, when none comes within the
  # timeout, the heartbeat watch ends it.
  if "the run lost another process" in fatal[0]:
    assert fatal[0].startswith("FATAL: Process 0 of 2: the run lost another process (")
    assert fatal[0].endswith(f"there is no checkpoint in {workdir} yet: rerun the same command "
                             "on every process to resume.")
    assert not (workdir / "lock.json").exists()
  else:
    assert fatal[0] == (
        "FATAL: Process 0 of 2: process 1 has sent no heartbeat for 5 s (--distributed_timeout): "
        "it died or hangs, its log says why. Stopped; rerun the same command on every process "
        "to resume from the latest checkpoint.")
  assert elapsed < 5 + 15, elapsed  # Measured: 1.7 s (gloo), 5.8 s (heartbeat watch).
  if (workdir / "lock.json").exists():  # Left by a watch's exit: free, so a rerun takes it over.
    with open(workdir / "lock.json") as f:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _sigterm_pod(tmp_path, started, whom, total_steps=1000000):
  """A pod of 2 with a checkpoint every 50 steps; once `started(workdir)`, SIGTERM to `whom`
  ('all': every supervisor and its child, as `launch/tpu.sh stop`'s pkill and a VM's shutdown
  send it; 'supervisors': as a container's PID 1 gets it; 'process 1': its supervisor and child,
  one preempted host). Returns (exit codes, stderrs, seconds from the signal to the last exit,
  saved steps)."""
  port, folder, workdir = _free_port(), _folder(tmp_path), tmp_path / "workdir"
  overrides = _main_overrides(folder, total_steps=total_steps, checkpoint_every_steps=50)
  procs = [subprocess.Popen(
      [*_main_args(workdir, overrides), f"--coordinator_address=127.0.0.1:{port}",
       "--num_processes=2", f"--process_id={i}", "--distributed_timeout=10"],
      cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    deadline = time.monotonic() + 180
    while not started(workdir) and time.monotonic() < deadline:
      time.sleep(0.05)
    signalled = procs[1:] if whom == "process 1" else procs
    pids = [p.pid for p in signalled]
    if whom != "supervisors":
      pids += [c.pid for p in signalled for c in psutil.Process(p.pid).children()]
    for pid in pids:
      os.kill(pid, signal.SIGTERM)
    stderrs, elapsed = _communicate_all(procs, timeout=120)
  finally:
    _reap(procs)
  return ([p.returncode for p in procs], stderrs, elapsed,
          checkpoint.Workdir(str(workdir)).saved_steps())


@pytest.mark.slow
def test_sigterm_to_a_pod_during_the_set_up_stops_every_process_at_once(tmp_path):
  """SIGTERM to every process (supervisors and children) once `jax.distributed` runs and the
  lock is taken: exit 75 at once, nothing saved (was: jax's preemption service kept SIGTERM, so
  the pod compiled and trained a first step, then saved it: 14 s here, minutes for big models)."""
  codes, stderrs, elapsed, steps = _sigterm_pod(
      tmp_path, lambda workdir: (workdir / "lock.json").exists(), "all")
  assert codes == [75, 75], [e[-3000:] for e in stderrs]
  # Process 0, the coordinator, exits first; jax's client in process 1 may then abort it during
  # its 1 s announce (stops.ANNOUNCE_S), and its supervisor says so (3 times in 12 here, loaded).
  aborted = ("Preempted (SIGTERM): stopped; JAX's distributed runtime then ended this process "
             "(SIGABRT) as the other processes had stopped too. Rerun the same command on every "
             "process to resume from the latest checkpoint.")
  for i, stderr in enumerate(stderrs):
    assert stderr.splitlines()[-1] in (_SET_UP_STOP, aborted)[:i + 1], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
  assert elapsed < 10, elapsed  # Measured: 0.03-0.08 s.
  assert not list(steps)


@pytest.mark.slow
def test_a_process_stopped_in_the_set_up_stops_the_others_without_waiting_for_it(tmp_path):
  """SIGTERM to process 1 only (one preempted host) once the lock is taken: process 1 stops, and
  process 0, waiting for it in a collective or about to, reads its heartbeat ("stopped") and
  stops too with exit 75 (was: it waited `--distributed_timeout`, then a FATAL line, exit 1).
  Process 1 ends 75 too, by its own stop or, when jax aborts it as process 0 ends, by its
  supervisor."""
  codes, stderrs, elapsed, steps = _sigterm_pod(
      tmp_path, lambda workdir: (workdir / "lock.json").exists(), "process 1")
  assert codes == [75, 75], [e[-3000:] for e in stderrs]
  assert stderrs[0].splitlines()[-1] == (
      "Process 0 of 2: process 1 stopped. Preempted (SIGTERM) during the set-up, before the "
      "first step: stopped at once with nothing saved or half-written; rerun the same "
      "command."), stderrs[0][-3000:]
  assert elapsed < 5, elapsed  # The heartbeat's period is 1 s.
  assert not list(steps)


@pytest.mark.slow
def test_sigterm_to_a_pods_supervisors_in_training_saves_one_step_on_every_process(tmp_path):
  """SIGTERM to the two supervisors only (a container's PID 1) once a checkpoint exists: each
  passes it on, jax's preemption service has SIGTERM back from the first step on, and both
  processes save the same step and exit 75."""
  codes, stderrs, elapsed, steps = _sigterm_pod(
      tmp_path, lambda workdir: (workdir / "checkpoints" / "50").exists(), "supervisors")
  assert codes == [75, 75], [e[-3000:] for e in stderrs]
  saved = [re.search(r"Preempted: saved the checkpoint of step (\d+) in ", e) for e in stderrs]
  assert all(saved), [e[-3000:] for e in stderrs]
  assert saved[0].group(1) == saved[1].group(1) and int(saved[0].group(1)) > 50
  assert max(steps) == int(saved[0].group(1))
  assert elapsed < 10, elapsed  # Measured: 1.5-1.7 s.


def _pod(tmp_path, overrides, workdirs, timeout_s):
  """The two processes of a pod of 2 on one image folder: process i with `overrides[i]` (a tiny
  run's extra --config overrides) and --workdir `workdirs[i]`."""
  port, folder = _free_port(), _folder(tmp_path)
  return [subprocess.Popen(
      [*_main_args(workdirs[i], _main_overrides(folder, **overrides[i])),
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
       f"--distributed_timeout={timeout_s}"],
      cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True) for i in range(2)]


_SAME_COMMAND = ("Every process of a pod runs the same command (--config, its overrides and "
                 "--workdir; only --process_id differs): give every process the same command, "
                 "then rerun.")


@pytest.mark.slow
@pytest.mark.parametrize("differing", ["seed", "workdir"])
def test_a_pods_processes_given_different_commands_are_refused_before_any_write(
    tmp_path, differing):
  """Process 1 with another --config.seed (was: both trained to the end with different
  "replicated" parameters, exit 0) or another --workdir (was: both hung in the second save, deaf
  to --distributed_timeout and SIGTERM): both processes exit 2 once the resolved configs are
  compared, each with one FATAL line naming the key, its value here and on process 0; neither
  workdir is created."""
  workdirs = [tmp_path / "workdir", tmp_path / ("other" if differing == "workdir" else "workdir")]
  steps = dict(total_steps=1000000, checkpoint_every_steps=2)
  procs = _pod(tmp_path, [dict(steps, seed=0), dict(steps, seed=int(differing == "seed"))],
               workdirs, timeout_s=10)
  try:
    stderrs, elapsed = _communicate_all(procs, timeout=150)
  finally:
    _reap(procs)
  assert [p.returncode for p in procs] == [2, 2], [e[-3000:] for e in stderrs]
  key, values = (("--config.seed", ("1", "0")) if differing == "seed" else
                 ("--workdir", tuple(repr(str(w)) for w in workdirs[::-1])))
  assert _fatal_lines(stderrs[0]) == [
      f"FATAL: Process 0 of 2: process 1 got another command than this one: {key}={values[0]} "
      f"on process 1, {values[1]} here. {_SAME_COMMAND}"], stderrs[0][-3000:]
  assert _fatal_lines(stderrs[1]) == [
      f"FATAL: Process 1 of 2 got another command than process 0: {key}={values[0]} here, "
      f"{values[1]} on process 0. {_SAME_COMMAND}"], stderrs[1][-3000:]
  assert not any(w.exists() for w in workdirs)
  assert elapsed < 90, elapsed  # The imports and the set-up (about 10 s here), then at once.


def test_command_differences_name_nested_and_missing_keys():
  """`pod.command_differences`: the leaves that differ, by dotted key (sorted), a key on one side
  only as `pod.ABSENT` on the other (an empty section is a leaf); a tuple equals its list, NaN
  equals NaN."""
  mine = {"--workdir": "/a", "--config": {"seed": 1, "model": {"hidden_size": 8, "patch_size":
          (4, 4), "dropout": float("nan")}, "optim": {"lr": 0.1}, "extra": None}}
  reference = {"--workdir": "/b", "--config": {"seed": 1, "model": {"hidden_size": 16,
               "patch_size": [4, 4], "dropout": float("nan")}, "optim": {}, "name": "x"}}
  assert pod.command_differences(mine, reference) == [
      ("--config.extra", None, pod.ABSENT), ("--config.model.hidden_size", 8, 16),
      ("--config.name", pod.ABSENT, "x"), ("--config.optim", pod.ABSENT, {}),
      ("--config.optim.lr", 0.1, pod.ABSENT), ("--workdir", "/a", "/b")]
  assert pod.command_differences(mine, mine) == []
  assert pod.command_differences({"a": {"b": 1}}, {"a": 1}) == [
      ("a", pod.ABSENT, 1), ("a.b", 1, pod.ABSENT)]


@pytest.mark.slow
def test_a_pod_process_stopped_in_training_ends_the_other_within_the_timeout(tmp_path):
  """SIGSTOP of process 0's training process, the coordinator, once a checkpoint exists (a hung
  host): process 1, waiting for it in a collective and in its heartbeat's calls, which never
  return, ends with one FATAL line naming it and exit 1 within --distributed_timeout (10 s) plus
  a margin (was: jax's abort 30 s later, under a stack dump, with a line that blamed no one).
  Process 1 stopped instead: process 0 ends the same way, in 9.6 s here (its heartbeat watch, as
  `test_the_heartbeat_watch_ends_a_process_whose_peer_or_coordinator_is_silent` checks)."""
  stopped, workdir = 0, tmp_path / "workdir"
  steps = dict(total_steps=1000000, checkpoint_every_steps=5)
  procs = _pod(tmp_path, [steps, steps], [workdir, workdir], timeout_s=10)
  child = None
  try:
    deadline = time.monotonic() + 180
    while not (workdir / "checkpoints" / "5").exists() and time.monotonic() < deadline:
      assert procs[0].poll() is None and procs[1].poll() is None
      time.sleep(0.05)
    child = psutil.Process(procs[stopped].pid).children()[0]  # The training process (`supervise`).
    child.suspend()  # SIGSTOP
    start = time.monotonic()
    _, stderr = procs[1 - stopped].communicate(timeout=120)
    elapsed = time.monotonic() - start
  finally:
    if child is not None:
      child.kill()
    _reap(procs)
  assert procs[1 - stopped].returncode == pod.POD_FAULT_EXIT_CODE == 1, stderr[-3000:]
  fatal = _fatal_lines(stderr)
  assert len(fatal) == 1, stderr[-3000:]
  assert fatal == [
      "FATAL: Process 1 of 2: the coordinator (process 0) has not answered for 10 s "
      "(--distributed_timeout; its calls do not return): it died or hangs, its log says why. "
      "Stopped; rerun the same command on every process to resume from the latest checkpoint."]
  assert 10 <= elapsed < 10 + 10, elapsed  # Measured: 11.2 s.


class _Exited(Exception):
  """`stops.exit_process`'s `(code, message)`, raised instead of ending the test's process."""


def _exited(*args, **_):
  raise _Exited(*args)


class _Coordination:
  """A coordination service's client holding `values`; with `hang` (an Event), every call waits
  for it, then raises TypeError (`_watch_peers` then returns)."""

  def __init__(self, values, hang=None):
    self.values, self.hang = dict(values), hang

  def key_value_set(self, key, value, allow_overwrite=False):
    del allow_overwrite
    if self.hang is not None:
      self.hang.wait()
      raise TypeError("released")
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_the_heartbeat_watch_ends_a_process_whose_peer_or_coordinator_is_silent(monkeypatch):
  """`pod._watch_peers`: a peer whose heartbeat stays the same `timeout_s` (a SIGSTOPped
  process) ends this one with a FATAL line naming it, exit 1; `pod._watch_call`: a heartbeat call
  that never returns (a SIGSTOPped coordinator) too."""
  monkeypatch.setattr(pod, "_BEAT_S", 0.05)
  monkeypatch.setattr(stops, "exit_process", _exited)
  with pytest.raises(_Exited) as exited:
    pod._watch_peers(_Coordination({"vit_jax/alive/1": "7"}), 0, 2, 0.3, pod._Call())
  assert exited.value.args == (1, (
      "FATAL: Process 0 of 2: process 1 has sent no heartbeat for 0.3 s (--distributed_timeout): "
      "it died or hangs, its log says why. Stopped; rerun the same command on every process to "
      "resume from the latest checkpoint."))
  hung, call = _Coordination({}, hang=threading.Event()), pod._Call()
  beating = threading.Thread(target=pod._watch_peers, args=(hung, 1, 2, 0.3, call), daemon=True)
  beating.start()
  try:
    with pytest.raises(_Exited) as exited:
      pod._watch_call(call, 1, 2, 0.3)
  finally:
    hung.hang.set()
    beating.join(10)
  assert exited.value.args == (1, (
      "FATAL: Process 1 of 2: the coordinator (process 0) has not answered for 0.3 s "
      "(--distributed_timeout; its calls do not return): it died or hangs, its log says why. "
      "Stopped; rerun the same command on every process to resume from the latest checkpoint."))
  assert not beating.is_alive()
