"""Predicts the classes of images with a trained model: ``python -m vit_jax.predict``; in Python,
``Predictor`` (``from vit_jax.predict import Predictor``). docs/evaluation.md shows both.

  python -m vit_jax.predict /tmp/vit_fmnist photo.png more_images/ [--top-k 5] [--json]
  python -m vit_jax.predict ViT-B_16.npz cat.jpg                   # ImageNet-21k names
  python -m vit_jax.predict ViT-B_16.npz cat.jpg --image-size 384  # its table resampled
  python -m vit_jax.predict 81.5_T2T_ViT_14.pth.tar cat.jpg --model T2T-ViT-14

Each image is preprocessed as the model's evaluation does and scored with a softmax (or
sigmoids for a model trained with a sigmoid loss). A folder stands for its image files and its
subfolders', sorted. Output: per image its path and the top-k classes; ``--json``: ``[{"path",
"predictions": [{"label", "index", "probability"}]}]``. Details: docs/evaluation.md.

Exit status: 0 when an image was predicted (one that cannot be decoded is skipped with a
``WARNING: skipped <path>: <reason>`` line); 2 bad input, one ``FATAL:`` line (a missing or
unusable SOURCE or path, a model that does not fit it, a folder without images, no decodable
image, bad flags); 1 a system error while predicting (e.g. a full disk, named).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from vit_jax import storage
from vit_jax.tools import common


class Prediction(NamedTuple):
  """One class of an image's prediction: ``label`` (name, or the number as text), ``index`` in
  ``[0, C)``, ``probability`` in [0, 1]."""
  label: str
  index: int
  probability: float


class Predictor:
  """A trained model, loaded once, that predicts the classes of images (local devices).
  ``source``: what ``vit_jax.inference.load`` reads (``load_kwargs``: its options), or a
  ``TrainedModel``. ``batch_size``: images per step (default the config's ``eval_batch_size``),
  rounded up to a multiple of the devices. Raises as ``load``; ValueError for ``batch_size`` < 1
  or load options with a loaded model."""

  def __init__(self, source: Any, *, batch_size: Optional[int] = None, **load_kwargs: Any):
    from vit_jax import inference  # pylint: disable=g-import-not-at-top
    if isinstance(source, inference.TrainedModel):
      if load_kwargs:
        raise ValueError(f'{sorted(load_kwargs)}: a loaded TrainedModel takes no load options.')
      trained = source
    else:
      trained = inference.load(source, **load_kwargs)
    if batch_size is not None:  # Rounded up to a multiple of the devices.
      import jax  # pylint: disable=g-import-not-at-top
      if int(batch_size) < 1:
        raise ValueError(f'batch_size={batch_size}: give 1 or more images per batch.')
      config = type(trained.config)(trained.config.to_dict())
      config.eval_batch_size = -(-int(batch_size) // jax.device_count()) * jax.device_count()
      trained = dataclasses.replace(trained, config=config)
    self.trained = trained
    self.runner = inference.Runner(trained)

  @property
  def label_names(self) -> Optional[Tuple[str, ...]]:
    return self.trained.label_names

  @property
  def image_size(self) -> int:
    return self.trained.image_size

  def preprocess(self, image: Any, name: Optional[str] = None) -> np.ndarray:
    return preprocess(self.trained, image, name)

  def inputs(self, images: Any) -> np.ndarray:
    """Images (one, a sequence, or ``[B, H, W, C]``; see :meth:`predict`) -> the model's float32
    ``[B, S, S, 3]`` inputs. Raises as :meth:`preprocess`."""
    if (isinstance(images, (str, bytes, os.PathLike)) or hasattr(images, 'convert')
        or isinstance(images, np.ndarray) and images.ndim in (2, 3)):
      images = [images]  # One image.
    images, size = list(images), self.image_size
    return (np.stack([self.preprocess(x) for x in images]) if images
            else np.zeros((0, size, size, 3), np.float32))

  def probabilities(self, images: Any) -> np.ndarray:
    """float32 ``[B, C]`` class probabilities of ``images`` (see :meth:`predict`)."""
    return self.trained.probabilities(self.runner.logits(self.inputs(images)))

  def features(self, images: Any) -> np.ndarray:
    """float32 ``[B, F]`` pre-logits of ``images`` (``vit_jax.inference.Runner.features``)."""
    return self.runner.features(self.inputs(images))

  def tokens(self, images: Any, **options: Any) -> np.ndarray:
    """Block outputs ``[B, N, D]`` of ``images`` (``vit_jax.inference.Runner.tokens``: its
    ``blocks``, ``norm``)."""
    return self.runner.tokens(self.inputs(images), **options)

  def patch_grid(self, images: Any, **options: Any) -> np.ndarray:
    """Patch tokens ``[B, gh, gw, D]`` of ``images`` (``vit_jax.inference.Runner.patch_grid``)."""
    return self.runner.patch_grid(self.inputs(images), **options)

  def predict(self, images: Any, top_k: int = 5) -> List[List[Prediction]]:
    """Per image (one, a sequence, or ``[B, H, W, C]``) its ``top_k`` :class:`Prediction`, most
    probable first (ties: the lower class). Raises as :meth:`preprocess`."""
    return self.top(self.probabilities(images), top_k)

  def predict_inputs(self, inputs: np.ndarray, top_k: int = 5) -> List[List[Prediction]]:
    """:meth:`predict` of already preprocessed inputs: float32 ``[B, S, S, 3]``."""
    return self.top(self.trained.probabilities(self.runner.logits(inputs)), top_k)

  def top(self, probabilities: np.ndarray, top_k: int) -> List[List[Prediction]]:
    """``[B, C]`` probabilities -> per row the ``top_k`` classes, most probable first."""
    if int(top_k) < 1:
      raise ValueError(f'top_k={top_k}: give 1 or more classes per image.')
    probabilities = np.asarray(probabilities)
    order = np.argsort(-probabilities, axis=-1, kind='stable')[:, :top_k]
    return [[Prediction(self.trained.label_name(int(i)), int(i), float(row[i])) for i in idx]
            for row, idx in zip(probabilities, order)]


def preprocess(trained: Any, image: Any, name: Optional[str] = None) -> np.ndarray:
  """One image (a path, bytes, a PIL image, an array ``[H, W]`` / ``[H, W, C]``) -> the float32
  ``[S, S, 3]`` input of ``trained``. Raises as ``vit_jax.data.files.eval_input``."""
  from vit_jax.data import files  # pylint: disable=g-import-not-at-top  (TensorFlow)
  data = trained.config.data
  return files.eval_input(image, size=int(data.image_size), normalization=data.normalization,
                          crop_pct=data.eval_crop_pct, name=name)


def _parser() -> common.Parser:
  parser = common.Parser(prog='python -m vit_jax.predict', description=__doc__)
  common.add_source_arguments(parser)
  parser.add_argument('images', nargs='+', metavar='IMAGE_OR_FOLDER',
                      help='image files, or folders of them (searched recursively)')
  parser.add_argument('--top-k', type=int, default=5, help='classes per image (default 5)')
  parser.add_argument('--json', action='store_true',
                      help='print one JSON document instead of text')
  parser.add_argument('--batch-size', type=int,
                      help="images per step (default: the model's eval batch)")
  return parser


def missing_image(arguments: Sequence[str]) -> Optional[FileNotFoundError]:
  """The error for the first local argument with nothing there (broken links too), or None."""
  for arg in arguments:
    if not storage.is_remote(arg) and not os.path.exists(arg):
      return FileNotFoundError(f'{arg} does not exist: give image files or folders of them.')
  return None


def image_paths(arguments: Sequence[str]) -> List[str]:
  """The image files of the IMAGE_OR_FOLDER arguments, each once, in argument order. Raises
  FileNotFoundError, or ValueError (a folder without images, a non-UTF-8 name)."""
  from vit_jax.data import files  # pylint: disable=g-import-not-at-top
  from vit_jax.data import bad_images  # pylint: disable=g-import-not-at-top
  found: Dict[str, None] = {}
  for arg in arguments:
    try:
      arg.encode('utf-8')  # A name that is not UTF-8 arrives with lone surrogates ('\udce9').
    except UnicodeEncodeError:
      raise bad_images.non_utf8_name_error(arg) from None
    if storage.isdir(arg):
      links: List[str] = []
      listed = files.list_images(arg, skipped_links=links)
      for link in links:
        print(f'WARNING: not entered {link}: a link to a folder already listed.',
              file=sys.stderr)
      if not listed:
        raise ValueError(f'{arg} has no image files ({" ".join(files.IMAGE_EXTENSIONS)}, in it '
                         'or its subfolders): give image files or a folder of them.')
      found.update(dict.fromkeys(listed))
    elif storage.exists(arg):
      found[arg] = None
    else:
      raise FileNotFoundError(f'{arg} does not exist: give image files or folders of them.')
  return list(found)


def _progress(done: int, total: int) -> None:
  """'predict: 128/1000 images' on stderr ('\\r'-updated on a terminal)."""
  tty = sys.stderr.isatty()
  print(f'{chr(13) if tty else ""}predict: {done}/{total} images', file=sys.stderr, flush=True,
        end='' if tty and done < total else '\n')


def _emit(text: str) -> None:
  """Writes ``text`` to stdout at once; OSError naming the fix if it cannot."""
  try:
    sys.stdout.write(text)
    sys.stdout.flush()
  except OSError as e:
    try:  # Where standard output goes: its file's path when it is one.
      target = os.readlink(f'/proc/self/fd/{sys.stdout.fileno()}')
    except (OSError, ValueError, AttributeError):
      target = ''
    where = f'{target} (standard output)' if target.startswith('/') else 'standard output'
    try:  # The unwritten rest would fail again when Python flushes at exit.
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, sys.stdout.fileno())
      os.close(devnull)
    except (OSError, ValueError, AttributeError):
      pass
    raise OSError(e.errno, f'writing the results to {where} failed: {e.strerror}. Free space '
                  'there or send the output elsewhere (> FILE on another disk).') from None


def _predict_paths(predictor: Predictor, paths: Sequence[str], batch: int, top_k: int,
                   as_json: bool) -> Tuple[int, List[Dict[str, Any]]]:
  """Predicts and prints ``paths`` batch by batch; returns the count predicted, JSON records."""
  from vit_jax.data import BadImageError  # pylint: disable=g-import-not-at-top
  trained = predictor.trained
  named = predictor.label_names is not None
  records = []
  predicted = 0
  for start in range(0, len(paths), batch):
    chunk = paths[start:start + batch]
    good = []
    inputs = []
    for path in chunk:
      try:
        special = storage.not_a_file(path)
        if special and os.path.exists(path) and not os.path.isdir(path):  # Links, folders: read.
          raise OSError(f'{path} is {special}, not an image file: reading it would wait forever.')
        inputs.append(predictor.preprocess(path))
        good.append(path)
      except (BadImageError, OSError) as e:  # The reason after the path: 'not a decodable ...'.
        reason = re.sub(f'^{re.escape(path)} (is )?', '', common.reason(e))
        print(f'WARNING: skipped {path}: {reason}', file=sys.stderr)
    if good and not as_json and not predicted:
      kind = 'sigmoid' if trained.config.loss == 'sigmoid_xent' else 'softmax'
      names = '' if trained.label_names else ', no class names'
      _emit(f'# {trained.description}: {trained.num_classes} classes ({kind}{names})\n\n')
    tops = predictor.predict_inputs(np.stack(inputs), top_k) if good else []
    for path, top in zip(good, tops):
      if as_json:
        records.append({'path': path, 'predictions': [
            {'label': p.label if named else None, 'index': p.index,
             'probability': p.probability} for p in top]})
      else:
        _emit('\n'.join([path] + [f'  {100 * p.probability:6.2f}%  '
                                  f'{p.label if named else f"class {p.index}"}' for p in top])
              + '\n\n')
    predicted += len(good)
    if len(paths) > batch:
      _progress(start + len(chunk), len(paths))
  return predicted, records


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  if args.top_k < 1:
    raise ValueError(f'--top-k {args.top_k}: give 1 or more classes per image.')
  if args.batch_size is not None and args.batch_size < 1:
    raise ValueError(f'--batch-size {args.batch_size}: give 1 or more images per batch.')
  paths = image_paths(args.images)
  trained = common.load_source(args)
  batch = min(args.batch_size or int(trained.config.eval_batch_size), len(paths))
  predictor = Predictor(trained, batch_size=batch)
  predicted, records = _predict_paths(predictor, paths, batch, args.top_k, args.json)
  if not predicted:
    raise ValueError(f'none of the {len(paths)} image file(s) could be decoded (see the '
                     'warnings above): give JPEG, PNG, GIF, BMP or WebP images.')
  if args.json:
    _emit(json.dumps(records, indent=1) + '\n')
  return 0


def run_main() -> None:
  """``python -m vit_jax.predict``: a missing image is refused before the set-up."""
  common.run_program(main, _parser, lambda args: missing_image(args.images))
