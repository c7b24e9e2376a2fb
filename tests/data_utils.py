"""Generators of tiny datasets for tests (importable: `from tests import data_utils`).

Every generated image is constant-valued and encodes an example id, so tests
can check which examples a pipeline produced:

* `make_image_folder`: root/{train,test}/<class>/*.png|jpg, pixel value of
  example = `folder_pixel_value(split, class, k)`.
* `make_multilabel_dataset`: a generated tfds dataset (builder
  `tiny_multi_label`) with multi-hot `labels`; example i has pixel value i and
  labels `multilabel_labels(i)`.
* `make_fake_idx`: Fashion-MNIST-format gz IDX files; example i of a split has
  pixel value `idx_pixel_value(split, i)` and label i % 10.

The helpers go through `vit_jax.data` first, which hides accelerators from
TensorFlow.
"""

from __future__ import annotations

import gzip
import os
import struct
from typing import List, Optional, Sequence

import numpy as np

from vit_jax import data as _vit_data  # noqa: F401  (hides GPUs from TF first)
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-order
import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top,wrong-import-order

# ---------------------------------------------------------------- image folder

FOLDER_SPLIT_OFFSET = {'train': 0, 'test': 128}


def folder_pixel_value(split: str, class_index: int, k: int,
                       per_class: int) -> int:
  """Pixel value of the k-th image of class `class_index` in `split`."""
  return FOLDER_SPLIT_OFFSET[split] + class_index * per_class + k


def make_image_folder(root: str, num_classes: int = 3, per_class=4,
                      size=(8, 6), channels: int = 3,
                      jpeg_every: int = 0) -> str:
  """Writes root/{train,test}/class_<c>/img_<k>.{png,jpg} (real PNG/JPEG files).

  Args:
    root: directory to create.
    num_classes: classes 'class_0', ...; sorted names = class indices.
    per_class: images per class per split (int, or dict split -> int).
    size: (H, W) of every image (int for square).
    channels: 3 (RGB) or 1 (grayscale PNG/JPEG).
    jpeg_every: if > 0, every `jpeg_every`-th image is a JPEG (lossy: pixel
      values are only approximately preserved), the others PNG.

  Returns:
    `root`. Image k of class c in split s is constant-valued with pixel value
    `folder_pixel_value(s, c, k, per_class[s])` (< 256).
  """
  if isinstance(size, int):
    size = (size, size)
  if isinstance(per_class, int):
    per_class = {'train': per_class, 'test': per_class}
  for split, count in per_class.items():
    if FOLDER_SPLIT_OFFSET[split] + num_classes * count > 256:
      raise ValueError('Too many images to encode ids in pixel values.')
    for c in range(num_classes):
      d = os.path.join(root, split, f'class_{c}')
      os.makedirs(d, exist_ok=True)
      for k in range(count):
        v = folder_pixel_value(split, c, k, count)
        img = tf.fill([size[0], size[1], channels], tf.constant(v, tf.uint8))
        if jpeg_every and k % jpeg_every == jpeg_every - 1:
          path, enc = os.path.join(d, f'img_{k}.jpg'), tf.io.encode_jpeg(
              img, quality=100)
        else:
          path, enc = os.path.join(d, f'img_{k}.png'), tf.io.encode_png(img)
        with open(path, 'wb') as f:
          f.write(enc.numpy())
  return root


# ------------------------------------------------------- multi-label builder

MULTILABEL_NUM_CLASSES = 5
#: Id of the first test example (96 % 32 == 0: it has no label).
MULTILABEL_TEST_START = 96

_GEN_PARAMS = {'train': 12, 'test': 10, 'size': 8}


def multilabel_labels(i: int) -> List[int]:
  """Labels of example i: the set bits of i (mod 32); i % 32 == 0 -> none."""
  return [j for j in range(MULTILABEL_NUM_CLASSES) if (i >> j) & 1]


