r"""T2T-ViT from scratch with its ImageNet recipe: `get_config('<model>[,<dataset>][,<slice>]')`.

  <model>:   7, 10, 12, 14, 19, 24 (Performer T2T module), t14, t19, t24 (Transformer T2T
             module), or the full name of one of these variants (e.g. T2T-ViT_t-14).
  <dataset>: imagenet2012 (default) or any tfds name / prepared directory.
  <slice>:   a Cloud TPU type (v3-8, v3-32, ...): keep the batch of 512 and fit it to the slice
             (bfloat16 compute, FSDP and gradient accumulation where needed; see
             vit_jax.config.slices and configs/vit.py); pre-flight confirms it.

The recipe of the official T2T-ViT code (docs/reference.md section 3; timm's train.py defaults):
  * AdamW (b1 0.9, b2 0.999), lr 5e-4 at batch 512, scaled linearly with the global batch
    (`optim.lr_base_batch_size=512`); 1e-3 for T2T-ViT-7/10/12. Decoupled weight decay 0.05
    (0.03 for 7/10/12, 0.065 for 19/24) on the kernels only: the class token, norms, biases and
    the fixed tables (not parameters at all here) are not decayed, as in the reference.
  * Cosine decay to 1e-5 over 300 epochs after 10 warmup epochs rising from 1e-6, then 10
    cooldown epochs at 1e-5: 310 epochs in all. No gradient clipping.
  * Softmax cross-entropy with label smoothing 0.1 (smoothing the mixed targets, as timm's
    Mixup does).
  * Inception-style random crop (area 8%-100%), random flip, RandAugment (2 ops, m9, mstd 0.5,
    timm's 'increasing' op set), ImageNet mean/std normalisation, random erasing (p 0.25),
    then Mixup (alpha 0.8) or CutMix (alpha 1.0), switching with probability 0.5.
  * Stochastic depth (drop path) 0.1; attention scale head_dim**-0.5 (the from-scratch default).
  * Parameter EMA with decay 0.99996, evaluated ('validation_ema/accuracy') and saved with the
    checkpoints; the released weights are the EMA.
  * 224 px; evaluation resizes the shorter side to 248 px (bicubic) and takes the central
    224 px crop (crop_pct 0.9).

Example (on one 8-chip host or a pod slice):
  python -m vit_jax.main --config configs/t2t.py:14 --workdir gs://b/t2t_vit_14 \
      --config.data.data_dir=gs://b/tensorflow_datasets

Fine-tune released weights instead: configs/t2t.py:14 with
  --config.init_from=81.5_T2T_ViT_14.pth.tar --config.model.qk_scale=0.05103103630798288
(384**-0.5: the released weights use D**-0.5) and a shorter schedule.
"""

from vit_jax import config as config_lib

MODELS = {
    "7": "T2T-ViT-7", "10": "T2T-ViT-10", "12": "T2T-ViT-12", "14": "T2T-ViT-14",
    "19": "T2T-ViT-19", "24": "T2T-ViT-24", "t14": "T2T-ViT_t-14", "t19": "T2T-ViT_t-19",
    "t24": "T2T-ViT_t-24",
}

IMAGENET_TRAIN_EXAMPLES = 1_281_167


def _lr_and_weight_decay(model_name: str):
  """(lr at batch 512, weight decay) of the official recipe for a variant."""
  depth = model_name.rsplit("-", 1)[-1]
  if depth in ("7", "10", "12"):
    return 1e-3, 0.03
  if depth in ("19", "24"):
    return 5e-4, 0.065
  return 5e-4, 0.05


ARGS = config_lib.args.Spec(
    "configs/t2t.py", ("model", "dataset", "slice"),
    defaults={"model": "14", "dataset": "imagenet2012", "slice": None},
    help={"model": f"{', '.join(MODELS)} or a variant's full name",
          "slice": "a Cloud TPU type, e.g. v3-8"},
    patterns={"slice": config_lib.slices.SLICE_PATTERN})


def get_config(arg: str = "14,imagenet2012"):
  """Returns the T2T-ViT recipe config for '<model>[,<dataset>][,<slice>]' (see the module
  docstring)."""
  args = ARGS.parse(arg)
  model_name = MODELS.get(args["model"], args["model"])
  dataset = args["dataset"]
  lr, weight_decay = _lr_and_weight_decay(model_name)

  try:
    config = config_lib.get_config(model_name, dataset, drop_path_rate=0.1)
  except (ValueError, KeyError) as e:
    raise ValueError(f"configs/t2t.py: unknown model {args['model']!r}; use one of "
                     f"{', '.join(MODELS)} or a variant's full name such as 'T2T-ViT_t-14' "
                     f"({e})") from None
  if config.model_name and "custom" in str(config.model_name).lower():
    raise ValueError("configs/t2t.py is the recipe of the nine T2T-ViT variants; for a custom "
                     "size start from configs/fashion_mnist.py:t2t or override "
                     "--config.model.embed_dim/depth/... of a variant.")
  config.regime = "pretrain"  # Training from scratch; every regime field is set below.
  config.loss = "softmax_xent"
  config.label_smoothing = 0.1
  config.ema_decay = 0.99996

  config.optim.optimizer = "adamw"
  config.optim.lr = lr
  config.optim.lr_base_batch_size = 512
  config.optim.weight_decay = weight_decay
  config.optim.b1 = 0.9
  config.optim.b2 = 0.999
  config.optim.schedule = "cosine"
  config.optim.end_lr = 1e-5
  config.optim.warmup_epochs = 10.0
  config.optim.warmup_init_lr = 1e-6
  config.optim.cooldown_epochs = 10.0
  config.optim.grad_clip_norm = 0.0

  config.batch_size = 512
  config.num_epochs = 310.0

  data = config.data
  data.train_split = "train"
  data.eval_split = "validation" if dataset == "imagenet2012" else "test"
  data.image_size = 224
  data.augment = "inception_crop"
  data.inception_crop_min_area = 0.08
  data.normalization = "imagenet"
  data.eval_crop_pct = 0.9
  data.randaugment_num_layers = 2
  data.randaugment_magnitude = 9.0
  data.randaugment_magnitude_std = 0.5
  data.random_erasing = 0.25
  data.mixup_alpha = 0.8
  data.cutmix_alpha = 1.0
  data.mix_switch_prob = 0.5
  data.mix_prob = 1.0

  steps_per_epoch = IMAGENET_TRAIN_EXAMPLES // config.batch_size
  config.log_every_steps = 100
  config.eval_every_steps = 5 * steps_per_epoch
  config.checkpoint_every_steps = steps_per_epoch
  if args["slice"]:
    config_lib.slices.fit_to_slice(config, args["slice"])
  return config
