"""Weights of the other ViT libraries: transformers, timm and big_vision files read with their
golden logits, written back exactly, and refused by name where this ViT has no equivalent."""

import json
import pathlib
import shutil

import jax
import numpy as np
import PIL.Image
import pytest

from vit_jax import checkpoint
from vit_jax import config as config_lib
from vit_jax import inference
from vit_jax import models
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import flatten_params
from vit_jax.tools import convert

ECOSYSTEM = pathlib.Path(__file__).resolve().parents[1] / 'fixtures' / 'ecosystem'

#: fixture -> the path given to load (a directory or a file), and the golden output's name.
SOURCES = {
    'timm_vit': ('timm_vit/model.safetensors', 'logits'),
    'timm_vit_gap': ('timm_vit_gap/model.safetensors', 'logits'),
    'hf_vit_v4': ('hf_vit_v4', 'logits'),
    'hf_vit_v5': ('hf_vit_v5/model.safetensors', 'logits'),
    'hf_vit_model': ('hf_vit_model', 'pooler_output'),
    'big_vision_tok': ('big_vision_tok/params.npz', 'logits'),
    'big_vision_map_scanned': ('big_vision_map_scanned/params.npz', 'logits'),
    'big_vision_sincos_gap': ('big_vision_sincos_gap/params.npz', 'logits'),
}

#: What each file computes with, besides the tiny architecture they share (timm's and
#: transformers' also how they resample the position table at another size:
#: ecosystem.RESAMPLING; timm: bicubic antialiased, transformers: bicubic).
NUMERICS = {
    'timm_vit': dict(classifier='token', gelu_approximate=False, layer_norm_epsilon=1e-6,
                     posemb_resize='bicubic_antialias'),
    'timm_vit_gap': dict(classifier='gap', gelu_approximate=False, layer_norm_epsilon=1e-6,
                         posemb_resize='bicubic_antialias'),
    'hf_vit_v4': dict(classifier='token', gelu_approximate=False, layer_norm_epsilon=1e-12,
                      posemb_resize='bicubic'),
    'hf_vit_v5': dict(classifier='token', gelu_approximate=False, layer_norm_epsilon=1e-12,
                      posemb_resize='bicubic'),
    'hf_vit_model': dict(classifier='token', gelu_approximate=False, layer_norm_epsilon=1e-12,
                         representation_size=32, num_classes=None, posemb_resize='bicubic'),
    'big_vision_tok': dict(classifier='token', gelu_approximate=True, layer_norm_epsilon=1e-6),
    'big_vision_map_scanned': dict(classifier='map', gelu_approximate=True,
                                   layer_norm_epsilon=1e-6),
    'big_vision_sincos_gap': dict(classifier='gap', posemb='sincos2d', gelu_approximate=True,
                                  layer_norm_epsilon=1e-6),
}

TINY = dict(patch_size=8, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64)


def _fields(name):
  fields = dict(TINY, num_classes=5, representation_size=None, posemb='learn')
  fields.update(NUMERICS[name])
  return fields


@pytest.mark.golden
@pytest.mark.parametrize('name', sorted(SOURCES))
def test_reference_files_give_their_libraries_outputs(name):
  path, output = SOURCES[name]
  path = ECOSYSTEM / path
  fields = checkpoint.model_fields(path, num_heads=4)
  # A fixed sincos2d table is made for any grid: such a file does not say its image size.
  assert fields.pop('image_size') == (None if name == 'big_vision_sincos_gap' else 32)
  assert fields == _fields(name)
  model = models.create('ViT-custom', **fields)
  variables = checkpoint.load(path, model=model)
  golden = np.load(ECOSYSTEM / name / 'golden.npz')
  out = np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(variables,
                                                                        golden['images']))
  np.testing.assert_allclose(out, golden[output], rtol=0, atol=1e-5)


def test_other_numerics_are_refused_for_evaluation_and_named():
  model = models.create('ViT-custom', num_classes=5, **TINY)  # tanh GELU, epsilon 1e-6
  with pytest.raises(ValueError) as e:
    checkpoint.load(ECOSYSTEM / 'hf_vit_v4', model=model)
  assert ('gelu_approximate=False (the model has True), layer_norm_epsilon=1e-12 (the model has '
          '1e-06)') in str(e.value)
  # The same weights computed with the official numerics: the difference the fields remove.
  golden = np.load(ECOSYSTEM / 'hf_vit_v4' / 'golden.npz')
  variables = checkpoint.load(ECOSYSTEM / 'hf_vit_v4')
  wrong = np.asarray(model.apply(variables, golden['images'], train=False))
  assert np.abs(wrong - golden['logits']).max() > 1e-4


