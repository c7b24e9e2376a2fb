"""The benchmark's report: environment, medians over rounds, ratios ours / timm, notes, tables."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import statistics
from typing import Any, Optional, Sequence

from benchmarks.common import available_cores
from benchmarks.common import cpu_info
from benchmarks.inputs import INPUT_LABELS
from benchmarks.inputs import RECIPE_IMAGES
from benchmarks.inputs import RECIPE_LABELS
from vit_jax import platform as vit_jax_platform

MEDIAN_KEYS = ("images_per_sec", "step_seconds", "lower_seconds", "compile_seconds",
               "first_step_seconds", "peak_rss_mib", "device_peak_mib",
               "achieved_flops_per_sec", "fraction_of_peak", "flops_per_step_xla")


def environment(threads: int) -> dict[str, Any]:
  """Versions, CPU, core and thread counts, XLA_FLAGS: what the figures depend on."""
  versions = {}
  for package in ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "timm"):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  cpu = cpu_info()
  memory = vit_jax_platform.host_memory_bytes()  # The cgroup's limit where lower.
  memory_gib = None if memory is None else round(memory / 2**30, 1)
  simd = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
  cpu_features = [flag for flag in cpu.get("flags", "").split() if flag in simd]
  cpu_model = cpu.get("model name") or platform.processor() or None
  available = len(available_cores())
  return {"python": platform.python_version(), "platform": platform.platform(),
          "versions": versions, "cpu_model": cpu_model, "cpu_family": cpu.get("cpu family"),
          "cpu_model_number": cpu.get("model"), "cpu_features": cpu_features,
          "memory_gib": memory_gib, "cpu_count": os.cpu_count(),
          "available_cores": available, "threads": threads,
          "jax_cpu_threads": f"NPROC={threads} (the size of XLA's CPU thread pool), "
                             + (f"pinned to {threads} of {available} cores" if threads < available
                                else f"all {available} cores"),
          "torch_threads": f"torch.set_num_threads({threads}), OMP_NUM_THREADS={threads}",
          "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
          "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}


def measured_on(results: list[dict[str, Any]]) -> dict[str, Any]:
  """Where each framework ran (device, threads), from its first result."""
  out = {}
  for r in results:
    if r["framework"] not in out:
      out[r["framework"]] = {k: r.get(k) for k in ("platform", "device_kind", "num_devices",
                                                   "threads", "torchvision_ops") if k in r}
  return out


INPUT_MEDIAN_KEYS = ("images_per_sec", "images_per_cpu_second", "cores_busy", "seconds",
                     "cpu_seconds", "peak_rss_mib")


def aggregate(rounds: list[dict[str, Any]], keys: Sequence[str] = MEDIAN_KEYS) -> dict[str, Any]:
  """One result of several rounds: medians of `keys` (`INPUT_MEDIAN_KEYS` for an input
  measurement), and every timed step."""
  merged = dict(rounds[0])
  for key in keys:
    values = [r[key] for r in rounds if r.get(key) is not None]
    merged[key] = statistics.median(values) if values else None
  if "step_seconds_all" in merged:
    merged["step_seconds_all"] = [t for r in rounds for t in r.get("step_seconds_all", [])]
  merged["rounds"] = [{k: r.get(k) for k in keys} for r in rounds]
  return merged


def recipe_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per recipe and core count: ours and timm's images/s and per CPU-second, ours / timm."""
  rows: dict[tuple, dict[str, Any]] = {}
  for r in results:
    cores = len(r["threads"]["cpu_affinity"] or []) or None
    row = rows.setdefault((r["recipe"], cores), {"recipe": r["recipe"], "cores": cores})
    who = "ours" if r["framework"] == "input" else "timm"
    row.update({f"{who}_images_per_sec": r["images_per_sec"],
                f"{who}_images_per_cpu_second": r["images_per_cpu_second"],
                f"{who}_cores_busy": r["cores_busy"]})
  for row in rows.values():
    ours, theirs = row.get("ours_images_per_cpu_second"), row.get("timm_images_per_cpu_second")
    row["per_cpu_second_ratio"] = ours / theirs if ours and theirs else None
  return list(rows.values())


