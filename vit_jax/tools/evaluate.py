"""Evaluates a trained model on every example of a dataset split once: top-1 and top-5
accuracy, loss, per-class accuracy and a confusion matrix, written as metrics.json,
confusion_matrix.png and confusion_matrix.csv (``--out``).

  python -m vit_jax.evaluate /tmp/vit_fmnist
  python -m vit_jax.evaluate ViT-B_16.npz --data imagenet2012:validation
  python -m vit_jax.evaluate 81.5_T2T_ViT_14.pth.tar --model T2T-ViT-14 --real
  python -m vit_jax.evaluate /tmp/vit_fmnist --image-folder ~/fmnist_images --split test
  python -m vit_jax.evaluate /tmp/vit_fmnist --image-size 56  # another size: table resampled

The model's eval preprocessing and the training's evaluator: a workdir on its own eval split
scores what its training reported (docs/evaluation.md). Exit status: 0 done; 2 bad input, before
any work (one FATAL line: a missing or unusable SOURCE, a model that does not fit it, data with
other classes, an undecodable image (see --skip-bad-images), an output folder that holds a
result (see --overwrite), bad flags); 1 a failure while writing the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from vit_jax import rundir
from vit_jax.tools import common
from vit_jax.tools import eval_data as eval_data_lib
from vit_jax.tools import eval_report

EvalData = eval_data_lib.EvalData
Result = eval_report.Result


def evaluate(trained, eval_data: EvalData, *, batch_size: Optional[int] = None,
             progress: Optional[Callable[[int, int], None]] = None) -> Result:
  """The :class:`Result` of ``trained`` on every example of ``eval_data`` once, summed over all
  processes by the training's evaluator. ``batch_size``: global (default the config's);
  ``progress(done, total)`` after each batch. Raises ValueError: a batch the mesh cannot split,
  no labelled example, an undecodable image (``vit_jax.data.BadImageError``)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  from vit_jax import evaluation  # pylint: disable=g-import-not-at-top
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  from vit_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  config = trained.config
  if batch_size is not None:
    shards = step_lib.batch_shards(config.mesh, len(jax.devices()))
    if batch_size <= 0 or batch_size % shards:
      raise ValueError(f'--batch-size {batch_size} must be a positive multiple of the {shards} '
                       'batch shard(s) of the device mesh.')
    config = type(config)(config.to_dict())
    config.eval_batch_size = batch_size
    trained = dataclasses.replace(trained, config=config)
  runner = inference.Runner(trained)
  setup = runner.setup
  compiler = step_lib.Compiler(setup)
  dataset = data.create_eval_dataset(eval_data.config, global_batch_size=runner.batch_size)
  eval_step = setup.jit_eval_step(variables_only=True, top1=True)
  classes = eval_data.num_classes
  confusion = None if eval_data.multi_label else np.zeros((classes, classes), np.int64)

  def on_batch(i: int, batch: Dict[str, np.ndarray], outputs) -> None:
    if confusion is not None:
      mask = np.asarray(batch['mask'], bool)
      true = np.argmax(batch['labels'], axis=-1)
      np.add.at(confusion, (true[mask], setup.to_local(outputs[1])[mask]), 1)
    if progress is not None:
      progress(i + 1, len(dataset))

  totals = evaluation.sum_batches(
      lambda state, batch: compiler(eval_step, state, setup.to_global(batch)), runner.state,
      dataset, on_batch)
  if confusion is not None and jax.process_count() > 1:
    confusion = np.asarray(multihost_utils.process_allgather(confusion)).sum(axis=0)
  count = int(totals.pop('count'))
  if count == 0:
    raise ValueError(f'{eval_data.label} has no labelled examples: choose another split.')
  top5 = totals.get('correct_top5')
  top5 = None if top5 is None else int(top5)
  return eval_report.Result(count, int(totals['correct']), top5, float(totals['loss'] / count),
                            confusion, runner.batch_size)


