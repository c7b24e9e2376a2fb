"""Exports a trained model for serving: ``python -m vit_jax.export SOURCE OUT``.

  python -m vit_jax.export /tmp/vit_fmnist /tmp/vit_fmnist_serving
  python -m vit_jax.export ViT-B_16.npz /srv/vit_b16 --platforms cpu,cuda,tpu --input-dtype uint8
  python -m vit_jax.export 81.5_T2T_ViT_14.pth.tar /srv/t2t --model T2T-ViT-14

OUT is a new directory: ``model.jax_export``, the inference function as a serialized
``jax.export`` artifact (the weights inside, the batch size symbolic), and ``serving.json``, the
preprocessing it expects (RGB pixels in [0, 255], normalised in the graph). Loading it with jax
alone, and the fields: docs/evaluation.md ("Export for serving").

Exit status: 0 written; 2 bad input, one ``FATAL:`` line (what predict refuses of SOURCE, an
existing OUT without ``--overwrite``, an OUT that is or holds SOURCE, a platform or model that
cannot be exported); 1 a failure while writing. OUT is written beside and moved into place.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from vit_jax import storage
from vit_jax.tools import common
from vit_jax.tools import eval_report

#: The files of OUT: the serialized ``jax.export.Exported`` and its serving description.
ARTIFACT = 'model.jax_export'
SPEC = 'serving.json'
#: ``serving.json``'s ``format`` and ``version`` (raised when a field changes meaning).
FORMAT, VERSION = 'vit_jax.export', 1
#: What ``--platforms`` may name (``jax.export``'s names), and its default: the CPU, where the
#: tests run the artifact, and TPU, which lowers here without one (docs/evaluation.md).
PLATFORMS = ('cpu', 'cuda', 'rocm', 'tpu')
DEFAULT_PLATFORMS = ('cpu', 'tpu')
INPUT_DTYPES = ('float32', 'uint8')
#: The largest serialized artifact: ``jax.export`` writes a flatbuffer, at most 2 GiB.
MAX_ARTIFACT_BYTES = 2**31


def _parser() -> common.Parser:
  parser = common.Parser(prog='python -m vit_jax.export', description=__doc__)
  common.add_source_arguments(parser)
  parser.add_argument('out', metavar='OUT', help=f'a new directory: {ARTIFACT} and {SPEC}')
  parser.add_argument('--platforms', default=','.join(DEFAULT_PLATFORMS),
                      help='comma-separated platforms the artifact runs on, of '
                      f'{", ".join(PLATFORMS)} (default {",".join(DEFAULT_PLATFORMS)}); '
                      'none needs its device here')
  parser.add_argument('--input-dtype', choices=INPUT_DTYPES, default='float32',
                      help='the pixels the function takes, in [0, 255] (default float32: '
                      "exactly predict's for any image; uint8: exact when no resize is needed)")
  parser.add_argument('--batch-size', type=int,
                      help='a fixed batch size (default: symbolic, any batch)')
  parser.add_argument('--overwrite', action='store_true', help='replace an existing OUT')
  return parser


def parse_platforms(text: str) -> Tuple[str, ...]:
  """'cpu,tpu' -> ('cpu', 'tpu'); ValueError naming the platforms known."""
  names = tuple(dict.fromkeys(p.strip().lower() for p in text.split(',') if p.strip()))
  unknown = [p for p in names if p not in PLATFORMS]
  if unknown or not names:
    problem = f'unknown {", ".join(unknown)}' if unknown else 'none given'
    raise ValueError(f'--platforms {text!r}: {problem}; give some of {", ".join(PLATFORMS)} '
                     '(comma-separated, e.g. cpu,tpu).')
  return names


def _exists(out: str) -> FileExistsError:
  return FileExistsError(f'{out} exists; choose a new OUT or pass --overwrite (it is replaced '
                         'whole).')


def _precheck(args) -> Optional[Exception]:
  """Refusals before the set-up (JAX): bad flags; an OUT that is, holds or is in SOURCE; a local
  OUT that exists (without --overwrite)."""
  try:
    parse_platforms(args.platforms)
  except ValueError as e:
    return e
  if args.batch_size is not None and args.batch_size < 1:
    return ValueError(f'--batch-size {args.batch_size}: give 1 or more images (or leave it out '
                      'for any batch size).')
  if storage.overlap(args.out, args.source):  # Read from the names alone, gs:// too.
    return ValueError(f'{args.out} is (or contains, or is inside) the source {args.source}: '
                      'write the export to a new path outside it.')
  if storage.is_remote(args.out) or storage.is_remote(args.source):
    return None  # A bucket's OUT: main checks it after the set-up, which can read a bucket.
  if os.path.lexists(args.out) and not args.overwrite:
    return _exists(args.out)
  return None


def serving_function(trained: Any):
  """``trained``'s logits of pixels: ``[B, S, S, 3]`` RGB in [0, 255], any dtype -> float32
  ``[B, C]``, normalised as its ``config.data.normalization`` (``vit_jax.data.preprocess
  .normalize``, here in JAX), the weights closed over (constants). Returns ``(fn, config)``, the
  config with ``attention='xla'`` (a fused kernel is a custom call no other process has)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from vit_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  from vit_jax.data import preprocess  # pylint: disable=g-import-not-at-top
  from vit_jax.models import layout  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict(trained.config.to_dict())
  if 'attention' in config.model:
    config.model.attention = 'xla'
  normalization = config.data.normalization
  if normalization not in ('minus_one_to_one', 'imagenet'):
    raise ValueError(f'config.data.normalization={normalization!r}: the export states '
                     "'minus_one_to_one' or 'imagenet' only.")
  mean, std = (np.float32(preprocess.IMAGENET_MEAN), np.float32(preprocess.IMAGENET_STD))
  variables = layout.unbox(dict(trained.variables))
  state = {'params': variables.pop('params'), **({'model_state': variables} if variables else {})}
  logits_step = step_lib.make_features_step(step_lib.create_model(config), head=True)

  def logits(pixels):
    x = pixels.astype(jnp.float32)
    x = x / 127.5 - 1. if normalization == 'minus_one_to_one' else (x / 255. - mean) / std
    return logits_step(state, x).astype(jnp.float32)

  return logits, config


