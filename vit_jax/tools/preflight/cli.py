r"""Pod pre-flight: compiles the real training step for a TPU slice on this machine, before paying.

Examples:
  # ViT-B/16 pretraining on ImageNet-21k on a v3-32: does the step fit a core's 16 GiB?
  python -m vit_jax.preflight --config configs/vit.py:b16,imagenet21k --accelerator v3-32 \
      --config.model.dtype=bfloat16
  # The largest per-core batch of ViT-L/16 in bfloat16 with FSDP over a v3-8's cores.
  python -m vit_jax.preflight --config configs/vit.py:l16,imagenet2012 --accelerator v3-8 \
      --config.model.dtype=bfloat16 --config.mesh.fsdp=8 --config.mesh.data=1 --largest_batch
  # Two v4-8 slices joined by the data-center network (DCN), data parallel across them.
  python -m vit_jax.preflight --config configs/vit.py:b16,imagenet21k --accelerator v4-8 \
      --config.mesh.dcn_data=2
  # ViT-S/16's estimated step time and MFU on a v4-8, also as JSON (for python -m vit_jax.cost
  # --preflight out.json).
  python -m vit_jax.preflight --config configs/vit.py:s16,imagenet2012 --accelerator v4-8 \
      --json out.json

It compiles the trainer's own train and eval steps (`vit_jax.step`) with abstract inputs for
the whole slice with libtpu's TPU compiler, and prints per device the state, batch, temporaries
and total against the HBM; for each step that fits, the compiler's estimate of its time and the
MFU it implies. A step that does not fit gets the first overrides that fit, ready to paste; one
that fits with remat, those without remat if faster. How, and measured times: docs/pods.md.

Exit codes: 0 fits; 1 does not fit (the suggestion, if any, is printed); 2 a bad config or flag,
libtpu missing (with the install line), a compiler error other than memory, or a --json FILE
that cannot be written. Needs libtpu: pip install -e '.[tpu]'.
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any, Optional

from absl import logging
import jax

from vit_jax import cli as vit_cli
from vit_jax import hardware
from vit_jax import platform
from vit_jax import sharding
from vit_jax.tools import common
from vit_jax.tools import cost
from vit_jax.tools.preflight import fit
from vit_jax.tools.preflight import search
from vit_jax.tools.preflight import topology


_size = common.size_text


def _memory_rows(result: fit.Result) -> list[tuple[str, ...]]:
  steps = result.steps
  hbm = result.slice.hbm_bytes
  parts = (("parameters", "params"), ("optimizer state", "opt_state"),
           ("EMA parameters", "ema_params"), ("fixed tables", "model_state"))
  rows = [("per device", *(f"{s.name} step" for s in steps))]
  for label, key in parts:
    if any(s.memory.state.get(key) for s in steps):
      rows.append((label, *(_size(s.memory.state.get(key)) for s in steps)))
  for label, attr in (("batch", "batch"), ("temporaries", "temporaries"), ("code", "code")):
    rows.append((label, *(_size(getattr(s.memory, attr)) for s in steps)))

  def total(s: fit.StepCheck) -> str:
    if s.accepted:
      return f"{_size(s.needs)} of {_size(hbm)} ({s.needs / hbm:.0%})"
    return f"needs {_size(s.needs)}+ > {_size(hbm)}"

  rows.append(("total", *(total(s) for s in steps)))
  rows.append(("compile time", *(f"{s.seconds:.1f} s" for s in steps)))
  speeds = [result.speed(s) for s in steps]
  if any(speeds):
    rows += [
        ("est. step time", *(_seconds(v.seconds) if v else "-" for v in speeds)),
        ("images/s", *(f"{v.images_per_second:,.0f}" if v else "-" for v in speeds)),
        ("  per chip", *(f"{v.per_chip:,.0f}" if v else "-" for v in speeds)),
        ("  per core", *(f"{v.per_core:,.0f}" if v else "-" for v in speeds)),
        ("est. MFU", *(f"{v.mfu:.1%}" if v and v.mfu is not None else "-" for v in speeds))]
  return rows


def _seconds(seconds: float) -> str:
  return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _estimate_lines(result: fit.Result) -> list[str]:
  """How the steps' times were estimated, and why one has none."""
  costs = [s for s in result.steps if s.cost is not None]
  if not costs:
    return []
  loops = "; ".join(f"{s.name} step {s.cost.describe_loops()}" for s in costs)
  compiles = sum(s.cost.compile_seconds for s in costs)
  lines = [f"step time    the TPU compiler's estimate (its cost model: a lower bound), each loop's "
           f"body counted as many times as it runs ({loops}; a body measured by compiling the "
           f"step again with its loop unrolled, 2 trips per body around other loops: "
           f"{compiles:.0f} s)"]
  lines += [f"             {s.name} step: no estimate: {s.cost.missing}" for s in costs
            if s.cost.missing]
  peak, dtype = result.peak_flops, str(result.config.model.dtype)
  if peak and any(result.speed(s) for s in costs):
    kind = hardware.kind(result.slice.hardware.device_kind)
    runs_as = kind.runs_as.get(dtype, dtype)
    lines.append(f"MFU          the step's analytic FLOPs over its estimated time and the "
                 f"slice's peak, {peak / 1e12:,.0f} TFLOP/s ({runs_as}, "
                 f"{len(result.slice.devices)} x {kind.device_kind}"
                 + (f"; {dtype} matmuls run as {runs_as})" if runs_as != dtype else ")"))
  return lines


