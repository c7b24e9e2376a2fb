"""Host set-up, done once before any work: huge pages, multi-process JAX, TensorFlow kept off the
accelerators, quiet library logs.

`python -m vit_jax.main` and the tools call, in order:
  1. `reexec_with_huge_pages()` first thing in `__main__` (glibc reads its tunables only at
     process start, so it re-executes the same command line once);
  2. `setup(...)`: log filters, `jax.distributed` for multi-process runs, TensorFlow's view of
     the accelerators hidden (tf.data must never grab a GPU/TPU that belongs to JAX).
The training loop holds `stop_notice()` while it runs: a preemption notice (SIGTERM) or a first
Ctrl-C (SIGINT) becomes an event that the loop checks at every step.

Huge pages: XLA:CPU allocates a step's temporary buffers afresh at every execution, and glibc
serves allocations over 32 MiB with a new `mmap`, so every step first-touches all of them, one
page fault per 4 KiB. With `HUGE_PAGES_TUNABLE` glibc advises `MADV_HUGEPAGE` on its mappings and
the kernel maps 2-MiB pages instead (docs/benchmarks.md has the measurements).
`VIT_JAX_HUGE_PAGES=0` turns it off; a `glibc.malloc.hugetlb` already in `GLIBC_TUNABLES` is
kept; a library user exports `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` before starting Python.
"""

from __future__ import annotations

import contextlib
import logging as py_logging
import os
import re
import signal
import sys
import threading
from typing import Optional

from absl import logging


#: The glibc tunable that makes malloc advise transparent huge pages (`MADV_HUGEPAGE`) for the
#: memory it maps (glibc >= 2.35). See `huge_pages_environment`.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
#: Set to 0 (or false, no, off) to run without `HUGE_PAGES_TUNABLE` (the entry points then never
#: re-execute); unset, empty, 1, true, yes or on: the default, with it.
HUGE_PAGES_SWITCH = "VIT_JAX_HUGE_PAGES"
_SWITCH_OFF, _SWITCH_ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_version() -> tuple[int, ...] | None:
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # e.g. "glibc 2.36"
    return tuple(int(p) for p in version.split(".")[:2]) if name == "glibc" else None
  except (AttributeError, ValueError, OSError):
    return None


