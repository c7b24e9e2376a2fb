"""Damaged and hostile checkpoint files: each is refused with one clear error (a ValueError:
``vit_jax.main`` prints one ``FATAL:`` line and exits 2) naming the file, what is wrong and the
fix, never a zipfile/zlib/pickle traceback, and never a huge allocation.

The files are real: a truncated or CRC-damaged ``.npz`` written by ``save_npz``, half of the
T2T-ViT fixture ``.pth.tar``, and tiny torch-layout zips whose ``data.pkl`` is written opcode by
opcode here (no torch): a ``posix.system`` call, a zero-stride tensor that would be 256 MiB, a
storage member that inflates past the file's own size.
"""

import io
import os
import pathlib
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from tests.data import test_bad_images
from tests.test_train_failures import _folder, _main_args, _main_overrides
from vit_jax import checkpoint
from vit_jax import storage
from vit_jax.checkpoint import torch_pickle

ROOT = pathlib.Path(__file__).parents[2]
FIXTURES = ROOT / 'tests' / 'fixtures'
T2T_PTH = FIXTURES / 't2t_tiny_performer' / 'checkpoint.pth.tar'

# ------------------------------------------------------------------------------------------------
# Writers of damaged and hand-made files.
# ------------------------------------------------------------------------------------------------


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {'embedding': {'kernel': rng.standard_normal((4, 4, 3, 8)).astype(np.float32),
                        'bias': np.zeros(8, np.float32)},
          'head': {'kernel': rng.standard_normal((8, 10)).astype(np.float32),
                   'bias': np.arange(10, dtype=np.float32)}}


def write_npz(path):
  """A real official-layout ``.npz`` (``save_npz``) of four small arrays; returns ``path``."""
  checkpoint.save_npz(path, _params())
  return path


def truncate(src, dst, fraction=0.5):
  """``dst``: the first ``fraction`` of ``src`` (an interrupted download)."""
  data = pathlib.Path(src).read_bytes()
  pathlib.Path(dst).write_bytes(data[:int(len(data) * fraction)])
  return dst


def flip_byte_in_member(path, member, at=100):
  """Flips one byte ``at`` bytes into ``member``'s data (its CRC-32 no longer matches)."""
  with zipfile.ZipFile(path) as archive:
    info = archive.getinfo(member)
  data = bytearray(pathlib.Path(path).read_bytes())
  header = 30 + len(info.filename.encode()) + len(info.extra)  # The member's local header.
  data[info.header_offset + header + at] ^= 0xFF
  pathlib.Path(path).write_bytes(bytes(data))
  return path


# A torch.save zip (see vit_jax/checkpoint/torch_pickle.py) written by hand: data.pkl in pickle
# protocol 2 opcodes, storages under data/<key>.


def _str(text):
  raw = text.encode()
  return b'X' + len(raw).to_bytes(4, 'little') + raw  # BINUNICODE


def _int(value):
  return pickle.dumps(value, protocol=2)[2:-1]  # BININT1/BININT2/BININT/LONG1, no memo.


def _tuple(values):
  return b'(' + b''.join(_int(v) for v in values) + b't'


def pkl_tensor(key, numel, offset, size, stride, storage='FloatStorage'):
  """``torch._utils._rebuild_tensor_v2`` of persistent storage ``key`` as torch.save writes it."""
  storage_id = (b'(' + _str('storage') + f'ctorch\n{storage}\n'.encode() + _str(key) +
                _str('cpu') + _int(numel) + b'tQ')  # BINPERSID
  return (b'ctorch._utils\n_rebuild_tensor_v2\n(' + storage_id + _int(offset) + _tuple(size) +
          _tuple(stride) + b'\x89ccollections\nOrderedDict\n)RtR')


def pkl_state_dict(entries):
  """``{'state_dict': {name: <tensor opcodes>}}`` as a complete pickle."""
  items = b''.join(_str(name) + value for name, value in entries.items())
  return b'\x80\x02}' + _str('state_dict') + b'}(' + items + b'us.'


def pkl_system(marker):
  """A pickle of ``posix.system('touch <marker>')``: what a hostile checkpoint would run."""
  return b'\x80\x02cposix\nsystem\n' + _str(f'touch {marker}') + b'\x85R.'


