"""Single image files (vit_jax.data.files): a folder's images, and one file or array
preprocessed exactly as the eval pipeline preprocesses it."""

import io
import os
import re

import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

from vit_jax.data import bad_images
from vit_jax.data import files
from vit_jax.data import preprocess


def _png(path, array):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  Image.fromarray(array).save(path)
  return str(path)


def _image(seed, shape):
  return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_a_folder_lists_its_image_files_sorted_and_recursively(tmp_path):
  for name in ["b.png", "a.JPG", "sub/c.webp", "sub/deeper/d.gif", "e.bmp", "f.jpeg"]:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(b"")
  for name in ["notes.txt", ".hidden.png", ".cache/x.png", "noext"]:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(b"")
  expected = ["a.JPG", "b.png", "e.bmp", "f.jpeg", "sub/c.webp", "sub/deeper/d.gif"]
  assert files.list_images(str(tmp_path)) == [str(tmp_path / n) for n in expected]
  assert files.list_images(str(tmp_path), recursive=False) == [
      str(tmp_path / n) for n in expected[:4]]
  with pytest.raises(FileNotFoundError, match="is not a directory"):
    files.list_images(str(tmp_path / "b.png"))


def test_a_folder_is_listed_once_whatever_links_lead_back_into_it(tmp_path):
  """Issue 37: `predict` on a folder with a link to its parent never finished (406,011
  directories in 45 s): each level doubled the walk."""
  for name in ["a.png", "sub/b.png", "other/c.png"]:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(b"")
  (tmp_path / "sub" / "up").symlink_to("..")  # A loop.
  (tmp_path / "sub" / "again").symlink_to(tmp_path / "sub")  # A loop to itself.
  (tmp_path / "alias").symlink_to("other")  # A second way to a folder: listed once.
  links = []
  assert files.list_images(str(tmp_path), skipped_links=links) == [
      str(tmp_path / n) for n in ["a.png", "other/c.png", "sub/b.png"]]
  assert links == [str(tmp_path / n) for n in ["alias", "sub/again", "sub/up"]]
  outside = tmp_path.parent / f"{tmp_path.name}_outside"
  (outside / "back").mkdir(parents=True)
  (outside / "d.png").write_bytes(b"")
  (outside / "back" / "in").symlink_to(tmp_path)  # Out, and back in: followed once.
  (tmp_path / "out").symlink_to(outside)
  assert files.list_images(str(tmp_path)) == [
      str(tmp_path / n) for n in ["a.png", "other/c.png", "out/d.png", "sub/b.png"]]
  (tmp_path / "self.png").symlink_to("self.png")
  with pytest.raises(OSError, match=rf"^{tmp_path}/self.png cannot be read: Too many levels "
                     "of symbolic links$"):
    files.read_bytes(str(tmp_path / "self.png"))
  latin1 = os.fsencode(tmp_path) + b"/other/caf\xe9.png"
  open(latin1, "wb").close()
  with pytest.raises(ValueError, match=re.escape(f"The file name {latin1!r} is not UTF-8")):
    files.list_images(str(tmp_path))
  assert bad_images.first_non_utf8_path(str(tmp_path)) == latin1


@pytest.mark.parametrize("crop_pct,normalization", [(None, "minus_one_to_one"),
                                                    (0.9, "imagenet"), (None, None)])
def test_a_file_is_the_eval_pipelines_input(tmp_path, crop_pct, normalization):
  """`eval_input` of a path = `preprocess.eval_image` of its bytes (resize, or the T2T-ViT
  resize-and-crop; [-1, 1], mean/std or [0, 255]); a PIL image and an array of the same pixels
  give the same input."""
  array = _image(0, (23, 17, 3))
  path = _png(tmp_path / "x.png", array)
  kwargs = dict(size=12, normalization=normalization, crop_pct=crop_pct)
  expected = preprocess.eval_image(tf.io.read_file(path), encoded=True, **kwargs).numpy()
  assert expected.shape == (12, 12, 3) and expected.dtype == np.float32
  for image in (path, open(path, "rb").read(), Image.open(path), array):
    np.testing.assert_array_equal(files.eval_input(image, **kwargs), expected)


def test_grey_palette_and_alpha_images_become_rgb_as_the_pipeline_decodes_them(tmp_path):
  grey = _image(1, (6, 5))
  rgb = np.repeat(grey[..., None], 3, -1)
  kwargs = dict(size=6, normalization=None)
  expected = files.eval_input(rgb, **kwargs)
  assert (expected == expected[..., :1]).all()  # Three equal channels.
  for image in (grey, grey[..., None], Image.fromarray(grey),
                _png(tmp_path / "grey.png", grey)):
    np.testing.assert_array_equal(files.eval_input(image, **kwargs), expected)
  rgba = np.concatenate([rgb, np.zeros((6, 5, 1), np.uint8)], -1)  # Transparent: dropped.
  for image in (rgba, Image.fromarray(rgba), _png(tmp_path / "rgba.png", rgba)):
    np.testing.assert_array_equal(files.eval_input(image, **kwargs), expected)
  palette = Image.fromarray(rgb).convert("P")
  buffer = io.BytesIO()
  palette.save(buffer, format="PNG")
  np.testing.assert_array_equal(files.eval_input(palette, **kwargs),
                                files.eval_input(buffer.getvalue(), **kwargs))


def test_bad_files_and_arrays_are_named_in_the_error(tmp_path):
  kwargs = dict(size=8, normalization="minus_one_to_one")
  bad = tmp_path / "bad.jpg"
  bad.write_bytes(b"\xff\xd8 truncated jpeg")
  with pytest.raises(bad_images.BadImageError, match=f"^{bad} is not a decodable image: ") as info:
    files.eval_input(str(bad), **kwargs)
  assert info.value.paths == [str(bad)]
  with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'missing.png'} does not exist"):
    files.eval_input(str(tmp_path / "missing.png"), **kwargs)
  with pytest.raises(IsADirectoryError, match="is a directory, not an image file"):
    files.eval_input(str(tmp_path), **kwargs)
  with pytest.raises(ValueError, match=r"^photo: an array of shape \(2, 3, 4, 3\)"):
    files.eval_input(np.zeros((2, 3, 4, 3), np.uint8), name="photo", **kwargs)
  with pytest.raises(ValueError, match=r"an array of dtype <U1; give uint8 pixels"):
    files.eval_input(np.array([["a"]]), **kwargs)
