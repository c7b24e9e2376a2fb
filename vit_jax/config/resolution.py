"""The one place a config becomes what runs (`resolve`): the regime filled in, lengths in steps,
the attention chosen for the target devices, and every value checked before any work, refused
with the field, its value, the valid range and the fix. Ranges are the `_*_RANGES` tables.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Sequence

from absl import logging
import jax
import ml_collections

from vit_jax import dispatch
from vit_jax import hardware
from vit_jax import models
from vit_jax import optim
from vit_jax import param_groups
from vit_jax import platform
from vit_jax import sharding
from vit_jax import step
from vit_jax.config import defaults
from vit_jax.config import slices
from vit_jax.models import vit_fields


def _number(value: Any) -> bool:
  """A finite int or float (not a bool, NaN or infinity)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


# A range check: (what the value must be, the test). None passes wherever `optional`.
_Check = tuple[str, Callable[[Any], bool]]
_POSITIVE_INT: _Check = ("a positive int", lambda v: _integer(v) and v > 0)
_NON_NEGATIVE_INT: _Check = ("an int >= 0", lambda v: _integer(v) and v >= 0)
_POSITIVE: _Check = ("> 0", lambda v: _number(v) and v > 0)
_NON_NEGATIVE: _Check = (">= 0", lambda v: _number(v) and v >= 0)
_UNIT: _Check = ("in [0, 1)", lambda v: _number(v) and 0 <= v < 1)
_PROBABILITY: _Check = ("in [0, 1] (a probability)", lambda v: _number(v) and 0 <= v <= 1)
_FRACTION: _Check = ("in (0, 1]", lambda v: _number(v) and 0 < v <= 1)
_BOOL: _Check = ("True or False", lambda v: isinstance(v, bool))
#: The most optimizer steps a run can count: the train state's step is an int32.
MAX_STEPS = 2**31 - 1
_STEP_COUNT: _Check = (f"a positive int <= {MAX_STEPS:,} (the int32 step counter)",
                       lambda v: _integer(v) and 0 < v <= MAX_STEPS)


def _one_of(choices: Sequence[Any]) -> _Check:
  return (f"one of {tuple(choices)}", lambda v: v in choices)