def format_result(result: fit.Result) -> str:
  """The report of one checked config: the run's shape, then the memory table."""
  c = result.config
  sizes = sharding.axis_sizes(c.mesh, len(result.slice.devices))
  mesh = " x ".join(f"{axis}={size}" for axis, size in sizes.items())
  model = c.model
  execution = "scan, " if model.get("scan") else ""
  execution += f"remat {model.remat_policy}" if model.get("remat") else "no remat"
  train = result.train
  xla = train.xla_flops if train else None
  loops_counted = train.cost.total.get("flops") if train and train.cost else None
  if loops_counted:
    devices = len(result.slice.devices)
    xla_text = (f"; XLA counts {loops_counted:.3g} per device, loops counted as they run "
                f"(x {devices} devices: {loops_counted * devices / result.train_flops:.2f} x "
                "the analytic count)")
  elif xla:
    xla_text = f"; XLA counts {xla:.3g} per device, partial: a scanned loop's body is counted once"
  else:
    xla_text = ""
  lines = [
      f"model        {c.model_name}, {result.parameters:,} parameters "
      f"({_size(result.parameter_bytes)}), {result.replicated_fraction:.0%} of their bytes "
      "replicated on every device",
      f"run          compute {model.dtype}, {execution}, attention {model.attention}, "
      f"mesh {mesh}",
      f"batch        {c.batch_size:,} per step = {result.batch_per_host:,} per host x "
      f"{result.slice.num_hosts} = {result.batch_per_device:,} per device; micro-batch "
      f"{result.micro_batch_per_device:,} per device (accumulation {c.grad_accum_steps})",
      f"FLOPs/step   {result.train_flops:.3g} (analytic: 3 forward passes of the matrix "
      "products)" + xla_text,
  ]
  lines += _estimate_lines(result)
  if result.slice.num_slices > 1:
    lines += _slices_lines(result)
  rows = _memory_rows(result)
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
  return "\n".join(lines)


def _slices_lines(result: fit.Result) -> list[str]:
  """The slices and, per compiled step, the collectives that cross them (`collectives`)."""
  n = result.slice.num_slices
  data = sharding.axis_sizes(result.config.mesh, len(result.slice.devices))["data"]
  parts = []
  for s in result.steps:
    found = s.cross_slice
    if found is None:
      parts.append(f"{s.name} step not compiled (refused)")
      continue
    kinds = ", ".join(f"{kind} x {count}" for kind, count in sorted(found.kinds.items()))
    size = _size(found.bytes) if found.bytes >= 2**20 else f"{found.bytes / 2**10:.1f} KiB"
    parts.append(f"{s.name} step {found.count}{'' if found.exact else '+'} collectives"
                 + (f" ({kinds})" if kinds else "") + f", {size}")
  return [f"slices       {n} x {result.slice.accelerator} joined by DCN; the mesh's data axis "
          f"is {n} slices x {data // n}",
          f"across DCN   {'; '.join(parts)} per step and device (the buffers each device "
          "hands the DCN)"]


