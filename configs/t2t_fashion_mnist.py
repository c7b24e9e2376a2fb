r"""A small T2T-ViT trained from scratch on Fashion-MNIST, offline, on a CPU.

  python -m vit_jax.main --config configs/t2t_fashion_mnist.py --workdir /tmp/t2t_fmnist

Images are resized from 28x28 to 40x40 so that the three soft splits (unfold 7/4/2, 3/2/1,
3/2/1) give 10x10 -> 5x5 -> 3x3 = 9 tokens (+ class token), and normalised with the ImageNet
mean/std as in the T2T-ViT code. Model: Performer T2T module with token_dim 32, then D=96,
4 blocks, 4 heads, MLP ratio 2 (T2T-ViT-custom). 10 epochs at batch 128, AdamW lr 2e-3 with
cosine decay, random flips; no drop path (too short a schedule to need it).
Measured on a 2-core CPU: 90.3% test accuracy (top-1; top-5 99.8%) in 10 min 27 s of wall time
(376,272 trainable parameters, ~8.5 steps/s).
"""

from vit_jax import defaults


def get_config(arg=None):
  """Returns the T2T-ViT Fashion-MNIST config (`arg` is unused)."""
  del arg
  config = defaults.get_config(
      "T2T-ViT-custom", "fashion_mnist_local", embed_dim=96, depth=4, num_heads=4,
      mlp_ratio=2.0, token_dim=32, tokens_type="performer", drop_path_rate=0.0)
  config.regime = "pretrain"  # From scratch, with the small-data settings below.
  config.loss = "softmax_xent"
  config.optim.lr = 2e-3
  config.optim.weight_decay = 0.05
  config.optim.schedule = "cosine"
  config.optim.warmup_steps = 200

  config.data.image_size = 40
  config.data.normalization = "imagenet"
  config.data.augment = "flip"
  config.data.cache = True
  config.data.shuffle_buffer = 60_000
  config.batch_size = 128
  config.num_epochs = 10.0
  config.log_every_steps = 100
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 1000
  return config
