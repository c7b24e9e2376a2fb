"""Tests of vit_jax.checkpoint: official .npz files, Orbax training checkpoints, save_npz."""

import os
import pathlib
import sys
import types
import zipfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.models import layout

FIXTURES = pathlib.Path(__file__).parent / 'fixtures'
TINY = FIXTURES / 'vit_tiny'


def _tiny_model(**extra):
  return models.create('ViT-custom', num_classes=10, patch_size=4, hidden_size=32, mlp_dim=64,
                       num_heads=2, num_layers=2, **extra)


def _logits(model, variables):
  inputs = np.load(TINY / 'inputs.npy')
  return np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, inputs))


# ------------------------------------------------------------------------------------------------
# Flat/nested helpers and name conversion.
# ------------------------------------------------------------------------------------------------


def test_flatten_unflatten_round_trip():
  tree = {'a': {'b': {'c': np.ones(2)}, 'd': np.zeros(3)}, 'e': np.arange(4), 'empty': {}}
  flat = checkpoint.flatten_params(tree)
  assert list(flat) == ['a/b/c', 'a/d', 'e']
  back = checkpoint.unflatten_params(flat)
  assert back.keys() == {'a', 'e'}
  chex.assert_trees_all_equal(back, {k: v for k, v in tree.items() if k != 'empty'})
  with pytest.raises(ValueError, match='conflict'):
    checkpoint.unflatten_params({'a': np.ones(1), 'a/b': np.ones(1)})
  with pytest.raises(ValueError, match='without'):
    checkpoint.flatten_params({'a/b': np.ones(1)})


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
# Orbax checkpoints as written by the training loop.
# ------------------------------------------------------------------------------------------------


def _train_state(params, step, model_state=None):
  tx = optax.adam(1e-3)
  params = jax.tree.map(jnp.asarray, params)
  return {'step': jnp.asarray(step, jnp.int32), 'params': params,
          'opt_state': jax.jit(tx.init)(params), 'model_state': model_state or {}}


def _save_steps(workdir, states):
  mngr = ocp.CheckpointManager(directory=os.path.join(workdir, 'checkpoints'))
  for step, state in states:
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
  mngr.wait_until_finished()
  mngr.close()


def test_orbax_round_trip(tmp_path):
  variables = checkpoint.load(TINY / 'params_linen.npz')
  reference = np.load(TINY / 'logits.npy')
  perturbed = jax.tree.map(lambda x: x + 1.0, variables['params'])
  workdir = str(tmp_path / 'workdir')
  _save_steps(workdir, [(10, _train_state(perturbed, 10)),
                        (20, _train_state(variables['params'], 20))])

  for path in (workdir, os.path.join(workdir, 'checkpoints'),
               pathlib.Path(workdir) / 'checkpoints' / '20'):
    loaded = checkpoint.load(path)
    assert set(loaded) == {'params'}
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(loaded))
    chex.assert_trees_all_equal(loaded, variables)
  np.testing.assert_allclose(_logits(_tiny_model(), loaded), reference, rtol=1e-5, atol=1e-5)

  older = checkpoint.load(os.path.join(workdir, 'checkpoints', '10'))
  chex.assert_trees_all_equal(older['params'], perturbed)
  # The 'state' item directory itself is accepted too.
  chex.assert_trees_all_equal(
      checkpoint.load(os.path.join(workdir, 'checkpoints', '10', 'state'))['params'], perturbed)


def test_orbax_model_state_and_scanned_layout(tmp_path):
  variables = checkpoint.load(TINY / 'params_linen.npz')
  scanned = layout.scan_params(variables['params'])
  model_state = {'batch_stats': {'bn': {'mean': np.arange(3, dtype=np.float32)}}}
  workdir = str(tmp_path / 'w')
  _save_steps(workdir, [(1, _train_state(scanned, 1, model_state))])
  loaded = checkpoint.load(workdir)
  assert set(loaded) == {'params', 'batch_stats'}
  np.testing.assert_array_equal(loaded['batch_stats']['bn']['mean'], [0, 1, 2])
  # The layout is not changed by load: still scanned, and usable by a scan=True model.
  assert 'encoderblock' in loaded['params']['Transformer']
  chex.assert_trees_all_equal(loaded['params'], scanned)
  np.testing.assert_allclose(_logits(_tiny_model(scan=True), {'params': loaded['params']}),
                             np.load(TINY / 'logits.npy'), rtol=1e-5, atol=1e-5)


def test_orbax_without_finalized_steps(tmp_path):
  (tmp_path / 'w' / 'checkpoints').mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match='No finalized Orbax checkpoint step'):
    checkpoint.load(tmp_path / 'w')
  (tmp_path / 'w' / 'checkpoints' / '5.orbax-checkpoint-tmp-123').mkdir()
  with pytest.raises(FileNotFoundError, match='No finalized'):
    checkpoint.load(tmp_path / 'w' / 'checkpoints')


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
      GFile=lambda p, mode: open(local(p), mode),
  )
  module = types.ModuleType('tensorflow')
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
