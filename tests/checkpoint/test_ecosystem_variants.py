"""timm's ViT variants (issue 41): DeiT III, DINOv2 with and without registers, SigLIP and
SigLIP 2, a register + LayerScale + fc_norm average-pool ViT, and a big_vision SigLIP two-tower
.npz; QK normalisation (issue 51). Read from files timm wrote (tests/fixtures/ecosystem/
make_fixtures.py, `variants` and `qk_norm`) with timm's outputs and parameter counts, written
back exactly, and refused where they do not fit."""

import dataclasses
import json
import logging
import pathlib

import jax
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.checkpoint import archive
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import flatten_params

ECOSYSTEM = pathlib.Path(__file__).resolve().parents[1] / 'fixtures' / 'ecosystem'
CHECKS = json.loads((ECOSYSTEM / 'checks.json').read_text())['checks']

#: The tiny dimensions of the variant fixtures (V_DIMS in make_fixtures.py).
TINY = dict(hidden_size=16, num_layers=2, num_heads=2, mlp_dim=32, representation_size=None,
            posemb='learn', layer_norm_epsilon=1e-6, gelu_approximate=False)
LAYERSCALE = 1e-5  # What LayerScale weights read as (vit_shapes.LAYERSCALE_INIT).

#: fixture -> (the file, the fields it implies besides the image size, image size).
FIXTURES = {
    'timm_deit3': ('model.safetensors', dict(
        TINY, patch_size=8, classifier='token', num_classes=3, layerscale_init=LAYERSCALE,
        no_embed_class=True), 32),
    'timm_dinov2': ('model.safetensors', dict(
        TINY, patch_size=14, classifier='token', num_classes=3, layerscale_init=LAYERSCALE), 42),
    'timm_dinov2_reg4': ('model.safetensors', dict(
        TINY, patch_size=14, classifier='token', num_classes=None, layerscale_init=LAYERSCALE,
        num_registers=4, no_embed_class=True), 28),
    'timm_siglip': ('model.safetensors', dict(
        TINY, patch_size=8, classifier='map', num_classes=3), 32),
    'timm_siglip2_so400m': ('model.safetensors', dict(
        TINY, patch_size=8, classifier='map', num_classes=3, mlp_dim=59), 32),
    'timm_reg4_gap': ('model.safetensors', dict(
        TINY, patch_size=8, classifier='gap', num_classes=3, layerscale_init=LAYERSCALE,
        num_registers=4, no_embed_class=True, fc_norm=True), 32),
    'timm_vit_reg': ('model.safetensors', dict(
        TINY, patch_size=8, hidden_size=32, num_heads=4, mlp_dim=64, classifier='token',
        num_classes=5, num_registers=1), 32),
    'timm_qk_norm': ('model.safetensors', dict(
        TINY, patch_size=8, classifier='token', num_classes=3, qk_norm=True), 32),
    'big_vision_siglip': ('params.npz', dict(
        TINY, patch_size=8, classifier='map', num_classes=3, gelu_approximate=True), 32),
}
TIMM = sorted(k for k in FIXTURES if k.startswith('timm_'))
#: timm files do not record their GELU: the so400m/16 SigLIP 2 tower's is tanh (the model's).
MODEL_GELU = {'timm_siglip2_so400m': True}


def _read(name):
  """(path, fields, the model they make, its variables as loaded for it)."""
  filename, fields, size = FIXTURES[name]
  path = ECOSYSTEM / name / filename
  fields = dict(fields, gelu_approximate=MODEL_GELU.get(name, fields['gelu_approximate']))
  model = models.create('ViT-custom', **fields)
  return path, fields, model, checkpoint.load(path, model=model)


def _apply(model, variables, images):
  return np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, images))