def _step_json(result: fit.Result, step: fit.StepCheck) -> dict[str, Any]:
  memory = step.memory
  speed, cost = result.speed(step), step.cost
  train = step.name == "train"
  devices = len(result.slice.devices)
  loops_counted = cost.total.get("flops") if cost else None
  return {
      "accepted": step.accepted, "fits": step.fits, "refusal": step.message or None,
      "compile_seconds": step.seconds,
      "images": result.config.batch_size if train else result.config.eval_batch_size,
      "estimated_step_seconds": speed.seconds if speed else None,
      "estimate_note": cost.missing if cost else "not estimated",
      "images_per_second": speed.images_per_second if speed else None,
      "images_per_second_per_chip": speed.per_chip if speed else None,
      "images_per_second_per_core": speed.per_core if speed else None,
      "mfu": speed.mfu if speed else None,
      "flops_per_step": {
          "analytic": result.train_flops if train else result.eval_flops,
          "compiler": loops_counted * devices if loops_counted else None,
          "compiler_per_device": loops_counted,
          "compiler_per_device_loops_once": step.xla_flops},
      "memory_per_device": {
          **memory.state, "batch": memory.batch, "temporaries": memory.temporaries,
          "code": memory.code, "outputs": memory.outputs, "total": memory.total,
          "needs_at_least": step.needs, "hbm": step.hbm},
      "compiler_cost_per_device": {"loops_counted": cost.total, "loops_once": cost.once}
                                  if cost else None,
      "loops": [{"trips": list(loop.level), "scans": loop.scans, "body": loop.body}
                for loop in cost.loops] if cost else None,
      "estimate_compile_seconds": cost.compile_seconds if cost else None,
  }


def report_json(result: fit.Result) -> dict[str, Any]:
  """`--json`'s report of one checked config (bytes, seconds, FLOPs): the slice, model, run and
  batch, per step ('steps') its memory and estimate, the train step's also at the top."""
  c, tpu = result.config, result.slice
  hw = tpu.hardware
  steps = {s.name: _step_json(result, s) for s in result.steps}
  train = steps.get("train", {})
  return {
      "accelerator": tpu.accelerator, "num_slices": tpu.num_slices, "topology": tpu.topology,
      "device_kind": hw.device_kind, "devices": len(tpu.devices),
      "chips": hw.chips * tpu.num_slices, "cores": hw.cores * tpu.num_slices,
      "hosts": tpu.num_hosts, "hbm_bytes_per_device": tpu.hbm_bytes,
      "peak_flops": result.peak_flops, "model": c.model_name, "parameters": result.parameters,
      "parameter_bytes": result.parameter_bytes, "dtype": str(c.model.dtype),
      "scan": bool(c.model.get("scan")),
      "remat_policy": c.model.remat_policy if c.model.get("remat") else None,
      "attention": c.model.attention,
      "mesh": sharding.axis_sizes(c.mesh, len(tpu.devices)),
      "batch_size": c.batch_size, "eval_batch_size": c.eval_batch_size,
      "batch_per_host": result.batch_per_host, "batch_per_device": result.batch_per_device,
      "micro_batch_per_device": result.micro_batch_per_device,
      "grad_accum_steps": c.grad_accum_steps, "fits": result.fits,
      "estimated_step_seconds": train.get("estimated_step_seconds"),
      "mfu": train.get("mfu"), "flops_per_step": train.get("flops_per_step"),
      "memory_per_device": train.get("memory_per_device"), "steps": steps,
  }


def _write_json(path: Optional[str], report: dict[str, Any]) -> None:
  if path:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
    print(f"Wrote {path}")


