"""Host set-up before any work: huge pages for XLA:CPU's step buffers (docs/benchmarks.md),
multi-process JAX, TensorFlow kept off the accelerators, quiet library logs. Imports neither JAX
nor TensorFlow: :func:`reexec_with_huge_pages` and ``quiet_native_logs`` run before they load."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging as py_logging
import os
import re
import sys
import tempfile
import traceback
from typing import Optional

from absl import logging

import vit_jax
from vit_jax import pod
from vit_jax import stops

#: Makes malloc advise transparent huge pages for the memory it maps (glibc >= 2.35).
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
#: 0 (false, no, off): run without `HUGE_PAGES_TUNABLE`; unset, 1 (true, yes, on): with it.
HUGE_PAGES_SWITCH = "VIT_JAX_HUGE_PAGES"
_SWITCH_OFF = ("0", "false", "no", "off")
_SWITCH_ON = ("", "1", "true", "yes", "on")
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
#: What TensorFlow 2.21's C++ writes to stderr while it loads, whatever TF_CPP_MIN_LOG_LEVEL says.
_TF_BANNERS = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called|"
                         r"\] oneDNN custom operations are on|"
                         r"\] This TensorFlow binary is optimized|"
                         r"^To enable the following instructions: .*rebuild TensorFlow")
#: The cgroup v2 and v1 (memory limit, memory usage) files.
_CGROUP_FILES = (('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory.current'),
                 ('/sys/fs/cgroup/memory/memory.limit_in_bytes',
                  '/sys/fs/cgroup/memory/memory.usage_in_bytes'))


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
  return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


def huge_pages_environment(environ=None, glibc=None, thp_mode=None) -> dict[str, str] | None:
  """The environment to re-execute with for huge pages, or None (switched off, a hugetlb tunable
  already set, glibc < 2.35 or THP 'never'); ``glibc`` and ``thp_mode`` default to this host's.
  ValueError: an unreadable switch."""
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
  """Re-executes ``sys.orig_argv`` (same pid) under :func:`huge_pages_environment` if it has one;
  exits 2 with one line for an unreadable ``VIT_JAX_HUGE_PAGES``."""
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


@functools.lru_cache(maxsize=None)
def _real(path: str) -> str:
  return os.path.realpath(path)


def _package_dir(name: str) -> Optional[str]:
  """The installed package `name`'s directory (resolved, with a trailing separator), or None."""
  spec = importlib.util.find_spec(name)
  locations = list(spec.submodule_search_locations or ()) if spec else []
  return os.path.join(_real(locations[0]), "") if locations else None


class QuietLibraries(py_logging.Filter):
  """Keeps the INFO lines of vit_jax's and clu's own files (not clu's `LoggingWriter` metric
  dicts), others' from WARNING as one line; --verbosity=1: all. A file is a package's by the
  installed package's directory, not by a name in its path (a checkout named vit_jax holds its
  venv's libraries)."""

  def __init__(self):
    super().__init__()
    self._kept = tuple(d for d in map(_package_dir, ("vit_jax", "clu")) if d)
    clu = _package_dir("clu")
    self._metric_dicts = clu and os.path.join(clu, "metric_writers", "logging_writer.py")

  def filter(self, record: py_logging.LogRecord) -> bool:
    if logging.get_verbosity() >= 1:
      return True
    path = _real(record.pathname)
    if path == self._metric_dicts:
      return record.levelno >= py_logging.WARNING
    if path.startswith(self._kept):
      return True
    if record.levelno < py_logging.WARNING:
      return False
    if record.exc_info or "\n" in str(record.msg):
      message = record.getMessage().splitlines()
      record.msg = message[0][:300] if message else ""
      record.args = None
      record.exc_info = None
      record.exc_text = None
    return True


def quiet_unraisable_hook(previous=None):
  """A ``sys.unraisablehook`` logging at DEBUG the errors C code reports without a Python object
  (tensorstore's after a failed save); others go to ``previous`` (default: the current hook)."""
  previous = previous or sys.unraisablehook

  def hook(unraisable):
    if unraisable.object is not None or logging.get_verbosity() >= 1:
      return previous(unraisable)
    logging.debug("A library reported an error it could not raise:\n%s", "".join(
        traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                   unraisable.exc_traceback)))
    return None

  return hook


