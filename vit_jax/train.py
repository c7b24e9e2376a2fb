"""The training loop: pretraining or fine-tuning a ViT, with evaluation and orbax checkpoints.

Read it top to bottom: `train_and_evaluate` (the body of `_train_and_evaluate`) goes through
the phases in order
  1. config: regime defaults, the device mesh, checks that fail before any expensive work;
  2. data: dataset facts, the per-process train iterator and the exact (padded) eval set;
  3. model, optimizer, and where every array of the state lives on the mesh;
  4. state: restored from the latest checkpoint of `workdir` (onto this mesh), else the
     fine-tuning init of `config.init_from`, else a fresh initialisation;
  5. the jitted train and eval steps;
  6. the loop: train, log, evaluate, checkpoint;
  7. the end: final evaluation, last checkpoint, results returned.
A `vit_jax.accounting.CostAccountant` times each part (training steps, compilation, evaluation,
checkpointing, input) and reports the run's cost in TPU-core-days, FLOPs and MFU: in the log,
as TensorBoard scalars 'cost/...', in every checkpoint (so a resumed run adds up all its
attempts) and in `workdir/cost.json`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import threading
import time
from typing import Any

from absl import logging
from clu import metric_writers
from clu import periodic_actions
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from vit_jax import accounting
from vit_jax import checkpoint
from vit_jax import data
from vit_jax import flops
from vit_jax import models
from vit_jax import optim
from vit_jax import sharding
from vit_jax.models import fused_attention

# {'step': int32[], 'params': ..., 'opt_state': ..., 'model_state': ..., 'ema_params': ...}.
# 'model_state' holds the model's variable collections other than 'params' (e.g. T2T-ViT's fixed
# sinusoid table and Performer features): saved and restored with the rest, never trained; absent
# when empty. 'ema_params' (only with config.ema_decay > 0) is the moving average of 'params'.
State = dict[str, Any]


class ConfigError(ValueError):
  """A config that cannot run, found before any work starts; the message says what to change."""


#: `python -m vit_jax.main` exits with this code after a preemption notice (SIGTERM) once the
#: checkpoint of the current step is saved: EX_TEMPFAIL, "try again" (rerun to resume).
PREEMPTED_EXIT_CODE = 75


class Preempted(Exception):
  """Training stopped at a preemption notice after saving the checkpoint of `step`."""

  def __init__(self, step: int, workdir: str):
    super().__init__(f"Preempted: saved the checkpoint of step {step} in {workdir}; rerun the "
                     "same command to resume from it.")
    self.step = step


class CheckpointSaveError(OSError):
  """Writing to the workdir failed (e.g. the disk is full): a checkpoint (the earlier ones are
  intact) or the TensorBoard events."""


@contextlib.contextmanager
def _config_errors():
  """Turns the setup's ValueError, TypeError, KeyError, FileNotFoundError, NotImplementedError
  and PermissionError into a ConfigError (the original stays attached as __cause__)."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError, KeyError, FileNotFoundError, NotImplementedError,
          PermissionError) as e:
    message = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    raise ConfigError(message) from e


def num_train_steps(config: ml_collections.ConfigDict, num_train_examples: int) -> int:
  """Optimizer updates of the whole run.

  `config.total_steps` when it is set (so `--config.total_steps=N` overrides a config's
  epochs), else `config.num_epochs` epochs of `num_train_examples` at `config.batch_size`.

  Raises:
    ValueError: neither is set, or the result is not positive.
  """
  if config.total_steps is not None:
    steps = config.total_steps
  elif config.num_epochs is not None:
    steps = math.ceil(config.num_epochs * num_train_examples / config.batch_size)
  else:
    raise ValueError("Set the schedule length: --config.total_steps=N or --config.num_epochs=E.")
  if steps <= 0:
    raise ValueError(f"The run has {steps} training steps; set a positive "
                     "--config.total_steps or --config.num_epochs.")
  return steps


