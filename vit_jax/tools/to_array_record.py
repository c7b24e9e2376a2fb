r"""Adds ArrayRecord files to a prepared tfds dataset, so that training reads it by index and a
resumed run starts its input at once (TFRecord files are read in order: a resume reads again
every example of the epoch before its step). No Apache Beam.

  python -m vit_jax.to_array_record ~/tensorflow_datasets/imagenet2012/5.1.0
  python -m vit_jax.to_array_record imagenet2012 --data-dir gs://bucket/tfds --workers 16

Each TFRecord shard is copied record by record (the same serialized examples) into an
ArrayRecord shard beside it, written under a temporary name and renamed when complete; then
``dataset_info.json`` lists ArrayRecord as an alternative file format (TFRecord stays the
primary one). Rerunning skips the shards already complete (a damaged one is written again).
Bad input: one ``FATAL:`` line, exit 2.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import tempfile
from typing import Optional, Sequence

from vit_jax.tools import common


def _shards(builder) -> list[tuple[str, str, int]]:
  """(TFRecord path, ArrayRecord path, records) of every shard of every split."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  out = []
  for split in builder.info.splits.values():
    paths = split.filepaths
    targets = split.filename_template.replace(
        filetype_suffix=tfds.core.FileFormat.ARRAY_RECORD.file_suffix).sharded_filepaths(
            len(paths))
    out += [(str(a), str(b), n) for a, b, n in zip(paths, targets, split.shard_lengths)]
  return out


def _complete(target: str, expected: int) -> bool:
  """Whether ArrayRecord `target` exists, opens and holds `expected` records."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if not tf.io.gfile.exists(target):
    return False
  try:
    return tfds.core.file_adapters.ArrayRecordFileAdapter.num_examples(target) == expected
  except (RuntimeError, OSError):
    return False


def _convert(source: str, target: str, expected: int) -> int:
  """Copies the records of TFRecord `source` into ArrayRecord `target` (written locally, then
  copied and renamed into place) unless it is complete already; returns the records written."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if _complete(target, expected):
    return 0
  with tempfile.TemporaryDirectory() as scratch:
    local = os.path.join(scratch, os.path.basename(target))
    writer = array_record_module.ArrayRecordWriter(local, 'group_size:1')  # As tfds writes.
    count = 0
    for record in tf.data.TFRecordDataset(source).as_numpy_iterator():
      writer.write(record)
      count += 1
    writer.close()
    if count != expected:
      raise ValueError(f'{source} holds {count} records, dataset_info.json says {expected}: the '
                       'dataset is incomplete or changed; prepare it again.')
    tf.io.gfile.copy(local, target + '.incomplete', overwrite=True)
    tf.io.gfile.rename(target + '.incomplete', target, overwrite=True)
  return count


def convert(dataset: str, data_dir: Optional[str] = None,
            workers: int = 0) -> tuple[str, int, int, int]:
  """Adds ArrayRecord shards to the prepared tfds `dataset` (a directory, or a name with
  `data_dir`); returns (its directory, shards, records, records written now). FileNotFoundError:
  no prepared dataset there; ValueError: a shard whose record count differs from
  dataset_info.json."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from vit_jax.data import sources  # pylint: disable=g-import-not-at-top
  if sources.looks_like_path(dataset):
    if not tf.io.gfile.isdir(os.path.expanduser(dataset)):
      raise FileNotFoundError(f'{dataset} is not a directory: give that of a prepared tfds dataset '
                              '(e.g. ~/tensorflow_datasets/NAME/VERSION), or its name.')
    builder = tfds.builder_from_directory(sources.find_builder_dir(dataset))
  else:
    builder = tfds.builder(dataset, data_dir=data_dir)
    if not builder.is_prepared():
      where = data_dir or "tfds's data_dir"
      raise FileNotFoundError(f'{dataset!r} is not prepared in {where}: give its directory (e.g. '
                              '~/tensorflow_datasets/NAME/VERSION) or --data-dir.')
  shards = _shards(builder)
  with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count()) as pool:
    written = sum(pool.map(lambda shard: _convert(*shard), shards))
  info = builder.info
  if tfds.core.FileFormat.ARRAY_RECORD not in info.available_file_formats():
    info.add_alternative_file_format(tfds.core.FileFormat.ARRAY_RECORD)
    info.write_to_directory(builder.data_dir)
  return str(builder.data_dir), len(shards), sum(n for _, _, n in shards), written


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = common.Parser(prog='python -m vit_jax.to_array_record',
                         description=__doc__.split('\n\n')[0],
                         epilog=__doc__.split('\n\n', 1)[1])
  parser.add_argument('dataset', help='a prepared tfds dataset: its directory, or its name')
  parser.add_argument('--data-dir', help="tfds data_dir of a dataset name (default: tfds's)")
  parser.add_argument('--workers', type=int, default=0,
                      help='shards converted at once (default: the CPU count)')
  args = parser.parse_args(argv)
  where, shards, records, written = convert(args.dataset, args.data_dir, args.workers)
  done = 'all written now' if written == records else (
      'all there already' if not written else f'{written:,} examples written now')
  print(f'{where}: {shards} ArrayRecord shards, {records:,} examples ({done}); training now '
        'reads it by index.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
