"""The benchmark's command line, `python -m benchmarks`; `--help` prints the package
docstring."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import benchmarks as package
from benchmarks import inputs as inputs_lib
from benchmarks import report as report_lib
from benchmarks import runner
from benchmarks.common import BenchmarkError
from benchmarks.common import DTYPES
from benchmarks.common import MODES
from vit_jax import platform
from vit_jax.tools import common


def _int_at_least(least: int):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
      raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
    return value
  return parse


def _parser() -> argparse.ArgumentParser:
  parser = common.Parser(prog="python -m benchmarks", description=package.__doc__)
  count = _int_at_least(1)
  parser.add_argument("models", nargs="*", metavar="MODEL",
                      help="model names of vit_jax.models, e.g. ViT-B_16, ViT-Ti_16, T2T-ViT-14, "
                           "ViT-custom (with --set for its sizes)")
  parser.add_argument("--batch", type=count, default=8, help="images per step (default 8)")
  parser.add_argument("--resolution", type=count, default=224,
                      help="square image side in pixels (default 224)")
  parser.add_argument("--dtype", choices=DTYPES, default="float32",
                      help="compute dtype; parameters stay float32 (default float32)")
  parser.add_argument("--mode", choices=(*MODES, "both"), default="both",
                      help="train: the trainer's step; inference: forward only; both (default)")
  parser.add_argument("--warmup", type=_int_at_least(0), default=2,
                      help="untimed steps after the first execution (default 2)")
  parser.add_argument("--steps", type=count, default=5,
                      help="timed steps; images/s uses their median (default 5)")
  parser.add_argument("--threads", type=count, default=None,
                      help="cores / threads for both frameworks (default: all this process may "
                           "use)")
  common.add_set_argument(parser, "a config.model field: e.g. --set scan=False, --set "
                          "num_layers=4, --set attention=xla")
  parser.add_argument("--override", action="append", dest="set", metavar="KEY=VALUE",
                      help="deprecated: the same as --set")
  parser.add_argument("--num-classes", type=count, default=1000,
                      help="classes of the head (default 1000)")
  parser.add_argument("--compare", choices=("timm",), default=None,
                      help="also measure timm's equivalent model (pip install -e '.[bench]')")
  parser.add_argument("--rounds", type=count, default=None,
                      help="rounds of fresh processes per configuration, frameworks alternating "
                           "(default 3 with --compare, else 1)")
  parser.add_argument("--compile-only", action="store_true",
                      help="only lower and compile our step on abstract shapes")
  parser.add_argument("--timeout", type=float, default=3600.0,
                      help="seconds one measuring process may take (default 3600)")
  parser.add_argument("--input-pipeline", action="store_true",
                      help="also measure the training input pipeline alone, and each recipe's "
                           "preprocessing (ViT, T2T-ViT) beside timm's DataLoader, in images per "
                           "CPU-second on 1 and --threads cores")
  parser.add_argument("--json", metavar="PATH", default=None,
                      help="also write the report (results, ratios, environment, units) as JSON")
  parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
  return parser


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; returns the exit status (bad flags: the parser's SystemExit(2))."""
  args = _parser().parse_args(argv)
  if args.worker:
    return runner.worker(*args.worker)
  if not args.models and not args.input_pipeline:
    raise BenchmarkError("Name at least one model, e.g. python -m benchmarks ViT-B_16 "
                         "(or measure only the input pipeline: --input-pipeline)")
  common.check_output_folder(args.json, "--json")
  report = runner.run(args.models, batch=args.batch, resolution=args.resolution,
                      dtype=args.dtype, modes=MODES if args.mode == "both" else (args.mode,),
                      warmup=args.warmup, steps=args.steps,
                      overrides=dict(common.parse_setting(s) for s in args.set),
                      num_classes=args.num_classes, threads=args.threads,
                      compare=args.compare, rounds=args.rounds or (3 if args.compare else 1),
                      compile_only=args.compile_only, timeout=args.timeout,
                      inputs=inputs_lib.INPUTS if args.input_pipeline else (),
                      progress=lambda m: print(m, file=sys.stderr, flush=True))
  print(report_lib.format_report(report))
  if args.json:
    with common.output_errors():
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"\nWrote {args.json}")
  return 0


def _setup() -> None:
  """Huge pages for malloc (re-executing once, as `vit_jax.main`; the measuring processes, timm's
  too, inherit them) and the parent on the CPU (it only traces shapes); not in a worker."""
  if "--worker" not in sys.argv:
    platform.reexec_with_huge_pages()
    import jax  # pylint: disable=g-import-not-at-top  (after --help and bad flags)
    jax.config.update("jax_platforms", "cpu")


def run_main() -> None:
  common.run_program(main, _parser, setup=_setup)
