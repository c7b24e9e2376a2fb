"""Train / eval input pipelines (tf.data -> numpy batches, this process's share of the global
batch): :func:`get_info`, :func:`create_train_iterator`, :func:`create_eval_dataset`."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import math
from typing import Callable, Dict, Iterator, Optional, Tuple
import weakref

from absl import logging
import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.data import bad_images
from vit_jax.data import memory
from vit_jax.data import preprocess
from vit_jax.data import sources
from vit_jax.data import train_maps


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """The configured dataset: C = ``num_classes`` (multi-hot targets if ``multi_label``),
  example counts of all processes (eval: ReaL's unlabeled ones included), ``image_shape`` (S, S,
  3), ``num_skipped_images`` (``bad_images='skip'``: an image folder's count, None for tfds; 0 in
  'fail' mode) and the C ``label_names``."""
  num_classes: int
  multi_label: bool
  num_train_examples: int
  num_eval_examples: int
  image_shape: Tuple[int, int, int]
  num_skipped_images: Optional[int] = 0
  label_names: Tuple[str, ...] = ()


# What iterating a pipeline raises when an image cannot be decoded.
_DECODE_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.DataLossError)
# error -> the BadImageError explaining it, or None (see Source.bad_image_error).
_Diagnose = Callable[[Exception], Optional[bad_images.BadImageError]]


def _processes(process_index: Optional[int], process_count: Optional[int],
               global_batch_size: int) -> Tuple[int, int, int]:
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index={process_index} not in [0, process_count={process_count}).')
  return process_index, process_count, local_batch_size(global_batch_size, process_count)


def local_batch_size(global_batch_size: int, process_count: int) -> int:
  """global_batch_size // process_count; ValueError if not divisible."""
  if global_batch_size <= 0 or global_batch_size % process_count:
    raise ValueError(
        f'global_batch_size={global_batch_size} must be a positive multiple of the number of JAX '
        f'processes ({process_count}): every process loads global_batch_size / process_count '
        'examples per step.')
  return global_batch_size // process_count


def _num_examples(source: sources.Source, split, what: str) -> int:
  try:
    return source.num_examples(split)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'Bad {what}={split!r} for dataset {source.name!r} (splits: '
                     f'{sorted(source.builder.info.splits.keys())}): {e}') from e


_EPOCH_STRIDE = 2**32  # > examples per epoch of one process.


_OPTIONS = tf.data.Options()
_OPTIONS.deterministic = True
_OPTIONS.threading.max_intra_op_parallelism = 1


def get_info(data_cfg) -> DatasetInfo:
  """The :class:`DatasetInfo` of ``config.data`` (prepared if that works offline). Raises
  ValueError (an invalid config field or split) or as :func:`sources.get_source`."""
  source = sources.get_source(data_cfg)
  s = data_cfg.image_size
  return DatasetInfo(
      source.label.num_classes, source.label.multi_label,
      _num_examples(source, data_cfg.train_split, 'config.data.train_split'),
      _num_examples(source, data_cfg.eval_split, 'config.data.eval_split'),
      (s, s, 3), source.num_skipped_images, source.label.names)


class _Batches:
  """A pipeline's numpy batches; ``next()`` raises ``BadImageError`` for an undecodable image in
  'fail' mode (the iterator is then unusable). Closed at exit (`_close_live_iterators`)."""

  def __init__(self, dataset: tf.data.Dataset, diagnose: _Diagnose):
    self.dataset = dataset
    self._diagnose = diagnose
    self._it = dataset.as_numpy_iterator()
    _LIVE.add(self)

  def __iter__(self) -> '_Batches':
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    try:
      return next(self._it)
    except _DECODE_ERRORS as e:
      bad = self._diagnose(e)
      if bad is None:
        raise
      raise bad from e


class TrainIterator(_Batches):
  """Infinite iterator of this process's training batches (numpy dicts), as `_Batches`."""

  def __init__(self, dataset: tf.data.Dataset, local_batch: int, examples_per_epoch: int,
               diagnose: _Diagnose):
    super().__init__(dataset, diagnose)
    self.local_batch_size = local_batch
    self.examples_per_epoch = examples_per_epoch


_LIVE = weakref.WeakSet()  # The iterators not yet collected.


@atexit.register
def _close_live_iterators() -> None:
  """Deletes the tf.data iterators still alive before the interpreter's finalization, where a
  pipeline's thread running Python (ArrayRecord's reads) cannot take the GIL: deleting its
  iterator then would wait forever."""
  for iterator in list(_LIVE):
    iterator._it = None  # pylint: disable=protected-access
  gc.collect()


