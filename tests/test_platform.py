"""Host set-up (vit_jax.platform): malloc's huge pages for XLA:CPU's step buffers, the
multi-process switch, and the stop notice (SIGTERM, Ctrl-C)."""

import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from vit_jax import platform
from vit_jax import pod
from vit_jax import stops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORTED = platform.huge_pages_environment({}) is not None
needs_huge_pages = pytest.mark.skipif(
    not SUPPORTED, reason="no glibc >= 2.35 with transparent huge pages on this machine")


def _environ(**extra):
  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", platform.HUGE_PAGES_SWITCH)}
  env.update(JAX_PLATFORMS="cpu", **extra)
  return env


def test_huge_pages_environment_adds_the_tunable_and_keeps_the_rest():
  env = platform.huge_pages_environment({"HOME": "/h"}, glibc=(2, 36), thp_mode="madvise")
  assert env == {"HOME": "/h", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
  env = platform.huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                                   glibc=(2, 35), thp_mode="always")
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_huge_pages_switch_reads_on_and_off_and_refuses_anything_else():
  on = dict(glibc=(2, 36), thp_mode="madvise")
  for value in ("", "1", "true", "Yes", " on "):
    assert platform.huge_pages_environment({platform.HUGE_PAGES_SWITCH: value}, **on) is not None, value
  for value in ("0", " 0 ", "false", "No", "OFF"):
    assert platform.huge_pages_environment({platform.HUGE_PAGES_SWITCH: value}, **on) is None, value
  with pytest.raises(ValueError, match="VIT_JAX_HUGE_PAGES='garbage' is neither on"):
    platform.huge_pages_environment({platform.HUGE_PAGES_SWITCH: "garbage"}, **on)
  proc = subprocess.run([sys.executable, "-m", "vit_jax.main", "--help"], cwd=ROOT,
                        env=_environ(**{platform.HUGE_PAGES_SWITCH: "garbage"}), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.startswith("FATAL: VIT_JAX_HUGE_PAGES='garbage'")


@pytest.mark.parametrize("environ, glibc, thp_mode", [
    ({platform.HUGE_PAGES_SWITCH: "0"}, (2, 36), "madvise"),  # Switched off.
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), "madvise"),  # The user's choice.
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, (2, 36), "madvise"),  # Already re-executed.
    ({}, (2, 34), "madvise"),  # glibc before the tunable existed.
    ({}, (), "madvise"),  # Not glibc (e.g. musl).
    ({}, (2, 36), "never"),  # The kernel's huge pages are off.
    ({}, (2, 36), ""),  # No transparent huge pages at all.
])
def test_huge_pages_environment_leaves_the_process_alone(environ, glibc, thp_mode):
  assert platform.huge_pages_environment(environ, glibc=glibc, thp_mode=thp_mode) is None


_REEXEC = ("import os, sys, json; from vit_jax import platform; print('before', flush=True); "
           "platform.reexec_with_huge_pages(); "
           "print(json.dumps([sys.argv, os.environ.get('GLIBC_TUNABLES')]))")


@needs_huge_pages
def test_reexec_runs_the_same_command_line_once_with_the_tunable():
  proc = subprocess.run([sys.executable, "-c", _REEXEC, "a b", "--flag=1"], cwd=ROOT,
                        env=_environ(), capture_output=True, text=True, timeout=120, check=True)
  lines = proc.stdout.splitlines()
  # "before" twice: the first process printed it and was replaced; the second went on.
  assert lines[:2] == ["before", "before"] and len(lines) == 3, proc.stdout
  argv, tunables = json.loads(lines[2])
  assert argv == ["-c", "a b", "--flag=1"] and tunables == platform.HUGE_PAGES_TUNABLE

  off = subprocess.run([sys.executable, "-c", _REEXEC], cwd=ROOT, capture_output=True,
                       env=_environ(**{platform.HUGE_PAGES_SWITCH: "0"}), text=True, timeout=120,
                       check=True)
  assert off.stdout.splitlines()[0] == "before" and json.loads(off.stdout.splitlines()[1])[1] is None


# A jitted function whose 128 MiB temporary (the [1024, 32768] float32 product) XLA:CPU
# allocates afresh at every call; prints the minor page faults of the 3rd-5th calls.
_FAULTS = """
import resource, jax, jax.numpy as jnp
f = jax.jit(lambda x, w: jnp.sum(jnp.tanh(x @ w), axis=0) @ jnp.tanh(x @ w).T)
x, w = jnp.ones((1024, 16)), jnp.ones((16, 32768)) / 16
for _ in range(2):
  jax.block_until_ready(f(x, w))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
  jax.block_until_ready(f(x, w))
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3)
"""