def _recipes_table(report: dict[str, Any]) -> list[str]:
  headers = ["recipe", "augmentations", "cores", "ours images/s", "ours images/CPU-s",
             "ours cores busy", "timm images/s", "timm images/CPU-s", "timm cores busy",
             "ratio per CPU-s"]
  rows = [[*RECIPE_LABELS[r["recipe"]], str(r["cores"]),
           fmt(r.get("ours_images_per_sec"), "sig"),
           fmt(r.get("ours_images_per_cpu_second"), "sig"), fmt(r.get("ours_cores_busy"), ".2f"),
           fmt(r.get("timm_images_per_sec"), "sig"),
           fmt(r.get("timm_images_per_cpu_second"), "sig"), fmt(r.get("timm_cores_busy"), ".2f"),
           fmt(r.get("per_cpu_second_ratio"), ".2f")]
          for r in recipe_rows(report["input_recipes"])]
  return ["Each recipe's full training preprocessing on 500x375 JPEGs, ours (vit_jax.data) and "
          f"timm's DataLoader, {RECIPE_IMAGES} images timed after as many, medians over rounds "
          "(ratio > 1: ours does more per CPU-second):", table(headers, rows)]


def timm_label(result: dict[str, Any]) -> str:
  """timm's model name, starred when created with keyword arguments."""
  return result["timm_model"] + ("*" if result.get("timm_kwargs") else "")


