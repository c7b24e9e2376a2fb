"""Every key of the training config with its default and meaning: the one place defaults live.

:func:`get_config` returns a locked ``ml_collections.ConfigDict``; config files change values,
never add keys, so a typo in ``--config.some_key`` is an error. A None default is a typed
placeholder, filled (regime fields from ``REGIME_DEFAULTS``, schedule length from the dataset)
and checked by ``vit_jax.config.resolve``.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from vit_jax import models

#: The two regimes of the ViT paper (Sec. 4.1 and App. B.1; docs/reference.md section 3). Every
#: key is a config field that is None by default and filled from here by `resolve`, so
#: `--config.regime=finetune` switches all of them and a single override still wins.
REGIME_DEFAULTS = {
    # Adam (0.9, 0.999) with decoupled weight decay, linear warmup then linear decay, sigmoid
    # cross-entropy with the head bias at -10.
    "pretrain": dict(optimizer="adamw", lr=1e-3, weight_decay=0.1, b1=0.9, b2=0.999,
                     momentum=0.9, schedule="linear", warmup_steps=10_000, grad_clip_norm=1.0,
                     loss="sigmoid_xent", head_bias_init=-10.0),
    # SGD momentum 0.9, global-norm clipping at 1, cosine decay after 500 warmup steps, no
    # weight decay, softmax cross-entropy with a zero head.
    "finetune": dict(optimizer="sgd", lr=0.03, weight_decay=0.0, b1=0.9, b2=0.999,
                     momentum=0.9, schedule="cosine", warmup_steps=500, grad_clip_norm=1.0,
                     loss="softmax_xent", head_bias_init=0.0),
}

#: How the blocks run in training unless a config overrides it: a scanned encoder (one
#: compiled block body, stacked parameters) whose blocks are rematerialised with the policy
#: 'auto' picks from the target devices, the compute dtype and the width
#: (`vit_jax.dispatch.choose_remat_policy`: on a CPU, and on TPU/GPU in 16-bit below ViT-L's
#: width, the dense projections' outputs are kept; otherwise less). Both model families
#: take these fields; the models' own defaults stay the plain unrolled encoder with the
#: official per-layer names (docs/benchmarks.md has the measurements behind the choice).
TRAINING_DEFAULTS = dict(scan=True, remat=True, remat_policy="auto")

#: `config.model.attention`: 'auto' picks, from the devices the step is compiled for, the
#: fastest implementation that can run there (`vit_jax.dispatch.choose_attention`).
ATTENTION_CHOICES = ("auto",) + models.ATTENTION_IMPLEMENTATIONS

#: Values of `config.data.augment`, `config.data.normalization`, `config.data.bad_images`.
AUGMENTATIONS = ("inception_crop", "pad_crop", "flip", "none")
NORMALIZATIONS = ("minus_one_to_one", "imagenet")
BAD_IMAGES = ("fail", "skip")

# Model fields whose None default stands for a float (the others are ints, e.g.
# representation_size): T2T-ViT's attention scale (None: head_dim**-0.5).
_FLOAT_MODEL_FIELDS = {"qk_scale": float}


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
      model[key] = config_dict.placeholder(_FLOAT_MODEL_FIELDS.get(key, int))
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
  # Recipes stated in epochs or at a reference batch (T2T-ViT: "lr 5e-4 at batch 512, 10 warmup
  # epochs from 1e-6, cosine to 1e-5, 10 cooldown epochs"); see optim.schedule_from_config.
  c.lr_base_batch_size = config_dict.placeholder(int)  # lr *= batch_size / this.
  c.warmup_epochs = config_dict.placeholder(float)  # Replaces warmup_steps if set.
  c.warmup_init_lr = 0.0  # The warmup rises from this rate.
  c.cooldown_steps = 0  # Updates at end_lr after the decay (part of the run).
  c.cooldown_epochs = config_dict.placeholder(float)  # Replaces cooldown_steps if set.
  c.grad_clip_norm = config_dict.placeholder(float)  # 0 disables clipping.
  # Large runs: an update whose gradients are NaN/Inf is skipped (parameters and optimizer state
  # unchanged, counted in train/skipped_updates) up to this many times in a row; the next one
  # stops the run. 0 (default): the first non-finite loss stops the run.
  c.max_skipped_updates = 0
  return c


def data_config() -> ml_collections.ConfigDict:
  """``config.data``: the input pipeline (``vit_jax.data``).

  The defaults reproduce the official ViT fine-tuning input pipeline on the offline
  Fashion-MNIST builder, so they work without network access.
  """
  c = ml_collections.ConfigDict()
  # Dataset: a registered tfds name ('cifar10', 'name/config', 'name:1.2.3') or the directory of
  # a prepared tfds dataset (a path: starts with '/', '.', '~', has '://', or exists). Ignored
  # if `image_folder` is set.
  c.name = "fashion_mnist_local"
  # Root of an image-folder dataset: root/<split>/<class>/*.{jpg,jpeg,png} (classes sorted).
  c.image_folder = config_dict.placeholder(str)
  # tfds data_dir (local path or gs://...); None = tfds default ($TFDS_DATA_DIR or
  # ~/tensorflow_datasets).
  c.data_dir = config_dict.placeholder(str)
  # tfds manual_dir for preparing (e.g. the ImageNet tars; fashion_mnist_local's IDX files).
  c.manual_dir = config_dict.placeholder(str)
  # Prepare an unprepared dataset from local files (nothing is ever downloaded).
  c.prepare = True

  # Splits, with tfds slicing syntax ('train[:98%]', 'train[1000:]', 'train+validation', ...).
  c.train_split = "train"
  c.eval_split = "test"

  # Side S of the square [S, S, 3] images fed to the model.
  c.image_size = 224
  # Training augmentation (vit_jax.data.preprocess): 'inception_crop' (the ViT fine-tuning
  # recipe), 'pad_crop' (random translation by up to pad_crop_pixels), each + resize to S and a
  # random flip; 'flip'; 'none' (resize only).
  c.augment = "inception_crop"
  # Minimum fraction of the image area kept by the Inception crop.
  c.inception_crop_min_area = 0.05
  # The largest shift of 'pad_crop', in pixels of the source image.
  c.pad_crop_pixels = 4
  # Extra training augmentations of the T2T-ViT / DeiT ImageNet recipe (timm's), off by
  # default; see vit_jax.data.augment. All are seeded by (seed, step), so resuming is exact.
  # RandAugment after the crop / flip (timm 'rand-m9-mstd0.5-inc1'): this many ops per image
  # (0 disables), each with probability 0.5, magnitude ~ N(magnitude, magnitude_std) in [0, 10].
  c.randaugment_num_layers = 0
  c.randaugment_magnitude = 9.0
  c.randaugment_magnitude_std = 0.5
  # Random erasing after normalization: with this probability one rectangle (2%-33% of the
  # area, aspect ratio 0.3-3.3) is filled with standard-normal noise (timm mode 'pixel').
  c.random_erasing = 0.0
  # Mixup / CutMix of each process's batch with its reverse (timm Mixup, mode 'batch'): with
  # probability mix_prob a batch is mixed, by CutMix with probability mix_switch_prob when both
  # alphas are > 0; lambda ~ Beta(alpha, alpha) (CutMix: corrected to the pasted area); labels
  # become lambda * y + (1 - lambda) * y_reversed. 0 disables each.
  c.mixup_alpha = 0.0
  c.cutmix_alpha = 0.0
  c.mix_switch_prob = 0.5
  c.mix_prob = 1.0
  # Eval resizing: None resizes the whole image to S (bilinear; the official ViT eval); a
  # fraction p resizes the shorter side to floor(S / p) (bicubic) and takes the central S x S
  # crop (timm; T2T-ViT uses 0.9).
  c.eval_crop_pct = config_dict.placeholder(float)
  # 'minus_one_to_one' (ViT) or 'imagenet' mean/std (T2T-ViT, timm); preprocess.normalize.
  c.normalization = "minus_one_to_one"

  # Examples in the training shuffle buffer (per process). The buffer holds encoded images
  # (decoded ones if cache=True).
  c.shuffle_buffer = 50_000
  # Batches prefetched by tf.data.
  c.prefetch = 2
  # Cache the decoded, un-augmented images in memory before shuffling (train) and before
  # resizing (eval). Good for small datasets (Fashion-MNIST, CIFAR); the whole split of this
  # process must fit in host RAM.
  c.cache = False
  # Parallelism of the decode / augment maps; -1 = tf.data.AUTOTUNE.
  c.num_parallel_calls = -1

  # Undecodable images: 'fail' raises `vit_jax.data.BadImageError` naming them; 'skip' leaves
  # them out (image folders: validated once, before slicing; tfds: dropped while reading).
  # See docs/failures.md.
  c.bad_images = "fail"

  # Feature holding the image.
  c.image_key = "image"
  # Feature holding the labels; None: 'real_label' for 'imagenet2012_real', else 'label' or
  # 'labels'. ClassLabel: one-hot; Sequence(ClassLabel): multi-hot targets.
  c.label_key = config_dict.placeholder(str)
  return c


def mesh_config() -> ml_collections.ConfigDict:
  """`config.mesh`: axis sizes (-1: all the devices the other axes leave) and rule changes."""
  c = ml_collections.ConfigDict()
  c.data = -1
  c.fsdp = 1
  c.tensor = 1
  # Data parallelism across TPU slices (multi-slice over DCN); 1 for one slice or host group.
  c.dcn_data = 1
  # Changes to vit_jax.sharding.DEFAULT_RULES, 'logical=mesh_axis[+mesh_axis],...'; an empty
  # right side leaves the logical axis unsharded. E.g. 'embed=,mlp=fsdp' or
  # 'batch=data+fsdp+tensor'.
  c.rules = ""
  # Stop at startup when FSDP is requested (fsdp > 1) but more than this fraction of the
  # parameter bytes would still be replicated on every device.
  c.max_replicated_fraction = 0.5
  return c


def fewshot_config() -> ml_collections.ConfigDict:
  """``config.fewshot``: few-shot linear evaluation during training (docs/evaluation.md)."""
  c = ml_collections.ConfigDict()
  # Every this many steps, and at the end of training; 0 (default): off.
  c.every_steps = 0
  # tfds names or prepared directories, read with the training config's eval preprocessing
  # (--config.fewshot.datasets=cifar10,oxford_iiit_pet); empty: the training data itself.
  c.datasets = ()
  # The split the shots are drawn from and the split measured; None: the training data's
  # config.data.train_split / eval_split for the training data, 'train' / 'test' for the others.
  c.train_split = config_dict.placeholder(str)
  c.eval_split = config_dict.placeholder(str)
  c.shots = (1, 5, 10, 25)  # Training examples per class of each probe.
  c.seeds = 3  # Draws of the shots per k (seeds 0 .. seeds-1).
  # The ridge penalty: one value (big_vision's 2^10), or several, the best of each draw chosen
  # on held-out training examples (never on the eval split).
  c.l2_regs = (1024.0,)
  # Training examples kept per class: the first ones of the train split in reading order; None:
  # max(shots) * seeds (+ 10 held-out ones with several l2_regs). Reading stops when all are in.
  c.train_per_class = config_dict.placeholder(int)
  # Eval examples used, the first ones of the eval split; None: all of them.
  c.max_eval_examples = config_dict.placeholder(int)
  return c


def analysis_config() -> ml_collections.ConfigDict:
  """`config.analysis`: pictures in TensorBoard during training (`vit_jax.evaluation.pictures`;
  the same figures as `python -m vit_jax.analyze`, docs/analysis.md). Off by default."""
  c = ml_collections.ConfigDict()
  # At every evaluation: the mean attention distance of every head against depth (the ViT
  # paper's Fig. 7 right) over the first this many images of the first eval batch (lowered to
  # config.eval_batch_size), as 'analysis/attention_distance'; 0: off.
  c.attention_images = 0
  # Of those, how many are shown with their attention rollout maps ('analysis/rollout').
  c.rollout_images = 4
  # Once when the run starts (or resumes): this many images of the first training batch as the
  # model sees them, augmented ('analysis/training_images'); 0: off.
  c.train_images = 0
  return c


def get_config(model_name: str = "ViT-B_16", dataset: str = "imagenet2012",
               **model_overrides) -> ml_collections.ConfigDict:
  """The full default config for ``model_name`` on ``dataset``, locked (keys may not change).

  ``dataset``: a tfds name or prepared directory; ``model_overrides``: model fields differing
  from the named variant. Raises ValueError, TypeError for an unknown model name or override.
  """
  config = ml_collections.ConfigDict()
  # 'pretrain' or 'finetune': the defaults of REGIME_DEFAULTS for every None regime field.
  config.regime = "pretrain"
  config.seed = 0

  # Model: the name picks the family and variant; `model` holds every field of that variant,
  # resolved, so each can be overridden (--config.model.num_layers=4).
  config.model_name = model_name
  config.model = model_config(model_name, **model_overrides)
  # Classes of the head; None: the dataset's (the resolved config records the number).
  config.num_classes = config_dict.placeholder(int)

  config.data = data_config()
  config.data.name = dataset

  # An optional second evaluation set with the same classes and preprocessing, reported under
  # '<name>_<split>/accuracy': e.g. name='imagenet2012_real', split='validation' for the
  # ImageNet ReaL labels the ViT paper reports (images without a ReaL label are skipped).
  config.extra_eval = ml_collections.ConfigDict()
  config.extra_eval.name = config_dict.placeholder(str)  # tfds name or prepared directory.
  config.extra_eval.split = "validation"

  # Schedule length: total_steps if set, else num_epochs (epochs of data.train_split).
  config.batch_size = 4096  # Global batch over all devices and hosts (images per update).
  config.grad_accum_steps = 1  # Split each batch into this many sequential micro-batches.
  # The Cloud TPU slice (e.g. 'v3-32') whose devices a config's `<slice>` argument fitted the
  # batch to (compute dtype, mesh, accumulation: vit_jax.config.slices); resolve refuses to run
  # those settings on another number of devices. None: not fitted to a slice.
  config.slice = config_dict.placeholder(str)
  # Global batch of the eval step (None: batch_size). The eval step has no accumulation: lower
  # it when evaluating a large batch does not fit (python -m vit_jax.preflight says).
  config.eval_batch_size = config_dict.placeholder(int)
  config.total_steps = config_dict.placeholder(int)
  config.num_epochs = config_dict.placeholder(float)

  # Loss: 'softmax_xent' or 'sigmoid_xent' (None: the regime's).
  config.loss = config_dict.placeholder(str)
  config.label_smoothing = 0.0

  config.optim = optim_config()

  # Exponential moving average of the parameters (timm ModelEmaV2: ema = d * ema + (1 - d) *
  # params after every update), evaluated next to the parameters ('<split>_ema/...') and saved
  # in the checkpoint ('ema_params'); 0 disables it. T2T-ViT recipe: 0.99996.
  config.ema_decay = 0.0

  # Fine-tuning: initialise from this checkpoint (any format vit_jax.checkpoint reads) when the
  # workdir has none yet; see vit_jax.checkpoint.init_for_finetuning.
  config.init_from = config_dict.placeholder(str)
  # The official convention instead: init_from = '{pretrained_dir}/{model_name}.npz'
  # (e.g. gs://vit_models/imagenet21k with model_name 'ViT-B_16').
  config.pretrained_dir = config_dict.placeholder(str)
  config.init_from_ema = True  # Take the checkpoint's EMA weights when it has them.
  # True: a new head always (official ViT). False: keep the checkpoint's head when the class
  # count is the same (T2T-ViT reference; e.g. ImageNet fine-tuning at a higher resolution).
  config.init_reset_head = True

  # The device mesh ('data', 'fsdp', 'tensor' sizes; -1 = the rest) and the logical-axis rules:
  # data parallelism, FSDP and tensor parallelism are choices here; see vit_jax.sharding.
  config.mesh = mesh_config()

  # Periodic work, in optimizer steps.
  config.log_every_steps = 50
  config.eval_every_steps = 1000  # Also evaluated at the end of training.
  config.checkpoint_every_steps = 1000  # Also saved at the end of training.
  config.keep_checkpoints = 3  # Most recent checkpoints kept on disk.
  config.async_checkpointing = True
  # One run per workdir (WORKDIR/lock.json): on gs:// the lock is held by a heartbeat, and one
  # whose heartbeat is older than this many seconds (its run gone) is taken over.
  config.workdir_lock_timeout = 600

  config.fewshot = fewshot_config()
  config.analysis = analysis_config()

  config.lock()
  return config