# key: (check, None allowed, what the field is / a hint).
_RUN_RANGES = {
    "regime": (_one_of(tuple(defaults.REGIME_DEFAULTS)), False,
               "--config.regime=pretrain or --config.regime=finetune"),
    "seed": (("an int", _integer), False, ""),
    "batch_size": (_POSITIVE_INT, False, "the global batch, images per update"),
    "grad_accum_steps": (_POSITIVE_INT, False, "micro-batches per update"),
    "eval_batch_size": (_POSITIVE_INT, True, "None: batch_size"),
    "total_steps": (_STEP_COUNT, True, "optimizer updates of the run"),
    "num_epochs": (_POSITIVE, True, "epochs of data.train_split"),
    "num_classes": (_POSITIVE_INT, True, "None: the dataset's"),
    "loss": (_one_of(optim.LOSSES), False, ""),
    "label_smoothing": (_UNIT, False, "the T2T-ViT recipe uses 0.1"),
    "ema_decay": (_UNIT, False, "0 disables the parameter EMA; the T2T-ViT recipe uses 0.99996"),
    "init_from_ema": (_BOOL, False, ""),
    "init_reset_head": (_BOOL, False, ""),
    "log_every_steps": (_POSITIVE_INT, False, ""),
    "eval_every_steps": (_POSITIVE_INT, False, ""),
    "checkpoint_every_steps": (_POSITIVE_INT, False, ""),
    "keep_checkpoints": (_POSITIVE_INT, False, "the most recent checkpoints kept"),
    "input_wait_warning": (_UNIT, False, "a share of the training time; 0 turns the warning off"),
    "async_checkpointing": (_BOOL, False, ""),
    "workdir_lock_timeout": (_POSITIVE, False, "seconds without a heartbeat before a gs:// "
                             "workdir's lock is stale"),
}
_OPTIM_RANGES = {
    "optimizer": (_one_of(optim.OPTIMIZERS), False, ""),
    "lr": (_POSITIVE, False, "the peak learning rate"),
    "weight_decay": (_NON_NEGATIVE, False, "decoupled, on the kernels"),
    "b1": (_UNIT, False, "Adam's first-moment decay"),
    "b2": (_UNIT, False, "Adam's second-moment decay"),
    "momentum": (_UNIT, False, "SGD's momentum"),
    "schedule": (_one_of(optim.SCHEDULES), False, ""),
    "warmup_steps": (_NON_NEGATIVE_INT, False, ""),
    "end_lr": (_NON_NEGATIVE, False, ""),
    "lr_base_batch_size": (("positive", lambda v: _integer(v) and v > 0), True,
                           "or None to use config.optim.lr as it is"),
    "warmup_epochs": (_NON_NEGATIVE, True, ""),
    "warmup_init_lr": (_NON_NEGATIVE, False, ""),
    "cooldown_steps": (_NON_NEGATIVE_INT, False, ""),
    "cooldown_epochs": (_NON_NEGATIVE, True, ""),
    "grad_clip_norm": (_NON_NEGATIVE, False, "0 disables clipping"),
    "max_skipped_updates": (_NON_NEGATIVE_INT, False, "0: the first non-finite loss stops"),
    "layer_decay": (_FRACTION, True, "None turns layer-wise lr decay off; BEiT and timm "
                    "fine-tune with 0.65 to 0.75"),
    "head_warmup_steps": (_NON_NEGATIVE_INT, False, "0 turns the head-only warm-up off"),
}
_DATA_RANGES = {
    "augment": (_one_of(defaults.AUGMENTATIONS), False, ""),
    "normalization": (_one_of(defaults.NORMALIZATIONS), False, ""),
    "bad_images": (_one_of(defaults.BAD_IMAGES), False,
                   "fail with the file names, or skip undecodable images"),
    "image_size": (_POSITIVE_INT, False, "the side of the square images the model sees"),
    "inception_crop_min_area": (_FRACTION, False, ""),
    "pad_crop_pixels": (_POSITIVE_INT, False, "the largest shift of augment='pad_crop'"),
    "shuffle_buffer": (("an int >= 1", lambda v: _integer(v) and v >= 1), False, ""),
    "prefetch": (_NON_NEGATIVE_INT, False, ""),
    "num_parallel_calls": (("-1 (AUTOTUNE) or an int >= 1",
                            lambda v: _integer(v) and (v == -1 or v >= 1)), False, ""),
    "randaugment_num_layers": (_NON_NEGATIVE_INT, False, "0 disables RandAugment"),
    "randaugment_magnitude": (("in [0, 10]", lambda v: _number(v) and 0 <= v <= 10), False,
                              "timm: 9"),
    "randaugment_magnitude_std": (_NON_NEGATIVE, False, ""),
    "random_erasing": (_PROBABILITY, False, ""),
    "mix_switch_prob": (_PROBABILITY, False, ""),
    "mix_prob": (_PROBABILITY, False, ""),
    "mixup_alpha": (_NON_NEGATIVE, False, "0 disables it"),
    "cutmix_alpha": (_NON_NEGATIVE, False, "0 disables it"),
    "eval_crop_pct": (_FRACTION, True, "None resizes the whole image"),
}
_SPLIT: _Check = ("a non-empty split name", lambda v: isinstance(v, str) and bool(v.strip()))
_FEWSHOT_RANGES = {
    "every_steps": (_NON_NEGATIVE_INT, False, "0 turns few-shot evaluation off"),
    "seeds": (_POSITIVE_INT, False, "draws of the shots per k"),
    "train_split": (_SPLIT, True, "None: the training data's train split, else 'train'"),
    "eval_split": (_SPLIT, True, "None: the training data's eval split, else 'test'"),
    "train_per_class": (_POSITIVE_INT, True, "None: max(shots) * seeds"),
    "max_eval_examples": (_POSITIVE_INT, True, "None: the whole eval split"),
}
_ANALYSIS_RANGES = {
    "attention_images": (_NON_NEGATIVE_INT, False, "0 turns the attention figures off"),
    "rollout_images": (_NON_NEGATIVE_INT, False, "0: no rollout maps"),
    "train_images": (_NON_NEGATIVE_INT, False, "0 turns the training-image grid off"),
}


