"""The features API (vit_jax.inference, vit_jax.step.make_tokens_step): pre-logits, every
block's tokens with and without the final LayerNorm, the patch tokens as a grid, a trained model
applied directly; checked on timm's files (tests/fixtures/ecosystem): the final-norm tokens,
pooled and passed through the head as the model does, give timm's outputs."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import inference
from vit_jax import models
from vit_jax import step as step_lib
from vit_jax.models import layout as layout_lib

ECOSYSTEM = os.path.join(os.path.dirname(__file__), "fixtures", "ecosystem")
#: The variant fixtures' width is not a standard one: timm files do not record the heads.
HEADS = {"num_heads": 2}


def _load(name, **kwargs):
  golden = np.load(os.path.join(ECOSYSTEM, name, "golden.npz"))
  trained = inference.load(os.path.join(ECOSYSTEM, name, "model.safetensors"), **kwargs)
  return trained, inference.Runner(trained), golden


def _jitted_apply(trained, images):
  """`trained.apply(images)` under jax.jit: one compilation instead of every op's (the unjitted
  apply compiles each operation on its own: about 3x the CPU time here)."""
  return np.asarray(jax.jit(trained.apply)(images))


def _head(trained, pooled):
  head = trained.variables["params"]["head"]
  return pooled @ np.asarray(head["kernel"]) + np.asarray(head["bias"])


def _layer_norm(x, params, epsilon):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + epsilon) * params["scale"] + params["bias"]


@pytest.mark.golden
def test_dinov2_with_registers_as_a_feature_extractor_gives_timms_features():
  """timm's vit_small_patch14_reg4_dinov2 with num_classes=0 (no head): loaded with
  num_classes=0, its features, the normed class token of tokens() and apply() are timm's output;
  the 4 registers are in tokens() (class token, registers, 2x2 patches) and not in the grid."""
  trained, runner, golden = _load("timm_dinov2_reg4", num_classes=0, overrides=HEADS)
  images, want = golden["images"], golden["logits"]
  assert trained.num_classes == 0 and trained.label_names is None
  assert (runner.layout.prefix, runner.layout.grid) == (5, (2, 2))
  np.testing.assert_allclose(runner.features(images), want, rtol=0, atol=1e-5)
  np.testing.assert_allclose(_jitted_apply(trained, images), want, rtol=0, atol=1e-5)
  tokens = runner.tokens(images)
  assert tokens.shape == (2, 9, 16) and tokens.dtype == np.float32
  np.testing.assert_allclose(tokens[:, 0], want, rtol=0, atol=1e-5)
  raw = runner.tokens(images, norm=False)
  assert np.abs(raw[:, 0] - want).max() > 0.1  # The norm is what makes them timm's.
  norm = trained.variables["params"]["Transformer"]["encoder_norm"]
  np.testing.assert_allclose(_layer_norm(raw, norm, 1e-6), tokens, rtol=0, atol=1e-5)
  grids = runner.patch_grid(images, blocks=[0, -1])
  assert grids.shape == (2, 2, 2, 2, 16)  # [blocks, B, gh, gw, D].
  np.testing.assert_array_equal(grids[1], tokens[:, 5:].reshape(2, 2, 2, 16))
  first = runner.tokens(images, blocks=(0,), norm=False)
  assert first.shape == (1, 2, 9, 16)
  np.testing.assert_allclose(_layer_norm(first[0][:, 5:], norm, 1e-6).reshape(2, 2, 2, 16),
                             grids[0], rtol=0, atol=1e-5)
  assert np.abs(first[0] - raw).max() > 0.1  # Block 0 is not block 1.
  with pytest.raises(ValueError, match=r"loaded as a feature extractor \(num_classes=0, no "
                     r"head\): it has no logits"):
    runner.logits(images)
  with pytest.raises(ValueError, match=r"has no classification head .* num_classes=0"):
    inference.load(os.path.join(ECOSYSTEM, "timm_dinov2_reg4", "model.safetensors"),
                   overrides=HEADS)


@pytest.mark.golden
@pytest.mark.parametrize("name", ["timm_vit", "timm_vit_gap", "timm_reg4_gap"])
def test_final_norm_tokens_pooled_through_the_head_are_timms_logits(name):
  """The class token (timm_vit), the mean of the 16 patch tokens (timm_vit_gap) or of the patch
  tokens after the 4 registers, then fc_norm (timm_reg4_gap: no final norm on the tokens, as
  timm's forward_features) through the head give the golden logits; features() is the pooled."""
  trained, runner, golden = _load(name, overrides=HEADS if name == "timm_reg4_gap" else {
      "num_heads": 4})
  images, want = golden["images"], golden["logits"]
  tokens, grid = runner.tokens(images), runner.patch_grid(images)
  prefix = {"timm_vit": 1, "timm_vit_gap": 0, "timm_reg4_gap": 4}[name]
  assert runner.layout.prefix == prefix and grid.shape == (2, 4, 4, tokens.shape[-1])
  np.testing.assert_array_equal(grid.reshape(2, 16, -1), tokens[:, prefix:])
  pooled = tokens[:, 0] if name == "timm_vit" else grid.mean(axis=(1, 2))
  if name == "timm_reg4_gap":
    np.testing.assert_array_equal(tokens, runner.tokens(images, norm=False))
    pooled = _layer_norm(pooled, trained.variables["params"]["fc_norm"], 1e-6)
  np.testing.assert_allclose(runner.features(images), pooled, rtol=0, atol=1e-5)
  np.testing.assert_allclose(_head(trained, pooled), want, rtol=0, atol=1e-5)
  np.testing.assert_allclose(_jitted_apply(trained, images), want, rtol=0, atol=1e-5)


def _random_variables(model, images):
  shapes = layout_lib.unbox(jax.eval_shape(lambda k, x: model.init(k, x, train=False),
                                           jax.random.key(0), images))
  rng = np.random.default_rng(1)
  return jax.tree.map(lambda s: jnp.asarray(0.5 * rng.normal(size=s.shape), s.dtype), shapes)


def test_t2t_and_scanned_tokens_step():
  """T2T-ViT: its final norm (`norm`) on the last block's class token, through the head, is the
  model's logits; a scanned ViT gives the per-layer model's tokens; a bad block is refused."""
  t2t = models.T2TViT(num_classes=3, embed_dim=16, depth=2, num_heads=2, mlp_ratio=1.0,
                      token_dim=8)
  images = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
  variables = _random_variables(t2t, images)
  state = {"params": variables["params"], "model_state": {"constants": variables["constants"]}}
  last, first = jax.jit(step_lib.make_tokens_step(t2t, (-1, 0), norm=True))(state, images)
  assert last.shape == (2, 5, 16)  # The class token and a 2x2 grid.
  head = variables["params"]["head"]
  logits = jax.jit(lambda v, x: t2t.apply(v, x, train=False))(variables, images)  # 0.8 s, not
  np.testing.assert_allclose(last[:, 0] @ head["kernel"] + head["bias"],  # 6.6 s unjitted.
                             logits, rtol=0, atol=1e-5)
  assert np.abs(last - first).max() > 0.1

  fields = dict(num_classes=3, patch_size=8, hidden_size=16, mlp_dim=16, num_heads=2,
                num_layers=3, num_registers=2, classifier="gap")
  plain = models.VisionTransformer(**fields)
  variables = _random_variables(plain, images)
  scanned = models.VisionTransformer(**fields, scan=True)
  blocks = (0, 1, -1)
  want = jax.jit(step_lib.make_tokens_step(plain, blocks, norm=False))(variables, images)
  got = jax.jit(step_lib.make_tokens_step(scanned, blocks, norm=False))(
      models.scan_params(variables), images)
  assert len(got) == 3 and got[0].shape == (2, 18, 16)  # 2 registers, 4x4 patches.
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
  with pytest.raises(IndexError, match=r"Block 3: the model has 3 blocks \(0 to 2, or -3 to -1"):
    step_lib.make_tokens_step(plain, (3,), norm=True)


def test_the_runner_checks_blocks_and_images():
  trained, runner, golden = _load("timm_vit", overrides={"num_heads": 4})
  images = golden["images"]
  assert runner.tokens(images[:0]).shape == (0, 17, 32)
  assert runner.patch_grid(images[:0], blocks=[0, 1]).shape == (2, 0, 4, 4, 32)
  for bad in (5, [], [0, "1"], True, 1.5):
    with pytest.raises(ValueError, match=r"blocks="):
      runner.tokens(images, blocks=bad)
  with pytest.raises(ValueError, match=r"the model takes \[B, 32, 32, 3\]"):
    runner.patch_grid(images[:, :16])
  assert trained.token_layout == runner.layout


def test_the_predictor_gives_features_of_images():
  """Predictor's features, tokens and patch grid of images (arrays here) are the Runner's of
  their preprocessed inputs, one image or several."""
  from vit_jax.predict import Predictor  # pylint: disable=g-import-not-at-top
  trained = inference.load(os.path.join(ECOSYSTEM, "timm_vit", "model.safetensors"),
                           overrides={"num_heads": 4})
  predictor = Predictor(trained)
  pictures = list(np.random.default_rng(2).integers(0, 256, (2, 40, 40, 3), dtype=np.uint8))
  inputs = predictor.inputs(pictures)
  assert inputs.shape == (2, 32, 32, 3)
  np.testing.assert_array_equal(predictor.features(pictures), predictor.runner.features(inputs))
  np.testing.assert_array_equal(predictor.patch_grid(pictures, blocks=[0], norm=False),
                                predictor.runner.patch_grid(inputs, blocks=[0], norm=False))
  one = predictor.tokens(pictures[1])
  assert one.shape == (1, 17, 32)
  np.testing.assert_allclose(one[0], predictor.runner.tokens(inputs)[1], rtol=0, atol=1e-6)
