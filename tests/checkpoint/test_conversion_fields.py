"""Every conversion keeps every field the weights compute with, or refuses by name (issue 52,
item 2), and a position table that fits two layouts is never guessed (item 3). The fixtures
(tests/fixtures/README.md) go through every pair of formats (``python -m vit_jax.convert``:
official ``.npz`` with its ``.vit_jax.json``, Orbax, timm, transformers) and their logits are
compared, in this project's ViT, with their library's golden ones."""

import functools
import json
import pathlib

import jax
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import inference
from vit_jax import models
from vit_jax.checkpoint import archive
from vit_jax.checkpoint import hf_vit
from vit_jax.checkpoint import npz
from vit_jax.checkpoint import timm_vit
from vit_jax.checkpoint import vit_shapes
from vit_jax.models import resample
from vit_jax.tools import convert

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / 'fixtures'
ECOSYSTEM = FIXTURES / 'ecosystem'

#: fixture -> (source path, convert --set for the source, formats refused: {format: words the
#: refusal names}). timm files record neither heads nor GELU (the fixtures' widths are not
#: standard ones; the SigLIP 2 tower's GELU is tanh).
HEADS2, HEADS4 = ['num_heads=2'], ['num_heads=4']
NO_HF_VARIANT = lambda field: {'hf': [field, '--to timm']}
CASES = {
    'timm_vit': ('timm_vit/model.safetensors', HEADS4, {}),
    'timm_vit_gap': ('timm_vit_gap/model.safetensors', HEADS4, {'hf': ["classifier='gap'"]}),
    'timm_vit_reg': ('timm_vit_reg/model.safetensors', HEADS4, NO_HF_VARIANT('num_registers=1')),
    'timm_deit3': ('timm_deit3/model.safetensors', HEADS2, NO_HF_VARIANT('layerscale_init')),
    'timm_dinov2': ('timm_dinov2/model.safetensors', HEADS2, NO_HF_VARIANT('layerscale_init')),
    'timm_dinov2_reg4': ('timm_dinov2_reg4/model.safetensors', HEADS2,
                         NO_HF_VARIANT('num_registers=4')),
    'timm_reg4_gap': ('timm_reg4_gap/model.safetensors', HEADS2, NO_HF_VARIANT('fc_norm=True')),
    'timm_qk_norm': ('timm_qk_norm/model.safetensors', HEADS2, NO_HF_VARIANT('qk_norm=True')),
    'timm_siglip': ('timm_siglip/model.safetensors', HEADS2, {'hf': ["classifier='map'"]}),
    'timm_siglip2_so400m': ('timm_siglip2_so400m/model.safetensors',
                            HEADS2 + ['gelu_approximate=true'], {'hf': ["classifier='map'"]}),
    'hf_vit_v4': ('hf_vit_v4', [], {'timm': ['LayerNorm epsilon 1e-12', '--to hf']}),
    'hf_vit_v5': ('hf_vit_v5', [], {'timm': ['LayerNorm epsilon 1e-12', '--to hf']}),
    'hf_vit_model': ('hf_vit_model', [], {'timm': ['LayerNorm epsilon 1e-12', 'pre_logits']}),
    'big_vision_tok': ('big_vision_tok/params.npz', [], {}),
    'big_vision_map_scanned': ('big_vision_map_scanned/params.npz', [],
                               {'hf': ["classifier='map'"]}),
    'big_vision_sincos_gap': ('big_vision_sincos_gap/params.npz', [],
                              {'hf': ["classifier='gap'"]}),
    'big_vision_siglip': ('big_vision_siglip/params.npz', [], {'hf': ["classifier='map'"]}),
    'vit_tiny': ('../vit_tiny/params.npz', [], {}),
    'vit_tiny_gap_repr': ('../vit_tiny_gap_repr/params.npz', [],
                          {'hf': ["classifier='gap'"], 'timm': ['pre_logits']}),
}
#: Fixtures without a head: their golden features (read with ``num_classes=0``).
HEADLESS = {'timm_dinov2_reg4': 'logits', 'hf_vit_model': 'pooler_output'}
#: A fixed sin-cos table records no image size: the fixture's is given where a model is built.
IMAGE_SIZE = {'big_vision_sincos_gap': 32}
FORMATS = ('npz', 'orbax', 'timm', 'hf')
#: Orders that take every ordered pair of the kept formats once (an Euler circuit of the
#: complete digraph on 2, 3 or 4 formats), from the first.
CIRCUITS = {2: (0, 1, 0), 3: (0, 1, 2, 0, 2, 1, 0), 4: (0, 1, 2, 3, 0, 2, 1, 3, 2, 0, 3, 1, 0)}
#: The fields compared at every step (the position embedding is 'learn' once a fixed sin-cos
#: table is written into a library's file: the same values).
COMPARED = tuple(k for k in vit_shapes.KEPT_FIELDS if k != 'posemb')


