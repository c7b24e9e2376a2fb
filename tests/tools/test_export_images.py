"""`python -m vit_jax.tools.export_images`: a dataset's examples as PNG files named by label."""

import os

import numpy as np
from PIL import Image

from tests import data_utils
from vit_jax.tools import export_images


def test_examples_are_written_losslessly_and_named_by_index_and_labels(tmp_path, capsys):
  dataset = data_utils.make_multilabel_dataset(str(tmp_path / "tfds"), num_test=10)
  capsys.readouterr()  # tfds's preparation lines.
  out = tmp_path / "out"
  assert export_images.main(["--data", dataset, "--split", "test[:4]", "--out", str(out)]) == 0
  assert capsys.readouterr().out == f"Wrote 4 images to {out}.\n"
  names = sorted(os.listdir(out))
  assert [n.split("_")[0] for n in names] == ["0", "1", "2", "3"]
  for name in names:
    image = np.asarray(Image.open(out / name))
    assert image.shape == (8, 8)  # Three equal channels: written as one.
    value = int(image[0, 0])  # Example `value` has that pixel value and these labels.
    labels = "+".join(map(str, data_utils.multilabel_labels(value))) or "none"
    assert (image == value).all() and name == f"{name.split('_')[0]}_{labels}.png"


def test_an_unknown_dataset_is_one_fatal_line(tmp_path, capsys):
  code = export_images.main(["--data", "no_such_dataset_xyz", "--out", str(tmp_path / "o")])
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 1 and err.startswith(
      "FATAL: config.data.name='no_such_dataset_xyz' is neither a registered tfds dataset")