def write_torch_zip(path, data_pkl, storages=(), *, compress=zipfile.ZIP_STORED):
  """A zip in torch.save's layout: ``archive/data.pkl`` and ``archive/data/<key>`` members."""
  with zipfile.ZipFile(path, 'w') as archive:
    archive.writestr('archive/data.pkl', data_pkl)
    archive.writestr('archive/byteorder', 'little')
    for key, raw in dict(storages).items():
      archive.writestr(f'archive/data/{key}', raw, compress_type=compress)
    archive.writestr('archive/version', '3\n')
  return path


# ------------------------------------------------------------------------------------------------
# .npz files.
# ------------------------------------------------------------------------------------------------


def test_the_hand_written_files_are_valid_when_not_damaged(tmp_path):
  """The writers above make loadable files: the refusals below are about the damage alone."""
  good = write_npz(tmp_path / 'good.npz')
  flat = checkpoint.flatten_params(checkpoint.load(good)['params'])
  np.testing.assert_array_equal(flat['head/bias'], np.arange(10, dtype=np.float32))
  values = np.arange(6, dtype=np.float32)
  path = write_torch_zip(tmp_path / 'good.pth.tar',
                         pkl_state_dict({'w': pkl_tensor('0', 6, 0, (2, 3), (1, 2)),
                                         'v': pkl_tensor('0', 6, 2, (4,), (1,))}),
                         {'0': values.tobytes()})
  loaded = checkpoint.load_pth(path)
  np.testing.assert_array_equal(loaded['w'], values.reshape(3, 2).T)
  np.testing.assert_array_equal(loaded['v'], values[2:])


def test_a_truncated_npz_is_reported_as_damaged(tmp_path):
  good = write_npz(tmp_path / 'good.npz')
  size = good.stat().st_size
  for name in ('half.npz', 'half.pth.tar'):  # Whatever its name: the zip magic is what counts.
    half = truncate(good, tmp_path / name)
    for call in (checkpoint.detect, checkpoint.load, checkpoint.load_npz):
      with pytest.raises(checkpoint.DamagedCheckpointError) as error:
        call(half)
      assert str(error.value) == (
          f"{str(half)!r} is truncated or damaged: its zip directory cannot be read (File is not "
          f"a zip file); the file has {size // 2:,} bytes. Download or copy it again.")
      assert isinstance(error.value, ValueError)


def test_a_crc_damaged_npz_member_is_reported(tmp_path):
  path = flip_byte_in_member(write_npz(tmp_path / 'crc.npz'), 'embedding/kernel.npy')
  assert checkpoint.detect(path) == 'npz'  # Its directory is intact; the member is not.
  with pytest.raises(checkpoint.DamagedCheckpointError) as error:
    checkpoint.load(path)
  assert str(error.value) == (
      f"{str(path)!r} is truncated or damaged: its member 'embedding/kernel.npy' cannot be read "
      f"(Bad CRC-32 for file 'embedding/kernel.npy'); the file has {path.stat().st_size:,} bytes. "
      "Download or copy it again.")


def test_a_damaged_compressed_npz_member_is_reported(tmp_path):
  path = tmp_path / 'compressed.npz'
  np.savez_compressed(path, **{'head/kernel': np.ones((64, 64), np.float32)})
  flip_byte_in_member(path, 'head/kernel.npy', at=20)
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=r"its member 'head/kernel\.npy' cannot be read \(.*\).*Download or copy "
                     r"it again"):
    checkpoint.load(path)


def test_an_npz_header_claiming_more_than_its_member_holds_is_refused(tmp_path):
  """A hand-made member whose .npy header claims a (100000, 100000) array (40 GB) is refused
  before anything is allocated."""
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(
      header, {'descr': '<f4', 'fortran_order': False, 'shape': (100000, 100000)})
  path = tmp_path / 'huge.npz'
  with zipfile.ZipFile(path, 'w') as archive:
    archive.writestr('head/kernel.npy', header.getvalue() + b'\0' * 16)
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=r"its member 'head/kernel\.npy' declares a float32 array of shape "
                     r"\(100000, 100000\) \(40,000,000,000 bytes\) but holds 16 bytes"):
    checkpoint.load(path)


# ------------------------------------------------------------------------------------------------
# PyTorch files.
# ------------------------------------------------------------------------------------------------


