"""A trained model from any source (vit_jax.inference, vit_jax.checkpoint.workdir): the workdir
describes itself (config, class names), the official files get their papers' evaluation
settings, and the Runner reproduces the reference logits."""

import json
import os
import shutil

import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import data
from vit_jax import inference
from vit_jax.checkpoint import saved_run

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NPZ = os.path.join(FIXTURES, "vit_tiny", "params.npz")
PTH = os.path.join(FIXTURES, "t2t_tiny_performer", "checkpoint.pth.tar")
T2T_FIELDS = dict(embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, token_dim=16,
                  tokens_type="performer", qk_scale=64 ** -0.5)


@pytest.mark.golden
def test_an_official_npz_gets_its_architecture_from_the_shapes_and_the_reference_logits():
  trained = inference.load(NPZ)
  assert trained.config.model_name == "ViT-custom"
  model = trained.config.model
  assert (tuple(model.patch_size), model.hidden_size, model.num_layers, model.num_heads,
          model.mlp_dim, model.classifier, model.scan) == ((4, 4), 32, 2, 2, 64, "token", False)
  # 8x8 grid of 4x4 patches (65 rows with the class token): 32 px, the official preprocessing.
  assert trained.image_size == 32 and trained.config.data.normalization == "minus_one_to_one"
  assert trained.config.data.eval_crop_pct is None and trained.config.loss == "softmax_xent"
  assert trained.num_classes == 10 and trained.label_names is None and trained.step is None
  logits = inference.Runner(trained).logits(np.load(os.path.join(FIXTURES, "vit_tiny",
                                                                 "inputs.npy")))
  np.testing.assert_allclose(logits, np.load(os.path.join(FIXTURES, "vit_tiny", "logits.npy")),
                             atol=2e-5)
  probabilities = trained.probabilities(logits)
  np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-6)
  assert (probabilities.argmax(-1) == logits.argmax(-1)).all()


@pytest.mark.slow
@pytest.mark.golden
def test_a_t2t_pth_tar_reads_its_class_count_and_size_and_evaluates_with_the_t2t_crop():
  trained = inference.load(PTH, model_name="T2T-ViT-custom", overrides=T2T_FIELDS)
  assert trained.image_size == 64 and trained.num_classes == 10  # pos_embed: 4x4 + 1 rows.
  assert (trained.config.data.normalization, trained.config.data.eval_crop_pct) == ("imagenet",
                                                                                    0.9)
  runner = inference.Runner(trained)
  images = np.load(os.path.join(FIXTURES, "t2t_tiny_performer", "inputs_nhwc.npy"))
  np.testing.assert_allclose(runner.logits(images), np.load(
      os.path.join(FIXTURES, "t2t_tiny_performer", "logits.npy")), atol=2e-5)  # The EMA.
  features = runner.features(images)
  assert features.shape == (2, 64) and np.isfinite(features).all()


ECOSYSTEM = os.path.join(FIXTURES, "ecosystem")
REG4_GAP = os.path.join(ECOSYSTEM, "timm_reg4_gap", "model.safetensors")
#: timm_reg4_gap's architecture (a non-standard width: timm files do not record the heads).
REG4_ARCH = dict(hidden_size=16, mlp_dim=32, num_heads=2, num_layers=2, patch_size=8)


@pytest.mark.golden
def test_timm_variants_named_with_model_take_their_fields_from_the_weights():
  """--model ViT-custom with the architecture: LayerScale, 4 registers, no_embed_class and
  fc_norm come from the weights, as the classifier and position embedding do; timm's logits."""
  trained = inference.load(REG4_GAP, model_name="ViT-custom", overrides=REG4_ARCH)
  model = trained.config.model
  assert (model.layerscale_init, model.num_registers, model.no_embed_class, model.fc_norm,
          model.classifier) == (1e-5, 4, True, True, "gap")
  golden = np.load(os.path.join(ECOSYSTEM, "timm_reg4_gap", "golden.npz"))
  np.testing.assert_allclose(inference.Runner(trained).logits(golden["images"]),
                             golden["logits"], rtol=0, atol=1e-5)


