"""Looks inside a trained model: the ViT paper's analysis figures (Sec. 4.5, Fig. 6, 7 and 14) as
PNG files (attention rollout over images, every layer's attention, mean attention distance per
head against depth, position embedding similarity, principal components of the patch-embedding
filters) and the numbers behind them in analysis.json, for any model ``inference.load`` reads.

  python -m vit_jax.analyze /tmp/vit_fmnist --out /tmp/vit_fmnist_analysis
  python -m vit_jax.analyze ViT-B_16.npz --images photos/ --out /tmp/b16_analysis

Files, images and exit statuses: docs/analysis.md. JAX, TensorFlow and matplotlib load after
``--help`` and bad flags are answered.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from vit_jax import storage
from vit_jax.tools import common
from vit_jax.tools import eval_data
from vit_jax.tools import predict

#: Files the tool writes in ``--out`` (those that apply to the model).
OUTPUTS = ('rollout.png', 'layer_attention.png', 'attention_distance.png',
           'posemb_similarity.png', 'filter_components.png', 'analysis.json')

#: Images per forward pass (the maps take ``4 B heads N^2`` bytes per layer).
CHUNK = 16


def _parser() -> common.Parser:
  parser = common.Parser(prog='python -m vit_jax.analyze', description=__doc__)
  common.add_source_arguments(parser)
  images = parser.add_mutually_exclusive_group()
  images.add_argument('--images', nargs='+', metavar='PATH',
                      help='image files or folders (searched recursively)')
  images.add_argument('--data', metavar='NAME[:SPLIT]',
                      help="a tfds dataset or prepared directory (default: a workdir's own "
                      'evaluation split)')
  parser.add_argument('--out', required=True, help='the folder for the figures and '
                      'analysis.json (created)')
  parser.add_argument('--num-images', type=int, default=128,
                      help='images averaged for the attention distances (default 128)')
  parser.add_argument('--overlays', type=int, default=8,
                      help='images shown with their rollout maps (default 8)')
  parser.add_argument('--overwrite', action='store_true',
                      help='replace the results of an earlier analysis in --out')
  return parser


def _from_data(trained: Any, data_arg: Optional[str], count: int
               ) -> Tuple[np.ndarray, List[str]]:
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  chosen = eval_data.choose_data(trained, data=data_arg)
  batch = min(count, 64)
  inputs, labels = [], []
  for example in data.create_eval_dataset(chosen.config, global_batch_size=batch):
    mask = np.asarray(example['mask'], bool)
    inputs.append(np.asarray(example['image'])[mask])
    labels.extend(chosen.label_names[int(i)] for i in np.argmax(example['labels'], -1)[mask])
    if len(labels) >= count:
      break
  return np.concatenate(inputs)[:count].astype(np.float32), labels[:count]


def analyze(trained: Any, inputs: np.ndarray, *, overlays: int = 8) -> Dict[str, Any]:
  """The numbers behind the figures for ``inputs`` (float32 ``[B, S, S, 3]``, preprocessed): a
  dict of NumPy arrays: ``attention_distance`` ``[L][heads]`` pixels, ``rollout``
  ``[overlays, gh, gw]``, ``predicted``, ``layer_maps`` ``[L, gh, gw]`` (first image),
  ``posemb_similarity``, ``filter_components``, ``explained_variance`` (or None), and
  ``model``, ``image_size``, ``stride``, ``grid``, ``prefix``, ``registers``, ``num_images``.
  The maps are the class token's, or without one the mean of the patch rows (registers never).
  """
  from vit_jax import analysis  # pylint: disable=g-import-not-at-top
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  from vit_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  from vit_jax.models import intermediates  # pylint: disable=g-import-not-at-top
  model = step_lib.create_model(trained.config)
  variables = models.unbox(trained.variables)
  registers = int(getattr(model, 'num_registers', 0))  # T2T-ViT: none.
  sums = None
  rollouts = []
  predicted = []
  layer_maps = None
  layout = None
  for start in range(0, len(inputs), CHUNK):
    captured = intermediates.capture(model, variables, inputs[start:start + CHUNK])
    layout = captured.layout
    grid, stride, prefix = layout.grid, layout.stride, layout.prefix
    per_image = np.stack([analysis.mean_attention_distance(a, grid, stride, prefix,
                                                           per_image=True)
                          for a in captured.attention])  # [L, B, heads]
    sums = per_image.sum(axis=1) if sums is None else sums + per_image.sum(axis=1)
    if len(rollouts) < overlays:
      matrix = analysis.rollout(captured.attention)
      rollouts.extend(analysis.class_token_map(matrix, grid, num_prefix_tokens=prefix,
                                               num_registers=registers))
      predicted.extend(int(i) for i in np.argmax(np.asarray(captured.logits), axis=-1))
    if layer_maps is None:
      layer_maps = analysis.layer_class_token_maps([a[:1] for a in captured.attention], grid,
                                                   num_prefix_tokens=prefix,
                                                   num_registers=registers)[:, 0]
  params = variables['params']
  out = dict(model=trained.config.model_name, image_size=int(inputs.shape[1]),
             stride=list(layout.stride), grid=list(layout.grid), prefix=layout.prefix,
             registers=registers, num_images=len(inputs), attention_distance=sums / len(inputs),
             rollout=np.stack(rollouts[:overlays]), predicted=predicted[:overlays],
             layer_maps=layer_maps,
             posemb_similarity=None, filter_components=None, explained_variance=None)
  table = params.get('Transformer', {}).get('posembed_input', {}).get('pos_embedding')
  if table is not None:  # The table's own grid (resampled in the model at another size).
    table_grid = trained.config.model.get('posemb_grid') or layout.grid
    out['posemb_similarity'] = analysis.posemb_similarity(
        table, tuple(table_grid), models.vit.posemb_prefix_rows(model))
  kernel = params.get('embedding', {}).get('kernel')
  if kernel is not None and 'conv_root' not in params:
    count = min(28, int(np.prod(kernel.shape[:3])), int(kernel.shape[-1]))
    out['filter_components'], out['explained_variance'] = (
        analysis.embedding_filter_components(kernel, n=count))
  return out


def write_figures(result: Dict[str, Any], images: np.ndarray, labels: Sequence[str],
                  out: str) -> List[str]:
  """Writes the PNGs and ``analysis.json`` of ``result`` into ``out``; returns their paths."""
  from vit_jax.analysis import figures  # pylint: disable=g-import-not-at-top
  storage.makedirs(out)  # Local or gs://, as every path here.
  shown = len(result['rollout'])
  written = [
      figures.rollout_overlay(images[:shown], result['rollout'], storage.join(out, OUTPUTS[0]),
                              labels=list(labels[:shown]) or None),
      figures.layer_attention(images[0], result['layer_maps'], storage.join(out, OUTPUTS[1]),
                              rollout_map=result['rollout'][0]),
      figures.attention_distance(result['attention_distance'], storage.join(out, OUTPUTS[2]),
                                 image_size=result['image_size'],
                                 patch_size=tuple(result['stride'])),
  ]
  if result['posemb_similarity'] is not None:
    written.append(figures.posemb_similarity_grid(result['posemb_similarity'],
                                             storage.join(out, OUTPUTS[3])))
  if result['filter_components'] is not None:
    written.append(figures.filter_components(result['filter_components'],
                                             storage.join(out, OUTPUTS[4]),
                                             explained=result['explained_variance']))
  numbers = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in result.items()
             if k not in ('filter_components',)}
  path = storage.join(out, OUTPUTS[5])
  storage.write_bytes(path, json.dumps(numbers).encode())
  return written + [path]


def _captions(trained: Any, predicted: Sequence[int], labels: Sequence[str], *,
              from_files: bool) -> List[str]:
  """The rollout panels' captions: 'file.jpg: Sneaker' for files; for a dataset the predicted
  class, with the true one when it differs."""
  from vit_jax.analysis import figures  # pylint: disable=g-import-not-at-top
  names = [trained.label_name(int(p)) for p in predicted]
  if from_files:
    return [f'{label}: {name}' for label, name in zip(labels, names)]
  return [figures.prediction_caption(name, label) for name, label in zip(names, labels)]


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  for flag, value in (('--num-images', args.num_images), ('--overlays', args.overlays)):
    if value < 1:
      raise ValueError(f'{flag} {value}: must be 1 or more.')
  existing = [f for f in OUTPUTS if storage.exists(storage.join(args.out, f))]
  if existing and not args.overwrite:
    raise FileExistsError(f'{args.out} already holds an analysis ({", ".join(existing)}); '
                          'choose another --out or pass --overwrite.')
  trained = common.load_source(args)
  if args.images:
    paths = predict.image_paths(args.images)[:args.num_images]
    inputs = np.stack([predict.preprocess(trained, p, name=p) for p in paths]).astype(np.float32)
    labels = [storage.basename(p) for p in paths]
  else:
    inputs, labels = _from_data(trained, args.data, args.num_images)
  if args.overlays > len(inputs):
    print(f'--overlays {args.overlays} lowered to the {len(inputs)} image(s) analysed.')
  result = analyze(trained, inputs, overlays=min(args.overlays, len(inputs)))
  captions = _captions(trained, result['predicted'], labels, from_files=bool(args.images))
  with common.output_errors():
    written = write_figures(result, inputs, captions, args.out)
  distance = np.asarray(result['attention_distance'])
  print(f'{trained.description}: {result["num_images"]} image(s), {distance.shape[0]} layers x '
        f'{distance.shape[1]} heads; mean attention distance {distance[0].mean():.1f} px in the '
        f'first layer, {distance[-1].mean():.1f} px in the last (image {result["image_size"]} '
        f'px).')
  for path in written:
    print(f'  wrote {path}')
  return 0


def run_main() -> None:
  common.run_program(main, _parser)
