"""The optimizers, learning-rate schedules and losses (vit_jax.optim)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import config as config_lib
from vit_jax import models as models_lib
from vit_jax import optim


def test_cosine_schedule_matches_reference_values():
  base, total, warmup = 0.03, 100, 10
  lr = optim.lr_schedule(base, total, warmup, "cosine")
  # optax counts updates from 0; the reference numbers steps from 1.
  np.testing.assert_allclose(lr(0), base / warmup, rtol=1e-6)  # step 1
  np.testing.assert_allclose(lr(warmup - 1), base, rtol=1e-6)  # end of warmup
  step = 55  # progress = (55 - 10) / 90 = 0.5
  np.testing.assert_allclose(lr(step - 1), base * 0.5 * (1 + math.cos(math.pi * 0.5)), rtol=1e-6)
  np.testing.assert_allclose(lr(total - 1), 0.0, atol=1e-9)  # step = total: zero
  assert float(lr(total + 5)) == pytest.approx(0.0, abs=1e-9)  # clipped afterwards


def test_linear_and_constant_schedules():
  lr = optim.lr_schedule(1e-3, 110, 10, "linear")
  np.testing.assert_allclose(lr(0), 1e-4, rtol=1e-6)
  np.testing.assert_allclose(lr(59), 1e-3 * 0.5, rtol=1e-6)  # step 60: progress 0.5
  np.testing.assert_allclose(lr(109), 0.0, atol=1e-10)
  const = optim.lr_schedule(0.1, 50, 0, "constant")
  np.testing.assert_allclose([const(0), const(49)], [0.1, 0.1], rtol=1e-6)
  with_end = optim.lr_schedule(1.0, 10, 0, "cosine", end_lr=0.1)
  np.testing.assert_allclose(with_end(9), 0.1, rtol=1e-6)


def test_timm_style_warmup_from_init_lr_and_cooldown():
  # T2T-ViT recipe shape: warmup from 1e-6, cosine to end_lr, then a cooldown at end_lr.
  lr = optim.lr_schedule(1e-3, 120, 10, "cosine", 1e-5, warmup_init_lr=1e-6, cooldown_steps=10)
  np.testing.assert_allclose(lr(-1), 1e-6, rtol=1e-6)  # step 0 (before the first update)
  np.testing.assert_allclose(lr(4), 1e-6 + (1e-3 - 1e-6) * 0.5, rtol=1e-6)  # step 5 of 10
  np.testing.assert_allclose(lr(9), 1e-3, rtol=1e-6)
  step = 60  # progress = (60 - 10) / (120 - 10 - 10) = 0.5
  np.testing.assert_allclose(lr(step - 1), 1e-5 + (1e-3 - 1e-5) * 0.5, rtol=1e-6)
  np.testing.assert_allclose([lr(109), lr(115), lr(119)], [1e-5] * 3, rtol=1e-5)  # cooldown


def test_schedule_from_config_scales_lr_and_converts_epochs():
  config = config_lib.get_config("T2T-ViT-7", "imagenet2012")
  config.optim.update(lr=5e-4, lr_base_batch_size=512, warmup_epochs=2.0, cooldown_epochs=1.0,
                      schedule="cosine", warmup_init_lr=0.0)
  # 1024 images per batch, 50 updates per epoch: peak 1e-3, warmup 100, cooldown 50 updates.
  lr = optim.schedule_from_config(config.optim, batch_size=1024, total_steps=500,
                                  steps_per_epoch=50)
  np.testing.assert_allclose(lr(99), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(lr(49), 0.5e-3, rtol=1e-6)
  np.testing.assert_allclose(lr(449), 0.0, atol=1e-12)  # decay ends 50 updates early
  config.optim.lr_base_batch_size = 0
  with pytest.raises(ValueError, match=r"lr_base_batch_size=0 must be a positive int or None \(lr "
                     r"\*= batch_size / this"):
    optim.schedule_from_config(config.optim, batch_size=8, total_steps=5, steps_per_epoch=1)


def test_schedule_rejects_bad_arguments():
  with pytest.raises(ValueError, match=r"warmup_steps=100 \(\+ cooldown_steps=0\) must be smaller"):
    optim.lr_schedule(0.1, 100, 100, "cosine")
  with pytest.raises(ValueError, match="cooldown_steps=60\\) must be smaller"):
    optim.lr_schedule(0.1, 100, 40, "cosine", cooldown_steps=60)
  with pytest.raises(ValueError, match="Unknown schedule 'step'"):
    optim.lr_schedule(0.1, 100, 0, "step")


def test_losses_give_reference_values():
  logits = jnp.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
  labels = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
  softmax = optim.loss_fn(logits, labels, "softmax_xent")
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  np.testing.assert_allclose(softmax, [-log_p[0, 0], -(log_p[1, 1] + log_p[1, 2]) / 2], rtol=1e-6)
  sigmoid = optim.loss_fn(logits, labels, "sigmoid_xent")
  p = 1 / (1 + np.exp(-np.asarray(logits)))
  expected = -(labels * np.log(p) + (1 - labels) * np.log(1 - p)).sum(-1)
  np.testing.assert_allclose(sigmoid, expected, rtol=1e-5)


def test_label_smoothing_applies_to_both_losses():
  """eps=0.3, K=3 classes: targets * 0.7 + 0.1 (big_vision's onehot(on=0.8, off=0.1)).

  logits z = [2, 0, -1]: logsumexp(z) = 2.1698460; log sigmoid(z) = [-0.1269280, -0.6931472,
  -1.3132617], log sigmoid(-z) = [-2.1269280, -0.6931472, -0.3132617].
  """
  logits = jnp.array([[2.0, 0.0, -1.0], [2.0, 0.0, -1.0]])
  labels = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])  # one-hot; multi-hot (two labels)
  # softmax: one-hot -> [0.8, 0.1, 0.1]: 2.1698460 - (0.8 * 2 + 0.1 * 0 - 0.1 * 1) = 0.6698460.
  # Multi-hot -> normalised [0, 0.5, 0.5] -> [0.1, 0.45, 0.45]: 2.1698460 + 0.25 = 2.4198460.
  np.testing.assert_allclose(optim.loss_fn(logits, labels, "softmax_xent", 0.3),
                             [0.6698460, 2.4198460], rtol=1e-6)
  # sigmoid: one-hot -> [0.8, 0.1, 0.1]: (0.8 * 0.1269280 + 0.2 * 2.1269280) + 0.6931472
  # + (0.1 * 1.3132617 + 0.9 * 0.3132617) = 0.5269280 + 0.6931472 + 0.4132617 = 1.6333369.
  # Multi-hot [0, 1, 1] -> [0.1, 0.8, 0.8] (both positives stay equal, none is diluted):
  # (0.1 * 0.1269280 + 0.9 * 2.1269280) + 0.6931472 + (0.8 * 1.3132617 + 0.2 * 0.3132617)
  # = 1.9269280 + 0.6931472 + 1.1132617 = 3.7333369.
  np.testing.assert_allclose(optim.loss_fn(logits, labels, "sigmoid_xent", 0.3),
                             [1.6333369, 3.7333369], rtol=1e-6)
  # eps=0 is the unsmoothed loss; smoothing changed the sigmoid loss (it used to be ignored).
  unsmoothed = optim.loss_fn(logits, labels, "sigmoid_xent", 0.0)
  np.testing.assert_allclose(unsmoothed[0], 0.1269280 + 0.6931472 + 0.3132617, rtol=1e-6)
  for eps in (-0.1, 1.0, 1.5):
    with pytest.raises(ValueError, match=f"label_smoothing={eps} must be in \\[0, 1\\)"):
      optim.loss_fn(logits, labels, "sigmoid_xent", eps)


def test_sgd_finetune_optimizer_clips_and_uses_momentum():
  config = config_lib.get_config("ViT-custom", "fashion_mnist_local", hidden_size=8,
                                 mlp_dim=16, num_heads=2, num_layers=1, patch_size=4)
  config.regime = "finetune"
  config = config_lib.fill_regime(config)
  config.optim.warmup_steps = 0
  config.optim.schedule = "constant"
  config.optim.lr = 0.5
  tx = optim.make_optimizer(config.optim, optim.lr_schedule(0.5, 10, 0, "constant"))
  params = {"kernel": jnp.zeros(2)}
  state = tx.init(params)
  grads = {"kernel": jnp.array([3.0, 4.0])}  # global norm 5 -> clipped to 1: [0.6, 0.8]
  updates, state = tx.update(grads, state, params)
  np.testing.assert_allclose(updates["kernel"], [-0.3, -0.4], rtol=1e-6)
  updates, state = tx.update(grads, state, params)  # momentum 0.9: 1.9 * clipped grad
  np.testing.assert_allclose(updates["kernel"], [-0.57, -0.76], rtol=1e-6)


def test_t2t_weight_decay_skips_class_token_norms_biases_and_tables():
  """As the T2T-ViT recipe: decay on the Linear kernels only (tables are not parameters)."""
  model = models_lib.create("T2T-ViT-custom", num_classes=3, embed_dim=16, depth=1,
                            num_heads=2, mlp_ratio=2.0, token_dim=8)
  variables = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False))
  mask = checkpoint.flatten_params(optim._decay_mask(variables["params"]))  # pylint: disable=protected-access
  decayed = sorted(k for k, v in mask.items() if v)
  assert decayed == sorted(k for k in mask if k.endswith("/kernel"))
  assert len(decayed) == 14  # 2 T2T layers x 4, project, one block x 4, head.
  assert not any(mask[k] for k in mask if k == "cls_token" or "norm" in k or k.endswith("bias"))
  assert "pos_embed" not in mask and all("/w" not in k for k in mask)
