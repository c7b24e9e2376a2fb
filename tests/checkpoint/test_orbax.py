"""Tests of vit_jax.checkpoint.orbax and load_orbax: the training loop's Orbax checkpoints read as
NumPy variables (any path into a workdir, EMA, model_state, scanned layout), save_orbax, and the
check of a saved state against a run's."""

import os
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.models import layout

FIXTURES = pathlib.Path(__file__).parents[1] / 'fixtures'
TINY = FIXTURES / 'vit_tiny'


def _tiny_model(**extra):
  fields = dict(patch_size=4, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
  return models.create('ViT-custom', num_classes=10, **dict(fields, **extra))


def _logits(model, variables):
  inputs = np.load(TINY / 'inputs.npy')
  return np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, inputs))


# ------------------------------------------------------------------------------------------------
# Orbax checkpoints as written by the training loop.
# ------------------------------------------------------------------------------------------------


def _train_state(params, step, model_state=None):
  tx = optax.adam(1e-3)
  params = jax.tree.map(jnp.asarray, params)
  return {'step': jnp.asarray(step, jnp.int32), 'params': params,
          'opt_state': jax.jit(tx.init)(params), 'model_state': model_state or {}}


def _save_steps(workdir, states):
  """Saves train states as the training loop does (vit_jax.checkpoint.Workdir)."""
  saved = checkpoint.Workdir(workdir).checkpoints(keep=None, asynchronous=False)
  for step, state in states:
    saved.save(step, state, cost={'step': step})
  saved.close()


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
  with pytest.raises(FileNotFoundError, match='No finalized Orbax checkpoint step at .*: the run '
                     'has saved no checkpoint yet. Wait for its first checkpoint, or train it'):
    checkpoint.load(tmp_path / 'w')
  (tmp_path / 'w' / 'checkpoints' / '5.orbax-checkpoint-tmp-123').mkdir()
  with pytest.raises(FileNotFoundError, match='No finalized .*: the save of step 5 is being '
                     'written'):
    checkpoint.load(tmp_path / 'w' / 'checkpoints')


def test_orbax_ema_params_are_preferred(tmp_path):
  variables = checkpoint.load(TINY / 'params_linen.npz')
  ema = jax.tree.map(lambda x: x * 0.5, variables['params'])
  state = dict(_train_state(variables['params'], 3), ema_params=jax.tree.map(jnp.asarray, ema))
  workdir = str(tmp_path / 'w')
  _save_steps(workdir, [(3, state)])
  chex.assert_trees_all_equal(checkpoint.load(workdir)['params'], ema)
  chex.assert_trees_all_equal(checkpoint.load(workdir, use_ema=False)['params'],
                              variables['params'])
  assert checkpoint.detect(workdir) == 'orbax'


def test_save_orbax_round_trip_with_collections(tmp_path):
  variables = checkpoint.load(TINY / 'params_linen.npz')
  constants = {'pos_embed': np.arange(6, dtype=np.float32).reshape(1, 2, 3)}
  dst = tmp_path / 'converted'
  checkpoint.save_orbax(dst, {'params': variables['params'], 'constants': constants})
  loaded = checkpoint.load(dst)
  assert set(loaded) == {'params', 'constants'}
  chex.assert_trees_all_equal(loaded['params'], variables['params'])
  np.testing.assert_array_equal(loaded['constants']['pos_embed'], constants['pos_embed'])
  with pytest.raises(FileExistsError, match='exists'):
    checkpoint.save_orbax(dst, variables)
  checkpoint.save_orbax(dst, variables, overwrite=True)
  assert set(checkpoint.load(dst)) == {'params'}
  with pytest.raises(ValueError, match="expects variables {'params'"):
    checkpoint.save_orbax(tmp_path / 'other', variables['params'])


def test_save_orbax_keeps_metadata_that_the_reader_applies(tmp_path):
  """`metadata` goes to EXPORT_JSON in the item; `inference.load` names the classes and takes
  the preprocessing from it, for a scanned run's weights too (they are read per layer)."""
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  variables = checkpoint.load(TINY / 'params_linen.npz')
  names = [f'n{i}' for i in range(10)]
  dst = tmp_path / 'converted'
  checkpoint.save_orbax(dst, {'params': layout.scan_params(variables['params'])},
                        metadata={'label_names': names, 'normalization': 'imagenet',
                                  'eval_crop_pct': 0.875, 'multi_label': True})
  assert checkpoint.orbax.read_export_metadata(dst)['label_names'] == names
  trained = inference.load(dst)
  assert list(trained.label_names) == names and trained.multi_label
  assert (trained.config.data.normalization, trained.config.data.eval_crop_pct) == (
      'imagenet', 0.875)
  checkpoint.save_orbax(dst, variables, overwrite=True)  # No metadata: none is left behind.
  assert checkpoint.orbax.read_export_metadata(dst) is None
  assert inference.load(dst).label_names is None
  checkpoint.save_orbax(dst, variables, overwrite=True, metadata={'label_names': ['a', 'b']})
  with pytest.raises(ValueError, match=(
      rf"^{dst}/vit_jax_export.json names 2 classes, but the model's head has 10 outputs: the "
      r"names are not this model's; restore the file, or delete it")):
    inference.load(dst)
  (dst / checkpoint.orbax.EXPORT_JSON).write_text('[1, 2]')
  with pytest.raises(ValueError, match=r'vit_jax_export.json is not a JSON object; restore it, or '
                     r'delete it \(the class names and preprocessing are then the defaults'):
    checkpoint.orbax.read_export_metadata(dst)


def test_check_state_fits_names_the_differences(tmp_path):
  variables = checkpoint.load(TINY / 'params_linen.npz')
  workdir = str(tmp_path / 'w')
  _save_steps(workdir, [(1, _train_state(variables['params'], 1))])
  item = os.path.join(workdir, 'checkpoints', '1', 'state')
  same = jax.eval_shape(lambda: _train_state(variables['params'], 1))
  checkpoint.check_state_fits(item, same)
  wider = _tiny_model(mlp_dim=96)
  shapes = models.unbox(models.abstract_variables(wider, (32, 32)))
  with pytest.raises(ValueError) as info:
    checkpoint.check_state_fits(item, {'params': shapes['params']})
  message = str(info.value)
  assert f'The checkpoint {item} does not fit this model:\n  shape mismatches (6): ' in message
  assert ('params/Transformer/encoderblock_0/MlpBlock_0/Dense_0/bias: saved (64,), this run '
          '(96,)') in message
  assert message.endswith('The checkpoint is a ViT with patch_size=4, hidden_size=32, '
                          'num_layers=2, num_heads=2, mlp_dim=64, representation_size=None, '
                          '10 classes.')
  scanned = models.unbox(models.abstract_variables(_tiny_model(scan=True), (32, 32)))
  with pytest.raises(ValueError, match=r'written with the per-layer block layout: resume with '
                     r'--config.model.scan=False'):
    checkpoint.check_state_fits(item, {'params': scanned['params']})
