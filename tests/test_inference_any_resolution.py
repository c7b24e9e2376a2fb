"""Evaluating and predicting at another image size than the weights were made for (issue 41):
inference.load(..., image_size=S) (the tools' --image-size) resamples a ViT's learned position
table in the model (posemb_grid: the table's grid), for weight files and training workdirs."""

import os

import jax
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import inference
from vit_jax import models

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NPZ = os.path.join(FIXTURES, "vit_tiny", "params.npz")  # 4 px patches, 32 px: an 8x8 grid.
PTH = os.path.join(FIXTURES, "t2t_tiny_performer", "checkpoint.pth.tar")
T2T_FIELDS = dict(embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, token_dim=16,
                  tokens_type="performer", qk_scale=64 ** -0.5)


def _images(size, seed=0):
  return np.random.default_rng(seed).uniform(-1, 1, (3, size, size, 3)).astype(np.float32)


def test_an_npz_evaluates_at_another_size_with_its_table_resampled_in_the_model():
  native = inference.load(NPZ)
  assert native.image_size == 32 and native.config.model.posemb_grid is None
  trained = inference.load(NPZ, image_size=48)
  assert trained.image_size == 48 and tuple(trained.config.model.posemb_grid) == (8, 8)
  table = trained.variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  assert table.shape == (1, 65, 32)  # As saved: resampled in the model.
  logits = inference.Runner(trained).logits(_images(48))
  # The same as the official fine-tuning resize of the table, applied at 48 px (12x12 grid).
  variables = checkpoint.load(NPZ)
  entry = variables["params"]["Transformer"]["posembed_input"]
  entry["pos_embedding"] = checkpoint.resize_posemb(entry["pos_embedding"], 1 + 12 * 12,
                                                    has_class_token=True)
  model = models.create("ViT-custom", num_classes=10, hidden_size=32, mlp_dim=64, num_heads=2,
                        num_layers=2, patch_size=4)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, _images(48))
  np.testing.assert_allclose(logits, want, rtol=0, atol=2e-6)
  assert np.abs(logits - inference.Runner(native).logits(_images(32))).max() > 1e-3
  with pytest.raises(ValueError, match=r"Images of shape \(3, 32, 32, 3\): the model takes "
                     r"\[B, 48, 48, 3\]"):
    inference.Runner(trained).logits(_images(32))


def test_a_t2t_checkpoint_refuses_another_size():
  with pytest.raises(ValueError, match=r"--image-size 32: .*checkpoint.pth.tar is a "
                     r"T2T-ViT-custom for 64 px images, whose stored position table fits no "
                     r"other size; drop --image-size \(or give 64\)"):
    inference.load(PTH, model_name="T2T-ViT-custom", overrides=T2T_FIELDS, image_size=32)


@pytest.mark.slow
def test_a_workdir_evaluates_at_another_size(tiny_workdir):
  """The tiny run (8 px, 4 px patches: a 2x2 grid, scanned) at 16 px: a 4x4 grid."""
  workdir, _, _ = tiny_workdir
  trained = inference.load(workdir, image_size=16)
  assert trained.image_size == 16 and tuple(trained.config.model.posemb_grid) == (2, 2)
  assert trained.config.data.image_size == 16 and trained.step == 12
  logits = inference.Runner(trained).logits(_images(16))
  assert logits.shape == (3, 3) and np.isfinite(logits).all()
  assert inference.load(workdir, image_size=8).config.model.posemb_grid is None


@pytest.mark.slow
def test_a_trained_workdir_applies_at_a_non_square_size_as_with_its_table_resized(tiny_workdir):
  """The tiny run's trained weights (8 px: a 2x2 grid) applied to 8x12 px images (2x3): the
  logits of the same weights with the table resized explicitly, in and out of the model."""
  from vit_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  from vit_jax.models import resample  # pylint: disable=g-import-not-at-top
  workdir, _, _ = tiny_workdir
  trained = inference.load(workdir)
  model = step_lib.create_model(trained.config)
  variables = models.unbox(trained.variables)
  images = np.random.default_rng(1).uniform(-1, 1, (3, 8, 12, 3)).astype(np.float32)
  logits = np.asarray(model.apply(variables, images, train=False))
  entry = variables["params"]["Transformer"]["posembed_input"]
  table = np.asarray(entry["pos_embedding"])
  assert table.shape == (1, 5, 8)  # Trained at 8 px: the class row and a 2x2 grid.
  resized = resample.resample_posemb(table, (2, 3), num_prefix_tokens=1)
  explicit = jax.tree.map(lambda x: x, variables)
  explicit["params"]["Transformer"]["posembed_input"]["pos_embedding"] = resized
  same = np.asarray(model.clone(posemb_grid=(2, 3)).apply(explicit, images, train=False))
  assert logits.shape == (3, 3) and np.isfinite(logits).all()
  np.testing.assert_allclose(logits, same, rtol=0, atol=1e-6)
