"""Tests of vit_jax.checkpoint.tree: flat names, the families' architecture descriptions, the
mismatch report and check_fits."""

import pathlib

import chex
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.checkpoint import mismatch
from vit_jax.checkpoint import vit_shapes

FIXTURES = pathlib.Path(__file__).parents[1] / 'fixtures'


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


def test_describe_architecture_of_each_family():
  vit = checkpoint.load(FIXTURES / 'vit_tiny_gap_repr' / 'params.npz')
  assert checkpoint.describe_architecture(vit) == (
      'The checkpoint is a ViT with patch_size=4, hidden_size=32, num_layers=2, num_heads=2, '
      'mlp_dim=64, representation_size=16, 10 classes.')
  scanned = models.scan_params(vit)
  assert checkpoint.describe_architecture(scanned) == checkpoint.describe_architecture(vit)
  hybrid = checkpoint.load(FIXTURES / 'vit_hybrid_tiny' / 'params.npz')
  assert 'a ResNet stem with ' in checkpoint.describe_architecture(hybrid)
  assert 'resnet_num_layers=(2, 1)' in checkpoint.describe_architecture(hybrid)
  t2t = models.unbox(models.abstract_variables(
      models.create('T2T-ViT-custom', num_classes=5, embed_dim=32, depth=3, num_heads=2,
                    mlp_ratio=2.0, token_dim=8), (32, 32)))
  assert checkpoint.describe_architecture(t2t) == (
      "The checkpoint is a T2T-ViT with embed_dim=32, depth=3, mlp_ratio=2.0, token_dim=8, "
      "tokens_type='performer', 5 classes.")
  assert checkpoint.describe_architecture({'params': {'w': np.ones(3)}}) is None


def test_mismatch_report_counts_and_lists_the_first_entries():
  missing = [f'k{i}' for i in range(10)]
  report = mismatch.mismatch_report('Header:', missing, ['u (1,)'], [], 'A hint.')
  assert report == ('Header:\n'
                    '  missing keys (10): k0, k1, k2, k3, k4, k5, k6, k7, ... and 2 more\n'
                    '  unexpected keys (1): u (1,)\n'
                    '  A hint.')
  assert checkpoint.mismatch_report is mismatch.mismatch_report


def test_check_fits_accepts_an_exact_fit_and_lists_the_rest():
  variables = checkpoint.load(FIXTURES / 'vit_tiny' / 'params.npz')
  model = models.create('ViT-custom', num_classes=10, patch_size=4, hidden_size=32, mlp_dim=64,
                        num_heads=2, num_layers=2)
  checkpoint.check_fits(variables, models.abstract_variables(model, (32, 32)))
  with pytest.raises(ValueError) as info:
    checkpoint.check_fits(variables, models.abstract_variables(model.clone(num_classes=4),
                                                               (32, 32)), what='x.npz')
  assert str(info.value) == (
      'x.npz does not fit the model:\n'
      '  shape mismatches (2): params/head/bias: checkpoint (10,), model (4,); '
      'params/head/kernel: checkpoint (32, 10), model (32, 4)\n'
      '  The checkpoint is a ViT with patch_size=4, hidden_size=32, num_layers=2, num_heads=2, '
      'mlp_dim=64, representation_size=None, 10 classes. Build the model with these values.')


def test_a_square_grid_side_and_the_image_size_it_implies():
  """196 tokens are 14x14 (ViT-B/16 at 224 px), 576 24x24 (at 384 px); 197 (with the class
  token) or 0 are no grid."""
  assert [vit_shapes.square_side(n) for n in (1, 4, 196, 576, 0, 197, -4)] == [
      1, 2, 14, 24, None, None, None]
  table = {vit_shapes.POSEMB_KEY: (1, 197, 768), 'params/cls': (1, 1, 768)}
  assert vit_shapes.image_size(table, {'patch_size': 16}) == 224  # The fields' class token.
  no_class_token = {'patch_size': 16, 'classifier': 'gap'}
  assert vit_shapes.image_size({vit_shapes.POSEMB_KEY: (1, 197, 768)}, no_class_token) is None