def test_a_file_of_another_architecture_gets_the_mismatch_report():
  model = models.create('ViT-custom', num_classes=5, **dict(TINY, hidden_size=64),
                        gelu_approximate=False, layer_norm_epsilon=1e-12)
  with pytest.raises(ValueError) as e:
    checkpoint.load(ECOSYSTEM / 'hf_vit_v4', model=model)
  message = str(e.value)
  assert 'does not fit the model' in message and 'shape mismatches' in message
  assert 'The checkpoint is a ViT with patch_size=8, hidden_size=32, num_layers=2' in message


@pytest.mark.parametrize('name, what', [
    # (Register tokens, timm_vit_reg, are read since issue 41: test_ecosystem_variants.py.)
    ('timm_vit_fcnorm', "a class token and a LayerNorm after the average pooling (timm's fc_norm"),
])
def test_timm_variants_without_an_equivalent_are_refused_by_name(name, what):
  with pytest.raises(ValueError, match=r'is a timm ViT with ') as e:
    checkpoint.load(ECOSYSTEM / name / 'model.safetensors')
  assert what in str(e.value)


def test_bad_safetensors_are_explained(tmp_path):
  # transformers names without their config.json.
  lone = tmp_path / 'model.safetensors'
  shutil.copy(ECOSYSTEM / 'hf_vit_v4' / 'model.safetensors', lone)
  with pytest.raises(ValueError, match='no config.json lies beside it'):
    checkpoint.load(lone)
  # A truncated download.
  shutil.copytree(ECOSYSTEM / 'hf_vit_v4', tmp_path / 'cut')
  cut = tmp_path / 'cut' / 'model.safetensors'
  cut.write_bytes(cut.read_bytes()[:-100])
  with pytest.raises(checkpoint.DamagedCheckpointError, match='truncated or damaged'):
    checkpoint.load(cut)
  # Another model's tensors.
  from vit_jax.checkpoint import archive
  other = tmp_path / 'other.safetensors'
  archive.write_safetensors(str(other), {'encoder.weight': np.zeros((2, 2), np.float32)})
  with pytest.raises(ValueError, match='neither a transformers ViT nor a timm'):
    checkpoint.load(other)
  # timm does not record heads: a non-standard width needs them.
  with pytest.raises(ValueError, match='does not record its attention heads'):
    checkpoint.load(ECOSYSTEM / 'timm_vit' / 'model.safetensors')
  # A truncated timm file is damaged before any question about its heads (was: heads first).
  timm_cut = tmp_path / 'timm_cut.safetensors'
  whole = (ECOSYSTEM / 'timm_vit' / 'model.safetensors').read_bytes()
  timm_cut.write_bytes(whole[:20000])
  with pytest.raises(checkpoint.DamagedCheckpointError, match=(
      f"truncated or damaged: its header describes {len(whole):,} bytes; the file has "
      "20,000 bytes")):
    checkpoint.model_fields(timm_cut)


def _random_variables(model, image_size=32, seed=0):
  """Every parameter random (zero-initialised heads and tokens would hide mappings); shapes
  from `jax.eval_shape` (no initialisation to compile)."""
  shapes = models.unbox(models.abstract_variables(model, (image_size, image_size)))
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32), shapes)


