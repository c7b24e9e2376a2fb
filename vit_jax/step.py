"""The train state, the steps and their devices: one definition that the trainer, the tools,
the benchmark and the pre-flight compile (``setup = step.build(config, image_shape=...)``).

The state: ``{'step': int32[], 'params', 'opt_state', 'model_state' (the untrained collections;
absent when empty), 'ema_params' (with config.ema_decay > 0)}``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

from absl import logging
import flax.linen as nn
import jax
from jax.experimental import multihost_utils
from jax.experimental.compilation_cache import compilation_cache as jax_cache
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from vit_jax import models
from vit_jax import optim
from vit_jax import param_groups
from vit_jax import sharding
from vit_jax.models import intermediates

State = dict[str, Any]
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def create_model(config: ml_collections.ConfigDict) -> nn.Module:
  """`config.model_name` with the fields of `config.model`; raises as `vit_jax.models.create`."""
  fields = {}
  for k, v in config.model.items():
    if k in ("dtype", "param_dtype") and isinstance(v, str):
      v = jnp.dtype(v)
    fields[k] = v
  return models.create(config.model_name, num_classes=config.num_classes, **fields)


def state_from_variables(variables: dict[str, Any], tx: optax.GradientTransformation, *,
                         ema: bool) -> State:
  """The train state at step 0 of `variables` (`{'params', **collections}`, plain arrays)."""
  variables = dict(variables)
  params = variables.pop("params")
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
  if variables:
    state["model_state"] = variables
  if ema:
    state["ema_params"] = params
  return state


def boxed_init(model: nn.Module, image_shape: Sequence[int], rng: jax.Array) -> dict[str, Any]:
  """`model.init` on one `[1, H, W, C]` image of zeros, parameters boxed with logical axes."""
  return dict(model.init({"params": rng}, jnp.zeros((1, *image_shape), jnp.float32), train=False))


def variables_of(state: State, params: Any = None) -> dict[str, Any]:
  """What `model.apply` takes: the parameters (or `params`) and the untrained collections."""
  return {"params": state["params"] if params is None else params,
          **state.get("model_state", {})}


def eval_sums(logits: jax.Array, labels: jax.Array, mask: jax.Array,
              loss: str) -> dict[str, jax.Array]:
  """Sums over the unmasked rows of logits, labels `[B, C]` (one- or multi-hot), mask `[B]`:
  int32 `count`, `correct` (top-1 among the labels: precision@1 for multi-hot), `correct_top5`
  (C >= 5) and float32 `loss` (`vit_jax.optim.loss_fn`)."""
  top1 = jnp.argmax(logits, axis=-1)
  hit1 = jnp.take_along_axis(labels, top1[:, None], axis=-1)[:, 0] > 0
  sums = {"count": mask.sum(dtype=jnp.int32), "correct": (hit1 & mask).sum(dtype=jnp.int32),
          "loss": jnp.where(mask, optim.loss_fn(logits, labels, loss), 0.0).sum()}
  if logits.shape[-1] >= 5:
    top5 = jax.lax.top_k(logits, 5)[1]
    hit5 = (jnp.take_along_axis(labels, top5, axis=-1) > 0).any(axis=-1)
    sums["correct_top5"] = (hit5 & mask).sum(dtype=jnp.int32)
  return sums


def train_accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The float32 mean of `labels[argmax(logits)]` clipped to [0, 1] (`[B, C]` each): top-1
  accuracy, precision@1, or against mixup/CutMix labels the expected top-1 accuracy."""
  top1 = jnp.argmax(logits, axis=-1)
  hit = jnp.take_along_axis(labels.astype(jnp.float32), top1[:, None], axis=-1)[:, 0]
  return jnp.clip(hit, 0.0, 1.0).mean()


def frozen_mask(optim_config: ml_collections.ConfigDict, params: Any) -> Optional[Any]:
  """`params`' tree of bool `[n]` NumPy arrays (`vit_jax.param_groups.ParamGroups.frozen`);
  None when nothing is frozen. Raises as `param_groups`."""
  if not param_groups.finetune_controls(optim_config).freeze:
    return None
  frozen = param_groups.param_groups(optim_config, params).frozen
  return jax.tree_util.tree_map_with_path(
      lambda path, _: frozen[param_groups.name_of(path)], params)