@pytest.mark.slow
@needs_huge_pages
def test_huge_pages_remove_the_page_faults_of_xlas_fresh_temporaries():
  faults = {}
  for name, tunables in (("default", ""), ("huge", platform.HUGE_PAGES_TUNABLE)):
    proc = subprocess.run([sys.executable, "-c", _FAULTS], cwd=ROOT, timeout=300, check=True,
                          env=_environ(GLIBC_TUNABLES=tunables), capture_output=True, text=True)
    faults[name] = float(proc.stdout.split()[-1])
  # 4-KiB pages: a fault per page of the 128 MiB temporary (32,768) at every call ...
  assert faults["default"] > 0.5 * 128 * 256, faults
  # ... and with 2-MiB pages, 64 per call at most.
  assert faults["huge"] < 0.1 * faults["default"], faults


def test_distributed_needs_the_process_count_and_index():
  with pytest.raises(ValueError, match="--coordinator_address needs --num_processes and "
                     "--process_id"):
    pod.initialize_distributed("localhost:1234", num_processes=2)


@pytest.mark.parametrize("accelerator,hosts,multi", [
    ("v3-8", "", False), ("v3-32", "", True), ("v4-8", "", False), ("v4-16", "", True),
    ("v5litepod-8", "", False), ("v5litepod-16", "", True), ("", "", False),
    ("", "10.0.0.1,10.0.0.2", True)])
def test_multi_host_tpu_detection(monkeypatch, accelerator, hosts, multi):
  """jax.distributed starts by itself only on a TPU slice with several hosts."""
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator)
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", hosts)
  assert pod._on_multi_host_tpu() == multi  # pylint: disable=protected-access


def test_errors_that_c_code_cannot_raise_go_to_the_debug_log(capsys):
  """What tensorstore's threads report after a failed save or restore (`PyErr_WriteUnraisable`
  without an object) is logged at DEBUG; an object's unraisable error reaches the previous hook."""
  import types  # pylint: disable=g-import-not-at-top
  seen = []
  hook = platform.quiet_unraisable_hook(seen.append)
  try:
    raise RuntimeError("Event loop is closed")
  except RuntimeError as e:
    error = e
  unraisable = types.SimpleNamespace(exc_type=RuntimeError, exc_value=error,
                                     exc_traceback=error.__traceback__, err_msg=None, object=None)
  hook(unraisable)
  assert seen == [] and capsys.readouterr().err == ""
  of_an_object = types.SimpleNamespace(**dict(vars(unraisable), object=object()))
  hook(of_an_object)
  assert seen == [of_an_object]


def test_sigterm_and_a_first_ctrl_c_set_the_stop_notice_and_a_second_ctrl_c_interrupts():
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  with stops.stop_notice() as notice:
    notice.training()  # The first step is done (before: see the set-up's stop below).
    assert not notice.is_set()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # The handler runs in this (the main) thread, between bytecodes.
    assert notice.is_set() and notice.signal == "SIGINT"
    os.kill(os.getpid(), signal.SIGTERM)  # A later SIGTERM does not rename the first notice.
    time.sleep(0.05)
    assert notice.signal == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
  with stops.stop_notice() as notice:
    notice.training()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert notice.is_set() and notice.signal == "SIGTERM"


# ------------------------------------------------------------------ stops and pod faults


def test_distributed_timeouts_put_jax_s_abort_after_vit_jax_s_fatal_line():
  """The bound reaches jax.distributed (each keyword only where this jax accepts it: 0.10.2
  accepts all three), registration and heartbeat later than vit_jax's own deadline and watch."""
  assert pod._distributed_timeouts(60) == {  # pylint: disable=protected-access
      "initialization_timeout": 70, "heartbeat_timeout_seconds": 90,
      "shutdown_timeout_seconds": 60}


def test_a_stop_in_the_set_up_waits_for_a_deferred_section_then_is_raised():
  with stops.stop_notice() as notice:
    with pytest.raises(stops.StopRequested) as stop:
      with stops.deferred_stop():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # Python runs the handler between bytecodes: here, deferred.
          time.sleep(0)
        finished = True
    assert finished and stop.value.exit_code == 75 and stop.value.signal == "SIGTERM"
    with pytest.raises(stops.StopRequested) as stop:
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(1000):
        time.sleep(0)
    assert stop.value.exit_code == 130
    assert str(stop.value).startswith("Interrupted (Ctrl-C) during the set-up")
    assert not notice.is_set()


