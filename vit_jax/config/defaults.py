"""Every key of the training config, declared once (a :class:`vit_jax.config.keys.Key` tuple per
section; docs/configs.md), and :func:`get_config`, the locked config they make.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import ml_collections
from ml_collections import config_dict

from vit_jax import models
from vit_jax.config import keys
from vit_jax.config.keys import Key

#: The ViT paper's two regimes (Sec. 4.1, App. B.1; docs/configs.md): each key is a config field,
#: None by default and filled from here by `resolve` (a single override still wins).
REGIME_DEFAULTS = {
    "pretrain": dict(optimizer="adamw", lr=1e-3, weight_decay=0.1, b1=0.9, b2=0.999,
                     momentum=0.9, schedule="linear", warmup_steps=10_000, grad_clip_norm=1.0,
                     loss="sigmoid_xent", head_bias_init=-10.0),
    "finetune": dict(optimizer="sgd", lr=0.03, weight_decay=0.0, b1=0.9, b2=0.999,
                     momentum=0.9, schedule="cosine", warmup_steps=500, grad_clip_norm=1.0,
                     loss="softmax_xent", head_bias_init=0.0),
}

#: How the blocks run in training unless overridden (docs/configs.md); the models' own defaults
#: are the plain unrolled encoder with the official per-layer names.
TRAINING_DEFAULTS = dict(scan=True, remat=True, remat_policy="auto")
#: The fields of `config.model` that change how the steps run, not what they compute (a resumed run
#: may change them; `vit_jax.config.keys.Key.trained`).
UNTRAINED_MODEL_KEYS = ("attention", "remat", "remat_policy")

#: Values of `config.data.augment`, `config.data.normalization`, `config.data.bad_images`.
AUGMENTATIONS = ("inception_crop", "pad_crop", "flip", "none")
NORMALIZATIONS = ("minus_one_to_one", "imagenet")
BAD_IMAGES = ("fail", "skip")
#: Values of `config.optim.schedule`, `config.optim.optimizer`, `config.loss` (`vit_jax.optim`).
SCHEDULES = ("linear", "cosine", "constant")
OPTIMIZERS = ("adamw", "sgd")
LOSSES = ("softmax_xent", "sigmoid_xent")


def _untrained(declared: Tuple[Key, ...]) -> Tuple[Key, ...]:
  """``declared``, each key marked as not changing what a run trains (``Key.trained``)."""
  return tuple(dataclasses.replace(key, trained=False) for key in declared)


def _regime(name: str, kind: type, text: str, check: keys.Check) -> Key:
  """A key whose None (the default) `resolve` fills from `REGIME_DEFAULTS` before its check."""
  return Key(name, None, kind, f"{text}; None: the regime's (REGIME_DEFAULTS)", check,
             filled=True)


#: `config.optim`: the optimizer and its schedule, then the fine-tuning controls.
SCHEDULE_KEYS: Tuple[Key, ...] = (
    _regime("optimizer", str, "the optimizer", keys.one_of(OPTIMIZERS)),
    _regime("lr", float, "the peak learning rate", keys.POSITIVE),
    _regime("weight_decay", float, "decoupled, on the kernels", keys.NON_NEGATIVE),
    _regime("b1", float, "Adam's first-moment decay", keys.UNIT),
    _regime("b2", float, "Adam's second-moment decay", keys.UNIT),
    _regime("momentum", float, "SGD's momentum", keys.UNIT),
    _regime("schedule", str, "the decay after the warm-up", keys.one_of(SCHEDULES)),
    _regime("warmup_steps", int, "updates of the linear warm-up", keys.NON_NEGATIVE_INT),
    Key("end_lr", 0.0, float, "the learning rate at the end of the decay", keys.NON_NEGATIVE),
    # Recipes stated in epochs or at a reference batch (T2T-ViT's); optim.schedule_from_config.
    Key("lr_base_batch_size", None, int,
        "lr *= batch_size / this (None: config.optim.lr as it is)", keys.POSITIVE_INT),
    Key("warmup_epochs", None, float, "replaces warmup_steps if set", keys.NON_NEGATIVE),
    Key("warmup_init_lr", 0.0, float, "the warm-up rises from this rate", keys.NON_NEGATIVE),
    Key("cooldown_steps", 0, int, "updates at end_lr after the decay (part of the run)",
        keys.NON_NEGATIVE_INT),
    Key("cooldown_epochs", None, float, "replaces cooldown_steps if set", keys.NON_NEGATIVE),
    _regime("grad_clip_norm", float, "global-norm clipping, 0 disables it", keys.NON_NEGATIVE),
    Key("max_skipped_updates", 0, int,
        "updates with NaN/Inf gradients skipped in a row (train/skipped_updates) before the next "
        "stops the run; 0: the first non-finite loss stops it", keys.NON_NEGATIVE_INT,
        trained=False),
)


def _pair(item) -> bool:
  """A (regex, multiplier >= 0) pair of `config.optim.wd_mults`."""
  return (isinstance(item, (tuple, list)) and len(item) == 2 and keys.number(item[1])
          and item[1] >= 0)


_PATTERNS = "regexes of the whole '/'-joined parameter name, the first match deciding"
#: Fine-tuning controls (`vit_jax.param_groups`, which checks the patterns; docs/configs.md), off.
FINETUNE_KEYS: Tuple[Key, ...] = (
    Key("layer_decay", None, float,
        "layer-wise lr decay (BEiT, timm): layer i of 0 (embeddings) .. L + 1 (head) gets lr * "
        "layer_decay^(L + 1 - i); None turns it off; BEiT and timm fine-tune with 0.65 to 0.75",
        keys.FRACTION),
    Key("freeze", (), tuple,
        f"frozen parameters (no updates, no optimizer state), {_PATTERNS}; ('(?!head/).*',): a "
        "linear probe", keys.Check("a tuple of regexes",
                                   lambda v: isinstance(v, (str, tuple, list)),
                                   "\"('Transformer/.*',)\"")),
    Key("wd_mults", (), tuple,
        f"(pattern, multiplier) of the weight decay, {_PATTERNS}; unmatched: 1 on kernels, 0 "
        "elsewhere", keys.Check("a tuple of (regex, multiplier >= 0) pairs",
                                lambda v: isinstance(v, (tuple, list)) and all(map(_pair, v)),
                                "\"(('head/.*', 0.0),)\"")),
    Key("head_warmup_steps", 0, int,
        "the first this many updates train only head_warmup_pattern's parameters (LP-FT); 0 "
        "turns the head-only warm-up off", keys.NON_NEGATIVE_INT),
    Key("head_warmup_pattern", "head/.*", str, f"the head warm-up's parameters, {_PATTERNS}"),
)
OPTIM_KEYS = SCHEDULE_KEYS + FINETUNE_KEYS

#: `config.data`: the input pipeline (`vit_jax.data`); the defaults are the official ViT
#: fine-tuning pipeline on the offline Fashion-MNIST builder.
DATA_KEYS: Tuple[Key, ...] = (
    Key("name", "fashion_mnist_local", str,
        "a registered tfds name ('cifar10', 'name/config', 'name:1.2.3') or a prepared tfds "
        "directory (a path: starts with '/', '.', '~', has '://', or exists)"),
    Key("image_folder", None, str,
        "root of an image-folder dataset, root/<split>/<class>/*.{jpg,jpeg,png} (classes "
        "sorted); replaces name"),
    Key("data_dir", None, str, "tfds data_dir (local or gs://); None: $TFDS_DATA_DIR or "
        "~/tensorflow_datasets", trained=False),
    Key("manual_dir", None, str, "tfds manual_dir for preparing (e.g. the ImageNet tars; "
        "fashion_mnist_local's IDX files)", trained=False),
    Key("prepare", True, bool, "prepare an unprepared dataset from local files (nothing is ever "
        "downloaded)", trained=False),
    Key("train_split", "train", str, "tfds split, with slicing ('train[:98%]', "
        "'train+validation')"),
    Key("eval_split", "test", str, "tfds split, with slicing", trained=False),
    Key("image_size", 224, int, "the side of the square images the model sees", keys.POSITIVE_INT),
    Key("augment", "inception_crop", str,
        "training augmentation: 'inception_crop' (ViT fine-tuning) or 'pad_crop', each + resize "
        "and a random flip; 'flip'; 'none' (resize only)", keys.one_of(AUGMENTATIONS)),
    Key("inception_crop_min_area", 0.05, float,
        "the smallest fraction of the image area the Inception crop keeps", keys.FRACTION),
    Key("pad_crop_pixels", 4, int, "the largest shift of augment='pad_crop', in source pixels",
        keys.POSITIVE_INT),
    # The T2T-ViT / DeiT recipe's augmentations (timm's; vit_jax.data.augment), off by default.
    Key("randaugment_num_layers", 0, int, "RandAugment after the crop: ops per image, each with "
        "probability 0.5; 0 disables RandAugment", keys.NON_NEGATIVE_INT),
    Key("randaugment_magnitude", 9.0, float,
        "RandAugment's magnitude ~ N(this, randaugment_magnitude_std) in [0, 10]; timm: 9",
        keys.Check("in [0, 10]", lambda v: keys.number(v) and 0 <= v <= 10)),
    Key("randaugment_magnitude_std", 0.5, float, "RandAugment's magnitude noise",
        keys.NON_NEGATIVE),
    Key("random_erasing", 0.0, float, "after normalization, the probability of one rectangle "
        "of N(0, 1) noise", keys.PROBABILITY),
    # Mixup / CutMix of each process's batch with its reverse (timm Mixup, mode 'batch').
    Key("mixup_alpha", 0.0, float, "Mixup's lambda ~ Beta(alpha, alpha); 0 disables it",
        keys.NON_NEGATIVE),
    Key("cutmix_alpha", 0.0, float, "CutMix's lambda ~ Beta(alpha, alpha); 0 disables it",
        keys.NON_NEGATIVE),
    Key("mix_switch_prob", 0.5, float,
        "with both alphas > 0, the probability a mixed batch is CutMix", keys.PROBABILITY),
    Key("mix_prob", 1.0, float, "the probability a batch is mixed", keys.PROBABILITY),
    Key("eval_crop_pct", None, float,
        "eval resizing: None resizes the whole image (official ViT); p resizes the shorter side "
        "to floor(S / p) and takes the central crop (timm; T2T-ViT: 0.9)", keys.FRACTION,
        trained=False),
    Key("normalization", "minus_one_to_one", str,
        "'minus_one_to_one' (ViT) or the 'imagenet' mean/std (T2T-ViT, timm)",
        keys.one_of(NORMALIZATIONS)),
    Key("shuffle_buffer", 50_000, int, "examples in the training shuffle buffer per process "
        "(docs/data.md)", keys.Check("an int >= 1", lambda v: keys.integer(v) and v >= 1)),
    Key("prefetch", 2, int, "batches prefetched by tf.data", keys.NON_NEGATIVE_INT, trained=False),
    Key("cache", False, bool, "keep the decoded, un-augmented images in host memory (small "
        "datasets)", trained=False),
    Key("num_parallel_calls", -1, int, "parallelism of the decode / augment maps",
        keys.Check("-1 (AUTOTUNE) or an int >= 1",
                   lambda v: keys.integer(v) and (v == -1 or v >= 1)), trained=False),
    Key("bad_images", "fail", str, "undecodable images: 'fail' names them "
        "(vit_jax.data.BadImageError), 'skip' leaves them out (docs/failures.md)",
        keys.one_of(BAD_IMAGES)),
    Key("image_key", "image", str, "the feature holding the image"),
    Key("label_key", None, str,
        "the feature holding the labels (ClassLabel: one-hot; Sequence(ClassLabel): multi-hot); "
        "None: 'real_label' for 'imagenet2012_real', else 'label' or 'labels'"),
)

#: `config.extra_eval`: an optional second eval set of the same classes, '<name>_<split>/...'.
EXTRA_EVAL_KEYS: Tuple[Key, ...] = _untrained((
    Key("name", None, str, "tfds name or prepared directory (e.g. 'imagenet2012_real' for the "
        "ImageNet ReaL labels); None: none"),
    Key("split", "validation", str, "its split"),
))

#: `config.mesh`: the device mesh and the logical-axis rules (`vit_jax.sharding`, which checks).
MESH_KEYS: Tuple[Key, ...] = _untrained((
    Key("data", -1, int, "data-parallel axis size; -1: all the devices the other axes leave"),
    Key("fsdp", 1, int, "fully sharded data-parallel axis size (-1: the rest)"),
    Key("tensor", 1, int, "tensor-parallel axis size (-1: the rest)"),
    Key("dcn_data", 1, int, "data parallelism across TPU slices (multi-slice over DCN); 1 for one "
        "slice or host group"),
    Key("rules", "", str, "changes to vit_jax.sharding.DEFAULT_RULES, "
        "'logical=mesh_axis[+mesh_axis],...' (empty right side: unsharded), e.g. "
        "'embed=,mlp=fsdp'"),
    Key("max_replicated_fraction", 0.5, float, "with fsdp > 1, the run stops when more than this "
        "fraction of the parameter bytes stays replicated", keys.PROBABILITY),
))

#: `config.fewshot`: few-shot linear evaluation during training (docs/evaluation.md).
FEWSHOT_KEYS: Tuple[Key, ...] = _untrained((
    Key("every_steps", 0, int, "every this many steps, and at the end of training; 0 turns "
        "few-shot evaluation off", keys.NON_NEGATIVE_INT),
    Key("datasets", (), tuple,
        "tfds names or prepared directories, read with the training config's eval "
        "preprocessing; empty: the training data itself",
        keys.Check("a tuple of tfds names or prepared directories (empty: the training data)",
                   lambda v: isinstance(v, (list, tuple)) and all(
                       isinstance(d, str) and all(map(str.strip, d.split(","))) for d in v),
                   "cifar10,dtd")),
    Key("train_split", None, str, "the split the shots are drawn from; None: the training "
        "data's train split, else 'train'", keys.SPLIT),
    Key("eval_split", None, str, "the split measured; None: the training data's eval split, "
        "else 'test'", keys.SPLIT),
    Key("shots", (1, 5, 10, 25), tuple, "training examples per class of each probe",
        keys.Check("a non-empty tuple of distinct positive ints",
                   lambda v: isinstance(v, (list, tuple)) and bool(v) and all(
                       map(keys.POSITIVE_INT.test, v)) and len(set(v)) == len(v), "1,5,10,25")),
    Key("seeds", 3, int, "draws of the shots per k (seeds 0 .. seeds-1)", keys.POSITIVE_INT),
    Key("l2_regs", (1024.0,), tuple, "the ridge penalties (big_vision's: 1024.0), each draw's "
        "best on held-out training examples",
        keys.Check("a non-empty tuple of numbers > 0",
                   lambda v: isinstance(v, (list, tuple)) and bool(v) and all(
                       map(keys.POSITIVE.test, v)), "1024.0")),
    Key("train_per_class", None, int, "training examples kept per class (the first ones); None: "
        "max(shots) * seeds (+ 10)", keys.POSITIVE_INT),
    Key("max_eval_examples", None, int, "eval examples used, the first ones of the eval split; "
        "None: the whole eval split", keys.POSITIVE_INT),
))

#: `config.analysis`: pictures in TensorBoard during training (docs/analysis.md); off.
ANALYSIS_KEYS: Tuple[Key, ...] = _untrained((
    Key("attention_images", 0, int,
        "at every evaluation, the mean attention distance per head against depth (ViT Fig. 7) of "
        "the first this many eval images; 0 turns the attention figures off",
        keys.NON_NEGATIVE_INT),
    Key("rollout_images", 4, int, "of those, how many are shown with their attention rollout "
        "maps; 0: no rollout maps", keys.NON_NEGATIVE_INT),
    Key("train_images", 0, int, "when the run starts, this many augmented training images; 0 "
        "turns the training-image grid off", keys.NON_NEGATIVE_INT),
))

#: The top level's keys (the sections, `SECTIONS`, besides).
RUN_KEYS: Tuple[Key, ...] = (
    Key("regime", "pretrain", str, "'pretrain' or 'finetune': REGIME_DEFAULTS fills every None "
        "regime key", keys.one_of(tuple(REGIME_DEFAULTS))),
    Key("seed", 0, int, "the seed of the initialisation, the data order and dropout", keys.INT),
    Key("model_name", "ViT-B_16", str, "the model variant (vit_jax.models.MODEL_NAMES); "
        "config.model holds its every field; 'auto': the ViT the weights of config.init_from "
        "record (docs/checkpoints.md)"),
    Key("recipe_regime", None, str, "the regime the config file's optimizer settings were "
        "chosen for: another --config.regime resets them to its REGIME_DEFAULTS (one warning); "
        "None: kept whatever the regime", keys.one_of(tuple(REGIME_DEFAULTS))),
    Key("num_classes", None, int, "classes of the head; None: the dataset's",
        keys.POSITIVE_INT),
    Key("batch_size", 4096, int, "the global batch over all devices and hosts, images per update",
        keys.POSITIVE_INT),
    Key("grad_accum_steps", 1, int, "micro-batches per update, run one after the other",
        keys.POSITIVE_INT, trained=False),
    Key("slice", None, str, "the Cloud TPU slice (e.g. 'v3-32') the settings were fitted to "
        "(vit_jax.config.slices); resolve refuses another number of devices; None: not fitted",
        trained=False),
    Key("eval_batch_size", None, int, "the eval step's global batch; None: batch_size",
        keys.POSITIVE_INT, trained=False),
    Key("total_steps", None, int, "optimizer updates of the run; None: from num_epochs",
        keys.STEP_COUNT),
    Key("num_epochs", None, float, "epochs of data.train_split, when total_steps is None",
        keys.POSITIVE),
    _regime("loss", str, "the loss", keys.one_of(LOSSES)),
    Key("label_smoothing", 0.0, float, "label smoothing; the T2T-ViT recipe uses 0.1", keys.UNIT),
    Key("ema_decay", 0.0, float, "decay of the parameters' EMA (timm ModelEmaV2), evaluated as "
        "'<split>_ema/...'; 0 disables it; the T2T-ViT recipe uses 0.99996", keys.UNIT),
    Key("init_from", None, str, "fine-tuning: the checkpoint (any vit_jax.checkpoint format) to "
        "initialise from when the workdir has none yet", trained=False),
    Key("pretrained_dir", None, str, "the official convention instead: init_from = "
        "'{pretrained_dir}/{model_name}.npz' (e.g. gs://vit_models/imagenet21k)", trained=False),
    Key("init_from_ema", True, bool, "take the checkpoint's EMA weights when it has them",
        keys.BOOL, trained=False),
    Key("init_reset_head", True, bool, "True: a new head always (official ViT); False: keep the "
        "checkpoint's head when the class count is the same (T2T-ViT reference)", keys.BOOL,
        trained=False),
    Key("log_every_steps", 50, int, "optimizer steps between training metrics",
        keys.POSITIVE_INT, trained=False),
    Key("eval_every_steps", 1000, int, "optimizer steps between evaluations (also at the end)",
        keys.POSITIVE_INT, trained=False),
    Key("checkpoint_every_steps", 1000, int, "optimizer steps between checkpoints (also at the "
        "end)", keys.POSITIVE_INT, trained=False),
    Key("keep_checkpoints", 3, int, "the most recent checkpoints kept", keys.POSITIVE_INT,
        trained=False),
    Key("input_wait_warning", 0.1, float, "warn when a log window's steps wait on input for more "
        "than this share of their time (docs/compute_cost.md); 0 turns the warning off",
        keys.UNIT, trained=False),
    Key("async_checkpointing", True, bool, "save checkpoints while training goes on", keys.BOOL,
        trained=False),
    Key("workdir_lock_timeout", 600, int, "seconds without a heartbeat before a gs:// workdir's "
        "lock is stale and taken over (docs/configs.md)", keys.POSITIVE, trained=False),
    Key("compilation_cache_dir", "", str, "JAX's persistent compilation cache: '' is "
        "$JAX_COMPILATION_CACHE_DIR if set, else WORKDIR/compilation_cache; 'none' turns it off; "
        "else a directory (local or gs://)", trained=False),
    Key("resume_with_changes", False, bool, "resume a run whose WORKDIR/config.json differs in "
        "keys that change what it trains (e.g. a longer total_steps); False refuses such a "
        "resume, naming the keys", keys.BOOL, trained=False),
)

#: Every section below the top level with its keys and one line of help; `config.model`'s keys
#: are the model's fields (`vit_jax.models.fields`).
SECTIONS: Dict[str, Tuple[Tuple[Key, ...], str]] = {
    "model": ((), "every field of config.model_name's model, and how the blocks run"),
    "data": (DATA_KEYS, "the input pipeline (vit_jax.data)"),
    "extra_eval": (EXTRA_EVAL_KEYS, "a second eval set of the same classes"),
    "optim": (OPTIM_KEYS, "the optimizer, its schedule and the fine-tuning controls"),
    "mesh": (MESH_KEYS, "the device mesh and the logical-axis rules (vit_jax.sharding)"),
    "fewshot": (FEWSHOT_KEYS, "few-shot linear evaluation during training"),
    "analysis": (ANALYSIS_KEYS, "pictures in TensorBoard during training"),
}


def model_config(model_name: str, **model_overrides) -> ml_collections.ConfigDict:
  """``config.model``: every field of the named variant, resolved, plus how the blocks run.

  Raises ValueError, TypeError as ``vit_jax.models.model_config``.
  """
  model_overrides = dict(model_overrides)
  attention = model_overrides.pop("attention", "auto")  # Resolved from the target devices.
  if model_overrides.get("remat_policy") == "auto":  # Also resolved there (the default).
    del model_overrides["remat_policy"]
  fields = models.model_config(model_name, **model_overrides)
  fields.update({k: v for k, v in TRAINING_DEFAULTS.items()
                 if k in fields and k not in model_overrides})
  fields["attention"] = attention
  model = ml_collections.ConfigDict(fields)
  for key, value in list(model.items()):
    if value is None:  # e.g. representation_size: keep it overridable with the right type.
      model[key] = config_dict.placeholder(models.FIELD_TYPES[key])
  if "head_bias_init" in model:  # ViT: the regime's default (-10 or 0) if None.
    model.head_bias_init = config_dict.placeholder(float)
  return model


def data_config() -> ml_collections.ConfigDict:
  """``config.data`` (`DATA_KEYS`): the official ViT fine-tuning pipeline on the offline
  Fashion-MNIST builder."""
  return keys.section(DATA_KEYS)


def mesh_config() -> ml_collections.ConfigDict:
  """`config.mesh` (`MESH_KEYS`): axis sizes (-1: all the devices the other axes leave)."""
  return keys.section(MESH_KEYS)


def get_config(model_name: str = "ViT-B_16", dataset: str = "imagenet2012",
               **model_overrides) -> ml_collections.ConfigDict:
  """The locked default config of ``model_name`` (with ``model_overrides``) on ``dataset`` (a tfds
  name or prepared directory); ValueError, TypeError for an unknown model name or override."""
  config = keys.section(RUN_KEYS, model_name=model_name)
  config.model = model_config(model_name, **model_overrides)
  config.data = keys.section(DATA_KEYS, name=dataset)
  for name, (section_keys, _) in SECTIONS.items():
    if name not in config:
      config[name] = keys.section(section_keys)
  config.lock()
  return config