@pytest.fixture(autouse=True, scope='module')
def _one_trace_per_model():
  """``models.abstract_variables`` (the ``eval_shape`` of ``model.init`` that every load and
  conversion checks the weights against, ~0.5 s of tracing) once per model and image shape: a
  chain reads the same model back at every step. Pure, so a cached tree is the same tree."""
  original = models.abstract_variables
  traced = functools.lru_cache(maxsize=None)(original)

  def abstract_variables(model, image_shape=(224, 224)):
    try:
      return traced(model, tuple(image_shape))
    except TypeError:  # An unhashable model: traced each time.
      return original(model, image_shape)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(models, 'abstract_variables', abstract_variables)
    yield


def _golden(name):
  if name.startswith('vit_tiny'):
    return np.load(FIXTURES / name / 'inputs.npy'), np.load(FIXTURES / name / 'logits.npy')
  golden = np.load(ECOSYSTEM / name / 'golden.npz')
  return golden['images'], golden[HEADLESS.get(name, 'logits')]


def _dst(tmp_path, step, fmt):
  return str(tmp_path / {'npz': f'{step}.npz', 'orbax': f'{step}_orbax',
                         'timm': f'{step}.safetensors', 'hf': f'{step}_hf'}[fmt])


def _convert(src, dst, fmt, sets=(), size=None):
  args = [src, dst] + (['--to', fmt] if fmt in ('timm', 'hf') else [])
  if size and fmt in ('timm', 'hf'):
    args += ['--image-size', str(size)]
  for setting in sets:
    args += ['--set', setting]
  return convert.main(args)


def _load(path, headless, size=None):
  return inference.load(path, num_classes=0 if headless else None, image_size=size)


@functools.lru_cache(maxsize=None)
def _compiled(model):
  return jax.jit(functools.partial(model.apply, train=False))


def _apply(trained, images, variables=None):
  """``trained.apply(images)`` (``model.apply(variables, images, train=False)``) compiled as one
  program, once per model (~0.5 s; unjitted, op by op, 2-3 s)."""
  return _compiled(trained.model)(trained.variables if variables is None else variables, images)


def _fields(trained):
  return {k: trained.config.model.get(k) for k in COMPARED}


def _kept(name):
  return [f for f in FORMATS if f not in CASES[name][2]]


def _segments(kept):
  """``CIRCUITS[len(kept)]`` cut where it first comes back to the ``.npz``: a round trip through
  every kept format, then the other ordered pairs (another circuit from the ``.npz``; none for
  two formats)."""
  circuit = CIRCUITS[len(kept)]
  cut = circuit.index(0, 1)
  return circuit[:cut + 1], circuit[cut:]