class _ExtensionLoader(importlib.machinery.ExtensionFileLoader):
  """Runs Python during its module's initialisation, as jaxlib's MLIR bindings do (an exception
  raised there aborts the process: SIGABRT, not exit 75)."""

  def create_module(self, spec):
    return None

  def exec_module(self, module):
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # The handler runs here: it must not raise.
      time.sleep(0)
    module.initialised = True


def test_a_stop_during_an_extension_modules_initialisation_is_raised_just_after_it():
  spec = importlib.util.spec_from_loader(
      "_extension", _ExtensionLoader("_extension", "/nonexistent/_extension.so"))
  module = importlib.util.module_from_spec(spec)
  with stops.stop_notice():
    with pytest.raises(stops.StopRequested) as stop:
      spec.loader.exec_module(module)
      assert module.initialised
      start = time.monotonic()
      for _ in range(100):
        time.sleep(0.01)
    assert time.monotonic() - start < 0.5 and stop.value.exit_code == 75


_SECOND_COPY_DURING_THE_EXIT = """
import os, signal, time
from vit_jax import stops
stops.stop_at_once_on_signals()
def announce(stop):  # Then fails, as when the coordinator of a pod is already gone.
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(0.5)
  raise RuntimeError("UNAVAILABLE: recvmsg:Connection reset by peer")
stops.announce_stops_with(announce)
try:
  with stops.deferred_stop():  # A stop raised at a section's end forgets its signal,
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
except stops.StopRequested as stop:
  stops.exit_stopped(stop)  # so the copy a supervisor passes on arrives in the exit's announce.
"""


def test_a_second_copy_of_the_signal_during_the_exit_does_not_raise_in_it():
  """A pod's supervisor passes SIGTERM on while its child already exits for the first copy, and
  the announcement fails: exit 75 with the set-up line, no traceback (was: StopRequested raised
  inside `exit_stopped`, then jax's atexit shutdown aborted the process; the failed announcement
  printed its thread's traceback)."""
  proc = subprocess.run([sys.executable, "-c", _SECOND_COPY_DURING_THE_EXIT], cwd=ROOT,
                        env=_environ(), capture_output=True, text=True, timeout=60)
  assert proc.returncode == 75, proc.stderr[-3000:]
  assert proc.stderr.splitlines()[-1].startswith("Preempted (SIGTERM) during the set-up")
  assert "Traceback" not in proc.stderr


_EXIT_WHILE_ANOTHER_THREAD_LOGS = """
import threading, time
from absl import logging
from vit_jax import stops
logging.use_absl_handler()
def log_forever():
  line = 0
  while True:
    line += 1
    logging.warning("a log line of the main thread, %d\\ngroup  layer  tensors", line)
threading.Thread(target=log_forever, daemon=True).start()
time.sleep(0.3)
stops.exit_process(75, "Process 0 of 2: process 1 stopped.")
"""


