"""How the training split is read, by index or in order (issue 50, items 12 and 18): image folders
and cached datasets by index, the mode recorded with every checkpoint, and a resume that keeps it
(bitwise) or refuses before any write, naming the fix."""

import json
import logging
import os
import signal

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from tests import data_utils
from tests.test_train_failures import _main_config, _params
from vit_jax import config as config_lib
from vit_jax import data
from vit_jax import train
from vit_jax.data import pipeline
from vit_jax.data import sources
from vit_jax.tools import to_array_record

SIZES = ((8, 6), (5, 9), (12, 4))  # (H, W) of the images of each class: no static size.


def _cfg(**overrides):
  cfg = config_lib.defaults.data_config()
  cfg.update(image_size=4, shuffle_buffer=64, augment='none', **overrides)
  return cfg


def _ids(cfg, steps, start_step=0, read=None, batch=4):
  """The pixel ids of `steps` training batches (process 0 of 1)."""
  it = data.create_train_iterator(cfg, batch, seed=0, start_step=start_step, read=read,
                                  process_index=0, process_count=1)
  return np.stack([data_utils.pixel_ids(next(it)['image']) for _ in range(steps)])


def _held_spec(cfg):
  """The element spec of the examples that `random_access(decode=True)` holds in memory."""
  positions = tf.data.Dataset.from_tensors((tf.constant(0, tf.int64), tf.constant(0, tf.int64)))
  spec = sources.get_source(cfg).random_access('train', decode=True).read(positions).element_spec
  return {k: (v.dtype, v.shape.as_list()) for k, v in spec[1].items()}


def _mixed_size_folder(root):
  """train/class_<c>/img_<k>.png, 3 classes x 2 images of the sizes in SIZES; pixel value 10 *
  (c + 1) + k."""
  for c, (h, w) in enumerate(SIZES):
    os.makedirs(os.path.join(root, 'train', f'class_{c}'))
    for k in range(2):
      image = tf.fill([h, w, 3], tf.constant(10 * (c + 1) + k, tf.uint8))
      with open(os.path.join(root, 'train', f'class_{c}', f'img_{k}.png'), 'wb') as f:
        f.write(tf.io.encode_png(image).numpy())
  return root


@pytest.fixture(autouse=True)
def _fresh_sources():
  """Each test sees the files as they are now (sources are memoized per config)."""
  sources._SOURCES.clear()
  yield
  sources._SOURCES.clear()


def test_an_image_folder_with_cache_is_read_by_index_from_its_decoded_images(tmp_path, caplog):
  """Item 18: config.data.cache=True on an image folder (images of several sizes) holds the
  decoded images in memory and reads them by index: the batches of cache=False, a resume starts
  at once, and the memory line counts the images before they are read."""
  cfg = _cfg(image_folder=_mixed_size_folder(str(tmp_path / 'images')), cache=True)
  assert pipeline.train_read_mode(cfg) == pipeline.BY_INDEX == 'by_index'
  assert _held_spec(cfg) == {'image': (tf.uint8, [None, None, 3]), 'label': (tf.int64, [])}
  with caplog.at_level(logging.INFO):
    uninterrupted = _ids(cfg, 6, batch=3)
  assert sorted(uninterrupted[:2].ravel()) == [10, 11, 20, 21, 30, 31]  # An epoch: all 6 once.
  # The pixels of the three sizes: 2 x (144 + 135 + 144) bytes + 6 int64 labels = 894 bytes.
  memory = next(r.getMessage() for r in caplog.records if 'host memory' in r.getMessage())
  assert memory.startswith('Input pipeline host memory (process 0 of 1): shuffle buffer none '
                           '(read by index); decoded images in memory (config.data.cache) = '
                           '894 B (mean of 6 read); batch buffers '), memory
  np.testing.assert_array_equal(uninterrupted, _ids(_cfg(image_folder=cfg.image_folder), 6,
                                                    batch=3))
  caplog.clear()
  with caplog.at_level(logging.INFO):
    np.testing.assert_array_equal(uninterrupted[3:], _ids(cfg, 3, start_step=3, batch=3))
  assert 'is read by index, so the input starts at once at example 3 of epoch 1' in caplog.text
  assert 'reads and drops' not in caplog.text


