"""Tests of the vit_jax input pipeline (vit_jax.data). Fast, CPU only."""

import collections
import logging
import os

import ml_collections
import numpy as np
from PIL import Image
import pytest

from vit_jax import data
from vit_jax import config as config_lib
from vit_jax.data import fashion_mnist_local as fml
from vit_jax.data import memory as memory_lib
from vit_jax.data import pipeline
from vit_jax.data import sources
from vit_jax.tools import to_array_record
from tests import data_utils
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-order

S = 4  # Tiny image side: images are constant, so any size works.


def _cfg(**overrides):
  cfg = config_lib.defaults.data_config()
  cfg.image_size = S
  cfg.shuffle_buffer = 64
  for k, v in overrides.items():
    setattr(cfg, k, v)
  return cfg


def _take(it, n):
  return [next(it) for _ in range(n)]


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  """3 classes; train 4 per class (12), test 5 per class (15); RGB PNGs."""
  return data_utils.make_image_folder(
      str(tmp_path_factory.mktemp('folder')), num_classes=3,
      per_class={'train': 4, 'test': 5}, size=(8, 6))


@pytest.fixture(scope='module')
def folder10(tmp_path_factory):
  """2 classes x 5 test images = 10 eval examples; JPEG for every 3rd file."""
  return data_utils.make_image_folder(
      str(tmp_path_factory.mktemp('folder10')), num_classes=2,
      per_class={'train': 2, 'test': 5}, size=5, jpeg_every=3)


@pytest.fixture(scope='module')
def multilabel(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp('tfds_ml'))
  path = data_utils.make_multilabel_dataset(data_dir, num_train=12,
                                            num_test=10)
  return data_dir, path


@pytest.fixture(scope='module')
def fake_fmnist(tmp_path_factory):
  manual = data_utils.make_fake_idx(str(tmp_path_factory.mktemp('idx')),
                                    num_train=20, num_test=10)
  data_dir = str(tmp_path_factory.mktemp('tfds_fm'))
  return _cfg(name='fashion_mnist_local', data_dir=data_dir,
              manual_dir=manual, augment='none')


# ---------------------------------------------------------------- config/info


def test_default_config():
  cfg = config_lib.defaults.data_config()
  for field in ('name', 'image_folder', 'data_dir', 'manual_dir', 'prepare',
                'train_split', 'eval_split', 'image_size', 'augment',
                'inception_crop_min_area', 'normalization', 'shuffle_buffer',
                'prefetch', 'cache', 'num_parallel_calls', 'label_key'):
    assert field in cfg, field
  assert cfg.image_folder is None and cfg.label_key is None
  assert cfg.augment == 'inception_crop' and cfg.inception_crop_min_area == 0.05
  assert cfg.normalization == 'minus_one_to_one' and cfg.num_parallel_calls == -1
  cfg.image_folder = '/x'  # Placeholders accept strings.
  cfg.label_key = 'labels'


def test_info_image_folder(folder):
  info = data.get_info(_cfg(image_folder=folder))
  assert info == data.DatasetInfo(num_classes=3, multi_label=False,
                                  num_train_examples=12, num_eval_examples=15,
                                  image_shape=(S, S, 3),
                                  label_names=('class_0', 'class_1', 'class_2'))


def test_invalid_config_errors(folder):
  with pytest.raises(ValueError, match='augment'):
    data.get_info(_cfg(image_folder=folder, augment='mixup'))
  with pytest.raises(ValueError, match='normalization'):
    data.get_info(_cfg(image_folder=folder, normalization='zero_one'))
  with pytest.raises(ValueError, match='train_split'):
    data.get_info(_cfg(image_folder=folder, train_split='validation'))


def test_batch_not_divisible_by_process_count(folder):
  with pytest.raises(ValueError, match='multiple of the number of JAX proc'):
    data.create_train_iterator(_cfg(image_folder=folder), 6, seed=0,
                               process_index=0, process_count=4)
  with pytest.raises(ValueError, match='multiple of the number of JAX proc'):
    data.create_eval_dataset(_cfg(image_folder=folder), 5, process_index=1,
                             process_count=2)


def test_not_prepared_online_dataset_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match='never downloads'):
    data.get_info(_cfg(name='mnist', data_dir=str(tmp_path)))


# ----------------------------------------------------------------------- eval


