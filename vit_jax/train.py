"""The training loop: pretraining or fine-tuning, with evaluation and Orbax checkpoints.

`train_and_evaluate` reads top to bottom, phase by phase; every refusal comes in the config phase,
before any write. One `accounting.CostAccountant` times every part and reports the run's cost."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Callable, Optional

from absl import logging
import jax
import ml_collections
import numpy as np

from vit_jax import accounting
from vit_jax import checkpoint
from vit_jax import config as config_lib
from vit_jax import data
from vit_jax import evaluation
from vit_jax import flops
from vit_jax import kernels
from vit_jax import ledger as ledger_lib
from vit_jax import param_groups
from vit_jax import pod
from vit_jax import progress
from vit_jax import rundir
from vit_jax import sharding
from vit_jax import step as step_lib
from vit_jax import stops
from vit_jax import storage
from vit_jax.checkpoint import CheckpointSaveError  # noqa: F401  (re-exported: main catches it)
from vit_jax.evaluation import fewshot
from vit_jax.evaluation import pictures as pictures_lib


class ConfigError(ValueError):
  """A config that cannot run, found before any work starts; the message says what to change."""


class Preempted(Exception):
  """Saved the checkpoint of `step`, then stopped at SIGTERM or a first Ctrl-C (`interrupted`)."""

  def __init__(self, step: int, workdir: str, interrupted: bool = False):
    what = "Interrupted (Ctrl-C)" if interrupted else "Preempted"
    super().__init__(f"{what}: saved the checkpoint of step {step} in {workdir}; rerun the "
                     "same command to resume from it.")
    self.step = step
    self.interrupted = interrupted


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       program_start: Optional[float] = None) -> dict[str, float]:
  """Trains (resuming from `workdir`'s latest checkpoint; a finished run only evaluates again)
  and returns the final evaluation's metrics and 'step'; `program_start`: `time.monotonic()` the
  program started, the start of the cost account (default: now).

  Raises:
    ConfigError: (a ValueError) the config or workdir cannot run, raised before any write.
    FloatingPointError: the loss became NaN or Inf (the last good checkpoint is kept).
    Preempted: SIGTERM or a first Ctrl-C from the first step on, after saving the step.
    vit_jax.stops.StopRequested: SIGTERM or Ctrl-C during the set-up: nothing saved.
    CheckpointSaveError: writing to the workdir failed; earlier checkpoints are intact.
    vit_jax.data.BadImageError: an undecodable image (config.data.bad_images='fail')."""
  with stops.stop_notice() as notice, contextlib.ExitStack() as held:
    # 1. Config: every check before any write; the workdir's lock held from then on.
    with _config_errors():
      run = _prepare(config, workdir, program_start, held)
    config = run.config
    accountant = run.accountant
    # JAX's persistent cache (it writes as it compiles): from here on, once nothing is refused.
    held.enter_context(step_lib.compilation_cache(_compilation_cache_dir(config, workdir)))

    # 2. State: the latest checkpoint, else the fine-tuning initialisation, else a fresh one.
    checkpoints, state, writer = _open_run(run, held)
    start_step = int(state["step"])
    total_steps = config.total_steps

    # 3. Steps: jitted over the mesh, compiled ahead of time and cached (`run.compiler`).
    pictures, evaluate, evaluate_fewshot = _evaluations(run, accountant, writer, notice.agreed)

    def save_cost(step: int, final: bool = False) -> dict[str, Any]:
      """The account to TensorBoard and cost.json; its line to the log at the end."""
      report = accountant.report(step)
      writer.write_scalars(step, accounting.scalars(report))
      level = logging.INFO if final else 1
      logging.log(level, "Step %d: %s", step, accounting.summary(report))
      run.run_dir.write_cost(report)
      return report

    # 4. Loop: step s's metrics are fetched after step s+1 was dispatched (the host never
    # stalls the device); a NaN/Inf loss stops the run one step later at the latest.
    train_iter = data.create_train_iterator(config.data, global_batch_size=config.batch_size,
                                            seed=config.seed, start_step=start_step,
                                            read=run.dataset["read"])
    skipping = config.optim.max_skipped_updates > 0
    window = progress.Progress(accountant, config.batch_size, total_steps, start_step,
                               config.input_wait_warning, progress.input_wait_fix(config.data))
    pending = None  # (step, device metrics) of the step dispatched last.
    results: dict[str, float] = {}

    def save(step: int, state, pending) -> None:
      """Checkpoints `step`, its `pending` metrics checked first (no NaN update is saved)."""
      if pending is not None:
        window.add(_check_finite(*pending, checkpoints, skipping))
      with accountant.timed("checkpoint"):
        checkpoints.save(step, state, cost=accountant.report(step),
                         config=config.to_dict(), dataset=run.dataset)
      logging.info("Checkpoint of step %d: written in the background to %s/%d.", step,
                   checkpoints.directory, step)

    def evaluated(state, step: int, evaluating: bool, fewshot_due: bool) -> bool:
      """Adds the due evaluations of `step` to `results`. False: a stop notice ended one at a
      batch boundary (on a pod, every process at the same batch), its results unwritten."""
      try:
        if evaluating:
          results.update(evaluate(state, step))
        if fewshot_due:
          results.update(evaluate_fewshot(state, step))
      except evaluation.Stopped:
        return False
      return True

    step = start_step
    # A run resumed at a step whose evaluation is due evaluates first: a stop notice cut it short
    # there, or a preemption skipped it (a stop during it still stops at once: the step is saved).
    preempted = 0 < start_step < total_steps and not evaluated(
        state, start_step, start_step % config.eval_every_steps == 0,
        run.fewshot is not None and start_step % config.fewshot.every_steps == 0)
    with accountant.timed("train"):  # Minus the nested input, compile, eval, checkpoint.
      final_step = start_step if preempted else total_steps
      for step in range(start_step + 1, final_step + 1):
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
          with accountant.timed("input"):
            local_batch = next(train_iter)
            batch = run.setup.to_global(local_batch)
          state, metrics = run.compiler(run.train_step, state, batch)
          accountant.count_step()
        if step == start_step + 1:  # Compiled now: the throughput is measured from here.
          notice.training()  # A stop notice now saves the current step (before: stops at once).
          with accountant.timed("eval"):
            pictures.training_images(writer, local_batch, start_step)
          window.restart(step)
        if pending is not None:
          window.add(_check_finite(*pending, checkpoints, skipping))
        pending = (step, metrics)

        if step % config.log_every_steps == 0 or step == total_steps:
          window.add(_check_finite(*pending, checkpoints, skipping))
          pending = None
          mfu = save_cost(step)["mfu"]
          writer.write_scalars(step, window.summary(step, skipping, mfu))

        is_last = step == total_steps
        # A preemption notice (SIGTERM or Ctrl-C here, or on any host of a pod: Orbax's sync
        # point, the same step on every host) saves this step and stops without evaluating.
        preempted = notice.is_set() or checkpoints.reached_preemption(step)
        saving, evaluating, fewshot_due = _due(config, run.fewshot is not None, step, is_last,
                                               preempted)
        if saving or evaluating or fewshot_due:
          jax.block_until_ready(state)  # The steps in flight are training time.
        if saving:  # Before the evaluation, which can fail (e.g. an undecodable eval image).
          save(step, state, pending)
          pending = None
        if not evaluated(state, step, evaluating, fewshot_due):  # Stopped: the rerun redoes it.
          preempted = True
          if not saving:
            save(step, state, pending)
            pending = None
        if preempted:
          break

    # 5. End: a run that was already finished only evaluates again (a stop: at once, as above).
    if start_step >= total_steps:
      logging.info("The run in %s already finished its %d steps; evaluating only.", workdir,
                   total_steps)
      preempted = not evaluated(state, start_step, True, True)
    with accountant.timed("checkpoint"):
      checkpoints.wait_until_finished()
    checkpoints.close()
    last_step = step if preempted else max(start_step, total_steps)
    logging.info("Where the time went (python -m vit_jax.cost %s draws it):\n%s", workdir,
                 ledger_lib.format_ledger(save_cost(last_step, final=True)))
    if preempted:
      raise Preempted(last_step, workdir, interrupted=notice.signal == "SIGINT")
    return dict(results, step=last_step)


def _open_run(run: _Run, held: contextlib.ExitStack
              ) -> tuple[checkpoint.Checkpoints, step_lib.State, Any]:
  """`(checkpoints, state, metric writer)` of `run`, each closed by `held`: the config and dataset
  records written, the state restored (`_initial_state`), then the writer opened."""
  config = run.config
  run_dir = run.run_dir
  with stops.deferred_stop():
    run_dir.write_config(config.to_dict())
    run_dir.write_dataset(run.dataset)
    checkpoints = run_dir.checkpoints(keep=config.keep_checkpoints,
                                      asynchronous=config.async_checkpointing)
    held.push(_closing(checkpoints.wait_until_finished, checkpoints.close, always=False))
  state = _initial_state(run, checkpoints)
  # After the restore, so that a refused run leaves no events file.
  with stops.deferred_stop():
    writer = run_dir.metric_writer(checkpoint.flatten_params(config.to_dict(), sep="."),
                                   settle=checkpoints.wait_until_finished)
    held.push(_closing(writer.close, always=True))  # Before a failure is reported.
  num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  logging.info("Model %s: %s parameters; %d of %d steps done.", config.model_name,
               f"{num_params:,}", int(state["step"]), config.total_steps)
  return checkpoints, state, writer


def _compilation_cache_dir(config: ml_collections.ConfigDict, workdir: str) -> Optional[str]:
  """JAX's persistent compilation cache: `config.compilation_cache_dir`, else
  $JAX_COMPILATION_CACHE_DIR, else WORKDIR/compilation_cache; None for 'none' (no cache)."""
  cache = (config.compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
           or storage.join(workdir, rundir.COMPILATION_CACHE_DIR))
  return None if cache == "none" else cache


def _due(config: ml_collections.ConfigDict, fewshot: bool, step: int, is_last: bool,
         preempted: bool) -> tuple[bool, bool, bool]:
  """(save, evaluate, few-shot) at `step`: on its period, the last step; preempted: save only."""
  saving = step % config.checkpoint_every_steps == 0 or is_last or preempted
  evaluating = (step % config.eval_every_steps == 0 or is_last) and not preempted
  fewshot_due = fewshot and not preempted and (step % config.fewshot.every_steps == 0 or is_last)
  return saving, evaluating, fewshot_due


@dataclasses.dataclass
class _Run:
  """What the set-up of a run found: the resolved config and everything built from it."""
  config: ml_collections.ConfigDict
  accountant: accounting.CostAccountant
  run_dir: checkpoint.Workdir
  setup: step_lib.Setup
  evals: dict[str, Any]
  finetune: Optional[dict[str, Any]]  # The fine-tuning initialisation, if any.
  dataset: dict[str, Any]  # The training data's record (`dataset_record`).
  compiler: step_lib.Compiler  # Every step's compilation, timed as 'compile'.
  train_step: Any  # `setup.jit_train_step()`.
  fewshot: Optional[fewshot.Evaluator] = None  # config.fewshot's evaluator, when on.


def dataset_record(config: ml_collections.ConfigDict, info: data.DatasetInfo,
                   read: str) -> dict[str, Any]:
  """The training data's record in `WORKDIR/dataset.json` and every checkpoint: its name, the C
  `label_names` in label order, counts, `multi_label`, `image_shape` `[H, W, C]`, and how the
  training split is `read` (`data.pipeline.train_read_mode`: kept by a resume)."""
  return {"name": config.data.image_folder or config.data.name, "read": read,
          "label_names": list(info.label_names), "num_classes": info.num_classes,
          "multi_label": info.multi_label, "image_shape": list(info.image_shape),
          "num_train_examples": info.num_train_examples,
          "num_eval_examples": info.num_eval_examples}


def _prepare(config: ml_collections.ConfigDict, workdir: str,
             program_start: Optional[float], held: contextlib.ExitStack) -> _Run:
  """Phase 1: the resolved config, the workdir's lock (pushed on `held`), the model, mesh, eval
  sets and fine-tuning weights; writes nothing but the lock. Raises what `_config_errors` turns
  into a ConfigError."""
  config_lib.check_paths(config, workdir)  # A gs:// URL without a bucket: before any read.
  info = data.get_info(config.data)
  config = config_lib.resolve(config, num_train_examples=info.num_train_examples,
                              num_classes=info.num_classes)
  if config.data.image_size != info.image_shape[0]:  # model_name=auto fitted it to the patch.
    info = data.get_info(config.data)
  pod.check_same_command(config.to_dict(), workdir)  # A pod's processes: one command, or exit 2.
  # The compute account starts now: the program's time includes the set-up.
  accountant = accounting.CostAccountant(
      accounting.local_hardware(str(config.model.dtype)), config.batch_size, start=program_start,
      compile_saved=step_lib.compile_seconds_saved)
  run_dir = checkpoint.Workdir(workdir)
  run_dir.check_writable()
  with stops.deferred_stop():  # A stop notice stops once the lock is held (and released).
    lock = run_dir.lock(timeout_s=config.workdir_lock_timeout)
    checkpoint.acquire_on_all_processes(lock)
    held.push(lock)  # Released at the end; a refused run also removes the directories it made.
  labels = "multi-label" if info.multi_label else "single-label"
  logging.info("Dataset %s: %d classes (%s), %d train and %d eval examples, images %s.",
               config.data.image_folder or config.data.name, info.num_classes, labels,
               info.num_train_examples, info.num_eval_examples, info.image_shape)
  setup = step_lib.build(config, image_shape=info.image_shape)
  logging.info("%s", sharding.check_replication(
      setup.abstract_state["params"], setup.state_shardings["params"], setup.mesh,
      config.mesh.max_replicated_fraction))
  logging.info("%s", param_groups.param_groups_table(  # config.optim's fine-tuning controls.
      param_groups.param_groups(config.optim, setup.abstract_state["params"])))
  evals = evaluation.eval_sets(config, info)
  train_step = setup.jit_train_step()

  def on_compile(jitted, compiled: jax.stages.Compiled) -> None:
    if jitted is train_step:  # Its FLOPs recorded, its attention logged.
      accountant.set_step_flops(*flops.step_flops(
          compiled, setup.model, setup.image_shape, setup.mesh.size, accountant.batch_size))
      logging.info("Attention in the compiled training step: %s.",
                   kernels.called_by(compiled) or setup.config.model.attention)

  compiler = step_lib.Compiler(setup, lambda: accountant.timed("compile"), on_compile)
  fewshot_eval = None
  if config.fewshot.every_steps:  # Its datasets and splits are checked now, before any write.
    fewshot_eval = fewshot.Evaluator.from_config(config, setup, compiler=compiler)
  saved = run_dir.saved_steps()
  resuming = bool(saved)
  if resuming:  # A checkpoint of another model, a changed config: refused now.
    run_dir.check_state_fits(setup.abstract_state)
    _check_resume(config, run_dir, saved[-1])
  read = _read_mode(config, run_dir, resuming)
  finetune = None
  if config.init_from and resuming:
    logging.info("Not initialising from %s: resuming from the checkpoints in %s.",
                 config.init_from, run_dir.checkpoints_dir)
  elif config.init_from:
    logging.info("Initialising from %s for fine-tuning.", config.init_from)
    fresh = jax.device_get(jax.jit(setup.init_variables)(setup.init_rng))
    finetune = checkpoint.load_for_finetuning(
        config.init_from, setup.model, fresh, use_ema=config.init_from_ema,
        reset_head=config.init_reset_head, image_size=setup.image_shape[:2])
  logging.info("Config (resolved): %s (--verbosity=1 logs it).", run_dir.config_json)
  logging.vlog(1, "Config (resolved):\n%s", config)
  return _Run(config, accountant, run_dir, setup, evals, finetune,
              dataset_record(config, info, read), compiler, train_step, fewshot_eval)


def _check_resume(config: ml_collections.ConfigDict, run_dir: checkpoint.Workdir,
                  step: int) -> None:
  """Refuses to resume `run_dir` when `config` changes a key of what its run trains (its
  config.json's; `config_lib.resume_changes`) unless `config.resume_with_changes`; logs the
  changes it resumes with, and the learning rate at `step` where the schedule changed it."""
  recorded = run_dir.read_config() or {}
  changes = config_lib.resume_changes(recorded, config)
  refused = [c for c in changes if c[3]]
  if refused and not config.resume_with_changes:
    key, old, value, _ = refused[0]
    others = ", ".join(f"{k}: {o!r} -> {v!r}" for k, o, v, _ in refused[1:])
    as_recorded = " and ".join(f"config.{k}={json.dumps(o)}" for k, o, _, _ in refused)
    raise config_lib.ConfigError(
        key, value, f"differs from the run resumed in {run_dir.path}, which recorded {old!r} "
        f"in its config.json" + (f" (also changed: {others})" if others else ""),
        f"to resume that run, set {as_recorded} as recorded; for a new run, use another --workdir; "
        "to resume with the changes, set config.resume_with_changes=True")
  for key, old, value, trained in changes:
    logging.log(logging.WARNING if trained else logging.INFO, "Resuming %s with config.%s=%r "
                "(it recorded %r).", run_dir.path, key, value, old)
  if refused:
    _log_learning_rate_change(recorded, config, step)


def _log_learning_rate_change(recorded: dict[str, Any], config: ml_collections.ConfigDict,
                              step: int) -> None:
  """Warns when the schedule of `config` gives step `step + 1` another learning rate than the
  `recorded` config's (e.g. a longer cosine: it rises again from near 0)."""
  try:
    before = step_lib.learning_rate(config_lib.from_json(recorded), step)
  except (KeyError, TypeError, ValueError):  # Another version's config.json: no comparison.
    return
  after = step_lib.learning_rate(config, step)
  if not np.isclose(before, after, rtol=1e-6, atol=0.0):
    logging.warning("The learning rate of step %d is %.4g with the changes (%.4g as recorded): "
                    "the schedule is a function of the step and of the changed keys.", step + 1,
                    after, before)


def _read_mode(config: ml_collections.ConfigDict, run_dir: checkpoint.Workdir,
               resuming: bool) -> str:
  """How the training split is read: as the checkpoint resumed was trained (its dataset record's
  "read"), else as a new run reads it. ValueError: that mode cannot be kept (the fixes)."""
  recorded = (run_dir.read_dataset() or {}).get("read") if resuming else None
  read = data.train_read_mode(config.data, recorded)
  if resuming and recorded is None:
    logging.info("The checkpoint's dataset record does not say how the training data was read "
                 "(saved by an earlier version): reading it %s, as a new run does.",
                 read.replace("_", " "))
  return read


def _initial_state(run: _Run, checkpoints: checkpoint.Checkpoints) -> step_lib.State:
  """Phase 2: the latest checkpoint, else the fine-tuning initialisation, else a fresh state,
  on the mesh. ConfigError: the checkpoint's state does not fit this config."""
  setup = run.setup
  latest = checkpoints.latest_step()
  if latest is not None:
    logging.info("Resuming from the checkpoint at step %d in %s.", latest, checkpoints.directory)
    with _config_errors():
      state, saved_cost = checkpoints.restore(latest, setup.abstract_state)
    run.accountant.resume(accounting.latest_report(saved_cost, run.run_dir.read_cost()),
                          start_step=latest)
    return state
  previous = run.run_dir.read_cost()  # A run killed before its first checkpoint: from step 0.
  if previous and previous.get("attempts"):
    run.accountant.resume(previous, start_step=0)
  if run.finetune is not None:
    variables, run.finetune = run.finetune, None
    return jax.jit(setup.state_from_variables, out_shardings=setup.state_shardings)(variables)
  return jax.jit(setup.init_state, out_shardings=setup.state_shardings)(setup.init_rng)


def _evaluations(run: _Run, accountant: accounting.CostAccountant, writer,
                 stop: Callable[[], bool]):
  """`(pictures, evaluate, evaluate_fewshot)`: `config.analysis`'s pictures, and `(state, step)
  -> metrics` of every eval set and of `config.fewshot`, written and timed as eval; they raise
  `evaluation.Stopped`, nothing written, once `stop()` is true before a batch."""
  setup = run.setup
  eval_step = setup.jit_eval_step()
  _, first_eval = next(iter(run.evals.values()))
  evals = {name: (split, evaluation.Stoppable(eval_ds, stop))
           for name, (split, eval_ds) in run.evals.items()}
  pictures = pictures_lib.Pictures(setup, run.dataset["label_names"],
                                   lambda: next(iter(first_eval)), run.compiler)

  predict = lambda state, batch: run.compiler(eval_step, state, setup.to_global(batch))

  def evaluate(state, step: int) -> dict[str, float]:
    with accountant.timed("eval"):
      results = evaluation.evaluate(predict, state, evals,
                                    with_ema=bool(run.config.ema_decay), step=step)
      writer.write_scalars(step, results)
      pictures.attention(writer, state, step)
    return results

  def evaluate_fewshot(state, step: int) -> dict[str, float]:
    if run.fewshot is None:
      return {}
    with accountant.timed("eval"):
      results = run.fewshot.run({k: state[k] for k in setup.variables_shardings}, stop)
      writer.write_scalars(step, results)
    return results

  return pictures, evaluate, evaluate_fewshot


def _closing(*calls, always: bool):
  """An `__exit__` making `calls` after a failure, with `always` after a success too; their error
  is raised only after a success (e.g. a full disk's CheckpointSaveError from the metric writer),
  else logged: the failure in flight is the one to report."""

  def close(exc_type, exc, traceback) -> bool:
    del exc, traceback
    try:
      if always or exc_type is not None:
        for call in calls:
          call()
    except Exception as e:  # pylint: disable=broad-except
      if exc_type is None:
        raise
      logging.debug("Closing after the failure: %s", e)
    return False

  return close


@contextlib.contextmanager
def _config_errors():
  """The set-up's errors below as a ConfigError with their message (from the original)."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError, KeyError, FileNotFoundError, NotImplementedError,
          PermissionError, checkpoint.WorkdirInUseError) as e:
    message = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    raise ConfigError(message) from e


def _check_finite(step: int, metrics: dict[str, jax.Array], checkpoints: checkpoint.Checkpoints,
                  skipping: bool = False) -> dict[str, np.ndarray]:
  """Fetches a step's metrics. FloatingPointError (naming the step, values, checkpoint kept and
  fixes) when loss, gradients or parameters are not finite (with `skipping`: the parameters)."""
  metrics = jax.device_get(metrics)
  watched = ("param_norm",) if skipping else ("loss", "grad_norm", "param_norm")
  if not all(np.isfinite(metrics[k]) for k in watched):
    checkpoints.wait_until_finished()
    skipped = " after the maximum of skipped updates in a row" if skipping else ""
    latest = checkpoints.latest_step()
    kept = ("There is no checkpoint yet" if latest is None else
            f"The last good checkpoint (step {latest}) is kept")
    raise FloatingPointError(
        f"Training diverged at step {step}{skipped}: loss={metrics['loss']}, "
        f"grad_norm={metrics['grad_norm']}, param_norm={metrics['param_norm']}. {kept}; "
        "lower --config.optim.lr, lengthen --config.optim.warmup_steps, set "
        "--config.optim.grad_clip_norm or allow skipping with "
        "--config.optim.max_skipped_updates=N, then rerun.")
  return metrics
