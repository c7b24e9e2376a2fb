"""Tests of vit_jax.checkpoint.npz: official .npz files (pre-Linen names, GroupNorm), save_npz,
format detection and errors, and remote (gs://) paths through tf.io.gfile."""

import importlib.machinery
import os
import pathlib
import sys
import types
import zipfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax.models import layout

# Outputs compared with the reference implementations' fixtures: highest matmul precision.
pytestmark = pytest.mark.golden

FIXTURES = pathlib.Path(__file__).parents[1] / 'fixtures'
TINY = FIXTURES / 'vit_tiny'


# ------------------------------------------------------------------------------------------------
# Name conversion of older files.
# ------------------------------------------------------------------------------------------------


def test_convert_pre_linen():
  block = {'LayerNorm_0': 1, 'MultiHeadDotProductAttention_1': 2, 'LayerNorm_2': 3,
           'MlpBlock_3': {'Dense_0': 4, 'Dense_1': 5}}
  tree = {'Transformer': {'encoderblock_0': block, 'encoderblock_1': block, 'encoder_norm': 6},
          'embedding': 7}
  converted = checkpoint.convert_pre_linen(tree)
  assert converted['Transformer']['encoderblock_1'] == {
      'LayerNorm_0': 1, 'MultiHeadDotProductAttention_0': 2, 'LayerNorm_1': 3,
      'MlpBlock_0': {'Dense_0': 4, 'Dense_1': 5}}
  assert converted['embedding'] == 7 and converted['Transformer']['encoder_norm'] == 6
  # Natural (numeric) order: block 10 stays after block 9.
  many = {f'encoderblock_{i}': i for i in range(12)}
  assert checkpoint.convert_pre_linen(many) == many
  # Idempotent on Linen names.
  assert checkpoint.convert_pre_linen(converted) == converted


def test_fix_groupnorm():
  tree = {'gn_root': {'scale': np.ones((1, 1, 1, 8)), 'bias': np.zeros((1, 1, 1, 8))},
          'block1': {'unit1': {'gn1': {'scale': np.ones((1, 1, 1, 4))},
                               'conv1': {'kernel': np.ones((1, 1, 1, 4))}}}}
  fixed = checkpoint.fix_groupnorm(tree)
  assert fixed['gn_root']['scale'].shape == (8,)
  assert fixed['gn_root']['bias'].shape == (8,)
  assert fixed['block1']['unit1']['gn1']['scale'].shape == (4,)
  assert fixed['block1']['unit1']['conv1']['kernel'].shape == (1, 1, 1, 4)


# ------------------------------------------------------------------------------------------------
# Official .npz files.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', ['vit_tiny', 'vit_tiny_gap_repr'])
def test_pre_linen_and_linen_files_load_identically(name):
  old = checkpoint.load(FIXTURES / name / 'params.npz')
  new = checkpoint.load(str(FIXTURES / name / 'params_linen.npz'))
  assert set(old) == {'params'}
  chex.assert_trees_all_equal(old, new)
  block = old['params']['Transformer']['encoderblock_1']
  assert set(block) == {'LayerNorm_0', 'MultiHeadDotProductAttention_0', 'LayerNorm_1',
                        'MlpBlock_0'}
  leaves = jax.tree.leaves(old)
  assert all(isinstance(x, np.ndarray) and x.dtype == np.float32 for x in leaves)
  # The raw pre-Linen file really uses the old names.
  with np.load(FIXTURES / name / 'params.npz') as raw:
    assert 'Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel' in raw.files
    np.testing.assert_array_equal(
        raw['Transformer/encoderblock_0/LayerNorm_2/scale'],
        old['params']['Transformer']['encoderblock_0']['LayerNorm_1']['scale'])


