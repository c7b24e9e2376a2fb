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

Every config field can be overridden with --config.<key>=<value> (e.g.
--config.model.num_layers=4); --print_config lists them with their help (docs/configs.md).
Rerunning the same command resumes from the latest checkpoint in DIR; TensorBoard events, the
resolved config.json and cost.json go to DIR. Where glibc allows, the command re-executes itself
with huge pages for malloc (VIT_JAX_HUGE_PAGES=0: not).

Exit codes: 0 done; 1 failed (the message says which checkpoint is intact); 2 a bad config or
flag, an unusable fine-tuning checkpoint or a workdir in use, found before any work; 75
preempted (SIGTERM) and 130 interrupted (a first Ctrl-C): the current step was saved (during the
set-up: stopped at once, nothing saved), rerun the same command to resume. Every exit comes with
one line saying why (a failure's starts with FATAL:); docs/failures.md has them all."""

import sys
import traceback

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import vit_jax
from vit_jax import cli
from vit_jax import platform
from vit_jax import pod
from vit_jax import stops

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
    "num_processes", None,
    "Number of processes (or $JAX_NUM_PROCESSES), with --coordinator_address.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index in [0, num_processes) (or $JAX_PROCESS_ID).")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print every key of the --config (overrides and the regime "
    "applied; without --config: the defaults) as the --config.KEY=VALUE flag that sets it, with "
    "one line of help, and exit.")
_DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout", pod.DISTRIBUTED_TIMEOUT_S, "Multi-process runs (TPU pods "
    "included): seconds that every process waits for all the others to register, and after "
    "which a process that sends no heartbeat counts as dead; either ends every process with "
    "exit code 1 and a FATAL line.", lower_bound=1)


def _fatal(error: BaseException, code: int, line: str = "") -> None:
  """A FATAL line (`line`, default `FATAL: <error>`), exit `code`; --verbosity=1: traceback too."""
  stop = stops.stop_in(error)  # A stop during the set-up that a library wrapped.
  if stop is not None:
    stops.exit_stopped(stop)
  line = line or f"FATAL: {error}"
  if logging.get_verbosity() >= 1:
    traceback.print_exception(error)
    stops.exit_process(code, line)
  stops.exit_process(code, f"{line}\n(--verbosity=1 shows the traceback.)")


def _latest_step(workdir: str):
  """The latest saved step in `workdir`, or None (also when it cannot be read)."""
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top
  try:
    return max(checkpoint.Workdir(workdir).saved_steps(), default=None)
  except Exception:  # pylint: disable=broad-except
    return None


def main(argv):
  if _PRINT_CONFIG.value:
    print(cli.config_help(_CONFIG.value, cli.config_spec(sys.argv)))
    return
  try:
    if len(argv) > 1:
      raise ValueError(f"Unexpected arguments: {' '.join(argv[1:])} (flags take the form "
                       "--flag=value; --help lists them).")
    if _CONFIG.value is None or not _WORKDIR.value:
      raise ValueError("Give --config=configs/<file>.py[:<args>] and --workdir=DIR (local or "
                       "gs://); --help explains.")
    platform.setup(coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                   process_id=_PROCESS_ID.value, distributed_timeout_s=_DISTRIBUTED_TIMEOUT.value)
  except ValueError as e:
    sys.stderr.write(f"FATAL: {e}\n")
    sys.exit(2)
  # Imported here so that --help and flag errors answer before TensorFlow and JAX load.
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from vit_jax import train  # pylint: disable=g-import-not-at-top
  try:
    given = config_flags.get_override_values(flags.FLAGS["config"])
    config = config_lib.switch_regime(_CONFIG.value, given=given)  # Keeps what the flags set.
    if config.get("model_name") == "auto" and "model.num_heads" not in given:
      config.model.num_heads = None  # The weights' heads, or asked for by name: not the file's.
  except ValueError as e:
    _fatal(e, 2, f"FATAL: {cli.error_text(e)}")
  try:
    results = train.train_and_evaluate(config, _WORKDIR.value, program_start=vit_jax.STARTED)
  except train.ConfigError as e:
    _fatal(e, 2, f"FATAL: {cli.error_text(e)}")
  except train.Preempted as e:
    logging.warning("%s", e)  # Every process stops at this step: jax.distributed shuts down.
    if e.interrupted:
      code = stops.INTERRUPTED_EXIT_CODE
    else:
      code = stops.PREEMPTED_EXIT_CODE
    stops.exit_process(code, shutdown=not e.interrupted)
  except (train.CheckpointSaveError, FloatingPointError, train.data.BadImageError) as e:
    _fatal(e, 1)
  except KeyboardInterrupt:  # A second Ctrl-C: a save in flight completed, the lock released.
    stops.exit_process(stops.INTERRUPTED_EXIT_CODE, (
        f"Interrupted (Ctrl-C): rerun the same command to resume from the latest checkpoint in "
        f"{_WORKDIR.value}."))
  except Exception as e:  # pylint: disable=broad-except
    import jax  # pylint: disable=g-import-not-at-top
    from vit_jax import storage  # pylint: disable=g-import-not-at-top
    failure = storage.failure(e)  # E.g. a gs:// init_from without a network.
    if failure:
      _fatal(e, failure[1], f"FATAL: {failure[0]}")
    if jax.process_count() == 1 or stops.stop_in(e):
      raise  # A bug (its traceback), or a stop during the set-up that an import wrapped.
    stop = stops.received_stop()  # The others stopped too: not a fault.
    if stop is not None:
      stops.exit_stopped(stop)
    # A pod: a collective or barrier failed because another process died (gloo's 'Connection
    # reset by peer', a barrier's DEADLINE_EXCEEDED). Ended here, before jax's exit handler
    # would wait for the lost process until jax aborts.
    _fatal(e, pod.POD_FAULT_EXIT_CODE, stops.peer_lost_message(
        e, _WORKDIR.value, _latest_step(_WORKDIR.value)))
  step = results.pop("step")
  print(f"Final evaluation at step {step}: "
        + ", ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())), flush=True)
  stops.exit_process(0, shutdown=True)


if __name__ == "__main__":
  pod.supervise(sys.argv)  # A pod: the same command as a child, for a FATAL line on any end.
  platform.reexec_with_huge_pages()  # First: glibc reads its tunables only at process start.
  platform.quiet_native_logs()  # Before a config file loads JAX.
  stops.stop_at_once_on_signals()  # Before JAX and TensorFlow load (seconds).
  try:
    app.run(main, flags_parser=cli.parse_flags)
  except BaseException as e:  # pylint: disable=broad-except
    stop = stops.stop_in(e)  # In the set-up: nothing to save.
    if stop is None:
      raise
    stops.exit_stopped(stop)
