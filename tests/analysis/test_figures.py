"""vit_jax.analysis.figures: every figure is a PNG of the documented pixel size, not blank, and
the same picture as its uint8 RGB array; overlays and bad input."""

import numpy as np
from PIL import Image
import pytest

from vit_jax import analysis
from vit_jax.analysis import figures


def _check_png(path, size, fig):
  """The PNG at ``path`` has ``size`` (width, height) pixels, many colours, and is the picture
  that ``to_rgb(fig)`` gives."""
  with Image.open(path) as image:
    assert image.format == "PNG"
    assert image.size == size
    pixels = np.asarray(image.convert("RGB"))
  packed = pixels.astype(np.int32) @ np.array([1 << 16, 1 << 8, 1], np.int32)
  assert len(np.unique(packed)) > 50  # Not blank: many colours.
  assert pixels.std() > 10
  rgb = figures.to_rgb(fig)
  assert rgb.dtype == np.uint8 and rgb.shape == (size[1], size[0], 3)
  np.testing.assert_array_equal(rgb, pixels)


def _images(count, size=32, channels=3):
  y, x = np.mgrid[:size, :size]
  base = np.stack([(x * 8) % 256, (y * 8) % 256, ((x + y) * 4) % 256], axis=-1)[..., :channels]
  return np.stack([np.roll(base, 5 * i, axis=1) for i in range(count)]).astype(np.uint8)


def _maps(count, g=4):
  maps = np.random.default_rng(0).uniform(size=(count, g, g)).astype(np.float32)
  return maps / maps.max(axis=(1, 2), keepdims=True)


def test_rollout_overlay(tmp_path):
  images, maps = _images(3), _maps(3)
  path = figures.rollout_overlay(images, maps, str(tmp_path / "out" / "rollout.png"),
                                 labels=["a", "b", "c"], columns=2)
  assert path == str(tmp_path / "out" / "rollout.png")  # The folder made, the path returned.
  fig = figures.rollout_overlay_figure(images, maps, labels=["a", "b", "c"], columns=2)
  _check_png(path, (800, 450), fig)


def test_layer_attention(tmp_path):
  image = _images(1, channels=1)[0].astype(np.float32) / 127.5 - 1  # Grayscale, [-1, 1].
  maps, rollout_map = _maps(3), _maps(1)[0]
  fig = figures.layer_attention_figure(image, maps, rollout_map=rollout_map)
  _check_png(figures.write_png(fig, str(tmp_path / "layers.png")), (1000, 250), fig)
  assert [ax.get_title() for ax in fig.axes[:5]] == [
      "input", "layer 1", "layer 2", "layer 3", "rollout"]


def test_attention_distance(tmp_path):
  distances = np.linspace(5, 100, 4 * 6).reshape(4, 6)
  fig = figures.attention_distance_figure(distances, image_size=(224, 224), patch_size=16)
  _check_png(figures.write_png(fig, str(tmp_path / "distance.png")), (700, 450), fig)
  assert fig.axes[0].get_title() == (
      "Mean attention distance, 224x224 px images, 16x16 px patches")
  assert len(fig.axes[0].collections) == 6  # One scatter (colour) per head.


def test_posemb_similarity_grid(tmp_path):
  similarity = analysis.posemb_similarity(np.random.default_rng(0).normal(size=(1, 17, 8)), 4, 1)
  fig = figures.posemb_similarity_figure(similarity)
  _check_png(figures.write_png(fig, str(tmp_path / "posemb.png")), (700, 600), fig)


@pytest.mark.parametrize("channels", [3, 1])
def test_filter_components(tmp_path, channels):
  kernel = np.random.default_rng(0).normal(size=(4, 4, channels, 64))
  components, ratio = analysis.embedding_filter_components(kernel)
  assert len(components) == (28 if channels == 3 else 16)
  fig = figures.filter_components_figure(components, explained=ratio,
                                         scale="joint" if channels == 3 else "channel")
  rows = 4 if channels == 3 else 3
  _check_png(figures.write_png(fig, str(tmp_path / "filters.png")), (700, rows * 100 + 60), fig)


def test_writers_forward_their_options(tmp_path):
  similarity = analysis.posemb_similarity(np.random.default_rng(0).normal(size=(1, 9, 8)), 3, 0)
  components, _ = analysis.embedding_filter_components(np.random.default_rng(0).normal(
      size=(2, 2, 1, 8)))
  written = [
      figures.layer_attention(_images(1)[0], _maps(2), str(tmp_path / "a.png"), columns=2),
      figures.attention_distance(np.ones((2, 2)), str(tmp_path / "b.png"), image_size=8, dpi=50),
      figures.posemb_similarity_grid(similarity, str(tmp_path / "c.png"), dpi=50),
      figures.filter_components(components, str(tmp_path / "d.png"), columns=2),
  ]
  sizes = []
  for path in written:
    with Image.open(path) as image:
      sizes.append(image.size)
  assert sizes == [(400, 450), (350, 225), (350, 300), (200, 260)]


def test_overlay_values():
  images = np.zeros((1, 4, 4, 1), np.uint8) + 255
  maps = np.ones((1, 2, 2), np.float32)
  masked = figures.overlay(images, maps, style="mask")
  np.testing.assert_allclose(masked, 1.0)
  blended = figures.overlay(images, maps * 0, alpha=1.0, cmap="gray")
  np.testing.assert_allclose(blended, 0.0)


@pytest.mark.parametrize("call, message", [
    (lambda: figures.filter_components_figure(np.ones((2, 4, 4, 5))),
     "C 1 (grayscale) or 3 (RGB) input channels, got (2, 4, 4, 5) (a hybrid ViT"),
    (lambda: figures.overlay(_images(2), _maps(3)),
     "maps must have shape [B, gh, gw] with B = 2 images, got (3, 4, 4)"),
    (lambda: figures.overlay(_images(1), _maps(1), style="blend"), "style must be one of"),
    (lambda: figures.rollout_overlay_figure(np.ones((1, 8, 8, 2)), _maps(1)),
     "images must have shape [B, H, W] or [B, H, W, C] with C 1 (grayscale) or 3 (RGB)"),
    (lambda: figures.attention_distance_figure(np.ones(3), image_size=32),
     "distances must have shape [layers, heads], got (3,)"),
])
def test_bad_input(call, message):
  with pytest.raises(ValueError) as error:
    call()
  assert message in str(error.value)
