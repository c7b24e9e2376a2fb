"""The optimizers, learning-rate schedules and losses a resolved config names (the ViT paper's
regimes, Sec. 4.1, App. B.1: ``vit_jax.config.REGIME_DEFAULTS``)."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from vit_jax import param_groups
from vit_jax.config import defaults
from vit_jax.config import keys
# The values of config.optim.schedule, config.loss, config.optim.optimizer (declared there).
from vit_jax.config.defaults import LOSSES, OPTIMIZERS, SCHEDULES  # noqa: F401


def lr_schedule(base_lr: float, total_steps: int, warmup_steps: int = 0,
                decay: str = "cosine", end_lr: float = 0.0, *, warmup_init_lr: float = 0.0,
                cooldown_steps: int = 0) -> Callable[[jax.Array], jax.Array]:
  """The learning rate (float32) of optax's 0-based update count: the official vit_jax schedule,
  ``base * min(1, step / warmup) * f(progress)`` (steps from 1, ``f`` cosine, linear or 1, towards
  ``end_lr``); timm's T2T-ViT recipe warms up from ``warmup_init_lr`` and ends with
  ``cooldown_steps`` at ``end_lr`` (docs/reference.md section 3). ValueError: bad arguments."""
  if decay not in SCHEDULES:
    raise ValueError(f"Unknown schedule {decay!r}; choose one of {list(SCHEDULES)}.")
  if total_steps <= 0:
    raise ValueError(f"total_steps must be positive, got {total_steps}.")
  if warmup_steps < 0 or cooldown_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps} and cooldown_steps={cooldown_steps} must be "
                     ">= 0.")
  if warmup_steps + cooldown_steps >= total_steps:
    raise keys.ConfigError(
        "optim.warmup_steps", warmup_steps, f"(+ cooldown_steps={cooldown_steps}) must be "
        f"smaller than total_steps={total_steps}", "lower config.optim.warmup_steps (or "
        "warmup_epochs, cooldown_epochs) or train longer.")
  decay_steps = total_steps - cooldown_steps - warmup_steps

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0  # optax counts from 0, the reference from 1.
    progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
    if decay == "cosine":
      factor = 0.5 * (1.0 + jnp.cos(math.pi * progress))
    elif decay == "linear":
      factor = 1.0 - progress
    else:
      factor = jnp.ones_like(progress)
    lr = end_lr + (base_lr - end_lr) * factor
    if warmup_steps > 0:
      lr = warmup_init_lr + (lr - warmup_init_lr) * jnp.minimum(1.0, step / warmup_steps)
    return lr

  return schedule


def schedule_from_config(optim: ml_collections.ConfigDict, *, batch_size: int, total_steps: int,
                         steps_per_epoch: Optional[float] = None
                         ) -> Callable[[jax.Array], jax.Array]:
  """:func:`lr_schedule` of ``config.optim``: peak ``lr`` (x ``batch_size / lr_base_batch_size``
  when set); epoch fields need ``steps_per_epoch`` unless resolved. ValueError: bad fields."""
  lr = optim.lr
  if optim.get("lr_base_batch_size") is not None:
    keys.check(optim, (keys.find(defaults.OPTIM_KEYS, "lr_base_batch_size"),), "optim.")
    lr = lr * batch_size / optim.lr_base_batch_size

  def steps(name: str) -> int:
    epochs = optim.get(f"{name}_epochs")
    if epochs is not None:
      if steps_per_epoch is None:
        raise ValueError(f"config.optim.{name}_epochs needs the epoch length: resolve the "
                         "config (vit_jax.config.resolve) or pass steps_per_epoch.")
      return int(round(epochs * steps_per_epoch))
    return int(optim.get(f"{name}_steps") or 0)

  return lr_schedule(lr, total_steps, steps("warmup"), optim.schedule, optim.end_lr,
                     warmup_init_lr=optim.get("warmup_init_lr") or 0.0,
                     cooldown_steps=steps("cooldown"))


def _decay_mask(params):
  """True for the leaves that get weight decay: the kernels (by last dict key), as big_vision."""
  return _map_named(lambda name, _: name.rsplit("/", 1)[-1] == "kernel", params)


def make_optimizer(optim: ml_collections.ConfigDict,
                   schedule: Callable[[jax.Array], jax.Array],
                   params: Any = None) -> optax.GradientTransformation:
  """The optax optimizer of ``config.optim`` ('adamw' or 'sgd' with momentum, decoupled weight
  decay on kernels, global-norm clipping, ``apply_if_finite`` with ``max_skipped_updates``);
  with fine-tuning controls on, per parameter group of ``params`` (arrays or ShapeDtypeStructs).
  ValueError: bad values, naming the key and the fix."""
  if optim.optimizer not in OPTIMIZERS:
    raise ValueError(f"Unknown optimizer {optim.optimizer!r}; choose one of {list(OPTIMIZERS)}.")
  controls = param_groups.finetune_controls(optim)
  if controls.on:
    if params is None:
      raise ValueError("config.optim's fine-tuning controls (layer_decay, freeze, wd_mults, "
                       "head_warmup_steps) need the parameters: make_optimizer(optim, schedule, "
                       "params).")
    return _skipping(optim, _finetune_optimizer(optim, schedule,
                                                param_groups.param_groups(optim, params)))
  parts = []
  if optim.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(optim.grad_clip_norm))
  if optim.optimizer == "adamw":
    parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2,
                             weight_decay=optim.weight_decay, mask=_decay_mask))
  else:
    if optim.weight_decay:
      parts.append(optax.add_decayed_weights(optim.weight_decay, mask=_decay_mask))
    parts.append(optax.sgd(schedule, momentum=optim.momentum))
  return _skipping(optim, optax.chain(*parts))


def _skipping(optim: ml_collections.ConfigDict,
              tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` in `optax.apply_if_finite` when ``max_skipped_updates`` > 0."""
  if optim.get("max_skipped_updates", 0):
    keys.check(optim, (keys.find(defaults.OPTIM_KEYS, "max_skipped_updates"),), "optim.")
    tx = optax.apply_if_finite(tx, max_consecutive_errors=optim.max_skipped_updates)
  return tx


