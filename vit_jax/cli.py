"""Command-line helpers shared by `vit_jax.main`, `vit_jax.cost` and `vit_jax.benchmark`: flag
parsing with clear errors for a config file or a `--config.<key>` override that is wrong, quiet
library logs, and glibc's malloc set to back large allocations with huge pages."""

from __future__ import annotations

import difflib
import importlib.util
import logging as py_logging
import os
import sys

from absl import flags
from absl import logging


def load_config_file(spec: str):
  """Imports `path[:arg]` the way --config does and returns its get_config(arg)."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_vit_jax_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def unknown_override_message(argv: list[str]) -> str | None:
  """Names the first `--config.<key>` in `argv` that the config file does not define.

  Returns:
    A message naming the key, the valid keys at that level and the closest match, or None if
    every override names an existing key (or the config file itself cannot be loaded).
  """
  spec = config_spec(argv)
  if spec is None:
    return None
  try:
    config = load_config_file(spec)
  except Exception:  # pylint: disable=broad-except
    return None  # Let the flag parser report the real problem with the file.
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config."):].split("=", 1)[0]
    node, keys = config, path.split(".")
    for depth, key in enumerate(keys):
      children = list(node.keys()) if hasattr(node, "keys") else []
      if key not in children:
        where = ".".join(keys[:depth]) or "the top level"
        close = difflib.get_close_matches(key, children, n=1)
        hint = f" Did you mean '{'.'.join(keys[:depth] + close)}'?" if close else ""
        return (f"Unknown config key '{path}' in '{arg}': the config {spec} has no '{key}' at "
                f"{where}. Keys there: {', '.join(sorted(children))}.{hint}")
      node = node[key]
  return None


def _without_traceback(message: str) -> str:
  """ml_collections puts the config file's traceback in its flag error: keep the first line
  (which flag) and the exception's own line (what is wrong)."""
  if "Traceback (most recent call last)" not in message:
    return message
  head = message.split("Traceback (most recent call last)")[0].strip()
  last = [line for line in message.splitlines() if line.strip()][-1]
  return f"{head} {last}"


def config_spec(argv: list[str]) -> str | None:
  """The `path[:arg]` of `--config` in `argv`, or None."""
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if spec is None and "--config" in argv[:-1]:
    spec = argv[argv.index("--config") + 1]
  return spec


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a clear message for a missing config file or a mistyped
  `--config.<key>` (instead of ml_collections' traceback)."""
  spec = config_spec(argv)
  path = spec.partition(":")[0] if spec else None
  if path and not os.path.isfile(path):
    here = sorted(p for p in os.listdir("configs") if p.endswith(".py")) if os.path.isdir(
        "configs") else []
    known = f" The configs here: {', '.join('configs/' + p for p in here)}." if here else ""
    sys.stderr.write(f"FATAL: The config file {path!r} (--config={spec}) does not exist.{known}\n")
    sys.exit(2)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    message = unknown_override_message(argv) or _without_traceback(str(e))
  except (AttributeError, KeyError) as e:  # ml_collections' error for an unknown key.
    message = unknown_override_message(argv) or f"Bad --config override: {e}"
  except (ValueError, TypeError) as e:  # The config file's get_config(arg) refused its arg.
    message = unknown_override_message(argv) or f"Bad --config: {e}"
  sys.stderr.write(f"FATAL: {message}\nPass --help to see the flags.\n")
  sys.exit(2)


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

  Why: XLA:CPU allocates a step's temporary buffers (e.g. 664 MiB for the ViT-Ti/16 training
  step at batch 32) afresh at every execution, and glibc serves allocations over 32 MiB with a
  new `mmap`, so every step first-touches all of it: 173,000 4-KiB page faults per step, about
  a tenth of the step on a 2-core CPU. With `HUGE_PAGES_TUNABLE` glibc advises `MADV_HUGEPAGE`
  on those mappings and the kernel maps 2-MiB pages instead: under 400 faults per step (README
  "Benchmarks"). glibc reads `GLIBC_TUNABLES` only when a process starts, hence the re-exec.

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
  """Keeps INFO lines of vit_jax and clu (progress, metrics); other libraries' from WARNING.

  orbax and jax log every checkpoint's internals at INFO; run with --verbosity=1 to see them.
  """

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING or logging.get_verbosity() >= 1:
      return True
    path = record.pathname.replace(os.sep, "/")
    return "/vit_jax/" in path or "/clu/" in path
