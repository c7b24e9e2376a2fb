"""What every part of the benchmark shares: modes, units, errors, timing helpers (no JAX or
torch: the command line checks its input before any backend starts)."""

from __future__ import annotations

import itertools
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Optional

from vit_jax.tools import common as tools_common


MODES = ("train", "inference")
DTYPES = ("float32", "bfloat16")

UNITS = {
    "images_per_sec": "images/s (batch / median step time)",
    "step_seconds": "s (median of the timed steps)",
    "step_seconds_all": "s (every timed step)",
    "lower_seconds": "s (jax.jit(...).lower)", "compile_seconds": "s (.compile())",
    "first_step_seconds": "s (first execution after compiling; timm: first eager step)",
    "peak_rss_mib": "MiB (ru_maxrss of the measuring process)",
    "rss_after_imports_mib": "MiB (VmRSS before the model is built)",
    "device_peak_mib": "MiB (peak_bytes_in_use of device 0; None on CPU)",
    "flops_per_step_xla": "FLOPs (XLA cost analysis of the compiled step)",
    "flops_per_step_analytic": "FLOPs (2 x forward MACs x batch, x3 for training)",
    "achieved_flops_per_sec": "FLOP/s (analytic FLOPs / median step time)",
    "fraction_of_peak": "0..1 (achieved / peak_flops_per_device)",
    "peak_flops_per_device": "FLOP/s",
}


def worker_environment(env: Optional[dict[str, str]] = None) -> dict[str, str]:
  """A copy of `env` (default: os.environ) with the repository root first on PYTHONPATH: the
  measuring processes (`python -m benchmarks ...`) import this checkout's benchmarks/ and
  vit_jax/ whatever their working directory (benchmarks/ is not installed)."""
  env = dict(os.environ if env is None else env)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  return env


class BenchmarkError(ValueError):
  """Bad input: one FATAL line, exit status 2."""


class NoTimmModel(BenchmarkError):
  """The model has no timm equivalent."""


class MeasurementFailed(tools_common.WorkFailed):
  """A measuring subprocess failed (e.g. out of memory): exit status 1."""


def check_sizes(batch: int, resolution: int, warmup: int, steps: int, mode: str = MODES[0],
                dtype: str = DTYPES[0]) -> None:
  """Raises BenchmarkError unless batch, resolution, steps >= 1, warmup >= 0, and `mode` and
  `dtype` are of MODES and DTYPES."""
  for name, value, least in (("batch", batch, 1), ("resolution", resolution, 1),
                             ("warmup", warmup, 0), ("steps", steps, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise BenchmarkError(f"{name} must be an integer >= {least}, got {value!r}.")
  for name, value, choices in (("mode", mode, MODES), ("dtype", dtype, DTYPES)):
    if value not in choices:
      raise BenchmarkError(f"{name} must be one of {choices}, got {value!r}.")


def rss_now_mib() -> Optional[float]:
  """This process's resident set now (VmRSS) in MiB; None where /proc is missing."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return None


def peak_rss_mib() -> float:
  """This process's peak resident set in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def timed(fn: Callable[[], Any], warmup: int, steps: int) -> tuple[float, list[float]]:
  """Seconds of the first call of `fn` (which must wait for its own results), and of each of
  `steps` calls after `warmup` untimed ones."""
  times = []
  for _ in range(1 + warmup + steps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times[0], times[1 + warmup:]


def fill_rates(result: dict[str, Any], batch: int, times: list[float]) -> None:
  """Fills the rate fields of `result` (median step time, images/s, FLOP/s, fraction of peak)
  from the timed steps (None without any)."""
  result.update(step_seconds=None, step_seconds_all=times, images_per_sec=None,
                achieved_flops_per_sec=None, fraction_of_peak=None)
  if not times:
    return
  median = statistics.median(times)
  result.update(step_seconds=median, images_per_sec=batch / median)
  if result.get("flops_per_step_analytic"):
    result["achieved_flops_per_sec"] = result["flops_per_step_analytic"] / median
    if result.get("peak_flops_per_device"):
      result["fraction_of_peak"] = (result["achieved_flops_per_sec"]
                                    / result["peak_flops_per_device"])


def thread_facts() -> dict[str, Any]:
  """The cores this process may run on and the variables that size its thread pools."""
  affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
  return {"cpu_affinity": affinity, "NPROC": os.environ.get("NPROC"),
          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
          "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
          "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", "")}


def available_cores() -> list[int]:
  """The cores this process may run on (all of them where affinity is unknown)."""
  return (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
          else list(range(os.cpu_count() or 1)))


def cpu_info() -> dict:
  """The first processor's fields of /proc/cpuinfo ({} where it cannot be read)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      fields = (line.partition(":") for line in itertools.takewhile(str.strip, f))
      return {key.strip(): value.strip() for key, _, value in fields}
  except OSError:
    return {}