def _leaf_factor(value: np.ndarray, leaf: jax.Array) -> Any:
  """A per-slice `value` [n] as a factor of `leaf` ([n, ...] when stacked, else a scalar)."""
  if value.size == 1 or np.all(value == value.flat[0]):
    return jnp.asarray(value.flat[0], leaf.dtype)
  return jnp.asarray(value, leaf.dtype).reshape((-1,) + (1,) * (leaf.ndim - 1))


def _map_named(fn: Callable[[str, jax.Array], Any], *trees: Any) -> Any:
  """`fn(name, *leaves)` over `trees` (the first's paths; optax.MaskedNode left as it is)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, *leaves: fn(param_groups.name_of(path), *leaves), *trees)


class GatedState(NamedTuple):
  """`_after_steps`'s state: updates counted so far, the inner transformation's state."""
  count: jax.Array
  inner_state: Any


def _after_steps(inner: optax.GradientTransformation,
                 steps: int) -> optax.GradientTransformation:
  """`inner` from update `steps` on (counted from 0): before, zero updates and `inner`'s state
  kept as initialised (fresh moments when it starts)."""

  def init(params):
    return GatedState(jnp.zeros([], jnp.int32), inner.init(params))

  def update(updates, state, params=None):
    new_updates, new_inner = inner.update(updates, state.inner_state, params)
    started = state.count >= steps
    new_updates = jax.tree.map(lambda u: jnp.where(started, u, jnp.zeros_like(u)), new_updates)
    new_inner = jax.tree.map(lambda new, old: jnp.where(started, new, old), new_inner,
                             state.inner_state)
    return new_updates, GatedState(optax.safe_int32_increment(state.count), new_inner)

  return optax.GradientTransformation(init, update)


class SelectState(NamedTuple):
  """`_select_gradients`' state with a head warm-up: updates counted so far."""
  count: jax.Array


def _select_gradients(groups: param_groups.ParamGroups) -> optax.GradientTransformation:
  """Zeroes the gradients of frozen parameters (slices) and, during the head warm-up, of every
  parameter outside the head: what is not trained is left out of the clipping's norm."""
  steps = groups.controls.head_warmup_steps

  def select(count):
    def one(name, g):
      if groups.label(name) == "frozen":
        return jnp.zeros_like(g)
      if groups.frozen[name].any():
        g = g * _leaf_factor((~groups.frozen[name]).astype(np.float64), g)
      if groups.label(name) == "trunk":
        g = jnp.where(count >= steps, g, jnp.zeros_like(g))
      return g
    return one

  def init(params):
    del params
    return SelectState(jnp.zeros([], jnp.int32)) if steps else optax.EmptyState()

  def update(updates, state, params=None):
    del params
    if not steps:
      return _map_named(select(None), updates), state
    return (_map_named(select(state.count), updates),
            SelectState(optax.safe_int32_increment(state.count)))

  return optax.GradientTransformation(init, update)


