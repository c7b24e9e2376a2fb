"""Frozen parameters (config.optim.freeze) in the train step: they enter the loss through
jax.lax.stop_gradient, so their gradients are zero (not computed) and train/grad_norm counts the
trainable parameters only; the updates are the same as without (the optimizer zeroes them)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import data_utils
from vit_jax import flops
from vit_jax import optim
from vit_jax import step as step_lib

VIT = dict(hidden_size=8, mlp_dim=16, num_heads=2, num_layers=2, patch_size=4)
BATCH = {"image": np.random.default_rng(0).standard_normal((4, 8, 8, 3)).astype(np.float32),
         "labels": np.eye(3, dtype=np.float32)[np.arange(4) % 3]}


def _setup(**changes) -> step_lib.Setup:
  """A tiny ViT (2 blocks) fine-tuned with SGD, per-layer unless `model.scan` is changed."""
  return data_utils.tiny_step_setup(VIT, {"model.scan": False, "model.remat": False,
                                          "optim.lr": 0.1, "optim.grad_clip_norm": 0.0,
                                          **changes})


def _state(setup):
  """A train state of random parameters (the initial head is zero: no gradient below it)."""
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape), s.dtype),
                        setup.abstract_state["params"])
  return setup.state_from_variables({"params": params})


def _grads(setup, state):
  """The loss's gradient of every parameter, frozen or not."""
  def loss(params):
    logits = setup.model.apply(step_lib.variables_of(state, params), BATCH["image"], train=True,
                               rngs={"dropout": jax.random.fold_in(setup.dropout_rng, 0)})
    return optim.loss_fn(logits, BATCH["labels"], setup.config.loss).mean()
  return jax.jit(jax.grad(loss))(state["params"])


def _step(setup, frozen):
  c = setup.config
  return jax.jit(step_lib.make_train_step(
      setup.model, setup.tx, setup.schedule, loss=c.loss, dropout_rng=setup.dropout_rng,
      frozen=frozen))


def test_a_linear_probe_counts_the_heads_gradient_only_and_updates_the_same():
  setup = _setup(**{"optim.freeze": ("(?!head/).*",)})
  state = _state(setup)
  grads = _grads(setup, state)
  assert optax.tree.norm(grads) > 2 * optax.tree.norm(grads["head"])  # The trunk's count.
  frozen = step_lib.frozen_mask(setup.config.optim, state["params"])
  assert frozen["head"]["kernel"].tolist() == [False]
  assert frozen["Transformer"]["encoderblock_0"]["MlpBlock_0"]["Dense_0"]["kernel"].tolist() == [
      True]
  new, metrics = jax.jit(setup.train_step_fn())(state, BATCH)
  np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads["head"]), rtol=1e-6)
  # Without the mask, the same update (the optimizer zeroes the frozen ones) but every gradient
  # in the norm: what train/grad_norm reported before.
  old, old_metrics = _step(setup, None)(state, BATCH)
  np.testing.assert_allclose(old_metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, new["params"], old["params"])
  np.testing.assert_array_equal(new["params"]["embedding"]["kernel"],
                                state["params"]["embedding"]["kernel"])
  assert np.abs(new["params"]["head"]["kernel"] - state["params"]["head"]["kernel"]).max() > 0


def test_the_frozen_trunks_backward_pass_is_not_computed():
  """A linear probe's step: the forward and the head kernel's gradient ([D, B] x [B, C]), no
  backward through the trunk (XLA would otherwise compute it, then zero it)."""
  setup = _setup(**{"optim.freeze": ("(?!head/).*",)})
  state = jax.eval_shape(setup.init_state, setup.init_rng)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), BATCH)
  probe = flops.jaxpr_macs(jax.make_jaxpr(setup.train_step_fn())(state, batch).jaxpr)
  full = flops.jaxpr_macs(jax.make_jaxpr(_step(setup, None))(state, batch).jaxpr)
  forward = 4 * flops.model_forward_macs(setup.model, (8, 8, 3))
  assert probe == forward + 8 * 4 * 3
  assert full > 2 * forward


def test_frozen_blocks_of_a_stacked_encoder_get_zero_gradients():
  """scan=True: freezing block 0 zeroes slice 0 of the stacked tensors' gradients only."""
  setup = _setup(**{"model.scan": True, "optim.freeze": ("Transformer/encoderblock_0/.*",)})
  state = _state(setup)
  grads = _grads(setup, state)
  stacked = grads["Transformer"]["encoderblock"]
  kept = dict(grads, Transformer=dict(grads["Transformer"], encoderblock=jax.tree.map(
      lambda g: g.at[0].set(0.0), stacked)))
  assert optax.tree.norm(grads) > optax.tree.norm(kept) * (1 + 1e-3)
  new, metrics = jax.jit(setup.train_step_fn())(state, BATCH)
  np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(kept), rtol=1e-5)
  kernel = "MlpBlock_0/Dense_0/kernel".split("/")
  before, after = state["params"]["Transformer"]["encoderblock"], new["params"]["Transformer"][
      "encoderblock"]
  for key in kernel:
    before, after = before[key], after[key]
  np.testing.assert_array_equal(after[0], before[0])
  assert np.abs(after[1] - before[1]).max() > 0


def test_no_freeze_no_mask_and_a_bad_pattern_is_named():
  setup = _setup()
  params = setup.abstract_state["params"]
  assert step_lib.frozen_mask(setup.config.optim, params) is None
  optim_config = setup.config.optim.copy_and_resolve_references()
  optim_config.freeze = ("nothing/.*",)
  with pytest.raises(ValueError, match="matches no parameter"):
    step_lib.frozen_mask(optim_config, params)