@pytest.mark.golden
@pytest.mark.parametrize('name', sorted(FIXTURES))
def test_variants_give_the_source_library_outputs_and_parameter_count(name):
  filename, expected, size = FIXTURES[name]
  path = ECOSYSTEM / name / filename
  fields = checkpoint.model_fields(path, num_heads=expected['num_heads'])
  assert fields.pop('image_size') == size
  if path.suffix == '.safetensors':  # timm's resize of the table at another image size.
    assert fields.pop('posemb_resize') == 'bicubic_antialias'
  assert fields == expected  # timm's GELU (the exact one) where the model gives none.
  path, fields, model, variables = _read(name)
  golden = np.load(ECOSYSTEM / name / 'golden.npz')
  np.testing.assert_allclose(_apply(model, variables, golden['images']), golden['logits'],
                             rtol=0, atol=1e-5)
  count = sum(np.size(v) for v in flatten_params(variables['params']).values())
  if path.suffix == '.safetensors':  # Exactly timm's tensors, each an element per parameter.
    assert count == sum(np.prod(s) for s in archive.shapes(archive.read_header(str(path))).values())
  timm_count = CHECKS[name].get('num_params', CHECKS[name].get('num_params_image_tower'))
  if timm_count is not None:  # sum(p.numel() for p in model.parameters()) in timm.
    assert count == timm_count


def test_a_model_gelu_reads_a_timm_file_and_changes_the_outputs():
  # The so400m/16 SigLIP 2 tower computes with the tanh GELU, which its file does not record.
  _, fields, model, variables = _read('timm_siglip2_so400m')
  golden = np.load(ECOSYSTEM / 'timm_siglip2_so400m' / 'golden.npz')
  exact = models.create('ViT-custom', **dict(fields, gelu_approximate=False))
  wrong = _apply(exact, checkpoint.load(ECOSYSTEM / 'timm_siglip2_so400m' / 'model.safetensors',
                                        model=exact), golden['images'])
  assert np.abs(wrong - golden['logits']).max() > 1e-4


def test_the_siglip_text_tower_is_ignored_with_a_log_line(caplog):
  path = ECOSYSTEM / 'big_vision_siglip' / 'params.npz'
  with caplog.at_level(logging.INFO):
    params = checkpoint.load(path)['params']
  assert 'its image tower img/ is read as the ViT; b, t, txt/ ignored' in caplog.text
  assert {'txt', 't', 'b', 'img'}.isdisjoint(params)
  assert params['MAPHead_0']['probe'].shape == (1, 1, 16)
  assert checkpoint.open(path).numerics() == (dict(posemb='learn', classifier='map'),
                                              'a big_vision .npz')


@pytest.mark.parametrize('name', TIMM)
def test_timm_exports_write_back_the_same_tensors(tmp_path, name):
  path, fields, _, variables = _read(name)
  dst = tmp_path / 'back.safetensors'
  call = ecosystem.write(str(dst), variables['params'], fields, to='timm',
                         image_size=FIXTURES[name][2])
  source, back = archive.read_safetensors(str(path)), archive.read_safetensors(str(dst))
  assert sorted(back) == sorted(source)
  for key, value in source.items():
    np.testing.assert_array_equal(back[key], value, err_msg=key)
  back_fields = checkpoint.model_fields(dst)  # Heads and GELU recorded now.
  assert back_fields.pop('image_size') == FIXTURES[name][2]
  assert back_fields.pop('posemb_resize') == 'bicubic_antialias'
  assert back_fields == fields
  for keyword in ([f"init_values={LAYERSCALE}"] if fields.get('layerscale_init') else []) + (
      [f"reg_tokens={fields['num_registers']}"] if fields.get('num_registers') else []) + (
          ['no_embed_class=True'] if fields.get('no_embed_class') else []) + (
              ['qk_norm=True'] if fields.get('qk_norm') else []):
    assert keyword in call, keyword
  assert ('fc_norm=True' in call) == bool(fields.get('fc_norm'))


@pytest.mark.parametrize('name', ['timm_reg4_gap', 'timm_dinov2_reg4', 'big_vision_siglip'])
def test_npz_exports_read_back_exactly(tmp_path, name):
  _, _, model, variables = _read(name)
  checkpoint.save_npz(tmp_path / 'out.npz', variables)
  back = checkpoint.load(tmp_path / 'out.npz', model=model, image_size=FIXTURES[name][2])
  ours, theirs = flatten_params(variables['params']), flatten_params(back['params'])
  assert ours.keys() == theirs.keys()
  for key, value in ours.items():
    np.testing.assert_array_equal(theirs[key], value, err_msg=key)