def check_batch_size(batch_size: int, grad_accum_steps: int, num_shards: int) -> None:
  """Fails early when the global batch cannot be split into micro-batches and batch shards.

  Args:
    num_shards: how many ways the mesh splits the batch (data x fsdp devices with the default
      rules; see `vit_jax.sharding.data_parallel_size`).

  Raises:
    ValueError: `batch_size` is not a multiple of `grad_accum_steps * num_shards`.
  """
  unit = grad_accum_steps * num_shards
  if batch_size <= 0 or batch_size % unit:
    lower, upper = max(unit, batch_size // unit * unit), (batch_size // unit + 1) * unit
    raise ValueError(
        f"config.batch_size={batch_size} cannot be split into {grad_accum_steps} micro-batch(es) "
        f"over {num_shards} batch shard(s) of the device mesh: it must be a multiple of {unit}. "
        f"Use --config.batch_size={lower} or {upper}.")


def check_workdir(workdir: str) -> None:
  """Fails early when a local `workdir` cannot be created or written (nothing is created here).

  Raises:
    PermissionError: the directory, or its nearest existing ancestor, is not a writable
      directory (e.g. a read-only filesystem, or a file in the way). gs:// paths are not checked.
  """
  if "://" in workdir:
    return
  path = os.path.abspath(workdir)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
    what = "is not a directory" if not os.path.isdir(path) else "is not writable"
    where = "" if path == os.path.abspath(workdir) else " (where it would be created)"
    raise PermissionError(f"--workdir {workdir!r} cannot be used: {path}{where} {what}. Choose "
                          "a directory you can write to (or a gs:// path).")


def eval_sums(logits: jax.Array, labels: jax.Array, mask: jax.Array,
              loss: str) -> dict[str, jax.Array]:
  """Sums of one eval batch over its real (unmasked) examples.

  A prediction is a hit when the top-scoring class is among the true labels: top-1 accuracy for
  one-hot labels, precision@1 for multi-hot ones (the ViT paper's ImageNet-21k / JFT metric).

  Args:
    logits: `[B, C]`; labels: `[B, C]` one-hot or multi-hot; mask: `[B]` bool, False for padding.
    loss: the loss kind of `vit_jax.optim.loss_fn`.

  Returns:
    int32 `count` (real examples), `correct` (top-1 hits), `correct_top5` (hits among the top 5,
    only when C >= 5) and float32 `loss` (summed per-example loss).
  """
  top1 = jnp.argmax(logits, axis=-1)
  hit1 = jnp.take_along_axis(labels, top1[:, None], axis=-1)[:, 0] > 0
  sums = {"count": mask.sum(dtype=jnp.int32), "correct": (hit1 & mask).sum(dtype=jnp.int32),
          "loss": jnp.where(mask, optim.loss_fn(logits, labels, loss), 0.0).sum()}
  if logits.shape[-1] >= 5:
    top5 = jax.lax.top_k(logits, 5)[1]
    hit5 = (jnp.take_along_axis(labels, top5, axis=-1) > 0).any(axis=-1)
    sums["correct_top5"] = (hit5 & mask).sum(dtype=jnp.int32)
  return sums


def _eval_name(split: str) -> str:
  """'test' -> 'test', 'train[98%:]' -> 'train_98': a TensorBoard-friendly name of a split."""
  return re.sub(r"[^A-Za-z0-9]+", "_", split).strip("_")


def _model_fields(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The model's fields from `config.model`, dtypes as numpy dtypes."""
  fields = {key: config.model[key] for key in config.model}
  for key in ("dtype", "param_dtype"):
    if isinstance(fields.get(key), str):
      fields[key] = jnp.dtype(fields[key])
  return fields


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       program_start: float | None = None) -> dict[str, float]:
  """Trains (or resumes training) and evaluates; returns the final evaluation metrics.

  Rerunning with the same `workdir` resumes from its latest checkpoint at the saved step and
  finishes the schedule; a finished run does no more training (it only evaluates again).

  Args:
    config: a config from `configs/*.py` (see `vit_jax.defaults.get_config`).
    workdir: where checkpoints (`checkpoints/`) and TensorBoard events go (local or gs://).
    program_start: `time.monotonic()` when the program started (`vit_jax.STARTED` from
      `vit_jax.main`): the compute account's program time counts from there (default: now).

  Returns:
    `{'<split>/accuracy': top-1 (precision@1 for multi-label data), '<split>/top5_accuracy'
    (with >= 5 classes), '<split>/loss', 'step'}` of the final evaluation.

  Raises:
    ConfigError: (a ValueError) the config cannot run: batch size, schedule length, regime,
      dataset, model name or image size, a workdir that cannot be written or holds another
      model's checkpoints; raised before anything is written to `workdir`.
    FloatingPointError: the training loss became NaN or Inf (the last good checkpoint is kept).
    Preempted: SIGTERM (from the start of the set-up on): the next training step was saved.
    CheckpointSaveError: writing to the workdir failed (e.g. a full disk); earlier checkpoints
      are intact.
    vit_jax.data.BadImageError: an image cannot be decoded (config.data.bad_images='fail').
  """
  with _sigterm_notice() as notice:
    return _train_and_evaluate(config, workdir, program_start, notice)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        program_start: float | None, notice: threading.Event
                        ) -> dict[str, float]:
  """`train_and_evaluate`; `notice` is set by a preemption notice (SIGTERM)."""
  # 1. Config: fill in the regime's defaults. Everything up to the abstract state is a cheap
  # check of the config, done before anything is written to the workdir.
  with _config_errors():
    config = optim.resolve_regime(config)
    # The compute account starts now: the program's time includes the set-up below.
    accountant = accounting.CostAccountant(
        accounting.local_hardware(str(config.model.dtype)), config.batch_size,
        start=program_start)
    # The device mesh and the rules that map the models' logical axes onto it
    # (vit_jax.sharding): data parallelism, FSDP and tensor parallelism are mesh sizes.
    mesh = sharding.create_mesh(config.mesh)
    rules = sharding.parse_rules(config.mesh.rules, mesh.axis_names)
    check_batch_size(config.batch_size, config.grad_accum_steps,
                     sharding.data_parallel_size(mesh, rules))

    def in_mesh(fn):
      """Runs (and so traces) `fn` with the mesh and rules that the models' logical
      activation constraints resolve against."""
      def run(*args):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
          return fn(*args)
      return run

    # 2. Data: each process reads its own part; eval visits every example exactly once.
    info = data.get_info(config.data)
    total_steps = num_train_steps(config, info.num_train_examples)
    logging.info("Dataset %s: %d classes (%s), %d train and %d eval examples, images %s.",
                 config.data.image_folder or config.data.name, info.num_classes,
                 "multi-label" if info.multi_label else "single-label",
                 info.num_train_examples, info.num_eval_examples, info.image_shape)

    # 3. Model and optimizer.
    model = models.create(config.model_name, num_classes=info.num_classes,
                          **_model_fields(config))
    schedule = optim.schedule_from_config(
        config.optim, batch_size=config.batch_size, total_steps=total_steps,
        steps_per_epoch=info.num_train_examples / config.batch_size)
    if not 0.0 <= config.label_smoothing < 1.0:
      raise ValueError(f"config.label_smoothing={config.label_smoothing} must be in [0, 1) "
                       "(the T2T-ViT recipe uses 0.1).")
    if not 0.0 <= config.ema_decay < 1.0:
      raise ValueError(f"config.ema_decay={config.ema_decay} must be in [0, 1) (0 disables the "
                       "parameter EMA; the T2T-ViT recipe uses 0.99996).")
    init_from = config.init_from
    if not init_from and config.pretrained_dir:  # The official '<dir>/<model_name>.npz'.
      init_from = f"{config.pretrained_dir.rstrip('/')}/{config.model_name}.npz"
    init_from_ema, init_reset_head = config.init_from_ema, config.init_reset_head
    if init_from and not os.path.exists(init_from) and "://" not in init_from:
      source = "config.init_from" if config.init_from else "config.pretrained_dir/<model_name>.npz"
      raise FileNotFoundError(f"The checkpoint to fine-tune from, {init_from!r} ({source}), does "
                              "not exist; give an official .npz, a .pth.tar, an orbax checkpoint "
                              "or a workdir.")
    check_workdir(workdir)
    tx = optim.make_optimizer(config.optim, schedule)
    batch_sharding = sharding.batch_sharding(mesh, rules)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def state_from_variables(variables: dict[str, Any]) -> State:
      variables = dict(variables)
      params = variables.pop("params")
      state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
      if variables:
        state["model_state"] = variables
      if config.ema_decay:
        state["ema_params"] = params
      return state

    def init_boxed(rng) -> dict[str, Any]:
      """model.init: parameters boxed with their logical axis names."""
      images = jnp.zeros((1, *info.image_shape), jnp.float32)
      return dict(model.init({"params": rng}, images, train=False))

    def init_variables(rng) -> dict[str, Any]:
      return nn.unbox(init_boxed(rng))

    def init_state(rng) -> State:
      return state_from_variables(init_variables(rng))

    # Evaluation sets: data.eval_split, and optionally another dataset with the same classes
    # and preprocessing (e.g. ImageNet ReaL labels next to the ImageNet validation labels).
    evals = {_eval_name(config.data.eval_split): (
        config.data.eval_split,
        data.create_eval_dataset(config.data, global_batch_size=config.batch_size))}
    if config.extra_eval.name:
      extra = ml_collections.ConfigDict(config.data.to_dict())
      extra.update(name=config.extra_eval.name, eval_split=config.extra_eval.split,
                   image_folder=None)
      extra_ds = data.create_eval_dataset(extra, global_batch_size=config.batch_size)
      extra_classes = extra_ds.dataset.element_spec["labels"].shape[-1]
      if extra_classes != info.num_classes:
        raise ValueError(
            f"config.extra_eval.name={config.extra_eval.name!r} has {extra_classes} classes, "
            f"the training data {info.num_classes}: an extra eval needs the same label set.")
      base = os.path.basename(config.extra_eval.name.rstrip("/"))
      evals[_eval_name(f"{base}_{config.extra_eval.split}")] = (config.extra_eval.split, extra_ds)

    # Shapes only (nothing allocated); this is where an image size the patch does not divide
    # is reported.
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    try:
      shapes = jax.eval_shape(init_state, init_rng)
    except ValueError as e:
      if "is not divisible by" not in str(e):
        raise
      raise ValueError(f"{e} (Training resizes every image to config.data.image_size="
                       f"{config.data.image_size}: set --config.data.image_size to such a "
                       "multiple.)") from e
    # Where every array of the state lives: parameters (and their EMA, and the optimizer's
    # moments) by their logical axes and the rules; the step and counters replicated.
    state_shardings = sharding.state_shardings(shapes, jax.eval_shape(init_boxed, init_rng),
                                               mesh, rules)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, state_shardings)
    logging.info("%s", sharding.check_replication(
        shapes["params"], state_shardings["params"], mesh, config.mesh.max_replicated_fraction))

    # The fine-tuning initialisation, read now so that a checkpoint that does not fit stops the
    # run before the workdir is touched; a workdir that has a checkpoint resumes from it instead.
    ckpt_dir = _join(workdir, "checkpoints")
    saved_steps = sorted(int(p.name) for p in ckpt_dir.iterdir()
                         if p.name.isdigit()) if ckpt_dir.exists() else []
    resuming = bool(saved_steps)
    if resuming:  # A checkpoint of another model: said now, from its metadata.
      try:
        checkpoint.check_state_fits(ckpt_dir / str(saved_steps[-1]) / "state", shapes)
      except ValueError as e:
        raise ValueError(f"{e}\n  Rerun with the config it was trained with, or start a new "
                         "run in another --workdir.") from e
    finetune_variables = None
    if init_from and resuming:
      logging.info("Not initialising from %s: resuming from the checkpoints in %s.", init_from,
                   ckpt_dir)
    elif init_from:
      logging.info("Initialising from %s for fine-tuning.", init_from)
      finetune_variables = checkpoint.load_for_finetuning(
          init_from, model, jax.device_get(jax.jit(init_variables)(init_rng)),
          use_ema=init_from_ema, reset_head=init_reset_head)

  # 4. State: the latest checkpoint in workdir if there is one, else the fine-tuning init from
  # config.init_from (new head, regenerated tables), else a fresh initialisation. Then the
  # TensorBoard writer (so that a run refused here leaves no events file behind).
  manager = ocp.CheckpointManager(
      ckpt_dir,
      options=ocp.CheckpointManagerOptions(
          max_to_keep=config.keep_checkpoints,
          enable_async_checkpointing=config.async_checkpointing,
          # A save that a crash or a full disk interrupted leaves a '<step>.orbax-checkpoint-tmp'
          # directory (never a step directory): removed here, in the background.
          cleanup_tmp_directories=True,
      ),
  )
  latest = manager.latest_step()
  cost_json = _join(workdir, "cost.json")
  if latest is not None:
    logging.info("Resuming from the checkpoint at step %d in %s.", latest, ckpt_dir)
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if (ckpt_dir / str(latest) / "cost").exists():
      items["cost"] = ocp.args.JsonRestore()
    try:
      restored = manager.restore(latest, args=ocp.args.Composite(**items))
    except (ValueError, KeyError, TypeError) as e:  # E.g. another optimizer's state.
      raise ConfigError(
          f"The checkpoint of step {latest} in {ckpt_dir} does not fit this config's "
          f"optimizer or state ({str(e).splitlines()[0][:300]}). Rerun with the config it was "
          "trained with, or start a new run in another --workdir.") from e
    state = restored["state"]
    accountant.resume(_latest_cost(restored["cost"] if "cost" in items else None, cost_json),
                      start_step=latest)
  elif finetune_variables is not None:
    state = jax.jit(state_from_variables, out_shardings=state_shardings)(finetune_variables)
    del finetune_variables
  else:
    state = jax.jit(init_state, out_shardings=state_shardings)(init_rng)
  start_step = int(state["step"])
  try:
    writer = metric_writers.create_default_writer(
        workdir, just_logging=jax.process_index() > 0, asynchronous=True)
  except Exception as e:  # pylint: disable=broad-except  (TensorFlow's errors are not OSErrors)
    raise CheckpointSaveError(
        f"Cannot write the TensorBoard events to {workdir}: {str(e).splitlines()[0][:300]}. "
        "Free disk space or fix the permissions there, then rerun the same command.") from e
  writer.write_hparams({k: v for k, v in _flatten(config.to_dict()).items()
                        if isinstance(v, (int, float, str, bool))})
  num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  logging.info("Model %s: %s parameters; %d of %d steps done.", config.model_name,
               f"{num_params:,}", start_step, total_steps)

  # 5. The jitted steps. The train step donates the old state, so its buffers are reused.
  accum = config.grad_accum_steps
  skipping = config.optim.max_skipped_updates > 0  # See optim.make_optimizer.

  def variables_of(state: State, params=None) -> dict[str, Any]:
    """What `model.apply` takes: the parameters and the untrained collections."""
    return {"params": state["params"] if params is None else params,
            **state.get("model_state", {})}

  def loss_of(params, state, images, labels, rng):
    logits = model.apply(variables_of(state, params), images, train=True,
                         rngs={"dropout": rng})
    return optim.loss_fn(logits, labels, config.loss, config.label_smoothing).mean()

  def train_step(state: State, batch: dict[str, jax.Array]) -> tuple[State, dict[str, jax.Array]]:
    step_rng = jax.random.fold_in(dropout_rng, state["step"])
    grad_fn = jax.value_and_grad(loss_of)
    if accum == 1:
      loss, grads = grad_fn(state["params"], state, batch["image"], batch["labels"], step_rng)
    else:
      # Micro-batch i takes examples i, i+accum, ...: every micro-batch is spread over all
      # devices, so each one keeps the whole mesh busy.
      micro = jax.tree.map(
          lambda x: jnp.swapaxes(x.reshape(-1, accum, *x.shape[1:]), 0, 1), batch)

      def accumulate(carry, xs):
        micro_batch, i = xs
        loss, grads = grad_fn(state["params"], state, micro_batch["image"],
                              micro_batch["labels"], jax.random.fold_in(step_rng, i))
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state["params"]))
      (loss, grads), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(accum)))
      loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = dict(state, step=state["step"] + 1, params=params, opt_state=opt_state)
    if config.ema_decay:
      new_state["ema_params"] = optax.incremental_update(params, state["ema_params"],
                                                         1.0 - config.ema_decay)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
               "param_norm": optax.global_norm(params), "lr": schedule(state["step"])}
    if skipping:  # optax.apply_if_finite made this update zero.
      metrics["skipped"] = 1.0 - jnp.isfinite(metrics["grad_norm"]).astype(jnp.float32)
    return new_state, metrics

  def eval_step(state: State, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    logits = model.apply(variables_of(state), batch["image"], train=False)
    return eval_sums(logits, batch["labels"], batch["mask"], config.loss)

  p_train_step = jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                         out_shardings=(state_shardings, replicated), donate_argnums=0)
  p_eval_step = jax.jit(eval_step, in_shardings=(state_shardings, batch_sharding),
                        out_shardings=replicated)
  executables = {}

  def compiled(step_fn, state: State, batch: dict[str, jax.Array]):
    """`step_fn` compiled for this batch shape, ahead of time so that compilation is timed
    apart (and the train step's FLOPs are read from XLA's cost analysis)."""
    key = (step_fn, tuple((k, v.shape) for k, v in batch.items()))
    if key not in executables:
      with accountant.timed("compile"):
        executables[key] = in_mesh(lambda s, b: step_fn.lower(s, b).compile())(state, batch)
        if step_fn is p_train_step:
          _account_step_flops(accountant, executables[key], model, info.image_shape)
    return executables[key]

  def to_global(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(batch_sharding, v) for k, v in batch.items()}

  # The parameters evaluated: the trained ones, and their EMA as '<split>_ema/...' if kept.
  weights = {"": lambda state: state}
  if config.ema_decay:
    weights["_ema"] = lambda state: dict(state, params=state["ema_params"])

  def evaluate(state: State, step: int) -> dict[str, float]:
    results = {}
    for (name, (split, eval_ds)), (suffix, select) in itertools.product(
        evals.items(), weights.items()):
      name += suffix
      totals: dict[str, float] = {}
      for batch in eval_ds:
        batch = to_global(batch)
        sums = compiled(p_eval_step, select(state), batch)(select(state), batch)
        for k, v in jax.device_get(sums).items():
          totals[k] = totals.get(k, 0) + v
      count = int(totals.pop("count"))
      if count == 0:
        raise ValueError(f"The eval split '{split}' has no (labelled) examples; choose a "
                         "non-empty split (--config.data.eval_split / extra_eval.split).")
      metrics = {f"{name}/accuracy": totals["correct"] / count,
                 f"{name}/loss": totals["loss"] / count}
      if "correct_top5" in totals:
        metrics[f"{name}/top5_accuracy"] = totals["correct_top5"] / count
      logging.info("Evaluated %d examples of '%s' at step %d: %s", count, split, step,
                   ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
      results.update(metrics)
    writer.write_scalars(step, results)
    return results

  # 6. The loop. Metrics of step s are fetched after step s+1 was dispatched, so the host
  # never stalls the device; a NaN/Inf loss stops the run one step later at the latest.
  train_iter = data.create_train_iterator(config.data, global_batch_size=config.batch_size,
                                          seed=config.seed, start_step=start_step)
  progress = periodic_actions.ReportProgress(num_train_steps=total_steps, writer=writer,
                                             every_steps=config.log_every_steps)
  train_metrics: list[dict[str, np.ndarray]] = []
  pending = None  # (step, device metrics) of the step dispatched last.
  last_log_time, last_log_step = time.time(), start_step
  results: dict[str, float] = {}

  def save_cost(step: int) -> dict[str, Any]:
    """The cost so far: to the log, TensorBoard and workdir/cost.json (process 0)."""
    report = accountant.report(step)
    writer.write_scalars(step, accounting.scalars(report))
    logging.info("Step %d: %s", step, accounting.summary(report))
    if jax.process_index() == 0:
      partial = cost_json.parent / "cost.json.partial"  # Never a half-written cost.json.
      partial.write_text(json.dumps(report, indent=1))
      partial.replace(cost_json)
    return report

  def save_checkpoint(step: int) -> None:
    """Saves `state` as step `step` (once: a step already saved is not saved again)."""
    if step in manager.all_steps():
      return
    with accountant.timed("checkpoint"), _save_errors(manager, step):
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          cost=ocp.args.JsonSave(accountant.report(step))), force=True)

  # Everything in this block counts as training time except what the nested `timed` blocks
  # take out: waiting for input, compiling, evaluating and checkpointing.
  preempted = False
  with accountant.timed("train"):
    for step in range(start_step + 1, total_steps + 1):
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        with accountant.timed("input"):
          batch = to_global(next(train_iter))
        state, metrics = compiled(p_train_step, state, batch)(state, batch)
        accountant.count_step()
      if step == start_step + 1:  # Compiled now: the throughput is measured from here.
        last_log_time, last_log_step = time.time(), step
      if pending is not None:
        train_metrics.append(_check_finite(*pending, manager, skipping))
      pending = (step, metrics)
      progress(step)

      if step % config.log_every_steps == 0 or step == total_steps:
        train_metrics.append(_check_finite(*pending, manager, skipping))
        pending = None
        now = time.time()
        # Means over the window (skipped updates' non-finite values left out).
        summary = {f"train/{k}": float(np.mean([m[k] for m in train_metrics
                                                 if np.isfinite(m[k])] or [np.nan]))
                   for k in train_metrics[0] if k != "skipped"}
        if skipping:
          summary["train/skipped_updates"] = float(sum(m["skipped"] for m in train_metrics))
          if summary["train/skipped_updates"]:
            logging.warning("Step %d: skipped %d update(s) with non-finite gradients in the last "
                            "%d steps.", step, summary["train/skipped_updates"],
                            len(train_metrics))
        summary["train/lr"] = float(train_metrics[-1]["lr"])  # The rate now, not the mean.
        if step > last_log_step:  # (Not for a window that only held the compiling step.)
          summary["train/images_per_sec"] = ((step - last_log_step) * config.batch_size /
                                             (now - last_log_time))
        writer.write_scalars(step, summary)
        save_cost(step)
        train_metrics, last_log_time, last_log_step = [], now, step

      is_last = step == total_steps
      # A preemption notice (SIGTERM here, or on any host of a pod: orbax's sync point, the
      # same step on every host) saves this step and stops without evaluating.
      preempted = notice.is_set() or manager.reached_preemption(step)
      evaluating = (step % config.eval_every_steps == 0 or is_last) and not preempted
      saving = step % config.checkpoint_every_steps == 0 or is_last or preempted
      if evaluating or saving:
        # The steps in flight are training time: finish them before the clock switches.
        jax.block_until_ready(state)
      paused = time.time()  # Evaluation and checkpointing do not count in train/images_per_sec.
      if saving:  # Before the evaluation, which can fail (e.g. on an undecodable eval image).
        if pending is not None:  # Never checkpoint parameters that a NaN update produced.
          train_metrics.append(_check_finite(*pending, manager, skipping))
          pending = None
        save_checkpoint(step)
      if evaluating:
        with accountant.timed("eval"):
          results = evaluate(state, step)
      last_log_time += time.time() - paused
      if preempted:
        break

  # 7. The end: a run that was already finished only evaluates again.
  if start_step >= total_steps:
    logging.info("The run in %s already finished its %d steps; evaluating only.", workdir,
                 total_steps)
    with accountant.timed("eval"):
      results = evaluate(state, start_step)
  with accountant.timed("checkpoint"), _save_errors(manager, manager.latest_step()):
    manager.wait_until_finished()
  manager.close()
  last_step = step if preempted else max(start_step, total_steps)
  save_cost(last_step)
  writer.flush()
  writer.close()
  if preempted:
    raise Preempted(last_step, workdir)
  results["step"] = last_step
  return results


