r"""What a training run costs: predicted before it runs (FLOPs, TPU-core-days and wall time), or
measured by a run (its ledger: where the core-days went, per attempt, and the goodput).

Examples:
  # ViT-L/16 pretraining on ImageNet-21k (90 epochs, batch 4096) on a TPU v3-256 at 35% MFU.
  python -m vit_jax.cost --config configs/vit.py:l16,imagenet21k --accelerator v3-256
  # The same on a v4-128 at 50% MFU; any config override works as in vit_jax.main.
  python -m vit_jax.cost --config configs/vit.py:l16,imagenet21k --accelerator v4-128 \
      --mfu 0.5 --config.batch_size=2048
  # On a v4-128 at the MFU the TPU compiler estimates for the train step at the same 64 images
  # per chip (the pre-flight compiles it for a v4-8 here, no TPU needed).
  python -m vit_jax.preflight --config configs/vit.py:l16,imagenet21k --accelerator v4-8 \
      --config.batch_size=256 --json l16_v4.json
  python -m vit_jax.cost --config configs/vit.py:l16,imagenet21k --accelerator v4-128 \
      --preflight l16_v4.json
  # The ViT paper's Table 2: the MFU that each reported TPUv3-core-days figure implies.
  python -m vit_jax.cost --table2
  # A run's ledger (finished or running), and its stacked bar figure in WORKDIR/cost.png.
  python -m vit_jax.cost /tmp/vit_run --figure /tmp/vit_run_cost.png

Training FLOPs = 3 x 2 x forward MACs (`vit_jax.flops`) x batch x steps; wall time = FLOPs /
(MFU x the accelerator's peak); core-days = wall days x TensorCores. Evaluation, compilation and
input stalls are not included. With a WORKDIR it reads what the run measured (`vit_jax.ledger`).
Details: docs/compute_cost.md.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Optional

from absl import logging

from vit_jax import cli
from vit_jax import hardware
from vit_jax import platform
from vit_jax import rundir
from vit_jax import storage
from vit_jax.tools import common

# Split sizes and classes of large or manually downloaded datasets, so that an estimate needs no
# data. ImageNet-21k: the fall 2011 release (14M images), the official checkpoints' classes.
KNOWN_DATASETS = {
    "imagenet2012": ({"train": 1_281_167, "validation": 50_000}, 1000),
    "imagenet21k": ({"train": 14_197_122}, 21_843),
    "cifar10": ({"train": 50_000, "test": 10_000}, 10),
    "cifar100": ({"train": 50_000, "test": 10_000}, 100),
    "oxford_iiit_pet": ({"train": 3_680, "test": 3_669}, 37),
    "oxford_flowers102": ({"train": 1_020, "validation": 1_020, "test": 6_149}, 102),
    "fashion_mnist": ({"train": 60_000, "test": 10_000}, 10),
    "fashion_mnist_local": ({"train": 60_000, "test": 10_000}, 10),
}


def split_size(split: str, sizes: dict[str, int]) -> int:
  """Examples in a tfds split spec ('train[:99%]', 'train+validation') of splits of `sizes`.
  Raises ValueError for a split not in `sizes`."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  infos = {name: tfds.core.SplitInfo(name=name, shard_lengths=[n], num_bytes=0,
                                     filename_template=None) for name, n in sizes.items()}
  try:
    parts = tfds.core.ReadInstruction.from_spec(split).to_absolute(infos)
  except (KeyError, ValueError, AssertionError) as e:
    raise ValueError(f"Split {split!r} does not fit the splits {sorted(sizes)}: {e}") from e
  return sum((p.to if p.to is not None else sizes[p.splitname]) - (p.from_ or 0) for p in parts)


def dataset_facts(config, num_train_examples=None, num_classes=None) -> tuple[int, int, str]:
  """(train examples, classes, where they come from) for `config.data`. Raises ValueError for
  an unknown dataset that is not prepared (naming the flags to give)."""
  name = config.data.image_folder or config.data.name
  for flag, value in (("num_train_examples", num_train_examples), ("num_classes", num_classes)):
    if value is not None and value <= 0:
      raise ValueError(f"--{flag}={value} must be positive.")
  if num_train_examples and num_classes:
    return num_train_examples, num_classes, "given"
  if name in KNOWN_DATASETS:
    sizes, classes = KNOWN_DATASETS[name]
    return (num_train_examples or split_size(config.data.train_split, sizes),
            num_classes or classes, f"{name}'s published size")
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  try:
    info = data.get_info(config.data)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"Cannot size the dataset {name!r} ({e}). Give --num_train_examples=N and "
        "--num_classes=C.") from e
  return (num_train_examples or info.num_train_examples, num_classes or info.num_classes,
          "the prepared dataset")