class TinyMultiLabel(tfds.core.GeneratorBasedBuilder):
  """Tiny generated multi-label dataset (registered as `tiny_multi_label`)."""

  VERSION = tfds.core.Version('1.0.0')
  VIT_JAX_OFFLINE = True  # vit_jax may prepare it (no downloads).

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            # Static size: vit_jax resizes / flips such images per batch.
            'image': tfds.features.Image(
                shape=(_GEN_PARAMS['size'], _GEN_PARAMS['size'], 3)),
            'labels': tfds.features.Sequence(
                tfds.features.ClassLabel(num_classes=MULTILABEL_NUM_CLASSES)),
            # Same values, under the ImageNet ReaL feature name.
            'real_label': tfds.features.Sequence(
                tfds.features.ClassLabel(num_classes=MULTILABEL_NUM_CLASSES)),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples(0, _GEN_PARAMS['train']),
            'test': self._generate_examples(MULTILABEL_TEST_START,
                                            _GEN_PARAMS['test'])}

  def _generate_examples(self, start, count):
    s = _GEN_PARAMS['size']
    for i in range(start, start + count):
      yield i, {'image': np.full((s, s, 3), i, np.uint8),
                'labels': multilabel_labels(i),
                'real_label': multilabel_labels(i)}


def make_multilabel_dataset(data_dir: str, num_train: int = 12,
                            num_test: int = 10, size: int = 8,
                            file_format: str = 'tfrecord', num_shards: Optional[int] = None
                            ) -> str:
  """Prepares `tiny_multi_label` into `data_dir`.

  Use as `config.data.name='tiny_multi_label', data_dir=data_dir`, or pass the
  returned path as `config.data.name` (read with builder_from_directory).

  Train example i (0 <= i < num_train) and test example 96 + i
  (0 <= i < num_test) have pixel value = their id and labels (features
  'labels' and 'real_label', identical) `multilabel_labels(id)`; test example
  96 has no label.

  The image size is part of the features: use one `size` per test session
  when loading by name (loading by path always works). `file_format`:
  'tfrecord' or 'array_record'; `num_shards`: files per split (default: tfds's, 1 here).

  Returns:
    The prepared dataset directory (holding dataset_info.json).
  """
  if MULTILABEL_TEST_START + num_test > 256 or num_train > 96:
    raise ValueError('num_train <= 96 and num_test <= 160.')
  _GEN_PARAMS.update(train=num_train, test=num_test, size=size)
  builder = TinyMultiLabel(data_dir=data_dir, file_format=file_format)
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False, num_shards=num_shards))
  return os.fspath(builder.data_dir)


# ------------------------------------------------------------- fake IDX files

IDX_SPLIT_OFFSET = {'train': 0, 'test': 200}


def idx_pixel_value(split: str, i: int) -> int:
  return (IDX_SPLIT_OFFSET[split] + i) % 256


def write_idx(path: str, array: np.ndarray, magic: Optional[int] = None,
              count: Optional[int] = None) -> None:
  """Writes a uint8 array as a gzip IDX file (optionally with a wrong header)."""
  array = np.asarray(array, np.uint8)
  if magic is None:
    magic = 0x0800 | array.ndim
  dims = list(array.shape)
  if count is not None:
    dims[0] = count
  header = struct.pack('>i', magic) + struct.pack(f'>{len(dims)}i', *dims)
  with gzip.open(path, 'wb') as f:
    f.write(header + array.tobytes())


def make_fake_idx(directory: str, num_train: int = 20,
                  num_test: int = 10, marker: bool = False) -> str:
  """Writes Fashion-MNIST-format IDX files with tiny splits into `directory`.

  Example i of a split: 28x28 image of value `idx_pixel_value(split, i)`,
  label i % 10. With `marker`, its left 7 columns are 255 instead (to see
  flips; `pixel_ids` still recovers the id, ids must then be < 255).

  Returns:
    `directory` (use as `config.data.manual_dir`).
  """
  os.makedirs(directory, exist_ok=True)
  for split, prefix, n in (('train', 'train', num_train),
                           ('test', 't10k', num_test)):
    images = np.zeros((n, 28, 28), np.uint8)
    for i in range(n):
      images[i] = idx_pixel_value(split, i)
      if marker:
        images[i, :, :7] = 255
    labels = np.arange(n) % 10
    write_idx(os.path.join(directory, f'{prefix}-images-idx3-ubyte.gz'),
              images)
    write_idx(os.path.join(directory, f'{prefix}-labels-idx1-ubyte.gz'),
              labels)
  return directory


