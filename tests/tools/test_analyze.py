"""`python -m vit_jax.analyze`: the figures and numbers of a trained workdir and of a T2T-ViT file,
and the bad inputs of the command (one FATAL line, exit 2, nothing written)."""

import json
import types
import pathlib

import numpy as np
from PIL import Image
import pytest

from vit_jax.tools import analyze

ROOT = pathlib.Path(__file__).resolve().parents[2]
PTH = str(ROOT / "tests" / "fixtures" / "t2t_tiny_performer" / "checkpoint.pth.tar")
T2T_SETS = ["--set", "embed_dim=64", "--set", "depth=2", "--set", "num_heads=2", "--set",
            "mlp_ratio=2.0", "--set", "token_dim=16", "--set", "tokens_type='performer'",
            "--set", "qk_scale=0.125"]


def _size(path):
  with Image.open(path) as image:
    return image.size


def test_a_workdir_gets_every_figure_and_its_numbers(tiny_workdir, tmp_path, capsys):
  workdir, folder, _ = tiny_workdir  # ViT: 8 px, 4x4 patches (a 2x2 grid), 1 layer, 2 heads.
  out = tmp_path / "analysis"
  assert analyze.main([workdir, "--images", folder, "--out", str(out), "--num-images", "6",
                       "--overlays", "4"]) == 0
  printed = capsys.readouterr().out
  assert "6 image(s), 1 layers x 2 heads" in printed
  for name in analyze.OUTPUTS:
    assert (out / name).exists(), name
  numbers = json.loads((out / "analysis.json").read_text())
  assert (numbers["grid"], numbers["stride"], numbers["prefix"], numbers["num_images"]) == (
      [2, 2], [4, 4], 1, 6)
  distance = np.asarray(numbers["attention_distance"])
  # On a 2x2 grid of 4 px patches a key is 0, 4 or 4*sqrt(2) px from its query: any attention's
  # mean distance lies in [0, 5.66].
  assert distance.shape == (1, 2) and np.all((distance >= 0) & (distance <= 4 * 2 ** 0.5))
  assert np.asarray(numbers["rollout"]).shape == (4, 2, 2)
  assert len(numbers["predicted"]) == 4 and all(0 <= p < 3 for p in numbers["predicted"])
  similarity = np.asarray(numbers["posemb_similarity"])
  np.testing.assert_allclose(similarity.reshape(4, 4).diagonal(), 1.0, atol=1e-6)
  assert len(numbers["explained_variance"]) == 8  # min(28, 4*4*3 values, 8 filters)
  assert _size(out / "rollout.png")[0] > _size(out / "rollout.png")[1]  # 4 images side by side.
  # Again: refused without --overwrite, nothing changed; accepted with it.
  before = (out / "analysis.json").read_bytes()
  assert analyze.main([workdir, "--images", folder, "--out", str(out)]) == 2
  assert "already holds an analysis" in capsys.readouterr().err
  assert (out / "analysis.json").read_bytes() == before


def test_a_t2t_vit_file_gets_its_backbone_analysis(tmp_path, capsys):
  image = tmp_path / "images" / "a.png"
  image.parent.mkdir()
  Image.fromarray(np.random.RandomState(0).randint(0, 255, (40, 40, 3), np.uint8)).save(image)
  out = tmp_path / "t2t"
  assert analyze.main([PTH, "--model", "T2T-ViT-custom", *T2T_SETS, "--images", str(image),
                       "--out", str(out)]) == 0
  numbers = json.loads((out / "analysis.json").read_text())
  assert numbers["stride"] == [16, 16] and numbers["prefix"] == 1
  assert numbers["posemb_similarity"] is None and numbers["explained_variance"] is None
  assert not (out / "filter_components.png").exists()
  assert (out / "attention_distance.png").exists()


def test_registers_and_no_class_token_get_the_patch_rows_and_the_patch_table():
  """timm's reg4_gap ViT (4 registers, no class token, a position table of the 16 patches only:
  no_embed_class) was refused ("pos_embedding has 16 tokens but ... num_prefix_tokens=4"): its
  maps are the mean of the patch rows and its similarity is the table's 4x4 grid."""
  from vit_jax import analysis  # pylint: disable=g-import-not-at-top
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  from vit_jax.models import intermediates  # pylint: disable=g-import-not-at-top
  source = ROOT / "tests" / "fixtures" / "ecosystem" / "timm_reg4_gap"
  trained = inference.load(str(source / "model.safetensors"), overrides={"num_heads": 2})
  images = np.load(source / "golden.npz")["images"]
  result = analyze.analyze(trained, images, overlays=2)
  assert (result["prefix"], result["registers"], result["grid"]) == (4, 4, [4, 4])
  captured = intermediates.capture(trained.model, trained.variables, images)
  mean_rows = analysis.rollout(captured.attention)[:, 4:, 4:].mean(1)
  np.testing.assert_allclose(result["rollout"].reshape(2, 16),
                             mean_rows / mean_rows.max(-1, keepdims=True), rtol=1e-5)
  table = trained.variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  assert table.shape == (1, 16, 16)
  unit = table[0] / np.linalg.norm(table[0], axis=-1, keepdims=True)
  np.testing.assert_allclose(result["posemb_similarity"].reshape(16, 16), unit @ unit.T,
                             atol=1e-5)
  assert result["layer_maps"].shape == (2, 4, 4)


def test_rollout_captions_show_wrong_predictions_as_training_does():
  trained = types.SimpleNamespace(label_name=["Coat", "Pullover", "Bag"].__getitem__)
  assert analyze._captions(trained, [1, 0], ["Coat", "Coat"], from_files=False) == [
      "Pullover (true Coat)", "Coat"]
  assert analyze._captions(trained, [2], ["a.jpg"], from_files=True) == ["a.jpg: Bag"]


def test_bad_input_is_one_fatal_line(tmp_path, tiny_workdir, capsys):
  workdir, _, _ = tiny_workdir
  empty = tmp_path / "empty"
  empty.mkdir()
  assert analyze.main([workdir, "--images", str(empty), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("FATAL: ") and "no image files" in err
  assert analyze.main([str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert analyze.main([workdir, "--out", str(tmp_path / "o"), "--num-images", "0"]) == 2
  assert capsys.readouterr().err == "FATAL: --num-images 0: must be 1 or more.\n"
  assert not (tmp_path / "o").exists()