@contextlib.contextmanager
def _sigterm_notice():
  """Yields a `threading.Event` that SIGTERM sets (the previous handler is restored after).

  Only in a single-process run on the main thread: with several processes jax's preemption
  service handles SIGTERM and `CheckpointManager.reached_preemption` reports it.
  """
  notice = threading.Event()
  if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
    yield notice
    return
  previous = signal.signal(signal.SIGTERM, lambda *_: notice.set())
  try:
    yield notice
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _save_errors(manager: ocp.CheckpointManager, step: int | None):
  """Turns a failed save (full disk, no permission) into a `CheckpointSaveError` that says
  what is intact and what to do. `step`: the save being made (None: the last one)."""
  try:
    yield
  except (OSError, ValueError, RuntimeError) as e:
    text = str(e)
    if not isinstance(e, OSError) and not re.search(
        r"No space left|RESOURCE_EXHAUSTED|Permission denied|PERMISSION_DENIED|os_error", text):
      raise
    kept = [s for s in manager.all_steps() if s != step]
    which = "the last save" if step is None else f"step {step}"
    intact = (f"the checkpoint of step {max(kept)} is intact" if kept else
              "there is no earlier checkpoint")
    full = "No space left" in text or "RESOURCE_EXHAUSTED" in text
    cause = "No space left on device" if full else text.splitlines()[0][:300]
    raise CheckpointSaveError(
        f"Saving a checkpoint in {manager.directory} failed ({which}, or the save before "
        f"it, which runs in the background): {cause}. {intact.capitalize()} (the partial save "
        "is removed at the next start); "
        + ("free disk space (or lower --config.keep_checkpoints)" if full else
           "make the checkpoint directory writable")
        + " and rerun the same command to resume.") from e