def comparisons(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per model and mode measured by both: images/s and peak memory, ours / timm."""
  out = []
  by_key = {(r["model"], r["mode"], r["framework"]): r for r in results}
  ratio = lambda a, b: a / b if a and b else None
  for (model, mode, framework), ours in by_key.items():
    theirs = by_key.get((model, mode, "timm"))
    if framework != "ours" or theirs is None:
      continue
    out.append({
        "model": model, "timm_model": theirs["timm_model"], "timm_label": timm_label(theirs),
        "mode": mode, "ours_images_per_sec": ours["images_per_sec"],
        "timm_images_per_sec": theirs["images_per_sec"],
        "images_per_sec_ratio": ratio(ours["images_per_sec"], theirs["images_per_sec"]),
        "ours_peak_rss_mib": ours["peak_rss_mib"], "timm_peak_rss_mib": theirs["peak_rss_mib"],
        "peak_rss_ratio": ratio(ours["peak_rss_mib"], theirs["peak_rss_mib"]),
        "ours_device_peak_mib": ours["device_peak_mib"],
        "timm_device_peak_mib": theirs["device_peak_mib"],
    })
  return out


def attention_notes(results: list[dict[str, Any]]) -> list[str]:
  """Which attention our steps ran and why, and whether the compiled step calls vit_jax's CPU
  kernel; one note per distinct answer."""
  groups: dict[tuple, list[str]] = {}
  for r in results:
    if r["framework"] == "ours" and r.get("attention"):
      key = (r["attention"], r.get("attention_reason"), r.get("attention_cpu_kernel_called"),
             r.get("platform"))
      groups.setdefault(key, []).append(f"{r['model']} {r['mode']}")
  notes = []
  for (implementation, reason, called, device), runs in groups.items():
    note = f"attention (ours: {', '.join(runs)}): {implementation} ({reason})"
    if device == "cpu":
      note += ("; the compiled step calls vit_jax's fused CPU kernel "
               "(vit_jax.kernels), whose products are in the analytic count, not in 'GFLOPs "
               "XLA' (XLA cannot see into a custom call); --set attention=xla "
               "measures XLA's attention instead" if called else
               "; the compiled step does not call vit_jax's fused CPU kernel")
    notes.append(note + ".")
  return notes


def result_notes(results: list[dict[str, Any]], *, compile_only: bool,
                 peak_flops: Optional[float], platform_name: str) -> list[str]:
  """The notes the results call for (compile-only, timm, attention, malloc, the CPU peak)."""
  notes = []
  if compile_only:
    notes.append("--compile-only: the step was lowered and compiled on abstract shapes, not "
                 "run; peak RSS is the compilation's.")
  if any(r.get("timm_kwargs") for r in results):
    notes.append("timm model*: created with keyword arguments for the architecture or dropout "
                 "that differ from the named model ('timm_kwargs' in the JSON).")
  if any(r.get("torchvision_ops") is False for r in results):
    notes.append("torchvision's C++ ops did not load next to this torch (a mismatched wheel); "
                 "timm's ViT does not use them (see timm.import_timm).")
  notes += attention_notes(results)
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  with_timm = any(r["framework"] == "timm" for r in results)
  timm_too = ", timm's processes too" if with_timm else ""
  if "glibc.malloc.hugetlb=1" in tunables:
    notes.append("malloc: huge pages for large allocations "
                 f"(GLIBC_TUNABLES={tunables}{timm_too}).")
  else:
    notes.append(f"malloc: no huge pages (GLIBC_TUNABLES={tunables or 'unset'}{timm_too}): "
                 "VIT_JAX_HUGE_PAGES=0, a glibc.malloc.hugetlb of your own, or not supported here.")
  if platform_name == "cpu" and peak_flops:
    notes.append(f"CPU peak: {peak_flops / 1e9:.0f} GFLOP/s, XLA's own float32 2048^3 "
                 "matmul (for bfloat16 too) measured once in this run (it moves with the "
                 "machine's load); a faster GEMM library can exceed 100%."
                 + (" timm's rows use the same peak and our analytic FLOPs." if with_timm
                    else ""))
  return notes


def fmt(value: Any, spec: str, scale: float = 1.0) -> str:
  """`value * scale` in `spec`; spec 'sig' is 3 significant digits without an exponent."""
  if value is None:
    return "-"
  value *= scale
  if spec != "sig":
    return format(value, spec)
  if value == 0 or abs(value) >= 100:
    return f"{value:,.0f}"
  digits = 2 - int(math.floor(math.log10(abs(value))))
  return f"{value:.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  """Aligned columns: the first three left-aligned, the rest right-aligned."""
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(headers)]
  line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths)))
  return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _results_table(results: list[dict[str, Any]]) -> str:
  headers = ["model", "framework", "mode", "images/s", "step s", "lower s", "compile s",
             "1st step s", "peak RSS MiB", "dev peak MiB", "GFLOPs XLA", "GFLOPs analytic",
             "GFLOP/s", "% of peak"]
  rows = []
  for r in results:
    name = r["model"] if r["framework"] == "ours" else f"{r['model']} ({timm_label(r)})"
    rows.append([name, r["framework"], r["mode"], fmt(r.get("images_per_sec"), "sig"),
                 fmt(r.get("step_seconds"), "sig"), fmt(r.get("lower_seconds"), "sig"),
                 fmt(r.get("compile_seconds"), "sig"), fmt(r.get("first_step_seconds"), "sig"),
                 fmt(r.get("peak_rss_mib"), ".0f"), fmt(r.get("device_peak_mib"), ".0f"),
                 fmt(r.get("flops_per_step_xla"), "sig", 1e-9),
                 fmt(r.get("flops_per_step_analytic"), "sig", 1e-9),
                 fmt(r.get("achieved_flops_per_sec"), "sig", 1e-9),
                 fmt(r.get("fraction_of_peak"), ".1f", 100)])
  return table(headers, rows)


def _inputs_table(report: dict[str, Any]) -> list[str]:
  train = [r["images_per_sec"] for r in report["results"]
           if r["mode"] == "train" and r["framework"] == "ours" and r.get("images_per_sec")]
  headers = ["input pipeline", "augment", "images/s", "peak RSS MiB"]
  if train:
    headers.append("x our fastest training step")
  rows = [[INPUT_LABELS[r["input"]], r["augment"], fmt(r["images_per_sec"], "sig"),
           fmt(r["peak_rss_mib"], ".0f")]
          + ([fmt(r["images_per_sec"] / max(train), ".1f")] if train else [])
          for r in report["inputs"]]
  return ["The training input pipeline alone (vit_jax.data, same batch, resolution and threads"
          + ("; > 1x: it is not the bottleneck):" if train else "):"), table(headers, rows)]


def _comparisons_table(report: dict[str, Any]) -> list[str]:
  headers = ["model", "timm model", "mode", "ours images/s", "timm images/s", "ratio",
             "ours peak RSS MiB", "timm peak RSS MiB", "ratio"]
  rows = [[c["model"], c["timm_label"], c["mode"], fmt(c["ours_images_per_sec"], "sig"),
           fmt(c["timm_images_per_sec"], "sig"), fmt(c["images_per_sec_ratio"], ".2f"),
           fmt(c["ours_peak_rss_mib"], ".0f"), fmt(c["timm_peak_rss_mib"], ".0f"),
           fmt(c["peak_rss_ratio"], ".2f")] for c in report["comparisons"]]
  return ["Ours / timm (ratio > 1: ours has more images/s, or more memory):",
          table(headers, rows)]


def format_report(report: dict[str, Any]) -> str:
  """The printed text of a `runner.run` report: results, input pipeline, ratios, notes."""
  args = report["args"]
  env = report["environment"]
  timing = ("compile only, nothing run" if args["compile_only"] else
            f"medians of {args['steps']} timed step(s) after {args['warmup']} warm-up step(s)"
            + (f", over {args['rounds']} rounds" if args["rounds"] > 1 else ""))
  parts = [f"batch {args['batch']}, {args['resolution']}x{args['resolution']} px, "
           f"{args['dtype']}, {env['threads']} thread(s) on {env['available_cores']} core(s) "
           f"({env['cpu_model']}); {timing}"]
  if report["results"]:
    parts.append(_results_table(report["results"]))
  if report.get("inputs"):
    parts += _inputs_table(report)
  if report.get("input_recipes"):
    parts += _recipes_table(report)
  if report["comparisons"]:
    parts += _comparisons_table(report)
  if report["notes"]:
    parts.append("\n".join(f"Note: {n}" for n in report["notes"]))
  return "\n\n".join(parts)
