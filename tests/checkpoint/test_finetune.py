"""Fine-tuning from a checkpoint (head reset, T2T table regenerated), EMA, and the converter CLI."""

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import data_utils
from tests import t2t_fixtures
from vit_jax import checkpoint
from vit_jax.checkpoint import finetune
from vit_jax.models import resample
from vit_jax.tools import convert
from vit_jax.config import defaults
from vit_jax import models
from vit_jax import train

# Outputs compared with the reference implementations' fixtures: highest matmul precision.
pytestmark = pytest.mark.golden

FIXTURES = pathlib.Path(__file__).parents[1] / 'fixtures'
PERFORMER = FIXTURES / 't2t_tiny_performer'


def _fixture_overrides(name='t2t_tiny_performer'):
  kwargs = dict(t2t_fixtures.constructor_kwargs(name))
  kwargs.pop('img_size')
  kwargs.pop('num_classes')
  return kwargs


def _fixture_logits(model, variables, name='t2t_tiny_performer'):
  inputs = np.load(FIXTURES / name / 'inputs_nhwc.npy', allow_pickle=False)
  with jax.default_matmul_precision('highest'):
    return np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, inputs))


def _init(model, size):
  init = jax.jit(lambda rng: model.init(rng, jnp.zeros((1, size, size, 3)), train=False))
  return models.unbox(jax.device_get(init(jax.random.PRNGKey(1))))  # Plain arrays.


# ------------------------------------------------------------------------------ init_for_finetuning


@pytest.mark.slow
def test_t2t_finetuning_init_new_classes_and_resolution():
  """A 10-class, 64 px checkpoint initialises a 3-class model at 32 px: new head, new table."""
  model = models.create('T2T-ViT-custom', num_classes=3, **_fixture_overrides())
  fresh = _init(model, 32)
  variables = checkpoint.load_for_finetuning(PERFORMER / 'checkpoint.pth.tar', model, fresh)
  saved = checkpoint.load(PERFORMER / 'checkpoint.pth.tar',
                          model=models.create('T2T-ViT-custom', num_classes=10,
                                              **_fixture_overrides()))
  flat, flat_saved, flat_fresh = (checkpoint.flatten_params(v) for v in (variables, saved, fresh))
  assert list(flat) == list(flat_fresh)
  for key, value in flat.items():
    if key in ('params/head/kernel', 'params/head/bias', 'constants/pos_embed'):
      np.testing.assert_array_equal(value, flat_fresh[key], err_msg=key)
    else:  # Everything else is the checkpoint's, the Performer features included.
      np.testing.assert_array_equal(value, flat_saved[key], err_msg=key)
  assert flat['params/head/kernel'].shape == (64, 3)
  # 32 px -> 2 x 2 tokens + class token; the table is regenerated (sinusoid of 5 positions).
  np.testing.assert_array_equal(flat['constants/pos_embed'],
                                models.t2t.sinusoid_table(5, 64))
  logits = jax.jit(lambda v: model.apply(v, jnp.ones((2, 32, 32, 3)), train=False))(variables)
  assert logits.shape == (2, 3) and np.isfinite(np.asarray(logits)).all()


@pytest.mark.slow
def test_same_task_finetuning_init_keeps_head_and_logits():
  model = models.create('T2T-ViT-custom', num_classes=10, **_fixture_overrides())
  variables = checkpoint.load_for_finetuning(PERFORMER / 'checkpoint.pth.tar', model,
                                             _random(model, 64), reset_head=False)
  np.testing.assert_allclose(_fixture_logits(model, variables),
                             np.load(PERFORMER / 'logits.npy'), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_finetuning_init_lists_every_mismatch():
  overrides = dict(_fixture_overrides(), depth=3, token_dim=8)
  model = models.create('T2T-ViT-custom', num_classes=3, **overrides)
  with pytest.raises(ValueError) as info:
    checkpoint.load_for_finetuning(PERFORMER / 'checkpoint.pth.tar', model,
                                   _random(models.create('T2T-ViT-custom', num_classes=3,
                                                         **overrides), 64))
  message = str(info.value)  # A PyTorch file: its own names and shapes.
  assert 'missing keys' in message and 'blocks.2.attn.qkv.weight' in message
  assert 'tokens_to_token.attention1.proj.weight: checkpoint (16, 16), model (8, 8)' in message
  assert 'head' not in message  # The head is replaced, not an error.


def _posemb_fixture(name):
  import json  # pylint: disable=g-import-not-at-top
  return json.loads((FIXTURES / name / 'config.json').read_text())


@pytest.mark.slow
@pytest.mark.parametrize('name,source,classifier,representation_size,seed', [
    ('posemb_resize', 'vit_tiny', 'token', None, 3),
    ('posemb_resize_gap_repr', 'vit_tiny_gap_repr', 'gap', 16, 4),
])
def test_official_finetuning_init_fixtures(name, source, classifier, representation_size, seed):
  """The official load_pretrained into a 48 px, 5-class model: same table, head, pre_logits."""
  info = _posemb_fixture(name)
  model = models.create('ViT-custom', num_classes=5, classifier=classifier,
                        representation_size=representation_size, **_vit_tiny_fields())
  fresh = jax.device_get(jax.jit(lambda: model.init(  # Compiled: a third of the eager CPU time.
      jax.random.PRNGKey(seed), jnp.ones((1, 48, 48, 3)), train=False))())
  variables = checkpoint.init_for_finetuning(checkpoint.load(FIXTURES / source / 'params.npz'),
                                             fresh)
  flat = checkpoint.flatten_params(variables['params'])
  posemb = flat['Transformer/posembed_input/pos_embedding']
  assert list(posemb.shape) == info['pos_embedding_shape']
  np.testing.assert_allclose(posemb, np.load(FIXTURES / name / 'pos_embedding.npy'), atol=1e-6)
  with np.load(FIXTURES / name / 'loaded_params_linen.npz', allow_pickle=False) as official:
    assert sorted(official.files) == sorted(flat)
    for key in official.files:  # Head = the fresh init (zeros); pre_logits kept; rest copied.
      np.testing.assert_allclose(flat[key], official[key], atol=1e-6, err_msg=key)
  for key, facts in info['head_and_pre_logits'].items():
    assert facts['equals_init_params'] == np.array_equal(
        flat[key], checkpoint.flatten_params(fresh['params'])[key]), key
  inputs = np.load(FIXTURES / name / 'inputs.npy')
  logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, inputs)
  np.testing.assert_allclose(logits, np.load(FIXTURES / name / 'logits.npy'), atol=1e-6)