def _attempt_line(attempt: search.Attempt) -> str:
  flags_text = fit.flags_of(attempt.overrides)
  if attempt.result is None:
    return f"  {flags_text}: not possible: {attempt.error}"
  r = attempt.result
  seconds = sum(s.seconds for s in r.steps)
  names = " and ".join(s.name for s in r.steps)
  if r.fits:
    speed = r.speed(r.train) if r.train is not None else None
    estimated = f", estimated {speed.seconds * 1e3:.3g} ms" if speed else ""
    return f"  {flags_text or '(as is)'}: {names} step fit{'s' * (len(r.steps) == 1)}, " \
           f"peak {_size(r.peak)}{estimated} ({seconds:.0f} s)"
  step = r.refused
  return (f"  {flags_text or '(as is)'}: {step.name} step does not fit (needs "
          f"{_size(step.needs)}{'' if step.accepted else '+'}, {seconds:.0f} s)")


def run(config, accelerator: str, *, suggest: bool = True, eval_step: bool = True,
        largest_batch: bool = False, num_train_examples: Optional[int] = None,
        num_classes: Optional[int] = None, estimate: bool = True, faster: bool = True,
        json_path: Optional[str] = None) -> int:
  """Checks and prints `config` on `accelerator` (the flags of the same names); returns the exit
  code (0 fits, 1 does not). `json_path`: also writes `report_json` there, a suggestion's under
  'suggestion', `search.faster`'s under 'faster'. Raises ValueError,
  topology.MissingLibtpuError, or OSError when the JSON cannot be written."""
  tpu = topology.tpu_slice(accelerator, num_slices=int(config.mesh.dcn_data))
  say = functools.partial(print, flush=True)
  say(f"Pre-flight for {tpu.describe()}; compiling with libtpu's TPU compiler...")
  checker = functools.partial(fit.check, tpu=tpu, eval_step=eval_step,
                              num_train_examples=num_train_examples, num_classes=num_classes,
                              estimate=estimate)
  if largest_batch:
    def progress(per_device, result):
      say(f"  {per_device} per device: {'fits' if result.fits else 'does not fit'} "
          f"({sum(s.seconds for s in result.steps):.0f} s)")
    per_device, result = search.largest_batch(config, tpu, checker, report=progress)
    if result is None:
      say("DOES NOT FIT even at 1 image per device.")
      return 1
    cap = (f" (the search starts at {search.LARGEST_BATCH_LIMIT}: more may fit)"
           if per_device == search.LARGEST_BATCH_LIMIT else "")
    say(f"Largest batch per device (power of two): {per_device}{cap}, global "
        f"{result.config.batch_size:,}.\n{format_result(result)}")
    _write_json(json_path, {**report_json(result), "largest_batch_per_device": per_device})
    return 0
  result = checker(config)
  say(format_result(result))
  report = report_json(result)
  if result.fits:
    say(f"FITS: peak {_size(result.peak)} per device of {_size(result.slice.hbm_bytes)}.")
    if faster and estimate:
      _faster(config, result, checker, report, say)
    _write_json(json_path, report)
    return 0
  say(f"DOES NOT FIT: {result.refused.verdict}")
  if suggest:
    say("Compiling smaller changes, in order (bfloat16, accumulation, FSDP, remat, batch; then "
        "the eval batch):")
    found = search.suggest(config, result, checker, report=lambda a: say(_attempt_line(a)))
    if found is None:
      say("Nothing fits down to one image per device: use a larger slice or a smaller model.")
    else:
      say(f"\nFits with these overrides:\n  {fit.flags_of(found.overrides)}\n"
          f"{format_result(found.result)}")
      report["suggestion"] = _found_json(found)
  _write_json(json_path, report)
  return 1


def _found_json(found: search.Attempt) -> dict[str, Any]:
  """A found attempt's overrides, as flags too, and its `report_json`."""
  return {"overrides": found.overrides, "flags": fit.flags_of(found.overrides),
          **report_json(found.result)}