def _check_ranges(section: Any, ranges: dict, prefix: str) -> None:
  for key, ((expected, ok), optional, hint) in ranges.items():
    value = section[key]
    if value is None and optional:
      continue
    if not ok(value):
      expected += " or None" if optional else ""
      if isinstance(value, float) and not math.isfinite(value):
        expected = f"finite and {expected}"
      hint = f" ({hint})" if hint else ""
      raise ValueError(f"config.{prefix}{key}={value!r} must be {expected}{hint}; set "
                       f"--config.{prefix}{key} to such a value.")


def _fewshot_list(fewshot: ml_collections.ConfigDict, key: str, expected: str, example: str,
                  ok: Callable[[Any], bool], convert: Callable[[Any], Any] = lambda v: v,
                  whole: Callable[[tuple], bool] = lambda t: True) -> tuple:
  """`config.fewshot.<key>` as a tuple of `convert(v)`, or a ValueError naming the flag unless a
  list or tuple of items that are `ok`, `whole` as a tuple."""
  value = fewshot[key]
  if not isinstance(value, (list, tuple)) or not all(map(ok, value)) or not whole(tuple(value)):
    raise ValueError(f"config.fewshot.{key}={value!r} must be {expected}; set "
                     f"--config.fewshot.{key} to such a value, e.g. "
                     f"--config.fewshot.{key}={example}.")
  return tuple(map(convert, value))


def resolve_fewshot(fewshot: ml_collections.ConfigDict) -> None:
  """Checks `config.fewshot` and normalises it in place (`datasets` split at commas, `shots`
  sorted, `l2_regs` floats); ValueError naming the field and the flag."""
  _check_ranges(fewshot, _FEWSHOT_RANGES, "fewshot.")
  datasets = sum(_fewshot_list(
      fewshot, "datasets", "a tuple of tfds names or prepared directories (empty: the training "
      "data)", "cifar10,dtd", lambda v: isinstance(v, str) and all(map(str.strip, v.split(","))),
      lambda v: tuple(part.strip() for part in v.split(","))), ())
  if len(set(datasets)) != len(datasets):
    raise ValueError(f"config.fewshot.datasets={fewshot.datasets!r} names a dataset twice; "
                     "list each once in --config.fewshot.datasets.")
  shots = _fewshot_list(fewshot, "shots", "a non-empty tuple of distinct positive ints",
                        "1,5,10,25", _POSITIVE_INT[1],
                        whole=lambda t: bool(t) and len(set(t)) == len(t))
  l2_regs = _fewshot_list(fewshot, "l2_regs", "a non-empty tuple of numbers > 0 (the ridge "
                          "penalties)", "1024.0", _POSITIVE[1], float)
  if not l2_regs:
    raise ValueError("config.fewshot.l2_regs=() must hold at least one number > 0; set "
                     "--config.fewshot.l2_regs=1024.0 (big_vision's value), or several.")
  if fewshot.train_per_class is not None and fewshot.train_per_class < max(shots):
    raise ValueError(f"config.fewshot.train_per_class={fewshot.train_per_class} keeps fewer "
                     f"training examples per class than the largest shot count, {max(shots)}; "
                     f"set --config.fewshot.train_per_class to at least {max(shots)} (or None).")
  fewshot.update(datasets=datasets, shots=tuple(sorted(shots)), l2_regs=l2_regs)