def test_eval_10_examples_batch_4(folder10):
  cfg = _cfg(image_folder=folder10)
  ds = data.create_eval_dataset(cfg, global_batch_size=4, process_index=0,
                                process_count=1)
  assert len(ds) == 3
  for _ in range(2):  # Re-iterable, same order.
    batches = list(ds)
    assert len(batches) == 3
    ids, masks = [], []
    for b in batches:
      assert b['image'].shape == (4, S, S, 3) and b['image'].dtype == np.float32
      assert b['labels'].shape == (4, 2) and b['labels'].dtype == np.float32
      assert b['mask'].shape == (4,) and b['mask'].dtype == bool
      ids.append(data_utils.pixel_ids(b['image']))
      masks.append(b['mask'])
      # Labels match the class folder of each image: ids 128 + 5 c + k.
      got = ids[-1][b['mask']]
      np.testing.assert_array_equal(b['labels'][b['mask']].argmax(1),
                                    (got - 128) // 5)
      np.testing.assert_array_equal(b['image'][~b['mask']], 0.)
      np.testing.assert_array_equal(b['labels'][~b['mask']], 0.)
    ids, masks = np.concatenate(ids), np.concatenate(masks)
    assert masks.sum() == 10 and not masks[10:].any()
    # Each example exactly once (JPEGs are lossy at +-2 only).
    np.testing.assert_allclose(np.sort(ids[masks]), np.arange(128, 138),
                               atol=2)
    assert len(set(np.rint(ids[masks]))) == 10
    if _ == 0:
      first = ids
    else:
      np.testing.assert_array_equal(first, ids)


@pytest.mark.parametrize('process_count,global_batch', [(2, 4), (3, 6)])
def test_eval_multi_process_no_drop_same_num_batches(folder, process_count,
                                                     global_batch):
  cfg = _cfg(image_folder=folder)  # 15 eval examples, ids 128..142.
  all_ids, lengths = [], []
  for pi in range(process_count):
    ds = data.create_eval_dataset(cfg, global_batch, process_index=pi,
                                  process_count=process_count)
    batches = list(ds)
    lengths.append(len(batches))
    assert len(batches) == len(ds)
    for b in batches:
      assert b['image'].shape[0] == global_batch // process_count
      all_ids += list(data_utils.pixel_ids(b['image'])[b['mask']])
  assert len(set(lengths)) == 1, lengths
  assert sorted(all_ids) == list(range(128, 143))


def test_eval_more_processes_than_examples(multilabel):
  data_dir, _ = multilabel  # 10 eval examples over 12 processes.
  cfg = _cfg(name='tiny_multi_label', data_dir=data_dir)
  ids = []
  for pi in range(12):
    ds = data.create_eval_dataset(cfg, 24, process_index=pi, process_count=12)
    batches = list(ds)
    assert len(ds) == len(batches) == 1
    assert batches[0]['mask'].sum() == (1 if pi < 10 else 0)
    ids += list(data_utils.pixel_ids(batches[0]['image'])[batches[0]['mask']])
  start = data_utils.MULTILABEL_TEST_START
  assert sorted(ids) == list(range(start, start + 10))


def test_eval_empty_split_yields_one_masked_batch(folder, multilabel):
  data_dir, _ = multilabel
  for cfg in (_cfg(image_folder=folder, eval_split='train[99%:]'),
              _cfg(name='tiny_multi_label', data_dir=data_dir,
                   eval_split='test[99%:]')):
    ds = data.create_eval_dataset(cfg, 4, process_index=0, process_count=1)
    batches = list(ds)
    assert len(ds) == len(batches) == 1 and not batches[0]['mask'].any()
    assert batches[0]['image'].shape == (4, S, S, 3)


# ---------------------------------------------------------------------- train


@pytest.mark.parametrize('normalization,lo,hi', [
    ('minus_one_to_one', -1., 1.),
    ('imagenet', -0.485 / 0.229, (1 - 0.406) / 0.225),
])
@pytest.mark.parametrize('augment', ['inception_crop', 'flip', 'none'])
def test_train_batches(folder, normalization, lo, hi, augment):
  cfg = _cfg(image_folder=folder, normalization=normalization, augment=augment)
  it = data.create_train_iterator(cfg, global_batch_size=4, seed=0,
                                  process_index=0, process_count=1)
  for b in _take(it, 4):  # > 1 epoch of 12 examples.
    assert set(b) == {'image', 'labels'}
    assert b['image'].shape == (4, S, S, 3) and b['image'].dtype == np.float32
    assert b['labels'].shape == (4, 3) and b['labels'].dtype == np.float32
    assert lo - 1e-5 <= b['image'].min() and b['image'].max() <= hi + 1e-5
    np.testing.assert_array_equal(b['labels'].sum(1), 1.)
    # Train ids are 4 c + k: label = id // 4.
    ids = data_utils.pixel_ids(b['image'], normalization)
    np.testing.assert_array_equal(b['labels'].argmax(1), ids // 4)


def test_train_epoch_is_permutation(folder):
  it = data.create_train_iterator(_cfg(image_folder=folder, augment='none'),
                                  4, seed=3, process_index=0, process_count=1)
  ids = np.concatenate([data_utils.pixel_ids(b['image'])
                        for b in _take(it, 6)])
  assert sorted(ids[:12]) == list(range(12))
  assert sorted(ids[12:]) == list(range(12))
  assert list(ids[:12]) != list(ids[12:])  # Reshuffled each epoch.


def test_train_process_sharding(folder):
  cfg = _cfg(image_folder=folder, augment='none')
  seen = []
  for pi in range(2):
    it = data.create_train_iterator(cfg, 4, seed=0, process_index=pi,
                                    process_count=2)
    assert it.local_batch_size == 2 and it.examples_per_epoch == 6
    seen.append(set(np.concatenate(
        [data_utils.pixel_ids(b['image']) for b in _take(it, 3)])))
  assert seen[0] | seen[1] == set(range(12)) and not seen[0] & seen[1]


@pytest.mark.parametrize('cache', [False, True])
def test_train_deterministic_and_resumable(folder, cache):
  cfg = _cfg(image_folder=folder, augment='inception_crop', cache=cache)
  def batches(seed, start_step=0, n=5):
    it = data.create_train_iterator(cfg, 4, seed=seed, start_step=start_step,
                                    process_index=0, process_count=1)
    return _take(it, n)
  a, b, c = batches(0), batches(0), batches(1)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x['image'], y['image'])
    np.testing.assert_array_equal(x['labels'], y['labels'])
  assert any(not np.array_equal(x['labels'], y['labels']) for x, y in zip(a, c))
  # Resuming at step 2 (offset 8 in epoch 0) and at step 4 (epoch 1) gives
  # exactly the batches of the uninterrupted run, augmentations included.
  for start in (2, 4):
    for x, y in zip(a[start:], batches(0, start_step=start, n=5 - start)):
      np.testing.assert_array_equal(x['image'], y['image'])
      np.testing.assert_array_equal(x['labels'], y['labels'])


def test_train_split_slicing(folder, multilabel):
  cfg = _cfg(image_folder=folder, augment='none', train_split='train[:50%]')
  assert data.get_info(cfg).num_train_examples == 6
  it = data.create_train_iterator(cfg, 3, seed=0, process_index=0,
                                  process_count=1)
  ids = np.concatenate([data_utils.pixel_ids(b['image']) for b in _take(it, 4)])
  assert len(set(ids)) == 6 and sorted(ids[:6]) == sorted(ids[6:])
  data_dir, _ = multilabel
  cfg = _cfg(name='tiny_multi_label', data_dir=data_dir, augment='none',
             train_split='train[:50%]')
  assert data.get_info(cfg).num_train_examples == 6
  it = data.create_train_iterator(cfg, 3, seed=0, process_index=0,
                                  process_count=1)
  ids = np.concatenate([data_utils.pixel_ids(b['image']) for b in _take(it, 2)])
  assert sorted(ids) == sorted(set(ids)) and len(ids) == 6


def test_grayscale_becomes_rgb(tmp_path):
  root = data_utils.make_image_folder(str(tmp_path / 'gray'), num_classes=2,
                                      per_class=3, size=7, channels=1)
  cfg = _cfg(image_folder=root)
  b = next(data.create_train_iterator(cfg, 2, seed=0, process_index=0,
                                      process_count=1))
  assert b['image'].shape == (2, S, S, 3)
  np.testing.assert_array_equal(b['image'][..., 0], b['image'][..., 2])
  b = next(iter(data.create_eval_dataset(cfg, 2, process_index=0,
                                         process_count=1)))
  assert b['image'].shape == (2, S, S, 3)


# ---------------------------------------------------------------- multi-label


@pytest.mark.parametrize('by_path,augment', [(False, 'flip'),
                                             (True, 'inception_crop')])
def test_multilabel_targets(multilabel, by_path, augment):
  data_dir, path = multilabel
  cfg = (_cfg(name=path) if by_path else
         _cfg(name='tiny_multi_label', data_dir=data_dir))
  cfg.augment = augment
  info = data.get_info(cfg)
  assert info.multi_label and info.num_classes == 5
  assert (info.num_train_examples, info.num_eval_examples) == (12, 10)

  def expected(ids):
    out = np.zeros((len(ids), 5), np.float32)
    for row, i in enumerate(ids):
      out[row, data_utils.multilabel_labels(int(i))] = 1.
    return out

  for b in _take(data.create_train_iterator(cfg, 4, seed=0, process_index=0,
                                            process_count=1), 3):
    np.testing.assert_array_equal(
        b['labels'], expected(data_utils.pixel_ids(b['image'])))
  ids = []
  for b in data.create_eval_dataset(cfg, 4, process_index=0, process_count=1):
    m = b['mask']
    got = data_utils.pixel_ids(b['image'])[m]
    ids += list(got)
    np.testing.assert_array_equal(b['labels'][m], expected(got))
  start = data_utils.MULTILABEL_TEST_START
  assert sorted(ids) == list(range(start, start + 10))  # Incl. unlabeled 96.


def test_real_label_masks_unlabeled_eval(multilabel):
  data_dir, _ = multilabel
  cfg = _cfg(name='tiny_multi_label', data_dir=data_dir, label_key='real_label')
  ids = []
  for b in data.create_eval_dataset(cfg, 4, process_index=0, process_count=1):
    ids += list(data_utils.pixel_ids(b['image'])[b['mask']])
  start = data_utils.MULTILABEL_TEST_START  # Example `start` has no label.
  assert sorted(ids) == list(range(start + 1, start + 10))


# ------------------------------------------------------------ Fashion-MNIST


def test_fashion_mnist_local_from_fake_idx(fake_fmnist):
  info = data.get_info(fake_fmnist)
  assert info == data.DatasetInfo(10, False, 20, 10, (S, S, 3),
                                  label_names=tuple(fml.LABEL_NAMES))
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds.builder('fashion_mnist_local', data_dir=fake_fmnist.data_dir)
  assert builder.info.features['image'].shape == (28, 28, 1)
  assert builder.info.features['label'].names == list(fml.LABEL_NAMES)
  ids, labels = [], []
  for b in data.create_eval_dataset(fake_fmnist, 4, process_index=0,
                                    process_count=1):
    assert b['image'].shape == (4, S, S, 3)
    ids += list(data_utils.pixel_ids(b['image'])[b['mask']])
    labels += list(b['labels'][b['mask']].argmax(1))
  assert sorted(ids) == [data_utils.idx_pixel_value('test', i)
                         for i in range(10)]
  for i, label in zip(ids, labels):
    assert label == (i - data_utils.IDX_SPLIT_OFFSET['test']) % 10
  cfg = fake_fmnist.copy_and_resolve_references()
  cfg.cache = True
  b = next(data.create_train_iterator(cfg, 20, seed=0, process_index=0,
                                      process_count=1))
  assert sorted(data_utils.pixel_ids(b['image'])) == list(range(20))
  np.testing.assert_array_equal(b['labels'].argmax(1),
                                data_utils.pixel_ids(b['image']) % 10)


@pytest.fixture(scope='module')
def fake_fmnist_marker(tmp_path_factory):
  """fashion_mnist_local of 20 + 4 marked IDX images, prepared once for the module."""
  manual = data_utils.make_fake_idx(str(tmp_path_factory.mktemp('idxm')),
                                    num_train=20, num_test=4, marker=True)
  cfg = _cfg(name='fashion_mnist_local', manual_dir=manual, image_size=28,
             data_dir=str(tmp_path_factory.mktemp('tfds_fm_marker')))
  data.get_info(cfg)  # Prepares it.
  return cfg


@pytest.mark.parametrize('cache', [False, True])
def test_vectorized_flip_deterministic_and_resumable(fake_fmnist_marker, cache):
  # Static-size images (fashion_mnist_local) take the batched resize/flip path.
  cfg = fake_fmnist_marker.copy_and_resolve_references()
  cfg.augment, cfg.cache = 'flip', cache
  def batches(seed, start_step=0, n=4):
    it = data.create_train_iterator(cfg, 10, seed=seed, start_step=start_step,
                                    process_index=0, process_count=1)
    return _take(it, n)
  a = batches(0)
  flipped = []
  for x in a:
    raw = (x['image'] + 1.) * 127.5
    left = np.all(np.isclose(raw[:, :, :7], 255.), axis=(1, 2, 3))
    right = np.all(np.isclose(raw[:, :, -7:], 255.), axis=(1, 2, 3))
    assert np.all(left ^ right)  # Marker on exactly one side.
    flipped += list(right)
    np.testing.assert_array_equal(x['labels'].argmax(1),
                                  data_utils.pixel_ids(x['image']) % 10)
  assert 0 < sum(flipped) < len(flipped)
  ids = np.concatenate([data_utils.pixel_ids(x['image']) for x in a])
  assert sorted(ids[:20]) == sorted(ids[20:]) == list(range(20))
  for start in (0, 1, 3):
    for x, y in zip(a[start:], batches(0, start_step=start, n=4 - start)):
      np.testing.assert_array_equal(x['image'], y['image'])
  c = batches(1)
  assert any(not np.array_equal(x['image'], y['image']) for x, y in zip(a, c))


def test_pad_crop_translates_each_image_by_its_own_offset():
  """Each image moves by (dy, dx) in [-P, P]^2 with zeros shifted in; the batch and the
  per-example paths draw the same kind of shifts; the seed decides them."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from vit_jax.data import preprocess  # pylint: disable=g-import-not-at-top
  images = np.random.RandomState(0).randint(1, 256, (64, 12, 10, 1)).astype(np.uint8)
  out = preprocess.pad_crop(tf.constant(images), tf.constant([3, 4], tf.int64), 2).numpy()
  assert out.shape == images.shape and out.dtype == np.uint8
  shifts = []
  for image, moved in zip(images, out):
    padded = np.pad(image, ((2, 2), (2, 2), (0, 0)))
    (found,) = [(dy, dx) for dy in range(5) for dx in range(5)
                if np.array_equal(padded[dy:dy + 12, dx:dx + 10], moved)]
    shifts.append(found)
  assert len(set(shifts)) > 15  # Independent offsets, all 25 possible in 64 draws.
  assert {dy for dy, _ in shifts} == {dx for _, dx in shifts} == set(range(5))
  again = preprocess.pad_crop(tf.constant(images), tf.constant([3, 4], tf.int64), 2).numpy()
  other = preprocess.pad_crop(tf.constant(images), tf.constant([3, 5], tf.int64), 2).numpy()
  assert np.array_equal(out, again) and not np.array_equal(out, other)
  one = preprocess.train_image(tf.constant(images[0]), encoded=False, seed=tf.constant(
      [1, 2], tf.int64), size=12, augment='pad_crop', min_area=0.05, normalization=None,
                               pad_pixels=2)
  assert one.shape == (12, 12, 3)


def test_inception_crop_window():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from vit_jax.data import preprocess  # pylint: disable=g-import-not-at-top
  img = tf.constant(np.random.RandomState(0).randint(0, 256, (60, 80, 3)),
                    tf.uint8)
  jpeg = tf.io.encode_jpeg(img)
  for i in range(20):
    seed = tf.constant([7, i], tf.int64)
    crop = preprocess.inception_crop(img, False, seed, 0.05)
    fused = preprocess.inception_crop(jpeg, True, seed, 0.05)
    assert crop.shape == fused.shape  # Same window, fused JPEG decoding.
    h, w, c = crop.shape
    assert c == 3 and 0.05 * 60 * 80 * 0.9 <= h * w <= 60 * 80
    if (h, w) != (60, 80):  # Whole image is the fallback.
      assert 3 / 4 * 0.8 <= w / h <= 4 / 3 * 1.25
    assert preprocess.train_image(
        jpeg, encoded=True, seed=seed, size=S, augment='inception_crop',
        min_area=0.05, normalization='minus_one_to_one').shape == (S, S, 3)


def test_fashion_mnist_missing_files_message(tmp_path):
  cfg = _cfg(name='fashion_mnist_local', data_dir=str(tmp_path / 'tfds'),
             manual_dir=str(tmp_path / 'empty'))
  os.makedirs(cfg.manual_dir)
  with pytest.raises(FileNotFoundError) as e:
    data.get_info(cfg)
  assert 'dataset-fashion-mnist' in str(e.value)
  assert 'apt-get install dataset-fashion-mnist' in str(e.value)
  assert 'manual_dir' in str(e.value)


def test_idx_validation(tmp_path):
  images = np.zeros((3, 28, 28), np.uint8)
  p = str(tmp_path / 'images.gz')
  data_utils.write_idx(p, images, magic=0x0801)
  with pytest.raises(fml.IdxFormatError, match='magic'):
    fml.read_idx(p, 0x0803)
  data_utils.write_idx(p, images, count=4)  # Header says 4, data holds 3.
  with pytest.raises(fml.IdxFormatError, match='declares shape'):
    fml.read_idx(p, 0x0803)
  data_utils.write_idx(p, images)
  assert fml.read_idx(p, 0x0803).shape == (3, 28, 28)
  with pytest.raises(fml.IdxFormatError, match='expected 5'):
    fml.read_idx(p, 0x0803, expected_count=5)


def test_png_encoder_roundtrip():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  img = np.random.RandomState(0).randint(0, 256, (28, 28, 1), np.uint8)
  decoded = tf.io.decode_png(fml.encode_png_gray(img)).numpy()
  np.testing.assert_array_equal(decoded, img)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists(os.path.join(fml.DEBIAN_DIR,
                                    'train-images-idx3-ubyte.gz')),
    reason='Debian package dataset-fashion-mnist not installed')
def test_fashion_mnist_real_debian_files(tmp_path, fashion_mnist_dir):
  # Prepared from /usr/share/datasets/... by `data.get_info` (tests/conftest.py, once per run).
  cfg = _cfg(name='fashion_mnist_local', data_dir=fashion_mnist_dir)
  info = data.get_info(cfg)
  assert (info.num_train_examples, info.num_eval_examples) == (60000, 10000)
  assert info.num_classes == 10 and not info.multi_label
  _, labels = fml.load_split(fml.DEBIAN_DIR, 'test')
  assert collections.Counter(labels.tolist()) == {i: 1000 for i in range(10)}
  ds = data.create_eval_dataset(cfg, 2000, process_index=0, process_count=1)
  assert len(ds) == 5
  counts = sum(b['labels'].sum(0) for b in ds)
  np.testing.assert_array_equal(counts, 1000.)
  # Exported in the IDX files' order (tfds stores them shuffled): the published test images.
  from vit_jax.tools import export_images  # pylint: disable=g-import-not-at-top
  images, labels = fml.load_split(fml.DEBIAN_DIR, 'test')
  written = export_images.export('fashion_mnist_local', 'test[2:5]', str(tmp_path / 'png'),
                                 data_dir=fashion_mnist_dir)
  for i, path in enumerate(written):
    name = fml.LABEL_NAMES[labels[2 + i]].replace('/', '_')
    assert os.path.basename(path) == f'{i}_{name}.png'
    np.testing.assert_array_equal(np.asarray(Image.open(path)), images[2 + i])


def test_eval_resize_and_center_crop_matches_pil():
  """crop_pct 0.9 at 20 px: shorter side -> 22 (bicubic), longer 29, central 20 x 20 crop."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from PIL import Image, ImageFilter  # pylint: disable=g-import-not-at-top
  from vit_jax.data import preprocess  # pylint: disable=g-import-not-at-top
  noise = (np.random.default_rng(0).random((60, 80, 3)) * 255).astype(np.uint8)
  image = np.asarray(Image.fromarray(noise).filter(ImageFilter.GaussianBlur(2)))
  reference = np.asarray(Image.fromarray(image).resize((29, 22), Image.BICUBIC), np.float32)
  reference = reference[1:21, 4:24]  # torchvision CenterCrop: round((22-20)/2), round((29-20)/2)
  out = preprocess.resize_and_center_crop(tf.constant(image), 20, 0.9).numpy()
  assert out.shape == (20, 20, 3)
  np.testing.assert_allclose(out, reference, atol=1.0)  # PIL rounds to uint8.
  batch = preprocess.resize_and_center_crop(tf.constant(np.stack([image, image.T.copy().T])),
                                            20, 0.9).numpy()
  np.testing.assert_array_equal(batch[0], out)
  tall = preprocess.resize_and_center_crop(tf.constant(image.transpose(1, 0, 2)), 20, 0.9)
  assert tall.shape == (20, 20, 3)
  with pytest.raises(ValueError, match='eval_crop_pct=1.5 must be in'):
    preprocess.resize_and_center_crop(tf.constant(image), 20, 1.5)


def test_eval_dataset_with_crop_pct(folder):
  config = config_lib.defaults.data_config()
  config.image_folder = folder
  config.image_size = 8
  config.eval_crop_pct = 0.875
  batch = next(iter(data.create_eval_dataset(config, global_batch_size=4)))
  assert batch['image'].shape == (4, 8, 8, 3)
  assert -1.0 <= batch['image'].min() and batch['image'].max() <= 1.0


# -------------------------------------------------- T2T-ViT recipe augmentations


_RECIPE = dict(randaugment_num_layers=2, randaugment_magnitude=9.,
               randaugment_magnitude_std=0.5, random_erasing=0.5,
               mixup_alpha=0.8, cutmix_alpha=1.0, normalization='imagenet')


@pytest.mark.slow
def test_recipe_augmentations_deterministic_and_resumable(folder):
  cfg = _cfg(image_folder=folder, augment='inception_crop', image_size=16,
             **_RECIPE)

  def batches(start_step=0, n=5):
    it = data.create_train_iterator(cfg, 4, seed=0, start_step=start_step,
                                    process_index=0, process_count=1)
    return _take(it, n)

  a = batches()
  plain = _take(data.create_train_iterator(
      _cfg(image_folder=folder, augment='inception_crop', image_size=16,
           normalization='imagenet'), 4, seed=0, process_index=0,
      process_count=1), 5)
  assert not any(np.array_equal(x['image'], y['image'])
                 for x, y in zip(a, plain))
  for batch in a:
    np.testing.assert_allclose(batch['labels'].sum(1), 1., rtol=1e-6)
  # Mixed targets (not one-hot) in some batch.
  assert any((b['labels'] != b['labels'].round()).any() for b in a)
  for start in (2, 4):
    for x, y in zip(a[start:], batches(start, n=5 - start)):
      np.testing.assert_array_equal(x['image'], y['image'])
      np.testing.assert_array_equal(x['labels'], y['labels'])


def test_mixup_pairs_each_image_with_the_reversed_batch(folder):
  """Constant images: pixel = lam x_i + (1 - lam) x_(B-1-i), same lam for the labels."""
  common = dict(image_folder=folder, augment='none', image_size=4)
  mixed = _take(data.create_train_iterator(
      _cfg(mixup_alpha=0.8, **common), 4, seed=0, process_index=0,
      process_count=1), 3)
  plain = _take(data.create_train_iterator(
      _cfg(**common), 4, seed=0, process_index=0, process_count=1), 3)
  checked = 0
  for m, p in zip(mixed, plain):
    x, xr = p['image'][:, 0, 0, 0], p['image'][::-1, 0, 0, 0]
    for i in range(4):
      if abs(x[i] - xr[i]) < 1e-3:
        continue
      lam = (m['image'][i, 0, 0, 0] - xr[i]) / (x[i] - xr[i])
      assert 0. <= lam <= 1.
      np.testing.assert_allclose(
          m['labels'][i], lam * p['labels'][i] + (1 - lam) * p['labels'][::-1][i],
          atol=1e-4)
      checked += 1
  assert checked >= 4


def test_recipe_config_errors(folder):
  for key, value, message in [
      ('randaugment_num_layers', -1, 'randaugment_num_layers=-1 must be an int >= 0'),
      ('randaugment_magnitude', 11., r'randaugment_magnitude=11.0 must be in \[0, 10\]'),
      ('random_erasing', 1.5, r'random_erasing=1.5 must be in \[0, 1\] \(a probability\)'),
      ('mixup_alpha', -0.1, 'mixup_alpha=-0.1 must be >= 0'),
      ('eval_crop_pct', 0., r'eval_crop_pct=0.0 must be in \(0, 1\]')]:
    with pytest.raises(ValueError, match=message):
      data.get_info(_cfg(image_folder=folder, **{key: value}))


# ------------------------------------------------------ shuffle buffer memory


def test_shuffle_memory_of_static_size_images(fake_fmnist):
  """Fashion-MNIST: 20 train images of 28 x 28 (stored as PNGs, decoded to RGB)."""
  source = sources.get_source(fake_fmnist)
  cfg = fake_fmnist.copy_and_resolve_references()
  cfg.cache, cfg.shuffle_buffer = True, 8
  memory = memory_lib.estimate_shuffle_memory(cfg, source, 'train', 20)
  # Decoded uint8 28 x 28 x 3 = 2352 bytes + 600 of tf.data per element; the cache holds all 20.
  assert memory == memory_lib.ShuffleMemory(
      buffer_elements=8, bytes_per_element=2952, decoded=True, cache_elements=20, sampled=0)
  assert (memory.buffer_bytes, memory.cache_bytes, memory.total_bytes) == (
      8 * 2952, 20 * 2952, 20 * 2952)
  # Without the cache the buffer holds the PNG bytes of the records (decoded after it).
  cfg.cache, cfg.shuffle_buffer = False, 64
  memory = memory_lib.estimate_shuffle_memory(cfg, source, 'train', 20)
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  records = tfds.builder('fashion_mnist_local', data_dir=cfg.data_dir).as_dataset(
      split='train', decoders={'image': tfds.decode.SkipDecoding()})
  pngs = [ex['image'] for ex in records.take(16).as_numpy_iterator()]
  assert len(pngs) == 16 and all(png.startswith(b'\x89PNG') for png in pngs)
  pngs = [len(png) for png in pngs]
  assert memory == memory_lib.ShuffleMemory(
      buffer_elements=20, bytes_per_element=round(np.mean(pngs)) + 600, decoded=False,
      cache_elements=0, sampled=16)
  assert memory.total_bytes == 20 * (round(np.mean(pngs)) + 600)


def test_shuffle_memory_of_an_image_folder(tmp_path):
  """12 train PNGs of 8 x 6, plus one of 20 x 20: the mean of what the buffer holds."""
  root = data_utils.make_image_folder(str(tmp_path / 'f'), num_classes=3, per_class=4,
                                      size=(8, 6))
  big = tf.fill([20, 20, 3], tf.constant(7, tf.uint8))
  with open(os.path.join(root, 'train', 'class_0', 'big.png'), 'wb') as f:
    f.write(tf.io.encode_png(big).numpy())
  files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(root, 'train'))
           for n in names]
  cfg = _cfg(image_folder=root, shuffle_buffer=5)
  source = sources.get_source(cfg)
  memory = memory_lib.estimate_shuffle_memory(cfg, source, 'train', 13)
  # Encoded: the files' bytes (all 13 sampled, the sample is 16).
  mean_file = round(sum(os.path.getsize(p) for p in files) / 13)
  assert memory == memory_lib.ShuffleMemory(5, mean_file + 600, False, 0, 13)
  # Cached: decoded (12 x 144 + 1200) / 13 = 225.2 -> 225 bytes, + 600.
  cfg.cache = True
  memory = memory_lib.estimate_shuffle_memory(cfg, source, 'train', 13)
  assert memory == memory_lib.ShuffleMemory(5, 825, True, 13, 13)
  assert memory.total_bytes == 13 * 825  # The buffer shares the cache's tensors.
  # A sample of 2: the first two files in split order, both 8 x 6.
  memory = memory_lib.estimate_shuffle_memory(cfg, source, 'train', 13, sample=2)
  assert (memory.bytes_per_element, memory.sampled) == (144 + 600, 2)


