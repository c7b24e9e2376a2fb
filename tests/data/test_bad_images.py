"""Bad input data: undecodable files fail with their names or are skipped
(`config.data.bad_images`); valid but unusual images decode to the right pixels.

Fast, CPU only (tiny images); the end-to-end runs and most of the sweeps over kinds of bad
files (a representative few stay in the fast tier) are marked slow.
"""

import contextlib
import io
import json
import logging
import os
import re
import threading

import numpy as np
from PIL import Image
import pytest

from tests import data_utils
from vit_jax import config as config_lib
from vit_jax import data
from vit_jax.data import bad_images
from vit_jax.data import files
from vit_jax.data import sources
from vit_jax.tools import predict
import tensorflow_datasets as tfds  # pylint: disable=g-bad-import-order

NPZ = os.path.join(os.path.dirname(__file__), '..', 'fixtures', 'vit_tiny',
                   'params.npz')
S = 16  # image_size: larger than the 7 x 5 odd-format images (upsampled).
SOLID = (200, 30, 90)
GRAY = 77
FIX = ('Remove or replace them, or set --config.data.bad_images=skip to skip '
       'undecodable images.')


def _cfg(**overrides):
  cfg = config_lib.defaults.data_config()
  cfg.update(image_size=S, shuffle_buffer=64, **overrides)
  return cfg


def _encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
  buf = io.BytesIO()
  img.save(buf, fmt, **kwargs)
  return buf.getvalue()


def _noise(size=32) -> Image.Image:
  rng = np.random.default_rng(size)
  return Image.fromarray(rng.integers(0, 256, (size, size, 3), np.uint8))


def _write(path: str, contents: bytes) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'wb') as f:
    f.write(contents)
  return path