def test_a_truncated_pth_is_reported_as_damaged(tmp_path):
  half = truncate(T2T_PTH, tmp_path / 'half.pth.tar')
  size = half.stat().st_size
  message = (f"{str(half)!r} is truncated or damaged: its zip directory cannot be read (File is "
             f"not a zip file); the file has {size:,} bytes. Download or copy it again.")
  for call in (checkpoint.detect, checkpoint.load_pth, torch_pickle.load_torch_zip):
    with pytest.raises(checkpoint.DamagedCheckpointError) as error:
      call(str(half))
    assert str(error.value) == message


def test_a_crc_damaged_storage_is_reported(tmp_path):
  path = tmp_path / 'crc.pth.tar'
  path.write_bytes(T2T_PTH.read_bytes())
  with zipfile.ZipFile(path) as archive:
    member = max(archive.infolist(), key=lambda info: info.file_size).filename
  flip_byte_in_member(path, member)
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=rf"is truncated or damaged: its member '{member}' cannot be read "
                     rf"\(Bad CRC-32 for file '{member}'\)"):
    checkpoint.load_pth(path)


def test_a_pickle_calling_posix_system_is_refused_as_a_value_error(tmp_path):
  marker = tmp_path / 'ran'
  path = write_torch_zip(tmp_path / 'evil.pth.tar', pkl_system(marker))
  with pytest.raises(torch_pickle.UnsafePickleError) as error:
    checkpoint.load_pth(path)
  assert str(error.value) == (
      f"{str(path)!r}: refusing to unpickle posix.system: only tensors and plain containers are "
      "loaded; nothing was run. Use weights from a trusted source, or re-save only the tensors "
      "with torch: torch.save(model.state_dict(), path).")
  assert isinstance(error.value, ValueError) and isinstance(error.value, pickle.UnpicklingError)
  assert not marker.exists()


def test_a_zero_stride_tensor_cannot_demand_a_huge_array(tmp_path):
  """622 bytes that used to load as a 256 MiB array: 8192 x 8192 views of one float."""
  path = write_torch_zip(tmp_path / 'tiny.pth.tar',
                         pkl_state_dict({'w': pkl_tensor('0', 1, 0, (8192, 8192), (0, 0))}),
                         {'0': np.float32(1).tobytes()})
  assert path.stat().st_size < 1000
  with pytest.raises(checkpoint.DamagedCheckpointError) as error:
    checkpoint.load_pth(path)
  assert str(error.value) == (
      f"{str(path)!r} is damaged or hand-made: a tensor of shape (8192, 8192), strides (0, 0), "
      "offset 0 addresses 67,108,864 elements of storage '0', which holds 1. Download or copy it "
      "again.")
  assert isinstance(error.value, pickle.UnpicklingError)  # What older callers catch.


def test_a_storage_record_larger_than_its_member_is_refused_before_reading(tmp_path):
  path = write_torch_zip(tmp_path / 'big.pth',
                         pkl_state_dict({'w': pkl_tensor('0', 2**40, 0, (2**20,), (1,))}),
                         {'0': b'\0' * 16})
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=r"is damaged or hand-made: storage '0' holds 16 bytes but its record "
                     r"declares 4,398,046,511,104\. Download"):
    checkpoint.load_pth(path)


def test_a_compressed_storage_cannot_inflate_past_the_file(tmp_path):
  """A zip bomb: 4 MiB of zeros deflated into a file of a few KiB."""
  numel = 2**20
  path = write_torch_zip(tmp_path / 'bomb.pth.tar',
                         pkl_state_dict({'w': pkl_tensor('0', numel, 0, (numel,), (1,))}),
                         {'0': bytes(4 * numel)}, compress=zipfile.ZIP_DEFLATED)
  size = path.stat().st_size
  assert size < 10_000
  with pytest.raises(checkpoint.DamagedCheckpointError) as error:
    checkpoint.load_pth(path)
  assert str(error.value) == (
      f"{str(path)!r} is damaged or hand-made: its member 'archive/data/0' declares "
      f"4,194,304 bytes, more than the whole file ({size:,} bytes). Download or copy it again.")