def _account_step_flops(accountant: accounting.CostAccountant, executable, model,
                        image_shape) -> None:
  """Gives `accountant` the train step's FLOPs: XLA's count and the analytic one, compared.

  On CPU also logs which attention the compiled step runs (the fused kernel is a custom call).
  """
  cost = executable.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  # The compiled module is one device's share of the SPMD program.
  compiled = cost["flops"] * jax.device_count() if cost and cost.get("flops") else None
  analytic = flops.training_flops(flops.model_forward_macs(model, image_shape),
                                  accountant.batch_size)
  accountant.set_step_flops(compiled, analytic)
  ratio = f"{compiled / analytic:.3f}" if compiled else "n/a"
  logging.info("FLOPs per training step: %s by XLA's cost analysis, %.4g analytic (3 x the "
               "forward matmuls); ratio %s. MFU uses the analytic count.",
               f"{compiled:.4g}" if compiled else "unavailable", analytic, ratio)
  if compiled and not 0.97 <= compiled / analytic <= 1.15:
    logging.info("The counts differ: XLA counts a loop body once (scan over layers, gradient "
                 "accumulation) and counts rematerialised work; the analytic count is the "
                 "model's useful work.")
  if jax.default_backend() == "cpu":  # Which attention the compiled step runs.
    if fused_attention.called_by(executable):
      logging.info("Attention: vit_jax's fused CPU kernel (not in XLA's FLOPs count).")
    else:
      logging.info("Attention: XLA's; the fused CPU kernel is %s.", fused_attention.status())


