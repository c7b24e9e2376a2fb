"""`python -m vit_jax.to_array_record` on a full disk (issue 50: a traceback, and a partial
`.incomplete` shard left on the full disk): one FATAL line naming the disk and the fix, nothing
partial left, and a rerun with room finishes. The destination's disk is a real tmpfs (mounting
needs root, as CI has); the staging disk's is array_record's error, simulated."""

import errno
import os
import subprocess
import threading

from array_record.python import array_record_module
import pytest

from tests import data_utils
from vit_jax.tools import to_array_record

SHARD = 'tiny_multi_label-{}.{}-00000-of-00001'


@pytest.fixture
def small_disk(tmp_path):
  """A 1 MiB tmpfs mounted at `tmp_path / 'disk'`."""
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root')
  mount = tmp_path / 'disk'
  mount.mkdir()
  subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(mount)], check=True,
                 capture_output=True)
  yield mount
  subprocess.run(['umount', str(mount)], check=True, capture_output=True)


def _fill(directory):
  """Fills the disk of `directory` to its last byte; returns the filler file."""
  filler = directory / 'filler'
  fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    while True:
      os.write(fd, bytes(1 << 16))
  except OSError as e:
    assert e.errno == errno.ENOSPC
  finally:
    os.close(fd)
  return filler


def _files(directory):
  return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_a_full_disk_is_one_line_leaves_nothing_partial_and_a_rerun_finishes(small_disk,
                                                                             capsys):
  path = data_utils.make_multilabel_dataset(str(small_disk), num_train=12, num_test=10)
  before = _files(small_disk / 'tiny_multi_label' / '1.0.0')
  filler = _fill(small_disk)
  capsys.readouterr()
  assert to_array_record.main([path, '--workers', '1']) == 1
  assert capsys.readouterr().err == (
      f'FATAL: The disk of {path} (mounted at {small_disk}) is full (0.0 MiB free) writing '
      f'{SHARD.format("train", "array_record")}: free space there (the ArrayRecord shards take '
      'about as much as the TFRecord ones), then rerun: the shards complete so far are kept, '
      'nothing partial was left.\n')
  assert _files(small_disk / 'tiny_multi_label' / '1.0.0') == before  # No .incomplete file.
  filler.unlink()
  assert to_array_record.main([path, '--workers', '1']) == 0
  assert sorted(os.listdir(path)) == sorted([*before, *(SHARD.format(split, 'array_record')
                                                         for split in ('test', 'train'))])


def test_a_full_staging_disk_is_named_with_the_fix_and_its_partial_shard_removed(
    tmp_path, monkeypatch):
  """A dataset in a bucket is staged on local disk: that disk full, the fix is another
  --staging-dir (or fewer --workers); the staged shard is removed, nothing reaches the target."""
  path = data_utils.make_multilabel_dataset(str(tmp_path / 'data'), num_train=12, num_test=10)
  staging = tmp_path / 'staging'
  scratch = staging / 'to_array_record-1-abc'  # As _staging_dir makes it.
  scratch.mkdir(parents=True)

  class FullDisk:
    """array_record's writer on a full disk: the file made, then `No space left on device`."""

    def __init__(self, local, options):  # pylint: disable=unused-argument
      self.local = local
      with open(local, 'wb') as f:
        f.write(bytes(8192))

    def write(self, record):  # pylint: disable=unused-argument
      raise RuntimeError(f'write() failed: No space left on device; writing {self.local}; at '
                         'byte 8192; Failed to close chunk_writer')

  monkeypatch.setattr(array_record_module, 'ArrayRecordWriter', FullDisk)
  monkeypatch.setattr(to_array_record.shutil, 'disk_usage', lambda _: type(
      'Usage', (), {'free': 3 << 20})())
  mount = str(scratch)
  while not os.path.ismount(mount):
    mount = os.path.dirname(mount)
  target = os.path.join(path, SHARD.format('train', 'array_record'))
  with pytest.raises(OSError) as error:
    to_array_record._convert(os.path.join(path, SHARD.format('train', 'tfrecord')), target, 12,
                             str(scratch), threading.Event())
  assert error.value.errno == errno.ENOSPC
  assert str(error.value.strerror) == (
      f'The disk of the staging folder {staging} (mounted at {mount}) is full (3.0 MiB free) '
      f'writing {SHARD.format("train", "array_record")}: free space there, or give --staging-dir '
      'on a larger disk (or fewer --workers), then rerun: the shards complete so far are kept, '
      'nothing partial was left.')
  assert os.listdir(scratch) == []
  assert not [name for name in os.listdir(path) if 'array_record' in name]


def test_a_dataset_not_prepared_in_its_data_dir_is_named_with_the_fix(tmp_path, capsys):
  assert to_array_record.main(['tiny_multi_label', '--data-dir', str(tmp_path)]) == 2
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"FATAL: 'tiny_multi_label' is not prepared in {tmp_path}: give the --data-dir it is "
      'prepared in, or its directory (e.g. ~/tensorflow_datasets/NAME/VERSION).')