@pytest.mark.slow
def test_hybrid_finetuning_init_resizes_the_grid():
  """R+ViT fixture (32 px, ResNet stride 8 -> 4x4 tokens) into a 48 px (6x6), 3-class model."""
  fields = dict(_vit_tiny_fields(), patch_size=1, resnet_num_layers=(2, 1))
  model = models.create('R+ViT-custom', num_classes=3, **fields)
  fresh = _random(model, 48)  # From the shapes: its head is what the new head must be.
  saved = checkpoint.load(FIXTURES / 'vit_hybrid_tiny' / 'params.npz')  # GroupNorm (1,1,1,C)
  variables = checkpoint.init_for_finetuning(saved, fresh)
  flat, flat_saved, flat_fresh = (checkpoint.flatten_params(v['params'])
                                  for v in (variables, saved, fresh))
  posemb = flat['Transformer/posembed_input/pos_embedding']
  assert posemb.shape == (1, 1 + 6 * 6, 32)
  np.testing.assert_array_equal(posemb[:, 0],
                                flat_saved['Transformer/posembed_input/pos_embedding'][:, 0])
  np.testing.assert_array_equal(flat['block2/unit1/gn_proj/scale'],
                                flat_saved['block2/unit1/gn_proj/scale'])
  assert flat['head/kernel'].shape == (32, 3)
  np.testing.assert_array_equal(flat['head/kernel'], flat_fresh['head/kernel'])


def test_resize_posemb_corners_aligned_gap_and_non_square():
  grid = np.arange(4, dtype=np.float32).reshape(1, 4, 1)  # [[0, 1], [2, 3]], 'gap': no class row
  out = checkpoint.resize_posemb(grid, 9, has_class_token=False)
  np.testing.assert_allclose(out[0, :, 0], [0, .5, 1, 1, 1.5, 2, 2, 2.5, 3])
  with_cls = np.concatenate([np.full((1, 1, 1), 7.), grid], axis=1)
  out = checkpoint.resize_posemb(with_cls, 1 + 2 * 3, has_class_token=True, new_grid=(2, 3))
  np.testing.assert_allclose(out[0, :, 0], [7, 0, .5, 1, 2, 2.5, 3])  # Class row unchanged.
  with pytest.raises(ValueError, match='12 grid tokens, not a square grid: pass its grid'):
    checkpoint.resize_posemb(with_cls, 13, has_class_token=True)
  with pytest.raises(ValueError, match='grid 3x3 does not match its 12'):
    checkpoint.resize_posemb(with_cls, 13, has_class_token=True, new_grid=(3, 3))


@pytest.mark.slow
def test_non_square_finetuning_224x320():
  """A square 2x2-grid checkpoint into a 2x3 grid model (the official code asserts here)."""
  fields = dict(_vit_tiny_fields(), patch_size=16)
  saved = _random(models.create('ViT-custom', num_classes=4, **fields), 32)
  model = models.create('ViT-custom', num_classes=3, **fields)
  fresh = _random(model, (32, 48), seed=1)
  variables = checkpoint.init_for_finetuning(saved, fresh, grid=(2, 3))
  posemb = variables['params']['Transformer']['posembed_input']['pos_embedding']
  old = saved['params']['Transformer']['posembed_input']['pos_embedding']
  assert posemb.shape == (1, 7, 32)
  np.testing.assert_array_equal(posemb[:, 0], old[:, 0])
  np.testing.assert_allclose(posemb[0, 2], (old[0, 1] + old[0, 2]) / 2, rtol=1e-6)


@pytest.mark.slow
def test_vit_finetuning_init_resets_head_and_converts_layout():
  saved = checkpoint.load(FIXTURES / 'vit_tiny' / 'params.npz')
  num_classes = saved['params']['head']['kernel'].shape[1]
  config = models.model_config('ViT-custom', **_vit_tiny_fields())
  model = models.create('ViT-custom', num_classes=num_classes + 2, **dict(config, scan=True))
  size = _vit_tiny_image_size()
  fresh = _random(model, size)
  variables = checkpoint.init_for_finetuning(saved, fresh)
  assert models.is_scanned(variables['params'])
  np.testing.assert_array_equal(variables['params']['head']['kernel'],
                                fresh['params']['head']['kernel'])
  unscanned = models.unscan_params(variables['params'])
  np.testing.assert_array_equal(
      unscanned['Transformer']['encoderblock_0']['MlpBlock_0']['Dense_0']['kernel'],
      saved['params']['Transformer']['encoderblock_0']['MlpBlock_0']['Dense_0']['kernel'])
  # Another width, and a missing parameter: all listed together.
  del saved['params']['Transformer']['encoder_norm']
  wide = models.create('ViT-custom', num_classes=3, **dict(_vit_tiny_fields(), hidden_size=48))
  with pytest.raises(ValueError) as info:
    checkpoint.init_for_finetuning(saved, _random(wide, size))
  message = str(info.value)
  assert 'shape mismatches (' in message and '... and ' in message  # Long lists are cut.
  assert 'The checkpoint is a ViT with patch_size=4, hidden_size=32, num_layers=2' in message
  assert 'missing keys (2): ' in message
  assert {'params/Transformer/encoder_norm/scale', 'params/Transformer/encoder_norm/bias'} <= set(
      message.split('missing keys (2): ')[1].split('\n')[0].split(', '))
  assert 'params/head' not in message


