"""The one place a config becomes what runs (`resolve`): the regime filled in, lengths in steps,
the attention chosen for the target devices, and every value checked before any work: each key
by its declaration's check (`vit_jax.config.defaults`), then what the keys must be together. A
refusal is a `vit_jax.config.keys.ConfigError` naming the key, its value and the fix.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

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
from vit_jax import storage
from vit_jax.config import defaults
from vit_jax.config import keys
from vit_jax.config import weights_model
from vit_jax.config.weights_model import AUTO, AUTO_PLACEHOLDERS  # noqa: F401
from vit_jax.config.keys import ConfigError
from vit_jax.models import vit_fields


def resolve_fewshot(fewshot: ml_collections.ConfigDict) -> None:
  """Checks `config.fewshot` (`defaults.FEWSHOT_KEYS`) and normalises it in place (`datasets`
  split at commas, `shots` sorted, `l2_regs` floats); ConfigError."""
  keys.check(fewshot, defaults.FEWSHOT_KEYS, "fewshot.")
  datasets = tuple(part.strip() for v in fewshot.datasets for part in v.split(","))
  if len(set(datasets)) != len(datasets):
    raise ConfigError("fewshot.datasets", fewshot.datasets, "names a dataset twice",
                      "list each once in config.fewshot.datasets.")
  shots = tuple(fewshot.shots)
  if fewshot.train_per_class is not None and fewshot.train_per_class < max(shots):
    raise ConfigError(
        "fewshot.train_per_class", fewshot.train_per_class,
        f"keeps fewer training examples per class than the largest shot count, {max(shots)}",
        f"set config.fewshot.train_per_class to at least {max(shots)} (or None).")
  fewshot.update(datasets=datasets, shots=tuple(sorted(shots)),
                 l2_regs=tuple(map(float, fewshot.l2_regs)))


def _resolve_analysis(config: ml_collections.ConfigDict) -> None:
  """Lowers `config.analysis`' counts above the batches they are taken from (logged)."""
  analysis = config.analysis
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
  """Checks a `config.data` by `defaults.DATA_KEYS` (for configs built without `resolve`)."""
  keys.check(data_config, defaults.DATA_KEYS, "data.")


def _regime_fields(config: ml_collections.ConfigDict):
  """(key, its section in `config`, its dotted name, the regime's value) of each regime field."""
  for key, value in defaults.REGIME_DEFAULTS[config.regime].items():
    section = {"head_bias_init": config.model, "loss": config}.get(key, config.optim)
    if key in section:
      dotted = {"head_bias_init": "model.head_bias_init", "loss": "loss"}.get(key, f"optim.{key}")
      yield key, section, dotted, value