def test_compressed_storages_cannot_inflate_past_the_file_together(tmp_path):
  """Each deflated storage is smaller than the file, all six together are 4 times larger
  (one-element tensors of each: only the storages would be big)."""
  storages = {'0': np.arange(2000, dtype=np.float32).tobytes(),
              **{str(i): bytes(6000) for i in range(1, 6)}}
  tensors = {f'w{i}': pkl_tensor(str(i), len(raw) // 4, 0, (1,), (1,))
             for i, raw in enumerate(storages.values())}
  path = tmp_path / 'bombs.pth'
  with zipfile.ZipFile(path, 'w') as archive:
    archive.writestr('archive/data.pkl', pkl_state_dict(tensors))
    for key, raw in storages.items():
      archive.writestr(f'archive/data/{key}', raw,
                       compress_type=zipfile.ZIP_STORED if key == '0' else zipfile.ZIP_DEFLATED)
  size = path.stat().st_size
  assert 6000 < size < 10_000
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=rf"its members declare [\d,]+ bytes together, more than the whole file "
                     rf"\({size:,} bytes\)"):
    checkpoint.load_pth(path)


def test_distinct_views_cannot_add_up_past_the_file(tmp_path):
  """Each view fits its storage, but 100 overlapping ones add up to 20 times the file."""
  values = np.arange(1000, dtype=np.float32)
  views = {f'w{i}': pkl_tensor('0', 1000, i, (900,), (1,)) for i in range(100)}
  path = write_torch_zip(tmp_path / 'views.pth', pkl_state_dict(views), {'0': values.tobytes()})
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=r"its tensors add up to more than the file's .* bytes"):
    checkpoint.load_pth(path)


def test_identical_views_are_one_array_counted_once(tmp_path):
  """Tied weights (the same view of one storage, 100 times) load, as one shared array."""
  values = np.arange(1000, dtype=np.float32)
  views = {f'w{i}': pkl_tensor('0', 1000, 0, (10, 100), (100, 1)) for i in range(100)}
  path = write_torch_zip(tmp_path / 'tied.pth', pkl_state_dict(views), {'0': values.tobytes()})
  loaded = checkpoint.load_pth(path)
  assert len(loaded) == 100
  assert all(loaded[f'w{i}'] is loaded['w0'] for i in range(100))
  np.testing.assert_array_equal(loaded['w99'], values.reshape(10, 100))


# ------------------------------------------------------------------------------------------------
# The command lines: one FATAL line, exit 2.
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_convert_prints_one_fatal_line_for_damaged_and_hostile_files(tmp_path):
  half = truncate(write_npz(tmp_path / 'good.npz'), tmp_path / 'half.npz')
  marker = tmp_path / 'ran'
  evil = write_torch_zip(tmp_path / 'evil.pth.tar', pkl_system(marker))
  expected = {
      (half,): f"FATAL: '{half}' is truncated or damaged: its zip directory cannot be read",
      (evil, '--model', 'T2T-ViT-14'): f"FATAL: '{evil}': refusing to unpickle posix.system",
  }
  for args, start in expected.items():
    run = subprocess.run([sys.executable, '-m', 'vit_jax.convert', str(args[0]),
                          str(tmp_path / 'out'), *args[1:]], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), run.stderr
    assert not (tmp_path / 'out').exists()
  assert not marker.exists()


@pytest.mark.slow
def test_main_with_a_truncated_init_from_prints_one_fatal_line(tmp_path):
  half = truncate(write_npz(tmp_path / 'good.npz'), tmp_path / 'ViT-B_16.npz')
  workdir = tmp_path / 'workdir'
  run = subprocess.run(_main_args(workdir, _main_overrides(_folder(tmp_path), init_from=half)),
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert run.returncode == 2, run.stderr
  fatal = [line for line in run.stderr.splitlines() if line.startswith('FATAL:')]
  assert len(fatal) == 1, run.stderr
  assert str(half) in fatal[0] and 'truncated or damaged' in fatal[0], fatal
  assert 'Download or copy it again' in fatal[0]
  assert 'Traceback' not in run.stderr
  assert not workdir.exists()


@pytest.mark.parametrize('name', ['x.npz', 'x.safetensors', 'x.pth'])
def test_a_fifo_named_like_weights_is_refused_and_never_opened(tmp_path, name):
  """Issue 50 (item 6's weight files): opening a FIFO waits for a writer forever; every
  checkpoint read refuses it by what it is, without opening it."""
  fifo = tmp_path / name
  os.mkfifo(fifo)
  with test_bad_images.unblocked_after(str(fifo), 30):  # A regression fails, never hangs.
    with pytest.raises(storage.NotAFileError,
                       match=f'^{fifo} is a FIFO, not a file that can be read: give'):
      checkpoint.load(str(fifo))