#: How the training split is read (:func:`train_read_mode`); a run's dataset record keeps it.
BY_INDEX = 'by_index'
IN_ORDER = 'in_order'


def _train_split(data_cfg, pi: int, pc: int) -> sources.SplitArg:
  return data_cfg.train_split if pc == 1 else tfds.split_for_jax_process(
      data_cfg.train_split, process_index=pi, process_count=pc)


def train_read_mode(data_cfg, recorded: Optional[str] = None, *,
                    process_index: Optional[int] = None,
                    process_count: Optional[int] = None) -> str:
  """How :func:`create_train_iterator` reads this process's training split (nothing decoded):
  BY_INDEX where `Source.random_access` can, else IN_ORDER; ``recorded`` (the checkpoint's mode;
  None: a new run) is kept as docs/data.md says. ValueError (the cause and the fixes) where it
  cannot be kept, or an unknown mode."""
  pi = jax.process_index() if process_index is None else process_index
  pc = jax.process_count() if process_count is None else process_count
  source = sources.get_source(data_cfg)
  if recorded is not None and recorded not in (BY_INDEX, IN_ORDER):
    raise ValueError(f'The dataset record of the checkpoint to resume says "read": '
                     f'{json.dumps(recorded)}; the modes are "{BY_INDEX}" and "{IN_ORDER}". '
                     "Restore the record (the step's dataset item, or dataset.json), or start a "
                     'new run in another --workdir.')
  by_index = source.reads_by_index(_train_split(data_cfg, pi, pc), decode=bool(data_cfg.cache))
  mode = BY_INDEX if by_index else IN_ORDER
  if recorded is None or recorded == mode:
    return mode
  if recorded == IN_ORDER and source.reads_in_order_as_before:
    return IN_ORDER
  was = (f'This run read {source.name} {recorded.replace("_", " ")} from its start (its '
         f'checkpoints\' dataset record: "read": "{recorded}"), but ')
  lost = 'resuming would train on other batches than an uninterrupted run.'
  new_run = 'start a new run in another --workdir.'
  if recorded == BY_INDEX:
    raise ValueError(
        f'{was}it can now be read in order only (its ArrayRecord files are missing or cannot be '
        f'read): {lost} Write its ArrayRecord files again (python -m vit_jax.to_array_record '
        f'{source.builder.data_dir}) and rerun, or {new_run}')
  raise ValueError(f'{was}its TFRecord files are gone (ArrayRecord files only): {lost} Restore '
                   f'the TFRecord files it was prepared with and rerun, or {new_run}')


