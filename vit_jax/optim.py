"""The optimizers, learning-rate schedules and losses a resolved config names (the ViT paper's
regimes, Sec. 4.1, App. B.1: ``vit_jax.config.REGIME_DEFAULTS``)."""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax

SCHEDULES = ("linear", "cosine", "constant")
LOSSES = ("softmax_xent", "sigmoid_xent")
OPTIMIZERS = ("adamw", "sgd")


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
    raise ValueError(
        f"warmup_steps={warmup_steps} (+ cooldown_steps={cooldown_steps}) must be smaller than "
        f"total_steps={total_steps}; lower --config.optim.warmup_steps (or warmup_epochs, "
        "cooldown_epochs) or train longer.")
  decay_steps = total_steps - cooldown_steps - warmup_steps

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0  # optax counts from 0, the reference from 1.
    progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
    factor = (0.5 * (1.0 + jnp.cos(math.pi * progress)) if decay == "cosine" else
              1.0 - progress if decay == "linear" else jnp.ones_like(progress))
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
    if optim.lr_base_batch_size <= 0:
      raise ValueError(f"config.optim.lr_base_batch_size={optim.lr_base_batch_size} must be "
                       "positive (or None to use config.optim.lr as it is).")
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
  return jax.tree_util.tree_map_with_path(lambda path, _: [
      p.key for p in path if isinstance(p, jax.tree_util.DictKey)][-1:] == ["kernel"], params)


def make_optimizer(optim: ml_collections.ConfigDict,
                   schedule: Callable[[jax.Array], jax.Array]) -> optax.GradientTransformation:
  """The optax optimizer of ``config.optim`` ('adamw' or 'sgd' with momentum, decoupled weight
  decay on kernels, global-norm clipping, ``apply_if_finite`` with ``max_skipped_updates``)."""
  parts = []
  if optim.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(optim.grad_clip_norm))
  if optim.optimizer == "adamw":
    parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2,
                             weight_decay=optim.weight_decay, mask=_decay_mask))
  elif optim.optimizer == "sgd":
    if optim.weight_decay:
      parts.append(optax.add_decayed_weights(optim.weight_decay, mask=_decay_mask))
    parts.append(optax.sgd(schedule, momentum=optim.momentum))
  else:
    raise ValueError(f"Unknown optimizer {optim.optimizer!r}; choose one of {list(OPTIMIZERS)}.")
  tx = optax.chain(*parts)
  if optim.get("max_skipped_updates", 0):
    if optim.max_skipped_updates < 0:
      raise ValueError(f"config.optim.max_skipped_updates={optim.max_skipped_updates} must be "
                       ">= 0.")
    tx = optax.apply_if_finite(tx, max_consecutive_errors=optim.max_skipped_updates)
  return tx


def loss_fn(logits: jax.Array, labels: jax.Array, kind: str,
            label_smoothing: float = 0.0) -> jax.Array:
  """Per-example loss ``[B]`` float32 of ``logits`` and targets ``[B, C]``: 'softmax_xent'
  (targets normalised) or 'sigmoid_xent' (summed over classes); ``label_smoothing`` eps maps
  each target to ``y * (1 - eps) + eps / C`` (docs/configs.md). ValueError: bad arguments."""
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1) "
                     "(--config.label_smoothing=0.1 is the T2T-ViT recipe's).")
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
