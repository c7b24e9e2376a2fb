"""Every key of the training config with its default and meaning: the one place defaults live.

:func:`get_config` returns a locked ``ml_collections.ConfigDict`` (a typo in ``--config.key`` is an
error); a None default is a typed placeholder that ``vit_jax.config.resolve`` fills and checks.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from vit_jax import models

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

#: How the blocks run in training unless overridden: scanned, each rematerialised with the policy
#: 'auto' picks from the target devices (docs/configs.md); the models' own defaults stay the
#: plain unrolled encoder with the official per-layer names.
TRAINING_DEFAULTS = dict(scan=True, remat=True, remat_policy="auto")

#: `config.model.attention`: 'auto' picks the fastest implementation the devices can run.
ATTENTION_CHOICES = ("auto",) + models.ATTENTION_IMPLEMENTATIONS

#: Values of `config.data.augment`, `config.data.normalization`, `config.data.bad_images`.
AUGMENTATIONS = ("inception_crop", "pad_crop", "flip", "none")
NORMALIZATIONS = ("minus_one_to_one", "imagenet")
BAD_IMAGES = ("fail", "skip")



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


def optim_config() -> ml_collections.ConfigDict:
  """`config.optim` (None: the regime's default, see `REGIME_DEFAULTS`)."""
  c = ml_collections.ConfigDict()
  c.optimizer = config_dict.placeholder(str)  # 'adamw' or 'sgd'.
  c.lr = config_dict.placeholder(float)  # Peak learning rate.
  c.weight_decay = config_dict.placeholder(float)  # Decoupled, kernels only.
  c.b1 = config_dict.placeholder(float)  # Adam.
  c.b2 = config_dict.placeholder(float)  # Adam.
  c.momentum = config_dict.placeholder(float)  # SGD.
  c.schedule = config_dict.placeholder(str)  # 'linear', 'cosine' or 'constant'.
  c.warmup_steps = config_dict.placeholder(int)
  c.end_lr = 0.0  # Learning rate at the end of the decay.
  # Recipes stated in epochs or at a reference batch (T2T-ViT's); optim.schedule_from_config.
  c.lr_base_batch_size = config_dict.placeholder(int)  # lr *= batch_size / this.
  c.warmup_epochs = config_dict.placeholder(float)  # Replaces warmup_steps if set.
  c.warmup_init_lr = 0.0  # The warmup rises from this rate.
  c.cooldown_steps = 0  # Updates at end_lr after the decay (part of the run).
  c.cooldown_epochs = config_dict.placeholder(float)  # Replaces cooldown_steps if set.
  c.grad_clip_norm = config_dict.placeholder(float)  # 0 disables clipping.
  # Updates with NaN/Inf gradients skipped (train/skipped_updates) up to this many in a row;
  # the next one stops the run. 0: the first non-finite loss stops it.
  c.max_skipped_updates = 0
  # Fine-tuning controls (vit_jax.param_groups; docs/configs.md), all off by default. Names
  # are '/'-joined ('Transformer/encoderblock_3/MlpBlock_0/Dense_0/kernel', per layer also with
  # scan=True) and patterns match them whole (re.fullmatch), the first one deciding.
  # Layer-wise lr decay (BEiT, timm layer_decay): layer i of 0 (embeddings) .. L + 1 (head) gets
  # lr * layer_decay^(L + 1 - i); in (0, 1], None: off.
  c.layer_decay = config_dict.placeholder(float)
  # Frozen parameters (zero updates, no optimizer state), e.g. ('(?!head/).*',): a linear probe.
  c.freeze = ()
  # (pattern, multiplier) of the weight decay; unmatched parameters keep the default: 1 on
  # kernels, 0 elsewhere. E.g. (('head/.*', 0.0),).
  c.wd_mults = ()
  # The first this many updates train only head_warmup_pattern's parameters (LP-FT); 0: off.
  c.head_warmup_steps = 0
  c.head_warmup_pattern = "head/.*"
  return c


def data_config() -> ml_collections.ConfigDict:
  """``config.data``: the input pipeline (``vit_jax.data``); the defaults are the official ViT
  fine-tuning pipeline on the offline Fashion-MNIST builder."""
  c = ml_collections.ConfigDict()
  # A registered tfds name ('cifar10', 'name/config', 'name:1.2.3') or a prepared tfds directory
  # (a path: starts with '/', '.', '~', has '://', or exists); ignored with `image_folder`.
  c.name = "fashion_mnist_local"
  # Root of an image-folder dataset: root/<split>/<class>/*.{jpg,jpeg,png} (classes sorted).
  c.image_folder = config_dict.placeholder(str)
  # tfds data_dir (local or gs://); None: $TFDS_DATA_DIR or ~/tensorflow_datasets.
  c.data_dir = config_dict.placeholder(str)
  # tfds manual_dir for preparing (e.g. the ImageNet tars; fashion_mnist_local's IDX files).
  c.manual_dir = config_dict.placeholder(str)
  c.prepare = True  # Prepare an unprepared dataset from local files (nothing is ever downloaded).

  # Splits, with tfds slicing syntax ('train[:98%]', 'train[1000:]', 'train+validation', ...).
  c.train_split = "train"
  c.eval_split = "test"

  c.image_size = 224  # Side S of the square [S, S, 3] images fed to the model.
  # Training augmentation: 'inception_crop' (ViT fine-tuning), 'pad_crop' (a random shift by up
  # to pad_crop_pixels), each + resize to S and a random flip; 'flip'; 'none' (resize only).
  c.augment = "inception_crop"
  c.inception_crop_min_area = 0.05  # Minimum fraction of the image area kept by the Inception crop.
  c.pad_crop_pixels = 4  # The largest shift of 'pad_crop', in pixels of the source image.
  # The T2T-ViT / DeiT recipe's augmentations (timm's; vit_jax.data.augment), off by default.
  # RandAugment after the crop / flip: this many ops per image (0: off), each with probability
  # 0.5, magnitude ~ N(magnitude, magnitude_std) in [0, 10].
  c.randaugment_num_layers = 0
  c.randaugment_magnitude = 9.0
  c.randaugment_magnitude_std = 0.5
  # Random erasing after normalization: the probability of one rectangle of N(0, 1) noise.
  c.random_erasing = 0.0
  # Mixup / CutMix of each process's batch with its reverse (timm Mixup, mode 'batch'): a batch
  # is mixed with probability mix_prob, by CutMix with probability mix_switch_prob when both
  # alphas are > 0; lambda ~ Beta(alpha, alpha). An alpha of 0 disables that method.
  c.mixup_alpha = 0.0
  c.cutmix_alpha = 0.0
  c.mix_switch_prob = 0.5
  c.mix_prob = 1.0
  # Eval resizing: None resizes the whole image to S (official ViT); a fraction p resizes the
  # shorter side to floor(S / p) and takes the central crop (timm; T2T-ViT: 0.9).
  c.eval_crop_pct = config_dict.placeholder(float)
  # 'minus_one_to_one' (ViT) or 'imagenet' mean/std (T2T-ViT, timm); preprocess.normalize.
  c.normalization = "minus_one_to_one"

  c.shuffle_buffer = 50_000  # Examples in the training shuffle buffer (per process; docs/data.md).
  c.prefetch = 2  # Batches prefetched by tf.data.
  # Keep the decoded, un-augmented images in host memory (small datasets: Fashion-MNIST, CIFAR).
  c.cache = False
  c.num_parallel_calls = -1  # Parallelism of the decode / augment maps; -1 = tf.data.AUTOTUNE.

  # Undecodable images: 'fail' raises `vit_jax.data.BadImageError` naming them; 'skip' leaves
  # them out (docs/failures.md).
  c.bad_images = "fail"

  c.image_key = "image"  # Feature holding the image.
  # Feature holding the labels; None: 'real_label' for 'imagenet2012_real', else 'label' or
  # 'labels'. ClassLabel: one-hot; Sequence(ClassLabel): multi-hot targets.
  c.label_key = config_dict.placeholder(str)
  return c


def mesh_config() -> ml_collections.ConfigDict:
  """`config.mesh`: axis sizes (-1: all the devices the other axes leave) and rule changes."""
  c = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  # Data parallelism across TPU slices (multi-slice over DCN); 1 for one slice or host group.
  c.dcn_data = 1
  # Changes to vit_jax.sharding.DEFAULT_RULES, 'logical=mesh_axis[+mesh_axis],...' (empty right
  # side: unsharded), e.g. 'embed=,mlp=fsdp'.
  c.rules = ""
  # With fsdp > 1, stop when more than this fraction of the parameter bytes stays replicated.
  c.max_replicated_fraction = 0.5
  return c


def fewshot_config() -> ml_collections.ConfigDict:
  """``config.fewshot``: few-shot linear evaluation during training (docs/evaluation.md)."""
  c = ml_collections.ConfigDict()
  c.every_steps = 0  # Every this many steps, and at the end of training; 0 (default): off.
  # tfds names or prepared directories, read with the training config's eval preprocessing
  # (--config.fewshot.datasets=cifar10,oxford_iiit_pet); empty: the training data itself.
  c.datasets = ()
  # The split the shots are drawn from and the split measured; None: the training data's
  # config.data.train_split / eval_split for the training data, 'train' / 'test' for the others.
  c.train_split = config_dict.placeholder(str)
  c.eval_split = config_dict.placeholder(str)
  c.shots = (1, 5, 10, 25)  # Training examples per class of each probe.
  c.seeds = 3  # Draws of the shots per k (seeds 0 .. seeds-1).
  # The ridge penalty, or several: each draw's best on held-out training examples.
  c.l2_regs = (1024.0,)
  # Training examples kept per class (the first ones); None: max(shots) * seeds (+ 10).
  c.train_per_class = config_dict.placeholder(int)
  # Eval examples used, the first ones of the eval split; None: all of them.
  c.max_eval_examples = config_dict.placeholder(int)
  return c


def analysis_config() -> ml_collections.ConfigDict:
  """`config.analysis`: pictures in TensorBoard during training (docs/analysis.md); off."""
  c = ml_collections.ConfigDict()
  # At every evaluation: the mean attention distance per head against depth (ViT Fig. 7 right)
  # of the first this many eval images; 0: off.
  c.attention_images = 0
  # Of those, how many are shown with their attention rollout maps ('analysis/rollout').
  c.rollout_images = 4
  c.train_images = 0  # When the run starts: this many augmented training images; 0: off.
  return c


def get_config(model_name: str = "ViT-B_16", dataset: str = "imagenet2012",
               **model_overrides) -> ml_collections.ConfigDict:
  """The locked default config of ``model_name`` (with ``model_overrides``) on ``dataset`` (a tfds
  name or prepared directory); ValueError, TypeError for an unknown model name or override."""
  config = ml_collections.ConfigDict()
  # 'pretrain' or 'finetune': the defaults of REGIME_DEFAULTS for every None regime field.
  config.regime = "pretrain"
  config.seed = 0

  # `model` holds every field of the named variant (--config.model.num_layers=4).
  config.model_name = model_name
  config.model = model_config(model_name, **model_overrides)
  # Classes of the head; None: the dataset's (the resolved config records the number).
  config.num_classes = config_dict.placeholder(int)

  config.data = data_config()
  config.data.name = dataset

  # An optional second eval set of the same classes, '<name>_<split>/accuracy' (e.g.
  # 'imagenet2012_real' for the ImageNet ReaL labels).
  config.extra_eval = ml_collections.ConfigDict()
  config.extra_eval.name = config_dict.placeholder(str)  # tfds name or prepared directory.
  config.extra_eval.split = "validation"

  # Schedule length: total_steps if set, else num_epochs (epochs of data.train_split).
  config.batch_size = 4096  # Global batch over all devices and hosts (images per update).
  config.grad_accum_steps = 1  # Split each batch into this many sequential micro-batches.
  # The Cloud TPU slice (e.g. 'v3-32') the settings were fitted to (vit_jax.config.slices);
  # resolve refuses another number of devices. None: not fitted.
  config.slice = config_dict.placeholder(str)
  # Global batch of the eval step, which has no accumulation (None: batch_size).
  config.eval_batch_size = config_dict.placeholder(int)
  config.total_steps = config_dict.placeholder(int)
  config.num_epochs = config_dict.placeholder(float)

  # Loss: 'softmax_xent' or 'sigmoid_xent' (None: the regime's).
  config.loss = config_dict.placeholder(str)
  config.label_smoothing = 0.0

  config.optim = optim_config()

  # Decay of the parameters' EMA (timm ModelEmaV2), evaluated as '<split>_ema/...'; 0: off.
  config.ema_decay = 0.0

  # Fine-tuning: initialise from this checkpoint (any vit_jax.checkpoint format) when the workdir
  # has none yet.
  config.init_from = config_dict.placeholder(str)
  # The official convention instead: init_from = '{pretrained_dir}/{model_name}.npz'
  # (e.g. gs://vit_models/imagenet21k with model_name 'ViT-B_16').
  config.pretrained_dir = config_dict.placeholder(str)
  config.init_from_ema = True  # Take the checkpoint's EMA weights when it has them.
  # True: a new head always (official ViT). False: keep the checkpoint's head when the class
  # count is the same (T2T-ViT reference; e.g. ImageNet fine-tuning at a higher resolution).
  config.init_reset_head = True

  config.mesh = mesh_config()  # The device mesh and the logical-axis rules (vit_jax.sharding).

  # Periodic work, in optimizer steps.
  config.log_every_steps = 50
  config.eval_every_steps = 1000  # Also evaluated at the end of training.
  config.checkpoint_every_steps = 1000  # Also saved at the end of training.
  config.keep_checkpoints = 3  # Most recent checkpoints kept on disk.
  # Warn when the steps of a log_every_steps window wait on input for more than this share of
  # their time (docs/compute_cost.md); 0: never.
  config.input_wait_warning = 0.1
  config.async_checkpointing = True
  # Seconds after which a gs:// workdir lock's stale heartbeat is taken over (docs/configs.md).
  config.workdir_lock_timeout = 600
  # JAX's persistent compilation cache, shared by a pod's hosts: '' is $JAX_COMPILATION_CACHE_DIR
  # if set, else WORKDIR/compilation_cache; 'none' turns it off; else a directory (local or
  # gs://) (docs/configs.md).
  config.compilation_cache_dir = ''

  config.fewshot = fewshot_config()
  config.analysis = analysis_config()

  config.lock()
  return config
