r"""ViT on a tfds dataset: `get_config('<model>,<dataset>[,<regime>][,<slice>]')`.

  <model>:   ti16, s16, s32, b16, b32, l16, l32, h14, g14, G14, or any name that
             vit_jax.models.create accepts (e.g. ViT-B_8).
  <dataset>: imagenet2012, imagenet21k, cifar10, cifar100, oxford_iiit_pet,
             oxford_flowers102, fashion_mnist_local, or any tfds name.
  <regime>:  pretrain (default) or finetune.
  <slice>:   a Cloud TPU type (v3-8, v3-32, v4-64, v5litepod-16, ...): keep the recipe's batch
             and fit it to that slice (vit_jax.config.slices): bfloat16 compute, FSDP when a
             replicated state would crowd a device, and the fewest gradient-accumulation
             micro-batches whose estimated memory fits; `python -m vit_jax.preflight` with the
             same config confirms it. Without it the config is float32, data parallel, no
             accumulation.

Pretraining follows the ViT paper's Table 3 (App. B.1; Adam b1 0.9, b2 0.999, batch 4096,
10k warmup steps, gradient clipping at global norm 1, a representation layer of width D, sigmoid
cross-entropy with head bias -10, 224 px, Inception crop + flip):
  imagenet21k    90 epochs, lr 1e-3, linear decay, weight decay 0.03, dropout 0.1
  imagenet2012  300 epochs, lr 3e-3, cosine decay, weight decay 0.3,  dropout 0.1
(Until 2026-12, imagenet2012 pretrained with lr 1e-3, linear decay and weight decay 0.1;
corrected to the table.) Other datasets pretrain 300 epochs with the regime's defaults (lr
1e-3, linear decay, weight decay 0.1; not in the paper). The paper's JFT-300M rows (7 or 14
epochs, lr 8e-4 for B, 6e-4 L/32, 4e-4 L/16, 3e-4 H/14) need a JFT-style dataset: pass its tfds
name with --config.num_epochs and --config.optim.lr from the table.
Fine-tuning is the official recipe: SGD momentum 0.9, batch 512, lr 0.03 cosine, 500 warmup
steps, no weight decay, clipping at 1, 384 px.

Examples:
  # ViT-B/16 pretraining on ImageNet-21k (Table 3: 90 epochs, batch 4096, Adam lr 1e-3,
  # weight decay 0.03, dropout 0.1, representation layer, sigmoid loss, head bias -10).
  python -m vit_jax.main --config configs/vit.py:b16,imagenet21k --workdir gs://b/b16_i21k \
      --config.data.data_dir=gs://b/tensorflow_datasets
  # The same on a v3-8: bfloat16, 512 images per core in micro-batches; check it first.
  python -m vit_jax.preflight --config configs/vit.py:b16,imagenet21k,v3-8 --accelerator v3-8
  # Fine-tuning schedule for CIFAR-10 (SGD momentum 0.9, 10k steps, batch 512, cosine, lr 0.03).
  python -m vit_jax.main --config configs/vit.py:b16,cifar10,finetune --workdir /tmp/b16_c10

The schedule lengths below are the paper's; on one CPU they take years, so shorten them
with --config.total_steps=... for a look.
"""

from ml_collections import config_dict

from vit_jax import config as config_lib
from vit_jax import models
from vit_jax.config import resolution

MODELS = {
    "ti16": "ViT-Ti_16", "s16": "ViT-S_16", "s32": "ViT-S_32", "b16": "ViT-B_16",
    "b32": "ViT-B_32", "l16": "ViT-L_16", "l32": "ViT-L_32", "h14": "ViT-H_14",
    "g14": "ViT-g_14", "G14": "ViT-G_14",
}

# Pretraining hyper-parameters of the ViT paper's Table 3, by dataset: (lr, decay, weight decay,
# dropout), the epochs in DATASETS; other datasets get the regime's defaults and no dropout.
TABLE3 = {
    "imagenet21k": (1e-3, "linear", 0.03, 0.1),
    "imagenet2012": (3e-3, "cosine", 0.3, 0.1),
}

