"""Optimizers, learning-rate schedules and losses of the ViT pretraining and fine-tuning regimes.

The two regimes of the ViT paper (Dosovitskiy et al., 2021, Sec. 4.1 and Appendix B.1) differ in
optimizer, schedule, loss and head initialisation; their values are
`vit_jax.config.REGIME_DEFAULTS`, filled into a config by `vit_jax.config.resolve`. This module
builds what a resolved config describes: the schedule (`schedule_from_config`) and the optax
optimizer (`make_optimizer`) of `config.optim`, and the per-example loss (`loss_fn`) of
`config.loss` and `config.label_smoothing`.
"""

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
  """The learning rate as a function of optax's 0-based update count.

  Reproduces the official vit_jax schedule, which numbers steps from 1:
  `lr(step) = base * min(1, step / warmup) * f(progress)` with
  `progress = clip((step - warmup) / (total - cooldown - warmup), 0, 1)` and
  `f = 0.5 * (1 + cos(pi * progress))` ('cosine'), `1 - progress` ('linear') or 1 ('constant');
  the decayed part is interpolated towards `end_lr`. So the first update uses `base / warmup`
  and the last (step = total) uses `end_lr` (0 by default) for the decaying schedules.

  Two additions give the timm `CosineLRScheduler` of the T2T-ViT recipe (docs/reference.md section 3):
  the warmup rises linearly from `warmup_init_lr` instead of 0
  (`lr = init + (decayed - init) * min(1, step / warmup)`), and the last `cooldown_steps`
  updates stay at `end_lr` (the decay ends `cooldown_steps` before `total_steps`). Unlike timm's
  per-epoch steps, the rate changes every update, and the decay starts after the warmup.

  Args:
    base_lr: peak learning rate (after warmup).
    total_steps: number of optimizer updates in the whole run (> 0).
    warmup_steps: linear warmup length in updates (0 disables warmup; must be < total_steps).
    decay: 'cosine', 'linear' or 'constant'.
    end_lr: learning rate reached at the end of the decay.
    warmup_init_lr: learning rate the warmup starts from (at step 0).
    cooldown_steps: updates at `end_lr` after the decay, included in `total_steps`.

  Returns:
    A function `count -> lr` (float32 scalar) usable as an optax schedule.

  Raises:
    ValueError: unknown `decay`, `total_steps <= 0`, or `warmup_steps + cooldown_steps >=
      total_steps`.
  """
  if decay not in SCHEDULES:
    raise ValueError(f"Unknown schedule {decay!r}; choose one of {list(SCHEDULES)}.")
  if total_steps <= 0:
    raise ValueError(f"total_steps must be positive, got {total_steps}.")
  if warmup_steps < 0 or cooldown_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps} and cooldown_steps={cooldown_steps} must be >= 0.")
  if warmup_steps + cooldown_steps >= total_steps:
    raise ValueError(
        f"warmup_steps={warmup_steps} (+ cooldown_steps={cooldown_steps}) must be smaller than "
        f"total_steps={total_steps}; lower --config.optim.warmup_steps (or warmup_epochs, "
        "cooldown_epochs) or train longer.")
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


def schedule_from_config(optim: ml_collections.ConfigDict, *, batch_size: int,
                         total_steps: int,
                         steps_per_epoch: Optional[float] = None) -> Callable[[jax.Array], jax.Array]:
  """`lr_schedule` of a resolved `config.optim`.

  The peak rate is `optim.lr`, times `batch_size / optim.lr_base_batch_size` when that is set
  (the linear scaling rule of the T2T-ViT and DeiT recipes: "lr 5e-4 at batch 512"). The warmup
  and cooldown are `optim.warmup_steps` / `optim.cooldown_steps`; `vit_jax.config.resolve` has
  turned `warmup_epochs` / `cooldown_epochs` into those. For an unresolved config give
  `steps_per_epoch` and the epoch fields are converted here (rounded to whole updates).

  Raises:
    ValueError: see `lr_schedule`; a non-positive `lr_base_batch_size`; epoch fields without
      `steps_per_epoch`.
  """
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
  """True for the leaves that get weight decay: the kernels (matrices), as in big_vision.

  The name is the last dict key of the leaf's path, so boxed parameters (logical axis metadata,
  see vit_jax.models) are decided by their name too.
  """
  def is_kernel(path, _):
    keys = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
    return bool(keys) and keys[-1] == "kernel"
  return jax.tree_util.tree_map_with_path(is_kernel, params)


