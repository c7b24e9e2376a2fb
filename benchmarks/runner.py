"""The benchmark's rounds: `run` checks the whole request, then measures each configuration
(model x mode x framework x round) in a fresh `python -m benchmarks --worker SPEC OUT`
pinned to the requested cores, ours and timm's alternating, and aggregates the rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Optional, Sequence

from benchmarks import inputs as inputs_lib
from benchmarks import report as report_lib
from benchmarks import timm as timm_lib
from benchmarks.common import available_cores
from benchmarks.common import BenchmarkError
from benchmarks.common import check_sizes
from benchmarks.common import MeasurementFailed
from benchmarks.common import MODES
from benchmarks.common import NoTimmModel
from benchmarks.common import UNITS
from benchmarks.common import worker_environment

WORKER_MODULE = "benchmarks"


def worker(spec_path: str, out_path: str) -> int:
  """A measuring subprocess: pins its cores, measures, writes the result as JSON."""
  with open(spec_path, encoding="utf-8") as f:
    spec = json.load(f)
  cores = spec.pop("cores", None)
  if cores and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, cores)
  framework = spec.pop("framework")
  try:
    if framework == "input":
      spec.pop("threads", None)
      result = inputs_lib.measure_input(**spec)
    elif framework == "timm_input":
      result = inputs_lib.measure_timm_input(**spec)
    elif framework == "ours":
      from benchmarks import ours  # pylint: disable=g-import-not-at-top  (_plan)
      for key in ("threads", "analytic_flops", "device"):
        spec.pop(key, None)
      result = ours.measure_ours(**spec)
    else:
      spec.pop("compile_only", None)
      result = timm_lib.measure_timm(**spec)
  except BenchmarkError as e:
    result = {"error": str(e)}
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(result, f)
  return 0


def run_in_subprocess(spec: dict[str, Any], timeout: Optional[float] = None) -> dict[str, Any]:
  """One measurement (a `measure_*`'s keyword arguments, 'framework', 'threads', 'cores') in a
  fresh process: its result. Raises MeasurementFailed: it failed, timed out or reported an
  error (the process's last lines on stderr first)."""
  threads = spec.get("threads")
  env = worker_environment()
  if threads:
    env.update(NPROC=str(threads), OMP_NUM_THREADS=str(threads))
  with tempfile.TemporaryDirectory(prefix="vit_jax_bench_") as tmp:
    spec_path = os.path.join(tmp, "spec.json")
    out_path = os.path.join(tmp, "result.json")
    with open(spec_path, "w", encoding="utf-8") as f:
      json.dump(spec, f)
    if spec["framework"] == "input":
      what = f"the {spec['source']} input pipeline"
    elif spec["framework"] == "timm_input":
      what = f"timm's DataLoader ({spec['recipe']})"
    else:
      what = f"{spec['model']} {spec['mode']} ({spec['framework']})"
    try:
      proc = subprocess.run([sys.executable, "-m", WORKER_MODULE, "--worker", spec_path,
                             out_path], env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
      raise MeasurementFailed(f"Measuring {what} took longer than --timeout {timeout:g} s.") from e
    if proc.returncode != 0 or not os.path.exists(out_path):
      print("\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:]), file=sys.stderr)
      killed = " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
      raise MeasurementFailed(f"Measuring {what} failed with exit status "
                              f"{proc.returncode}{killed} (its last lines above).")
    with open(out_path, encoding="utf-8") as f:
      result = json.load(f)
  if "error" in result:
    raise MeasurementFailed(f"Measuring {what}: {result['error']}")
  return result


def _check_request(*, batch: int, resolution: int, dtype: str, warmup: int, steps: int,
                   num_classes: int, threads: Optional[int], compare: Optional[str], rounds: int,
                   compile_only: bool, inputs: Sequence[str]) -> int:
  """Checks `run`'s arguments that need no model (BenchmarkError); the thread count."""
  check_sizes(batch, resolution, warmup, steps, dtype=dtype)
  for name, value in (("rounds", rounds), ("num_classes", num_classes)):
    if value < 1:
      raise BenchmarkError(f"{name} must be >= 1, got {value}.")
  available = available_cores()
  threads = threads or len(available)
  if threads > len(available):
    raise BenchmarkError(f"--threads {threads} is more than the {len(available)} core(s) this "
                         "process may use.")
  if compare not in (None, "timm"):
    raise BenchmarkError(f"--compare {compare!r}: only 'timm' is supported.")
  if compare and compile_only:
    raise BenchmarkError("--compile-only measures only our compilation; drop --compare timm.")
  if compare:
    missing = timm_lib.missing_bench_packages()
    if missing:
      raise BenchmarkError(f"--compare timm needs {' and '.join(missing)}, which "
                           f"{'is' if len(missing) == 1 else 'are'} not installed: "
                           "pip install -e '.[bench]' (torch, timm).")
  for source in inputs:
    if source not in inputs_lib.INPUTS:
      raise BenchmarkError(f"input must be one of {inputs_lib.INPUTS}, got {source!r}.")
  return threads


def _plan(models_: Sequence[str], *, resolution: int, dtype: str, overrides: dict[str, Any],
          num_classes: int, compare: Optional[str]) -> tuple[list[tuple], list[str]]:
  """Per model `(model, forward MACs, whether timm is measured too)`, and notes; each model is
  traced on abstract shapes here, so that bad input fails before anything runs."""
  # `ours` (JAX) is imported here and in `worker`: timm's processes, whose peak RSS is reported,
  # must not load JAX.
  from benchmarks import ours  # pylint: disable=g-import-not-at-top
  notes, plans = [], []
  scanned = False
  for model in models_:
    macs = ours.forward_macs(model, resolution=resolution, dtype=dtype, overrides=overrides,
                             num_classes=num_classes)
    scanned |= bool(ours.benchmark_config(model, batch=1, resolution=resolution,
                                          overrides=overrides).model.get("scan"))
    with_timm = False
    if compare:
      try:
        timm_lib.timm_equivalent(model, overrides)
        with_timm = True
      except NoTimmModel as e:
        notes.append(str(e))
    plans.append((model, macs, with_timm))
  if scanned:
    notes.append("scan=True: XLA's cost analysis counts the scanned layer body once, so "
                 "'GFLOPs XLA' is far below the analytic count; the utilisation uses the "
                 "analytic count.")
  return plans, notes


def _rounds(plan: tuple, mode: str, rounds: int, base_spec: dict[str, Any], peak: dict[str, Any],
            timeout: Optional[float], progress: Optional[Callable[[str], None]]
            ) -> list[dict[str, Any]]:
  """Measures one model and mode over `rounds` rounds, ours and timm's alternating (ours first
  while the device peak is unknown: it measures the peak, which later processes are given)."""
  model, macs, with_timm = plan
  analytic = (3 if mode == "train" else 1) * 2 * macs * base_spec["batch"]
  per_framework: dict[str, list[dict[str, Any]]] = {"ours": [], "timm": []}
  for round_ in range(rounds):
    order = ["ours", "timm"] if with_timm else ["ours"]
    if round_ % 2 and peak["flops"] is not None:
      order.reverse()
    for framework in order:
      spec = dict(base_spec, framework=framework, model=model, mode=mode,
                  peak_flops=peak["flops"], analytic_flops=float(analytic),
                  device=peak["platform"])
      if progress:
        progress(f"[{model} {mode}] {framework}, round {round_ + 1}/{rounds} ...")
      result = run_in_subprocess(spec, timeout)
      if framework == "ours" and peak["flops"] is None:
        peak.update(flops=result["peak_flops_per_device"], platform=result["platform"])
      per_framework[framework].append(result)
  return [report_lib.aggregate(r) for r in per_framework.values() if r]


def _recipe_rounds(*, batch: int, resolution: int, threads: int, rounds: int, with_timm: bool,
                   timeout: Optional[float], progress: Optional[Callable[[str], None]]
                   ) -> list[dict[str, Any]]:
  """Each recipe's full training preprocessing on the generated JPEGs, ours and (`with_timm`)
  timm's DataLoader alternating, on 1 and on `threads` cores: medians over `rounds`."""
  available = available_cores()
  out = []
  for recipe in inputs_lib.RECIPES:
    for count in sorted({1, threads}):
      per_framework: dict[str, list[dict[str, Any]]] = {"input": [], "timm_input": []}
      for round_ in range(rounds):
        order = ["input", "timm_input"] if with_timm else ["input"]
        if round_ % 2:
          order.reverse()
        for framework in order:
          if progress:
            who = "ours" if framework == "input" else "timm"
            progress(f"[input preprocessing] {recipe}, {count} core(s), {who}, "
                     f"round {round_ + 1}/{rounds} ...")
          spec = dict(framework=framework, recipe=recipe, batch=batch, resolution=resolution,
                      warmup=inputs_lib.recipe_steps(batch),  # (tf.data's autotuning.)
                      steps=inputs_lib.recipe_steps(batch), threads=count,
                      cores=available[:count] if count < len(available) else None)
          if framework == "input":
            spec["source"] = "jpeg"
          per_framework[framework].append(run_in_subprocess(spec, timeout))
      out += [report_lib.aggregate(r, report_lib.INPUT_MEDIAN_KEYS)
              for r in per_framework.values() if r]
  return out


def run(models_: Sequence[str], *, batch: int = 8, resolution: int = 224,
        dtype: str = "float32", modes: Sequence[str] = MODES, warmup: int = 2, steps: int = 5,
        overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
        threads: Optional[int] = None, compare: Optional[str] = None, rounds: int = 1,
        compile_only: bool = False, timeout: Optional[float] = None,
        inputs: Sequence[str] = (), progress: Optional[Callable[[str], None]] = None
        ) -> dict[str, Any]:
  """Measures every model and mode (and timm's, with compare='timm'), and the input pipelines
  `inputs` with each recipe's preprocessing, in fresh subprocesses: the report ('results':
  medians over rounds). Raises BenchmarkError (before anything runs) or MeasurementFailed."""
  overrides = dict(overrides or {})
  threads = _check_request(batch=batch, resolution=resolution, dtype=dtype, warmup=warmup,
                           steps=steps, num_classes=num_classes, threads=threads,
                           compare=compare, rounds=rounds, compile_only=compile_only,
                           inputs=inputs)
  plans, notes = _plan(models_, resolution=resolution, dtype=dtype, overrides=overrides,
                       num_classes=num_classes, compare=compare)
  available = available_cores()
  cores = available[:threads] if threads < len(available) else None
  peak: dict[str, Any] = {"flops": None, "platform": "cpu"}
  base_spec = dict(batch=batch, resolution=resolution, dtype=dtype, warmup=warmup, steps=steps,
                   overrides=overrides, num_classes=num_classes, compile_only=compile_only,
                   threads=threads, cores=cores)
  results = []
  for plan in plans:
    for mode in modes:
      results += _rounds(plan, mode, rounds, base_spec, peak, timeout, progress)
  input_results = []
  for source in inputs:
    if progress:
      progress(f"[input pipeline] {source} ...")
    input_results.append(run_in_subprocess(
        dict(framework="input", source=source, batch=batch, resolution=resolution,
             threads=threads, cores=cores), timeout))
  recipe_results = []
  if inputs:
    with_timm = not timm_lib.missing_bench_packages()
    if not with_timm:
      notes.append("timm's DataLoader not measured beside our preprocessing: pip install -e "
                   "'.[bench]' (torch, timm).")
    recipe_results = _recipe_rounds(batch=batch, resolution=resolution, threads=threads,
                                    rounds=rounds, with_timm=with_timm, timeout=timeout,
                                    progress=progress)
  notes += report_lib.result_notes(results, compile_only=compile_only, peak_flops=peak["flops"],
                                   platform_name=peak["platform"])
  return {
      "benchmark": "benchmarks",
      "args": {"models": list(models_), "batch": batch, "resolution": resolution,
               "dtype": dtype, "modes": list(modes), "warmup": warmup, "steps": steps,
               "overrides": overrides, "num_classes": num_classes, "threads": threads,
               "compare": compare, "rounds": rounds, "compile_only": compile_only,
               "inputs": list(inputs)},
      "environment": dict(report_lib.environment(threads),
                          measured_on=report_lib.measured_on(results)),
      "results": results, "comparisons": report_lib.comparisons(results),
      "inputs": input_results, "input_recipes": recipe_results, "notes": notes, "units": UNITS,
  }