@contextlib.contextmanager
def _without_tensorflow_banners():
  """Passes on what is written to file descriptor 2 meanwhile, except `_TF_BANNERS`."""
  if logging.get_verbosity() >= 1 or "tensorflow" in sys.modules:
    yield
    return
  sys.stderr.flush()
  with tempfile.TemporaryFile() as captured:
    stops.stderr_fd = os.dup(2)
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(stops.stderr_fd, 2)
      os.close(stops.stderr_fd)
      stops.stderr_fd = 2
      captured.seek(0)
      lines = captured.read().decode(errors="replace").splitlines(keepends=True)
      sys.stderr.write("".join(l for l in lines if not _TF_BANNERS.search(l)))
      sys.stderr.flush()


def hide_accelerators_from_tensorflow() -> None:
  """Makes TensorFlow (if installed, not yet initialised) see no GPU or TPU; imports it quietly."""
  try:
    with _without_tensorflow_banners():
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  for kind in ("GPU", "TPU"):
    try:
      tf.config.set_visible_devices([], kind)
    except (RuntimeError, ValueError):  # Already initialized / unknown kind.
      pass


def quiet_native_logs(argv: Optional[list[str]] = None) -> None:
  """``TF_CPP_MIN_LOG_LEVEL=2`` unless set (1 with ``--verbosity``/``-v`` in ``argv``, default
  ``sys.argv``): hides TensorFlow's and XLA's C++ INFO lines. Call it before JAX loads."""
  argv = sys.argv if argv is None else argv
  verbose = any(re.match(r"--?(verbosity|v)(=|$)", a) for a in argv[1:])
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1" if verbose else "2")


def setup(*, coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
          process_id: Optional[int] = None,
          distributed_timeout_s: int = pod.DISTRIBUTED_TIMEOUT_S) -> None:
  """Set-up of a program that trains or compiles; raises ``pod.initialize_distributed``'s errors."""
  vit_jax.gcs_retries()  # A bad GCS_RETRY_CONFIG_* now, not at the first save.
  logging.get_absl_handler().addFilter(QuietLibraries())
  sys.unraisablehook = quiet_unraisable_hook()
  if HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
    logging.info("malloc: transparent huge pages for large allocations (GLIBC_TUNABLES=%s).",
                 os.environ["GLIBC_TUNABLES"])
  quiet_native_logs()
  vit_jax.skip_absent_tpu()
  hide_accelerators_from_tensorflow()
  pod.initialize_distributed(coordinator_address, num_processes, process_id, distributed_timeout_s)


def _read_int(path: str) -> Optional[int]:
  try:
    with open(path) as f:
      return int(f.read().strip())  # 'max': no limit (ValueError).
  except (OSError, ValueError):
    return None


def host_memory_bytes() -> Optional[int]:
  """This host's RAM in bytes, or the cgroup memory limit when lower; None if unknown."""
  try:
    total = os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
  except (ValueError, OSError, AttributeError):
    total = None
  limits = (_read_int(limit) for limit, _ in _CGROUP_FILES)
  return min((v for v in (total, *limits) if v is not None), default=None)


def available_memory_bytes() -> Optional[int]:
  """Bytes this process can take: MemAvailable (or free pages) within the cgroup's, else None."""
  try:
    with open('/proc/meminfo') as f:  # In kB.
      available = next((int(l.split()[1]) * 1024 for l in f if l.startswith('MemAvailable:')), None)
  except (OSError, ValueError, IndexError):
    available = None
  if available is None:
    try:
      available = os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
    except (ValueError, OSError, AttributeError):
      pass
  files = [(_read_int(limit), _read_int(usage)) for limit, usage in _CGROUP_FILES]
  left = [max(l - u, 0) for l, u in files if l is not None and u is not None]
  return min((v for v in (available, *left) if v is not None), default=None)