def test_shuffle_memory_log_and_warnings(caplog):
  """The start-up line and its warning, whole: shuffle buffer, cache, batch buffers."""
  imagenet = memory_lib.ShuffleMemory(buffer_elements=50_000, bytes_per_element=110_000,
                                      decoded=False, cache_elements=0, sampled=16)
  cfg = ml_collections.ConfigDict({'image_size': 224, 'prefetch': 2, 'num_parallel_calls': -1})
  memory = memory_lib.estimate_input_memory(cfg, 256, 1000, shuffle=imagenet)
  # A batch element: float32 224 x 224 x 3 + 1,000 labels = 606,112 bytes, 2 + 2 + 5.5 copies.
  assert memory == memory_lib.InputMemory(imagenet, 0, 256, 224, 1000, 2, 2)
  assert (memory.element_bytes, memory.batch_copies, memory.batch_bytes) == (
      606_112, 9.5, 1_474_064_384)
  assert (memory.shuffle_bytes, memory.cache_bytes, memory.total_bytes) == (
      5_500_000_000, 0, 6_974_064_384)
  gib = 2**30
  with caplog.at_level(logging.INFO):
    assert memory_lib.log_input_memory(memory, ' (process 0 of 1)', 16 * gib) is None
    caplog.clear()
    warning = memory_lib.log_input_memory(memory, '', 8 * gib)
  info, warn = caplog.records
  assert info.levelname == 'INFO' and info.getMessage() == (
      'Input pipeline host memory: shuffle buffer 50,000 elements x 107.4 KiB (encoded images, '
      'mean of 16 read; +600 B per element) = 5.1 GiB; batch buffers 9.5 x 256 examples x '
      '591.9 KiB (float32 224x224x3 image + 1,000 labels; prefetch 2 + per-batch map 2 + 5.5 '
      'more) = 1.4 GiB; total ~6.5 GiB of 8.0 GiB host RAM (81%).')
  # 6.97e9 bytes > half of 8 GiB; a quarter of 8 GiB is 19,522 elements of 110,000 bytes.
  assert warn.levelname == 'WARNING' and warn.getMessage() == warning == (
      "The input pipeline needs ~6.5 GiB of host memory, more than 50% of this host's 8.0 GiB of "
      "RAM: the process may be killed for lack of memory. Its biggest part: the shuffle buffer "
      "(50,000 elements x 107.4 KiB, config.data.shuffle_buffer) needs ~5.1 GiB. Lower it, e.g. "
      "--config.data.shuffle_buffer=19522 (a quarter of the RAM).")
  # ImageNet's 1,281,167 training images decoded at ~400 x 350 (+600 B) in the cache: 501.6 GiB.
  cached = memory_lib.ShuffleMemory(50_000, 420_400, True, 1_281_167, 16)
  memory = memory_lib.estimate_input_memory(cfg, 256, 1000, shuffle=cached)
  assert (memory.shuffle_bytes, memory.cache_bytes) == (0, 538_602_606_800)
  caplog.clear()
  with caplog.at_level(logging.INFO):
    warning = memory_lib.log_input_memory(memory, '', 128 * gib)
  assert 'the cache (config.data.cache) holds 1,281,167 decoded images = 501.6 GiB, whose ' \
      'tensors the buffer shares; batch buffers' in caplog.records[0].getMessage()
  assert warning.startswith('The input pipeline needs ~503.0 GiB of host memory, more than 50%')
  assert warning.endswith('Its biggest part: the decoded training images held in memory '
                          '(config.data.cache) need ~501.6 GiB. Set --config.data.cache=False '
                          '(images are then decoded every epoch).')
  # Read by index, no buffer: 1,024 per host fill 5.5 GiB; 372 x 606,112 x 9.5 fill 2 GiB.
  memory = memory_lib.estimate_input_memory(cfg, 1024, 1000)
  assert memory.total_bytes == memory.batch_bytes == 5_896_257_536
  caplog.clear()
  with caplog.at_level(logging.INFO):
    warning = memory_lib.log_input_memory(memory, '', 8 * gib)
  assert caplog.records[0].getMessage() == (
      'Input pipeline host memory: shuffle buffer none (read by index); batch buffers 9.5 x '
      '1,024 examples x 591.9 KiB (float32 224x224x3 image + 1,000 labels; prefetch 2 + '
      'per-batch map 2 + 5.5 more) = 5.5 GiB; total ~5.5 GiB of 8.0 GiB host RAM (69%).')
  assert warning.endswith(
      'Its biggest part: the batch buffers (9.5 batches of 1,024 x 591.9 KiB) need ~5.5 GiB. '
      'Lower the batch per host (config.batch_size / processes = 1,024; 372 fill a quarter of '
      'the RAM): a smaller --config.batch_size, or more hosts.')
  # Mostly prefetched: 16 + 2 + 5.5 batches of 64 x 606,112 bytes = 869.4 MiB > 512 MiB.
  cfg.prefetch = 16
  memory = memory_lib.estimate_input_memory(cfg, 64, 1000)
  assert memory.batch_bytes == 911_592_448
  assert memory_lib.log_input_memory(memory, '', gib).endswith(
      'the batch buffers (23.5 batches of 64 x 591.9 KiB) need ~869.4 MiB. Most are prefetched '
      '(config.data.prefetch=16): lower it, e.g. --config.data.prefetch=2.')
  # Mostly in the per-batch map: 2 + 16 + 5.5, the same bytes.
  cfg.prefetch, cfg.num_parallel_calls = 2, 16
  memory = memory_lib.estimate_input_memory(cfg, 64, 1000)
  assert (memory.in_flight, memory.batch_bytes) == (16, 911_592_448)
  assert memory_lib.log_input_memory(memory, '', gib).endswith(
      'need ~869.4 MiB. Most are in the per-batch map (config.data.num_parallel_calls=16): lower '
      'it, e.g. --config.data.num_parallel_calls=-1 (AUTOTUNE).')
  # The threshold: a total of exactly half the RAM passes, a byte more warns. Element 1 x 1 x 3
  # + 1 label = 16 bytes x 9.5 = 152; with 848 bytes of in-memory images the total is 1,000.
  cfg.image_size, cfg.num_parallel_calls = 1, -1
  memory = memory_lib.estimate_input_memory(cfg, 1, 1, in_memory_bytes=848)
  assert (memory.batch_bytes, memory.cache_bytes, memory.total_bytes) == (152, 848, 1000)
  assert memory_lib.log_input_memory(memory, '', 2000) is None
  assert 'Its biggest part: the decoded training images held in memory (config.data.cache) ' \
      'need ~848 B.' in memory_lib.log_input_memory(memory, '', 1999)
  assert memory_lib.log_input_memory(memory, '', 0) is None  # RAM unknown: no share, no warning.