@pytest.mark.parametrize('to, overrides', [
    ('hf', dict(gelu_approximate=False, layer_norm_epsilon=1e-12)),
    ('hf', dict(scan=True)),
    ('timm', dict(classifier='map', scan=True)),
    ('timm', dict(classifier='gap', posemb='sincos2d', gelu_approximate=False)),
])
def test_written_files_read_back_exactly(tmp_path, to, overrides):
  model = models.create('ViT-custom', num_classes=3, **TINY, **overrides)
  variables = _random_variables(model)
  fields = dict(TINY, num_classes=3, **models.model_config('ViT-custom', **TINY, **overrides))
  dst = tmp_path / ('out' if to == 'hf' else 'out.safetensors')
  call = ecosystem.write(str(dst), variables['params'], fields, to=to, image_size=32,
                         label_names=['a', 'b', 'c'])
  back_fields = checkpoint.model_fields(dst)
  assert back_fields.pop('image_size') == 32
  for key in ecosystem.NUMERICS:  # The table of a sincos2d model is written as a learned one.
    expected = 'learn' if key == 'posemb' else fields[key]
    assert back_fields[key] == expected, key
  back_model = models.create('ViT-custom', **back_fields)  # Per-layer, 'learn'.
  back = checkpoint.load(dst, model=back_model)
  images = np.random.RandomState(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
  if overrides.get('scan'):  # The same per-layer computation on both sides, bit for bit.
    model = back_model
    variables = {'params': models.unscan_params(variables['params'])}
  apply = jax.jit(lambda m, v: m.apply(v, images, train=False), static_argnums=0)
  # A sincos2d table is written as computed once in NumPy: float32 rounding apart.
  np.testing.assert_allclose(np.asarray(apply(back_model, back)),
                             np.asarray(apply(model, variables)), rtol=0,
                             atol=1e-6 if overrides.get('posemb') == 'sincos2d' else 0)
  if overrides.get('posemb') != 'sincos2d':  # Parameter for parameter, bit for bit.
    ours = flatten_params(variables['params'])
    theirs = flatten_params(back['params'])
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
      np.testing.assert_array_equal(theirs[key], value, err_msg=key)
  if to == 'hf':
    config = json.loads((dst / 'config.json').read_text())
    assert config['id2label'] == {'0': 'a', '1': 'b', '2': 'c'}
    assert config['hidden_act'] == ('gelu' if overrides.get('gelu_approximate') is False
                                    else 'gelu_pytorch_tanh')
    assert call == f"transformers.ViTForImageClassification.from_pretrained('{dst}')"
    processor = json.loads((dst / 'preprocessor_config.json').read_text())
    assert (processor['size'], processor['image_mean']) == ({'height': 32, 'width': 32},
                                                            [0.5, 0.5, 0.5])
  else:
    assert call.startswith("timm.create_model('vit_base_patch16_224', pretrained=True, "
                           "pretrained_cfg_overlay=dict(file=")
    assert "input_size=(3, 32, 32), crop_pct=1.0, interpolation='bilinear'" in call
  assert checkpoint.open(dst).contents().label_names == ('a', 'b', 'c')


def test_what_a_library_cannot_express_is_refused_by_name(tmp_path):
  fields = dict(TINY, num_classes=3, classifier='gap', representation_size=None)
  with pytest.raises(ValueError, match=r"classifier='gap' \(ViTForImageClassification"):
    ecosystem.write(str(tmp_path / 'hf'), {}, fields, to='hf', image_size=32)
  fields = dict(TINY, num_classes=3, classifier='token', layer_norm_epsilon=1e-12)
  with pytest.raises(ValueError, match='LayerNorm epsilon 1e-12 .timm builds 1e-6; export with '
                     '--to hf'):
    ecosystem.write(str(tmp_path / 'x.safetensors'), {}, fields, to='timm', image_size=32)
  fields = dict(TINY, num_classes=3, representation_size=16, resnet_num_layers=(1,))
  with pytest.raises(ValueError, match='a ResNet stem .R\\+ViT hybrid.; a pre_logits layer'):
    ecosystem.write(str(tmp_path / 'y.safetensors'), {}, fields, to='timm', image_size=32)


def test_inference_takes_names_and_numerics_from_a_transformers_directory():
  trained = inference.load(ECOSYSTEM / 'hf_vit_v4')
  assert trained.label_names == ('apple', 'bicycle', 'cloud', 'dog', 'eagle')
  assert (trained.config.model.gelu_approximate, trained.config.model.layer_norm_epsilon) == (
      False, 1e-12)
  assert trained.config.data.image_size == 32
  assert trained.description.endswith('(transformers ViT)')


def test_init_from_sets_the_model_numerics(tmp_path):
  config = config_lib.get_config('ViT-custom', 'fashion_mnist', **TINY)
  config.init_from = str(ECOSYSTEM / 'hf_vit_v4')
  config.total_steps, config.batch_size, config.optim.warmup_steps = 2, 8, 1
  resolved = config_lib.resolve(config, num_train_examples=100, num_classes=5,
                                devices=jax.devices('cpu')[:1])
  assert (resolved.model.gelu_approximate, resolved.model.layer_norm_epsilon) == (False, 1e-12)
  config.init_from = str(ECOSYSTEM / 'big_vision_map_scanned' / 'params.npz')
  resolved = config_lib.resolve(config, num_train_examples=100, num_classes=5,
                                devices=jax.devices('cpu')[:1])
  assert (resolved.model.classifier, resolved.model.gelu_approximate) == ('map', True)


def test_convert_command_exports_and_refuses_bad_requests(tmp_path, capsys):
  src = ECOSYSTEM / 'hf_vit_v4'
  assert convert.main([str(src), str(tmp_path / 'timm.safetensors'), '--to', 'hf']) == 0
  out = capsys.readouterr().out
  assert 'Wrote transformers weights' in out and 'from_pretrained' in out
  assert (tmp_path / 'config.json').exists()
  # timm builds LayerNorm epsilon 1e-6 only: these weights need 1e-12.
  assert convert.main([str(src), str(tmp_path / 't.safetensors'), '--to', 'timm']) == 2
  assert 'LayerNorm epsilon 1e-12' in capsys.readouterr().err
  assert convert.main([str(src), str(tmp_path / 'u.safetensors')]) == 2
  assert '--to timm or --to hf' in capsys.readouterr().err
  assert convert.main([str(src), str(tmp_path / 'timm.safetensors'), '--to', 'hf']) == 2
  assert 'already exist; choose a new destination or pass --overwrite' in capsys.readouterr().err
  timm_file = ECOSYSTEM / 'timm_vit' / 'model.safetensors'
  assert convert.main([str(timm_file), str(tmp_path / 'v.safetensors'), '--to', 'timm',
                       '--set', 'num_heads=4']) == 0
  assert "act_layer" not in capsys.readouterr().out  # timm's exact GELU: timm's default.


def test_a_transformers_config_json_too_deep_or_of_another_shape_is_refused_by_name(
    tmp_path, capsys):
  """config.json nested 300,000 deep, not an object, or with a field of the wrong type: a
  ValueError naming the file, the field and the fix, for load, predict (one FATAL line, exit 2)
  and init_from (was: RecursionError, KeyError or TypeError tracebacks)."""
  from vit_jax.tools import predict  # pylint: disable=g-import-not-at-top
  src = tmp_path / 'hf'
  shutil.copytree(ECOSYSTEM / 'hf_vit_v4', src)
  good = json.loads((src / 'config.json').read_text())
  fix = ('take it again from the same Hub repository (or write it with python -m '
         'vit_jax.convert).')
  not_vit = f'{src}/config.json is not the config.json of a transformers ViT: '
  cases = [
      ('[' * 300_000, f'{src}/config.json is nested more than 64 levels deep, deeper than any '
       'JSON file read here (a damaged or foreign file); '),
      ('[1, 2]', f'{src}/config.json is not a JSON object; '),
      (dict(good, hidden_size='x'), not_vit + "hidden_size is 'x', not a positive integer; "),
      (dict(good, image_size=[32, None]),
       not_vit + 'image_size is [32, None], not a positive integer or a list of two; '),
      (dict(good, hidden_act=['gelu']), not_vit + "hidden_act is ['gelu'], not a string; "),
      (dict(good, layer_norm_eps='1e-12'), not_vit + "layer_norm_eps is '1e-12', not a number "
       'in (0, 1); '),
      ({k: v for k, v in good.items() if k != 'num_attention_heads'},
       not_vit + 'it has no num_attention_heads; '),
  ]
  for text, message in cases:
    (src / 'config.json').write_text(text if isinstance(text, str) else json.dumps(text))
    with pytest.raises(ValueError) as info:
      checkpoint.load(src)
    assert str(info.value) == message + fix
  # predict reads it first: one FATAL line; init_from: refused while the config resolves.
  (src / 'config.json').write_text('[' * 300_000)
  image = tmp_path / 'x.png'
  PIL.Image.new('RGB', (32, 32)).save(image)
  assert predict.main([str(src), str(image)]) == 2
  assert capsys.readouterr().err == f'FATAL: {cases[0][1]}{fix}\n'
  config = config_lib.get_config('ViT-custom', 'fashion_mnist', **TINY)
  config.init_from = str(src)
  with pytest.raises(ValueError, match='nested more than 64 levels deep'):
    config_lib.resolve(config, num_train_examples=100, num_classes=5,
                       devices=jax.devices('cpu')[:1])
  # A safetensors index nested too deep, or without a weight map.
  (src / 'config.json').write_text(json.dumps(good))
  (src / 'model.safetensors').rename(src / 'model-00001-of-00001.safetensors')
  for text, problem in (('{"weight_map": ' * 100 + '{}' + '}' * 100, 'is nested more than 64'),
                        ('{"weight_map": []}', 'is not a safetensors index')):
    (src / 'model.safetensors.index.json').write_text(text)
    with pytest.raises(ValueError, match=f'model.safetensors.index.json {problem}'):
      checkpoint.load(src)


def test_fine_tuning_starts_from_a_transformers_directory():
  # A scanned 10-class model at 48 px from the 5-class, 32 px per-layer weights.
  model = models.create('ViT-custom', num_classes=10, **TINY, scan=True, gelu_approximate=False,
                        layer_norm_epsilon=1e-12)
  fresh = _random_variables(model, image_size=48)
  variables = checkpoint.load_for_finetuning(ECOSYSTEM / 'hf_vit_v4', model, fresh)
  source = checkpoint.load(ECOSYSTEM / 'hf_vit_v4')['params']
  params = variables['params']
  np.testing.assert_array_equal(params['head']['kernel'],  # The new head: the official reset.
                                fresh['params']['head']['kernel'])
  np.testing.assert_array_equal(params['cls'], source['cls'])
  np.testing.assert_array_equal(params['Transformer']['encoderblock']['MlpBlock_0']['Dense_0']
                                ['kernel'][1], source['Transformer']['encoderblock_1']
                                ['MlpBlock_0']['Dense_0']['kernel'])
  assert params['Transformer']['posembed_input']['pos_embedding'].shape == (1, 37, 32)