def _through(name, segment, tmp_path, capsys):
  """``name``'s source into the official .npz (every chain starts there), then through the
  formats of ``_segments``' ``segment`` (0: the round trip, after the refusals; 1: the other
  pairs), its kept fields compared after every step and its logits at the end with the
  golden ones."""
  source, sets, refused = CASES[name]
  images, logits = _golden(name)
  headless = name in HEADLESS
  first = _dst(tmp_path, 0, 'npz')
  assert _convert(str(ECOSYSTEM / source), first, 'npz', sets) == 0
  size = IMAGE_SIZE.get(name)
  reference = _fields(_load(first, headless, size))
  capsys.readouterr()
  for fmt, words in refused.items() if segment == 0 else ():
    # Refused by name, naming the field and who keeps it.
    assert _convert(first, _dst(tmp_path, 'refused', fmt), fmt, size=size) == 2
    err = capsys.readouterr().err
    assert err.startswith('FATAL: The model cannot be written as a'), err
    for word in words + ['Orbax directory or an .npz']:
      assert word in err, (word, err)
  kept = _kept(name)
  path, fmt = first, 'npz'
  for step, index in enumerate(_segments(kept)[segment][1:], 1):
    target = _dst(tmp_path, step, kept[index])
    assert _convert(path, target, kept[index], size=size) == 0, capsys.readouterr().err
    trained = _load(target, headless, size)
    assert _fields(trained) == reference, (fmt, '->', kept[index])
    path, fmt = target, kept[index]
  np.testing.assert_allclose(np.asarray(_apply(trained, images)), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('name', sorted(CASES))
def test_every_fixture_keeps_its_logits_through_a_round_trip_of_its_formats(
    name, tmp_path, capsys):
  """.npz -> each other kept format in turn -> .npz (with two kept formats: every pair), the
  others refused by name."""
  _through(name, 0, tmp_path, capsys)


#: Fixtures whose every pair of formats the fast tier takes (four formats, and three with a
#: refusal); the other fixtures' other pairs are the full suite's.
EVERY_PAIR_FAST = ('timm_vit', 'big_vision_map_scanned')


@pytest.mark.parametrize('name', [
    pytest.param(name, marks=() if name in EVERY_PAIR_FAST else pytest.mark.slow)
    for name in sorted(CASES) if len(_segments(_kept(name))[1]) > 1])
def test_every_fixture_keeps_its_logits_through_every_pair_of_formats(name, tmp_path, capsys):
  """With the round trip above, every ordered pair of the kept formats (an Euler circuit)."""
  _through(name, 1, tmp_path, capsys)


def _ambiguous_timm_file(directory):
  """timm's DINOv2-with-registers fixture (4 registers, ``no_embed_class``) with its 2x2 table
  resampled as timm does (bicubic, antialiased) to the 3x3 grid of 42 px images: 9 rows, which
  also read as the class-token and 4 register rows then a 2x2 grid (28 px)."""
  tensors = archive.read_safetensors(str(ECOSYSTEM / 'timm_dinov2_reg4' / 'model.safetensors'))
  tensors['pos_embed'] = resample.resample_posemb(
      np.asarray(tensors['pos_embed'], np.float32), (3, 3), num_prefix_tokens=0,
      method=timm_vit.POSEMB_RESIZE).astype(np.float32)
  assert tensors['pos_embed'].shape == (1, 9, 16)
  path = directory / 'model.safetensors'
  archive.write_safetensors(str(path), tensors)
  return path


def _hub_config(directory, size):
  """timm's Hub config.json (``push_to_hf_hub``'s keys) for ``size`` px images."""
  (directory / 'config.json').write_text(json.dumps({
      'architecture': 'vit_small_patch14_reg4_dinov2', 'num_classes': 0, 'num_features': 16,
      'global_pool': 'token', 'pretrained_cfg': {'input_size': [3, size, size]}}))


def test_a_table_that_fits_two_layouts_is_refused_naming_both(tmp_path):
  path = _ambiguous_timm_file(tmp_path)
  for read in (lambda: checkpoint.model_fields(path, num_heads=2),
               lambda: inference.load(path, num_classes=0, overrides={'num_heads': 2})):
    with pytest.raises(vit_shapes.AmbiguousTableError) as e:
      read()
    for words in ('9 rows', '5 class-token and register rows then a 2x2 grid (28 px',
                  'a 3x3 grid alone (42 px', '--config.model.no_embed_class', 'config.json'):
      assert words in str(e.value), (words, str(e.value))
  # Stated, the field settles it: exact at 42 px (timm's outputs).
  golden = np.load(ECOSYSTEM / 'timm_dinov2_reg4' / 'golden.npz')
  trained = inference.load(path, num_classes=0, overrides={'num_heads': 2, 'no_embed_class': True})
  assert trained.image_size == 42
  np.testing.assert_allclose(np.asarray(_apply(trained, golden['images_42'])),
                             golden['logits_42'], rtol=1e-5, atol=1e-5)
  # A transformers config.json (no timm 'architecture') settles nothing.
  (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'vit', 'image_size': 42}))
  with pytest.raises(vit_shapes.AmbiguousTableError):
    checkpoint.model_fields(path, num_heads=2)
  # The same table in an .npz without the JSON file beside it: refused as well.
  _hub_config(tmp_path, 42)
  assert convert.main([str(path), str(tmp_path / 'p.npz'), '--set', 'num_heads=2']) == 0
  assert checkpoint.model_fields(tmp_path / 'p.npz')['no_embed_class'] is True
  pathlib.Path(npz.fields_path(tmp_path / 'p.npz')).unlink()
  with pytest.raises(vit_shapes.AmbiguousTableError, match='fit two layouts'):
    checkpoint.model_fields(tmp_path / 'p.npz')


