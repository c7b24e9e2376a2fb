r"""Trains and evaluates a Vision Transformer: pretraining or fine-tuning, one CPU to a TPU pod.

Usage:
  python -m vit_jax.main --config configs/<file>.py[:<args>] --workdir DIR [--config.key=value ...]

Examples:
  # ViT on Fashion-MNIST from scratch, offline, on a CPU (the README's main job).
  python -m vit_jax.main --config configs/fashion_mnist.py --workdir /tmp/vit_fmnist
  # ViT-B/16 on ImageNet (tfds 'imagenet2012', manual download), pretraining regime.
  python -m vit_jax.main --config configs/vit.py:b16,imagenet2012 --workdir gs://bucket/b16 \
      --config.data.data_dir=gs://bucket/tensorflow_datasets
  # ViT-B/16 fine-tuning schedule on CIFAR-10 (SGD momentum, cosine, grad clip 1, 10k steps).
  python -m vit_jax.main --config configs/vit.py:b16,cifar10,finetune --workdir /tmp/b16_c10
  # Any regime field alone: --config.regime=finetune switches optimizer, schedule and loss.

Every config field can be overridden with --config.<key>=<value> (nested keys with dots, e.g.
--config.model.num_layers=4, --config.data.image_size=384); an unknown key stops with an error
that names it. The log starts with the resolved config, the one that runs (regime filled in,
schedule in steps), also saved as DIR/config.json. The model's fields are its architecture plus
how it runs: --config.model.scan / remat (True by default for training; False/False for the
plain unrolled model), --config.model.remat_policy ('auto', the default, picks from the devices,
the compute dtype and the width; or one of vit_jax.models.execution.REMAT_POLICIES)
and --config.model.attention: 'auto' (default) picks from the devices the step runs on: XLA's
attention on TPU, cuDNN's on GPU in bfloat16, and on a one-device CPU vit_jax's fused kernel
where it is built and faster than XLA's on this CPU (float32, head size divisible by 16, no
attention dropout); 'xla', 'cudnn' or 'cpu_kernel' insist on one. The log says which ran and why.

Rerunning the same command with the same --workdir resumes from the latest checkpoint there;
checkpoints go to DIR/checkpoints, TensorBoard events to DIR, the run's compute cost
(TPU-core-days, FLOPs, MFU; all attempts) to DIR/cost.json. To predict a run's cost before
starting it: python -m vit_jax.cost --config ... --accelerator v3-256.

On Linux with glibc >= 2.35 and transparent huge pages on 'madvise' or 'always', the command first
re-executes itself with glibc.malloc.hugetlb=1 in GLIBC_TUNABLES, so that XLA:CPU's step buffers
get huge pages instead of a page fault per 4 KiB at every step; VIT_JAX_HUGE_PAGES=0 turns this
off (vit_jax.platform).

Exit codes: 0 done; 1 failed (e.g. the loss diverged, a checkpoint could not be saved: the message
says which checkpoint is intact); 2 a bad config or flag, an unusable fine-tuning checkpoint
or a workdir in use by another run, found before any work; 75 preempted (SIGTERM): the
checkpoint of the current step was saved, rerun the same command to resume; 130 interrupted
(Ctrl-C): the first saves the current step and stops (a second stops at once, without that
save); rerun the same command to resume.
"""

import sys
import traceback

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import vit_jax
from vit_jax import cli
from vit_jax import platform

#: The exit code after Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED_EXIT_CODE = 130

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training config: a configs/*.py file, optionally ':<arg>' for its "
    "get_config(arg), e.g. configs/vit.py:b16,imagenet2012.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory (local or gs://) for checkpoints and TensorBoard logs; "
    "reusing it resumes the run.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-process runs on CPU/GPU clusters: host:port of process "
    "0 (or $JAX_COORDINATOR_ADDRESS). TPU pods need none of these: every worker runs the same "
    "command and jax.distributed finds the others.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes (or $JAX_NUM_PROCESSES), with --coordinator_address.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index in [0, num_processes) (or $JAX_PROCESS_ID).")
flags.mark_flags_as_required(["config", "workdir"])


def _fatal(error: Exception, code: int) -> None:
  """One FATAL line and exit `code`; with --verbosity=1 the traceback first (same exit code)."""
  if logging.get_verbosity() >= 1:
    traceback.print_exception(error)
    sys.stderr.write(f"FATAL: {error}\n")
  else:
    sys.stderr.write(f"FATAL: {error}\n(--verbosity=1 shows the traceback.)\n")
  sys.exit(code)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  try:
    platform.setup(coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                   process_id=_PROCESS_ID.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  # Imported here so that --help and flag errors answer before TensorFlow and JAX load.
  from vit_jax import train  # pylint: disable=g-import-not-at-top
  try:
    results = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                                       program_start=vit_jax.STARTED)
  except train.ConfigError as e:
    _fatal(e, 2)
  except train.Preempted as e:
    logging.warning("%s", e)
    sys.exit(INTERRUPTED_EXIT_CODE if e.interrupted else train.PREEMPTED_EXIT_CODE)
  except (train.CheckpointSaveError, FloatingPointError, train.data.BadImageError) as e:
    _fatal(e, 1)
  except KeyboardInterrupt:  # A second Ctrl-C: a save in flight completed, the lock released.
    sys.stderr.write(f"Interrupted (Ctrl-C): rerun the same command to resume from the latest "
                     f"checkpoint in {_WORKDIR.value}.\n")
    sys.exit(INTERRUPTED_EXIT_CODE)
  step = results.pop("step")
  print(f"Final evaluation at step {step}: "
        + ", ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())), flush=True)


if __name__ == "__main__":
  platform.reexec_with_huge_pages()  # First: glibc reads its tunables only at process start.
  app.run(main, flags_parser=cli.parse_flags)