def test_timm_weights_at_another_size_resample_their_table_as_timm():
  """A timm file at 48 px (4x4 -> 6x6 grid): bicubic with antialiasing in the model (timm's
  dynamic_img_size), unless --set posemb_resize says otherwise."""
  heads = {"num_heads": 2}
  trained = inference.load(REG4_GAP, image_size=48, overrides=heads)
  assert trained.config.model.posemb_resize == "bicubic_antialias"
  assert tuple(trained.config.model.posemb_grid) == (4, 4)
  assert inference.load(REG4_GAP, overrides=heads).config.model.posemb_resize == (
      "bicubic_antialias")
  images = np.random.default_rng(0).uniform(-1, 1, (2, 48, 48, 3)).astype(np.float32)
  logits = inference.Runner(trained).logits(images)
  # The same as the table resampled once, by timm's method, applied at 48 px.
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  from vit_jax.models import resample  # pylint: disable=g-import-not-at-top
  variables = checkpoint.load(REG4_GAP, model=models.create(
      "ViT-custom", **{k: v for k, v in checkpoint.model_fields(REG4_GAP, num_heads=2).items()
                       if k != "image_size"}))
  entry = variables["params"]["Transformer"]["posembed_input"]
  entry["pos_embedding"] = resample.resample_posemb(entry["pos_embedding"], (6, 6),
                                                    num_prefix_tokens=0,
                                                    method="bicubic_antialias")
  want = inference.Runner(inference.load(REG4_GAP, overrides=heads)).setup.model.apply(
      variables, images, train=False)
  np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5)
  bilinear = inference.load(REG4_GAP, image_size=48,
                            overrides=dict(heads, posemb_resize="linear_corners"))
  assert bilinear.config.model.posemb_resize == "linear_corners"
  assert np.abs(inference.Runner(bilinear).logits(images) - logits).max() > 1e-4


def test_bad_sources_are_one_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"does not exist: give a training workdir"):
    inference.load(tmp_path / "nothing")
  with pytest.raises(ValueError, match=r"PyTorch checkpoint: name its model with --model"):
    inference.load(PTH)
  with pytest.raises(ValueError, match=r"params.npz does not fit --model ViT-B_16. The checkpoint "
                     r"is a ViT with patch_size=4, hidden_size=32, num_layers=2, .* 10 classes. "
                     r"Name the model these weights are of \(an .npz needs no --model"):
    inference.load(NPZ, model_name="ViT-B_16")
  with pytest.raises(ValueError, match=r"checkpoint.pth.tar does not fit --model T2T-ViT-14. The "
                     r"checkpoint is a T2T-ViT with embed_dim=64, depth=2, .* 10 classes. Name"):
    inference.load(PTH, model_name="T2T-ViT-14")
  with pytest.raises(ValueError, match=r"--num-classes 5 does not match .*its head has 10"):
    inference.load(NPZ, num_classes=5)
  with pytest.raises(ValueError, match=r"--step applies to training workdirs"):
    inference.load(NPZ, step=3)
  with pytest.raises(ValueError, match=r"is not a T2T-ViT|not one"):
    inference.load(PTH, model_name="ViT-B_16")
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ValueError, match="Unrecognised checkpoint directory"):
    inference.load(empty)
  runner = inference.Runner(inference.load(NPZ))
  with pytest.raises(ValueError, match=r"the model takes \[B, 32, 32, 3\]"):
    runner.logits(np.zeros((1, 28, 28, 3), np.float32))