def _stop_frozen(param: jax.Array, frozen: np.ndarray) -> jax.Array:
  """`param` with no gradient where `frozen` ([n]: per block of a stacked tensor)."""
  if frozen.all():
    return jax.lax.stop_gradient(param)
  if not frozen.any():
    return param
  keep = jnp.asarray(~frozen).reshape((-1,) + (1,) * (param.ndim - 1))
  return jnp.where(keep, param, jax.lax.stop_gradient(param))


def make_train_step(model: nn.Module, tx: optax.GradientTransformation,
                    schedule: Callable[[jax.Array], jax.Array], *, loss: str,
                    dropout_rng: jax.Array, label_smoothing: float = 0.0,
                    grad_accum_steps: int = 1, ema_decay: float = 0.0,
                    skip_nonfinite: bool = False, frozen: Optional[Any] = None
                    ) -> Callable[[State, Batch], tuple[State, Metrics]]:
  """`step(state, batch) -> (state, metrics)`: forward, backward, update, EMA; batch
  `{'image': [B, H, W, C], 'labels': [B, C]}` float32. `grad_accum_steps` micro-batches (rows
  i, i + n, ...) average to the batch's gradient; `ema_decay` > 0 keeps `ema_params`;
  `skip_nonfinite`: the optimizer is in `optax.apply_if_finite`; `frozen` (`frozen_mask`): no
  gradient computed. Metrics, float32 scalars: 'loss', 'accuracy' (`train_accuracy`),
  'grad_norm' (trainable parameters), 'param_norm', 'lr' and, with `skip_nonfinite`, 'skipped'."""

  def loss_of(params, state, images, labels, rng):
    if frozen is not None:
      params = jax.tree.map(_stop_frozen, params, frozen)
    logits = model.apply(variables_of(state, params), images, train=True, rngs={"dropout": rng})
    return (optim.loss_fn(logits, labels, loss, label_smoothing).mean(),
            train_accuracy(logits, labels))

  grad_fn = jax.value_and_grad(loss_of, has_aux=True)

  def train_step(state: State, batch: Batch) -> tuple[State, Metrics]:
    step_rng = jax.random.fold_in(dropout_rng, state["step"])
    if grad_accum_steps == 1:
      (loss_value, accuracy), grads = grad_fn(state["params"], state, batch["image"],
                                              batch["labels"], step_rng)
    else:
      micro = jax.tree.map(lambda x: jnp.swapaxes(
          x.reshape(-1, grad_accum_steps, *x.shape[1:]), 0, 1), batch)

      def accumulate(carry, xs):
        micro_batch, i = xs
        out = grad_fn(state["params"], state, micro_batch["image"], micro_batch["labels"],
                      jax.random.fold_in(step_rng, i))
        return jax.tree.map(jnp.add, carry, out), None

      zeros = ((jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
               jax.tree.map(jnp.zeros_like, state["params"]))
      ((loss_value, accuracy), grads), _ = jax.lax.scan(
          accumulate, zeros, (micro, jnp.arange(grad_accum_steps)))
      loss_value, accuracy, grads = jax.tree.map(lambda x: x / grad_accum_steps,
                                                 (loss_value, accuracy, grads))
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = dict(state, step=state["step"] + 1, params=params, opt_state=opt_state)
    if ema_decay:
      new_state["ema_params"] = optax.incremental_update(params, state["ema_params"],
                                                         1.0 - ema_decay)
    metrics = {"loss": loss_value, "accuracy": accuracy, "grad_norm": optax.tree.norm(grads),
               "param_norm": optax.tree.norm(params), "lr": schedule(state["step"])}
    if skip_nonfinite:  # optax.apply_if_finite made this update zero.
      metrics["skipped"] = 1.0 - jnp.isfinite(metrics["grad_norm"]).astype(jnp.float32)
    return new_state, metrics

  return train_step


def make_features_step(model: nn.Module, *, head: bool = False) -> Callable[..., jax.Array]:
  """`step(state, images [B, H, W, C]) -> [B, F]` float32: the model without its head (ViT's
  `pre_logits`, T2T-ViT's normed class token; the paper's few-shot features), `head`: logits."""
  trunk = model if head else model.clone(num_classes=None)

  def features_step(state: State, images: jax.Array) -> jax.Array:
    return trunk.apply(variables_of(state), images, train=False)

  features_step.__name__ = "logits" if head else "features_step"  # As `Compiler` logs it.
  return features_step


def make_tokens_step(model: nn.Module, blocks: Sequence[int], *,
                     norm: bool) -> Callable[..., tuple[jax.Array, ...]]:
  """`step(state, images [B, H, W, C]) -> ([B, N, D] float32, ...)`: the output tokens of each
  of `blocks` (0 the first, -1 the last), in `intermediates.TokenLayout`'s order; with `norm`,
  through `intermediates.final_norm`. IndexError: a block the model does not have."""
  depth = model.depth if isinstance(model, models.T2TViT) else model.num_layers
  for b in blocks:
    if not -depth <= b < depth:
      raise IndexError(f"Block {b}: the model has {depth} blocks (0 to {depth - 1}, or -{depth} "
                       "to -1 counted from the last).")
  def tokens_step(state: State, images: jax.Array) -> tuple[jax.Array, ...]:
    _, sown = model.apply(variables_of(state), images, train=False,
                          mutable=[intermediates.COLLECTION])
    tokens = intermediates.unpack(model, sown[intermediates.COLLECTION])["tokens"]
    out = [tokens[b] for b in blocks]
    if norm:
      out = [intermediates.final_norm(model, state["params"], x) for x in out]
    return tuple(x.astype(jnp.float32) for x in out)

  return tokens_step


def make_eval_step(model: nn.Module, *, loss: str, top1: bool = False) -> Callable[..., Any]:
  """`step(state, {'image', 'labels', 'mask'}) -> eval_sums(...)`; with `top1`, `(sums, int32 [B]
  top-1 classes)`. The EMA's: `dict(state, params=ema_params)`."""

  def eval_step(state: State, batch: Batch):
    logits = model.apply(variables_of(state), batch["image"], train=False)
    sums = eval_sums(logits, batch["labels"], batch["mask"], loss)
    return (sums, jnp.argmax(logits, axis=-1).astype(jnp.int32)) if top1 else sums

  return eval_step


@dataclasses.dataclass(frozen=True)
class Setup:
  """A resolved config bound to its model, optimizer, mesh and shardings (`build`)."""

  config: ml_collections.ConfigDict
  model: nn.Module
  tx: optax.GradientTransformation
  schedule: Callable[[jax.Array], jax.Array]
  mesh: jax.sharding.Mesh
  rules: sharding.Rules
  image_shape: tuple[int, int, int]
  init_rng: jax.Array
  dropout_rng: jax.Array
  abstract_state: State
  state_shardings: Any
  batch_sharding: jax.sharding.NamedSharding

  def init_variables(self, rng: jax.Array) -> dict[str, Any]:
    return nn.unbox(boxed_init(self.model, self.image_shape, rng))

  def init_state(self, rng: jax.Array) -> State:
    """A fresh state (jit it with `out_shardings=self.state_shardings`)."""
    return self.state_from_variables(self.init_variables(rng))

  def state_from_variables(self, variables: dict[str, Any]) -> State:
    """The state at step 0 of loaded variables (a fine-tuning initialisation)."""
    return state_from_variables(variables, self.tx, ema=bool(self.config.ema_decay))

  def train_step_fn(self) -> Callable[[State, Batch], tuple[State, Metrics]]:
    """`make_train_step` of this config."""
    c = self.config
    return make_train_step(
        self.model, self.tx, self.schedule, loss=c.loss, dropout_rng=self.dropout_rng,
        label_smoothing=c.label_smoothing, grad_accum_steps=c.grad_accum_steps,
        ema_decay=c.ema_decay, skip_nonfinite=c.optim.max_skipped_updates > 0,
        frozen=frozen_mask(c.optim, self.abstract_state["params"]))

  def jit_train_step(self):
    """The train step jitted over the mesh: state and batch sharded, the old state donated."""
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return jax.jit(self.train_step_fn(), in_shardings=(self.state_shardings, self.batch_sharding),
                   out_shardings=(self.state_shardings, replicated), donate_argnums=0)

  @property
  def variables_shardings(self) -> dict[str, Any]:
    """The shardings of 'params' (and 'model_state'): of a state that only evaluates."""
    return {k: v for k, v in self.state_shardings.items() if k in ("params", "model_state")}

  def jit_eval_step(self, *, variables_only: bool = False, top1: bool = False):
    """The eval step jitted over the mesh; `variables_only`: for `variables_shardings`."""
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    shardings = self.variables_shardings if variables_only else self.state_shardings
    out_shardings = (replicated, self.batch_sharding) if top1 else replicated
    eval_step = make_eval_step(self.model, loss=self.config.loss, top1=top1)
    return jax.jit(eval_step, in_shardings=(shardings, self.batch_sharding),
                   out_shardings=out_shardings)

  def jit_features_step(self, *, head: bool = False):
    """`make_features_step` jitted over the mesh, for a state with `variables_shardings`."""
    return jax.jit(make_features_step(self.model, head=head),
                   in_shardings=(self.variables_shardings, self.batch_sharding),
                   out_shardings=self.batch_sharding)

  def jit_tokens_step(self, blocks: Sequence[int], *, norm: bool):
    """`make_tokens_step` jitted over the mesh, for a state with `variables_shardings`."""
    return jax.jit(make_tokens_step(self.model, tuple(blocks), norm=norm),
                   in_shardings=(self.variables_shardings, self.batch_sharding),
                   out_shardings=self.batch_sharding)

  def abstract_batch(self, batch_size: int, *, eval_batch: bool = False) -> Batch:
    """`{'image', 'labels'[, 'mask']}` as `jax.ShapeDtypeStruct`s of a global batch."""
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
    batch = {"image": spec((batch_size, *self.image_shape), jnp.float32),
             "labels": spec((batch_size, self.config.num_classes), jnp.float32)}
    if eval_batch:
      batch["mask"] = spec((batch_size,), jnp.bool_)
    return batch

  def to_global(self, local: Any) -> Any:
    """This process's rows (`[B / processes, ...]`, arrays or a dict) -> global `[B, ...]`."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), local)

  def to_local(self, array: jax.Array) -> np.ndarray:
    """A batch-sharded global `[B, ...]` array -> this process's rows (as `to_global` took)."""
    return np.asarray(multihost_utils.global_array_to_host_local_array(
        array, self.mesh, self.batch_sharding.spec))

  def in_mesh(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run (and traced) with this mesh and rules active (the models' constraints)."""

    def run(*args, **kwargs):
      with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
        return fn(*args, **kwargs)

    return run

  def compile(self, jitted, *args) -> jax.stages.Compiled:
    """`jitted.lower(*args).compile()` inside the mesh and rules; args may be abstract."""
    return self.in_mesh(lambda *a: jitted.lower(*a).compile())(*args)


#: JAX's persistent compilation cache, as its events count it: loads, compile seconds saved.
_PERSISTENT = {"hits": 0, "saved_s": 0.0, "listening": False}


def _count(event: str, duration_secs: float = 0.0, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _PERSISTENT["hits"] += 1
  elif event == "/jax/compilation_cache/compile_time_saved_sec":
    _PERSISTENT["saved_s"] += duration_secs


def compile_seconds_saved() -> float:
  """Compile seconds that JAX's persistent cache saved in this process (`compilation_cache`)."""
  return _PERSISTENT["saved_s"]


@contextlib.contextmanager
def compilation_cache(directory: Optional[str]) -> Iterator[None]:
  """JAX's persistent compilation cache in `directory` (None: off) inside the block."""
  if not _PERSISTENT["listening"]:
    jax.monitoring.register_event_listener(_count)
    jax.monitoring.register_event_duration_secs_listener(_count)
    _PERSISTENT["listening"] = True
  previous = jax.config.jax_compilation_cache_dir
  jax_cache.reset_cache()  # Else a process that compiled before keeps its first setting.
  jax_cache.set_cache_dir(directory)
  try:
    yield
  finally:
    jax_cache.reset_cache()
    jax_cache.set_cache_dir(previous)


class Compiler:
  """Jitted steps of `setup`, compiled once per shapes of the arguments after the state, then
  cached and logged; `timer()` wraps each compilation, `on_compile(jitted, compiled)` follows it."""

  def __init__(self, setup: Setup, timer: Optional[Callable[[], ContextManager]] = None,
               on_compile: Optional[Callable[[Any, jax.stages.Compiled], None]] = None):
    self.setup = setup
    self._timer = timer or contextlib.nullcontext
    self._on_compile = on_compile or (lambda jitted, compiled: None)
    self._cache: dict[Any, jax.stages.Compiled] = {}

  def compiled(self, jitted, state, *args) -> jax.stages.Compiled:
    """`jitted` compiled for `(state, *args)` (arrays or abstract), from the cache when it was."""
    key = (jitted, jax.tree.structure(args),
           tuple((x.shape, x.dtype) for x in jax.tree.leaves(args)))
    if key not in self._cache:
      hits = _PERSISTENT["hits"]
      saved = _PERSISTENT["saved_s"]
      start = time.perf_counter()
      with self._timer():
        self._cache[key] = self.setup.compile(jitted, state, *args)
      name = getattr(jitted, "__name__", "step")
      seconds = time.perf_counter() - start
      if _PERSISTENT["hits"] > hits:
        logging.info("Loaded %s from the compilation cache in %.1f s (%.1f s of compiling "
                     "saved).", name, seconds, max(0.0, _PERSISTENT["saved_s"] - saved))
      else:
        logging.info("Compiled %s in %.1f s.", name, seconds)
      self._on_compile(jitted, self._cache[key])
    return self._cache[key]

  def __call__(self, jitted, state, *args):
    return self.compiled(jitted, state, *args)(state, *args)


def batch_shards(mesh_config: ml_collections.ConfigDict, num_devices: int) -> int:
  """How many ways `config.mesh` on `num_devices` splits the batch; raises as `axis_sizes`."""
  sizes = sharding.axis_sizes(mesh_config, num_devices)
  return math.prod(sizes[a] for a in sharding.batch_axes(sharding.parse_rules(mesh_config.rules)))


def learning_rate(config: ml_collections.ConfigDict, step: int) -> float:
  """The learning rate of training step ``step + 1`` (after ``step`` updates) under the schedule
  of a resolved ``config`` (`optim.schedule_from_config`); raises as that."""
  schedule = optim.schedule_from_config(config.optim, batch_size=config.batch_size,
                                        total_steps=config.total_steps)
  return float(schedule(step))


def build(config: ml_collections.ConfigDict, *, image_shape: Sequence[int],
          devices: Optional[Sequence[Any]] = None) -> Setup:
  """The `Setup` of a config resolved for `devices` (default `jax.devices()`; a TPU topology's
  to compile for a slice) and images `(H, W, C)`; nothing allocated. `models.ImageSizeError`:
  an image size the model cannot take (naming the flag); ValueError: a mesh that does not fit."""
  model = create_model(config)
  schedule = optim.schedule_from_config(config.optim, batch_size=config.batch_size,
                                        total_steps=config.total_steps)
  mesh = sharding.create_mesh(config.mesh, devices)
  rules = sharding.parse_rules(config.mesh.rules, mesh.axis_names)
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  image_shape = tuple(int(s) for s in image_shape)
  try:
    boxed = jax.eval_shape(functools.partial(boxed_init, model, image_shape), init_rng)
  except models.ImageSizeError as e:
    raise models.ImageSizeError(
        f"{e} (Training resizes every image to config.data.image_size="
        f"{config.data.image_size}: set --config.data.image_size to a size that fits.)") from e
  # The fine-tuning controls (config.optim.freeze, ...) group the parameters by name.
  tx = optim.make_optimizer(config.optim, schedule, nn.unbox(boxed)["params"])
  shapes = jax.eval_shape(
      lambda b: state_from_variables(nn.unbox(b), tx, ema=bool(config.ema_decay)), boxed)
  state_shardings = sharding.state_shardings(shapes, boxed, mesh, rules)
  abstract_state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, state_shardings)
  return Setup(config=config, model=model, tx=tx, schedule=schedule, mesh=mesh, rules=rules,
               image_shape=image_shape, init_rng=init_rng, dropout_rng=dropout_rng,
               abstract_state=abstract_state, state_shardings=state_shardings,
               batch_sharding=sharding.batch_sharding(mesh, rules))