def _thp_mode() -> str | None:
  """The kernel's transparent huge page mode ('always', 'madvise' or 'never'), or None."""
  try:
    with open(_THP_MODE_FILE, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return None
  chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
  return chosen[0] if chosen else None


def huge_pages_environment(environ=None, glibc=None, thp_mode=None) -> dict[str, str] | None:
  """The environment to re-execute with so that malloc backs large allocations with huge pages.

  Why: see the module docstring. glibc reads `GLIBC_TUNABLES` only when a process starts,
  hence the re-exec.

  Args:
    environ: the current environment (default `os.environ`).
    glibc: glibc's `(major, minor)`; `()` for another C library (default: this process's).
    thp_mode: the kernel's transparent huge page mode, '' for none (default: read from sysfs).

  Returns:
    The new environment (`GLIBC_TUNABLES` with `HUGE_PAGES_TUNABLE` appended), or None when
    there is nothing to do: `VIT_JAX_HUGE_PAGES=0`, a `glibc.malloc.hugetlb` already in
    `GLIBC_TUNABLES` (the user's own choice is kept), no glibc >= 2.35, or huge pages 'never'.

  Raises:
    ValueError: `VIT_JAX_HUGE_PAGES` is neither on (1, true, yes, on) nor off (0, false, no, off).
  """
  environ = os.environ if environ is None else environ
  switch = environ.get(HUGE_PAGES_SWITCH, "").strip().lower()
  if switch not in _SWITCH_OFF + _SWITCH_ON:
    raise ValueError(f"{HUGE_PAGES_SWITCH}={environ[HUGE_PAGES_SWITCH]!r} is neither on (1, true, "
                     "yes, on) nor off (0, false, no, off); set one of those or unset it.")
  if switch in _SWITCH_OFF:
    return None
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in tunables:
    return None
  glibc = (_glibc_version() or ()) if glibc is None else tuple(glibc)
  thp_mode = (_thp_mode() or "") if thp_mode is None else thp_mode
  if not glibc or glibc < (2, 35) or thp_mode not in ("always", "madvise"):
    return None
  return dict(environ, GLIBC_TUNABLES=":".join(t for t in (tunables, HUGE_PAGES_TUNABLE) if t))


def reexec_with_huge_pages() -> None:
  """Replaces this process by the same command under `huge_pages_environment`, if it has one.

  Call it first thing in a program's `if __name__ == "__main__":` block (it re-runs the whole
  command line, `sys.orig_argv`, with the same interpreter and process id). Returns without
  doing anything when `huge_pages_environment` returns None, so the re-executed process goes on.
  Exits with status 2 and a one-line message if `VIT_JAX_HUGE_PAGES` has a value it cannot read.
  """
  try:
    env = huge_pages_environment()
  except ValueError as e:
    sys.stderr.write(f"FATAL: {e}\n")
    sys.exit(2)
  if env is None or not getattr(sys, "orig_argv", None):
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


class QuietLibraries(py_logging.Filter):
  """Keeps INFO lines of vit_jax and clu (progress, metrics); other libraries' from WARNING, as
  one line each, without their tracebacks.

  orbax and jax log every checkpoint's internals at INFO, and a failed save (e.g. a full disk)
  as an error with a traceback from each of its threads, before vit_jax reports the failure as
  one `FATAL:` line; run with --verbosity=1 to see all of it.
  """

  def filter(self, record: py_logging.LogRecord) -> bool:
    if logging.get_verbosity() >= 1:
      return True
    path = record.pathname.replace(os.sep, "/")
    ours = "/vit_jax/" in path or "/clu/" in path
    if ours:
      return True
    if record.levelno < py_logging.WARNING:
      return False
    if record.exc_info or "\n" in str(record.msg):
      message = record.getMessage().splitlines()
      record.msg, record.args = (message[0][:300] if message else ""), None
      record.exc_info, record.exc_text = None, None
    return True


def quiet_unraisable_hook(previous=None):
  """A `sys.unraisablehook` that logs at DEBUG, instead of printing, the errors that C code
  reports without a Python object (all of them printed with --verbosity=1).

  Libraries' C++ threads report a Python error they cannot raise through
  `PyErr_WriteUnraisable(NULL)`: e.g. tensorstore, when a checkpoint save or restore fails (a full
  disk, a damaged file), prints a bare `RuntimeError: Event loop is closed` traceback for each of
  its pending callbacks after orbax has closed its event loop, before vit_jax reports the failure
  as one `FATAL:` line. Unraisable errors of Python objects (a failing `__del__`) go to
  `previous` (default: the current hook) unchanged.
  """
  previous = previous or sys.unraisablehook

  def hook(unraisable):
    if unraisable.object is not None or logging.get_verbosity() >= 1:
      return previous(unraisable)
    import traceback  # pylint: disable=g-import-not-at-top
    logging.debug("A library reported an error it could not raise:\n%s", "".join(
        traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                   unraisable.exc_traceback)))
    return None

  return hook