def _upsample_patches(images, patch, new_patch):
  """Each ``patch`` x ``patch`` patch of ``[B, H, W, C]`` resized alone to ``new_patch`` (timm's
  bicubic with antialiasing): the input on which FlexiViT's resize keeps every token."""
  b, h, w, c = images.shape
  gh, gw = h // patch, w // patch
  patches = images.reshape(b, gh, patch, gw, patch, c).transpose(2, 4, 0, 1, 3, 5)
  resized = resample.resize_grid(patches.reshape(patch, patch, -1), (new_patch, new_patch),
                                 'bicubic_antialias')
  resized = resized.reshape(new_patch, new_patch, b, gh, gw, c).transpose(2, 3, 0, 4, 1, 5)
  return resized.reshape(b, gh * new_patch, gw * new_patch, c)


@pytest.mark.parametrize('new_patch,size', [(8, 64), (2, 32)])
def test_patch_size_change_by_flexivit_resize(new_patch, size, caplog):
  """The 4 px-patch fixture (B/16 -> B/8 style) into patch 8 (upsampled, 64 px: the same 8x8
  grid, so every token and logit is kept on per-patch upsampled images) and patch 2 (32 px: a
  16x16 grid, the table resized as for another resolution); one INFO line names both sizes."""
  saved = checkpoint.load(FIXTURES / 'vit_tiny' / 'params.npz')
  model = models.create('ViT-custom', num_classes=10, **dict(_vit_tiny_fields(),
                                                             patch_size=new_patch))
  caplog.set_level(logging.INFO, logger='absl')
  variables = checkpoint.init_for_finetuning(saved, _random(model, size), reset_head=False)
  lines = [r.getMessage() for r in caplog.records if 'resampled by the FlexiViT' in r.getMessage()]
  assert lines == [f'Fine-tuning init: patch size 4x4 (checkpoint) -> {new_patch}x{new_patch} '
                   '(model): params/embedding/kernel resampled by the FlexiViT pseudo-inverse.']
  flat, flat_saved = (checkpoint.flatten_params(v) for v in (variables, saved))
  kernel = flat_saved['params/embedding/kernel']
  np.testing.assert_array_equal(flat['params/embedding/kernel'],
                                checkpoint.resample_patchemb(kernel, new_patch))
  table = flat_saved['params/Transformer/posembed_input/pos_embedding']
  grid = size // new_patch
  np.testing.assert_array_equal(flat['params/Transformer/posembed_input/pos_embedding'],
                                checkpoint.resize_posemb(table, 1 + grid * grid,
                                                         has_class_token=True))
  inputs = np.load(FIXTURES / 'vit_tiny' / 'inputs.npy')
  apply = jax.jit(lambda v, x: model.apply(v, x, train=False))
  if new_patch == 8:
    np.testing.assert_allclose(apply(variables, _upsample_patches(inputs, 4, 8)),
                               np.load(FIXTURES / 'vit_tiny' / 'logits.npy'), rtol=0, atol=5e-6)
  else:
    assert np.isfinite(np.asarray(apply(variables, inputs))).all()


def test_hybrid_patch_size_change_is_refused():
  fresh = {'params': {'conv_root': {'kernel': np.zeros((7, 7, 3, 8), np.float32)},
                      'embedding': {'kernel': np.zeros((2, 2, 16, 32), np.float32)}}}
  loaded = {'params': {'conv_root': {'kernel': np.ones((7, 7, 3, 8), np.float32)},
                       'embedding': {'kernel': np.ones((1, 1, 16, 32), np.float32)}}}
  with pytest.raises(finetune.ModelMismatchError, match=(
      r"The patch size differs, 1x1 \(checkpoint\) -> 2x2 \(model\), and the model is a hybrid "
      r"\(ResNet stem\).*Keep the checkpoint's patch size \(--config.model.patch_size=1\)")):
    checkpoint.init_for_finetuning(loaded, fresh)


ECOSYSTEM = FIXTURES / 'ecosystem'
POSEMB = 'params/Transformer/posembed_input/pos_embedding'


def _tiny_vit(patch_size, **fields):
  """A 1-layer, 8-wide ViT: at 8 px, patch 4 makes a 2x2 token grid, patch (8, 2) a 1x4 one."""
  return models.create('ViT-custom', num_classes=3, hidden_size=8, mlp_dim=16, num_heads=2,
                       num_layers=1, patch_size=patch_size, **fields)


def _random(model, size=8, seed=0):
  """Random plain variables of ``model`` for ``size`` px images (or ``(height, width)``), from
  the shapes alone (nothing compiled): a fresh tree for the fine-tuning init where its values are
  not what a test checks (the head is compared with the tree's own)."""
  height, width = (size, size) if isinstance(size, int) else size
  abstract = models.unbox(jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, height, width, 3)), train=False)))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.normal(0, 0.5, x.shape).astype(np.float32), abstract)


