"""The default training config that every `configs/*.py` file starts from.

`get_config(model_name, dataset)` returns a locked `ml_collections.ConfigDict`: every key that
`vit_jax.train` reads, with its default. Config files change values, never add keys, so a
typo in `--config.some_key=...` is an error. Fields whose default is None are typed
placeholders: they can be overridden from the command line, and the regime fields among them
(optimizer, lr, schedule, loss, head bias, ...) are filled by `vit_jax.optim.resolve_regime`.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from vit_jax import data
from vit_jax import models
from vit_jax import sharding


# Model fields whose None default stands for a float (the others are ints, e.g.
# representation_size): T2T-ViT's attention scale (None: head_dim**-0.5).
_FLOAT_MODEL_FIELDS = {"qk_scale": float}


def get_config(model_name: str = "ViT-B_16", dataset: str = "imagenet2012",
               **model_overrides) -> ml_collections.ConfigDict:
  """Returns the full default config for `model_name` trained on tfds `dataset`.

  Args:
    model_name: any name `vit_jax.models.create` accepts, e.g. 'ViT-B_16'.
    dataset: a tfds name (or a prepared tfds directory), see `vit_jax.data.get_default_config`.
    **model_overrides: model fields that differ from the named variant (e.g. num_layers=4).

  Returns:
    A locked ConfigDict (values may change, keys may not).
  """
  config = ml_collections.ConfigDict()
  # 'pretrain' (Adam, linear decay, sigmoid xent, head bias -10) or 'finetune' (SGD momentum,
  # cosine decay, softmax xent, grad clip 1): see vit_jax.optim.REGIME_DEFAULTS.
  config.regime = "pretrain"
  config.seed = 0

  # Model: the name picks the family and variant; `model` holds every field of that variant,
  # resolved, so each can be overridden (--config.model.num_layers=4).
  config.model_name = model_name
  fields = models.model_config(model_name, **model_overrides)
  # The execution fields train as models.TRAINING_DEFAULTS says (scanned, rematerialised blocks).
  fields.update({k: v for k, v in models.TRAINING_DEFAULTS.items()
                 if k in fields and k not in model_overrides})
  config.model = ml_collections.ConfigDict(fields)
  for key, value in list(config.model.items()):
    if value is None:  # e.g. representation_size: keep it overridable with the right type.
      config.model[key] = config_dict.placeholder(_FLOAT_MODEL_FIELDS.get(key, int))
  if "head_bias_init" in config.model:  # ViT: the regime's default (-10 or 0) if None.
    config.model.head_bias_init = config_dict.placeholder(float)

  config.data = data.get_default_config()
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
  config.total_steps = config_dict.placeholder(int)
  config.num_epochs = config_dict.placeholder(float)

  # Loss: 'softmax_xent' or 'sigmoid_xent' (None: the regime's).
  config.loss = config_dict.placeholder(str)
  config.label_smoothing = 0.0

  # Optimizer (None: the regime's default, see vit_jax.optim.REGIME_DEFAULTS).
  config.optim = ml_collections.ConfigDict()
  config.optim.optimizer = config_dict.placeholder(str)  # 'adamw' or 'sgd'.
  config.optim.lr = config_dict.placeholder(float)  # Peak learning rate.
  config.optim.weight_decay = config_dict.placeholder(float)  # Decoupled, kernels only.
  config.optim.b1 = config_dict.placeholder(float)  # Adam.
  config.optim.b2 = config_dict.placeholder(float)  # Adam.
  config.optim.momentum = config_dict.placeholder(float)  # SGD.
  config.optim.schedule = config_dict.placeholder(str)  # 'linear', 'cosine' or 'constant'.
  config.optim.warmup_steps = config_dict.placeholder(int)
  config.optim.end_lr = 0.0  # Learning rate at the end of the decay.
  # Recipes stated in epochs or at a reference batch (T2T-ViT: "lr 5e-4 at batch 512, 10 warmup
  # epochs from 1e-6, cosine to 1e-5, 10 cooldown epochs"); see optim.schedule_from_config.
  config.optim.lr_base_batch_size = config_dict.placeholder(int)  # lr *= batch_size / this.
  config.optim.warmup_epochs = config_dict.placeholder(float)  # Replaces warmup_steps if set.
  config.optim.warmup_init_lr = 0.0  # The warmup rises from this rate.
  config.optim.cooldown_steps = 0  # Updates at end_lr after the decay (part of the run).
  config.optim.cooldown_epochs = config_dict.placeholder(float)  # Replaces cooldown_steps.
  config.optim.grad_clip_norm = config_dict.placeholder(float)  # 0 disables clipping.
  # Large runs: an update whose gradients are NaN/Inf is skipped (parameters and optimizer state
  # unchanged, counted in train/skipped_updates) up to this many times in a row; the next one
  # stops the run. 0 (default): the first non-finite loss stops the run.
  config.optim.max_skipped_updates = 0

  # Exponential moving average of the parameters (timm ModelEmaV2: ema = d * ema + (1 - d) *
  # params after every update), evaluated next to the parameters ('<split>_ema/...') and saved
  # in the checkpoint ('ema_params'); 0 disables it. T2T-ViT recipe: 0.99996.
  config.ema_decay = 0.0

  # Fine-tuning: initialise from this checkpoint (official .npz, T2T .pth.tar, our orbax
  # checkpoint or workdir, or `python -m vit_jax.convert` output) when the workdir has no
  # checkpoint yet. The head is re-initialised, ViT's pre_logits dropped if the model has no
  # representation layer, ViT's position embedding resized to the new grid and T2T's sinusoid
  # table regenerated; see vit_jax.checkpoint.init_for_finetuning.
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
  config.mesh = sharding.get_default_config()

  # Periodic work, in optimizer steps.
  config.log_every_steps = 50
  config.eval_every_steps = 1000  # Also evaluated at the end of training.
  config.checkpoint_every_steps = 1000  # Also saved at the end of training.
  config.keep_checkpoints = 3  # Most recent checkpoints kept on disk.
  config.async_checkpointing = True

  config.lock()
  return config
