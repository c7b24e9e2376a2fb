"""The benchmark's command line: `python -m vit_jax.benchmark` (or `python -m
vit_jax.tools.benchmark`); `--help` prints the package docstring."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import vit_jax.tools.benchmark as package
from vit_jax.tools.benchmark import inputs as inputs_lib
from vit_jax.tools.benchmark import report as report_lib
from vit_jax.tools.benchmark import runner
from vit_jax.tools.benchmark.common import BenchmarkError
from vit_jax.tools.benchmark.common import DTYPES
from vit_jax.tools.benchmark.common import MeasurementFailed
from vit_jax.tools.benchmark.common import MODES
from vit_jax.tools.benchmark.common import parse_override


class _Parser(argparse.ArgumentParser):
  """argparse that reports a bad flag in one line (exit 2) instead of usage + error."""

  def error(self, message):
    raise BenchmarkError(f"{message} (python -m vit_jax.benchmark --help lists the flags)")


def _int_at_least(least: int):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
      raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
    return value
  parse.__name__ = "integer"
  return parse


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="python -m vit_jax.benchmark", description=package.__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("models", nargs="*", metavar="MODEL",
                      help="model names of vit_jax.models, e.g. ViT-B_16, ViT-Ti_16, ViT-S_16, "
                           "T2T-ViT-14, ViT-custom (with --override for its sizes)")
  parser.add_argument("--batch", type=_int_at_least(1), default=8,
                      help="images per step (default 8)")
  parser.add_argument("--resolution", type=_int_at_least(1), default=224,
                      help="square image side in pixels; the patch size must divide it "
                           "(T2T-ViT: any side the three soft splits accept) (default 224)")
  parser.add_argument("--dtype", choices=DTYPES, default="float32",
                      help="compute dtype; parameters stay float32 (timm: torch.autocast for "
                           "bfloat16) (default float32)")
  parser.add_argument("--mode", choices=(*MODES, "both"), default="both",
                      help="train: the trainer's step (forward, backward, AdamW update); "
                           "inference: forward only; both (default)")
  parser.add_argument("--warmup", type=_int_at_least(0), default=2,
                      help="untimed steps after the first execution (default 2)")
  parser.add_argument("--steps", type=_int_at_least(1), default=5,
                      help="timed steps; images/s uses their median (default 5)")
  parser.add_argument("--threads", type=_int_at_least(1), default=None,
                      help="cores / threads for both frameworks (default: all cores this "
                           "process may use); see 'Threads' above")
  parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="a config.model field, repeatable: e.g. --override scan=False, "
                           "--override num_layers=4, --override attention=xla (values are "
                           "Python literals)")
  parser.add_argument("--num-classes", type=_int_at_least(1), default=1000,
                      help="classes of the head (default 1000)")
  parser.add_argument("--compare", choices=("timm",), default=None,
                      help="also measure timm's equivalent model (needs the 'bench' extra: "
                           "pip install -e '.[bench]')")
  parser.add_argument("--rounds", type=_int_at_least(1), default=None,
                      help="rounds of fresh processes per configuration; the frameworks "
                           "alternate and medians over rounds are reported (default 3 with "
                           "--compare, else 1)")
  parser.add_argument("--compile-only", action="store_true",
                      help="only lower and compile our step on abstract shapes (no memory for "
                           "parameters; for compile times of large models)")
  parser.add_argument("--timeout", type=float, default=3600.0,
                      help="seconds one measuring process may take (default 3600)")
  parser.add_argument("--input-pipeline", action="store_true",
                      help="also measure the training input pipeline alone (images/s of "
                           "vit_jax.data with Inception crop at --resolution): Fashion-MNIST "
                           "(offline builder) and a generated folder of 500x375 JPEGs")
  parser.add_argument("--json", metavar="PATH", default=None,
                      help="also write the report (results, ratios, environment, units) as JSON")
  parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; returns the exit status (0, 1 measurement failed, 2 bad input)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    args = _parser().parse_args(argv)
    if args.worker:
      return runner.worker(*args.worker)
    if not args.models and not args.input_pipeline:
      raise BenchmarkError("Name at least one model, e.g. python -m vit_jax.benchmark ViT-B_16 "
                           "(or measure only the input pipeline: --input-pipeline)")
    overrides = dict(parse_override(o) for o in args.override)
    modes = MODES if args.mode == "both" else (args.mode,)
    rounds = args.rounds or (3 if args.compare else 1)
    if args.json:
      directory = os.path.dirname(os.path.abspath(args.json))
      if not os.path.isdir(directory):
        raise BenchmarkError(f"--json {args.json}: the directory {directory} does not exist.")
    report = runner.run(args.models, batch=args.batch, resolution=args.resolution,
                        dtype=args.dtype, modes=modes, warmup=args.warmup, steps=args.steps,
                        overrides=overrides, num_classes=args.num_classes,
                        threads=args.threads, compare=args.compare, rounds=rounds,
                        compile_only=args.compile_only, timeout=args.timeout,
                        inputs=inputs_lib.INPUTS if args.input_pipeline else (),
                        progress=lambda m: print(m, file=sys.stderr, flush=True))
  except BenchmarkError as e:
    print(f"vit_jax.benchmark: error: {e}", file=sys.stderr)
    return 2
  except MeasurementFailed as e:
    print(f"vit_jax.benchmark: {e}", file=sys.stderr)
    return 1
  print(report_lib.format_report(report))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
    print(f"\nWrote {args.json}")
  return 0


def run_main() -> None:
  """The program: huge pages for malloc (re-executing once, as `vit_jax.main`; the measuring
  subprocesses, timm's too, inherit the environment), the parent kept on the CPU (it only
  traces shapes to check the input; the measuring subprocesses use the default backend), then
  `main`'s exit status."""
  if "--worker" not in sys.argv:
    from vit_jax import platform  # pylint: disable=g-import-not-at-top
    platform.reexec_with_huge_pages()
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_platforms", "cpu")
  sys.exit(main())