def test_a_grid_change_at_the_same_token_count_resizes_the_table(caplog):
  """FlexiViT from a 2x2 grid (patch 4 at 8 px) to a 1x4 one (patch (8, 2)): as many rows, but
  the table is resampled from one grid to the other (not read row-major as the new grid), with
  the resize line; the same grid keeps it; an unrecorded grid into a non-square one is refused."""
  saved = _random(_tiny_vit(4))
  fresh = _random(_tiny_vit((8, 2)), seed=1)
  old = checkpoint.flatten_params(saved)[POSEMB]
  caplog.set_level(logging.INFO, logger='absl')
  variables = checkpoint.init_for_finetuning(saved, fresh, grid=(1, 4), checkpoint_grid=(2, 2))
  table = checkpoint.flatten_params(variables)[POSEMB]
  assert table.shape == old.shape == (1, 5, 8)
  np.testing.assert_array_equal(table, checkpoint.resize_posemb(
      old, 5, has_class_token=True, old_grid=(2, 2), new_grid=(1, 4)))
  np.testing.assert_array_equal(table[:, 0], old[:, 0])  # The class-token row.
  assert np.abs(table - old).max() > 1e-3
  assert ('resized params/Transformer/posembed_input/pos_embedding (1, 5, 8) -> (1, 5, 8) (2x2 '
          '-> 1x4 grid, 1 class-token / register rows kept, linear_corners)') in caplog.text
  same = checkpoint.init_for_finetuning(saved, _random(_tiny_vit(4), seed=1), grid=(2, 2),
                                        checkpoint_grid=(2, 2))
  np.testing.assert_array_equal(checkpoint.flatten_params(same)[POSEMB], old)
  with pytest.raises(ValueError) as e:
    checkpoint.init_for_finetuning(saved, fresh, grid=(1, 4))
  assert str(e.value) == (
      'The fine-tuning checkpoint records no token grid for its position table of 4 grid rows, '
      "and the model's grid is 1x4, not square: whether the table is 2x2 (square images), to be "
      'resampled, or already 1x4 cannot be told from its shape. Say which with '
      '--config.model.posemb_grid=(2, 2) (the model keeps the 2x2 table and resamples it to 1x4 '
      'as it runs) or --config.model.posemb_grid=(1, 4).')


def test_the_recorded_grid_decides_and_posemb_grid_says_an_unrecorded_one(tmp_path, caplog):
  """load_for_finetuning at the model's image size: a converted checkpoint that records its
  image size (8 px, patch 4: 2x2) is resized to the 1x4 grid; an .npz records none and is
  refused; the model's posemb_grid then says which grid the table is."""
  saved = _random(_tiny_vit(4))
  old = checkpoint.flatten_params(saved)[POSEMB]
  checkpoint.save_orbax(tmp_path / 'orbax', saved, metadata={'image_size': 8})
  checkpoint.save_npz(tmp_path / 'weights.npz', saved['params'])
  model = _tiny_vit((8, 2))
  caplog.set_level(logging.INFO, logger='absl')
  resized = checkpoint.load_for_finetuning(tmp_path / 'orbax', model, _random(model, seed=1),
                                           image_size=8)
  np.testing.assert_array_equal(checkpoint.flatten_params(resized)[POSEMB],
                                checkpoint.resize_posemb(old, 5, has_class_token=True,
                                                         old_grid=(2, 2), new_grid=(1, 4)))
  assert '(2x2 -> 1x4 grid' in caplog.text
  recorded = [(lambda c: c.table_grid(c.shapes()))(checkpoint.open(path)) for path in (
      tmp_path / 'orbax', tmp_path / 'weights.npz', ECOSYSTEM / 'hf_vit_v4')]
  assert recorded == [(2, 2), None, (4, 4)]  # transformers: its config's 32 px, patch 8.
  with pytest.raises(ValueError, match=r'records no token grid .* model\'s grid is 1x4'):
    checkpoint.load_for_finetuning(tmp_path / 'weights.npz', model, _random(model, seed=1),
                                   image_size=8)
  images = np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 3)).astype(np.float32)
  for stated in ((2, 2), (1, 4)):  # Either: the table kept as it is.
    as_stated = model.clone(posemb_grid=stated)
    variables = checkpoint.load_for_finetuning(tmp_path / 'weights.npz', as_stated,
                                               _random(as_stated, seed=1), image_size=8)
    np.testing.assert_array_equal(checkpoint.flatten_params(variables)[POSEMB], old)
    if stated == (2, 2):  # Resampled in the model: the logits of the table resized at init.
      np.testing.assert_allclose(as_stated.apply(variables, images, train=False),
                                 model.apply(resized, images, train=False), rtol=0, atol=1e-6)


def _timm_model(name, num_heads, **overrides):
  """(the timm fixture's path, a 7-class model of its fields and ``overrides``)."""
  path = ECOSYSTEM / name / 'model.safetensors'
  fields = checkpoint.model_fields(path, num_heads=num_heads)
  fields.pop('image_size')
  fields.update(dict(num_classes=7, posemb_resize='linear_corners'), **overrides)
  return path, models.create('ViT-custom', **fields)