# Undecodable files: name -> contents.
_JPEG = _encode(_noise(), 'JPEG', quality=90)
_PNG = _encode(_noise(), 'PNG')
BROKEN = {
    'random_bytes.jpg': np.random.default_rng(0).bytes(300),
    'truncated.jpg': _JPEG[:len(_JPEG) // 2],
    'empty.jpg': b'',
    'text.png': b'This is a text file, not a PNG.\n',
    'truncated.png': _PNG[:len(_PNG) // 2],
}


def _folder(tmp_path, bad=None, name='folder'):
  """2 classes, train 3 + test 2 per class (8x6 RGB PNGs), + `bad` files.

  Args:
    bad: {relative path: contents} written into the folder.

  Returns:
    (root, {relative path: absolute path} of the bad files).
  """
  root = data_utils.make_image_folder(
      str(tmp_path / name), num_classes=2, per_class={'train': 3, 'test': 2},
      size=(8, 6))
  paths = {rel: _write(os.path.join(root, rel), contents)
           for rel, contents in (bad or {}).items()}
  return root, paths


def _train_batches(cfg, batch, n, start_step=0):
  it = data.create_train_iterator(cfg, batch, seed=0, start_step=start_step,
                                  process_index=0, process_count=1)
  return [next(it) for _ in range(n)]


def _eval_batches(cfg, batch):
  return list(data.create_eval_dataset(cfg, batch, process_index=0,
                                       process_count=1))


# ---------------------------------------------------------------- the option


def test_bad_images_defaults_to_fail_and_rejects_other_values(tmp_path):
  assert config_lib.defaults.data_config().bad_images == 'fail'
  assert config_lib.BAD_IMAGES == ('fail', 'skip')
  root, _ = _folder(tmp_path)
  cfg = _cfg(image_folder=root, bad_images='ignore')
  message = r"config\.data\.bad_images='ignore'.*\('fail', 'skip'\)"
  with pytest.raises(ValueError, match=message):
    data.get_info(cfg)
  with pytest.raises(ValueError, match=message):
    data.create_train_iterator(cfg, 2, seed=0, process_index=0,
                               process_count=1)
  with pytest.raises(ValueError, match=message):
    data.create_eval_dataset(cfg, 2, process_index=0, process_count=1)
  with pytest.raises(ValueError, match=message):
    sources.get_source(cfg)


# ------------------------------------------------------------- 'fail' mode


def _check_error(error: data.BadImageError, path: str, split: str,
                 total: int):
  assert isinstance(error, ValueError)
  assert error.paths == [path]
  assert error.split == split
  message = str(error)
  assert path in message and FIX in message
  assert f"1 of {total} images of split '{split}'" in message, message
  assert '{{function_node' not in message


def _sweep(cases, fast):
  """`cases` for pytest.mark.parametrize, those not in `fast` marked slow: each case builds its
  own tf.data pipelines (about half a second), the fast tier keeps a representative few."""
  return [c if c in fast else pytest.param(*(c if isinstance(c, tuple) else (c,)),
                                           marks=pytest.mark.slow) for c in cases]


# The crop path decodes JPEGs its own way: every kind of file with it; a JPEG without it.
@pytest.mark.parametrize('augment,name', _sweep(
    [(augment, name) for augment in ('inception_crop', 'none') for name in sorted(BROKEN)],
    fast=[*(('inception_crop', name) for name in BROKEN), ('none', 'truncated.jpg')]))
def test_fail_names_the_bad_file_in_training(tmp_path, name, augment):
  root, paths = _folder(tmp_path, {f'train/class_1/{name}': BROKEN[name]})
  cfg = _cfg(image_folder=root, augment=augment)
  assert data.get_info(cfg).num_train_examples == 7  # Not checked up front.
  with pytest.raises(data.BadImageError) as e:
    _train_batches(cfg, 2, 5)  # 7 examples: the first epoch and then some.
  _check_error(e.value, paths[f'train/class_1/{name}'], 'train', 7)
  assert type(e.value.__cause__).__name__ == 'InvalidArgumentError'


@pytest.mark.parametrize('name', _sweep(sorted(BROKEN), fast=['truncated.jpg', 'text.png']))
def test_fail_names_the_bad_file_in_eval(tmp_path, name):
  root, paths = _folder(tmp_path, {
      f'test/class_0/{name}': BROKEN[name],
      'train/class_0/ok_elsewhere.png': _encode(_noise(8), 'PNG')})
  cfg = _cfg(image_folder=root)
  eval_ds = data.create_eval_dataset(cfg, 4, process_index=0, process_count=1)
  for _ in range(2):  # Every pass raises.
    with pytest.raises(data.BadImageError) as e:
      list(eval_ds)
    _check_error(e.value, paths[f'test/class_0/{name}'], 'test', 5)
  # Training on the clean train split is not affected.
  assert len(_train_batches(cfg, 4, 3)) == 3


def test_fail_names_up_to_8_files_and_counts_all(tmp_path):
  bad = {f'train/class_{i % 2}/bad_{i:02d}.jpg': b'' for i in range(11)}
  root, paths = _folder(tmp_path, bad)
  cfg = _cfg(image_folder=root, augment='flip', train_split='train')
  with pytest.raises(data.BadImageError) as e:
    _train_batches(cfg, 17, 1)
  message = str(e.value)
  assert "11 of 17 images of split 'train'" in message
  assert sorted(e.value.paths) == sorted(paths.values())
  assert sum(p in message for p in paths.values()) == 8
  assert '... and 3 more' in message and FIX in message


def test_fail_on_a_slice_names_only_the_files_of_that_slice(tmp_path):
  root, paths = _folder(tmp_path, {'train/class_0/bad.jpg': b''})
  with pytest.raises(data.BadImageError) as e:
    _train_batches(_cfg(image_folder=root, train_split='train[:100%]'), 7, 1)
  assert e.value.paths == [paths['train/class_0/bad.jpg']]
  assert "split 'train[:100%]'" in str(e.value)


def test_errors_that_are_not_decoding_errors_pass_through(tmp_path):
  root, _ = _folder(tmp_path)
  source = sources.get_source(_cfg(image_folder=root))
  other = ValueError('Incompatible shapes: [3] vs. [4]')
  assert source.bad_image_error(other, 'train') is None
  # A decoding error with no undecodable file in the split: not explained.
  assert source.bad_image_error(ValueError('DecodeImage failed'),
                                'train') is None


def test_find_undecodable(tmp_path):
  good = _write(str(tmp_path / 'good.jpg'), _JPEG)
  bad = [_write(str(tmp_path / name), contents)
         for name, contents in BROKEN.items()]
  missing = str(tmp_path / 'missing.png')
  paths = [bad[0], good, *bad[1:], missing]
  assert data.find_undecodable(paths) == [bad[0], *bad[1:], missing]
  assert data.find_undecodable([]) == []


# ------------------------------------------------------------- 'skip' mode


@pytest.fixture
def skip_folder(tmp_path):
  bad = {f'train/class_{i % 2}/{name}': contents
         for i, (name, contents) in enumerate(sorted(BROKEN.items()))}
  bad['test/class_1/broken.png'] = BROKEN['text.png']
  root, paths = _folder(tmp_path, bad)
  return root, paths


def test_skip_excludes_bad_files_with_one_warning(skip_folder, caplog,
                                                  monkeypatch):
  root, paths = skip_folder
  calls = []
  find = bad_images.find_undecodable
  monkeypatch.setattr(bad_images, 'find_undecodable',
                      lambda p: calls.append(len(p)) or find(p))
  cfg = _cfg(image_folder=root, bad_images='skip')
  with caplog.at_level(logging.WARNING):
    info = data.get_info(cfg)
    train_it = data.create_train_iterator(cfg, 6, seed=0, process_index=0,
                                          process_count=1)
    eval_ds = data.create_eval_dataset(cfg, 4, process_index=0,
                                       process_count=1)
    # Another config of the same folder: validated once per folder.
    data.get_info(_cfg(image_folder=root, bad_images='skip', prepare=False))
  assert calls == [16]  # One validation pass, over all 10 + 6 files.
  assert info.num_train_examples == 6 and info.num_eval_examples == 4
  assert info.num_skipped_images == 6
  assert sorted(sources.get_source(cfg).skipped_images) == sorted(
      paths.values())
  warnings = [r.getMessage() for r in caplog.records if 'Skipping' in
              r.getMessage()]
  assert len(warnings) == 1, warnings  # One per folder.
  assert warnings[0].startswith(
      "Skipping 6 of 16 images that cannot be decoded "
      "(data.bad_images='skip')"), warnings[0]
  for rel in paths:
    assert rel in warnings[0]
  # Every good image exactly once per epoch, in training and eval.
  for _ in range(3):  # Epochs.
    batch = next(train_it)
    assert sorted(data_utils.pixel_ids(batch['image'])) == list(range(6))
  ids = [i for b in eval_ds for i in data_utils.pixel_ids(b['image'])[b['mask']]]
  assert sorted(ids) == [128, 129, 130, 131]
  assert data.get_info(_cfg(image_folder=root)).num_skipped_images == 0


def test_skip_is_deterministic_and_resumable(skip_folder):
  root, _ = skip_folder
  cfg = _cfg(image_folder=root, bad_images='skip', augment='inception_crop')
  a, b = _train_batches(cfg, 4, 4), _train_batches(cfg, 4, 4)
  resumed = _train_batches(cfg, 4, 2, start_step=2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x['image'], y['image'])
  for x, y in zip(a[2:], resumed):
    np.testing.assert_array_equal(x['image'], y['image'])
    np.testing.assert_array_equal(x['labels'], y['labels'])


def test_skip_slices_the_good_files(skip_folder):
  root, _ = skip_folder
  cfg = _cfg(image_folder=root, bad_images='skip', augment='none',
             train_split='train[:50%]', eval_split='train[50%:]')
  info = data.get_info(cfg)
  assert info.num_train_examples == 3 and info.num_eval_examples == 3
  first = set(data_utils.pixel_ids(_train_batches(cfg, 3, 1)[0]['image']))
  second = {i for b in _eval_batches(cfg, 3)
            for i in data_utils.pixel_ids(b['image'])[b['mask']]}
  assert first | second == set(range(6)) and not first & second


def test_skip_with_every_file_bad_fails_clearly(tmp_path):
  root = str(tmp_path / 'all_bad')
  for split in ('train', 'test'):
    _write(os.path.join(root, split, 'class_0', 'x.jpg'), b'')
  cfg = _cfg(image_folder=root, bad_images='skip')
  assert data.get_info(cfg).num_train_examples == 0
  with pytest.raises(ValueError, match='no training examples'):
    data.create_train_iterator(cfg, 2, seed=0, process_index=0,
                               process_count=1)


def test_links_to_nothing_and_non_utf8_names_are_named_before_any_work(
    tmp_path):
  """Issue 37: a link to itself stopped the run with a TensorFlow traceback
  once the pipeline reached it (after the workdir was written); a file name
  that is not UTF-8 gave 'utf-8' codec can't decode byte 0xe9."""
  root, _ = _folder(tmp_path)
  os.symlink('self.png', os.path.join(root, 'train', 'class_1', 'self.png'))
  os.symlink('gone.png', os.path.join(root, 'test', 'class_0', 'gone.png'))
  with pytest.raises(FileNotFoundError) as error:
    sources.get_source(_cfg(image_folder=root))
  assert str(error.value) == (
      f'2 image file(s) of image folder {root} are not files that can be read '
      '(reading a FIFO or a device waits forever): test/class_0/gone.png (a '
      'broken or looping symbolic link), train/class_1/self.png (a broken or '
      'looping symbolic link). Remove them or replace them with images, or set '
      '--config.data.bad_images=skip to skip them.')
  # 'skip' leaves them out with the undecodable files.
  assert data.get_info(_cfg(image_folder=root, bad_images='skip')
                       ).num_skipped_images == 2

  root, _ = _folder(tmp_path, name='latin1')
  latin1 = os.fsencode(root) + b'/train/class_1/caf\xe9.png'
  os.link(os.path.join(root, 'train', 'class_0', 'img_0.png'), latin1)
  with pytest.raises(ValueError, match=re.escape(
      f'The file name {latin1!r} is not UTF-8, which TensorFlow cannot open: '
      'rename it (e.g. convmv -f latin1 -t utf8 --notest <file>) or move it '
      'away.')):
    sources.get_source(_cfg(image_folder=root))


@contextlib.contextmanager
def unblocked_after(fifo, seconds):
  """A reader left waiting on `fifo` after `seconds` gets its end of file (a
  regression then fails instead of hanging the suite)."""
  done = threading.Event()

  def unblock():
    done.wait(seconds)
    while not done.is_set():
      try:  # Opens only while a reader waits; closed at once: its EOF.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
      except OSError:
        pass
      done.wait(0.1)

  thread = threading.Thread(target=unblock, daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()


def test_a_fifo_named_like_an_image_is_refused_or_skipped_and_never_read(
    tmp_path, caplog, capsys):
  """Issue 50: a FIFO `x.jpg` in an image folder blocked training, the 'skip'
  validation and predict forever. Refused before any read, or left out with
  'skip'; predict skips it with a warning."""
  root, _ = _folder(tmp_path)
  fifo = os.path.join(root, 'train', 'class_0', 'x.jpg')
  os.mkfifo(fifo)
  with unblocked_after(fifo, 60):
    with pytest.raises(FileNotFoundError) as error:
      sources.get_source(_cfg(image_folder=root))
    assert str(error.value) == (
        f'1 image file(s) of image folder {root} are not files that can be '
        'read (reading a FIFO or a device waits forever): train/class_0/x.jpg '
        '(a FIFO). Remove them or replace them with images, or set '
        '--config.data.bad_images=skip to skip them.')
    cfg = _cfg(image_folder=root, bad_images='skip')
    with caplog.at_level(logging.WARNING):
      info = data.get_info(cfg)
    assert (info.num_train_examples, info.num_skipped_images) == (6, 1)
    assert ("Skipping 1 image file(s) of image folder "
            f"{root} that are not files that can be read (data.bad_images="
            "'skip'): train/class_0/x.jpg (a FIFO)") in caplog.text
    batch = next(data.create_train_iterator(cfg, 6, seed=0, process_index=0,
                                            process_count=1))
    assert batch['image'].shape == (6, S, S, 3)

    folder = os.path.dirname(fifo)
    assert predict.main([NPZ, folder, '--top-k', '1', '--json']) == 0
    out, err = capsys.readouterr()
    assert [r['path'] for r in json.loads(out)] == [
        os.path.join(folder, f'img_{i}.png') for i in range(3)]
    assert err == (f'WARNING: skipped {fifo}: a FIFO, not an image file: '
                   'reading it would wait forever.\n')
    # From Python too (Predictor.preprocess, eval_input): refused, never opened.
    with pytest.raises(OSError, match=f'^{re.escape(fifo)} is a FIFO, not an '
                       'image file.$'):
      files.read_bytes(fifo)


# --------------------------------------------------- unusual, valid images


def _odd_images():
  """class name -> (file name, encoded bytes, expected RGB)."""
  small = (7, 5)  # (W, H): smaller than S x S and than most crops.
  rgb = Image.new('RGB', small, SOLID)
  gray = Image.new('L', small, GRAY)
  palette = Image.new('P', small, 0)
  palette.putpalette([*SOLID, 0, 0, 0])
  return {
      'a_cmyk_jpeg': ('cmyk.jpg', _encode(rgb.convert('CMYK'), 'JPEG',
                                          quality=100), SOLID),
      'b_gray_jpeg': ('gray.jpg', _encode(gray, 'JPEG', quality=100),
                      (GRAY,) * 3),
      'c_png_named_jpg': ('png.jpg', _encode(rgb, 'PNG'), SOLID),
      'd_rgba_png_named_jpg': ('rgba.jpg', _encode(
          Image.new('RGBA', small, (*SOLID, 100)), 'PNG'), SOLID),
      'e_gray_png_named_jpg': ('gray.jpg', _encode(gray, 'PNG'), (GRAY,) * 3),
      'f_palette_png_named_jpg': ('palette.jpg', _encode(palette, 'PNG'),
                                  SOLID),
      'g_16bit_png': ('gray16.png', _encode(
          Image.new('I;16', small, GRAY * 257), 'PNG'), (GRAY,) * 3),
      'h_jpeg_named_png': ('jpeg.png', _encode(rgb, 'JPEG', quality=100),
                           SOLID),
      'i_1x1_png': ('dot.png', _encode(Image.new('RGB', (1, 1), SOLID), 'PNG'),
                    SOLID),
      'j_large_jpeg': ('large.jpg', _encode(Image.new('RGB', (40, 30), SOLID),
                                            'JPEG', quality=100), SOLID),
  }


@pytest.fixture(scope='module')
def odd_folder(tmp_path_factory):
  """One class per kind of image, the same file in train and test."""
  root = str(tmp_path_factory.mktemp('odd'))
  images = _odd_images()
  for split in ('train', 'test'):
    for cls, (name, contents, _) in images.items():
      _write(os.path.join(root, split, cls, name), contents)
  expected = np.array([rgb for _, _, rgb in images.values()], np.float32)
  return root, expected


def _check_pixels(batch, expected):
  """Every image of `batch` is solid, of the colour of its class."""
  pixels = (batch['image'] + 1.) * 127.5  # minus_one_to_one -> [0, 255]
  classes = batch['labels'].argmax(-1)
  assert sorted(classes) == list(range(len(expected)))
  np.testing.assert_allclose(
      pixels, np.broadcast_to(expected[classes][:, None, None, :],
                              pixels.shape), atol=3.)


@pytest.mark.parametrize('augment', ['inception_crop', 'flip', 'none'])
@pytest.mark.parametrize('bad_images', ['fail', 'skip'])
def test_unusual_images_decode_to_the_right_pixels(odd_folder, augment,
                                                   bad_images):
  root, expected = odd_folder
  cfg = _cfg(image_folder=root, augment=augment, bad_images=bad_images)
  n = len(expected)
  info = data.get_info(cfg)
  assert (info.num_train_examples, info.num_skipped_images) == (n, 0)
  for batch in _train_batches(cfg, n, 2):  # One batch = one epoch.
    assert batch['image'].shape == (n, S, S, 3)
    _check_pixels(batch, expected)
  (batch,) = _eval_batches(cfg, n)
  assert batch['mask'].all()
  _check_pixels(batch, expected)


def test_unusual_images_with_eval_crop_and_cache(odd_folder):
  root, expected = odd_folder
  cfg = _cfg(image_folder=root, eval_crop_pct=0.875, cache=True)
  (batch,) = _eval_batches(cfg, len(expected))
  _check_pixels(batch, expected)
  _check_pixels(_train_batches(cfg, len(expected), 1)[0], expected)


# ------------------------------------------------------------ tfds datasets


class VitJaxBadImageTest(tfds.core.GeneratorBasedBuilder):
  """6 PNGs per split (pixel value 10 * i); example 3 is not an image."""

  VERSION = tfds.core.Version('1.0.0')
  VIT_JAX_OFFLINE = True

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(None, None, 3)),
            'label': tfds.features.ClassLabel(num_classes=2)}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples(), 'test': self._generate_examples()}

  def _generate_examples(self):
    for i in range(6):
      image = (b'not an image' if i == 3 else
               _encode(Image.new('RGB', (6, 4), (10 * i,) * 3), 'PNG'))
      yield i, {'image': image, 'label': i % 2}