def _faster(config, result: fit.Result, checker, report: dict[str, Any], say) -> None:
  """Prints (and adds to `report` under 'faster') `search.faster`'s overrides, if any."""
  train = result.train
  if not result.config.model.get("remat") or result.speed(train) is None:
    return
  say("Compiling the train step without remat (scanned as configured, then unrolled):")
  found = search.faster(config, result, checker, report=lambda a: say(_attempt_line(a)))
  if found is None:
    say("Not faster without remat: keep it.")
    return
  now = result.speed(train).seconds
  then = found.result.speed(found.result.train).seconds
  layout = (" (a new run: scan=False changes the checkpoints' block layout)"
            if "model.scan" in found.overrides else "")
  say(f"\nFaster: without remat the train step fits, peak {_size(found.result.peak)}, in an "
      f"estimated {then * 1e3:.3g} ms, {1 - then / now:.0%} less than {now * 1e3:.3g} "
      f"ms{layout}:\n  {fit.flags_of(found.overrides)}")
  report["faster"] = _found_json(found)


def _parser() -> common.Parser:
  parser = cost.config_parser("python -m vit_jax.preflight", __doc__)
  parser.add_argument(
      "--accelerator", help="Cloud TPU type to compile for, e.g. v3-8, v4-32, v5p-8 (cores), "
      "v5litepod-16, v6e-8 (chips): one slice; with --config.mesh.dcn_data=N the steps are "
      "compiled for N such slices joined by DCN, counting the collectives that cross slices.")
  for name, default, text in (
      ("suggest", True, "When the step does not fit, print the first overrides that fit."),
      ("eval", True, "Also compile the eval step (at config.eval_batch_size)."),
      ("largest_batch", False, "Instead: find the largest per-device batch (a power of two up to "
       "1024, accumulation 1) that fits."),
      ("estimate", True, "Also estimate each fitting step's time (the TPU compiler's cost model, "
       "loops counted as they run: one more compile per loop level) and its MFU."),
      ("faster", True, "When the train step fits with remat, also try it without remat; print "
       "those overrides if faster (docs/pods.md).")):
    default_text = f" (default; --no{name}: not)" if default else ""
    parser.add_argument(f"--{name}", action="store_true", default=default,
                        help=text + default_text)
    parser.add_argument(f"--no{name}", dest=name, action="store_false", help=argparse.SUPPRESS)
  parser.add_argument(
      "--json", metavar="FILE", help="Also write the report as JSON to FILE (fields: "
      "docs/pods.md); python -m vit_jax.cost --preflight FILE takes its MFU.")
  return parser


@common.exit_status
def main(argv=None) -> int:
  args, config = cost.parse(_parser(), argv)
  if args.print_config:
    print(vit_cli.config_help(config, args.config))
    return 0
  if config is None or not args.accelerator:
    raise ValueError("Give --config=configs/<file>.py[:<args>] and --accelerator (e.g. "
                     "v3-8); --help explains.")
  common.check_output_folder(args.json, "--json")
  try:  # No TPU compiler here, or the --json FILE not written: 2, as 1 means "does not fit".
    with common.input_errors((topology.MissingLibtpuError, OSError)):
      return run(config, args.accelerator, suggest=args.suggest, eval_step=args.eval,
                 largest_batch=args.largest_batch, num_train_examples=args.num_train_examples,
                 num_classes=args.num_classes, estimate=args.estimate, faster=args.faster,
                 json_path=args.json)
  except jax.errors.JaxRuntimeError as e:  # Not a lack of memory, which `run` reports.
    raise ValueError("The TPU compiler failed (not for memory): "
                     f"{str(e).strip().splitlines()[0]}") from e


def _setup() -> None:
  logging.get_absl_handler().addFilter(platform.QuietLibraries())
  logging.set_verbosity(logging.WARNING)  # The report says what the INFO lines would.
  # This host only traces; the TPU is described by libtpu, never opened (on a TPU VM too).
  jax.config.update("jax_platforms", "cpu")


def run_main() -> None:
  common.run_program(main, setup=_setup)