def preflight_mfu(path: str, config, accelerator: str) -> tuple[float, str]:
  """(The train step's MFU that a pre-flight estimated, `python -m vit_jax.preflight --json
  FILE`; where it is from) for `config` on `accelerator`. Raises ValueError: no such file, no
  estimate in it, or another model, TPU kind or compute dtype than the config's."""
  from vit_jax import accounting  # pylint: disable=g-import-not-at-top  (after the flags)
  fix = "give the file that python -m vit_jax.preflight --json wrote"
  try:
    report = rundir.read_json(path, fix=fix)
  except OSError as e:
    raise ValueError(f"--preflight {path}: {e}") from e
  if report is None:
    raise ValueError(f"--preflight {path}: no such file; write it with python -m "
                     f"vit_jax.preflight --config ... --accelerator ... --json {path}.")
  if not isinstance(report.get("steps"), dict) or "device_kind" not in report:
    raise ValueError(f"{path} is not a pre-flight report; {fix}.")
  mfu = report.get("mfu")
  if not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
    why = (report["steps"].get("train") or {}).get("estimate_note") or "no train step"
    raise ValueError(f"{path} has no estimated MFU of the train step ({why}).")
  hw = accounting.accelerator(accelerator, str(config.model.dtype))
  for key, mine, what in (("model", config.model_name, "model"),
                          ("device_kind", hw.device_kind, f"TPU kind ({accelerator})"),
                          ("dtype", str(config.model.dtype), "compute dtype")):
    if report.get(key) != mine:
      raise ValueError(f"{path} estimates {key} {report.get(key)!r}, but this run's {what} is "
                       f"{mine!r}: its MFU does not carry over. Pre-flight this config for a "
                       f"{hw.device_kind} slice, or give the --accelerator it was made for.")
  theirs = report.get("batch_per_device")
  per_device = config.batch_size / hw.num_devices
  source = (f"the TPU compiler's estimate of the train step on {report.get('accelerator')} at "
            f"{theirs:,} images per device, from {path}" if isinstance(theirs, int) else
            f"the TPU compiler's estimate of the train step, from {path}")
  if per_device != theirs:
    source += f"; this run has {per_device:,.4g} per device"
  return float(mfu), source


def estimate(config, accelerator: str, mfu: float, num_train_examples=None,
             num_classes=None, mfu_source: Optional[str] = None) -> dict:
  """The predicted cost of training `config` on `accelerator` at utilisation `mfu` (assumed, or
  from `mfu_source`): a dict of model, parameters, image_size, forward_macs (per image), steps,
  images, training_flops, hardware (`accounting.Hardware`), mfu, dataset (where its size came
  from), days (wall), device_days, core_days and chip_days (None off TPUs). Raises ValueError."""
  import jax  # pylint: disable=g-import-not-at-top  (after the flags: fewshot's --help too)
  from vit_jax import accounting, flops, models, step  # pylint: disable=g-import-not-at-top
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top

  if not 0 < mfu <= 1:
    raise ValueError(f"--mfu={mfu} must be in (0, 1], e.g. 0.35 for 35%.")
  if config.batch_size <= 0:
    raise ValueError(f"config.batch_size={config.batch_size} must be positive.")
  config = config_lib.fill_regime(config)  # An unlocked copy; the regime's fields filled.
  hw = accounting.accelerator(accelerator, str(config.model.dtype))
  examples, classes, source = dataset_facts(config, num_train_examples, num_classes)
  steps = config_lib.num_train_steps(config, examples)
  if config.num_classes is None:
    config.num_classes = classes
  # Every attention and remat policy does the same products: count with ones any host traces.
  model = step.create_model(config_lib.for_counting(config))
  size = config.data.image_size
  macs = flops.model_forward_macs(model, (size, size, 3))
  variables = models.unbox(models.abstract_variables(model, (size, size)))
  parameters = sum(x.size for x in jax.tree.leaves(variables["params"]))
  images = steps * config.batch_size
  training = flops.training_flops(macs, images)
  seconds = training / (mfu * hw.peak_flops_per_device * hw.num_devices)
  days = seconds / accounting.SECONDS_PER_DAY
  return {
      "model": config.model_name, "parameters": parameters, "image_size": size,
      "forward_macs": macs, "batch_size": config.batch_size, "steps": steps, "images": images,
      "epochs": images / examples, "train_examples": examples, "dataset": source,
      "training_flops": training, "hardware": hw, "mfu": mfu, "mfu_source": mfu_source,
      "days": days,
      "device_days": days * hw.num_devices,
      "core_days": days * hw.cores if hw.cores else None,
      "chip_days": days * hw.chips if hw.chips else None,
  }


