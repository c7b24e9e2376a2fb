"""vit_jax.storage: paths, the file API (local, and remote through TensorFlow's file system,
reached here with ``file://`` URLs; gs:// itself: tests/test_gcs.py) and storage errors."""

import errno
import os

import pytest

from vit_jax import storage


def test_paths_local_and_remote():
  assert (storage.is_remote('gs://b/x'), storage.is_remote('/tmp/x')) == (True, False)
  assert (storage.scheme('gs://b/x'), storage.scheme('/tmp/gs://x')) == ('gs://', '')
  assert storage.join('gs://b/run/', 'checkpoints', '5') == 'gs://b/run/checkpoints/5'
  assert storage.join('run', 'checkpoints') == os.path.join('run', 'checkpoints')
  assert [storage.basename(p) for p in ('gs://b/run/', '/tmp/run/', 'x.npz')] == [
      'run', 'run', 'x.npz']
  assert [storage.dirname(p) for p in ('gs://b/run/ckpt/', 'gs://b/run', 'gs://b', '/a/b')] == [
      'gs://b/run', 'gs://b', 'gs://b', '/a']
  assert storage.clean('./run//checkpoints/') == 'run/checkpoints'
  assert storage.clean('gs://b/run/') == 'gs://b/run'
  assert storage.absolute('gs://b/x') == 'gs://b/x'
  assert storage.absolute('x') == os.path.join(os.getcwd(), 'x')
  assert storage.parents('gs://b/run/ckpt/') == ['gs://b/run/ckpt', 'gs://b/run', 'gs://b']
  assert storage.parents('/a/b') == [os.path.realpath('/a/b'), os.path.realpath('/a'), '/']
  assert str(storage.Path('gs://b/run') / 'checkpoints') == 'gs://b/run/checkpoints'
  assert str(storage.Path('run')) == os.path.join(os.getcwd(), 'run')
  assert [storage.overlap(a, b) for a, b in (('gs://b/run/', 'gs://b/run'), ('gs://b/run/x',
          'gs://b/run'), ('gs://b/run', 'gs://b/run/x'), ('gs://b/run2', 'gs://b/run'),
          ('/a/b/', '/a/b/../b'), ('/a/bc', '/a/b'))] == [True, True, True, False, True, False]


def test_local_files(tmp_path):
  target = str(tmp_path / 'a' / 'b' / 'x.bin')
  storage.write_bytes(target, b'12345')  # Its folders created.
  assert storage.read_bytes(target, 3) == b'123' and storage.size(target) == 5
  assert storage.glob(str(tmp_path / 'a' / '*' / '*.bin')) == [target]
  copy = str(tmp_path / 'y.bin')
  storage.copy(target, copy)
  with pytest.raises(FileExistsError):
    storage.copy(target, copy)
  storage.write_bytes(target, b'new')
  with pytest.raises(FileExistsError):
    storage.rename(target, copy)
  storage.rename(target, copy, overwrite=True)
  assert not storage.exists(target) and storage.read_bytes(copy) == b'new'
  assert abs(storage.mtime(copy) - os.path.getmtime(copy)) < 1e-6
  os.mkfifo(tmp_path / 'fifo')
  assert storage.not_a_file(str(tmp_path / 'fifo')) == 'a FIFO'
  with pytest.raises(storage.NotAFileError, match='fifo is a FIFO, not a file that can be read'):
    storage.read_bytes(str(tmp_path / 'fifo'))  # Never opened: it would wait forever.
  assert storage.not_a_file('gs://b/fifo') is None  # Objects are files.


def test_remote_paths_go_through_tensorflow_and_a_pruned_walk_skips_folders(tmp_path):
  """``file://`` URLs are remote to storage: TensorFlow's file system, as gs:// ones are."""
  for name in ('.hidden/a.png', 'sub/b.png', 'sub/deeper/c.png'):
    os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
    (tmp_path / name).write_bytes(b'x')
  root = f'file://{tmp_path}'
  walked = []
  for folder, dirs, names in storage.walk(root):
    dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    walked.append((folder[len(root):], dirs, sorted(names)))
  assert walked == [('', ['sub'], []), ('/sub', ['deeper'], ['b.png']),
                    ('/sub/deeper', [], ['c.png'])]
  assert sorted(storage.listdir(root)) == ['.hidden', 'sub']
  storage.write_bytes(f'{root}/new/d.bin', b'abc')
  assert (tmp_path / 'new' / 'd.bin').read_bytes() == b'abc'
  assert storage.size(f'{root}/new/d.bin') == 3 and storage.isdir(f'{root}/new')
  with pytest.raises(FileNotFoundError) as info:
    with storage.os_errors():
      storage.read_bytes(f'{root}/missing.bin')
  assert info.value.errno == errno.ENOENT and 'missing.bin' in info.value.strerror
  with pytest.raises(PermissionError, match='local'):
    with storage.os_errors():
      raise PermissionError('local')  # Not TensorFlow's: unchanged.


def test_storage_errors_are_classified():
  assert storage.write_failure(OSError(errno.ENOSPC, 'No space left on device')) == 'full'
  assert storage.write_failure(PermissionError(errno.EACCES, 'Permission denied')) == 'denied'
  assert storage.write_failure(RuntimeError('UNAVAILABLE: the server')) == 'unreachable'
  assert storage.write_failure(RuntimeError('a bug')) is None
  assert storage.cause(OSError(errno.ENOSPC, 'x')) == 'No space left on device'
  assert storage.unreachable(RuntimeError('[Gloo] UNAVAILABLE: Connection reset')) is None
  assert storage.unreachable(RuntimeError('DEADLINE_EXCEEDED\nmore')).startswith(
      'The storage did not answer (DEADLINE_EXCEEDED). Check')
  status = storage.failure(RuntimeError('GET gs://nope: response code 404'))
  assert status[1] == 2 and status[0].startswith("The storage answered 'Not Found'")
  assert storage.failure(ValueError('bad input')) is None