def _latest_cost(from_checkpoint: dict[str, Any] | None, cost_json) -> dict[str, Any] | None:
  """The account to continue: the checkpoint's, or workdir/cost.json when that one holds more
  (time spent after the last checkpoint by an attempt that was killed, which was paid for)."""
  try:
    on_disk = json.loads(cost_json.read_text()) if cost_json.exists() else None
  except (ValueError, OSError) as e:
    logging.warning("Ignoring %s (%s); the checkpoint's cost account is used.", cost_json, e)
    on_disk = None
  candidates = [r for r in (from_checkpoint, on_disk) if r and r.get("attempts")]
  return max(candidates, key=lambda r: r["seconds"]["program"], default=None)


def _check_finite(step: int, metrics: dict[str, jax.Array], manager: ocp.CheckpointManager,
                  skipping: bool = False) -> dict[str, np.ndarray]:
  """Fetches a step's metrics; stops the run if its loss, gradients or new parameters are not finite."""
  metrics = jax.device_get(metrics)
  # When skipping is on, a non-finite loss only skips its update; the run stops once the
  # parameters themselves are not finite (optax.apply_if_finite let the update through after
  # config.optim.max_skipped_updates in a row).
  watched = ("param_norm",) if skipping else ("loss", "grad_norm", "param_norm")
  if not all(np.isfinite(metrics[k]) for k in watched):
    manager.wait_until_finished()
    skipped = " after the maximum of skipped updates in a row" if skipping else ""
    raise FloatingPointError(
        f"Training diverged at step {step}{skipped}: loss={metrics['loss']}, "
        f"grad_norm={metrics['grad_norm']}, param_norm={metrics['param_norm']}. The last good "
        f"checkpoint (step {manager.latest_step()}) is kept; lower --config.optim.lr, lengthen "
        "--config.optim.warmup_steps, set --config.optim.grad_clip_norm or allow skipping with "
        "--config.optim.max_skipped_updates=N, then rerun.")
  return metrics


def _join(workdir: str, name: str):
  """`workdir/name` as an epath (local paths and gs:// alike), absolute for orbax."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  path = epath.Path(workdir)
  if not str(workdir).startswith("gs://"):
    path = path.absolute()
  return path / name


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out