def format_estimate(est: dict, accelerator: str) -> str:
  """The estimate as an aligned two-column table."""
  hw = est["hardware"]
  rows = [
      ("model", f"{est['model']}, {est['parameters']:,} parameters, {est['image_size']} px"),
      ("forward pass", f"{2 * est['forward_macs'] / 1e9:,.2f} GFLOPs per image "
                       f"({est['forward_macs'] / 1e9:,.2f} G multiply-adds, matmuls only)"),
      ("schedule", f"{est['steps']:,} steps of {est['batch_size']:,} images = "
                   f"{est['images']:.4g} images ({est['epochs']:.4g} epochs of "
                   f"{est['train_examples']:,}, {est['dataset']})"),
      ("training", f"{est['training_flops']:.4g} FLOPs (3 forward passes per image)"),
      ("accelerator", f"{accelerator}: {hw.describe()}"),
      ("MFU", f"{est['mfu']:.1%} ({est['mfu_source']})") if est.get("mfu_source") else
      ("assumed MFU", f"{est['mfu']:.0%}"),
      ("wall time", f"{est['days']:,.2f} days ({est['days'] * 24:,.1f} hours)"
                    if est["days"] >= 0.1 else f"{est['days'] * 24 * 60:,.3g} minutes"),
  ]
  if est["core_days"] is not None:
    rows.append(("TPU-core-days", f"{_days(est['core_days'])} {hw.device_kind} core-days "
                                  f"({_days(est['chip_days'])} chip-days)"))
  else:
    rows.append(("device-days", f"{_days(est['device_days'])} {hw.device_kind} device-days"))
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _days(days: float) -> str:
  """'251.3' for large figures, three significant digits for small ones ('0.00412')."""
  return f"{days:,.1f}" if days >= 10 else f"{days:.3g}"


def table2() -> str:
  """The ViT paper's Table 2 compute column (Markdown), each count checked by tracing."""
  from vit_jax import flops, models  # pylint: disable=g-import-not-at-top
  for run in flops.TABLE2:
    model = models.create(run.model.replace("/", "_"), num_classes=run.num_classes,
                          representation_size=run.hidden_size)
    traced = flops.model_forward_macs(model, (run.image_size, run.image_size, 3))
    if traced != run.forward_macs:
      raise AssertionError(f"{run.model}: traced {traced} MACs, formula {run.forward_macs}.")
  return flops.table2_markdown()


#: The figure's colour of each `ledger_lib.SEGMENTS` part.
COLORS = {"training": "#2e7d32", "redone": "#c62828", "compile": "#6a1b9a", "eval": "#1565c0",
          "input": "#ef6c00", "checkpoint": "#5d4037", "setup": "#f9a825", "other": "#9e9e9e"}