def test_params_prefix_and_groupnorm_in_npz(tmp_path):
  path = tmp_path / 'prefixed.npz'
  np.savez(path, **{'params/gn_root/scale': np.ones((1, 1, 1, 3), np.float32),
                    'params/head/bias': np.zeros(2, np.float32)})
  loaded = checkpoint.load(path)
  assert loaded['params']['gn_root']['scale'].shape == (3,)
  assert loaded['params']['head']['bias'].shape == (2,)


def test_save_npz_round_trip(tmp_path):
  variables = checkpoint.load(TINY / 'params.npz')
  path = tmp_path / 'sub' / 'out.npz'
  checkpoint.save_npz(path, variables['params'])
  chex.assert_trees_all_equal(checkpoint.load(path), variables)
  with np.load(path) as raw:
    assert raw.files == sorted(raw.files)
    assert 'Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel' in raw.files
    assert not any(k.startswith('params') for k in raw.files)
  # Byte-compatible content with the official Linen writer (same keys, same values).
  with np.load(path) as mine, np.load(TINY / 'params_linen.npz') as official:
    assert sorted(mine.files) == sorted(official.files)
    for key in official.files:
      np.testing.assert_array_equal(mine[key], official[key])


def test_save_npz_unscans_and_accepts_variables_and_bfloat16(tmp_path):
  variables = checkpoint.load(TINY / 'params_linen.npz')
  scanned = layout.scan_params(variables)
  scanned['params']['head']['bias'] = jnp.asarray(scanned['params']['head']['bias'],
                                                  jnp.bfloat16)
  path = tmp_path / 'scanned.npz'
  checkpoint.save_npz(path, scanned)  # whole variables dict, scanned, with a bf16 leaf
  loaded = checkpoint.load(path)
  assert 'encoderblock_1' in loaded['params']['Transformer']
  assert 'encoderblock' not in loaded['params']['Transformer']
  assert loaded['params']['head']['bias'].dtype == np.float32
  np.testing.assert_allclose(loaded['params']['head']['bias'],
                             variables['params']['head']['bias'], rtol=1e-2)
  loaded['params']['head']['bias'] = variables['params']['head']['bias']
  chex.assert_trees_all_equal(loaded, variables)


_HITS = []


def _record_unpickling(tag):
  _HITS.append(tag)


class _Tripwire:
  """Unpickling a pickled _Tripwire calls _record_unpickling: proof that unpickling happened."""

  def __reduce__(self):
    return (_record_unpickling, ('unpickled',))


def test_object_arrays_are_rejected_without_unpickling(tmp_path):
  path = tmp_path / 'evil.npz'
  evil = np.empty(1, dtype=object)
  evil[0] = _Tripwire()
  np.savez(path, **{'head/kernel': np.zeros((2, 2), np.float32), 'head/bias': evil})
  _HITS.clear()
  with pytest.raises(ValueError, match=r"(?s)'head/bias'.*object.*refusing"):
    checkpoint.load(path)
  assert _HITS == []
  # The file really holds a pickled object array (read from its .npy header, not unpickled).
  with zipfile.ZipFile(path) as archive, archive.open('head/bias.npy') as member:
    version = np.lib.format.read_magic(member)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}[version]
    _, _, dtype = read_header(member)
  assert dtype == np.dtype(object)


def test_missing_and_unknown_files(tmp_path):
  missing = tmp_path / 'nope.npz'
  with pytest.raises(FileNotFoundError, match='nope.npz'):
    checkpoint.load(missing)
  text = tmp_path / 'weights.txt'
  text.write_text('not a checkpoint')
  with pytest.raises(ValueError, match=r"(?s)Unrecognised checkpoint format.*\.npz.*Orbax"):
    checkpoint.load(text)
  npy = tmp_path / 'single.npy'
  np.save(npy, np.ones(3))
  with pytest.raises(ValueError, match='single-array .npy'):
    checkpoint.load(npy)
  with pytest.raises(ValueError, match='Unrecognised checkpoint directory'):
    checkpoint.load(tmp_path)
  empty_zip = tmp_path / 'empty.npz'
  with zipfile.ZipFile(empty_zip, 'w'):
    pass
  with pytest.raises(ValueError, match='no arrays'):
    checkpoint.load(empty_zip)


