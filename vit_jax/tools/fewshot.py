"""Few-shot linear accuracy of a trained model's frozen pre-logit features (ViT paper Sec. 4.1):
per k, a closed-form ridge regression to {-1, 1} targets fitted on k training examples per class
(drawn with each seed from the first examples of each class in the train split), scored on the
eval split; mean +- std over the seeds.

  python -m vit_jax.fewshot /tmp/vit_fmnist                 # its Fashion-MNIST splits
  python -m vit_jax.fewshot ViT-B_16.npz --data cifar10 --shots 10 --json
  python -m vit_jax.fewshot /tmp/vit_fmnist --image-folder ~/flowers --seeds 5

The protocol and its differences from big_vision's: docs/evaluation.md. Exit status: 0 done; 2
bad input (one FATAL line on stderr: a missing or unusable SOURCE, an unknown dataset or split,
a folder without images, more shots than a class has examples, bad flags).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional, Sequence

from vit_jax import storage
from vit_jax.tools import common
from vit_jax.tools import cost


def _positive(kind, example: str, many: bool = False):
  """An argparse type: a `kind` > 0, or with `many` '1,5,10' -> (1, 5, 10)."""
  noun = 'integer' if kind is int else 'number'
  what = f'comma-separated {noun}s > 0' if many else f'an {noun} > 0'

  def parse(text: str):
    try:
      values = tuple(kind(v) for v in text.split(',')) if many else (kind(text),)
    except ValueError:
      values = ()
    if not values or any(not v > 0 for v in values):
      raise argparse.ArgumentTypeError(f'{text!r} is not {what} (e.g. {example})')
    return values if many else values[0]

  return parse


def _parser() -> common.Parser:
  parser = common.Parser(prog='python -m vit_jax.fewshot', description=__doc__)
  common.add_source_arguments(parser)
  data = parser.add_mutually_exclusive_group()
  data.add_argument('--data', metavar='NAME',
                    help='a tfds name or prepared tfds directory (default: a workdir\'s own '
                    'training data)')
  data.add_argument('--image-folder', metavar='DIR',
                    help='an image folder, DIR/<split>/<class>/*.{jpg,jpeg,png}')
  parser.add_argument('--data-dir', help='the tfds data_dir (default: the model config\'s, '
                      'else $TFDS_DATA_DIR or ~/tensorflow_datasets)')
  parser.add_argument('--train-split', help="the split the shots are drawn from, tfds slicing "
                      "allowed (default: the workdir's train split for its own data, else "
                      "'train')")
  parser.add_argument('--eval-split', help="the split measured (default: the workdir's eval "
                      "split for its own data, else 'test')")
  parser.add_argument('--shots', type=_positive(int, '1,5,10,25', many=True),
                      default=(1, 5, 10, 25),
                      metavar='K,K,...', help='training examples per class of each probe '
                      '(default 1,5,10,25)')
  parser.add_argument('--seeds', type=_positive(int, '3'), default=3, metavar='N',
                      help='draws of the shots per k: seeds 0..N-1 (default 3)')
  parser.add_argument('--l2-regs', type=_positive(float, '1024 or 1,32,1024', many=True),
                      default=(1024.0,),
                      metavar='L2,...', help='the ridge penalty (default 1024, big_vision\'s); '
                      'several: the best of each draw, chosen on held-out training examples')
  parser.add_argument('--train-per-class', type=_positive(int, '75'), metavar='N',
                      help='training examples kept per class, the first ones read (default: '
                      'max(shots) x seeds, +10 with several --l2-regs)')
  parser.add_argument('--max-eval-examples', type=_positive(int, '10000'), metavar='N',
                      help='use only the first N eval examples (default: all)')
  parser.add_argument('--batch-size', type=_positive(int, '256'), metavar='B',
                      help="the features step's global batch (default: the model's eval batch)")
  parser.add_argument('--json', action='store_true', help='print one JSON object instead')
  return parser


#: The data settings as this tool's flags, in `make_task`'s messages.
_FLAGS = {'--config.data.image_folder': '--image-folder', 'config.data.image_folder':
          '--image-folder', 'config.data.train_split': '--train-split',
          'config.data.eval_split': '--eval-split', 'config.data.name': '--data'}


def evaluate(args) -> dict[str, Any]:
  """Loads SOURCE, featurises the dataset and runs the protocol; returns the report: 'source',
  'dataset', splits, example counts, 'seeds', 'l2_regs', 'results' {k: {'mean', 'std',
  'accuracies', 'l2'}}, 'scalars'. Raises the input errors of the loading and the protocol."""
  for flag, value in (('--shots', args.shots), ('--l2-regs', args.l2_regs)):
    if len(set(value)) != len(value):
      raise ValueError(f'{flag} {",".join(str(v) for v in value)} repeats a value; list each '
                       'once.')
  shots, seeds = tuple(sorted(args.shots)), args.seeds
  if args.train_per_class and args.train_per_class < max(shots):
    raise ValueError(f'--train-per-class {args.train_per_class} is below the largest shot '
                     f'count {max(shots)}; give at least {max(shots)}.')
  trained = common.load_source(args)
  from vit_jax import inference  # pylint: disable=g-import-not-at-top  (JAX, TensorFlow)
  from vit_jax import step  # pylint: disable=g-import-not-at-top
  from vit_jax.evaluation import features  # pylint: disable=g-import-not-at-top
  from vit_jax.evaluation import fewshot  # pylint: disable=g-import-not-at-top
  if args.data is None and args.image_folder is None:  # A workdir's own data and splits.
    if trained.step is None:
      raise ValueError(f'{args.source} is not a training workdir, so it has no training data to '
                       'evaluate on: give --data NAME (tfds) or --image-folder DIR.')
    data_config = trained.data_config()
    splits = (data_config.train_split, data_config.eval_split)
  else:
    data_config = trained.data_config(name=args.data, image_folder=args.image_folder,
                                      label_key=None)
    splits = ('train', 'test')
  data_config.update(train_split=args.train_split or splits[0],
                     eval_split=args.eval_split or splits[1], cache=False)
  if args.data_dir:
    data_config.data_dir = args.data_dir
  batch_size = args.batch_size or int(trained.config.eval_batch_size)
  task = fewshot.make_task(data_config, global_batch_size=batch_size, flags=_FLAGS)
  runner = inference.Runner(trained)  # After the data's checks: placing a model takes a while.
  shards = step.batch_shards(runner.setup.config.mesh, runner.setup.mesh.size)
  if batch_size % shards:
    raise ValueError(f'--batch-size {batch_size} must be a multiple of the {shards} batch '
                     f'shard(s) of the device mesh; use --batch-size '
                     f'{max(shards, batch_size // shards * shards)}.')
  evaluator = fewshot.Evaluator(
      [task], features.Featurizer(runner.setup), shots=shots, seeds=seeds,
      l2_regs=args.l2_regs, train_per_class=args.train_per_class,
      max_eval_examples=args.max_eval_examples,
      hint='lower --shots or give a larger --train-split')
  [result] = evaluator.evaluate(runner.state)
  return {
      'source': trained.description, 'dataset': data_config.image_folder or data_config.name,
      'train_split': data_config.train_split, 'eval_split': data_config.eval_split,
      'train_examples': result.pool, 'train_read': result.read, 'eval_examples': result.test,
      'seeds': seeds, 'l2_regs': list(evaluator.l2_regs),
      'results': {str(k): {'mean': r.mean, 'std': r.std, 'accuracies': list(r.accuracies),
                           'l2': list(r.l2_regs)} for k, r in result.shots.items()},
      'scalars': fewshot.scalars(task.name, result.shots)}


def table(report: dict[str, Any]) -> str:
  """The report as text: a header, then per k 'mean +- std' over the seeds."""
  l2 = ', '.join(f'{v:g}' for v in report['l2_regs'])
  lines = [f"Few-shot linear evaluation of {report['source']}",
           f"on {report['dataset']}: {report['train_examples']} training examples kept of "
           f"{report['train_read']} read from '{report['train_split']}', "
           f"{report['eval_examples']} eval examples of '{report['eval_split']}'; "
           f"{report['seeds']} seed(s), l2 {l2}.",
           f"{'shots':>5}  accuracy (mean +- std over seeds)"]
  for k, r in report['results'].items():
    lines.append(f"{k:>5}  {100 * r['mean']:6.2f}% +- {100 * r['std']:.2f}%")
  return '\n'.join(lines)


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  report = evaluate(args)
  print(json.dumps(report, indent=1) if args.json else table(report), flush=True)
  return 0


def _precheck(args: argparse.Namespace) -> Optional[Exception]:
  """A shot count no class can give, told before the set-up: from an image folder's class
  folders (non-hidden files counted) or a known dataset's published size."""
  k = max(args.shots)
  folder, name, split = args.image_folder, args.data, args.train_split
  if folder is None and name is None:  # A workdir's own data (its config.json).
    data = (common.run_config(args.source) or {}).get('data')
    if not isinstance(data, dict):
      return None
    folder, name = data.get('image_folder'), data.get('name')
    split = split or data.get('train_split')
  split = split or 'train'
  if isinstance(folder, str) and folder:
    split_dir = os.path.join(os.path.expanduser(folder), split)
    if storage.is_remote(folder) or not os.path.isdir(split_dir):
      return None
    classes = [os.path.join(split_dir, c) for c in os.listdir(split_dir)
               if not c.startswith('.') and os.path.isdir(os.path.join(split_dir, c))]
    entries = {c: [os.path.join(c, n) for n in os.listdir(c) if not n.startswith('.')]
               for c in classes}
    if any(os.path.isdir(e) for names in entries.values() for e in names):
      return None  # Nested folders (or links to them): left to the full check, which walks them.
    counts = {os.path.basename(c): len(names) for c, names in entries.items()}
    most = max(counts.values(), default=k)
    if most < k:
      largest = max(counts, key=counts.get)
      return ValueError(f'--shots {k}: no class of {split_dir} has {k} images (the most files '
                        f'are {most}, in {largest!r}); lower --shots to at most {most}, or give '
                        'a larger --train-split.')
    return None
  sizes, classes = cost.KNOWN_DATASETS.get(name, ({}, 0))
  examples = sizes.get(split)
  if examples and k * classes > examples:
    return ValueError(f"--shots {k}: {name}'s split {split!r} has {examples:,} examples of "
                      f'{classes:,} classes (its published size), {examples // classes:,} per '
                      f'class on average: fewer than {k}; lower --shots, or give a larger '
                      '--train-split.')
  return None


def run_main() -> None:
  common.run_program(main, _parser, _precheck)