def test_class_names_that_do_not_fit_the_head_are_refused(tmp_path):
  """A run's head has one output per class of its data: a record naming another count is not
  this model's (it was used silently): refused, naming the record and the fix."""
  step_dir = tmp_path / "w" / "checkpoints" / "12"
  (step_dir / "state").mkdir(parents=True)
  run = saved_run.SavedRun(str(step_dir / "state"), 12, None, None, False, [12])
  record = {"label_names": ["a", "b"], "multi_label": False}
  label_names = checkpoint.formats._label_names  # pylint: disable=protected-access
  assert label_names(record, 2, run) == (("a", "b"), False)
  with pytest.raises(ValueError) as error:
    label_names(record, 3, run)
  assert str(error.value) == (
      f"The dataset record {tmp_path}/w/dataset.json names 2 classes, but the model's head has 3 "
      f"outputs: the names are not this model's; restore this run's {tmp_path}/w/dataset.json, "
      "or delete it (the names then come from the training data, when it is on this machine).")
  (step_dir / "dataset").mkdir()  # The step's own record.
  with pytest.raises(ValueError, match=(
      rf"^The dataset record of step 12 \({step_dir}/dataset\) names 2 classes, but the model's "
      r"head has 3 outputs: the names are not this model's; the checkpoint is inconsistent: use "
      r"another step \(--step\)\.$")):
    label_names(record, 3, run)


@pytest.mark.slow
def test_a_workdir_rebuilds_its_model_labels_and_preprocessing(tiny_workdir, tmp_path,
                                                                monkeypatch):
  workdir, _, _ = tiny_workdir
  record = json.load(open(os.path.join(workdir, "dataset.json")))
  assert record["label_names"] == ["class_0", "class_1", "class_2"]
  assert (record["num_classes"], record["multi_label"], record["image_shape"],
          record["num_train_examples"]) == (3, False, [8, 8, 3], 15)

  trained = inference.load(workdir)
  assert trained.step == 12 and trained.label_names == ("class_0", "class_1", "class_2")
  assert trained.description == f"{workdir} (step 12, parameters)"
  assert trained.image_size == 8 and trained.config.model.scan  # The layout it was trained in.
  images = np.random.default_rng(0).uniform(-1, 1, (3, 8, 8, 3)).astype(np.float32)
  logits = inference.Runner(trained).logits(images)
  assert logits.shape == (3, 3)

  # An earlier step, a step directory, the checkpoints directory: the same run.
  assert inference.load(workdir, step=6).step == 6
  assert inference.load(os.path.join(workdir, "checkpoints", "6")).label_names == (
      "class_0", "class_1", "class_2")
  assert inference.load(os.path.join(workdir, "checkpoints")).step == 12
  with pytest.raises(FileNotFoundError, match=r"Step 7 is not saved .* saved steps are \[6, 12\]"):
    inference.load(workdir, step=7)
  with pytest.raises(ValueError, match=r"training workdir of ViT-custom: its saved config "
                     "rebuilds the model; drop --model"):
    inference.load(workdir, model_name="ViT-custom", overrides={"hidden_size": 8})
  # What the saved config fixes is checked, not ignored (a new user's find).
  with pytest.raises(ValueError, match=r"--num-classes 5: .* with num classes 3 .*drop "
                     "--num-classes"):
    inference.load(workdir, num_classes=5)
  # Another size is not refused (issue 41): the ViT resamples its 2x2 table in the model.
  at16 = inference.load(workdir, image_size=16)
  assert at16.image_size == 16 and tuple(at16.config.model.posemb_grid) == (2, 2)
  assert at16.config.model.posemb_resize == "linear_corners"  # The run's config's.
  assert inference.Runner(at16).logits(np.repeat(np.repeat(images, 2, 1), 2, 2)).shape == (3, 3)
  assert inference.load(workdir, num_classes=3, image_size=8).step == 12

  # A run saved before the dataset record existed: the names from its data while it is there.
  old = tmp_path / "old"
  shutil.copytree(workdir, old)
  os.remove(old / "dataset.json")
  for step in (6, 12):
    shutil.rmtree(old / "checkpoints" / str(step) / "dataset")
  assert saved_run.read_run(old).dataset is None
  older = inference.load(old)
  assert older.label_names == ("class_0", "class_1", "class_2")
  np.testing.assert_allclose(inference.Runner(older).logits(images), logits, rtol=1e-6)

  def unreadable(data_config):
    raise FileNotFoundError(f"{data_config.image_folder} is gone")

  monkeypatch.setattr(data, "get_info", unreadable)  # Then without names, the rest as before.
  older = inference.load(old)
  assert older.label_names is None and older.label_name(2) == "2"