# name -> (train split, eval split, pretraining epochs, fine-tuning steps).
DATASETS = {
    "imagenet2012": ("train[:99%]", "validation", 300, 20_000),
    "imagenet21k": ("train[:99%]", "train[99%:]", 90, 20_000),
    "cifar10": ("train[:98%]", "test", 300, 10_000),
    "cifar100": ("train[:98%]", "test", 300, 10_000),
    "oxford_iiit_pet": ("train[:90%]", "test", 300, 500),
    "oxford_flowers102": ("train[:90%]", "test", 300, 500),
    "fashion_mnist_local": ("train", "test", 30, 2_000),
}

# Classes of the heads, for the state's size when fitting to a slice (others: 1000).
CLASSES = {"imagenet21k": 21_843, "cifar10": 10, "cifar100": 100, "oxford_iiit_pet": 37,
           "oxford_flowers102": 102, "fashion_mnist_local": 10}

ARGS = config_lib.args.Spec(
    "configs/vit.py", ("model", "dataset", "regime", "slice"),
    choices={"regime": tuple(config_lib.REGIME_DEFAULTS)},
    defaults={"regime": "pretrain", "slice": None},
    help={"model": f"{', '.join(MODELS)}, a name vit_jax.models.create accepts, or auto (the "
                   "ViT of --config.init_from)",
          "dataset": "a tfds name, e.g. imagenet2012, cifar10",
          "slice": "a Cloud TPU type, e.g. v3-32"},
    patterns={"slice": config_lib.slices.SLICE_PATTERN})


def get_config(arg: str = "b16,imagenet2012"):
  """Returns the config for '<model>,<dataset>[,<regime>][,<slice>]' (see the module docstring)."""
  args = ARGS.parse(arg)
  model, dataset, regime = args["model"], args["dataset"], args["regime"]
  model_name = MODELS.get(model, model)
  train_split, eval_split, epochs, finetune_steps = DATASETS.get(
      dataset, ("train", "test", 300, 10_000))

  pretrain = regime == "pretrain"
  table = TABLE3.get(dataset) if pretrain else None
  overrides = {}
  if table:  # Pretraining on large data: dropout 0.1 and a representation layer of width D.
    overrides["dropout_rate"] = table[3]
  custom = model_name == "ViT-custom"  # Its fields are given as --config.model.<field> flags.
  if model == "auto" or custom:  # auto: the ViT the weights of --config.init_from record.
    overrides.update(resolution.AUTO_PLACEHOLDERS)
    model_name = "ViT-custom"
  config = config_lib.get_config(model_name, dataset, **overrides)
  if custom:  # None: resolve refuses each one not given, by name.
    for key in resolution.AUTO_PLACEHOLDERS:
      config.model[key] = config_dict.placeholder(models.FIELD_TYPES[key])
  if table:
    config.model.representation_size = config.model.hidden_size
  if model == "auto":
    config.model_name = resolution.AUTO
    # Read from the weights, or asked for: never a placeholder's; a typed None, so that
    # --config.model.num_heads=N sets it.
    config.model.num_heads = config_dict.placeholder(int)
  config.regime = regime
  config.recipe_regime = regime if table else None  # Table 3's lr and decay: pretraining's.
  config.data.train_split = train_split
  config.data.eval_split = eval_split
  if dataset == "imagenet2012":
    # Also report ImageNet ReaL (paper Table 2); needs tfds 'imagenet2012_real' prepared in
    # data_dir. --config.extra_eval.name="" turns it off.
    config.extra_eval.name = "imagenet2012_real"
    config.extra_eval.split = "validation"
  if pretrain:
    config.batch_size = 4096
    config.num_epochs = float(epochs)
    config.data.image_size = 224
    config.data.augment = "inception_crop"
    if table:
      config.optim.lr, config.optim.schedule, config.optim.weight_decay, _ = table
  else:
    config.batch_size = 512
    config.total_steps = finetune_steps
    config.data.image_size = 384
    config.data.augment = "inception_crop"
  if args["slice"]:
    config_lib.slices.fit_to_slice(config, args["slice"],
                                   num_classes=CLASSES.get(dataset, 1000))
  return config
