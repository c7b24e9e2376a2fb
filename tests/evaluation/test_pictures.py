"""config.analysis's pictures during training (vit_jax.evaluation.pictures): the reductions done
on the device equal vit_jax.analysis's host functions; the images written; the config checked.
(Written to TensorBoard by a real run: tests/test_train.py's
test_main_trains_writes_metrics_and_resumes.)"""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import analysis
from vit_jax import config as config_lib
from vit_jax.evaluation import pictures
from vit_jax.models import intermediates
from vit_jax.models import layout as layout_lib
from vit_jax.models import t2t
from vit_jax.models import vit

IMAGES = np.random.default_rng(0).uniform(-1.0, 1.0, (5, 8, 8, 3)).astype(np.float32)
LABELS = np.eye(3, dtype=np.float32)[[0, 1, 2, 0, 1]]
# A T2T-ViT on 32x32 images: a 2x2 backbone grid, tokens 16 px apart, plus the class token.
T2T = t2t.T2TViT(num_classes=3, embed_dim=16, depth=2, num_heads=2, mlp_ratio=1.0, token_dim=8)
VIT = dict(num_classes=3, patch_size=4, hidden_size=16, mlp_dim=16, num_heads=2, num_layers=2)


def _variables(model, images):
  """Random normal variables of every collection (no init compiled)."""
  shapes = layout_lib.unbox(jax.eval_shape(lambda k, x: model.init(k, x, train=False),
                                           jax.random.key(0), images))
  rng = np.random.default_rng(1)
  return jax.tree.map(lambda s: jnp.asarray(0.5 * rng.normal(size=s.shape), s.dtype), shapes)


@pytest.mark.parametrize("name", ["vit_token", "vit_gap", "t2t", "vit_token_reg", "vit_gap_reg"])
def test_the_device_summary_is_the_host_analysis(name):
  """Distances over the unmasked images and rollout maps as vit_jax.analysis computes them from
  the captured weights (float32 against float64: 1e-4 relative): the class token's row, without
  one the patch rows' mean (2 registers: never theirs); the state's 'model_state' (T2T-ViT's
  fixed tables) reaches the model."""
  registers = 2 if name.endswith("_reg") else 0
  if name == "t2t":
    model, size = T2T, 32
  else:
    model = vit.VisionTransformer(**VIT, classifier=name.split("_")[1], num_registers=registers)
    size = 8
  images = np.resize(IMAGES, (5, size, size, 3))
  variables = _variables(model, images)
  layout = intermediates.token_layout(model, size, size)
  mask = np.array([True, True, False, True, True])  # The third image is padding.
  batch = {"image": images, "labels": LABELS, "mask": mask}
  state = {"params": variables["params"]}
  if "constants" in variables:
    state["model_state"] = {"constants": variables["constants"]}
  summary = jax.jit(pictures._device_summary(model, layout, count=4, shown=2))(state, batch)

  captured = intermediates.capture(model, variables, images[:4])
  kept = [a[mask[:4]] for a in captured.attention]
  expected = analysis.mean_attention_distances(kept, layout.grid, layout.stride, layout.prefix)
  assert summary["attention_distance"].shape == (2, 2)
  np.testing.assert_allclose(summary["attention_distance"], expected, rtol=1e-4)
  stride = layout.stride[0]  # A 2x2 grid: between 0 and the diagonal.
  assert layout.grid == (2, 2) and 0 < expected.min() and expected.max() < np.hypot(stride, stride)
  maps = analysis.class_token_map(analysis.rollout([a[:2] for a in captured.attention]),
                                  layout.grid, num_prefix_tokens=layout.prefix,
                                  num_registers=registers)
  assert layout.prefix == registers + ("gap" not in name)  # The class token, the registers.
  np.testing.assert_allclose(summary["rollout"], maps, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(summary["logits"], captured.logits[:2], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(summary["images"], images[:2])


class _Writer:
  def __init__(self):
    self.images, self.scalars = {}, {}

  def write_images(self, step, images):
    self.images.update({(k, step): v for k, v in images.items()})

  def write_scalars(self, step, scalars):
    self.scalars.update({(k, step): v for k, v in scalars.items()})


def test_training_images_are_one_grid_with_the_class_names():
  options = types.SimpleNamespace(train_images=3, attention_images=0, rollout_images=0)
  setup = types.SimpleNamespace(config=types.SimpleNamespace(analysis=options),
                                image_shape=(8, 8, 3))
  shown = pictures.Pictures(setup, ["shirt", "bag", "boot"], None, None)
  writer = _Writer()
  shown.training_images(writer, {"image": IMAGES, "labels": LABELS}, step=7)
  grid = writer.images[("analysis/training_images", 7)]
  assert grid.dtype == np.uint8 and grid.shape == (1, 250, 600, 3)  # 3 panels of 200 px.
  assert shown._captions(LABELS[:3], -LABELS[:3]) == [
      "bag (true shirt)", "shirt (true bag)", "shirt (true boot)"]
  assert not shown.attention_on and shown.attention(writer, {}, 7) == {}


def test_analysis_values_are_checked_and_lowered_to_the_batches():
  def resolve(**analysis):
    config = config_lib.get_config("ViT-custom", "fashion_mnist", hidden_size=8, mlp_dim=8,
                                   num_heads=1, num_layers=1, patch_size=4)
    config.batch_size, config.total_steps, config.eval_batch_size = 8, 10, 4
    config.optim.warmup_steps = 1
    config.analysis.update(analysis)
    return config_lib.resolve(config, num_train_examples=100, num_classes=10).analysis

  assert resolve(attention_images=3, rollout_images=2, train_images=8).to_dict() == dict(
      attention_images=3, rollout_images=2, train_images=8)
  # Above the eval batch, the captured images, the training batch: lowered to them.
  assert resolve(attention_images=32, rollout_images=8, train_images=16).to_dict() == dict(
      attention_images=4, rollout_images=4, train_images=8)
  assert resolve(attention_images=0).rollout_images == 0
  for key in ("attention_images", "rollout_images", "train_images"):
    with pytest.raises(ValueError, match=re.escape(
        f"config.analysis.{key}=-1 must be an int >= 0")):
      resolve(**{key: -1})