def test_train_iterator_logs_its_shuffle_memory(folder, fake_fmnist, caplog):
  def line(cfg, global_batch, process_index=0, process_count=1, read=None):
    caplog.clear()
    with caplog.at_level(logging.INFO):
      data.create_train_iterator(cfg, global_batch, seed=0, process_index=process_index,
                                 process_count=process_count, read=read)
    lines = [r.getMessage() for r in caplog.records if 'host memory' in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]
  # Process 1 of 2 reads 6 of the 12 train images, decoded 8 x 6 x 3 = 144 bytes and an int64
  # label each, held by index (no static image size: the mean of those read, before they are);
  # batch buffers 2 x (4 x 4 x 3 + 3) x 4 bytes x 9.5.
  assert line(_cfg(image_folder=folder, cache=True), 4, 1, 2).startswith(
      'Input pipeline host memory (process 1 of 2): shuffle buffer none (read by index); decoded '
      'images in memory (config.data.cache) = 912 B (mean of 6 read); batch buffers 9.5 x 2 '
      'examples x 204 B (float32 4x4x3 image + 3 labels; prefetch 2 + per-batch map 2 + 5.5 '
      'more) = 3.8 KiB; total ~4.7 KiB of ')
  # A run that started reading it in order (train.py passes its record's mode): through a buffer
  # of 744 bytes (+600) per element, sharing tf.data's cache.
  assert line(_cfg(image_folder=folder, cache=True), 4, 1, 2, read='in_order').startswith(
      'Input pipeline host memory (process 1 of 2): shuffle buffer 6 elements x 744 B (decoded '
      'uint8 images, mean of 6 read; +600 B per element) = 4.4 KiB; the cache '
      '(config.data.cache) holds 6 decoded images = 4.4 KiB, whose tensors the buffer shares; '
      'batch buffers 9.5 x 2 examples x 204 B (float32 4x4x3 image + 3 labels; prefetch 2 + '
      'per-batch map 2 + 5.5 more) = 3.8 KiB; total ~8.1 KiB of ')
  # Read by index: no buffer; 1 + 2 + 5.5 batches.
  assert line(_cfg(image_folder=folder, prefetch=1), 4).startswith(
      'Input pipeline host memory (process 0 of 1): shuffle buffer none (read by index); batch '
      'buffers 8.5 x 4 examples x 204 B (float32 4x4x3 image + 3 labels; prefetch 1 + per-batch '
      'map 2 + 5.5 more) = 6.8 KiB; total ~6.8 KiB of ')
  # Fashion-MNIST in memory: 20 images of 28 x 28 x 3 bytes and 20 int64 labels, exact.
  cfg = ml_collections.ConfigDict(fake_fmnist.to_dict())
  cfg.cache = True
  assert line(cfg, 4).startswith(
      'Input pipeline host memory (process 0 of 1): shuffle buffer none (read by index); decoded '
      'images in memory (config.data.cache) = 46.1 KiB (exact); batch buffers 9.5 x 4 examples '
      'x 232 B (float32 4x4x3 image + 10 labels; prefetch 2 + per-batch map 2 + 5.5 more) = '
      '8.6 KiB; total ~54.7 KiB of ')