@pytest.mark.parametrize('size', [42, 28])
def test_a_config_json_beside_the_weights_settles_the_layout(tmp_path, size):
  path = _ambiguous_timm_file(tmp_path)
  _hub_config(tmp_path, size)
  fields = checkpoint.model_fields(path, num_heads=2)
  assert (fields.pop('image_size'), fields.get('no_embed_class', False)) == (size, size == 42)
  assert fields['num_registers'] == 4
  if size == 28:  # The other reading: the class-token and register rows first, 2x2.
    return
  golden = np.load(ECOSYSTEM / 'timm_dinov2_reg4' / 'golden.npz')
  trained = inference.load(path, num_classes=0, overrides={'num_heads': 2})
  assert trained.image_size == 42 and trained.config.model.no_embed_class
  np.testing.assert_allclose(np.asarray(_apply(trained, golden['images_42'])),
                             golden['logits_42'], rtol=1e-5, atol=1e-5)


def test_transformers_resize_is_recorded_and_kept_through_every_format(tmp_path, capsys):
  """transformers resamples its table as ``F.interpolate(mode='bicubic', align_corners=False)``
  (``ViTEmbeddings.interpolate_pos_encoding``): 'bicubic', which tests/models/
  test_any_resolution.py checks against torch's (timm's ``antialias=False`` resize). Before,
  the field was not recorded and a transformers checkpoint at 48 px took the official bilinear
  resize (its logits 3.6e-3 off here)."""
  source = ECOSYSTEM / 'hf_vit_v4'
  assert checkpoint.model_fields(source)['posemb_resize'] == hf_vit.POSEMB_RESIZE == 'bicubic'
  trained = inference.load(source, image_size=48)
  assert trained.config.model.posemb_resize == 'bicubic'
  images = np.random.default_rng(0).uniform(-1, 1, (2, 48, 48, 3)).astype(np.float32)
  logits = np.asarray(_apply(trained, images))
  # The same as the table resampled once by torch's bicubic, applied at 48 px.
  native = inference.load(source)
  variables = jax.tree.map(np.array, native.variables)
  entry = variables['params']['Transformer']['posembed_input']
  entry['pos_embedding'] = resample.resample_posemb(entry['pos_embedding'], (6, 6),
                                                    num_prefix_tokens=1, method='bicubic')
  np.testing.assert_allclose(logits, np.asarray(_apply(native, images, variables)),
                             rtol=0, atol=1e-5)
  bilinear = inference.load(source, image_size=48,
                            overrides={'posemb_resize': 'linear_corners'})
  assert np.abs(np.asarray(_apply(bilinear, images)) - logits).max() > 1e-3
  # Every format keeps it: .npz, Orbax, transformers, and each read back.
  path = str(source)
  for step, fmt in enumerate(('npz', 'orbax', 'hf', 'npz')):
    target = _dst(tmp_path, step, fmt)
    assert _convert(path, target, fmt) == 0, capsys.readouterr().err
    assert checkpoint.model_fields(target)['posemb_resize'] == 'bicubic', (step, fmt)
    np.testing.assert_allclose(np.asarray(_apply(inference.load(target, image_size=48), images)),
                               logits, rtol=0, atol=1e-5)
    path = target
  assert 'note:' not in capsys.readouterr().err  # transformers resizes as the model does.


def test_a_library_that_resizes_otherwise_keeps_the_field_and_says_so(tmp_path, capsys):
  """timm's table written for transformers (which resizes by 'bicubic', not timm's antialiased
  bicubic) and an official one (bilinear) for timm: the file keeps the model's resize for
  vit_jax, which reads it back over the library's, and the conversion says the library
  ignores it; timm's own resize written back to timm says nothing."""
  timm_file = str(ECOSYSTEM / 'timm_vit' / 'model.safetensors')
  cases = ((timm_file, HEADS4, 'hf', 'bicubic_antialias', 'bicubic'),
           (str(FIXTURES / 'vit_tiny' / 'params.npz'), [], 'timm', 'linear_corners',
            'bicubic_antialias'))
  for step, (source, sets, fmt, ours, theirs) in enumerate(cases):
    target = _dst(tmp_path, step, fmt)
    assert _convert(source, target, fmt, sets) == 0
    err = capsys.readouterr().err
    assert (f"resizes its position table to another input size by {theirs!r}, this model by "
            f"posemb_resize={ours!r}: the file keeps {ours!r} for vit_jax") in err, err
    assert checkpoint.model_fields(target, num_heads=4)['posemb_resize'] == ours
  assert _convert(timm_file, _dst(tmp_path, 'back', 'timm'), 'timm', HEADS4) == 0
  assert 'note:' not in capsys.readouterr().err