def _on_multi_host_tpu() -> bool:
  """A Cloud TPU VM that is one worker of several (before any JAX backend starts)."""
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if "," in hosts:
    return True
  accelerator = os.environ.get("TPU_ACCELERATOR_TYPE", "")  # e.g. 'v3-32'
  match = re.fullmatch(r"v\d+[a-z]*-(\d+)", accelerator)
  # The number counts TensorCores (v2-v5p) or chips (v5e, v6e); one host has at most 8.
  return bool(match) and int(match.group(1)) > 8


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> None:
  """Calls `jax.distributed.initialize` when this is one process of several.

  Explicit: the arguments (main's --coordinator_address/--num_processes/--process_id) or the
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID environment variables (CPU and GPU
  clusters; on CPU the cross-process collectives use gloo). Automatic: a multi-host Cloud TPU
  slice (its metadata names several workers). A single process does nothing.

  Raises:
    ValueError: a coordinator address without the process count or index.
  """
  import jax  # pylint: disable=g-import-not-at-top
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    num = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None
    pid = process_id if process_id is not None else (
        int(os.environ["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in os.environ else None)
    if num is None or pid is None:
      raise ValueError("--coordinator_address needs --num_processes and --process_id (or "
                       "JAX_NUM_PROCESSES and JAX_PROCESS_ID).")
    if (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "").startswith("cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
  elif _on_multi_host_tpu():
    jax.distributed.initialize()  # Finds the coordinator and the workers from the TPU metadata.
  if jax.process_count() > 1:
    logging.info("Process %d of %d; %d local of %d devices.", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())


#: PCI vendor id of Google's TPU chips (what JAX itself looks for in /sys/bus/pci/devices).
_GOOGLE_PCI_VENDOR = "0x1ae0"


def _has_tpu_chips() -> bool:
  import glob  # pylint: disable=g-import-not-at-top
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def skip_absent_tpu() -> None:
  """Keeps JAX from starting a TPU backend on a host without TPU chips.

  With libtpu installed (the `tpu` extra, for `python -m vit_jax.preflight`) JAX tries the TPU
  backend on any host, and on one without TPU chips libtpu prints a page of errors before JAX
  falls back to the CPU. Here JAX is told to use the CPU instead, unless `JAX_PLATFORMS` /
  `jax_platforms` was chosen, TPU chips are on the PCI bus, or a GPU plugin is installed.
  """
  import importlib.util  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  if jax.config.jax_platforms or importlib.util.find_spec("libtpu") is None:
    return
  gpu_plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                 "jax_rocm7_plugin")
  if _has_tpu_chips() or any(importlib.util.find_spec(p) for p in gpu_plugins):
    return
  jax.config.update("jax_platforms", "cpu")


def hide_accelerators_from_tensorflow() -> None:
  """Makes TensorFlow (tf.data, tfds) see no GPU or TPU, so it never allocates on one that
  belongs to JAX. Does nothing if TensorFlow is not installed or already initialised."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  for kind in ("GPU", "TPU"):
    try:
      tf.config.set_visible_devices([], kind)
    except (RuntimeError, ValueError):  # Already initialized / unknown kind.
      pass


def setup(*, coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
          process_id: Optional[int] = None) -> None:
  """The set-up of a program that trains or compiles: log filters (and the errors libraries'
  C++ threads cannot raise at DEBUG: `quiet_unraisable_hook`), no TPU backend on a host
  without TPU chips (`skip_absent_tpu`), multi-process JAX (`initialize_distributed` with these
  arguments), TensorFlow off the accelerators, and a log line when the huge-pages tunable is
  active.

  Raises:
    ValueError: as `initialize_distributed`.
  """
  logging.get_absl_handler().addFilter(QuietLibraries())
  sys.unraisablehook = quiet_unraisable_hook()
  if HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
    logging.info("malloc: transparent huge pages for large allocations (GLIBC_TUNABLES=%s).",
                 os.environ["GLIBC_TUNABLES"])
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's C++ INFO lines.
  skip_absent_tpu()
  hide_accelerators_from_tensorflow()
  initialize_distributed(coordinator_address, num_processes, process_id)


class StopNotice(threading.Event):
  """An event that SIGTERM or a first Ctrl-C sets; `signal` names which ('SIGTERM', 'SIGINT')."""

  def __init__(self):
    super().__init__()
    self.signal: Optional[str] = None

  def notify(self, name: str) -> None:
    """Sets the event, naming `name` ('SIGTERM' or 'SIGINT') as its cause unless already set
    (the first signal names it)."""
    if not self.is_set():
      self.signal = name
      self.set()


@contextlib.contextmanager
def stop_notice():
  """Yields a `StopNotice` that SIGTERM (a preemption notice) and a first Ctrl-C set; the
  previous handlers are restored after.

  The first Ctrl-C logs that the run saves its current step and stops, and makes a second one
  raise `KeyboardInterrupt` at once (Python's default). Only in a single-process run on the
  main thread: with several processes jax's preemption service handles SIGTERM and
  `Checkpoints.reached_preemption` reports it, and Ctrl-C keeps its default (a save needs every
  host).
  """
  import jax  # pylint: disable=g-import-not-at-top  (not at import: --help stays fast)
  notice = StopNotice()
  if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
    yield notice
    return

  def on_interrupt(*_):
    logging.warning("Ctrl-C: saving the current step, then stopping; Ctrl-C again stops at once "
                    "(a rerun then resumes from the latest checkpoint).")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    notice.notify("SIGINT")

  previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  signal.signal(signal.SIGTERM, lambda *_: notice.notify("SIGTERM"))
  signal.signal(signal.SIGINT, on_interrupt)
  try:
    yield notice
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