@pytest.mark.parametrize('name, num_heads, size, prefix, rows', [
    ('timm_vit_reg', 4, 48, 2, 2 + 36),      # Class token + 1 register rows, 4x4 -> 6x6.
    ('timm_deit3', 2, 48, 0, 36),            # no_embed_class (DeiT III): the grid only.
    ('timm_dinov2_reg4', 2, 42, 0, 9),       # no_embed_class, 4 registers: 2x2 -> 3x3.
    ('timm_dinov2', 2, 28, 1, 1 + 4),        # Class-token row, 3x3 -> 2x2 (downsampled).
])
def test_timm_variants_finetune_at_another_size_with_timms_resize(name, num_heads, size, prefix,
                                                                 rows, caplog):
  """Registers, no_embed_class and LayerScale weights at a new image size: the table's rows in
  front of the grid (class token, registers) kept, the grid resized as timm does (bicubic,
  antialiased) since the model keeps the default posemb_resize; the rest as saved, the head
  re-initialised. The same logits as the saved table resampled in the model (posemb_grid)."""
  path, model = _timm_model(name, num_heads)
  saved = checkpoint.open(path).read_for_finetuning(model)  # As saved (5 classes, 32 px).
  fresh = _random(model, size)
  caplog.set_level(logging.INFO, logger='absl')
  variables = checkpoint.load_for_finetuning(path, model, fresh)
  flat, flat_saved = (checkpoint.flatten_params(v) for v in (variables, saved))
  table, saved_table = flat[POSEMB], flat_saved[POSEMB]
  assert table.shape == (1, rows, model.hidden_size)
  np.testing.assert_array_equal(table[:, :prefix], saved_table[:, :prefix])
  old = int(round((saved_table.shape[1] - prefix) ** 0.5))
  new = int(round((rows - prefix) ** 0.5))
  np.testing.assert_allclose(
      table, resample.resample_posemb(saved_table, (new, new), num_prefix_tokens=prefix,
                                      method='bicubic_antialias'), rtol=0, atol=1e-7)
  assert np.abs(table - resample.resample_posemb(saved_table, (new, new), num_prefix_tokens=prefix,
                                                 method='linear_corners')).max() > 1e-4
  assert f'{old}x{old} -> {new}x{new} grid, {prefix} class-token / register rows kept, ' \
         'bicubic_antialias)' in caplog.text
  for key, value in flat_saved.items():
    if key not in (POSEMB, 'params/head/kernel', 'params/head/bias'):
      np.testing.assert_array_equal(flat[key], value, err_msg=key)
  np.testing.assert_array_equal(flat['params/head/kernel'],
                                checkpoint.flatten_params(fresh)['params/head/kernel'])
  # The model applying the saved table at this size resamples it the same way.
  grid_model = model.clone(posemb_resize='bicubic_antialias', posemb_grid=(old, old))
  in_model = dict(saved, params=dict(saved['params'], head=variables['params']['head']))
  images = np.random.default_rng(0).uniform(-1, 1, (2, size, size, 3)).astype(np.float32)
  with jax.default_matmul_precision('highest'):
    apply = lambda m, v: jax.jit(lambda v: m.apply(v, images, train=False))(v)  # Compiled.
    np.testing.assert_allclose(apply(grid_model, in_model), apply(model, variables), rtol=0,
                               atol=1e-5)


def test_the_configs_posemb_resize_wins_over_timms():
  path, model = _timm_model('timm_vit_reg', 4, posemb_resize='bicubic')
  saved = checkpoint.flatten_params(checkpoint.open(path).read_for_finetuning(model))[POSEMB]
  table = checkpoint.flatten_params(checkpoint.load_for_finetuning(path, model,
                                                                   _random(model, 48)))[POSEMB]
  np.testing.assert_allclose(table, resample.resample_posemb(saved, (6, 6), num_prefix_tokens=2,
                                                             method='bicubic'), rtol=0, atol=1e-7)
  assert checkpoint.posemb_resize(checkpoint.open(path), model) == 'bicubic'
  assert checkpoint.posemb_resize(checkpoint.open(path), model.clone(
      posemb_resize='linear_corners')) == 'bicubic_antialias'  # The default: timm's.
  npz = checkpoint.open(FIXTURES / 'vit_tiny' / 'params.npz')  # Official: the default.
  assert checkpoint.posemb_resize(npz) == 'linear_corners'


def test_a_table_without_the_prefix_rows_into_a_model_with_them_is_named():
  """DeiT III's table covers the patches only: a model without no_embed_class is told so."""
  path, model = _timm_model('timm_deit3', 2, no_embed_class=False)
  with pytest.raises(finetune.ModelMismatchError) as e:
    checkpoint.load_for_finetuning(path, model, _random(model, 48))
  message = str(e.value)
  assert ('pos_embedding: checkpoint (1, 16, 16), model (1, 37, 16)' in message
          and 'The position tables have 0 (checkpoint) and 1 (model) rows before the grid' in
          message and 'no_embed_class=True' in message), message


def _vit_tiny_fields():
  """The fixture's model (patch 4, D 32, MLP 64, 2 heads, 2 layers) at 32 x 32 px."""
  return dict(hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2, patch_size=4)


def _vit_tiny_image_size():
  return 32


# ------------------------------------------------------------------------------ training: init_from, EMA


def _folder_config(tmp_path, **overrides):
  folder = data_utils.make_image_folder(str(tmp_path / 'images'), num_classes=3, per_class=4,
                                        size=32)
  config = data_utils.folder_run_config('T2T-ViT-custom', folder, 32, total_steps=1,
                                        **_fixture_overrides())
  config.data.normalization = 'imagenet'
  config.optim.schedule = 'constant'
  for key, value in overrides.items():
    config[key] = value
  return config


