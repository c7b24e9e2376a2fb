r"""Adds ArrayRecord files to a prepared tfds dataset, so that training reads it by index and a
resumed run starts its input at once (TFRecord files are read in order: a resume reads again
every example of the epoch before its step). No Apache Beam.

  python -m vit_jax.to_array_record ~/tensorflow_datasets/imagenet2012/5.1.0
  python -m vit_jax.to_array_record imagenet2012 --data-dir gs://bucket/tfds --workers 16

Each TFRecord shard is copied record by record into an ArrayRecord shard beside it, written
under a temporary name and renamed when complete; in a bucket each is staged on local disk first
(--staging-dir; too little is refused). dataset_info.json then lists ArrayRecord as an
alternative format. Stopped at any moment, a rerun finishes the work, skipping the shards
already complete. Details: docs/data.md. Bad input: one ``FATAL:`` line, exit 2.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
from typing import Optional, Sequence

from vit_jax import storage
from vit_jax.tools import common

_INCOMPLETE = '.incomplete'
_gib = common.size_text


class _Stopped(Exception):
  """SIGTERM or Ctrl-C during a conversion (the shards done so far stay)."""


def _shards(builder) -> list[tuple[str, str, int, int]]:
  """(TFRecord path, ArrayRecord path, records, TFRecord bytes) of every shard of every split."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  out = []
  for split in builder.info.splits.values():
    paths = split.filepaths
    targets = split.filename_template.replace(
        filetype_suffix=tfds.core.FileFormat.ARRAY_RECORD.file_suffix).sharded_filepaths(
            len(paths))
    out += [(str(a), str(b), n) for a, b, n in zip(paths, targets, split.shard_lengths)]
  with concurrent.futures.ThreadPoolExecutor(16) as pool:  # Thousands of shards in a bucket.
    sizes = pool.map(lambda shard: storage.size(shard[0]), out)
    return [(*shard, size) for shard, size in zip(out, sizes)]


def _complete(target: str, expected: int) -> bool:
  """Whether ArrayRecord `target` exists, opens and holds `expected` records."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if not storage.exists(target):
    return False
  try:
    return tfds.core.file_adapters.ArrayRecordFileAdapter.num_examples(target) == expected
  except (RuntimeError, OSError):
    return False


def _convert(source: str, target: str, expected: int, staging: Optional[str],
             stop: threading.Event) -> int:
  """Copies the records of TFRecord `source` into ArrayRecord `target` unless complete already:
  written aside (staged under `staging` first if remote), then renamed. Returns the count."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if _complete(target, expected):
    return 0
  partial = target + _INCOMPLETE
  local = os.path.join(staging, storage.basename(target)) if staging else partial
  try:
    writer = array_record_module.ArrayRecordWriter(local, 'group_size:1')  # As tfds writes.
    count = 0
    for record in tf.data.TFRecordDataset(source).as_numpy_iterator():
      if stop.is_set():
        raise _Stopped()
      writer.write(record)
      count += 1
    writer.close()
    if count != expected:
      raise ValueError(f'{source} holds {count} records, dataset_info.json says {expected}: the '
                       'dataset is incomplete or changed; prepare it again.')
    if staging:
      storage.copy(local, partial, overwrite=True)
    storage.rename(partial, target, overwrite=True)
  except BaseException as e:
    with contextlib.suppress(Exception):  # Nothing partial left (a rerun writes it again).
      if storage.exists(partial):
        storage.remove(partial)
    if _no_space(e):
      raise _full_disk(local, staging) from None
    raise
  finally:
    if staging and os.path.exists(local):
      os.remove(local)
  return count


def _no_space(error: BaseException) -> bool:
  """Whether ``error`` says a disk is full (array_record's and TensorFlow's are no OSErrors)."""
  return (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
          or any(os.strerror(code) in str(error) for code in (errno.ENOSPC, errno.EDQUOT)))


def _full_disk(path: str, staging: Optional[str]) -> OSError:
  """The OSError (ENOSPC) for a full disk while writing the local ``path``: the disk named (its
  mount point, what is free), with the fix."""
  folder = os.path.dirname(os.path.abspath(path))
  mount = folder
  while not os.path.ismount(mount):
    mount = os.path.dirname(mount)
  free = _gib(shutil.disk_usage(folder).free)
  what = f'the staging folder {os.path.dirname(staging)}' if staging else folder  # Not scratch's.
  fix = ('free space there, or give --staging-dir on a larger disk (or fewer --workers)'
         if staging else 'free space there (the ArrayRecord shards take about as much as the '
         'TFRecord ones)')
  name = os.path.basename(path).removesuffix(_INCOMPLETE)
  return OSError(errno.ENOSPC, f'The disk of {what} (mounted at {mount}) is full ({free} free) '
                 f'writing {name}: {fix}, then rerun: the shards complete so far are kept, '
                 'nothing partial was left.')


