"""The data of ``python -m vit_jax.evaluate``: ``--data NAME[:SPLIT]``, ``--image-folder DIR``,
``--real`` (ImageNet ReaL) or a workdir's own, checked against the model (tfds is imported where
used: ``--help`` answers without it)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, List, Optional, Tuple

from vit_jax import storage

REAL_DATASET, REAL_SPLIT, REAL_LABEL_KEY = 'imagenet2012_real', 'validation', 'real_label'
REAL_CLASSES = 1000


@dataclasses.dataclass(frozen=True)
class EvalData:
  """The data to evaluate on: ``config`` is the model's ``config.data`` pointed at it (its
  ``eval_split`` = ``split``); ``name`` the tfds name or directory, or the image folder;
  ``multi_label``: multi-hot labels (precision@1, no confusion matrix); ``num_examples``
  counts ReaL's unlabelled ones (masked)."""

  config: Any
  name: str
  split: str
  num_classes: int
  multi_label: bool
  label_names: Tuple[str, ...]
  num_examples: int
  label_key: str = 'label'

  @property
  def label(self) -> str:
    return f'{self.name}:{self.split}'


_VERSION = re.compile(r'^\d+(\.\d+)*$')


def _same_set_other_order(model_names, data_names) -> bool:
  """The same class names up to case and punctuation ('T-shirt/top' and 'T-shirt_top'), in
  another order (an image folder's classes are its folder names, sorted)."""
  model, data = ([re.sub(r'[^0-9a-z]+', '_', n.lower()).strip('_') for n in names]
                 for names in (model_names, data_names))
  return sorted(model) == sorted(data) and model != data


def parse_data(text: str) -> Tuple[str, Optional[str]]:
  """'cifar10:test[:50%]' -> ('cifar10', 'test[:50%]'); 'mnist:3.0.1' (a tfds version) and
  'gs://b/ds' stay names; 'cifar10' -> ('cifar10', None)."""
  prefix = storage.scheme(text)
  rest = text[len(prefix):]
  name, *tail = rest.split(':', 2)
  if tail and _VERSION.match(tail[0].split('[')[0]):  # name:VERSION[:SPLIT]
    name, tail = f'{name}:{tail[0]}', tail[1:]
  split = ':'.join(tail) if tail else None
  if not name:
    raise ValueError(f'--data {text!r}: expected NAME[:SPLIT], e.g. --data '
                     'fashion_mnist_local:test.')
  return prefix + name, split or None


def _splits(source) -> List[str]:
  return sorted(source.builder.info.splits.keys())


def _get_source(cfg, what: str):
  """``vit_jax.data.sources.get_source``, with this tool's flags in its messages."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from vit_jax.data import sources  # pylint: disable=g-import-not-at-top
  name = cfg.name or ''
  if name and not cfg.image_folder and not (name.startswith(('/', '.', '~'))
                                            or storage.is_remote(name) or os.path.isdir(name)):
    try:
      tfds.builder(cfg.name, data_dir=cfg.data_dir)
    except tfds.core.registered.DatasetNotFoundError:
      raise ValueError(
          f'{what}: no tfds dataset is registered under that name (nor is it a directory): '
          'give a tfds name (e.g. fashion_mnist_local, cifar10), the path of a prepared tfds '
          'dataset, or --image-folder DIR.') from None
  try:
    return sources.get_source(cfg)
  except FileNotFoundError as e:  # Not prepared: this tool's flag rather than the config key.
    message = str(e).replace('set config.data.data_dir=DIR', 'pass --data-dir DIR')
    if message == str(e):
      raise
    raise FileNotFoundError(message) from e


def _real_config(trained, split: Optional[str], data_dir: Optional[str]):
  """The data config of ``--real``, after checking the model and the prepared dataset."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if trained.num_classes != REAL_CLASSES:
    raise ValueError(f'--real scores the ImageNet ReaL labels of the {REAL_CLASSES} ImageNet '
                     f'classes; this model has {trained.num_classes} classes: evaluate it with '
                     '--data or --image-folder instead.')
  cfg = trained.data_config(name=REAL_DATASET, split=split or REAL_SPLIT,
                            label_key=REAL_LABEL_KEY, image_key='image')
  if data_dir:
    cfg.data_dir = data_dir
  if not tfds.builder(REAL_DATASET, data_dir=cfg.data_dir).is_prepared():
    where = cfg.data_dir or '$TFDS_DATA_DIR or ~/tensorflow_datasets'
    raise FileNotFoundError(
        f'--real: the tfds dataset {REAL_DATASET} is not prepared in {where}. It needs the '
        'ImageNet validation images, a manual download (ILSVRC2012_img_val.tar from '
        'image-net.org): put the file in DIR, run `tfds build imagenet2012_real '
        '--manual_dir=DIR --data_dir=DATA` and pass --data-dir DATA.')
  return cfg