def _add_decayed_weights(groups: param_groups.ParamGroups,
                         weight_decay: float) -> optax.GradientTransformation:
  """`optax.add_decayed_weights` with each tensor's (slice's) `wd_mult`: u + wd * mult * p."""

  def one(name, u, p):
    mult = groups.wd_mult[name]
    if not mult.any():
      return u
    return u + _leaf_factor(weight_decay * mult, p) * p

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("Weight decay needs the parameters: tx.update(grads, state, params).")
    return _map_named(one, updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _scale_updates(groups: param_groups.ParamGroups) -> optax.GradientTransformation:
  """Multiplies each update by its tensor's (slice's) `update_scale` (layer decay, frozen 0)."""

  def one(name, u):
    scale = groups.update_scale(name)
    if groups.label(name) == "frozen" or np.all(scale == 1.0):  # Frozen: zeros already.
      return u
    return u * _leaf_factor(scale, u)

  return optax.stateless(lambda updates, params: _map_named(one, updates))


def _finetune_optimizer(optim: ml_collections.ConfigDict,
                        schedule: Callable[[jax.Array], jax.Array],
                        groups: param_groups.ParamGroups) -> optax.GradientTransformation:
  """`make_optimizer`'s chain with the fine-tuning controls: gradients selected, clipped, each
  group's moments (frozen: none allocated; the trunk's gated by `_after_steps`), weight decay x
  `wd_mult`, the schedule, x `update_scale`. Neutral controls give the plain optimizer's updates."""

  def moments() -> optax.GradientTransformation:
    decay = [_add_decayed_weights(groups, optim.weight_decay)] if optim.weight_decay else []
    if optim.optimizer == "adamw":
      return optax.chain(optax.scale_by_adam(b1=optim.b1, b2=optim.b2), *decay)
    if optim.momentum is not None:
      momentum = optax.trace(decay=optim.momentum)
    else:
      momentum = optax.identity()
    return optax.chain(*decay, momentum)

  if groups.controls.wd_mults and not optim.weight_decay:
    logging.warning("config.optim.wd_mults=%s has no effect: config.optim.weight_decay is 0 "
                    "(set config.optim.weight_decay).", groups.controls.wd_mults)
  steps = groups.controls.head_warmup_steps
  make = {"frozen": optax.set_to_zero, "train": moments, "head": moments,
          "trunk": lambda: _after_steps(moments(), steps)}
  transforms = {label: make[label]() for label in
                dict.fromkeys(groups.label(t.name) for t in groups.tensors)}
  labels = lambda tree: _map_named(lambda name, _: groups.label(name), tree)
  parts = [_select_gradients(groups)]
  if optim.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(optim.grad_clip_norm))
  parts += [optax.multi_transform(transforms, labels), optax.scale_by_learning_rate(schedule),
            _scale_updates(groups)]
  return optax.chain(*parts)


def loss_fn(logits: jax.Array, labels: jax.Array, kind: str,
            label_smoothing: float = 0.0) -> jax.Array:
  """Per-example loss ``[B]`` float32 of ``logits`` and targets ``[B, C]``: 'softmax_xent'
  (targets normalised) or 'sigmoid_xent' (summed over classes); ``label_smoothing`` eps maps
  each target to ``y * (1 - eps) + eps / C`` (docs/configs.md). ValueError: bad arguments;
  ConfigError: ``label_smoothing`` fails ``config.label_smoothing``'s check."""
  refused = keys.find(defaults.RUN_KEYS, "label_smoothing").refuse(label_smoothing)
  if refused:
    raise refused
  logits = logits.astype(jnp.float32)
  labels = labels.astype(jnp.float32)
  if kind == "softmax_xent":
    targets = labels / jnp.maximum(labels.sum(-1, keepdims=True), 1e-8)
    if label_smoothing:
      targets = optax.smooth_labels(targets, label_smoothing)
    return optax.softmax_cross_entropy(logits, targets)
  if kind == "sigmoid_xent":
    targets = optax.smooth_labels(labels, label_smoothing) if label_smoothing else labels
    return optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1)
  raise ValueError(f"Unknown loss {kind!r}; choose one of {list(LOSSES)}.")