def pixel_ids(images: np.ndarray, normalization: str = 'minus_one_to_one'
              ) -> np.ndarray:
  """Recovers integer pixel values (example ids) from normalized batches.

  Args:
    images: float32 [b, S, S, 3] constant images.
    normalization: the config's normalization.

  Returns:
    int [b]: rounded pixel value of each image (median over its pixels, so
    a marker on < 50% of the image does not matter).
  """
  x = np.median(images.reshape(images.shape[0], -1, 3), axis=1)
  if normalization == 'minus_one_to_one':
    x = (x + 1.) * 127.5
  else:
    x = (x * np.array([0.229, 0.224, 0.225]) +
         np.array([0.485, 0.456, 0.406])) * 255.
  return np.rint(x.mean(axis=1)).astype(np.int64)


__all__: Sequence[str] = [
    'make_image_folder', 'make_multilabel_dataset', 'make_fake_idx',
    'write_idx', 'pixel_ids', 'folder_pixel_value', 'multilabel_labels',
    'idx_pixel_value', 'MULTILABEL_NUM_CLASSES', 'MULTILABEL_TEST_START',
    'TinyMultiLabel',
]


def folder_run_config(model_name: str, folder: str, image_size: int, *,
                      total_steps: int = 2, batch_size: int = 4, **model_fields):
  """A short 'finetune'-regime run on an image folder: no augmentation, no warmup."""
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.get_config(model_name, 'unused', **model_fields)
  config.regime = 'finetune'
  config.data.update(image_folder=folder, image_size=image_size, augment='none')
  config.batch_size = batch_size
  config.total_steps = total_steps
  config.optim.warmup_steps = 0
  return config


def skip_cpu_peak_measurement(monkeypatch) -> None:
  """Makes `vit_jax.accounting.measure_cpu_peak` return 1e11 FLOP/s without measuring.

  The measurement (about a second of 2048^3 matmuls, once per process) starts every
  `train_and_evaluate` that is the first of its process; a test of a config that is refused
  before any work (and so reports no cost) need not pay it.
  """
  from vit_jax import accounting  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(accounting, 'measure_cpu_peak', lambda *args, **kwargs: 1e11)


def override(config, overrides: dict):
  """Sets {'section.key': value} in `config` in place, as `--config.section.key=value` would.

  Returns `config`. A key the config does not have raises (KeyError/AttributeError from
  ml_collections) unless the config is unlocked.
  """
  for key, value in overrides.items():
    section, _, name = key.rpartition(".")
    (config[section] if section else config)[name] = value
  return config


def main_flags(overrides: dict) -> list:
  """`overrides` as the `--config.<key>=<value>` flags of `python -m vit_jax.main`."""
  return [f"--config.{key}={value}" for key, value in overrides.items()]


def tiny_step_setup(model_fields: dict, changes: dict):
  """`vit_jax.step.build` of a ViT-custom with `model_fields` fine-tuned with SGD (no warmup,
  batch 4 of 8x8 px images, 3 classes, 10 steps, XLA attention, one CPU device), `changes`
  ({'section.key': value}) applied to the config first."""
  import jax  # pylint: disable=g-import-not-at-top
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from vit_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.get_config("ViT-custom", "fashion_mnist_local", attention="xla",
                                 **model_fields)
  config.regime = "finetune"
  config.update(batch_size=4, total_steps=10)
  config.optim.warmup_steps = 0
  config.data.image_size = 8
  override(config, changes)
  resolved = config_lib.resolve(config, num_train_examples=16, num_classes=3,
                                devices=jax.devices()[:1])
  return step_lib.build(resolved, image_shape=(8, 8, 3), devices=jax.devices()[:1])
