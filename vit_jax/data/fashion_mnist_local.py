"""``fashion_mnist_local``: an offline tfds builder of Fashion-MNIST from the four IDX files in
``manual_dir`` (default the Debian ``dataset-fashion-mnist`` path), the features and splits of
tfds's ``fashion_mnist``. Importing ``vit_jax.data`` registers it."""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from typing import Dict, Iterator, Optional, Tuple

from absl import logging
import numpy as np
import tensorflow_datasets as tfds

#: Where the Debian package `dataset-fashion-mnist` installs the IDX files.
DEBIAN_DIR = '/usr/share/datasets/fashion-mnist'

#: Class names, in label order (identical to tfds `fashion_mnist`).
LABEL_NAMES = ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt',
               'Sneaker', 'Bag', 'Ankle boot')

IMAGE_SHAPE = (28, 28, 1)

#: split name -> (images file, labels file, expected number of examples).
SPLIT_FILES: Dict[str, Tuple[str, str, int]] = {
    'train': ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz', 60000),
    'test': ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz', 10000),
}

# IDX magic numbers: 0x00 0x00 <dtype 0x08 = uint8> <number of dimensions>.
_IMAGES_MAGIC = 0x00000803
_LABELS_MAGIC = 0x00000801

_IDX_FILES = tuple(f for v in SPLIT_FILES.values() for f in v[:2])

MISSING_FILES_HINT = (
    'Install the Debian package `dataset-fashion-mnist` (`apt-get install dataset-fashion-mnist`, '
    f'which puts the IDX files in {DEBIAN_DIR}) or set `config.data.manual_dir` to a directory '
    'containing ' + ', '.join(_IDX_FILES) + '.')


class IdxFormatError(ValueError):
  """An IDX file is malformed (bad magic number, header or size)."""


def read_idx(path: str, expected_magic: int, expected_count: Optional[int] = None) -> np.ndarray:
  """A (gzipped) uint8 IDX file (yann.lecun.com/exdb/mnist; magic ``0x803`` images, ``0x801``
  labels) as an array of its declared shape. FileNotFoundError; IdxFormatError: malformed."""
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rb') as f:
    data = f.read()
  if len(data) < 4:
    raise IdxFormatError(f'{path}: file too short ({len(data)} bytes) for an IDX header.')
  (magic,) = struct.unpack('>i', data[:4])
  if magic != expected_magic:
    kind = 'images' if expected_magic == _IMAGES_MAGIC else 'labels'
    raise IdxFormatError(
        f'{path}: bad IDX magic number 0x{magic:08x}, expected '
        f'0x{expected_magic:08x} ({kind}).')
  ndim = magic & 0xFF
  header_len = 4 + 4 * ndim
  if len(data) < header_len:
    raise IdxFormatError(f'{path}: truncated IDX header.')
  dims = struct.unpack(f'>{ndim}i', data[4:header_len])
  size = int(np.prod(dims))
  if len(data) - header_len != size:
    raise IdxFormatError(f'{path}: header declares shape {dims} ({size} bytes of data) but the '
                         f'file holds {len(data) - header_len} bytes of data.')
  if expected_count is not None and dims[0] != expected_count:
    raise IdxFormatError(f'{path}: holds {dims[0]} examples, expected {expected_count}.')
  return np.frombuffer(data, dtype=np.uint8, offset=header_len).reshape(dims)


def encode_png_gray(image: np.ndarray) -> bytes:
  """Encodes a [H, W] or [H, W, 1] uint8 array as an 8-bit grayscale PNG."""
  image = np.asarray(image, dtype=np.uint8)
  image = image.reshape(image.shape[:2])
  h, w = image.shape
  raw = np.pad(image, ((0, 0), (1, 0)))  # Filter byte 0 (None) on every row.

  def chunk(tag: bytes, payload: bytes) -> bytes:
    return (struct.pack('>I', len(payload)) + tag + payload +
            struct.pack('>I', zlib.crc32(tag + payload) & 0xFFFFFFFF))

  ihdr = struct.pack('>IIBBBBB', w, h, 8, 0, 0, 0, 0)
  return (b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', ihdr) +
          chunk(b'IDAT', zlib.compress(raw.tobytes(), 6)) + chunk(b'IEND', b''))