def test_no_other_threads_log_line_follows_the_exit_message():
  """A pod's watcher thread ends the process while the main thread logs: the exit's message is
  the last line (was: a log line of the main thread, even a table, could follow it)."""
  for _ in range(8):  # A race: each run could show it.
    proc = subprocess.run([sys.executable, "-c", _EXIT_WHILE_ANOTHER_THREAD_LOGS], cwd=ROOT,
                          env=_environ(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "a log line of the main thread, 1\n" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "Process 0 of 2: process 1 stopped.", (
        proc.stderr[-500:])


def test_stop_in_finds_a_stop_that_a_library_wrapped():
  stop = stops.StopRequested("SIGTERM")
  try:
    try:
      raise stop
    except stops.StopRequested as e:
      raise RuntimeError("Error calling __set_name__ on 'Field' instance") from e
  except RuntimeError as wrapped:
    assert stops.stop_in(wrapped) is stop
  assert stops.stop_in(ValueError("x")) is None


def _fake_host(root, vendors=(), accel=False):
  for i, vendor in enumerate(vendors):
    device = root / "sys" / "bus" / "pci" / "devices" / f"0000:00:0{i}.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
  if accel:
    (root / "dev").mkdir(parents=True)
    (root / "dev" / "accel0").write_text("")
  return str(root)


def test_jax_skips_the_tpu_only_where_there_is_none_and_nothing_else_asks_for_it(
    tmp_path, monkeypatch):
  """`hardware.tpu_absent`: no Google PCI device (0x1ae0) nor /dev/accel0, no other JAX plugin,
  JAX_PLATFORMS and JAX_FORCE_TPU_INIT unset; with or without libtpu (without it JAX still
  tries the TPU and logs "Unable to initialize backend 'tpu' ... Failed to open libtpu.so")."""
  from importlib import util  # pylint: disable=g-import-not-at-top
  from vit_jax import hardware  # pylint: disable=g-import-not-at-top
  find_spec = util.find_spec
  monkeypatch.setattr(util, "find_spec", lambda name: (
      object() if name == "libtpu" else find_spec(name)))
  cpu_only = _fake_host(tmp_path / "cpu", vendors=("0x8086", "0x10de"))
  assert hardware.tpu_absent({}, root=cpu_only)
  assert not hardware.tpu_absent({"JAX_PLATFORMS": "tpu"}, root=cpu_only)
  assert not hardware.tpu_absent({"JAX_FORCE_TPU_INIT": "1"}, root=cpu_only)
  assert hardware.tpu_on_host(_fake_host(tmp_path / "tpu_vm", vendors=("0x8086", "0x1ae0")))
  assert not hardware.tpu_absent({}, root=str(tmp_path / "tpu_vm"))
  assert not hardware.tpu_absent({}, root=_fake_host(tmp_path / "accel", accel=True))
  npu = tmp_path / "npu" / "dev" / "accel"  # Linux's accel subsystem (an NPU): not a TPU.
  npu.mkdir(parents=True)
  (npu / "accel0").write_text("")
  assert hardware.tpu_absent({}, root=str(tmp_path / "npu"))
  monkeypatch.setattr(util, "find_spec", lambda name: None)  # No libtpu, no jax_plugins.
  assert hardware.tpu_absent({}, root=cpu_only)
  assert not hardware.tpu_absent({}, root=str(tmp_path / "tpu_vm"))


def test_import_vit_jax_keeps_jax_off_an_absent_tpu_and_quiet():
  """After `pip install -e '.[tpu]'` on a host without a TPU, JAX's first use printed a page of
  libtpu errors; `import vit_jax` (before or after `import jax`) now keeps JAX on the CPU."""
  from vit_jax import hardware  # pylint: disable=g-import-not-at-top
  if not hardware.tpu_absent({}):
    pytest.skip("libtpu is not installed or this host has a TPU or another accelerator plugin")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  for code in ("import vit_jax, jax; print(jax.devices()[0].platform)",
               "import jax, vit_jax; print(jax.devices()[0].platform)"):
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert proc.stdout == "cpu\n" and proc.stderr == "", (code, proc.stderr[-2000:])


def test_the_metric_dicts_of_clu_s_logging_writer_are_logged_only_at_verbosity_1():
  """TensorBoard has them; the progress and evaluation lines say what they would (each once)."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top

  def record(path, level=py_logging.INFO):
    return py_logging.LogRecord("absl", level, path, 48, "[%d] %s", (100, "train/loss=2.1"), None)

  import clu  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint  # pylint: disable=g-import-not-at-top
  clu_dir = os.path.dirname(clu.__file__)
  writer = os.path.join(clu_dir, "metric_writers", "logging_writer.py")
  quiet = platform.QuietLibraries()
  absl_logger = py_logging.getLogger("absl")
  verbosity, level = absl_logging.get_verbosity(), absl_logger.level
  try:
    absl_logging.set_verbosity(absl_logging.INFO)
    assert not quiet.filter(record(writer))
    assert quiet.filter(record(writer, py_logging.WARNING))
    assert quiet.filter(record(os.path.join(clu_dir, "periodic_actions.py")))
    assert quiet.filter(record(platform.__file__))
    assert not quiet.filter(record(orbax.checkpoint.__file__))
    # A checkout named vit_jax with its venv inside: the libraries there are not vit_jax's (was:
    # every Orbax and JAX INFO line kept).
    assert not quiet.filter(record("/tmp/vit_jax/.venv/lib/python3.11/site-packages/orbax/"
                                   "checkpoint/checkpoint_manager.py"))
    absl_logging.set_verbosity(1)
    assert quiet.filter(record(writer))
  finally:
    absl_logging.set_verbosity(verbosity)
    absl_logger.setLevel(level)  # set_verbosity sets a level; the logger's was NOTSET.


def test_host_cpu_names_the_model_and_the_usable_cores(tmp_path):
  from vit_jax import hardware  # pylint: disable=g-import-not-at-top
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: avx\n")
  cores = len(os.sched_getaffinity(0))
  assert hardware.host_cpu(str(cpuinfo)) == f"AMD EPYC 9B14, {cores} cores"
  assert hardware.host_cpu(str(tmp_path / "missing")).endswith(f", {cores} cores")
