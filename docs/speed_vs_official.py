r"""Estimated step time of the ViT training step beside the official vit_jax model's, per TPU slice.

The figures of docs/pods.md's "Step time against the official model" table. For each slice,
model and compute dtype it compiles, with the TPU compiler of libtpu (`vit_jax.preflight`'s
`fit.check` with `estimate=True`, nothing allocated, no TPU needed), the trainer's training step
(AdamW with the imagenet2012 recipe's settings, data parallel over the slice, parameters and
optimizer state float32) at the same batch per TensorCore for

  ours      the config's model with its training defaults (scan, remat, `remat_policy='auto'`);
  official  `VisionTransformer` of google-research/vision_transformer, as in
            docs/memory_vs_official.py (unrolled, no remat, always float32 compute: compiled
            once per slice and model, its row repeated for each dtype).

Per device (a chip; a TensorCore on v2/v3): the compiler's estimated step time with every
loop counted as it runs (`vit_jax/tools/preflight/estimate.py`), the MFU it implies against the
slice's peak in the compute dtype, the memory at the step's peak, and the FLOPs per step, the
compiler's (loops counted as they run) and the analytic count (`vit_jax.flops`).

Each compile's figures are appended to --out (JSON lines) as it ends; a rerun with the same
--out skips what is there, so a long table can be made in parts. The table is printed from
that file at the end.

Usage (libtpu installed: pip install -e '.[tpu]'; the official code: git clone
https://github.com/google-research/vision_transformer):
  python docs/speed_vs_official.py --official ~/vision_transformer --out speed.jsonl \
      [--accelerators v3-8,v4-8,v5litepod-8,v5p-8] [--batch-per-core 64] [--models b16,l16] \
      [--dtypes float32,bfloat16]

One entry takes one to ten minutes on 2 CPU cores (ours: the step and its unrolled variant).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from unittest import mock

GIB = 2**30
HERE = os.path.dirname(os.path.abspath(__file__))


def _module(name: str, path: str):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def measure(side: str, config, tpu, models_vit, official_model) -> dict:
  """One compile of `side` ('official', or ours) with `config` on `tpu`: a JSON-able record."""
  from vit_jax import step as step_lib  # pylint: disable=import-outside-toplevel
  from vit_jax.tools.preflight import fit  # pylint: disable=import-outside-toplevel
  patch = mock.patch.dict({})
  if side == "official":  # Unscanned, no remat: the official parameter tree, our fields unused.
    config = fit.with_overrides(config, {"model.scan": False, "model.remat": False,
                                         "model.dtype": "float32"})
    patch = mock.patch.object(step_lib, "create_model",
                              lambda c: official_model(models_vit, c))
  with patch:
    result = fit.check(config, tpu, eval_step=False, estimate=True)
  step, devices = result.train, len(tpu.devices)
  record = {"accepted": step.accepted, "fits": step.fits, "message": step.message,
            "memory_bytes": step.needs, "compile_seconds": step.seconds,
            "analytic_flops": result.train_flops / devices}
  speed = result.speed(step) if step.fits else None
  if step.cost is not None:
    record.update(compiler_flops=step.cost.total.get("flops"),
                  loops=step.cost.describe_loops(),
                  estimate_compile_seconds=step.cost.compile_seconds)
  if speed is not None:
    record.update(step_seconds=speed.seconds, mfu=speed.mfu, per_core=speed.per_core)
  return record


def _cell(record: dict) -> str:
  if not record.get("fits"):
    return f"does not fit ({record['memory_bytes'] / GIB:.1f} GiB)"
  mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "-"
  flops = record.get("compiler_flops")
  tflops = f"{flops / 1e12:.2f}" if flops else "-"
  return (f"**{record['step_seconds'] * 1e3:.0f} ms** / {mfu} / "
          f"{record['memory_bytes'] / GIB:.2f} GiB / {tflops}")


def table(records: dict) -> str:
  """The markdown table of `records` ({key: record}, key 'slice|model|dtype|side')."""
  lines = ["| slice | model | compute | ours: step / MFU / memory / TFLOPs | official: step / "
           "MFU / memory / TFLOPs | analytic TFLOPs | ours / official step |",
           "|---|---|---|---|---|---|---|"]
  for key, ours in records.items():
    tpu, model, dtype, side = key.split("|")
    if not side.startswith("ours"):
      continue
    if side != "ours":  # With overrides: named in the compute column.
      dtype = f"{dtype} {side[len('ours'):]}"
    official = records.get(f"{tpu}|{model}|float32|official")
    ratio = "-"
    if official and ours.get("step_seconds") and official.get("step_seconds"):
      ratio = f"**{ours['step_seconds'] / official['step_seconds']:.2f}**"
    lines.append(f"| {tpu} | {model} | {dtype} | {_cell(ours)} | "
                 f"{_cell(official) if official else '-'} | "
                 f"{ours['analytic_flops'] / 1e12:.2f} | {ratio} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--official", required=True,
                      help="a checkout of google-research/vision_transformer")
  parser.add_argument("--out", required=True, help="JSON lines, appended; a rerun skips them")
  parser.add_argument("--accelerators", default="v3-8,v4-8,v5litepod-8,v5p-8")
  parser.add_argument("--batch-per-core", type=int, default=64,
                      help="images per TensorCore (the global batch: this x the slice's cores)")
  parser.add_argument("--models", default="b16,l16", help="configs/vit.py model names")
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for ours (its rows are named by them), e.g. "
                           "model.remat_policy=dots_and_attention_saveable")
  args = parser.parse_args(argv)

  from vit_jax.tools.preflight import fit  # pylint: disable=import-outside-toplevel
  from vit_jax.tools.preflight import topology  # pylint: disable=import-outside-toplevel

  memory = _module("memory_vs_official", os.path.join(HERE, "memory_vs_official.py"))
  configs_vit = _module("configs_vit", os.path.join(HERE, "..", "configs", "vit.py"))
  models_vit = memory.load_official(args.official)
  overrides = memory.parse_overrides(args.override)
  ours = "ours" + "".join(f"[{item}]" for item in args.override)
  records = {}
  if os.path.exists(args.out):
    with open(args.out, encoding="utf-8") as f:
      for line in f:
        record = json.loads(line)
        records[record.pop("key")] = record
  for accelerator in args.accelerators.split(","):
    tpu = topology.tpu_slice(accelerator)
    batch = args.batch_per_core * tpu.hardware.cores
    for model in args.models.split(","):
      for dtype in args.dtypes.split(","):
        config = fit.with_overrides(configs_vit.get_config(f"{model},imagenet2012"), {
            "model.dtype": dtype, "batch_size": batch, "total_steps": 1_000_000})
        for side in (ours, "official"):
          key = f"{accelerator}|{model}|{'float32' if side == 'official' else dtype}|{side}"
          if key in records:
            continue
          records[key] = measure(
              side, config if side == "official" else fit.with_overrides(config, overrides),
              tpu, models_vit, memory.official_model)
          print(f"  {key}: {_cell(records[key])}", file=sys.stderr, flush=True)
          with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, **records[key]}) + "\n")
  print(f"batch {args.batch_per_core} per TensorCore; per device:")
  print(table(records))
  return 0


if __name__ == "__main__":
  sys.exit(main())