def create_train_iterator(data_cfg, global_batch_size: int, seed: int, start_step: int = 0, *,
                          read: Optional[str] = None, process_index: Optional[int] = None,
                          process_count: Optional[int] = None) -> TrainIterator:
  """This process's training batches, ``b`` = global / process count: ``'image'`` float32
  ``[b, S, S, 3]`` (normalized), ``'labels'`` float32 ``[b, C]`` (one- or multi-hot, mixed).

  Deterministic: ``start_step=k`` yields exactly steps k, k+1, ... of an uninterrupted run (tfds
  in 'skip' mode: if nothing was dropped before), read as :func:`train_read_mode` says (``read``:
  the resumed run's mode; docs/data.md, "Resuming in constant time").

  Raises ValueError (batch size not a multiple of the process count, invalid config, empty split,
  a ``read`` that cannot be kept) or as :func:`get_info`; ``next()``: ``BadImageError`` in
  'fail' mode.
  """
  pi, pc, b = _processes(process_index, process_count, global_batch_size)
  if start_step < 0:
    raise ValueError(f'start_step must be >= 0, got {start_step}.')
  source = sources.get_source(data_cfg)
  split = _train_split(data_cfg, pi, pc)
  mode = train_read_mode(data_cfg, read, process_index=pi, process_count=pc)
  cache = bool(data_cfg.cache)
  n = _num_examples(source, split, 'config.data.train_split')
  empty = ValueError(f'Process {pi}/{pc} has no training examples in {data_cfg.train_split!r} of '
                     f'{source.name!r}.')
  if n == 0:
    raise empty
  # Logged before the decoded images fill the memory (config.data.cache).
  shuffle = (None if mode == BY_INDEX
             else memory.estimate_shuffle_memory(data_cfg, source, split, n))
  in_memory = (memory.estimate_in_memory(source, split, n) if mode == BY_INDEX and cache
               else (0, 0))
  memory.log_input_memory(memory.estimate_input_memory(
      data_cfg, b, source.label.num_classes, shuffle=shuffle, in_memory_bytes=in_memory[0],
      in_memory_sampled=in_memory[1]), f' (process {pi} of {pc})')
  access = source.random_access(split, decode=cache) if mode == BY_INDEX else None
  if access is not None:
    n = access.num_examples  # 'skip' mode with the cache: without the undecodable images.
    if n == 0:
      raise empty
  start_epoch, offset = divmod(start_step * b, n)
  mask = 2**63 - 1  # The root key, int64 [2], of any Python int seed.
  run_key = tf.constant([(int(seed) >> 63) & mask, int(seed) & mask], tf.int64)
  shuffle_root = preprocess.fold_in(run_key, 0)
  epochs = tf.data.Dataset.range(start_epoch, 2**62)
  if access is None:  # In order: each epoch's files and a buffer shuffled by its key.
    if cache:  # Decoded, un-augmented images, shared by all epochs.
      cached = source.drop_undecodable(source.read(split, decode=True)).cache()

    @tf.autograph.experimental.do_not_convert
    def epoch_examples(epoch):
      key = preprocess.fold_in(shuffle_root, epoch)
      ds = cached if cache else source.read(split, decode=False, file_seed=key[0])
      ds = ds.shuffle(min(data_cfg.shuffle_buffer, n), seed=key[1], reshuffle_each_iteration=False)
      return ds.enumerate(start=epoch * _EPOCH_STRIDE)
    ds = epochs.flat_map(epoch_examples)
    if offset:
      drops = (f'reads and drops the {offset:,} examples of epoch {start_epoch} before it '
               f'({100 * offset / n:.0f}% of an epoch)')
      if source.reads_by_index(split, decode=cache):  # Kept: the run started in order.
        logging.warning(
            'Resuming at step %d: %s is read in order, as this run was from its start (its '
            'checkpoints\' dataset record: "read": "%s"), though it can now be read by index, so '
            'that its batches are those of an uninterrupted run: the input %s. A run started in a '
            'new --workdir reads it by index.', start_step, source.name, IN_ORDER, drops)
      else:
        logging.warning(
            'Resuming at step %d: %s is read in order (TFRecord), so the input %s before the '
            'first batch. `python -m vit_jax.to_array_record %s` adds ArrayRecord files, read by '
            'index by the runs started after it (they resume in constant time); this run goes on '
            'reading in order, as it started, for the batches of an uninterrupted run '
            '(docs/data.md).', start_step, source.name, drops, source.builder.data_dir)
      ds = ds.skip(offset)
  else:
    if start_step:
      logging.info('Resuming at step %d: %s is read by index, so the input starts at once at '
                   'example %s of epoch %d (%.0f%% of an epoch).', start_step, source.name,
                   f'{offset:,}', start_epoch, 100 * offset / n)

    @tf.autograph.experimental.do_not_convert
    def epoch_positions(epoch):
      key = preprocess.fold_in(shuffle_root, epoch)
      first = tf.where(epoch == start_epoch, tf.constant(offset, tf.int64), 0)
      positions = tf.data.Dataset.range(first, n)
      return positions.map(lambda p: (epoch * _EPOCH_STRIDE + p, tf.random.experimental
                                      .index_shuffle(p, key, tf.constant(n - 1, tf.int64))))
    ds = access.read(epochs.flat_map(epoch_positions))
  maps = train_maps.TrainMaps(data_cfg, source, run_key)
  if not maps.vectorized or maps.encoded or source.label.multi_label:
    ds = ds.map(maps.per_example, num_parallel_calls=data_cfg.num_parallel_calls)
    if maps.encoded:
      ds = source.drop_undecodable(ds)
  ds = ds.batch(b, drop_remainder=True)
  ds = ds.map(maps.per_batch, num_parallel_calls=data_cfg.num_parallel_calls)
  ds = ds.prefetch(data_cfg.prefetch).with_options(_OPTIONS)
  return TrainIterator(ds, b, n, lambda error: source.bad_image_error(
      error, split, data_cfg.train_split))


class EvalDataset:
  """Re-iterable eval data, each pass in the same order: ``'image'`` float32 ``[b, S, S, 3]``,
  ``'labels'`` float32 ``[b, C]``, ``'mask'`` bool ``[b]`` (False: padding, unlabeled ReaL);
  ``num_batches`` (``len()``) is the same on every process. Raises ``BadImageError`` ('fail')."""

  def __init__(self, dataset: tf.data.Dataset, num_batches: int, diagnose: _Diagnose):
    self.dataset = dataset
    self.num_batches = num_batches
    self._diagnose = diagnose

  def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
    return _Batches(self.dataset, self._diagnose)

  def __len__(self) -> int:
    return self.num_batches


