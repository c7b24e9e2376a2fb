"""The results of ``python -m vit_jax.evaluate``: ``metrics.json``, the confusion matrix (PNG and
CSV) and the printed summary. The picture's rows are the true classes, each divided by its count
(the diagonal is per-class recall).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from vit_jax import rundir
from vit_jax import storage
from vit_jax.tools import common
from vit_jax.tools import eval_data as eval_data_lib
from vit_jax.tools.eval_data import EvalData

METRICS_JSON = 'metrics.json'
CONFUSION_PNG = 'confusion_matrix.png'
CONFUSION_CSV = 'confusion_matrix.csv'


@dataclasses.dataclass(frozen=True)
class Result:
  """The sums of an evaluation: ``count`` examples, top-1 (precision@1) and top-5 hits (None
  with < 5 classes), the mean ``loss``, int64 ``confusion[t, p]`` (examples of class t predicted
  as p; None multi-label) and the global ``batch_size``."""

  count: int
  correct: int
  correct_top5: Optional[int]
  loss: float
  confusion: Optional[np.ndarray]
  batch_size: int

  @property
  def accuracy(self) -> float:
    return self.correct / self.count

  @property
  def top5_accuracy(self) -> Optional[float]:
    return None if self.correct_top5 is None else self.correct_top5 / self.count


#: Up to this many classes, the axes carry the class names (else indices).
MAX_NAMED_CLASSES = 30
#: Up to this many classes, every cell shows its percentage.
MAX_ANNOTATED_CLASSES = 15


def normalized_rows(confusion: np.ndarray) -> np.ndarray:
  """``[C, C]`` counts -> float64 ``[C, C]`` rows summing to 1 (a row without examples: 0)."""
  confusion = np.asarray(confusion, np.float64)
  totals = confusion.sum(axis=1, keepdims=True)
  return np.divide(confusion, totals, out=np.zeros_like(confusion), where=totals > 0)


def png_bytes(confusion: np.ndarray, names: Optional[Sequence[str]], title: str) -> bytes:
  """The picture of ``confusion`` (int ``[C, C]``, rows true classes) as PNG bytes."""
  from matplotlib.backends import backend_agg  # pylint: disable=g-import-not-at-top
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  rows = normalized_rows(confusion)
  classes = rows.shape[0]
  named = names is not None and classes <= MAX_NAMED_CLASSES
  side = min(max(6.0, 0.42 * classes + 3.0), 16.0) if classes <= MAX_NAMED_CLASSES else 12.0
  fig = figure.Figure(figsize=(side + 1.5, side), dpi=100 if classes <= 300 else 150)
  backend_agg.FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  image = ax.imshow(rows, cmap='Blues', vmin=0.0, vmax=1.0, interpolation='nearest')
  fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label='fraction of the true class')
  if classes <= MAX_NAMED_CLASSES:
    ticks = np.arange(classes)
    labels = ([n if len(n) <= 24 else n[:23] + '\u2026' for n in names] if named
              else [str(i) for i in ticks])
    ax.set_xticks(ticks, labels, rotation=90 if named else 0, fontsize=9)
    ax.set_yticks(ticks, labels, fontsize=9)
  if classes <= MAX_ANNOTATED_CLASSES:  # Percent of the row; '<1' for a few, empty for none.
    for t in range(classes):
      for p in range(classes):
        if confusion[t, p]:
          text = f'{100 * rows[t, p]:.0f}' if rows[t, p] >= 0.01 else '<1'
          ax.text(p, t, text, ha='center', va='center', fontsize=8,
                  color='white' if rows[t, p] > 0.5 else 'black')
  ax.set_xlabel('predicted class')
  ax.set_ylabel('true class')
  ax.set_title(title, fontsize=10, wrap=True)
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format='png')
  return buffer.getvalue()


def csv_text(confusion: np.ndarray, names: Optional[Sequence[str]]) -> str:
  """``confusion`` as CSV: a header ``true \\ predicted, <class>...``, then one row of counts
  per true class, led by its name (or index)."""
  labels = list(names) if names is not None else [str(i) for i in range(len(confusion))]
  out = io.StringIO()
  csv.writer(out, lineterminator='\n').writerows(
      [['true \\ predicted', *labels]]
      + [[label, *(int(v) for v in row)] for label, row in zip(labels, np.asarray(confusion))])
  return out.getvalue()


def preprocessing(data_cfg) -> Dict[str, Any]:
  """The eval preprocessing of ``config.data``, as recorded in metrics.json."""
  size, crop = int(data_cfg.image_size), data_cfg.eval_crop_pct
  if crop is None:
    resize = f'bilinear resize of the whole image to {size}x{size}'
  else:
    resize = (f'bicubic resize of the shorter side to {math.floor(size / crop)}, central '
              f'{size}x{size} crop')
  values = {'minus_one_to_one': 'pixels / 127.5 - 1, in [-1, 1]',
            'imagenet': '(pixels / 255 - ImageNet mean) / ImageNet std'}
  return {'image_size': size, 'eval_crop_pct': crop, 'normalization': data_cfg.normalization,
          'description': f'{resize}; {values.get(data_cfg.normalization, data_cfg.normalization)}'}


def class_names(trained, eval_data: EvalData) -> Tuple[str, ...]:
  """The names to show: the model's (e.g. readable ImageNet names), else the data's."""
  return tuple(trained.label_names or eval_data.label_names
               or (str(i) for i in range(eval_data.num_classes)))


def names_note(trained, eval_data) -> Optional[str]:
  """A note when the model and the data name their classes differently (e.g. WordNet ids in a
  tfds ImageNet, readable names for the model): classes are matched by index."""
  if (not (trained.label_names and eval_data.label_names)
      or tuple(trained.label_names) == tuple(eval_data.label_names)):
    return None
  return (f"note: the data's class names differ from the model's (class 0: "
          f"{eval_data.label_names[0]!r} in the data, {trained.label_names[0]!r} for the "
          'model); classes are matched by index.')


def metrics_dict(trained, eval_data: EvalData, result: Result) -> Dict[str, Any]:
  """What ``metrics.json`` holds (see docs/evaluation.md)."""
  names = class_names(trained, eval_data)
  out = {
      'source': trained.description, 'step': trained.step, 'model': trained.config.model_name,
      'data': {'name': eval_data.name, 'split': eval_data.split,
               'image_folder': bool(eval_data.config.image_folder),
               'num_classes': eval_data.num_classes, 'multi_label': eval_data.multi_label,
               'label_key': eval_data.label_key,
               'bad_images': eval_data.config.bad_images},
      'preprocessing': preprocessing(eval_data.config),
      'batch_size': result.batch_size,
      'metric': 'precision@1' if eval_data.multi_label else 'top-1 accuracy',
      'count': result.count, 'correct': result.correct, 'accuracy': result.accuracy,
      'top5_accuracy': result.top5_accuracy, 'loss': result.loss,
      'loss_function': trained.config.loss,
  }
  if result.confusion is None:
    out['per_class'] = None
    out['note'] = ('multi-label data: per-class accuracy and the confusion matrix are not '
                   'computed (a prediction is correct when its top class is among the labels).')
  else:
    counts = result.confusion.sum(axis=1)
    out['per_class'] = [
        {'index': c, 'name': names[c], 'count': int(counts[c]),
         'correct': int(result.confusion[c, c]),
         'accuracy': float(result.confusion[c, c] / counts[c]) if counts[c] else None}
        for c in range(eval_data.num_classes)]
    out['files'] = {'confusion_matrix_png': CONFUSION_PNG, 'confusion_matrix_csv': CONFUSION_CSV}
  return out


def _eval_name(text: str) -> str:
  """``vit_jax.evaluation.eval_name`` ('train[98%:]' -> 'train_98') without TensorFlow."""
  return re.sub(r'[^A-Za-z0-9]+', '_', text).strip('_')


def out_path(source: str, workdir: Optional[str], step: Optional[int], data_name: str,
             split: str, no_ema: bool) -> str:
  """``<workdir>/eval_<data>_<split>_step<N>[_no_ema]`` for a workdir (and ``step``), else
  ``./eval_<file>_<data>_<split>``."""
  name = _eval_name(f"{storage.basename(data_name) or data_name}_{split}")
  if workdir is not None and step is not None:
    return storage.join(workdir, f'eval_{name}_step{step}' + ('_no_ema' if no_ema else ''))
  stem = storage.basename(source).split('.')[0] or 'model'
  return os.path.join('.', f'eval_{_eval_name(stem)}_{name}')


def planned_out(args) -> Optional[str]:
  """The output folder of ``evaluate`` ``args``, told before set-up from flags and a workdir;
  None when only the data can tell (a default split) or SOURCE is remote."""
  if args.out:
    return args.out
  given = sum(bool(x) for x in (args.data, args.image_folder, args.real))
  if storage.is_remote(args.source) or given > 1:
    return None
  source = os.path.abspath(os.path.expanduser(args.source)).rstrip('/')
  run = rundir.find(source)
  workdir, step = None, None
  if run.workdir == source:
    workdir = source
    step = (args.step if args.step is not None
            else max(rundir.saved_steps(run.checkpoints, readable=True), default=None))
    if step is None:
      return None
  elif run.checkpoints or run.step_dir:
    return None  # A run's checkpoints/ or one step: the run's folder, left to the late check.
  if args.real:
    name, split = eval_data_lib.REAL_DATASET, eval_data_lib.REAL_SPLIT
  elif args.data:
    name, split = eval_data_lib.parse_data(args.data)
  elif args.image_folder:
    name, split = args.image_folder, None
  elif workdir is not None:  # Its own data and eval split.
    data = (common.run_config(workdir) or {}).get('data')
    data = data if isinstance(data, dict) else {}
    name, split = data.get('image_folder') or data.get('name'), data.get('eval_split')
  else:
    return None
  split = args.split or split
  if not (isinstance(name, str) and isinstance(split, str) and name and split):
    return None
  return out_path(args.source, workdir, step, name, split, args.no_ema)


def check_out(out: str, overwrite: bool) -> None:
  """Raises FileExistsError (a metrics.json in ``out``, without ``overwrite``) or
  NotADirectoryError, before any work."""
  if storage.exists(out) and not storage.isdir(out):
    raise NotADirectoryError(f'--out {out} is a file: give a directory.')
  if storage.exists(storage.join(out, METRICS_JSON)) and not overwrite:
    raise FileExistsError(f'{out} already holds a result ({METRICS_JSON}): pass --overwrite to '
                          'replace it, or --out DIR for another directory.')


def write_outputs(out: str, metrics: Dict[str, Any], confusion: Optional[np.ndarray],
                  names: Sequence[str], title: str) -> List[str]:
  """Writes the confusion PNG and CSV (single-label), then metrics.json (last: a failure leaves
  none, so a rerun is not refused) into ``out``; returns the names, metrics.json first."""
  storage.makedirs(out)
  files = {}
  if confusion is not None:
    files[CONFUSION_PNG] = png_bytes(confusion, names, title)
    files[CONFUSION_CSV] = csv_text(confusion, names).encode()
  files[METRICS_JSON] = json.dumps(metrics, indent=1).encode() + b'\n'
  for name, content in files.items():
    with storage.open_file(storage.join(out, name), 'wb') as f:
      f.write(content)
  return [METRICS_JSON] + [name for name in files if name != METRICS_JSON]


def summary(metrics: Dict[str, Any], eval_data: EvalData) -> str:
  """The human summary printed by the command."""
  label = 'precision@1' if eval_data.multi_label else 'accuracy'
  lines = [f"Evaluated {metrics['source']} on {eval_data.label}",
           f"  {metrics['count']} examples, batch {metrics['batch_size']}; "
           f"{metrics['preprocessing']['description']}",
           f"  {label:<15} {metrics['accuracy']:.4f}  ({metrics['correct']} of "
           f"{metrics['count']})"]
  if metrics['top5_accuracy'] is not None:
    lines.append(f"  {'top-5 accuracy':<15} {metrics['top5_accuracy']:.4f}")
  lines.append(f"  {'loss':<15} {metrics['loss']:.4f}")
  per_class = [c for c in metrics['per_class'] or () if c['accuracy'] is not None]
  if per_class and len(metrics['per_class']) <= 10:
    width = max(len(c['name']) for c in per_class)
    lines.append('  per class:')
    lines += [f"    {c['name']:<{width}}  {c['accuracy']:.4f}  ({c['correct']} of {c['count']})"
              for c in per_class]
  elif per_class:
    ranked = sorted(per_class, key=lambda c: (c['accuracy'], c['index']))
    show = lambda cs: ', '.join(f"{c['name']} {c['accuracy']:.3f}" for c in cs)
    lines.append(f'  per class: lowest {show(ranked[:5])}; highest {show(ranked[::-1][:5])}')
  elif metrics['per_class'] is None:
    lines.append('  per class: skipped (multi-label data)')
  return '\n'.join(lines)
