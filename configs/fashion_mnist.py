r"""Small models trained from scratch on Fashion-MNIST, offline, on a CPU: the README's main job.

  python -m vit_jax.main --config configs/fashion_mnist.py --workdir /tmp/vit_fmnist
  python -m vit_jax.main --config configs/fashion_mnist.py:t2t --workdir /tmp/t2t_fmnist

Data: the original Fashion-MNIST IDX files from the Debian package `dataset-fashion-mnist`
(/usr/share/datasets/fashion-mnist), read by the project's tfds builder 'fashion_mnist_local',
so the run takes the same input path as ImageNet (tfds -> tf.data -> global jax.Arrays).
Both models: batch 128, AdamW lr 2e-3 with cosine decay after 200 warmup steps, weight decay
0.05, softmax cross-entropy, random flips; 'vit' 10 epochs (4,688 steps), 't2t' 14 epochs (6,563
steps) with label smoothing 0.1.

'vit' (default): ViT with 7x7 patches on the 28x28 images (a 4x4 grid, 16 tokens + class
token), hidden size D=96, 4 layers, 4 heads, MLP 192; 316,234 parameters.
Expected on a 2-core CPU: 89.1% test accuracy (top-1; top-5 99.8%) in about 6 minutes, the
one-off preparation of the tfds dataset (~11 s) included (docs/benchmarks.md).

't2t': T2T-ViT with a Performer T2T module (token_dim 32), then D=96, 4 blocks, 4 heads, MLP
ratio 2, no drop path (too short a schedule to need it); 376,272 trainable parameters. Images
are resized to 40x40 so that the three soft splits (unfold 7/4/2, 3/2/1, 3/2/1) give
10x10 -> 5x5 -> 3x3 = 9 tokens, and normalised with the ImageNet mean/std as in the T2T-ViT
code. Expected on a 2-core CPU: 91.1 to 91.2% test accuracy (top-5 99.7%) in 12 to 18
minutes of wall time, depending on the machine's load (docs/benchmarks.md). Label smoothing
0.1 and 14 epochs instead of none and 10 (90.5% in 11 minutes): +0.6 to 0.7 points; 16 epochs
add 0.2 more, EMA (0.999) and 2-pixel pad-and-crop shifts did not help at this length.
"""

from vit_jax import config as config_lib

MODELS = {
    "vit": ("ViT-custom", dict(hidden_size=96, mlp_dim=192, num_heads=4, num_layers=4,
                               patch_size=7)),
    "t2t": ("T2T-ViT-custom", dict(embed_dim=96, depth=4, num_heads=4, mlp_ratio=2.0,
                                   token_dim=32, tokens_type="performer",
                                   drop_path_rate=0.0)),
}


ARGS = config_lib.args.Spec("configs/fashion_mnist.py", ("model",),
                            choices={"model": tuple(MODELS)}, defaults={"model": "vit"})


def get_config(arg: str = "vit"):
  """Returns the Fashion-MNIST config for `arg` in {'vit', 't2t'} (see the module docstring)."""
  arg = ARGS.parse(arg)["model"]
  model_name, model_fields = MODELS[arg]
  config = config_lib.get_config(model_name, "fashion_mnist_local", **model_fields)
  config.regime = "pretrain"  # Training from scratch, with the settings below for a small set;
  # --config.regime=finetune replaces them by the fine-tuning recipe (one warning).
  config.recipe_regime = "pretrain"
  config.loss = "softmax_xent"  # single-label data: softmax (and a zero ViT head bias).
  if "head_bias_init" in config.model:
    config.model.head_bias_init = 0.0
  config.optim.lr = 2e-3
  config.optim.weight_decay = 0.05
  config.optim.schedule = "cosine"
  config.optim.warmup_steps = 200

  config.data.image_size = 28 if arg == "vit" else 40
  if arg == "t2t":
    config.data.normalization = "imagenet"
  config.data.augment = "flip"
  config.data.cache = True
  config.data.shuffle_buffer = 60_000
  config.batch_size = 128
  config.num_epochs = 10.0
  if arg == "t2t":  # Measured on the T2T-ViT (see the module docstring).
    config.label_smoothing = 0.1
    config.num_epochs = 14.0
  config.log_every_steps = 100
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 1000
  # TensorBoard pictures (docs/analysis.md): a grid of augmented training images at the start;
  # at each evaluation, the attention distances of 32 test images and 8 rollout maps.
  config.analysis.train_images = 16
  config.analysis.attention_images = 32
  config.analysis.rollout_images = 8
  return config