# ------------------------------------------------------------------------------------------------
# Remote paths go through tf.io.gfile (a fake TensorFlow here; real TF is never imported).
# ------------------------------------------------------------------------------------------------


def _fake_tensorflow(root):
  """A 'tensorflow' module whose io.gfile maps gs://bucket/... to files under ``root``."""
  calls = []

  def local(path):
    assert path.startswith('gs://bucket/'), path
    calls.append(path)
    return os.path.join(root, path[len('gs://bucket/'):])

  gfile = types.SimpleNamespace(
      exists=lambda p: os.path.exists(local(p)),
      isdir=lambda p: os.path.isdir(local(p)),
      listdir=lambda p: os.listdir(local(p)),
      makedirs=lambda p: os.makedirs(local(p.rstrip('/') + '/'), exist_ok=True),
      GFile=lambda p, mode: open(local(p), mode),
  )
  module = types.ModuleType('tensorflow')
  module.__spec__ = importlib.machinery.ModuleSpec('tensorflow', None)  # For etils' probe.
  module.io = types.SimpleNamespace(gfile=gfile)
  return module, calls


def test_remote_paths_use_gfile(tmp_path, monkeypatch):
  fake, calls = _fake_tensorflow(str(tmp_path))
  monkeypatch.setitem(sys.modules, 'tensorflow', fake)
  variables = checkpoint.load(TINY / 'params.npz')
  checkpoint.save_npz('gs://bucket/model.npz', variables['params'])
  assert (tmp_path / 'model.npz').exists()
  chex.assert_trees_all_equal(checkpoint.load('gs://bucket/model.npz'), variables)
  assert 'gs://bucket/model.npz' in calls
  with pytest.raises(FileNotFoundError, match='gs://bucket/missing.npz'):
    checkpoint.load('gs://bucket/missing.npz')


def test_open_detects_once_and_the_handle_reads(monkeypatch):
  from vit_jax import storage  # pylint: disable=g-import-not-at-top
  from vit_jax.checkpoint import hf_vit  # pylint: disable=g-import-not-at-top
  path = str(TINY / 'params.npz')
  probes, sniffs = [], []
  monkeypatch.setattr(storage, 'probe', lambda *a, f=storage.probe: probes.append(a) or f(*a))
  monkeypatch.setattr(hf_vit, 'find', lambda *a, f=hf_vit.find, **k: (
      sniffs.append(a) or f(*a, **k)))
  ckpt = checkpoint.open(path)
  assert ckpt.name == 'npz' and ckpt.path == path and len(probes) == 1
  chex.assert_trees_all_equal(ckpt.read(), checkpoint.load_npz(path))
  assert ckpt.fields()['hidden_size'] == checkpoint.model_fields(path)['hidden_size']
  probes.clear()
  checkpoint.load(path)
  assert len(probes) == 1 and not sniffs  # One detection per load, nothing re-checked.


def test_detect_names_each_format(tmp_path):
  assert checkpoint.detect(TINY / 'params.npz') == 'npz'
  assert checkpoint.detect(str(FIXTURES / 't2t_tiny_performer' / 'checkpoint.pth.tar')) == (
      'pytorch')
  assert checkpoint.detect(tmp_path) == 'orbax'  # Any directory; load then says what it lacks.
  legacy = tmp_path / 'old.pth'
  legacy.write_bytes(b'not a zip')
  assert checkpoint.detect(legacy) == 'pytorch'  # Refused by the PyTorch reader, with the reason.
  assert checkpoint.is_torch_checkpoint(legacy)
  assert not checkpoint.is_torch_checkpoint(TINY / 'params.npz')
  with pytest.raises(FileNotFoundError, match='No checkpoint at'):
    checkpoint.detect(tmp_path / 'missing.npz')
