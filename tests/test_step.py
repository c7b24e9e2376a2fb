"""The train state and the steps (vit_jax.step): the step functions on tiny models, and the
setup that binds a resolved config to a mesh."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import data_utils
from vit_jax import config as config_lib
from vit_jax import models
from vit_jax import optim
from vit_jax import step as step_lib


def _setup(**changes):
  return data_utils.tiny_step_setup(dict(hidden_size=8, mlp_dim=16, num_heads=2, num_layers=1,
                                         patch_size=4), changes)


def _batch(seed=0, size=4):
  images = jax.random.normal(jax.random.key(seed), (size, 8, 8, 3))
  labels = jax.nn.one_hot(jnp.arange(size) % 3, 3)
  return {"image": images, "labels": labels}


def test_eval_sums_count_hits_precision_at_1_and_skip_padding():
  logits = jnp.array([[5.0, 1, 0, 0, 0, 0],   # top1 = 0 (a true label): hit
                      [1.0, 5, 4, 3, 2, 0],   # top1 = 1, true {5}: miss; 5 ranks 6th: no top-5 hit
                      [0.0, 1, 2, 3, 4, 5],   # top1 = 5, true {2, 5}: hit
                      [9.0, 0, 0, 0, 0, 0]])  # padding: ignored although it would hit
  labels = jnp.array([[1.0, 0, 0, 1, 0, 0],
                      [0.0, 0, 0, 0, 0, 1],
                      [0.0, 0, 1, 0, 0, 1],
                      [1.0, 0, 0, 0, 0, 0]])
  mask = jnp.array([True, True, True, False])
  sums = step_lib.eval_sums(logits, labels, mask, "sigmoid_xent")
  assert (int(sums["count"]), int(sums["correct"]), int(sums["correct_top5"])) == (3, 2, 2)
  per_example = optim.loss_fn(logits, labels, "sigmoid_xent")
  np.testing.assert_allclose(sums["loss"], per_example[:3].sum(), rtol=1e-6)
  assert "correct_top5" not in step_lib.eval_sums(logits[:, :4], labels[:, :4], mask,
                                                  "softmax_xent")


def test_setup_shapes_and_shardings_come_without_allocation():
  setup = _setup(ema_decay=0.9)
  state = setup.abstract_state
  assert sorted(state) == ["ema_params", "opt_state", "params", "step"]
  assert state["params"]["head"]["kernel"].shape == (8, 3)
  assert state["step"].sharding.is_fully_replicated
  batch = setup.abstract_batch(4, eval_batch=True)
  assert batch["image"].shape == (4, 8, 8, 3) and batch["mask"].shape == (4,)


def test_train_step_lowers_the_loss_and_keeps_an_ema():
  setup = _setup(ema_decay=0.5, **{"optim.lr": 0.3})
  state = jax.jit(setup.init_state, out_shardings=setup.state_shardings)(setup.init_rng)
  train = setup.compile(setup.jit_train_step(), setup.abstract_state, setup.abstract_batch(4))
  batch = _batch()
  head = lambda tree: np.asarray(tree["head"]["kernel"])
  start = head(state["params"])  # A copy: the step donates the old state.
  losses = []
  for _ in range(6):
    state, metrics = train(state, batch)
    losses.append(float(metrics["loss"]))
  assert int(state["step"]) == 6
  assert losses[-1] < losses[0] - 0.1, losses  # One repeated batch: it is learned.
  # ema = 0.5 ema + 0.5 params after every update: between the start and now.
  assert not np.allclose(head(state["ema_params"]), head(state["params"]))
  assert not np.allclose(head(state["ema_params"]), start)
  assert sorted(metrics) == ["accuracy", "grad_norm", "loss", "lr", "param_norm"]
  # The repeated batch is learned: the top class of each of the 4 images is its label.
  assert float(metrics["accuracy"]) == 1.0, losses


def test_train_accuracy_is_top1_precision_at_1_or_the_mixup_weight():
  logits = jnp.array([[3.0, 1, 0], [0.0, 2, 1], [0.0, 1, 5], [4.0, 0, 1]])
  one_hot = jnp.eye(3)[jnp.array([0, 2, 2, 1])]  # Hits: examples 0 and 2.
  assert float(step_lib.train_accuracy(logits, one_hot)) == 0.5
  multi_hot = jnp.array([[1.0, 1, 0], [0.0, 1, 1], [0.0, 0, 0], [1.0, 0, 1]])
  assert float(step_lib.train_accuracy(logits, multi_hot)) == 0.75  # Precision@1.
  mixed = 0.7 * one_hot + 0.3 * jnp.eye(3)[jnp.array([1, 1, 0, 0])]  # Mixup, lambda = 0.7.
  # Top classes 0, 1, 2, 0 carry the weights 0.7, 0.3, 0.7, 0.3.
  np.testing.assert_allclose(float(step_lib.train_accuracy(logits, mixed)), 0.5, rtol=1e-6)


@pytest.mark.slow
def test_gradient_accumulation_gives_the_full_batch_update():
  """Two micro-batches of 2 give the same update as one batch of 4 (no dropout)."""
  updated = []
  for accum in (1, 2):
    setup = _setup(grad_accum_steps=accum)
    state = jax.jit(setup.init_state)(setup.init_rng)
    state, metrics = jax.jit(setup.train_step_fn())(state, _batch())
    updated.append((state["params"], float(metrics["loss"]), float(metrics["accuracy"])))
  for a, b in zip(jax.tree.leaves(updated[0][0]), jax.tree.leaves(updated[1][0])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert updated[0][1] == pytest.approx(updated[1][1], rel=1e-5)
  assert updated[0][2] == updated[1][2]  # The mean of the micro-batches' accuracies.


@pytest.mark.slow
def test_skipped_update_leaves_the_state_unchanged():
  setup = _setup(**{"optim.max_skipped_updates": 2})
  state = jax.jit(setup.init_state)(setup.init_rng)
  bad = dict(_batch(), image=jnp.full((4, 8, 8, 3), jnp.nan))
  new_state, metrics = jax.jit(setup.train_step_fn())(state, bad)
  assert float(metrics["skipped"]) == 1.0
  for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(new_state["params"])):
    np.testing.assert_array_equal(a, b)


def test_eval_step_sums_the_masked_batch():
  setup = _setup()
  state = jax.jit(setup.init_state)(setup.init_rng)
  batch = dict(_batch(), mask=jnp.array([True, True, True, False]))
  sums = jax.jit(step_lib.make_eval_step(setup.model, loss="softmax_xent"))(state, batch)
  assert int(sums["count"]) == 3
  # A zero-initialised head: uniform logits, loss log(3) per real example.
  np.testing.assert_allclose(float(sums["loss"]), 3 * np.log(3), rtol=1e-5)


def test_the_compiler_compiles_once_per_shape_and_batches_go_to_the_mesh_and_back():
  setup = _setup()
  timed, compiled = [], []
  compiler = step_lib.Compiler(setup, lambda: contextlib.nullcontext(timed.append(1)),
                               lambda jitted, c: compiled.append(jitted))
  state = jax.jit(setup.init_state, out_shardings=setup.state_shardings)(setup.init_rng)
  variables = {k: state[k] for k in setup.variables_shardings}
  eval_step = setup.jit_eval_step(variables_only=True, top1=True)
  for size in (4, 4, 8):
    local = {k: np.asarray(v) for k, v in _batch(size=size).items()}
    local["mask"] = np.ones(size, bool)
    batch = setup.to_global(local)
    sums, top1 = compiler(eval_step, variables, batch)
    assert int(sums["count"]) == size and top1.dtype == jnp.int32
    np.testing.assert_array_equal(setup.to_local(top1), np.asarray(top1))
    np.testing.assert_array_equal(setup.to_local(batch["image"]), local["image"])
  assert len(timed) == 2 and compiled == [eval_step, eval_step]
  assert step_lib.batch_shards(setup.config.mesh, 1) == 1
  assert step_lib.batch_shards(setup.config.mesh, 4) == 4  # Data parallel.


def test_image_size_the_patch_does_not_divide_names_the_flag():
  with pytest.raises(models.ImageSizeError, match=r"not divisible by the patch size 4.*"
                     r"--config.data.image_size"):
    config = config_lib.get_config("ViT-custom", "x", hidden_size=8, mlp_dim=16, num_heads=2,
                                   num_layers=1, patch_size=4, attention="xla")
    config.update(batch_size=4, total_steps=10)
    config.optim.warmup_steps = 0
    config.data.image_size = 10
    resolved = config_lib.resolve(config, num_train_examples=16, num_classes=3,
                                  devices=jax.devices()[:1])
    step_lib.build(resolved, image_shape=(10, 10, 3))