def test_transformers_cannot_hold_the_variants_and_says_so(tmp_path):
  _, fields, _, variables = _read('timm_dinov2_reg4')
  with pytest.raises(ValueError, match=(
      r'layerscale_init=1e-05 \(a ViTConfig has no layerscale_init; export with --to timm\); '
      r'num_registers=4 \(a ViTConfig has no num_registers; export with --to timm\); '
      r'no_embed_class=True \(a ViTConfig has no no_embed_class; export with --to timm\)\. An '
      r'Orbax directory or an \.npz \(with its \.vit_jax\.json\) keeps every field')):
    ecosystem.write(str(tmp_path / 'hf'), variables['params'], fields, to='hf', image_size=28)
  _, fields, _, variables = _read('timm_qk_norm')
  with pytest.raises(ValueError, match=(
      r'^The model cannot be written as a transformers ViT: it has qk_norm=True \(a ViTConfig '
      r'has no qk_norm; export with --to timm\)\. An Orbax directory or an \.npz ')):
    ecosystem.write(str(tmp_path / 'hf'), variables['params'], fields, to='hf', image_size=32)
  assert not (tmp_path / 'hf').exists()


@pytest.mark.parametrize('name, missing, fix', [
    ('timm_deit3', dict(layerscale_init=None), 'layerscale_init=1e-05'),
    ('timm_dinov2_reg4', dict(num_registers=0), 'num_registers=4'),
    ('timm_reg4_gap', dict(fc_norm=False), 'fc_norm=True'),
    ('timm_qk_norm', dict(qk_norm=False), 'qk_norm=True'),
])
def test_weights_of_a_variant_into_a_model_without_it_get_the_mismatch_report(name, missing,
                                                                              fix):
  filename, fields, size = FIXTURES[name]
  model = models.create('ViT-custom', **dict(fields, **missing))
  with pytest.raises(ValueError) as e:
    checkpoint.load(ECOSYSTEM / name / filename, model=model)
  message = str(e.value)
  assert 'does not fit the model' in message and 'unexpected keys' in message, message
  assert 'The checkpoint is a ViT with patch_size=' in message and fix in message, message


def test_a_patch_only_table_into_a_model_with_a_class_row_is_a_shape_mismatch():
  filename, fields, _ = FIXTURES['timm_deit3']
  model = models.create('ViT-custom', **dict(fields, no_embed_class=False))
  with pytest.raises(ValueError, match=r'shape mismatches \(1\): params/Transformer/posembed_'
                     r'input/pos_embedding: checkpoint \(1, 16, 16\), model \(1, 17, 16\)'):
    checkpoint.load(ECOSYSTEM / 'timm_deit3' / filename, model=model)
  contents = checkpoint.open(ECOSYSTEM / 'timm_deit3' / filename).contents(
      overrides=dict(num_heads=2))
  assert 'no_embed_class=True' in checkpoint.describe_architecture(contents.variables)


@pytest.mark.golden
@pytest.mark.parametrize('name, size', [('timm_dinov2', 28), ('timm_dinov2', 56),
                                        ('timm_dinov2_reg4', 42)])
def test_dinov2_at_another_size_resamples_its_table_as_timm(name, size):
  """timm's dynamic_img_size: the table resampled per input, bicubic with antialiasing, the
  class-token row kept (DINOv2) or none (registers: no_embed_class)."""
  filename, fields, _ = FIXTURES[name]
  if 'posemb_resize' not in {f.name for f in dataclasses.fields(models.VisionTransformer)}:
    pytest.skip('the model resamples no position table yet (posemb_resize)')
  model = models.VisionTransformer(**fields, posemb_resize='bicubic_antialias')
  variables = checkpoint.load(ECOSYSTEM / name / filename, model=model)
  golden = np.load(ECOSYSTEM / name / 'golden.npz')
  np.testing.assert_allclose(_apply(model, variables, golden[f'images_{size}']),
                             golden[f'logits_{size}'], rtol=0, atol=1e-5)