def switch_regime(config: ml_collections.ConfigDict,
                  given: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """A copy of `config` where `config.recipe_regime` names another regime than `config.regime`:
  the config file's values of the regime fields cleared (filled by `fill_regime` from the run's
  regime, named in one warning), except the keys in `given` (dotted, 'optim.lr': what the command
  line set); then `recipe_regime` is the run's. ConfigError: an unknown regime."""
  keys.check(config, (keys.find(defaults.RUN_KEYS, "regime"),))
  config = ml_collections.ConfigDict(config.to_dict())  # Unlocked; the caller's is unchanged.
  recipe = config.get("recipe_regime")
  if not recipe or recipe == config.regime:
    return config
  given = set(given)
  reset = []
  for key, section, dotted, value in _regime_fields(config):
    if dotted not in given and section.get(key) not in (None, value):
      reset.append(f"{key}={section[key]!r} -> {value!r}")
      section[key] = None  # The config file chose it for its own regime: the run's replaces it.
  if reset:
    logging.warning(
        "config.regime=%r: the config file's optimizer settings were chosen for %r training "
        "(config.recipe_regime) and are replaced by the %r recipe (REGIME_DEFAULTS): %s. To "
        "keep a value, set it on the command line, or set --config.recipe_regime=%s.",
        config.regime, recipe, config.regime, ", ".join(reset), config.regime)
  config.recipe_regime = config.regime
  return config


def fill_regime(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` (`switch_regime`'s), every None regime field (`loss`,
  `model.head_bias_init`, `optim.*`) set from `REGIME_DEFAULTS[config.regime]`. ConfigError: an
  unknown regime."""
  config = switch_regime(config)
  for key, section, _, value in _regime_fields(config):
    if section.get(key) is None:
      section[key] = value
  return config


def num_train_steps(config: ml_collections.ConfigDict, num_train_examples: int) -> int:
  """Optimizer updates of the run: `config.total_steps` when set, else `num_epochs` epochs.
  ConfigError: neither is set, or the result is not positive or over `keys.MAX_STEPS`."""
  if config.total_steps is not None:
    steps = config.total_steps
  elif config.num_epochs is not None:
    steps = _epochs_to_steps(
        "num_epochs", config.num_epochs, config.num_epochs * num_train_examples / config.batch_size,
        num_train_examples, config.batch_size, math.ceil)
  else:
    raise ConfigError("total_steps", None, "and config.num_epochs=None leave the schedule's "
                      "length unset", "set config.total_steps=N or config.num_epochs=E.")
  if steps <= 0:
    key = "total_steps" if config.total_steps is not None else "num_epochs"
    raise ConfigError(key, config[key], f"gives the run {steps} training steps",
                      "set a positive config.total_steps or config.num_epochs.")
  return steps


def _epochs_to_steps(key: str, epochs: Any, steps: float, num_train_examples: int,
                     batch_size: int, rounding: Callable[[float], int]) -> int:
  """`rounding(steps)`; ConfigError of `config.<key>` when not finite or over `keys.MAX_STEPS`."""
  if not math.isfinite(steps) or steps > keys.MAX_STEPS:
    largest = keys.MAX_STEPS * batch_size / num_train_examples
    digits = 10.0**(math.floor(math.log10(largest)) - 3)  # Four significant digits, rounded down.
    largest = math.floor(largest / digits) * digits
    raise ConfigError(
        key, epochs, f"is {steps:.3g} steps of batch {batch_size} over {num_train_examples:,} "
        f"examples, more than the {keys.MAX_STEPS:,} a run can count (its step is an int32)",
        f"set config.{key} to at most {largest:.4g}.")
  return rounding(steps)


def check_batch_size(batch_size: int, grad_accum_steps: int, num_shards: int) -> None:
  """ConfigError unless `batch_size` is a multiple of `grad_accum_steps * num_shards` (the mesh's
  batch shards, `vit_jax.step.batch_shards`)."""
  unit = grad_accum_steps * num_shards
  if batch_size <= 0 or batch_size % unit:
    lower = max(unit, batch_size // unit * unit)
    upper = (batch_size // unit + 1) * unit
    raise ConfigError(
        "batch_size", batch_size, f"cannot be split into {grad_accum_steps} micro-batch(es) over "
        f"{num_shards} batch shard(s) of the device mesh: it must be a multiple of {unit}",
        f"use config.batch_size={lower} or {upper}.")


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
  `available_bytes`. ConfigError of `config.batch_size` with a batch that fits (a multiple of
  `unit`), or of `config.model.posemb_grid` with the largest square grid that fits.
  """
  batch = int(config.batch_size)
  pc = int(process_count)
  local_batch = batch // pc
  local_examples = num_train_examples // pc
  per_process = f"; {local_examples:,} per process of {pc}" if pc > 1 else ""

  def fitting(local: int) -> int:  # The largest global batch of `local` per process, in units.
    return max(unit, local * pc // unit * unit)

  if local_batch > local_examples:
    raise ConfigError(
        "batch_size", batch, f"is more than the {num_train_examples:,} training examples of an "
        f"epoch (config.data.train_split{per_process}): every batch would hold the same images "
        f"several times", f"set config.batch_size={fitting(local_examples)} or less.")
  if available_bytes is None:
    available_bytes = platform.available_memory_bytes()
  if not available_bytes:
    return
  copies = int(config.data.prefetch) + BATCHES_IN_FLIGHT
  per_image = 4 * (int(config.data.image_size) ** 2 * 3 + int(config.num_classes))
  needed = local_batch * per_image * copies
  allowed = BATCH_MEMORY_SHARE * available_bytes
  if needed > allowed:
    size = config.data.image_size
    raise ConfigError(
        "batch_size", batch, f"needs ~{needed / hardware.GIB:.1f} GiB of host memory per "
        f"process for its {copies} float32 batches of {size}x{size} images in flight "
        f"(config.data.prefetch={config.data.prefetch} + {BATCHES_IN_FLIGHT}), more than "
        f"{BATCH_MEMORY_SHARE:.0%} of the {available_bytes / hardware.GIB:.1f} GiB available: the "
        "run would be killed for lack of memory",
        f"set config.batch_size={fitting(int(allowed // (per_image * copies)))} or less, or "
        "lower config.data.prefetch.")
  _check_position_table(config.model, config.ema_decay, available_bytes)


def state_bytes_per_param(ema_decay: float) -> int:
  """Bytes a training run holds per parameter: float32 parameter, gradient, Adam's 2 moments, and
  the parameter EMA when `ema_decay` is set."""
  return 4 * (4 + (1 if ema_decay else 0))


def _check_position_table(model: ml_collections.ConfigDict, ema_decay: float,
                          available_bytes: int) -> None:
  """Refuses a learned position table made for `model.posemb_grid` whose training state
  (`state_bytes_per_param`) is more than `available_bytes`: its initialisation would
  never end."""
  grid = model.get("posemb_grid")
  if not grid or model.get("posemb") != "learn":
    return
  rows = vit_fields.posemb_table_rows(grid, model)
  width = int(model.hidden_size)
  per_param = state_bytes_per_param(ema_decay)
  needed = rows * width * per_param
  if needed <= available_bytes:
    return
  prefix = rows - math.prod(grid)
  side = math.isqrt(max(available_bytes // (width * per_param) - prefix, 0))
  ema = " and the EMA" if ema_decay else ""
  raise ConfigError(
      "model.posemb_grid", tuple(grid),
      f"makes a learned position table of {rows:,} x {width} parameters whose training state "
      f"({per_param} B each: the float32 parameter, its gradient, the optimizer's moments"
      f"{ema}) needs ~{needed / hardware.GIB:,.1f} GiB, more than the "
      f"{available_bytes / hardware.GIB:.1f} GiB of memory available on this host",
      f"set config.model.posemb_grid to the token grid of the table to load (at most ({side}, "
      f"{side}) here; e.g. (14, 14) for 224 px at patch 16), or leave it out (the images' grid).")


def _resolve_schedule(config: ml_collections.ConfigDict, num_train_examples: int,
                      regime_warmup: bool = False) -> None:
  """Fills total_steps, warmup_steps and cooldown_steps (epochs -> steps) and checks them. A
  warmup the regime filled (`regime_warmup`) that is not shorter than the run is lowered to a
  tenth of it (logged)."""
  config.total_steps = num_train_steps(config, num_train_examples)
  if regime_warmup and config.optim.warmup_steps >= config.total_steps:
    logging.info("config.optim.warmup_steps=%d (the %s regime's) lowered to %d, a tenth of the "
                 "run's %d steps.", config.optim.warmup_steps, config.regime,
                 config.total_steps // 10, config.total_steps)
    config.optim.warmup_steps = config.total_steps // 10
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
  config.optim.freeze = controls.freeze
  config.optim.wd_mults = controls.wd_mults
  if controls.head_warmup_steps >= config.total_steps:
    raise ConfigError(
        "optim.head_warmup_steps", controls.head_warmup_steps,
        f"must be smaller than the run's {config.total_steps} steps, or only the head would ever "
        "train", "lower it, or train the head alone with config.optim.freeze='(?!head/).*'.")


def check_paths(config: ml_collections.ConfigDict, workdir: Optional[str] = None) -> None:
  """Refuses a `gs://` URL without a valid bucket (`vit_jax.storage.check_url`) in
  `workdir` or any string of `config` (`init_from`, `data.data_dir`, ...), before anything reads
  them. Raises ValueError naming the flag or field and the fix."""
  urls = [("--workdir", workdir)]
  stack = [("config", config)]
  while stack:
    name, node = stack.pop()
    for key, value in node.items():
      if isinstance(value, (ml_collections.ConfigDict, dict)):
        stack.append((f"{name}.{key}", value))
      values = value if isinstance(value, (list, tuple)) else (value,)
      urls += [(f"{name}.{key}", v) for v in values]
  for name, url in urls:
    storage.check_url(url, name)


def _resolve_init_from(config: ml_collections.ConfigDict) -> None:
  """`init_from` from `pretrained_dir` ('<dir>/<model_name>.npz'); must exist."""
  if not config.init_from and config.pretrained_dir:
    config.init_from = f"{config.pretrained_dir.rstrip('/')}/{config.model_name}.npz"
    source = "config.pretrained_dir/<model_name>.npz"
  else:
    source = "config.init_from"
  path = config.init_from
  if storage.is_hub_name(path):  # Resolved (downloaded if missing) now: its errors before work.
    storage.normalize(path)
  elif path and not storage.is_remote(path) and not os.path.exists(os.path.expanduser(path)):
    raise FileNotFoundError(f"The checkpoint to fine-tune from, {path!r} ({source}), does not "
                            "exist; give an official or big_vision .npz, a transformers ViT "
                            "directory, a timm .safetensors, a .pth.tar, an orbax checkpoint, "
                            "a workdir or a Hub name (hf-hub:ORG/NAME).")
  auto = weights_model.AUTO
  if config.get("model_name") == auto and not path:
    raise ConfigError("model_name", auto, "reads the architecture from the weights, but "
                      "config.init_from names none", "set config.init_from=PATH, or name a "
                      "model (vit_jax.models.MODEL_NAMES).")
  if path:
    weights_model.model_from_weights(config, path)
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


def remat_choice(model: Mapping[str, Any], devices: Sequence[Any]) -> Optional[dispatch.Choice]:
  """`vit_jax.dispatch.choose_remat_policy` for the `model` fields (a config's `model`) on
  `devices` (only their platform is read); None: the model has no remat policy."""
  if "remat_policy" not in model:
    return None
  return dispatch.choose_remat_policy(
      model["remat_policy"], devices=devices, dtype=model.get("dtype", "float32"),
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
    raise ConfigError("slice", config.slice, "is not a Cloud TPU slice",
                      str(e).rstrip(".") + ".") from None
  slices = max(1, int(config.mesh.get("dcn_data", 1)))
  if fitted * slices != num_devices:
    copies = f" x {slices} slices = {fitted * slices}" if slices > 1 else ""
    raise ConfigError(
        "slice", config.slice, f"fitted the config's compute dtype, mesh and accumulation to its "
        f"{fitted} devices{copies}, but the step runs on {num_devices}",
        "use the config file's <slice> argument for these devices (e.g. "
        "configs/vit.py:b16,imagenet2012,v3-8), or config.slice= to run the settings as they "
        "are.")


def resume_changes(recorded: Mapping[str, Any], config: ml_collections.ConfigDict
                   ) -> List[Tuple[str, Any, Any, bool]]:
  """``(key, recorded value, value, trained)`` of each key (dotted, 'optim.lr') whose resolved
  value in ``config`` differs from ``recorded`` (the resumed run's WORKDIR/config.json), in JSON
  terms (tuples as lists); ``trained``: it changes what the run trains (`keys.Key.trained`). A key
  only one side has (another version's) and ``resume_with_changes`` itself are skipped."""
  declared = {key.name: key for key in defaults.RUN_KEYS}
  for name, (section_keys, _) in defaults.SECTIONS.items():
    declared.update({f"{name}.{key.name}": key for key in section_keys})
  changes = []

  def compare(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str) -> None:
    for name, value in new.items():
      key = prefix + name
      if name not in old or old[name] == value or key == "resume_with_changes":
        continue
      if isinstance(value, dict) and isinstance(old[name], dict):
        compare(old[name], value, f"{key}.")
      elif key in declared:
        changes.append((key, old[name], value, declared[key].trained))
      else:  # A model field.
        changes.append((key, old[name], value, name not in defaults.UNTRAINED_MODEL_KEYS))

  compare(recorded, json.loads(json.dumps(config.to_dict(), default=str)), "")
  return changes


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
    ConfigError: (a ValueError) a bad value, naming the key, the range and the fix; a schedule
      or batch that does not fit.
    ValueError: an unknown name, a mesh that does not fit (`config.mesh.dcn_data` other than the
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
  config = switch_regime(config)  # A warm-up the regime fills may be shortened (_resolve_schedule).
  optim_config = config.optim
  regime_warmup = optim_config.get("warmup_steps", 0) is None and optim_config.warmup_epochs is None
  config = fill_regime(config)
  keys.check(config, defaults.RUN_KEYS)
  for name, (section_keys, _) in defaults.SECTIONS.items():
    if name != "fewshot" and name in config:  # `resolve_fewshot` checks and normalises.
      keys.check(config[name], section_keys, f"{name}.")
  if "fewshot" in config:
    resolve_fewshot(config.fewshot)
  if config.num_classes is None:
    config.num_classes = int(num_classes)
  _resolve_init_from(config)  # May set the model's numerics from the weights.
  fields = dict(config.model.items())  # Keyword arguments of `vit_jax.models.model_config`.
  requested = fields.pop("attention")
  remat = remat_choice(config.model, devices)  # 'auto' -> a policy, from the devices and the dtype.
  if remat is not None:
    config.model.remat_policy = fields["remat_policy"] = remat.implementation
    if fields.get("remat"):
      logging.info("Remat policy: %s (%s).", remat.implementation, remat.reason)
  models.model_config(config.model_name, **fields)  # Every model field checked.

  shards = step.batch_shards(config.mesh, len(devices))
  check_batch_size(config.batch_size, config.grad_accum_steps, shards)
  if host:  # Before the schedule, whose length the batch sets.
    check_host_limits(config, num_train_examples=num_train_examples,
                      process_count=jax.process_count(), unit=config.grad_accum_steps * shards)
  _resolve_schedule(config, num_train_examples, regime_warmup)
  _resolve_finetune_controls(config)
  if config.eval_batch_size is None:
    config.eval_batch_size = config.batch_size
  elif config.eval_batch_size % shards:
    raise ConfigError("eval_batch_size", config.eval_batch_size, f"must be a multiple of the "
                      f"{shards} batch shard(s) of the device mesh",
                      "set config.eval_batch_size to such a multiple.")
  if "analysis" in config:
    _resolve_analysis(config)

  choice = attention_choice(config, requested, devices)
  config.model.attention = choice.implementation
  logging.info("Attention: %s (%s).", choice.implementation, choice.reason)
  config.lock()
  return config