def precheck(*, data: Optional[str] = None, image_folder: Optional[str] = None,
             split: Optional[str] = None) -> None:
  """Checks needing neither model nor data. Raises FileNotFoundError (``image_folder`` not a
  directory) or ValueError (``data`` not NAME[:SPLIT], or a second split)."""
  if image_folder and not storage.isdir(storage.normalize(image_folder)):
    raise FileNotFoundError(f'--image-folder {image_folder}: no such directory; give a folder '
                            'of <split>/<class>/*.jpg (e.g. test/cat/1.jpg).')
  if data:
    data_split = parse_data(data)[1]
    if data_split and split:
      raise ValueError(f'--data {data} names a split and --split {split} another: give one.')


def choose_data(trained, *, data: Optional[str] = None, image_folder: Optional[str] = None,
                split: Optional[str] = None, real: bool = False, data_dir: Optional[str] = None,
                skip_bad_images: bool = False) -> EvalData:
  """The :class:`EvalData` of ``data`` 'NAME[:SPLIT]', ``image_folder``, ``real`` or none (a
  workdir's training data), checked against ``trained``. Raises ValueError (no data, an unknown
  dataset or split, an empty split, another class count or order, conflicting arguments),
  FileNotFoundError (a missing or empty folder, a dataset not prepared), KeyError or TypeError
  (no usable label feature)."""
  if sum(bool(x) for x in (data, image_folder, real)) > 1:
    raise ValueError('Give one of --data, --image-folder and --real.')
  precheck(data=data, image_folder=image_folder, split=split)
  own = trained.config.data
  if real:
    cfg = _real_config(trained, split, data_dir)
    what = f'--real ({REAL_DATASET})'
  elif image_folder:
    cfg = trained.data_config(image_folder=image_folder)
    what = f'--image-folder {image_folder}'
  elif data:
    name, data_split = parse_data(data)
    split = split or data_split
    cfg = trained.data_config(name=name)
    what = f'--data {name}'
  elif trained.step is None:
    raise ValueError(f'{trained.description} is not a training workdir, so it has no dataset '
                     'of its own: give --data NAME[:SPLIT] or --image-folder DIR.')
  else:
    cfg = trained.data_config()
    what = f'the training data ({own.image_folder or own.name})'
  if data_dir:  # --real's is set already (its preparation is checked with it).
    cfg.data_dir = data_dir
  if skip_bad_images:
    cfg.bad_images = 'skip'
  source = _get_source(cfg, what)
  same_data = (cfg.name, cfg.image_folder) == (own.name, own.image_folder)
  split = (split or (same_data and own.eval_split)
           or next((s for s in ('test', 'validation') if s in _splits(source)), None))
  if not split:
    raise ValueError(f'{what} has no test or validation split (its splits: '
                     f'{", ".join(_splits(source))}): name one, e.g. --split train or --data '
                     'NAME:train[:10%].')
  try:
    count = source.num_examples(split)
  except Exception as e:  # pylint: disable=broad-except  (tfds: KeyError, ValueError, ...)
    raise ValueError(f'{what} has no split {split!r} (its splits: {", ".join(_splits(source))}): '
                     'choose one with --split or --data NAME:SPLIT.') from e
  if count == 0 and cfg.image_folder:
    pattern = f'{source.name}/{split}/<class>/*.{{jpg,jpeg,png}}'
    raise FileNotFoundError(f'{what}: split {split!r} has no images ({pattern}); choose '
                            'another split.')
  if count == 0:
    raise ValueError(f'{what}: split {split!r} has no examples; choose another split.')
  label = source.label
  if label.num_classes != trained.num_classes:
    shown = ', '.join(label.names[:5]) + (', ...' if len(label.names) > 5 else '')
    raise ValueError(
        f"{what} has {label.num_classes} classes ({shown}); the model's head has "
        f'{trained.num_classes}: evaluate it on data with the same {trained.num_classes} '
        'classes, in the same order.')
  names = trained.label_names
  if names and _same_set_other_order(names, label.names):
    raise ValueError(
        f"{what} has the model's classes in another order (the data's: "
        f"{', '.join(label.names[:3])}, ...; the model's: {', '.join(names[:3])}, ...; an image "
        "folder's classes are its folder names, sorted): give the data the model's class order "
        '(e.g. folders named 0_<name>, 1_<name>, ...).')
  cfg.eval_split = split
  return EvalData(cfg, source.name, split, label.num_classes, label.multi_label,
                  tuple(label.names), count, label.key)