# ------------------------------------------------------- reading by index


def _ids(cfg, batch, steps, start_step=0):
  it = data.create_train_iterator(cfg, batch, seed=0, start_step=start_step, process_index=0,
                                  process_count=1)
  return [data_utils.pixel_ids(b['image']) for b in _take(it, steps)]


def test_array_record_files_added_by_the_tool_are_read_by_index(tmp_path, caplog, capsys):
  """to_array_record adds ArrayRecord shards beside the TFRecord ones; training then shuffles
  whole epochs by index and a resume at any step gives the uninterrupted run's batches without
  reading the examples before it (the TFRecord path says what its resume costs)."""
  path = data_utils.make_multilabel_dataset(str(tmp_path), num_train=12, num_test=10)
  cfg = _cfg(name=path, augment='flip')
  capsys.readouterr()
  with caplog.at_level(logging.WARNING):
    _ids(cfg, 4, 1, start_step=1)
  assert 'reads and drops the 4 examples of epoch 0 before it (33% of an epoch)' in caplog.text
  assert f'python -m vit_jax.to_array_record {path}` adds ArrayRecord files' in caplog.text
  assert to_array_record.main([path, '--workers', '2']) == 0
  assert capsys.readouterr().out.splitlines() == [
      f'{path}: 2 TFRecord shards, 0.00 GiB, 2 at a time...',
      f'{path}: 2 ArrayRecord shards, 22 examples (all written now); runs started from now on '
      'read it by index (a run that read it in order goes on so).']
  assert sorted(os.listdir(path)) == [
      'dataset_info.json', 'features.json',  # Only dataset_info.json changed.
      'tiny_multi_label-test.array_record-00000-of-00001',
      'tiny_multi_label-test.tfrecord-00000-of-00001',
      'tiny_multi_label-train.array_record-00000-of-00001',
      'tiny_multi_label-train.tfrecord-00000-of-00001']
  assert to_array_record.main([path]) == 0  # Again: nothing left to do.
  assert '(all there already)' in capsys.readouterr().out
  sources._SOURCES.clear()
  assert sources.get_source(cfg).has_array_record
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    uninterrupted = _ids(cfg, 4, 7)
    for start in (1, 2, 4):  # Within epoch 0, at its end, within epoch 1.
      np.testing.assert_array_equal(uninterrupted[start:], _ids(cfg, 4, 7 - start, start))
  assert 'reads and drops' not in caplog.text
  # Evaluation still reads the TFRecord files (as_data_source switched the info's format).
  assert str(sources.get_source(cfg).builder.info.file_format.value) == 'tfrecord'
  assert sum(int(b['mask'].sum()) for b in data.create_eval_dataset(
      cfg, 4, process_index=0, process_count=1)) == 10
  epochs = np.concatenate(uninterrupted[:6]).reshape(2, 12)
  for epoch in epochs:
    assert sorted(epoch) == list(range(12))
  assert list(epochs[0]) != list(epochs[1])


