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
that names it. The config printed at the start lists every field with its value; the model's
are its architecture plus how the blocks run: --config.model.scan / remat (True by default
for training; False/False for the plain unrolled model) and --config.model.remat_policy (one
of vit_jax.models.vit.REMAT_POLICIES). Rerunning the same command with the same --workdir
resumes from the latest checkpoint there; checkpoints go to DIR/checkpoints, TensorBoard
events to DIR, the run's compute cost (TPU-core-days, FLOPs, MFU; all attempts) to
DIR/cost.json. To predict a run's cost before starting it:
python -m vit_jax.cost --config ... --accelerator v3-256.

On Linux with glibc >= 2.35 and the kernel's transparent huge pages on 'madvise' or 'always',
the command first re-executes itself with glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES, so
that XLA:CPU's step buffers get huge pages instead of a page fault per 4 KiB at every step
(about 10% of a small model's CPU step). VIT_JAX_HUGE_PAGES=0 turns this off; a
glibc.malloc.hugetlb already in GLIBC_TUNABLES is kept (vit_jax.cli.huge_pages_environment).
On a CPU, attention runs in vit_jax's fused kernel (vit_jax.models.fused_attention; built at
install time with a C++ compiler) for float32 attention with a head size divisible by 16 and no
attention dropout, on one device; the log says which attention the training step runs, and
VIT_JAX_FUSED_ATTENTION=0 turns the kernel off.

Exit codes: 0 done; 1 failed (e.g. the loss diverged, a checkpoint could not be saved: the message
says which checkpoint is intact); 2 a bad config or flag, found before any work; 75 preempted
(SIGTERM): the checkpoint of the current step was saved, rerun the same command to resume.
"""

import os
import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import vit_jax
from vit_jax import cli

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


def _on_multi_host_tpu() -> bool:
  """A Cloud TPU VM that is one worker of several (before any JAX backend starts)."""
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if "," in hosts:
    return True
  accelerator = os.environ.get("TPU_ACCELERATOR_TYPE", "")  # e.g. 'v3-32'
  match = re.fullmatch(r"v\d+[a-z]*-(\d+)", accelerator)
  # The number counts TensorCores (v2-v5p) or chips (v5e, v6e); one host has at most 8.
  return bool(match) and int(match.group(1)) > 8


def initialize_distributed() -> None:
  """Calls `jax.distributed.initialize` when this is one process of several.

  Explicit: --coordinator_address/--num_processes/--process_id or the JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES, JAX_PROCESS_ID environment variables (CPU and GPU clusters; on CPU the
  cross-process collectives use gloo). Automatic: a multi-host Cloud TPU slice (its metadata
  names several workers). A single process does nothing.
  """
  import jax  # pylint: disable=g-import-not-at-top
  address = _COORDINATOR.value or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    num = _NUM_PROCESSES.value or int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None
    pid = _PROCESS_ID.value if _PROCESS_ID.value is not None else (
        int(os.environ["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in os.environ else None)
    if num is None or pid is None:
      raise app.UsageError("--coordinator_address needs --num_processes and --process_id (or "
                           "JAX_NUM_PROCESSES and JAX_PROCESS_ID).")
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
  elif _on_multi_host_tpu():
    jax.distributed.initialize()  # Finds the coordinator and the workers from the TPU metadata.
  if jax.process_count() > 1:
    logging.info("Process %d of %d; %d local of %d devices.", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  logging.get_absl_handler().addFilter(cli.QuietLibraries())
  if cli.HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
    logging.info("malloc: transparent huge pages for large allocations (GLIBC_TUNABLES=%s).",
                 os.environ["GLIBC_TUNABLES"])
  initialize_distributed()
  from vit_jax.models import fused_attention  # pylint: disable=g-import-not-at-top
  try:
    fused_attention.enabled()
  except ValueError as e:  # VIT_JAX_FUSED_ATTENTION is neither on nor off.
    sys.stderr.write(f"FATAL: {e}\n")
    sys.exit(2)
  # Imported here so that --help and flag errors answer before TensorFlow and JAX load.
  from vit_jax import train  # pylint: disable=g-import-not-at-top
  logging.info("Config:\n%s", _CONFIG.value)
  try:
    results = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                                       program_start=vit_jax.STARTED)
  except train.ConfigError as e:
    if logging.get_verbosity() >= 1:
      raise
    sys.stderr.write(f"FATAL: {e}\n(--verbosity=1 shows the traceback.)\n")
    sys.exit(2)
  except train.Preempted as e:
    logging.warning("%s", e)
    sys.exit(train.PREEMPTED_EXIT_CODE)
  except (train.CheckpointSaveError, FloatingPointError, train.data.BadImageError) as e:
    if logging.get_verbosity() >= 1:
      raise
    sys.stderr.write(f"FATAL: {e}\n(--verbosity=1 shows the traceback.)\n")
    sys.exit(1)
  step = results.pop("step")
  print(f"Final evaluation at step {step}: "
        + ", ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())), flush=True)


if __name__ == "__main__":
  cli.reexec_with_huge_pages()  # Huge pages for XLA:CPU's step buffers (see its docstring).
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's C++ INFO lines.
  app.run(main, flags_parser=cli.parse_flags)