def _resolve_analysis(config: ml_collections.ConfigDict) -> None:
  """Checks `config.analysis`; counts above the batches they are taken from are lowered (logged)."""
  analysis = config.analysis
  _check_ranges(analysis, _ANALYSIS_RANGES, "analysis.")
  for key, limit_key, what in (  # In this order: rollout_images after attention_images.
      ("attention_images", "eval_batch_size", "the eval batch"),
      ("rollout_images", "analysis.attention_images", "config.analysis.attention_images"),
      ("train_images", "batch_size", "the training batch")):
    section, _, name = limit_key.rpartition(".")
    limit = (config[section] if section else config)[name]
    if analysis[key] > limit:
      logging.info("config.analysis.%s=%d lowered to %d, %s.", key, analysis[key], limit, what)
      analysis[key] = limit


def validate_data(data_config: ml_collections.ConfigDict) -> None:
  """Checks a `config.data` against `_DATA_RANGES` (for configs built without `resolve`)."""
  _check_ranges(data_config, _DATA_RANGES, "data.")


def fill_regime(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config`, every None regime field (`loss`, `model.head_bias_init`, `optim.*`) set
  from `REGIME_DEFAULTS[config.regime]`; ValueError: an unknown regime."""
  _check_ranges(config, {"regime": _RUN_RANGES["regime"]}, "")
  config = ml_collections.ConfigDict(config.to_dict())  # Unlocked; the caller's is unchanged.
  for key, value in defaults.REGIME_DEFAULTS[config.regime].items():
    section = {"head_bias_init": config.model, "loss": config}.get(key, config.optim)
    if key in section and section.get(key) is None:
      section[key] = value
  return config


def num_train_steps(config: ml_collections.ConfigDict, num_train_examples: int) -> int:
  """Optimizer updates of the run: `config.total_steps` when set, else `num_epochs` epochs.
  ValueError: neither is set, or the result is not positive or over `MAX_STEPS`."""
  if config.total_steps is not None:
    steps = config.total_steps
  elif config.num_epochs is not None:
    steps = _epochs_to_steps(
        "num_epochs", config.num_epochs, config.num_epochs * num_train_examples / config.batch_size,
        num_train_examples, config.batch_size, math.ceil)
  else:
    raise ValueError("Set the schedule length: --config.total_steps=N or --config.num_epochs=E.")
  if steps <= 0:
    raise ValueError(f"The run has {steps} training steps; set a positive "
                     "--config.total_steps or --config.num_epochs.")
  return steps


def _epochs_to_steps(key: str, epochs: Any, steps: float, num_train_examples: int,
                     batch_size: int, rounding: Callable[[float], int]) -> int:
  """`rounding(steps)`; ValueError naming `config.<key>` when not finite or over `MAX_STEPS`."""
  if not math.isfinite(steps) or steps > MAX_STEPS:
    largest = MAX_STEPS * batch_size / num_train_examples
    digits = 10.0**(math.floor(math.log10(largest)) - 3)  # Four significant digits, rounded down.
    largest = math.floor(largest / digits) * digits
    raise ValueError(
        f"config.{key}={epochs!r} is {steps:.3g} steps of batch {batch_size} over "
        f"{num_train_examples:,} examples, more than the {MAX_STEPS:,} a run can count (its step "
        f"is an int32); set --config.{key} to at most {largest:.4g}.")
  return rounding(steps)


def check_batch_size(batch_size: int, grad_accum_steps: int, num_shards: int) -> None:
  """ValueError unless `batch_size` is a multiple of `grad_accum_steps * num_shards` (the mesh's
  batch shards, `vit_jax.step.batch_shards`)."""
  unit = grad_accum_steps * num_shards
  if batch_size <= 0 or batch_size % unit:
    lower, upper = max(unit, batch_size // unit * unit), (batch_size // unit + 1) * unit
    raise ValueError(
        f"config.batch_size={batch_size} cannot be split into {grad_accum_steps} micro-batch(es) "
        f"over {num_shards} batch shard(s) of the device mesh: it must be a multiple of {unit}. "
        f"Use --config.batch_size={lower} or {upper}.")


#: Batches held besides the prefetched ones: being assembled, converted, on the (CPU) device.
BATCHES_IN_FLIGHT = 3
#: The share of the available host memory the training batches may take.
BATCH_MEMORY_SHARE = 0.5


def check_host_limits(config: ml_collections.ConfigDict, *, num_train_examples: int,
                      process_count: int = 1, available_bytes: Optional[int] = None,
                      unit: int = 1) -> None:
  """Refuses a batch this host cannot serve: per process, more than an epoch's examples, or
  `data.prefetch + BATCHES_IN_FLIGHT` float32 copies over `BATCH_MEMORY_SHARE` of
  `available_bytes` (default: `vit_jax.platform.available_memory_bytes()`; unknown: unchecked);
  and a learned position table (`model.posemb_grid`) whose training state is more than
  `available_bytes`. ValueError naming `config.batch_size` and a batch that fits (a multiple of
  `unit`), or `config.model.posemb_grid` and the largest square grid that fits.
  """
  batch, pc = int(config.batch_size), int(process_count)
  local_batch, local_examples = batch // pc, num_train_examples // pc
  per_process = f"; {local_examples:,} per process of {pc}" if pc > 1 else ""

  def fitting(local: int) -> int:  # The largest global batch of `local` per process, in units.
    return max(unit, local * pc // unit * unit)

  if local_batch > local_examples:
    raise ValueError(
        f"config.batch_size={batch} is more than the {num_train_examples:,} training examples "
        f"of an epoch (config.data.train_split{per_process}): every batch would hold the same "
        f"images several times. Set --config.batch_size={fitting(local_examples)} or less.")
  if available_bytes is None:
    available_bytes = platform.available_memory_bytes()
  if not available_bytes:
    return
  copies = int(config.data.prefetch) + BATCHES_IN_FLIGHT
  per_image = 4 * (int(config.data.image_size) ** 2 * 3 + int(config.num_classes))
  needed = local_batch * per_image * copies
  allowed = BATCH_MEMORY_SHARE * available_bytes
  if needed > allowed:
    gib = 2.0**30
    raise ValueError(
        f"config.batch_size={batch} needs ~{needed / gib:.1f} GiB of host memory per process "
        f"for its {copies} float32 batches of {config.data.image_size}x"
        f"{config.data.image_size} images in flight (config.data.prefetch="
        f"{config.data.prefetch} + {BATCHES_IN_FLIGHT}), more than {BATCH_MEMORY_SHARE:.0%} of "
        f"the {available_bytes / gib:.1f} GiB available: the run would be killed for lack of "
        f"memory. Set --config.batch_size={fitting(int(allowed // (per_image * copies)))} or "
        "less, or lower --config.data.prefetch.")
  _check_position_table(config.model, config.ema_decay, available_bytes)


def _check_position_table(model: ml_collections.ConfigDict, ema_decay: float,
                          available_bytes: int) -> None:
  """Refuses a learned position table made for `model.posemb_grid` whose training state
  (`slices.state_bytes_per_param`) is more than `available_bytes`: its initialisation would
  never end."""
  grid = model.get("posemb_grid")
  if not grid or model.get("posemb") != "learn":
    return
  rows = vit_fields.posemb_table_rows(grid, model.classifier, model.get("num_registers", 0),
                                      model.get("no_embed_class", False))
  width, per_param = int(model.hidden_size), slices.state_bytes_per_param(ema_decay)
  needed = rows * width * per_param
  if needed <= available_bytes:
    return
  prefix = rows - math.prod(grid)
  side = math.isqrt(max(available_bytes // (width * per_param) - prefix, 0))
  gib = 2.0**30
  raise ValueError(
      f"config.model.posemb_grid={tuple(grid)} makes a learned position table of {rows:,} x "
      f"{width} parameters whose training state ({per_param} B each: the float32 parameter, its "
      f"gradient, the optimizer's moments{' and the EMA' if ema_decay else ''}) needs "
      f"~{needed / gib:,.1f} GiB, more than the {available_bytes / gib:.1f} GiB of memory "
      f"available on this host. Set --config.model.posemb_grid to the token grid of the table "
      f"to load (at most ({side}, {side}) here; e.g. (14, 14) for 224 px at patch 16), or leave "
      "it out (the images' grid).")


def _resolve_schedule(config: ml_collections.ConfigDict, num_train_examples: int) -> None:
  """Fills total_steps, warmup_steps and cooldown_steps (epochs -> steps) and checks them."""
  config.total_steps = num_train_steps(config, num_train_examples)
  steps_per_epoch = num_train_examples / config.batch_size
  optim_config = config.optim
  for name in ("warmup", "cooldown"):
    epochs = optim_config[f"{name}_epochs"]
    if epochs is not None:  # An epoch count replaces the step count.
      optim_config[f"{name}_steps"] = _epochs_to_steps(
          f"optim.{name}_epochs", epochs, epochs * steps_per_epoch, num_train_examples,
          config.batch_size, lambda x: int(round(x)))
      optim_config[f"{name}_epochs"] = None
  optim.schedule_from_config(optim_config, batch_size=config.batch_size,
                             total_steps=config.total_steps)  # Raises for a bad length.


def _resolve_finetune_controls(config: ml_collections.ConfigDict) -> None:
  """Checks `config.optim`'s fine-tuning controls (`vit_jax.param_groups.finetune_controls`;
  those that need the model's parameter names are checked when the optimizer is built) and
  normalises them: `freeze` a tuple, `wd_mults` (pattern, float) pairs. After the schedule's
  length."""
  controls = param_groups.finetune_controls(config.optim)
  config.optim.freeze, config.optim.wd_mults = controls.freeze, controls.wd_mults
  if controls.head_warmup_steps >= config.total_steps:
    raise ValueError(
        f"config.optim.head_warmup_steps={controls.head_warmup_steps} must be smaller than the "
        f"run's {config.total_steps} steps, or only the head would ever train; lower it, or "
        "train the head alone with --config.optim.freeze='(?!head/).*'.")


def check_paths(config: ml_collections.ConfigDict, workdir: Optional[str] = None) -> None:
  """Refuses a `gs://` URL without a valid bucket (`vit_jax.checkpoint.paths.check_url`) in
  `workdir` or any string of `config` (`init_from`, `data.data_dir`, ...), before anything reads
  them. Raises ValueError naming the flag or field and the fix."""
  urls, stack = [("--workdir", workdir)], [("config", config)]
  while stack:
    name, node = stack.pop()
    for key, value in node.items():
      if isinstance(value, (ml_collections.ConfigDict, dict)):
        stack.append((f"{name}.{key}", value))
      urls += [(f"{name}.{key}", v) for v in (value if isinstance(value, (list, tuple)) else
                                               (value,))]
  urls = [(name, v) for name, v in urls if isinstance(v, str) and v.startswith("gs://")]
  if urls:  # (Imported only then: the estimator and preflight import no checkpoint module.)
    from vit_jax.checkpoint import paths  # pylint: disable=g-import-not-at-top  (a cycle)
    for name, url in urls:
      paths.check_url(url, name)


def _resolve_init_from(config: ml_collections.ConfigDict) -> None:
  """`init_from` from `pretrained_dir` ('<dir>/<model_name>.npz'); must exist."""
  if not config.init_from and config.pretrained_dir:
    config.init_from = f"{config.pretrained_dir.rstrip('/')}/{config.model_name}.npz"
    source = "config.pretrained_dir/<model_name>.npz"
  else:
    source = "config.init_from"
  path = config.init_from
  if path and "://" not in path and not os.path.exists(os.path.expanduser(path)):
    raise FileNotFoundError(f"The checkpoint to fine-tune from, {path!r} ({source}), does not "
                            "exist; give an official or big_vision .npz, a transformers ViT "
                            "directory, a timm .safetensors, a .pth.tar, an orbax checkpoint or "
                            "a workdir.")
  if path:
    _numerics_from_init(config, path)


def _numerics_from_init(config: ml_collections.ConfigDict, path: str) -> None:
  """A ViT's `config.model` numerics (`vit_jax.checkpoint.ecosystem.NUMERICS`) set from the
  weights `init_from` names, so that fine-tuning computes as they did; logged when changed."""
  if "gelu_approximate" not in config.model:  # Not a ViT (T2T-ViT).
    return
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top  (a cycle at import)
  from vit_jax.checkpoint import ecosystem  # pylint: disable=g-import-not-at-top
  found = checkpoint.open(path).numerics(config.model.num_heads)
  if found is None:  # No numerics in the file: left to the fine-tuning load's checks.
    return
  fields, family = found
  changed = {k: (config.model[k], v) for k, v in fields.items()
             if k in ecosystem.NUMERICS and k in config.model and config.model[k] != v}
  config.model.update({k: new for k, (_, new) in changed.items()})
  if changed:  # The weights win over the config (a flag included): they computed with these.
    logging.info("init_from %s is %s: %s set from the weights.", path, family,
                 ", ".join(f"model.{k}={new!r} (was {old!r})"
                           for k, (old, new) in changed.items()))


def for_counting(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` (unlocked, changed in place) with XLA's attention and a concrete remat policy, to
  trace the model on any host and count its parameters or products, never to run it."""
  config.model.attention = "xla"
  if config.model.get("remat_policy") == "auto":
    config.model.remat_policy = "nothing_saveable"
  return config


def remat_choice(config: ml_collections.ConfigDict,
                 devices: Sequence[Any]) -> Optional[dispatch.Choice]:
  """`vit_jax.dispatch.choose_remat_policy` for `config`'s model on `devices` (None: no policy)."""
  model = config.model
  if "remat_policy" not in model:
    return None
  return dispatch.choose_remat_policy(
      model.remat_policy, devices=devices, dtype=model.get("dtype", "float32"),
      width=model.get("hidden_size") or model.get("embed_dim") or 0)


def attention_choice(config: ml_collections.ConfigDict, requested: str,
                     devices: Sequence[Any]) -> dispatch.Choice:
  """`vit_jax.dispatch.choose_attention` of `requested` for `config`'s model on `devices`."""
  fields = dict(for_counting(ml_collections.ConfigDict(config.to_dict())).model.items())
  fields.pop("attention", None)  # The head size is all that is read.
  return dispatch.choose_attention(
      requested, devices=devices, dtype=config.model.get("dtype", "float32"),
      head_dim=models.head_dim(config.model_name, **fields),
      dropout=bool(config.model.get("attention_dropout_rate")))


def _check_slice(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Refuses settings fitted to one slice (`config.slice`) on a different number of devices
  (`config.mesh.dcn_data` such slices)."""
  if not config.get("slice"):  # Also a config.json written before the field existed.
    return
  try:
    if not isinstance(config.slice, str):
      raise ValueError("give a Cloud TPU type such as v3-32, or None")
    fitted = hardware.accelerator(config.slice)[1]
  except ValueError as e:
    raise ValueError(f"config.slice={config.slice!r}: {e}") from None
  slices = max(1, int(config.mesh.get("dcn_data", 1)))
  if fitted * slices != num_devices:
    copies = f" x {slices} slices = {fitted * slices}" if slices > 1 else ""
    raise ValueError(
        f"config.slice={config.slice!r}: the config's compute dtype, mesh and accumulation were "
        f"fitted to its {fitted} devices{copies}, but the step runs on {num_devices}. Use the "
        f"config file's <slice> argument for these devices (e.g. "
        f"configs/vit.py:b16,imagenet2012,v3-8), or --config.slice= to run the settings as they "
        f"are.")


def resolve(config: ml_collections.ConfigDict, *, num_train_examples: int, num_classes: int,
            devices: Optional[Sequence[Any]] = None) -> ml_collections.ConfigDict:
  """A new locked config: what runs, is logged and saved as `WORKDIR/config.json`.

  Args:
    config: a config of `configs/*.py`, overrides applied.
    num_train_examples: examples of `config.data.train_split` (all hosts); num_classes: the
      dataset's, used when `config.num_classes` is None.
    devices: the target devices (default `jax.devices()`), which size the mesh and choose the
      attention; None (this host runs it) also applies `check_host_limits`.

  Raises:
    ValueError: a bad value (naming the field, the range and the flag), an unknown name, a
      schedule or mesh or batch that does not fit (`config.mesh.dcn_data` other than the
      devices' slices included), an attention that cannot run there.
    TypeError: an unknown model field.
    FileNotFoundError: `init_from` (or `pretrained_dir`'s file) does not exist.
  A `gs://` URL without a valid bucket is a ValueError (`check_paths`), before anything is read.
  """
  check_paths(config)
  host = devices is None  # The run is on this host: its limits apply (`check_host_limits`).
  devices = list(jax.devices() if devices is None else devices)
  _check_slice(config, len(devices))
  sharding.check_slices(config.mesh, devices)  # config.mesh.dcn_data: the slices found.
  config = fill_regime(config)
  for section, ranges, prefix in ((config, _RUN_RANGES, ""),
                                  (config.optim, _OPTIM_RANGES, "optim."),
                                  (config.data, _DATA_RANGES, "data.")):
    _check_ranges(section, ranges, prefix)
  if "fewshot" in config:
    resolve_fewshot(config.fewshot)
  if config.num_classes is None:
    config.num_classes = int(num_classes)
  _resolve_init_from(config)  # May set the model's numerics from the weights.
  fields = dict(config.model.items())  # Keyword arguments of `vit_jax.models.model_config`.
  requested = fields.pop("attention")
  remat = remat_choice(config, devices)  # 'auto' -> a policy, from the devices and the dtype.
  if remat is not None:
    config.model.remat_policy = fields["remat_policy"] = remat.implementation
    if fields.get("remat"):
      logging.info("Remat policy: %s (%s).", remat.implementation, remat.reason)
  models.model_config(config.model_name, **fields)  # Every model field checked.

  shards = step.batch_shards(config.mesh, len(devices))
  _check_ranges(config.mesh, {"max_replicated_fraction": (_PROBABILITY, False, "")}, "mesh.")
  check_batch_size(config.batch_size, config.grad_accum_steps, shards)
  if host:  # Before the schedule, whose length the batch sets.
    check_host_limits(config, num_train_examples=num_train_examples,
                      process_count=jax.process_count(), unit=config.grad_accum_steps * shards)
  _resolve_schedule(config, num_train_examples)
  _resolve_finetune_controls(config)
  if config.eval_batch_size is None:
    config.eval_batch_size = config.batch_size
  elif config.eval_batch_size % shards:
    raise ValueError(f"config.eval_batch_size={config.eval_batch_size} must be a multiple of the "
                     f"{shards} batch shard(s) of the device mesh; set --config.eval_batch_size "
                     "to such a multiple.")
  if "analysis" in config:
    _resolve_analysis(config)

  choice = attention_choice(config, requested, devices)
  config.model.attention = choice.implementation
  logging.info("Attention: %s (%s).", choice.implementation, choice.reason)
  config.lock()
  return config