def _progress(done: int, total: int) -> None:
  if sys.stderr.isatty():
    print(f'\rEvaluating: batch {done} of {total}', end='\n' if done == total else '',
          file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
  parser = common.Parser(prog='python -m vit_jax.evaluate', description=__doc__)
  common.add_source_arguments(parser)
  parser.add_argument('--data', metavar='NAME[:SPLIT]',
                      help="a tfds dataset (name or prepared directory) and split (default: "
                      "test, else validation; the workdir's eval split for its own dataset)")
  parser.add_argument('--image-folder', metavar='DIR',
                      help='DIR/<split>/<class>/*.{jpg,jpeg,png} (default split: test)')
  parser.add_argument('--real', action='store_true',
                      help='ImageNet ReaL labels (tfds imagenet2012_real, validation split), '
                      'for 1000-class ImageNet models')
  parser.add_argument('--split', help='the split to evaluate (a tfds split spec)')
  parser.add_argument('--data-dir', metavar='DIR', help='the tfds data directory')
  parser.add_argument('--out', metavar='DIR',
                      help='where the results go (default: <workdir>/eval_<data>_<split>_step<N> '
                      'for a workdir, else ./eval_<file>_<data>_<split>)')
  parser.add_argument('--overwrite', action='store_true',
                      help='replace an earlier result in the output directory')
  parser.add_argument('--batch-size', type=int,
                      help="the global eval batch (default: the config's eval_batch_size)")
  parser.add_argument('--skip-bad-images', action='store_true',
                      help='leave undecodable images out (default: stop, naming them)')
  parser.add_argument('--json', action='store_true',
                      help='print the metrics as JSON instead of the summary')
  return parser


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if sum(bool(x) for x in (args.data, args.image_folder, args.real)) > 1:
    parser.error('give one of --data, --image-folder and --real.')
  if args.batch_size is not None and args.batch_size <= 0:
    parser.error(f'--batch-size {args.batch_size}: give a positive number.')
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  try:  # The cheap checks first, then the model, the data, the evaluation.
    eval_data_lib.precheck(data=args.data, image_folder=args.image_folder, split=args.split)
    if args.out:
      eval_report.check_out(args.out, args.overwrite)
    trained = common.load_source(args)
    chosen = eval_data_lib.choose_data(
        trained, data=args.data, image_folder=args.image_folder, split=args.split,
        real=args.real, data_dir=args.data_dir, skip_bad_images=args.skip_bad_images)
    workdir = rundir.find(args.source).workdir if trained.step is not None else None
    out = args.out or eval_report.out_path(args.source, workdir, trained.step, chosen.name,
                                           chosen.split, args.no_ema)
    eval_report.check_out(out, args.overwrite)
    note = eval_report.names_note(trained, chosen)
    if note:
      print(note, file=sys.stderr)
    result = evaluate(trained, chosen, batch_size=args.batch_size, progress=_progress)
  except data.BadImageError as e:  # Bad input, in this tool's words (its flag).
    if not e.paths:
      raise ValueError(f'An image of split {e.split!r} of {e.dataset} cannot be decoded; '
                       'rebuild the dataset without it, or pass --skip-bad-images.') from None
    more = f' and {len(e.paths) - 8} more' if len(e.paths) > 8 else ''
    raise ValueError(
        f'{len(e.paths)} image(s) of split {e.split!r} of {e.dataset} cannot be decoded: '
        f'{", ".join(e.paths[:8])}{more}; remove or replace them, or pass --skip-bad-images to '
        'leave them out.') from None
  metrics = dict(eval_report.metrics_dict(trained, chosen, result), out=out)
  if jax.process_index() == 0:
    title = (f'{trained.description}\non {chosen.label}: accuracy {result.accuracy:.4f} '
             f'({result.correct} of {result.count})')
    with common.output_errors(Exception):  # OSError, tf.errors.OpError: exit status 1.
      written = eval_report.write_outputs(out, metrics, result.confusion,
                                          eval_report.class_names(trained, chosen), title)
    if args.json:
      print(json.dumps(metrics, indent=1))
    else:
      print(eval_report.summary(metrics, chosen))
      print(f"Wrote {', '.join(written)} to {out}")
  return 0


def _precheck(args: argparse.Namespace) -> Optional[Exception]:
  """An earlier result in the planned output folder, refused before the set-up."""
  try:
    out = eval_report.planned_out(args)
    if out and not args.overwrite:
      eval_report.check_out(out, args.overwrite)
  except common.INPUT_ERRORS as e:
    return e
  return None


def run_main() -> None:
  common.run_program(main, _parser, _precheck)
