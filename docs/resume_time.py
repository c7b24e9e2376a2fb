r"""Time to the first training batch after a resume, TFRecord (read in order) vs ArrayRecord
(read by index): the figures of docs/data.md's "Resuming in constant time" table.

Generates an ImageNet-like tfds dataset (`--records` JPEGs of 500x375 pixels, about 75 KB each,
1,000 classes; 64 distinct images repeated) under DIR, prepared as TFRecord. For each position
(0, 50 and 90% of an epoch) it builds the training iterator at the step of that position
(`vit_jax.data.create_train_iterator(..., start_step)`, the config's defaults: Inception crop and
flip at 224 px) and times it to the first batch, for TFRecord with each of `--shuffle-buffers`
(a buffer fills before the first batch); then it adds ArrayRecord files with
`python -m vit_jax.to_array_record` and times the same again.

  python docs/resume_time.py --dir /tmp/resume_jpegs [--records 52000] [--batch 256] \
      [--shuffle-buffers 50000,2000]

Needs about 4 GB per format on disk (52,000 records). The files sit in the page cache after the first pass,
so the TFRecord figures are its CPU cost (parsing the records it skips); from Cloud Storage add
the reading time.
"""

from __future__ import annotations

import argparse
import io
import os
import time

import numpy as np
from PIL import Image
import tensorflow_datasets as tfds

from vit_jax import config as config_lib
from vit_jax import data
from vit_jax.data import sources
from vit_jax.tools import to_array_record

_SIZE = (500, 375)  # width, height
_COUNT = {'records': 52_000}


def _jpegs(count: int = 64) -> list[bytes]:
  """`count` textured 500x375 JPEGs (quality 90), photograph-like in size."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(count):
    coarse = Image.fromarray(rng.integers(0, 256, (15, 20, 3), np.uint8)).resize(
        _SIZE, Image.BICUBIC)
    pixels = np.asarray(coarse, np.float32) + rng.normal(0, 12, (*_SIZE[::-1], 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, 'JPEG', quality=90)
    out.append(buffer.getvalue())
  return out


class ResumeJpegs(tfds.core.GeneratorBasedBuilder):
  """The generated ImageNet-like dataset (train split only)."""
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(encoding_format='jpeg'),
        'label': tfds.features.ClassLabel(num_classes=1000)}))

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    images = _jpegs()
    for i in range(_COUNT['records']):
      yield i, {'image': io.BytesIO(images[i % len(images)]), 'label': i % 1000}


def _first_batch_seconds(cfg, batch: int, step: int) -> float:
  start = time.perf_counter()
  next(data.create_train_iterator(cfg, batch, seed=0, start_step=step, process_index=0,
                                  process_count=1))
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--dir', required=True, help='where the dataset is generated')
  parser.add_argument('--records', type=int, default=52_000)
  parser.add_argument('--batch', type=int, default=256)
  parser.add_argument('--shuffle-buffers', type=lambda t: [int(b) for b in t.split(',')],
                      default=[50_000, 2_000], help='TFRecord shuffle buffers to time (elements)')
  parser.add_argument('--repeats', type=int, default=2, help='timings per point (min shown)')
  args = parser.parse_args()
  _COUNT['records'] = args.records
  builder = ResumeJpegs(data_dir=args.dir)
  if not builder.is_prepared():
    start = time.perf_counter()
    builder.download_and_prepare()
    print(f'Generated {args.records:,} records in {time.perf_counter() - start:.0f} s.')
  cfg = config_lib.defaults.data_config()
  cfg.name = os.fspath(builder.data_dir)
  steps_per_epoch = args.records // args.batch
  points = {f'{p:.0%}': int(p * steps_per_epoch) for p in (0, 0.5, 0.9)}
  rows = {}
  runs = [(f'TFRecord, buffer {b:,}', b) for b in args.shuffle_buffers] + [('ArrayRecord', 0)]
  for fmt, buffer in runs:
    cfg.shuffle_buffer = buffer or cfg.shuffle_buffer
    if fmt == 'ArrayRecord':
      start = time.perf_counter()
      to_array_record.main([cfg.name])
      print(f'to_array_record: {time.perf_counter() - start:.0f} s.')
      sources._SOURCES.clear()  # pylint: disable=protected-access
    elif sources.get_source(cfg).has_array_record:
      raise SystemExit(f'{cfg.name} has ArrayRecord files already: use a new --dir.')
    for name, step in points.items():
      times = [_first_batch_seconds(cfg, args.batch, step) for _ in range(args.repeats)]
      rows[fmt, name] = min(times)
      print(f'{fmt:24s} resume at {name:>4s} of an epoch (step {step}): first batch in '
            + ', '.join(f'{t:.2f}' for t in times) + ' s', flush=True)
  print('\n| format | ' + ' | '.join(points) + ' |\n|---|' + '---|' * len(points))
  for fmt, _ in runs:
    print(f'| {fmt} | ' + ' | '.join(f'{rows[fmt, p]:.2f} s' for p in points) + ' |')


if __name__ == '__main__':
  main()
