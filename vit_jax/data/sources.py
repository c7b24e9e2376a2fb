"""Dataset sources: ``config.data`` -> a tfds builder (a registered name, prepared offline only,
a prepared directory, or an image folder ``root/<split>/<class>/*.{jpg,jpeg,png}``) whose splits
read as ``{'image', 'label'}``; bad image files: :mod:`vit_jax.data.bad_images`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax import config as config_lib
from vit_jax import storage
from vit_jax.data import bad_images
from vit_jax.data import preprocess

SplitArg = Any  # str or tfds AbstractSplit (e.g. a tfds.even_splits item).


@dataclasses.dataclass(frozen=True)
class LabelSpec:
  """The label feature ``key``: C = ``num_classes`` targets ``[C]``, multi-hot when
  ``multi_label`` (``Sequence(ClassLabel)``); ``mask_unlabeled_eval``: eval examples without a
  label are masked (ImageNet ReaL); ``names``: the C class names in label order."""
  key: str
  num_classes: int
  multi_label: bool
  mask_unlabeled_eval: bool = False
  names: Tuple[str, ...] = ()


def looks_like_path(name: str) -> bool:
  if name.startswith(('/', '.', '~')) or storage.is_remote(name):
    return True
  return '/' in name and os.path.isdir(name)


def find_builder_dir(path: str) -> str:
  """The folder holding dataset_info.json at `path`, else the largest version at most two
  levels down (`<data_dir>/<name>[/<config>]`)."""
  path = storage.normalize(path)
  if storage.exists(storage.join(path, 'dataset_info.json')):
    return path
  candidates = sorted(
      storage.glob(storage.join(path, '*', 'dataset_info.json')) +
      storage.glob(storage.join(path, '*', '*', 'dataset_info.json')))
  if not candidates:
    raise FileNotFoundError(
        f'config.data.name={path!r} looks like a path, but no prepared tfds '
        'dataset (a folder with dataset_info.json, e.g. '
        '~/tensorflow_datasets/mnist/3.0.1) was found there or below.')
  return storage.dirname(candidates[-1])


def _prepare(builder, name: str, data_cfg) -> None:
  """Prepares `builder` offline, or raises FileNotFoundError saying how."""
  where = data_cfg.data_dir or '$TFDS_DATA_DIR or ~/tensorflow_datasets'
  build_hint = (f'Prepare it where there is network access (`tfds build {name} --data_dir=DIR`), '
                'copy DIR here and set config.data.data_dir=DIR.')
  if not data_cfg.prepare:
    raise FileNotFoundError(
        f'Dataset {name!r} is not prepared in {where} and config.data.prepare is False. Set '
        f'prepare=True (offline builders only) or: {build_hint}')
  if not (getattr(builder, 'VIT_JAX_OFFLINE', False)
          or getattr(builder, 'MANUAL_DOWNLOAD_INSTRUCTIONS', None)):
    raise FileNotFoundError(
        f'Dataset {name!r} is not prepared in {where}, and vit_jax never downloads datasets (its '
        f'builder needs the network). {build_hint}')
  manual_dir = storage.normalize(data_cfg.manual_dir) if data_cfg.manual_dir else None
  download_config = tfds.download.DownloadConfig(manual_dir=manual_dir, try_download_gcs=False)
  try:
    builder.download_and_prepare(download_config=download_config)
  except Exception as e:  # Let it through, with a hint.
    e.add_note(f'vit_jax: preparing {name!r} into {where} failed (manual_dir='
               f'{data_cfg.manual_dir!r}). Nothing is downloaded: put the source files in '
               'config.data.manual_dir. ' + build_hint)
    raise


#: Indices read per Python call from an ArrayRecord dataset.
_READ_BATCH = 64


@dataclasses.dataclass(frozen=True)
class RandomAccess:
  """A split read by example index: ``num_examples``, and ``read(ds)``, which maps a dataset of
  int64 ``(id, index)`` pairs (index in ``[0, num_examples)``) to ``(id, {'image', 'label'})``
  as :meth:`Source.read` yields them, in order."""
  num_examples: int
  read: Callable[[tf.data.Dataset], tf.data.Dataset]


def _by_index(num_examples: int,
              example: Callable[[tf.Tensor], Dict[str, tf.Tensor]]) -> RandomAccess:
  """The `RandomAccess` whose example at an int64 index is ``example(index)``."""
  return RandomAccess(num_examples, lambda ds: ds.map(lambda i, index: (i, example(index)),
                                                      num_parallel_calls=tf.data.AUTOTUNE))


def _indexed(arrays: List[np.ndarray], *, batches: bool = False
             ) -> Callable[[tf.Tensor], tf.Tensor]:
  """``index -> example`` (int64 scalar index) of ``arrays`` held in memory: batches ``[B, ...]``
  of one shape (``batches``), concatenated; else one array per example (one rank and dtype),
  stacked when their shapes agree, else end to end with their offsets and shapes. Empties
  ``arrays`` as it copies them (at most two copies at once)."""
  shapes = None if batches else np.array([a.shape for a in arrays], np.int64).reshape(
      len(arrays), arrays[0].ndim)
  if shapes is None or (shapes == shapes[0]).all():
    held = np.concatenate(arrays) if batches else np.stack(arrays)
    arrays.clear()
    held = tf.constant(held)
    return lambda i: tf.gather(held, i)
  known = [int(d[0]) if (d == d[0]).all() else None for d in shapes.T]  # E.g. [-, -, 3].
  flat = np.concatenate([a.reshape(-1) for a in arrays])
  arrays.clear()
  flat = tf.constant(flat)
  sizes = shapes.prod(axis=1)
  starts = tf.constant(np.cumsum(sizes) - sizes)
  sizes = tf.constant(sizes)
  shapes = tf.constant(shapes)
  return lambda i: tf.ensure_shape(
      tf.reshape(tf.slice(flat, [starts[i]], [sizes[i]]), shapes[i]), known)


@dataclasses.dataclass(eq=False)
class Source:
  """A tfds builder (or image folder) ``name`` with its ``image_key`` and ``label``
  (:class:`LabelSpec`); an image folder's ``{split: examples}``; ``skipped_images``: its
  undecodable files left out (``bad_images='skip'``)."""
  builder: Any
  name: str
  image_key: str
  label: LabelSpec
  image_folder_examples: Optional[Dict[str, list]] = None
  bad_images: str = 'fail'
  skipped_images: Tuple[str, ...] = ()
  # repr(split) -> its ArrayRecord data source or None (`_array_records`, probed once).
  _records: Dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

  @property
  def num_skipped_images(self) -> Optional[int]:
    """Images left out as undecodable; None for tfds in 'skip' mode (not known in advance)."""
    return len(self.skipped_images) if self.is_image_folder or self.bad_images == 'fail' else None

  def drop_undecodable(self, ds: tf.data.Dataset) -> tf.data.Dataset:
    """After the decoding map: tfds in 'skip' mode drops the examples whose decoding raised."""
    drops = (self.bad_images == 'skip' and not self.is_image_folder
             and self.images_encoded_after_read)
    return ds.ignore_errors(log_warning=True) if drops else ds

  def bad_image_error(self, error: Exception, split: SplitArg,
                      split_name: Optional[str] = None) -> Optional[bad_images.BadImageError]:
    """``error`` (a ``tf.errors.OpError`` reading ``split``) as :func:`bad_images.decoding_error`
    explains it (an image folder's: naming the undecodable files), or None."""
    paths = self._folder_split(split)[0] if self.is_image_folder else None
    if split_name is None:
      split_name = str(split)
    return bad_images.decoding_error(error, self.name, split_name, self.bad_images, paths)

  @property
  def is_image_folder(self) -> bool:
    return self.image_folder_examples is not None

  def num_examples(self, split: SplitArg) -> int:
    """Number of examples of `split` (a spec like 'train[:10%]' or subsplit)."""
    if self.is_image_folder:
      return len(self._folder_split(split)[0])
    return int(self.builder.info.splits[split].num_examples)

  def _folder_split(self, split) -> Tuple[List[str], List[int]]:
    """Image folders: (paths, labels) of `split` in file order, in 'skip' mode without the
    undecodable files."""
    infos = {name: tfds.core.SplitInfo(name=name, shard_lengths=[len(exs)], num_bytes=0)
             for name, exs in self.image_folder_examples.items()}
    instructions = tfds.core.splits.AbstractSplit.from_spec(split).to_absolute(infos)
    examples = []
    for ai in instructions:
      examples.extend(self.image_folder_examples[ai.splitname][ai.from_:ai.to])
    str2int = self.builder.info.features['label'].str2int
    return [e.image_path for e in examples], [str2int(e.label) for e in examples]

  @property
  def images_encoded_after_read(self) -> bool:
    """Whether `read(decode=False)` yields encoded bytes (image folders: tfds's uint8 Image)."""
    feature = self.builder.info.features[self.image_key]
    return (isinstance(feature, tfds.features.Image) and tf.as_dtype(feature.np_dtype) == tf.uint8)

  def read(self, split: SplitArg, *, decode: bool,
           file_seed: Optional[tf.Tensor] = None) -> tf.data.Dataset:
    """``split`` as a finite dataset of ``{'image', 'label'}``: uint8 ``[H, W, 3]`` images when
    ``decode`` (else maybe encoded tf.string), int64 labels ``[]`` (multi-label ``[None]``); an
    int64 ``file_seed`` shuffles the order of TFRecord files."""
    if self.is_image_folder or not self._reads_in_order:  # By index, in order.
      ds = self.random_access(split, decode=False).read(
          tf.data.Dataset.range(self.num_examples(split)).map(lambda i: (i, i)))
      ds = ds.map(lambda _, ex: ex)
    else:
      shuffle_files = file_seed is not None
      reshuffle = False if shuffle_files else None
      read_config = tfds.ReadConfig(shuffle_seed=file_seed,
                                    shuffle_reshuffle_each_iteration=reshuffle)
      ds = self.builder.as_dataset(split=split, shuffle_files=shuffle_files,
                                   decoders=self._decoders, read_config=read_config)
      ds = ds.map(lambda ex: {'image': ex[self.image_key], 'label': ex[self.label.key]})
    if decode or not self.images_encoded_after_read:
      encoded = self.images_encoded_after_read
      ds = ds.map(
          lambda ex: {'image': self.decode(ex['image'], encoded), 'label': ex['label']},
          num_parallel_calls=tf.data.AUTOTUNE)
    return ds

  @property
  def _decoders(self) -> Optional[Dict[str, Any]]:
    """tfds decoders that keep encoded images encoded."""
    return ({self.image_key: tfds.decode.SkipDecoding()}
            if self.images_encoded_after_read else None)

  @property
  def _reads_in_order(self) -> bool:
    """Whether tf.data reads this tfds dataset's files (TFRecord; not ArrayRecord only)."""
    return tfds.core.file_adapters.ADAPTER_FOR_FORMAT[
        self.builder.info.file_format].SUPPORTS_TF_DATA

  @property
  def has_array_record(self) -> bool:
    """Whether this tfds dataset has ArrayRecord files (readable by index, local or gs://)."""
    return not self.is_image_folder and (tfds.core.FileFormat.ARRAY_RECORD
                                         in self.builder.info.available_file_formats())

  def reads_by_index(self, split: SplitArg, *, decode: bool) -> bool:
    """Whether :meth:`random_access` reads ``split`` (cheap: nothing is decoded)."""
    return decode or self.is_image_folder or self._array_records(split) is not None

  @property
  def reads_in_order_as_before(self) -> bool:
    """Whether :meth:`read` goes through the files as a run that read them in order did: TFRecord
    files or an image folder's list (not ArrayRecord only)."""
    return self.is_image_folder or self._reads_in_order

  def random_access(self, split: SplitArg, *, decode: bool) -> Optional[RandomAccess]:
    """``split`` read by index: with ``decode`` decoded into memory once (any source), else an
    image folder's files or ArrayRecord files; None where it cannot be (TFRecord files only, or
    as :meth:`_array_records`, which raises FileNotFoundError)."""
    if decode:
      return self._in_memory(split)
    if self.is_image_folder:
      paths, labels = self._folder_split(split)
      paths = tf.constant(paths, tf.string)
      labels = tf.constant(labels, tf.int64)
      return _by_index(int(paths.shape[0]), lambda index: {
          'image': tf.io.read_file(tf.gather(paths, index)), 'label': tf.gather(labels, index)})
    records = self._array_records(split)
    if records is None:
      return None
    if storage.is_remote(self.builder.data_dir):
      logging.warning(
          '%s is read by index straight from %s: array_record asks the bucket for the rest of '
          'the file at every random read, many times the record\'s bytes (docs/data.md, "Reading '
          'from a bucket"). On a pod, mount the bucket with Cloud Storage FUSE and give its local '
          'path (launch/tpu.sh run does by default).', self.name, self.builder.data_dir)
    features = self.builder.info.features
    decoders = self._decoders
    encoded = self.images_encoded_after_read

    def finish(serialized):
      example = features.deserialize_example(serialized, decoders=decoders)
      image = example[self.image_key]
      return {'image': image if encoded else self.decode(image, False),
              'label': example[self.label.key]}

    # One Python call reads _READ_BATCH records (in parallel); see
    # `pipeline._close_live_iterators` for Python inside tf.data.
    def fetch(ids, indices):
      serialized = tf.numpy_function(lambda i: np.array(records.__getitems__(i.tolist()), object),
                                     [indices], tf.string, stateful=False)
      return ids, tf.ensure_shape(serialized, [None])
    return RandomAccess(len(records), lambda ds: ds.batch(_READ_BATCH).map(
        fetch, num_parallel_calls=tf.data.AUTOTUNE).unbatch().map(
            lambda i, serialized: (i, finish(serialized)), num_parallel_calls=tf.data.AUTOTUNE))

  def _array_records(self, split: SplitArg) -> Any:
    """``split``'s ArrayRecord data source (serialized examples, probed once), or None: no
    ArrayRecord files, or unreadable ones beside TFRecord files (a warning names the fix).
    FileNotFoundError: unreadable ArrayRecord files and no TFRecord ones (naming the fix)."""
    key = repr(split)
    if key in self._records:
      return self._records[key]
    records = None
    if self.has_array_record:
      info = self.builder.info
      primary = info.file_format
      records = self.builder.as_data_source(
          split, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES,
          file_format=tfds.core.FileFormat.ARRAY_RECORD)
      # as_data_source made ArrayRecord the info's format: TFRecord again for `read` (evaluation).
      info.set_file_format(primary, override=True, override_if_initialized=True)
      try:
        first = [0] if len(records) else []
        records.__getitems__(first)
      except (RuntimeError, OSError) as e:  # A damaged shard, or a bucket that cannot be read.
        message = (f'The ArrayRecord files of {self.name} cannot be read ({e}): a damaged shard: '
                   f'rerun `python -m vit_jax.to_array_record {self.builder.data_dir}`, which '
                   'writes it again; in a bucket: check that this machine can read it.')
        if not self._reads_in_order:
          raise FileNotFoundError(message) from e
        logging.warning('%s %s is read in order from its TFRecord files instead.', message,
                        self.name)
        records = None
    self._records[key] = records
    return records

  def _in_memory(self, split: SplitArg) -> RandomAccess:
    """``split`` decoded once into memory ('skip' mode: without the undecodable images), held as
    :func:`_indexed` says (read in batches for one static size and single labels)."""
    ds = self.drop_undecodable(self.read(split, decode=True))
    batches = self.static_image_hw is not None and not self.label.multi_label
    parts = list((ds.batch(1024) if batches else ds).as_numpy_iterator())
    if not parts:  # Nothing to read (the pipelines refuse an empty split before reading).
      return RandomAccess(0, lambda positions: positions.take(0))
    n = sum(len(part['label']) for part in parts) if batches else len(parts)
    columns = {k: [part[k] for part in parts] for k in ('image', 'label')}
    del parts
    example = {k: _indexed(columns.pop(k), batches=batches) for k in ('image', 'label')}
    return _by_index(n, lambda index: {k: get(index) for k, get in example.items()})

  def decode(self, image: tf.Tensor, encoded: bool) -> tf.Tensor:
    """`preprocess.decode_rgb` + the static [H, W, 3] shape when known."""
    image = preprocess.decode_rgb(image, encoded)
    hw = self.static_image_hw
    return image if hw is None else tf.ensure_shape(image, [*hw, 3])

  @property
  def static_image_hw(self) -> Optional[Tuple[int, int]]:
    """(H, W) if every image of the dataset has that size (from the features; image folders:
    None)."""
    shape = getattr(self.builder.info.features[self.image_key], 'shape', None)
    if shape is None or len(shape) != 3 or None in shape[:2]:
      return None
    return int(shape[0]), int(shape[1])


def _label_spec(builder, name: str, label_key: Optional[str]) -> LabelSpec:
  features = builder.info.features
  if label_key is None:
    is_real = name.split('/')[0].split(':')[0] == 'imagenet2012_real'
    keys = ('real_label', 'label', 'labels') if is_real else ('label', 'labels')
    label_key = next((k for k in keys if k in features), None)
    if label_key is None:
      raise KeyError(f'Dataset {name!r} has no "label" or "labels" feature; set '
                     f'config.data.label_key to one of {sorted(features.keys())}.')
  if label_key not in features:
    raise KeyError(f'config.data.label_key={label_key!r} is not a feature of {name!r}; '
                   f'features: {sorted(features.keys())}.')
  feature = features[label_key]
  multi_label = isinstance(feature, tfds.features.Sequence)
  classes = feature.feature if multi_label else feature
  if isinstance(classes, tfds.features.ClassLabel):
    return LabelSpec(label_key, classes.num_classes, multi_label,
                     mask_unlabeled_eval=multi_label and label_key == 'real_label',
                     names=tuple(classes.names))
  raise TypeError(f'Feature {label_key!r} of {name!r} is a {type(feature).__name__}; expected '
                  'tfds.features.ClassLabel (single label) or tfds.features.Sequence(ClassLabel) '
                  '(multi-label).')


@contextlib.contextmanager
def _folder_names_without_slashes():
  """Strips the '/' that TensorFlow's ``listdir`` ends gs:// folder names with ('train/', 'cat/')
  while tfds's ImageFolder lists the splits and classes."""
  # pylint: disable=protected-access
  module = tfds.folder_dataset.image_folder
  listed = module._list_folders
  module._list_folders = lambda root: [name.rstrip('/') for name in listed(root)]
  try:
    yield
  finally:
    module._list_folders = listed


def tfds_builder(name: str, data_dir: Optional[str] = None):
  """The tfds builder of a prepared dataset's directory (`looks_like_path`) or of a registered
  `name` in `data_dir`, with the file formats its dataset_info.json lists (ArrayRecord added by
  `python -m vit_jax.to_array_record` included). FileNotFoundError: a path without a prepared
  dataset; ValueError: neither a registered name nor a directory."""
  if looks_like_path(name):
    return tfds.builder_from_directory(find_builder_dir(name))
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise ValueError(
        f'config.data.name={name!r} is neither a registered tfds dataset nor a directory. Use '
        'a tfds name (e.g. cifar10, imagenet2012, fashion_mnist_local), the path of a prepared '
        'tfds dataset, or --config.data.image_folder=ROOT for ROOT/{train,test}/<class>/*.jpg.'
    ) from None
  _restore_file_formats(builder)
  return builder


def _restore_file_formats(builder) -> None:
  """Copies the file formats of a registered builder's dataset_info.json into
  `info.alternative_file_formats`, where tfds 4.9 misses ArrayRecord files added later."""
  info = builder.info
  known = info.alternative_file_formats  # The list itself (tfds's property).
  for value in info.as_proto.alternative_file_formats:
    file_format = tfds.core.FileFormat.from_value(value)
    if file_format not in known:
      known.append(file_format)


def _make_source(data_cfg) -> Source:
  """Builds the `Source` for `config.data` (uncached)."""
  name = data_cfg.name
  mode = data_cfg.bad_images
  if data_cfg.image_folder:
    root = storage.normalize(data_cfg.image_folder)
    if not storage.isdir(root):
      raise FileNotFoundError(
          f'config.data.image_folder={data_cfg.image_folder!r} is not a directory; it should '
          'hold <split>/<class>/*.{jpg,jpeg,png}, e.g. train/cat/1.jpg and test/cat/2.jpg.')
    try:
      with _folder_names_without_slashes():
        builder = tfds.folder_dataset.ImageFolder(root)
    except UnicodeDecodeError:  # TensorFlow's file API lists names as UTF-8 only.
      raise bad_images.non_utf8_folder_error(root) from None
    if not builder.info.splits:
      raise FileNotFoundError(f'No images found under {root}/<split>/<class>/*.{{jpg,jpeg,png}}.')
    label = _label_spec(builder, root, data_cfg.label_key or 'label')
    # Reading the per-split file lists ourselves gives split slicing and reading by index.
    examples = dict(builder._split_examples)  # pylint: disable=protected-access
    image_paths = [e.image_path for exs in examples.values() for e in exs]
    skipped = bad_images.folder_skips(root, image_paths, mode)
    left_out = set(skipped)
    examples = {split: [e for e in exs if e.image_path not in left_out]
                for split, exs in examples.items()}
    return Source(builder, root, 'image', label, image_folder_examples=examples,
                  bad_images=mode, skipped_images=skipped)
  if not name:
    raise ValueError('Set config.data.name (or config.data.image_folder).')
  builder = tfds_builder(name, data_cfg.data_dir)
  if not builder.is_prepared():
    _prepare(builder, name, data_cfg)
    _restore_file_formats(builder)
  if data_cfg.image_key not in builder.info.features:
    raise KeyError(f'config.data.image_key={data_cfg.image_key!r} is not a feature of {name!r}; '
                   f'features: {sorted(builder.info.features)}.')
  return Source(builder, name, data_cfg.image_key, _label_spec(builder, name, data_cfg.label_key),
                bad_images=mode)


_SOURCES = {}
_CHECKED = set()  # The `config.data` values `config.validate_data` accepted.


def get_source(data_cfg) -> Source:
  """The (memoized) :class:`Source` of ``config.data``, prepared (and in 'skip' mode validated),
  after ``config.validate_data`` (once per values).

  Raises:
    FileNotFoundError: not prepared nor preparable offline; missing files; dangling links.
    KeyError, TypeError: unusable image or label feature.
    ValueError: an invalid field (``config.validate_data``); a file name that is not UTF-8.
  """
  values = repr(tuple(data_cfg.items()))  # Hashable, and 224.0 is not 224.
  if values not in _CHECKED:
    config_lib.validate_data(data_cfg)
    _CHECKED.add(values)
  key = (data_cfg.name, data_cfg.image_folder, data_cfg.data_dir, data_cfg.manual_dir,
         bool(data_cfg.prepare), data_cfg.image_key, data_cfg.label_key, data_cfg.bad_images)
  if key not in _SOURCES:
    _SOURCES[key] = _make_source(data_cfg)
  return _SOURCES[key]