@pytest.mark.slow
def test_training_from_init_from_with_ema(tmp_path):
  """init_from sets the first parameters; the EMA after one update is d * p0 + (1 - d) * p1."""
  config = _folder_config(tmp_path, init_from=str(PERFORMER / 'checkpoint.pth.tar'),
                          ema_decay=0.25)
  workdir = str(tmp_path / 'workdir')
  results = train.train_and_evaluate(config, workdir)
  assert {'test/accuracy', 'test_ema/accuracy', 'test_ema/loss'} <= set(results)
  model = models.create('T2T-ViT-custom', num_classes=3, **_fixture_overrides())
  p0 = checkpoint.load_for_finetuning(PERFORMER / 'checkpoint.pth.tar', model,
                                       _random(model, 32))
  p1 = checkpoint.load(workdir, use_ema=False)
  ema = checkpoint.load(workdir)  # use_ema=True by default.
  kqv = ('tokens_to_token', 'attention1', 'kqv', 'kernel')
  pick = lambda v: v['params'][kqv[0]][kqv[1]][kqv[2]][kqv[3]]
  assert not np.allclose(pick(p1), pick(p0))  # One SGD update happened.
  np.testing.assert_allclose(pick(ema), 0.25 * pick(p0) + 0.75 * pick(p1), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(ema['constants']['tokens_to_token']['attention1']['w'],
                                p0['constants']['tokens_to_token']['attention1']['w'])


@pytest.mark.slow
def test_init_from_that_does_not_fit_is_a_config_error(tmp_path, monkeypatch):
  data_utils.skip_cpu_peak_measurement(monkeypatch)  # Refused before any work.
  config = _folder_config(tmp_path, init_from=str(PERFORMER / 'checkpoint.pth.tar'))
  config.model.depth = 3
  with pytest.raises(train.ConfigError, match=r'(?s)missing keys.*depth=2, mlp_ratio=2.0'):
    train.train_and_evaluate(config, str(tmp_path / 'workdir'))
  assert not (tmp_path / 'workdir').exists()  # Stopped before writing anything.
  config.init_from = str(tmp_path / 'nothing_here.npz')
  with pytest.raises(train.ConfigError,
                     match=r'nothing_here.npz.*\(config.init_from\), does not exist'):
    train.train_and_evaluate(config, str(tmp_path / 'workdir2'))
  assert not (tmp_path / 'workdir2').exists()


# ------------------------------------------------------------------------------ python -m vit_jax.convert


@pytest.mark.slow
def test_convert_pth_to_orbax_reproduces_logits(tmp_path, capsys):
  """In this process (`python -m vit_jax.convert` itself: tests/test_hub.py and
  tests/checkpoint/test_damaged_files.py run it)."""
  dst = tmp_path / 't2t_orbax'
  sets = [f'--set={k}={v!r}' for k, v in _fixture_overrides().items()]
  assert convert.main([str(PERFORMER / 'checkpoint.pth.tar'), str(dst), '--model',
                       'T2T-ViT-custom', *sets]) == 0, capsys.readouterr().err
  out = capsys.readouterr().out
  assert 'Wrote Orbax checkpoint' in out and 'constants:' in out
  variables = checkpoint.load(dst)
  model = models.create('T2T-ViT-custom', num_classes=10, **_fixture_overrides())
  np.testing.assert_allclose(_fixture_logits(model, variables), np.load(PERFORMER / 'logits.npy'),
                             rtol=1e-5, atol=1e-5)
  # The written directory is a valid init_from: same task, same weights.
  again = checkpoint.load_for_finetuning(dst, model, _random(model, 64))
  np.testing.assert_array_equal(checkpoint.flatten_params(again)['params/cls_token'],
                                checkpoint.flatten_params(variables)['params/cls_token'])


def test_convert_npz_orbax_npz_round_trip(tmp_path):
  src = FIXTURES / 'vit_tiny' / 'params_linen.npz'  # Written back with the Linen names.
  assert convert.main([str(src), str(tmp_path / 'orbax')]) == 0
  assert convert.main([str(tmp_path / 'orbax'), str(tmp_path / 'back.npz')]) == 0
  with np.load(src, allow_pickle=False) as a, np.load(tmp_path / 'back.npz',
                                                      allow_pickle=False) as b:
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_convert_bad_input_is_explained(tmp_path, capsys):
  pth = PERFORMER / 'checkpoint.pth.tar'
  assert convert.main([str(pth), str(tmp_path / 'x')]) == 2
  assert 'name its model with --model' in capsys.readouterr().err
  sets = [f'--set={k}={v!r}' for k, v in _fixture_overrides().items()]
  assert convert.main([str(pth), str(tmp_path / 'x.npz'), '--model', 'T2T-ViT-custom', *sets]) == 2
  assert 'give a directory as the destination' in capsys.readouterr().err
  assert not (tmp_path / 'x.npz').exists()
  (tmp_path / 'taken').mkdir()
  assert convert.main([str(FIXTURES / 'vit_tiny' / 'params.npz'), str(tmp_path / 'taken')]) == 2
  assert 'exists; choose a new destination or pass --overwrite' in capsys.readouterr().err
  assert convert.main([str(tmp_path / 'missing.npz'), str(tmp_path / 'y')]) == 2
  assert capsys.readouterr().err == f"FATAL: No checkpoint at '{tmp_path / 'missing.npz'}'\n"
  assert convert.main([str(pth), str(tmp_path / 'z'), '--model', 'T2T-ViT-custom', *sets,
                       '--set=num_classes=10']) == 2
  assert 'class count (and the input size) are read from the file' in capsys.readouterr().err
  # State-dict arrays saved with numpy keep PyTorch names: not an official ViT .npz.
  assert convert.main([str(PERFORMER / 'state_dict_ema.npz'), str(tmp_path / 'w')]) == 2
  assert 'holds PyTorch state-dict names' in capsys.readouterr().err
  assert convert.main([str(FIXTURES / 'vit_tiny' / 'params.npz'), str(tmp_path / 'v'),
                       '--model', 'T2T-ViT-14']) == 0
  assert 'apply to PyTorch and timm files only' in capsys.readouterr().err
  # The source is never replaced, and only directories and .npz files are written.
  assert convert.main([str(tmp_path / 'v'), str(tmp_path / 'v'), '--overwrite']) == 2
  assert 'the source is never replaced' in capsys.readouterr().err
  assert (tmp_path / 'v').is_dir()
  assert convert.main([str(tmp_path / 'v'), str(tmp_path / 'out.pth')]) == 2
  assert 'a directory (Orbax checkpoint) or a .npz file' in capsys.readouterr().err
  assert convert.main([str(pth), str(tmp_path / 'u'), '--model', 'T2T-ViT-99']) == 2
  assert capsys.readouterr().err.startswith("FATAL: Unknown model name 'T2T-ViT-99'.")


def test_convert_summary_counts_the_arrays_written(tmp_path, capsys):
  """A scanned Orbax checkpoint (stacked encoderblock) -> .npz: the summary counts the
  unrolled arrays the .npz holds, not the scanned tree's."""
  variables = checkpoint.load(FIXTURES / 'vit_tiny' / 'params_linen.npz')
  scanned = models.scan_params(variables, num_layers=2)
  checkpoint.save_orbax(tmp_path / 'scanned', scanned)
  assert convert.main([str(tmp_path / 'scanned'), str(tmp_path / 'out.npz')]) == 0
  with np.load(tmp_path / 'out.npz', allow_pickle=False) as f:
    written = len(f.files)
  scanned_count = len(checkpoint.flatten_params(scanned['params']))
  assert written > scanned_count  # 2 blocks: their 12 stacked arrays become 24.
  out = capsys.readouterr().out
  assert f'  params: {written} arrays, ' in out, out
  assert convert.main([str(tmp_path / 'scanned'), str(tmp_path / 'again')]) == 0
  assert f'  params: {scanned_count} arrays, ' in capsys.readouterr().out  # Orbax: as saved.


# ------------------------------------------------------------------------------ export round trip


def _tiny_vit_run(tmp_path, name, **overrides):
  folder = data_utils.make_image_folder(str(tmp_path / 'images'), num_classes=3, per_class=4,
                                        size=16)
  config = data_utils.folder_run_config('ViT-custom', folder, 16,
                                        **dict(_vit_tiny_fields(), scan=True))
  for key, value in overrides.items():
    config[key] = value
  workdir = str(tmp_path / name)
  train.train_and_evaluate(config, workdir)
  return config, workdir


@pytest.fixture(scope='module')
def tiny_vit_workdir(tmp_path_factory):
  """The workdir of a finished `_tiny_vit_run` (scanned layout), shared by the tests below: one
  step, as test_pretrained_dir_convention's fine-tuning run (the same train step: compiled once,
  then read from the compilation cache)."""
  return _tiny_vit_run(tmp_path_factory.mktemp('tiny_vit'), 'run', total_steps=1)[1]


@pytest.mark.slow
def test_export_fine_tuned_checkpoint_to_official_npz_and_back(tmp_path, tiny_vit_workdir):
  """workdir (scanned layout) -> official .npz -> load: bitwise equal, same logits."""
  workdir = tiny_vit_workdir
  npz = tmp_path / 'exported.npz'
  assert convert.main([workdir, str(npz)]) == 0
  ours = checkpoint.load(workdir)
  assert models.is_scanned(ours['params'])
  exported = checkpoint.load(npz)
  assert not models.is_scanned(exported['params'])
  flat_ours = checkpoint.flatten_params(models.unscan_params(ours['params']))
  flat_exported = checkpoint.flatten_params(exported['params'])
  assert sorted(flat_ours) == sorted(flat_exported)
  for key, value in flat_ours.items():
    np.testing.assert_array_equal(flat_exported[key], value, err_msg=key)
  with np.load(npz, allow_pickle=False) as f:  # The official key layout.
    assert 'Transformer/encoderblock_1/MultiHeadDotProductAttention_0/query/kernel' in f.files
  images = np.random.default_rng(0).uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
  scanned = models.create('ViT-custom', num_classes=3, **dict(_vit_tiny_fields(), scan=True))
  unrolled = models.create('ViT-custom', num_classes=3, **_vit_tiny_fields())
  apply = lambda m, v: jax.jit(lambda v: m.apply(v, images, train=False))(v)  # Compiled: cheaper.
  np.testing.assert_allclose(apply(unrolled, exported), apply(scanned, ours), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.slow
def test_pretrained_dir_convention(tmp_path, tiny_vit_workdir):
  """init_from = '{pretrained_dir}/{model_name}.npz', as the official fine-tuning configs."""
  workdir = tiny_vit_workdir
  pretrained = tmp_path / 'pretrained'
  assert convert.main([workdir, str(pretrained / 'ViT-custom.npz')]) == 0
  _, finetuned = _tiny_vit_run(tmp_path, 'finetune', pretrained_dir=str(pretrained),
                               total_steps=1)
  assert checkpoint.load(finetuned)['params']['Transformer']['encoderblock']['LayerNorm_0'][
      'scale'].shape == (2, 32)
  with pytest.raises(train.ConfigError,
                     match=r'ViT-custom.npz.*\(config.pretrained_dir/<model_name>.npz\)'):
    _tiny_vit_run(tmp_path, 'missing', pretrained_dir=str(tmp_path / 'nowhere'))


# ------------------------------------------------------------------------------ end to end


def _fmnist_config(data_dir, image_size, total_steps, **overrides):
  config = defaults.get_config('ViT-custom', 'fashion_mnist_local', hidden_size=64, mlp_dim=128,
                               num_heads=4, num_layers=3, patch_size=7)
  config.regime = 'pretrain'
  config.loss = 'softmax_xent'
  config.model.head_bias_init = 0.0
  config.optim.update(lr=2e-3, weight_decay=0.05, schedule='cosine', warmup_steps=30)
  config.data.update(data_dir=data_dir, image_size=image_size, augment='flip', cache=False,
                     eval_split='test[:1000]', shuffle_buffer=10_000)
  config.batch_size = 64
  config.total_steps = total_steps
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = total_steps
  for key, value in overrides.items():
    if isinstance(value, dict):
      config[key].update(value)
    else:
      config[key] = value
  return config


@pytest.mark.slow
def test_pretrain_28px_export_then_finetune_42px_beats_scratch(tmp_path, fashion_mnist_dir):
  """Pretrain at 28 px, export to .npz, fine-tune at 42 px (position embedding 4x4 -> 6x6):
  the short fine-tuning schedule beats the same schedule from scratch."""
  data_dir = fashion_mnist_dir  # Prepared once per run (tests/conftest.py).
  pretrained = train.train_and_evaluate(_fmnist_config(data_dir, 28, 100), str(tmp_path / 'pre'))
  npz = tmp_path / 'pretrained.npz'
  assert convert.main([str(tmp_path / 'pre'), str(npz)]) == 0
  # The same short fine-tuning schedule (the 'finetune' regime: SGD momentum, lr 0.03, cosine;
  # batch 32) from the exported weights and from scratch.
  short = dict(regime='finetune', batch_size=32, optim=dict(
      optimizer=None, lr=None, weight_decay=None, schedule=None, warmup_steps=10))
  finetuned = train.train_and_evaluate(
      _fmnist_config(data_dir, 42, 20, init_from=str(npz), **short), str(tmp_path / 'fine'))
  scratch = train.train_and_evaluate(_fmnist_config(data_dir, 42, 20, **short),
                                     str(tmp_path / 'scratch'))
  # Measured: 0.62, 0.40 and 0.24 (fine-tuning at batch 32, the first 1000 test images; with
  # config.seed 1 and 2: 0.44 and 0.26, 0.41 and 0.18; at 56 px the margins were 0.20, 0.16
  # and 0.12 for seeds 0, 1 and 2, at 7% more CPU).
  print(f"pretrained (28 px, 100 steps): {pretrained['test_1000/accuracy']:.4f}; "
        f"fine-tuned (42 px, 20 steps): {finetuned['test_1000/accuracy']:.4f}; "
        f"scratch (42 px, 20 steps): {scratch['test_1000/accuracy']:.4f}")
  assert finetuned['test_1000/accuracy'] > scratch['test_1000/accuracy'] + 0.05


def test_restore_for_evaluation_checks_the_model():
  """load(path, model=, image_size=) restores everything as saved, or lists what does not fit."""
  path = FIXTURES / 'vit_tiny' / 'params.npz'
  model = models.create('ViT-custom', num_classes=10, **_vit_tiny_fields())
  variables = checkpoint.load(path, model=model, image_size=32)
  np.testing.assert_allclose(jax.jit(lambda v, x: model.apply(v, x, train=False))(
      variables, np.load(FIXTURES / 'vit_tiny' / 'inputs.npy')),
      np.load(FIXTURES / 'vit_tiny' / 'logits.npy'), atol=1e-5)
  with pytest.raises(ValueError) as info:  # Another class count and resolution: not for eval.
    checkpoint.load(path, model=models.create('ViT-custom', num_classes=5, representation_size=8,
                                              **_vit_tiny_fields()), image_size=48)
  message = str(info.value)
  assert 'does not fit the model' in message
  assert 'missing keys (2): ' in message and 'params/pre_logits/kernel' in message
  assert 'params/head/kernel: checkpoint (32, 10), model (8, 5)' in message
  assert 'pos_embedding: checkpoint (1, 65, 32), model (1, 145, 32)' in message
  with pytest.raises(ValueError, match='Only the position table differs: the checkpoint is for '
                     'another image size'):
    checkpoint.load(path, model=model, image_size=48)
  with pytest.raises(ValueError, match='must be a variables dict'):
    checkpoint.init_for_finetuning(variables['params'], variables)
  scanned = models.create('ViT-custom', num_classes=10, **dict(_vit_tiny_fields(), scan=True))
  with pytest.raises(ValueError, match='per-layer block layout; convert it with '
                     'vit_jax.models.scan_params first'):
    checkpoint.load(path, model=scanned, image_size=32)


def test_a_no_embed_class_mismatch_is_not_called_another_image_size():
  """Position tables that differ by exactly the class-token / register rows: no_embed_class."""
  path, model = _timm_model('timm_deit3', 2, no_embed_class=False, num_classes=3)
  with pytest.raises(ValueError) as e:
    checkpoint.load(path, model=model)
  message = str(e.value)
  assert 'another image size' not in message.replace('not another image size', '')
  assert ("Only the position table differs, by its 1 class-token / register rows: the "
          "checkpoint's covers the patch grid only (no_embed_class=True) (timm's "
          "no_embed_class), not another image size. Build the model with no_embed_class=True."
          in message), message
  path, model = _timm_model('timm_vit_reg', 4, no_embed_class=True, num_classes=5)
  with pytest.raises(ValueError, match=r"covers the patch grid and the 2 class-token / register "
                     r"rows in front \(no_embed_class=False\).* no_embed_class=False\."):
    checkpoint.load(path, model=model)
  # Another size (4x4 -> 6x6 grid) is still named so.
  path, model = _timm_model('timm_deit3', 2, num_classes=3)
  with pytest.raises(ValueError, match='Only the position table differs: the checkpoint is for '
                     'another image size'):
    checkpoint.load(path, model=model, image_size=48)


def test_hybrid_mismatch_names_the_resnet_stages():
  saved = checkpoint.load(FIXTURES / 'vit_hybrid_tiny' / 'params.npz')
  model = models.create('R+ViT-custom', num_classes=10,
                        **dict(_vit_tiny_fields(), patch_size=1, resnet_num_layers=(3, 1)))
  with pytest.raises(ValueError, match=r'a ResNet stem with .*resnet_num_layers=\(2, 1\)'):
    checkpoint.check_fits(saved, models.unbox(jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False))))


def test_square_patch_override_from_the_command_line_form():
  """--config.model.patch_size=4 on a tuple field arrives as (4,): a square patch."""
  model = models.create('ViT-custom', num_classes=2, **dict(_vit_tiny_fields(), patch_size=(4,)))
  assert models.vit.patch_pair(model.patch_size) == (4, 4)