def read_workdir(workdir: str) -> tuple[dict[str, Any], str]:
  """(the latest cost account of the run in `workdir`, a line on where it is from and whether the
  run holds the workdir): cost.json's, or the latest checkpoint's when it holds more program
  time (`accounting.latest_report`). Raises ValueError: no account there (naming the fix)."""
  from vit_jax import accounting  # pylint: disable=g-import-not-at-top  (JAX: after the flags)
  if not storage.isdir(workdir):
    raise ValueError(f"WORKDIR {workdir} is not a directory; give the --workdir of a run of "
                     "python -m vit_jax.main.")
  cost_json = storage.join(workdir, rundir.COST_JSON)
  fix = "restore it, or delete it to see the latest checkpoint's account"
  disk = rundir.read_json(cost_json, fix=fix)
  if disk is not None:
    accounting.check_report(disk, cost_json, fix)
  saved, saved_step = None, None
  checkpoints = storage.join(workdir, rundir.CHECKPOINTS_DIR)
  for saved_step in reversed(rundir.saved_steps(checkpoints)):
    item = storage.join(checkpoints, str(saved_step), rundir.COST_ITEM, "metadata")
    try:
      saved = rundir.read_json(item)
      saved = saved and accounting.check_report(saved, item)
    except (ValueError, OSError):  # Damaged: an earlier step's account.
      saved = None
    if saved:
      break
  report = accounting.latest_report(saved, disk)
  if report is None:
    raise ValueError(
        f"{workdir} has no cost account: expected {cost_json}, which python -m vit_jax.main "
        "writes at every config.log_every_steps and at the end (a run that has not logged its "
        "first steps has none yet). Give the --workdir of a training run, or --config=FILE to "
        "predict a run's cost.")
  where = (f"checkpoint {saved_step}" if report is saved and report is not disk else
           f"{cost_json}, written "
           f"{accounting.duration(max(0.0, time.time() - storage.mtime(cost_json)))} ago")
  try:
    lock = rundir.read_json(storage.join(workdir, rundir.LOCK_JSON))
  except (ValueError, OSError):  # A damaged lock: its holder unknown.
    lock = {}
  return report, f"{workdir}: the account at step {report['step']} ({where}); {_holder(lock)}."


def _holder(record: Optional[dict[str, Any]]) -> str:
  """Whether a run holds the workdir, from its lock.json record (`vit_jax.checkpoint.lock`)."""
  if record is None:
    return "no run holds the workdir (finished, stopped or refused)"
  host, pid = record.get("host", "?"), record.get("pid", "?")
  if host == socket.gethostname() and isinstance(pid, int):
    if not common.pid_alive(pid):
      return f"lock.json names pid {pid} of this host, which is gone: the run was killed"
    return f"running: pid {pid} of this host holds the workdir (figures as of its last log step)"
  return (f"lock.json names pid {pid} of host {host}: running there (figures as of its last log "
          "step), or killed")