def test_a_cached_multi_label_dataset_is_read_by_index(tmp_path):
  """cache=True on a tfds dataset of several labels per image (TFRecord files, then with
  ArrayRecord ones too) reads by index from memory: the order of the ArrayRecord files."""
  path = data_utils.make_multilabel_dataset(str(tmp_path), num_train=12, num_test=10)
  cfg = _cfg(name=path, cache=True)
  assert pipeline.train_read_mode(cfg) == 'by_index'
  assert _held_spec(cfg) == {'image': (tf.uint8, [8, 8, 3]), 'label': (tf.int64, [None])}
  cached = _ids(cfg, 6)
  assert sorted(cached[:3].ravel()) == list(range(12))
  np.testing.assert_array_equal(cached[2:], _ids(cfg, 4, start_step=2))
  assert to_array_record.main([path]) == 0
  sources._SOURCES.clear()
  assert pipeline.train_read_mode(cfg) == 'by_index'
  np.testing.assert_array_equal(cached, _ids(cfg, 6))
  np.testing.assert_array_equal(cached, _ids(_cfg(name=path), 6))  # The ArrayRecord files.


def test_the_recorded_read_mode_is_kept_or_refused_with_the_fix(tmp_path, caplog):
  """Item 12: ArrayRecord files added to a dataset read in order do not change a run recorded
  'in_order' (its TFRecord files are still read, in the same order); a run recorded 'by_index'
  whose ArrayRecord files cannot be read is refused, naming the fixes."""
  path = data_utils.make_multilabel_dataset(str(tmp_path), num_train=12, num_test=10)
  cfg = _cfg(name=path)
  assert pipeline.train_read_mode(cfg) == pipeline.IN_ORDER == 'in_order'
  in_order = _ids(cfg, 6)
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(in_order[2:], _ids(cfg, 4, start_step=2))
  assert (f'`python -m vit_jax.to_array_record {path}` adds ArrayRecord files, read by index by '
          'the runs started after it') in caplog.text
  assert 'this run goes on reading in order' in caplog.text
  assert to_array_record.main([path]) == 0
  sources._SOURCES.clear()
  assert pipeline.train_read_mode(cfg) == 'by_index'  # A new run.
  assert pipeline.train_read_mode(cfg, 'by_index') == 'by_index'
  assert pipeline.train_read_mode(cfg, 'in_order') == 'in_order'  # The run it resumes.
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(in_order[2:], _ids(cfg, 4, start_step=2, read='in_order'))
  assert (f'Resuming at step 2: {path} is read in order, as this run was from its start (its '
          'checkpoints\' dataset record: "read": "in_order"), though it can now be read by '
          'index, so that its batches are those of an uninterrupted run: the input reads and '
          'drops the 8 examples of epoch 0 before it (67% of an epoch). A run started in a new '
          '--workdir reads it by index.') in caplog.text
  assert not np.array_equal(in_order, _ids(cfg, 6))  # By index: another order.

  with open(os.path.join(path, 'tiny_multi_label-train.array_record-00000-of-00001'), 'wb') as f:
    f.write(b'not an ArrayRecord file')  # Damaged: the dataset reads in order only.
  sources._SOURCES.clear()
  assert pipeline.train_read_mode(cfg) == 'in_order'
  assert pipeline.train_read_mode(cfg, 'in_order') == 'in_order'
  with pytest.raises(ValueError) as e:
    pipeline.train_read_mode(cfg, 'by_index')
  assert str(e.value) == (
      f'This run read {path} by index from its start (its checkpoints\' dataset record: "read": '
      '"by_index"), but it can now be read in order only (its ArrayRecord files are missing or '
      'cannot be read): resuming would train on other batches than an uninterrupted run. Write '
      f'its ArrayRecord files again (python -m vit_jax.to_array_record {path}) and rerun, or '
      'start a new run in another --workdir.')
  with pytest.raises(ValueError, match='^The dataset record of the checkpoint to resume says '
                     '"read": "sideways"; the modes are "by_index" and "in_order"'):
    pipeline.train_read_mode(cfg, 'sideways')


def test_in_order_cannot_be_kept_without_the_tfrecord_files(tmp_path):
  path = data_utils.make_multilabel_dataset(str(tmp_path), num_train=12, num_test=10,
                                            file_format='array_record')
  cfg = _cfg(name=path)
  assert pipeline.train_read_mode(cfg) == 'by_index'
  with pytest.raises(ValueError) as e:
    pipeline.train_read_mode(cfg, 'in_order')
  assert str(e.value) == (
      f'This run read {path} in order from its start (its checkpoints\' dataset record: "read": '
      '"in_order"), but its TFRecord files are gone (ArrayRecord files only): resuming would '
      'train on other batches than an uninterrupted run. Restore the TFRecord files it was '
      'prepared with and rerun, or start a new run in another --workdir.')
  with pytest.raises(ValueError, match='its TFRecord files are gone'):
    data.create_train_iterator(cfg, 4, seed=0, read='in_order', process_index=0,
                               process_count=1)