def make_optimizer(optim: ml_collections.ConfigDict,
                   schedule: Callable[[jax.Array], jax.Array]) -> optax.GradientTransformation:
  """Builds the optax optimizer of a resolved `config.optim` (see `vit_jax.config.resolve`).

  `schedule` is the learning rate as a function of the update count (see `lr_schedule`).

  'adamw': Adam with decoupled weight decay `lr * weight_decay * w`, applied to kernels only
  (the ViT paper's "weight decay 0.1" at lr 1e-3 is a per-step decay of 1e-4).
  'sgd': SGD with momentum (`optim.momentum`, 0.9 by default); decoupled weight decay if > 0.
  Both are preceded by clipping at global norm `optim.grad_clip_norm` when it is set, and, with
  `optim.max_skipped_updates` = N > 0, wrapped in `optax.apply_if_finite`: an update with
  non-finite gradients is skipped, up to N in a row.

  Raises:
    ValueError: unknown optimizer.
  """
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
      raise ValueError(f"config.optim.max_skipped_updates={optim.max_skipped_updates} must be >= 0.")
    # Zero updates for non-finite gradients; after that many in a row the NaNs go through
    # (and the training loop stops the run).
    tx = optax.apply_if_finite(tx, max_consecutive_errors=optim.max_skipped_updates)
  return tx


def loss_fn(logits: jax.Array, labels: jax.Array, kind: str, label_smoothing: float = 0.0) -> jax.Array:
  """Per-example training loss, with label smoothing for both losses.

  Label smoothing (`config.label_smoothing` = eps in [0, 1), K = C classes) works as
  big_vision's `onehot(K, on=..., off=...)` preprocessing op, which maps every entry of a one- or
  multi-hot vector affinely (1 -> on, 0 -> off) whatever the loss, with timm's values
  (its Mixup targets and its `BinaryCrossEntropy`): on = 1 - eps + eps / K, off = eps / K, i.e.
  `optax.smooth_labels`, `targets * (1 - eps) + eps / K`, element-wise.

  - 'softmax_xent': the targets are first normalised to sum to one (as big_vision does for
    multi-hot labels: k labels get 1/k each), then smoothed; they still sum to one. With eps=0.1
    and K=3 a one-hot [1, 0, 0] becomes [0.9333, 0.0333, 0.0333].
  - 'sigmoid_xent': every class is a binary problem; the raw one-/multi-hot targets are smoothed
    element-wise (no normalisation): a positive becomes 1 - eps + eps/K, a negative eps/K,
    however many positives an example has (multi-label data such as JFT or ImageNet-21k keeps
    all its positives equal). With eps=0.1 and K=3, [0, 1, 1] becomes [0.0333, 0.9333, 0.9333].

  The map is affine, so it commutes with Mixup / CutMix (`lam * y1 + (1 - lam) * y2` targets).
  Evaluation losses are computed without smoothing (`vit_jax.step`).

  Args:
    logits: `[B, C]` (any float dtype; computed in float32).
    labels: `[B, C]` float one-hot (single-label) or multi-hot (multi-label) targets in [0, 1].
    kind: 'softmax_xent' or 'sigmoid_xent' (sum over classes of per-class binary cross-entropy,
      the ViT pretraining loss).
    label_smoothing: eps, a Python float in [0, 1); 0 leaves the targets as they are.

  Returns:
    `[B]` float32 losses.

  Raises:
    ValueError: unknown `kind`; `label_smoothing` outside [0, 1).
  """
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