def test_an_array_record_only_dataset_trains_and_evaluates(tmp_path):
  path = data_utils.make_multilabel_dataset(str(tmp_path), num_train=12, num_test=10,
                                            file_format='array_record')
  cfg = _cfg(name=path, augment='inception_crop')
  assert sorted(np.concatenate(_ids(cfg, 3, 4))) == list(range(12))
  ids = [data_utils.pixel_ids(b['image'])[b['mask']]
         for b in data.create_eval_dataset(cfg, 4, process_index=0, process_count=1)]
  start = data_utils.MULTILABEL_TEST_START
  assert sorted(np.concatenate(ids)) == list(range(start, start + 10))


def test_a_cached_dataset_is_read_by_index_from_memory(fake_fmnist, caplog):
  cfg = ml_collections.ConfigDict(fake_fmnist.to_dict())
  cfg.cache = True
  uninterrupted = _ids(cfg, 4, 8)
  assert sorted(np.concatenate(uninterrupted[:5])) == sorted(
      data_utils.idx_pixel_value('train', i) for i in range(20))
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(uninterrupted[6:], _ids(cfg, 4, 2, start_step=6))
  assert 'reads and drops' not in caplog.text


def test_to_array_record_refuses_what_is_not_a_prepared_dataset(tmp_path, capsys):
  assert to_array_record.main([str(tmp_path / 'missing')]) == 2
  assert capsys.readouterr().err == (
      f'FATAL: {tmp_path / "missing"} is not a directory: give that of a prepared tfds dataset '
      '(e.g. ~/tensorflow_datasets/NAME/VERSION), or its name.\n')


def test_array_record_files_that_cannot_be_opened_fall_back_to_tfrecord(tmp_path, caplog):
  """A damaged ArrayRecord shard gives a warning naming the fix, and training reads the TFRecord
  files."""
  path = data_utils.make_multilabel_dataset(str(tmp_path), num_train=12, num_test=10)
  assert to_array_record.main([path]) == 0
  with open(os.path.join(path, 'tiny_multi_label-train.array_record-00000-of-00001'), 'wb') as f:
    f.write(b'not an ArrayRecord file')
  sources._SOURCES.clear()
  cfg = _cfg(name=path, augment='none')
  with caplog.at_level(logging.WARNING):
    ids = np.concatenate(_ids(cfg, 4, 3))
  assert sorted(ids) == list(range(12))
  assert f'The ArrayRecord files of {path} cannot be read (' in caplog.text
  assert (f'a damaged shard: rerun `python -m vit_jax.to_array_record {path}`, which writes it '
          'again; in a bucket: check that this machine can read it. '
          f'{path} is read in order from its TFRecord files instead.') in caplog.text
  assert to_array_record.main([path]) == 0  # The damaged shard is written again.
  sources._SOURCES.clear()
  assert sources.get_source(cfg).random_access('train', decode=False).num_examples == 12
