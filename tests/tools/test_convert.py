"""`python -m vit_jax.convert SRC DIR` (vit_jax.tools.convert) to an Orbax directory: it keeps
what the arrays do not say (class names, preprocessing) for predict and evaluate. The
converter's other tests are in tests/checkpoint/test_finetune.py and test_ecosystem.py."""

import json
import os

import numpy as np
import pytest

from vit_jax import inference
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import orbax
from vit_jax.tools import convert

NPZ = os.path.join(os.path.dirname(__file__), "..", "fixtures", "vit_tiny", "params.npz")


def test_an_orbax_conversion_keeps_the_class_names_and_preprocessing(tmp_path, capsys):
  """A transformers ViT with class names and ImageNet normalization, converted to Orbax: its
  model names its classes and normalizes its input as the source does (they were dropped)."""
  trained = inference.load(NPZ)
  names = [f"kind_{i}" for i in range(trained.num_classes)]
  fields = dict(trained.config.model.to_dict(), num_classes=trained.num_classes)
  ecosystem.write(str(tmp_path / "hf"), trained.variables["params"], fields, to="hf",
                  image_size=trained.image_size, label_names=names, normalization="imagenet")
  source = inference.load(str(tmp_path / "hf"))
  assert list(source.label_names) == names and source.config.data.normalization == "imagenet"

  assert convert.main([str(tmp_path / "hf"), str(tmp_path / "orbax")]) == 0
  assert capsys.readouterr().out.splitlines()[-1] == (
      "  kept in vit_jax_export.json: 10 class names (kind_0, kind_1, kind_2, ...), "
      "normalization imagenet, image_size 32")
  kept = json.loads((tmp_path / "orbax" / orbax.EXPORT_JSON).read_text())
  assert kept == {"label_names": names, "image_size": 32, "normalization": "imagenet"}
  converted = inference.load(str(tmp_path / "orbax"))
  assert list(converted.label_names) == names
  assert converted.config.data.normalization == "imagenet"
  # Converted again (Orbax to Orbax), the facts travel on; to .npz there is no room for them.
  assert convert.main([str(tmp_path / "orbax"), str(tmp_path / "again")]) == 0
  assert list(inference.load(str(tmp_path / "again")).label_names) == names
  capsys.readouterr()
  assert convert.main([str(tmp_path / "orbax"), str(tmp_path / "back.npz")]) == 0
  out, err = capsys.readouterr()
  assert "kept in" not in out and err == (
      "note: an .npz holds arrays only; not kept: 10 class names (kind_0, kind_1, kind_2, ...), "
      "normalization imagenet, image_size 32 (write a directory, an Orbax checkpoint, to keep "
      "them).\n")


@pytest.mark.slow
def test_step_picks_a_step_of_a_workdir_and_is_refused_for_a_file(tiny_workdir, tmp_path,
                                                                   capsys):
  """`--step N` converts that step of a run (default its latest); a single file has no steps."""
  workdir = str(tiny_workdir[0])
  assert convert.main([workdir, str(tmp_path / "six.npz"), "--step", "6"]) == 0
  assert convert.main([workdir, str(tmp_path / "latest.npz")]) == 0
  six, latest = (np.load(tmp_path / f"{n}.npz") for n in ("six", "latest"))
  assert not np.array_equal(six["head/kernel"], latest["head/kernel"])
  np.testing.assert_array_equal(
      six["head/kernel"],
      inference.load(workdir, step=6).variables["params"]["head"]["kernel"])
  capsys.readouterr()
  assert convert.main([NPZ, str(tmp_path / "x.npz"), "--step", "6"]) == 2
  assert "--step applies to training workdirs" in capsys.readouterr().err