@pytest.fixture(scope='module')
def bad_tfds(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp('tfds_bad'))
  VitJaxBadImageTest(data_dir=data_dir).download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return data_dir


def test_tfds_fail_names_dataset_and_split(bad_tfds):
  cfg = _cfg(name='vit_jax_bad_image_test', data_dir=bad_tfds)
  with pytest.raises(data.BadImageError) as e:
    _train_batches(cfg, 2, 4)
  message = str(e.value)
  assert "split 'train' of dataset 'vit_jax_bad_image_test'" in message
  assert 'Unknown image file format' in message
  assert '--config.data.bad_images=skip' in message
  with pytest.raises(data.BadImageError, match="split 'test'"):
    _eval_batches(cfg, 2)


@pytest.mark.parametrize('cache', [False, True])
def test_tfds_skip_drops_bad_examples(bad_tfds, cache):
  cfg = _cfg(name='vit_jax_bad_image_test', data_dir=bad_tfds,
             bad_images='skip', augment='none', cache=cache)
  info = data.get_info(cfg)
  assert info.num_skipped_images is None  # Not known in advance.
  assert info.num_train_examples == 6  # Counted from the tfds metadata.
  (batch,) = _train_batches(cfg, 5, 1)
  assert sorted(data_utils.pixel_ids(batch['image'])) == [0, 10, 20, 40, 50]
  eval_ds = data.create_eval_dataset(cfg, 4, process_index=0, process_count=1)
  batches = list(eval_ds)
  assert len(batches) == len(eval_ds) == 2  # Padded to the promised length.
  ids = [i for b in batches for i in data_utils.pixel_ids(b['image'])[b['mask']]]
  assert sorted(ids) == [0, 10, 20, 40, 50]