def test_the_dataset_record_says_how_the_data_is_read(tmp_path):
  cfg = _cfg(image_folder=_mixed_size_folder(str(tmp_path / 'images')), eval_split='train')
  record = train.dataset_record(ml_collections.ConfigDict({'data': cfg}), data.get_info(cfg),
                                pipeline.train_read_mode(cfg))
  assert (record['name'], record['read'], record['num_train_examples']) == (
      cfg.image_folder, 'by_index', 6)


def test_a_resume_keeps_the_recorded_mode_and_takes_an_old_record_as_a_new_run(tmp_path, caplog):
  """train._read_mode: the mode of the checkpoint's record; a record of an earlier version (no
  "read") gets a new run's mode, with a line saying so; a new run reads no record."""
  config = ml_collections.ConfigDict(
      {'data': _cfg(image_folder=_mixed_size_folder(str(tmp_path / 'images')), cache=True)})

  class Saved:
    def __init__(self, record):
      self.record = record

    def read_dataset(self):
      return self.record

  with caplog.at_level(logging.INFO):
    assert train._read_mode(config, Saved({'read': 'in_order'}), resuming=True) == 'in_order'
    assert train._read_mode(config, Saved(None), resuming=False) == 'by_index'
    assert 'earlier version' not in caplog.text
    assert train._read_mode(config, Saved({'name': 'x'}), resuming=True) == 'by_index'
  assert ("The checkpoint's dataset record does not say how the training data was read (saved by "
          'an earlier version): reading it by index, as a new run does.') in caplog.text


@pytest.mark.slow
def test_to_array_record_mid_run_keeps_the_run_bitwise(
    tmp_path, caplog, monkeypatch):
  """Item 12, end to end (in this process): a run reading TFRecord in order is stopped by SIGTERM
  within an epoch (saved; `main` exits 75), the resume warning's advice is followed
  (to_array_record on its dataset), and the rerun goes on in order, ending with the parameters
  of a run never stopped. (A mode that cannot be kept is refused before any write:
  `test_the_recorded_read_mode_is_kept_or_refused_with_the_fix`.)"""
  path = data_utils.make_multilabel_dataset(str(tmp_path / 'tfds'), num_train=48, num_test=4)
  overrides = {'data.name': path, 'data.image_size': 8, 'data.augment': 'flip',  # 12 steps/epoch.
               'data.cache': False, 'data.shuffle_buffer': 32, 'model.hidden_size': 8,
               'model.mlp_dim': 16, 'model.num_heads': 2, 'model.num_layers': 1,
               'model.patch_size': (4, 4), 'batch_size': 4, 'optim.warmup_steps': 1,
               'total_steps': 10, 'log_every_steps': 5, 'checkpoint_every_steps': 5,
               'eval_every_steps': 100000, 'analysis.train_images': 0,
               'analysis.attention_images': 0, 'analysis.rollout_images': 0}
  create = data.create_train_iterator

  def sigterm_at_step_7(*args, **kwargs):
    for i, batch in enumerate(create(*args, **kwargs)):
      if i == 6:
        os.kill(os.getpid(), signal.SIGTERM)
      yield batch

  workdir = tmp_path / 'run'
  monkeypatch.setattr(data, 'create_train_iterator', sigterm_at_step_7)
  with pytest.raises(train.Preempted) as e:
    train.train_and_evaluate(_main_config(overrides), str(workdir))
  monkeypatch.undo()
  assert e.value.step == 7 and not e.value.interrupted
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['5', '7']
  assert json.loads((workdir / 'dataset.json').read_text())['read'] == 'in_order'
  straight = tmp_path / 'straight'  # Never stopped, before the ArrayRecord files exist.
  train.train_and_evaluate(_main_config(overrides), str(straight))

  assert to_array_record.main([path]) == 0  # The advice of the resume warning.
  sources._SOURCES.clear()
  caplog.clear()
  with caplog.at_level(logging.INFO):
    assert train.train_and_evaluate(_main_config(overrides), str(workdir))['step'] == 10
  assert (f'Resuming at step 7: {path} is read in order, as this run was from its start'
          in caplog.text)
  expected, got = _params(straight), _params(workdir)
  assert expected.keys() == got.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