def export(trained: Any, *, platforms: Sequence[str] = DEFAULT_PLATFORMS,
           input_dtype: str = 'float32', batch_size: Optional[int] = None):
  """``(jax.export.Exported of serving_function, config)``, lowered for ``platforms``, the batch
  size symbolic (``'B'``) unless ``batch_size``. ValueError where the model cannot be lowered."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import export as jax_export  # pylint: disable=g-import-not-at-top
  fn, config = serving_function(trained)
  size = trained.image_size
  batch = jax_export.symbolic_shape('B')[0] if batch_size is None else int(batch_size)
  spec = jax.ShapeDtypeStruct((batch, size, size, 3), np.dtype(input_dtype))
  what = f'{config.model_name} for {", ".join(platforms)}'
  try:
    exported = jax_export.export(jax.jit(fn), platforms=tuple(platforms))(spec)
  except jax.errors.InconclusiveDimensionOperation as e:
    raise ValueError(f'{what}: the model needs a fixed batch size ({common.reason(e)}); give '
                     '--batch-size N.') from e
  except NotImplementedError as e:  # No lowering of an operation for one of the platforms.
    raise ValueError(f'{what} cannot be exported: {common.reason(e)}. Leave that platform out '
                     '(--platforms).') from e
  return exported, config


def check_size(trained: Any) -> None:
  """Refuses weights that cannot fit an artifact (:data:`MAX_ARTIFACT_BYTES`, constants in it:
  e.g. a float32 ViT-H/14) with a ValueError naming the way to serve it instead."""
  import jax  # pylint: disable=g-import-not-at-top
  weights = sum(np.asarray(v).nbytes for v in jax.tree.leaves(trained.variables))
  if weights >= MAX_ARTIFACT_BYTES:
    raise ValueError(f'{trained.config.model_name}: its weights are {weights:,} bytes, more than '
                     f'the {MAX_ARTIFACT_BYTES:,} a jax.export artifact holds (a flatbuffer; the '
                     'weights are constants in it): serve it with vit_jax.predict.Predictor.')


def describe(trained: Any, exported: Any, config: Any, input_dtype: str) -> Dict[str, Any]:
  """``serving.json``: the artifact's input and output, the preprocessing before it, the classes
  and the model (its name and fields as exported)."""
  import jax  # pylint: disable=g-import-not-at-top
  from vit_jax.data import preprocess  # pylint: disable=g-import-not-at-top
  data, size = config.data, trained.image_size
  batch = exported.in_avals[0].shape[0]
  batch = batch if isinstance(batch, int) else str(batch)  # 'B': symbolic.
  crop = data.eval_crop_pct
  if crop is None:
    resize = {'method': 'bilinear', 'antialias': False, 'size': [size, size],
              'keep_aspect_ratio': False}
  else:
    resize = {'method': 'bicubic', 'antialias': True, 'shorter_side': math.floor(size / crop),
              'center_crop': [size, size], 'crop_pct': crop, 'keep_aspect_ratio': True}
  if data.normalization == 'imagenet':  # mean, std: of pixels / 255, as timm states them.
    mean, std = list(preprocess.IMAGENET_MEAN), list(preprocess.IMAGENET_STD)
    formula = '(pixels / 255 - mean) / std'
  else:
    mean, std, formula = [0.5] * 3, [0.5] * 3, 'pixels / 127.5 - 1'
  return {
      'format': FORMAT, 'version': VERSION, 'artifact': ARTIFACT,
      'source': trained.description, 'step': trained.step,
      'platforms': list(exported.platforms), 'jax_version': jax.__version__,
      'calling_convention_version': exported.calling_convention_version,
      'input': {
          'shape': [batch, size, size, 3],
          'dtype': input_dtype, 'layout': 'NHWC', 'channels': 'RGB', 'value_range': [0, 255],
          'gray': 'repeat the channel 3 times', 'alpha': 'drop it',
          'normalization_in_graph': {'name': data.normalization, 'formula': formula,
                                     'mean': mean, 'std': std},
      },
      'preprocessing': {
          'description': eval_report.preprocessing(data)['description'],
          'image_size': size, 'resize': resize, 'clip': [0, 255],
          'round_to_integers': input_dtype == 'uint8',
          'reference': 'vit_jax.data.preprocess.eval_image (tf.image.resize)',
      },
      'output': {
          'shape': [batch, trained.num_classes],
          'dtype': 'float32', 'values': 'logits',
          'scores': 'sigmoid' if config.loss == 'sigmoid_xent' else 'softmax',
      },
      'classes': {'count': trained.num_classes,
                  'names': list(trained.label_names) if trained.label_names else None},
      'model': {'name': config.model_name, 'num_classes': int(config.num_classes),
                'fields': config.model.to_dict()},
  }


def write(out: str, blob: bytes, spec: Dict[str, Any]) -> None:
  """Writes OUT (a directory: :data:`ARTIFACT`, :data:`SPEC`) beside and moves it into place,
  replacing one there; ``gs://``: each object whole, the artifact first. Raises OSError."""
  from vit_jax.checkpoint import durable  # pylint: disable=g-import-not-at-top
  text = json.dumps(spec, indent=1) + '\n'
  if storage.is_remote(out):
    durable.write_atomically(storage.join(out, ARTIFACT), bytes(blob))
    durable.write_atomically(storage.join(out, SPEC), text)
    return
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(os.path.abspath(out))}.partial-',
                             dir=parent)
  try:
    with open(os.path.join(staging, ARTIFACT), 'wb') as f:
      f.write(blob)
    with open(os.path.join(staging, SPEC), 'w', encoding='utf-8') as f:
      f.write(text)
    os.chmod(staging, 0o777 & ~_umask())
    durable.move_into_place(staging, out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  error = _precheck(args)
  if error is not None:
    raise error
  from vit_jax.tools import convert  # pylint: disable=g-import-not-at-top  (JAX: after --help)
  convert.refuse_running_workdir(args.out)  # --overwrite would replace a live run's files.
  trained = common.load_source(args)
  check_size(trained)
  exported, config = export(trained, platforms=parse_platforms(args.platforms),
                            input_dtype=args.input_dtype, batch_size=args.batch_size)
  blob = exported.serialize()
  spec = describe(trained, exported, config, args.input_dtype)
  if storage.exists(args.out) and not args.overwrite:  # Made while exporting.
    raise _exists(args.out)
  with common.output_errors():
    write(args.out, blob, spec)
  shape = ', '.join(map(str, spec['input']['shape']))
  resize = spec['preprocessing']['description'].split(';')[0]
  artifact = storage.join(args.out, ARTIFACT)
  print(f'Wrote {args.out}: {ARTIFACT} ({len(blob):,} bytes, {config.model_name}, platforms '
        f'{", ".join(spec["platforms"])}) and {SPEC}')
  print(f'  input   {args.input_dtype} [{shape}] RGB pixels in [0, 255]: {resize}; normalised '
        'in the graph')
  print(f'  output  float32 [{spec["output"]["shape"][0]}, {trained.num_classes}] logits '
        f'({spec["output"]["scores"]})')
  print('Load it with jax alone:\n'
        f"  exported = jax.export.deserialize(bytearray(open({artifact!r}, 'rb').read()))\n"
        '  logits = exported.call(pixels)')
  return 0


def run_main() -> None:
  """``python -m vit_jax.export``: bad flags and an existing OUT are refused before the set-up."""
  common.run_program(main, _parser, _precheck)