def _staging_dir(shards: list, workers: int, staging: Optional[str]) -> tuple[str, int]:
  """A new folder under `staging` (default: the temporary directory; killed runs' removed) for
  the shards in flight, and the bytes they take at most. OSError naming the fix when less is
  free."""
  parent = staging or tempfile.gettempdir()
  if not os.path.isdir(parent):
    raise FileNotFoundError(f'--staging-dir {parent} is not a directory.')
  needed = sum(sorted((size for *_, size in shards), reverse=True)[:workers])
  free = shutil.disk_usage(parent).free
  if needed > free:
    raise OSError(f'Staging the ArrayRecord shards under {parent} needs up to '
                  f'{_gib(needed)} of local disk ({workers} shards at once), but {_gib(free)} '
                  'is free: give fewer --workers, or --staging-dir on a larger disk.')
  for name in os.listdir(parent):  # Left by a killed run (SIGKILL): its process is gone.
    match = re.fullmatch(r'to_array_record-(\d+)-\w+', name)
    if match and not common.pid_alive(int(match.group(1))):
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
  return tempfile.mkdtemp(prefix=f'to_array_record-{os.getpid()}-', dir=parent), needed


def _write_info(builder) -> None:
  """`builder`'s dataset_info.json with ArrayRecord as an alternative format, replaced whole."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from vit_jax.checkpoint import durable  # pylint: disable=g-import-not-at-top
  info = builder.info
  if tfds.core.FileFormat.ARRAY_RECORD in info.available_file_formats():
    return
  info.add_alternative_file_format(tfds.core.FileFormat.ARRAY_RECORD)
  target = storage.join(os.fspath(builder.data_dir), 'dataset_info.json')
  try:
    durable.write_atomically(target, info.as_json, partial=_INCOMPLETE)
  except OSError as e:
    if _no_space(e) and not storage.is_remote(target):
      raise _full_disk(target, None) from None
    raise


def convert(dataset: str, data_dir: Optional[str] = None, workers: int = 0,
            staging: Optional[str] = None, report=lambda line: None) -> tuple[str, int, int, int]:
  """Adds ArrayRecord shards to the prepared tfds `dataset` (a directory, or a name with
  `data_dir`); `report(line)` gets the start line. Returns (its directory, shards, records,
  records written now). FileNotFoundError: no prepared dataset there; ValueError: a shard whose
  record count differs from dataset_info.json; OSError: too little local disk to stage on."""
  from vit_jax.data import sources  # pylint: disable=g-import-not-at-top
  if sources.looks_like_path(dataset) and not storage.isdir(storage.normalize(dataset)):
    raise FileNotFoundError(f'{dataset} is not a directory: give that of a prepared tfds dataset '
                            '(e.g. ~/tensorflow_datasets/NAME/VERSION), or its name.')
  builder = sources.tfds_builder(storage.normalize(dataset), data_dir)
  if not builder.is_prepared():
    where = data_dir or "tfds's data_dir"
    raise FileNotFoundError(f'{dataset!r} is not prepared in {where}: give the --data-dir it is '
                            'prepared in, or its directory (e.g. '
                            '~/tensorflow_datasets/NAME/VERSION).')
  where = os.fspath(builder.data_dir)
  shards = _shards(builder)
  workers = max(1, min(workers or os.cpu_count() or 1, len(shards)))
  remote = storage.is_remote(where)
  scratch = None
  staged = ''
  if remote:
    scratch, needed = _staging_dir(shards, workers, staging)
    staged = f', staged under {scratch} (up to {_gib(needed)} of local disk at once)'
  report(f'{where}: {len(shards)} TFRecord shards, {sum(s for *_, s in shards) / 2**30:.2f} GiB, '
         f'{workers} at a time{staged}...')
  stop = threading.Event()
  handlers = {}

  def on_signal(signum, frame):  # pylint: disable=unused-argument
    stop.set()

  if threading.current_thread() is threading.main_thread():
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      written = sum(pool.map(lambda shard: _convert(*shard[:3], scratch, stop), shards))
  except _Stopped:
    raise KeyboardInterrupt(f'Stopped: the shards complete so far stay; rerun the same command '
                            'to finish.') from None
  finally:
    for signum, handler in handlers.items():
      signal.signal(signum, handler)
    if scratch:
      shutil.rmtree(scratch, ignore_errors=True)
  _write_info(builder)
  return where, len(shards), sum(n for _, _, n, _ in shards), written


def _parser() -> common.Parser:
  parser = common.Parser(prog='python -m vit_jax.to_array_record', description=__doc__)
  parser.add_argument('dataset', help='a prepared tfds dataset: its directory (local or gs://), '
                      'or its name')
  parser.add_argument('--data-dir', help="tfds data_dir of a dataset name (default: tfds's)")
  parser.add_argument('--workers', type=int, default=0,
                      help='shards converted at once (default: the CPU count)')
  parser.add_argument('--staging-dir', help='local folder the shards of a dataset in a bucket are '
                      'written in before their upload (default: the temporary directory, $TMPDIR '
                      'or /tmp)')
  return parser


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  if args.workers < 0:
    raise ValueError(f'--workers {args.workers}: give a positive number, or 0 for the CPU count.')
  where, shards, records, written = convert(args.dataset, args.data_dir, args.workers,
                                            args.staging_dir, report=print)
  if written == records:
    done = 'all written now'
  elif not written:
    done = 'all there already'
  else:
    done = f'{written:,} examples written now'
  print(f'{where}: {shards} ArrayRecord shards, {records:,} examples ({done}); runs started '
        'from now on read it by index (a run that read it in order goes on so).')
  return 0


def run_main() -> None:
  common.run_program(main, _parser)