# --------------------------------------------------------------- end to end


def _run_config(folder, **data_fields):
  config = data_utils.folder_run_config(
      'ViT-custom', folder, 8, total_steps=3, hidden_size=8, mlp_dim=16,
      num_heads=2, num_layers=1, patch_size=4)
  config.log_every_steps = config.eval_every_steps = 3
  config.checkpoint_every_steps = 3
  config.data.update(**data_fields)
  return config


@pytest.mark.slow
def test_train_and_evaluate_with_a_truncated_jpeg(tmp_path):
  from vit_jax import train  # pylint: disable=g-import-not-at-top
  root, paths = _folder(tmp_path, {'train/class_0/cut.jpg': BROKEN[
      'truncated.jpg']})
  bad = paths['train/class_0/cut.jpg']
  # 3 steps of 4 > 7 examples: the whole first epoch is read.
  with pytest.raises(data.BadImageError, match='1 of 7 images') as e:
    train.train_and_evaluate(_run_config(root), str(tmp_path / 'fail'))
  assert e.value.paths == [bad] and bad in str(e.value)
  results = train.train_and_evaluate(_run_config(root, bad_images='skip'),
                                     str(tmp_path / 'skip'))
  assert results['step'] == 3 and 0. <= results['test/accuracy'] <= 1.


@pytest.mark.slow
def test_a_bad_eval_image_stops_the_run_after_its_checkpoint(tmp_path):
  """The checkpoint of a step is saved before that step's evaluation, which can fail."""
  from vit_jax import train  # pylint: disable=g-import-not-at-top
  root, paths = _folder(tmp_path, {'test/class_1/cut.jpg': BROKEN['truncated.jpg']})
  workdir = tmp_path / 'workdir'
  with pytest.raises(data.BadImageError, match="split 'test'") as e:
    train.train_and_evaluate(_run_config(root), str(workdir))
  assert e.value.paths == [paths['test/class_1/cut.jpg']]
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['3']