def load_split(directory: str, split: str) -> Tuple[np.ndarray, np.ndarray]:
  """``(images uint8 [N, 28, 28], labels uint8 [N])`` of 'train' or 'test' (other counts with a
  warning). FileNotFoundError (saying how to get the files); IdxFormatError: malformed."""
  images_file, labels_file, count = SPLIT_FILES[split]
  paths = [os.path.join(directory, images_file), os.path.join(directory, labels_file)]
  missing = [p for p in paths if not os.path.exists(p)]
  if missing:
    raise FileNotFoundError(f'Fashion-MNIST IDX file(s) not found: {", ".join(missing)}. '
                            + MISSING_FILES_HINT)
  images = read_idx(paths[0], _IMAGES_MAGIC)
  labels = read_idx(paths[1], _LABELS_MAGIC, expected_count=images.shape[0])
  if images.shape[0] != count:
    logging.warning('%s holds %d examples; the Fashion-MNIST %s split has %d.',
                    paths[0], images.shape[0], split, count)
  if images.shape[1:] != IMAGE_SHAPE[:2]:
    raise IdxFormatError(f'{paths[0]}: images have shape {images.shape[1:]}, '
                         f'expected {IMAGE_SHAPE[:2]}.')
  if labels.size and labels.max() >= len(LABEL_NAMES):
    raise IdxFormatError(f'{paths[1]}: label {labels.max()} out of range [0, {len(LABEL_NAMES)}).')
  return images, labels


class FashionMnistLocal(tfds.core.GeneratorBasedBuilder):
  """Fashion-MNIST from local IDX files (no network). Same features as `fashion_mnist`."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Offline builder reading the original IDX files.'}
  MANUAL_DOWNLOAD_INSTRUCTIONS = MISSING_FILES_HINT
  #: vit_jax marker: this builder prepares from local files only.
  VIT_JAX_OFFLINE = True

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description=(
            "Fashion-MNIST (Zalando's article images): 60,000 train and 10,000 "
            'test 28x28 grayscale images in 10 classes, read from local IDX files.'),
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=IMAGE_SHAPE),
            'label': tfds.features.ClassLabel(names=list(LABEL_NAMES)),
        }),
        supervised_keys=('image', 'label'),
        homepage='https://github.com/zalandoresearch/fashion-mnist',
    )

  def download_and_prepare(self, *, download_dir=None, download_config=None, **kwargs):
    # Without an explicit manual_dir: tfds's default if it has the files, else the Debian path.
    self._explicit_manual_dir = (os.fspath(download_config.manual_dir) if download_config is not
                                 None and download_config.manual_dir else None)
    return super().download_and_prepare(
        download_dir=download_dir, download_config=download_config, **kwargs)

  def _source_dir(self) -> str:
    explicit = getattr(self, '_explicit_manual_dir', None)
    if explicit:
      return os.path.expanduser(explicit)
    default_manual = os.path.join(os.fspath(self.data_dir_root), 'downloads', 'manual')
    if all(os.path.exists(os.path.join(default_manual, f)) for f in _IDX_FILES):
      return default_manual
    return DEBIAN_DIR

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    directory = self._source_dir()
    # Load (and validate) everything before writing anything.
    data = {split: load_split(directory, split) for split in SPLIT_FILES}
    return {split: self._generate_examples(*arrays) for split, arrays in data.items()}

  def _generate_examples(self, images: np.ndarray,
                         labels: np.ndarray) -> Iterator[Tuple[int, dict]]:
    for i in range(len(labels)):
      yield i, {'image': encode_png_gray(images[i]), 'label': int(labels[i])}