def write_figure(report: dict[str, Any], path: str) -> None:
  """A stacked bar per attempt of `report`'s ledger (`vit_jax.ledger`): its segments in
  device- or core-time, as a PNG at `path` (local or gs://). Raises OSError."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (optional, slow)
  from vit_jax import ledger as ledger_lib  # pylint: disable=g-import-not-at-top
  from vit_jax.analysis import figures  # pylint: disable=g-import-not-at-top
  rows = ledger_lib.ledger(report)
  unit, kind = report["hardware"]["unit"], report["hardware"]["device_kind"]
  largest = max([r["program_s"] * r["units"] for r in rows] + [1.0])
  name, scale = next((n, s) for n, s in (("days", 86_400.0), ("hours", 3600.0),
                                         ("minutes", 60.0), ("seconds", 1.0)) if largest >= s)
  figure = Figure(figsize=(max(5.0, 1.4 * len(rows) + 3.5), 4.5), dpi=100, layout="constrained")
  axes = figure.add_subplot()
  x = list(range(len(rows)))
  bottom = [0.0] * len(rows)
  for segment in ledger_lib.SEGMENTS:
    heights = [r["segments"][segment] * r["units"] / scale for r in rows]
    axes.bar(x, heights, bottom=bottom, color=COLORS[segment], width=0.6,
             label=ledger_lib.SEGMENT_TITLES[segment])
    bottom = [b + h for b, h in zip(bottom, heights)]
  axes.set_xticks(x, [f"attempt {r['attempt']}\nsteps {r['start_step']}-{r['end_step']}"
                      for r in rows])
  axes.set_ylabel(f"{kind} {unit}-{name}")
  axes.set_ylim(0, 1.08 * max(bottom + [1e-9]))
  value = report.get("goodput")
  axes.set_title(f"Where the {unit}-time went: goodput "
                 f"{'unknown' if value is None else format(value, '.1%')}")
  handles, labels = axes.get_legend_handles_labels()
  axes.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize="small")
  figures.write_png(figure, path)


def show_workdir(workdir: str, figure: Optional[str]) -> int:
  """Prints the ledger of the run in `workdir` and writes its figure (default WORKDIR/cost.png);
  returns 0. Raises ValueError (no account there) or WorkFailed (e.g. the figure not written)."""
  from vit_jax import ledger as ledger_lib  # pylint: disable=g-import-not-at-top
  with common.output_errors():
    report, where = read_workdir(workdir)
    print(where)
    print(ledger_lib.format_ledger(report))
    figure = figure or storage.join(workdir, "cost.png")
    write_figure(report, figure)
  print(f"Figure: {figure}")
  return 0


def config_parser(prog: str, doc: str) -> common.Parser:
  """A parser with the help `doc`, --config (its --config.key=value overrides are left to
  `parse`), --num_train_examples and --num_classes (`dataset_facts`)."""
  parser = common.Parser(prog=prog, description=doc)
  parser.add_argument("--config", metavar="FILE.py[:ARGS]", help="Training config as for "
                      "vit_jax.main: configs/<file>.py[:<args>], --config.key=value overrides.")
  parser.add_argument("--num_train_examples", type=int, help="Examples in config.data.train_split "
                      "(default: a known dataset's size, else the prepared tfds dataset's).")
  parser.add_argument("--num_classes", type=int, help="Classes of the dataset (default: as for "
                      "--num_train_examples).")
  parser.add_argument("--print_config", action="store_true", help="Print every key of the "
                      "--config (or the defaults) as the --config.KEY=VALUE flag that sets it, "
                      "with its help, and exit.")
  return parser


def parse(parser: common.Parser, argv=None):
  """(`parser`'s arguments, the config of --config with the --config.key=value overrides, loaded
  as `vit_jax.main` does: `cli.load_config`, None without --config). Raises ValueError."""
  args, rest = parser.parse_known_args(argv)
  return args, cli.load_config(([f"--config={args.config}"] if args.config else []) + rest)


def _parser() -> common.Parser:
  parser = config_parser("python -m vit_jax.cost", __doc__)
  parser.add_argument("workdir", nargs="?", metavar="WORKDIR", help="A run's --workdir: print its "
                      "cost ledger per attempt and its goodput, and draw it (--figure).")
  parser.add_argument("--figure", metavar="PATH", help="With WORKDIR: the PNG of the stacked "
                      "bars (default WORKDIR/cost.png).")
  parser.add_argument("--accelerator", default="v3-8", help="Cloud TPU type (v3-8, v4-32, "
                      "v5p-8: cores; v5litepod-16, v6e-8: chips) or GPUs (a100-8); default v3-8.")
  parser.add_argument("--mfu", type=float, help="Assumed model FLOP utilisation, 0..1 (default "
                      "0.35; Table 2 implies 0.22 to 0.38: --table2).")
  parser.add_argument("--preflight", metavar="FILE", help="Instead of --mfu: the train step's "
                      "MFU that python -m vit_jax.preflight --json FILE estimated for this "
                      "config on the --accelerator's TPU kind, at the planned per-device batch.")
  parser.add_argument("--table2", action="store_true", help="Print the ViT paper's Table 2 "
                      "compute column with the MFU each TPUv3-core-days figure implies.")
  return parser


@common.exit_status
def main(argv=None) -> int:
  args, config = parse(_parser(), argv)
  if args.print_config:
    print(cli.config_help(config, args.config))
    return 0
  if args.workdir is not None:
    if config is not None or args.table2:
      raise ValueError("Give a WORKDIR (a run's ledger) or --config / --table2 (a "
                       "prediction), not both.")
    return show_workdir(args.workdir, args.figure)
  if args.figure:
    raise ValueError("--figure draws a run's ledger: give its WORKDIR.")
  if args.table2:
    print(table2())
    print("\nAssumptions: forward FLOPs of the matrix products at 224 px with a representation "
          "layer of width D; training = 3 forward passes; ImageNet-21k = 14M images, JFT-300M "
          f"= 303M; a TPU v3 core peaks at {hardware.kind('TPU v3').peak['bfloat16'] / 1e12:g} "
          "TFLOP/s (bfloat16).")
    return 0
  if config is None:
    raise ValueError("Give --config=configs/<file>.py[:<args>] (or --table2, or a run's "
                     "WORKDIR); --help explains.")
  mfu = 0.35 if args.mfu is None else args.mfu
  source = None
  if args.preflight:
    if args.mfu is not None:
      raise ValueError("Give --mfu (assumed) or --preflight FILE (estimated), not both.")
    mfu, source = preflight_mfu(args.preflight, config, args.accelerator)
  est = estimate(config, args.accelerator, mfu, args.num_train_examples, args.num_classes,
                 mfu_source=source)
  print(format_estimate(est, args.accelerator))
  return 0


def run_main() -> None:
  common.run_program(main, setup=lambda: logging.get_absl_handler().addFilter(
      platform.QuietLibraries()))