def create_eval_dataset(data_cfg, global_batch_size: int, *, split: Optional[str] = None,
                        process_index: Optional[int] = None,
                        process_count: Optional[int] = None) -> EvalDataset:
  """The :class:`EvalDataset` of this process's part of ``split`` (default ``eval_split``).

  Every example once over all processes, padded with masked zeros to ``ceil(max_p n_p / b)``
  batches on every process (an empty split: one masked batch); resized to S x S (official), or
  with ``eval_crop_pct`` resized and centre-cropped (timm).

  Raises ValueError (batch size not a multiple of the process count, bad split or config) or as
  :func:`get_info`; iterating: ``BadImageError`` in 'fail' mode.
  """
  pi, pc, b = _processes(process_index, process_count, global_batch_size)
  source = sources.get_source(data_cfg)
  split = data_cfg.eval_split if split is None else split
  per_process = [split] if pc == 1 else tfds.even_splits(split, n=pc, drop_remainder=False)
  counts = [_num_examples(source, s, 'config.data.eval_split') for s in per_process]
  if not max(counts):
    logging.warning('Eval split %r of %r is empty: yielding one fully-masked batch per pass.',
                    split, source.name)
  num_batches = max(1, math.ceil(max(counts) / b))
  n = counts[pi]
  label = source.label
  cache = bool(data_cfg.cache)
  encoded = (not cache) and source.images_encoded_after_read
  vectorized = source.static_image_hw is not None  # Resize per batch.

  @tf.autograph.experimental.do_not_convert
  def per_example(ex):
    if vectorized:  # Only decode here; resize per batch.
      image = source.decode(ex['image'], encoded) if encoded else ex['image']
    else:
      image = preprocess.eval_image(ex['image'], encoded=encoded, size=data_cfg.image_size,
                                    normalization=None, crop_pct=data_cfg.eval_crop_pct)
    lab = ex['label']
    mask = tf.size(lab) > 0 if label.mask_unlabeled_eval else tf.constant(True)
    if label.multi_label:
      lab = preprocess.targets(lab, label.num_classes, True)
    return {'image': image, 'label': lab, 'mask': mask, '_real': tf.constant(True)}

  @tf.autograph.experimental.do_not_convert
  def per_batch(ex):
    image = ex['image']
    if vectorized:
      image = preprocess.resize_and_center_crop(image, data_cfg.image_size, data_cfg.eval_crop_pct)
    labels = ex['label'] if label.multi_label else preprocess.targets(
        ex['label'], label.num_classes, False)
    real = ex['_real']
    image = preprocess.normalize(image, data_cfg.normalization)
    return {'image': tf.where(real[:, None, None, None], image, 0.),
            'labels': tf.where(real[:, None], labels, 0.), 'mask': ex['mask']}

  # Padding ('_real' False): zero examples with mask=False, structured like per_example's.
  s = data_cfg.image_size
  pad_element = {
      'image': (tf.zeros([*source.static_image_hw, 3], tf.uint8) if vectorized
                else tf.zeros([s, s, 3], tf.float32)),
      'label': (tf.zeros([label.num_classes], tf.float32) if label.multi_label
                else tf.zeros([], tf.int64)),
      'mask': tf.constant(False), '_real': tf.constant(False),
  }
  # Enough padding for num_batches full batches, even if examples are dropped.
  padding = tf.data.Dataset.from_tensors(pad_element).repeat()
  if n:
    ds = source.read(per_process[pi], decode=cache)
    if cache:
      ds = source.drop_undecodable(ds).cache()
    ds = ds.map(per_example, num_parallel_calls=data_cfg.num_parallel_calls)
    if encoded:
      ds = source.drop_undecodable(ds)
    ds = ds.concatenate(padding)
  else:  # More processes than examples (tfds cannot read an empty split).
    ds = padding
  ds = ds.take(num_batches * b).batch(b, drop_remainder=True)
  ds = ds.map(per_batch, num_parallel_calls=data_cfg.num_parallel_calls)
  ds = ds.prefetch(data_cfg.prefetch).with_options(_OPTIONS)
  return EvalDataset(ds, num_batches, lambda error: source.bad_image_error(
      error, per_process[pi], split))
