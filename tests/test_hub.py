"""Hub names, ``hf-hub:ORG/NAME[@REVISION]`` (issue 52, item 4): read offline from a Hugging
Face cache laid out as huggingface_hub writes it, with the files of tests/fixtures/ecosystem
(a timm DINOv2 and a transformers ViT); a name the cache lacks is one FATAL line naming the
download command."""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import huggingface_hub
from huggingface_hub import constants
import jax
import ml_collections
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import hub
from vit_jax import inference
from vit_jax import models
from vit_jax import storage
from vit_jax.checkpoint import flatten_params
from vit_jax.config import resolution

ROOT = pathlib.Path(__file__).resolve().parents[1]
ECOSYSTEM = ROOT / 'tests' / 'fixtures' / 'ecosystem'
TIMM_REPO = 'timm/vit_small_patch14_dinov2.lvd142m'
HF_REPO = 'google/vit-tiny-fixture'
COMMIT = 'a' * 40
OTHER_COMMIT = 'b' * 40
#: The fields of the timm_dinov2 fixture (tests/checkpoint/test_ecosystem_variants.py), 42 px.
DINOV2 = dict(hidden_size=16, num_layers=2, num_heads=2, mlp_dim=32, representation_size=None,
              posemb='learn', layer_norm_epsilon=1e-6, gelu_approximate=False, patch_size=14,
              classifier='token', num_classes=3, layerscale_init=1e-5)
#: A timm Hub config.json for it, as timm's push_to_hf_hub writes one (architecture,
#: pretrained_cfg).
TIMM_CONFIG = {
    'architecture': 'vit_small_patch14_dinov2', 'num_classes': 3, 'num_features': 16,
    'global_pool': 'token',
    'pretrained_cfg': {'tag': 'lvd142m', 'input_size': [3, 42, 42], 'fixed_input_size': True,
                       'interpolation': 'bicubic', 'crop_pct': 1.0, 'crop_mode': 'center',
                       'mean': [0.485, 0.456, 0.406], 'std': [0.229, 0.224, 0.225],
                       'num_classes': 3, 'first_conv': 'patch_embed.proj',
                       'classifier': 'head'}}


def _blob_name(data: bytes, lfs: bool) -> str:
  """The blob's name in the cache: its etag, an LFS file's sha256, else its git blob sha1."""
  if lfs:
    return hashlib.sha256(data).hexdigest()
  return hashlib.sha1(b'blob %d\0' % len(data) + data).hexdigest()


def lay_out(cache: pathlib.Path, repo: str, files: dict, commit: str = COMMIT,
            ref: str = 'main') -> pathlib.Path:
  """Writes ``files`` ({name: bytes}) of the model ``repo`` at ``commit`` into the cache
  ``cache`` as huggingface_hub's hf_hub_download does (file_download.py: blobs named by etag,
  snapshot entries relative symbolic links to them, refs/<ref> holding the commit, no newline);
  returns the snapshot directory."""
  folder = cache / ('models--' + repo.replace('/', '--'))
  snapshot = folder / 'snapshots' / commit
  for name, data in files.items():
    blob = folder / 'blobs' / _blob_name(data, lfs=name.endswith('.safetensors'))
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = snapshot / name
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(blob, link.parent), link)
  (folder / 'refs').mkdir(exist_ok=True)
  (folder / 'refs' / ref).write_text(commit)
  return snapshot


def _timm_files(name='timm_dinov2', config=None):
  return {'model.safetensors': (ECOSYSTEM / name / 'model.safetensors').read_bytes(),
          'config.json': json.dumps(config or TIMM_CONFIG, indent=2).encode()}


def _hf_files():
  return {name: (ECOSYSTEM / 'hf_vit_model' / name).read_bytes()
          for name in ('config.json', 'model.safetensors')}


@pytest.fixture(name='cache')
def _cache(tmp_path, monkeypatch):
  """An empty Hugging Face cache, offline (what HF_HUB_CACHE and HF_HUB_OFFLINE=1 set)."""
  cache = tmp_path / 'hub'
  cache.mkdir()
  monkeypatch.setattr(constants, 'HF_HUB_CACHE', str(cache))
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
  return cache


def test_the_cache_laid_out_here_is_the_one_huggingface_hub_reads(cache):
  snapshot = lay_out(cache, TIMM_REPO, _timm_files())
  assert huggingface_hub.snapshot_download(TIMM_REPO, local_files_only=True) == str(snapshot)
  path = huggingface_hub.hf_hub_download(TIMM_REPO, 'model.safetensors', local_files_only=True)
  assert path == str(snapshot / 'model.safetensors')
  assert pathlib.Path(path).read_bytes() == (ECOSYSTEM / 'timm_dinov2' /
                                             'model.safetensors').read_bytes()
  info = huggingface_hub.scan_cache_dir(cache)  # Raises on a layout it does not know.
  assert not info.warnings
  (repo,) = info.repos
  assert (repo.repo_id, repo.repo_type, repo.refs.keys()) == (TIMM_REPO, 'model', {'main'})
  (revision,) = repo.revisions
  assert revision.commit_hash == COMMIT
  assert sorted(f.file_name for f in revision.files) == ['config.json', 'model.safetensors']
  assert revision.size_on_disk == sum(len(d) for d in _timm_files().values())


def test_a_timm_hub_name_reads_as_its_file_with_the_golden_logits(cache):
  snapshot = lay_out(cache, TIMM_REPO, _timm_files())
  name = f'hf-hub:{TIMM_REPO}'
  assert storage.normalize(name) == str(snapshot / 'model.safetensors')
  assert checkpoint.open(name).name == 'timm'
  fields = checkpoint.model_fields(name, num_heads=2)
  assert fields.pop('image_size') == 42
  assert fields.pop('posemb_resize') == 'bicubic_antialias'
  assert fields == DINOV2
  model = models.create('ViT-custom', **DINOV2)
  variables = checkpoint.load(name, model=model)
  golden = np.load(ECOSYSTEM / 'timm_dinov2' / 'golden.npz')
  logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, golden['images'])
  np.testing.assert_allclose(np.asarray(logits), golden['logits'], rtol=0, atol=1e-5)


def test_a_transformers_hub_name_reads_as_its_directory(cache):
  snapshot = lay_out(cache, HF_REPO, _hf_files())
  name = f'hf-hub:{HF_REPO}'
  assert storage.normalize(name) == str(snapshot)
  assert checkpoint.open(name).name == 'hf'
  local = ECOSYSTEM / 'hf_vit_model'
  assert checkpoint.model_fields(name) == checkpoint.model_fields(local)
  ours = flatten_params(checkpoint.open(name).read()['params'])
  theirs = flatten_params(checkpoint.open(local).read()['params'])
  assert ours.keys() == theirs.keys() and len(ours) > 10
  for key, value in theirs.items():
    np.testing.assert_array_equal(ours[key], value, err_msg=key)


def test_inference_loads_a_hub_name_with_the_golden_outputs(cache):
  lay_out(cache, HF_REPO, _hf_files())
  trained = inference.load(f'hf-hub:{HF_REPO}', num_classes=0)  # No head: the features.
  golden = np.load(ECOSYSTEM / 'hf_vit_model' / 'golden.npz')  # A ViTModel: its pooler output.
  np.testing.assert_allclose(np.asarray(trained.apply(golden['images'])),
                             golden['pooler_output'], rtol=0, atol=1e-5)


def test_a_revision_picks_its_snapshot(cache):
  main = lay_out(cache, TIMM_REPO, _timm_files())
  tagged = lay_out(cache, TIMM_REPO, _timm_files('timm_vit', dict(TIMM_CONFIG, num_classes=5)),
                   commit=OTHER_COMMIT, ref='v1')
  assert storage.normalize(f'hf-hub:{TIMM_REPO}') == str(main / 'model.safetensors')
  assert storage.normalize(f'hf-hub:{TIMM_REPO}@v1') == str(tagged / 'model.safetensors')
  assert storage.normalize(f'hf-hub:{TIMM_REPO}@{COMMIT}') == str(main / 'model.safetensors')
  assert checkpoint.model_fields(f'hf-hub:{TIMM_REPO}@v1', num_heads=4)['patch_size'] == 8


def test_timm_weights_are_chosen_as_timm_chooses_them(cache):
  files = _timm_files()
  files['pytorch_model.bin'] = b'not read: model.safetensors comes first'
  snapshot = lay_out(cache, TIMM_REPO, files)
  assert hub.resolve(f'hf-hub:{TIMM_REPO}') == str(snapshot / 'model.safetensors')
  open_clip = dict(TIMM_CONFIG, pretrained_cfg=dict(TIMM_CONFIG['pretrained_cfg'],
                                                    hf_hub_filename='open_clip_pytorch_model.bin'))
  files = _timm_files(config=open_clip)
  files['open_clip_model.safetensors'] = files.pop('model.safetensors')
  snapshot = lay_out(cache, 'timm/open-clip-tower', files)
  assert hub.resolve('hf-hub:timm/open-clip-tower') == str(
      snapshot / 'open_clip_model.safetensors')


@pytest.mark.parametrize('name, command', [
    (f'hf-hub:{TIMM_REPO}', f'hf download {TIMM_REPO}'),
    (f'hf-hub:{TIMM_REPO}@v2', f'hf download {TIMM_REPO} --revision v2'),
])
def test_a_name_not_in_the_cache_offline_names_the_download_command(cache, name, command):
  with pytest.raises(FileNotFoundError) as e:
    storage.normalize(name)
  assert str(e.value) == (
      f'{name} is not in the Hugging Face cache ({cache}: no config.json) and HF_HUB_OFFLINE is '
      f'set: download it first, on a machine with a network: {command} (HF_HOME or '
      'HF_HUB_CACHE names the cache).')


def test_weights_missing_from_the_cache_name_the_download_command(cache):
  files = _timm_files()
  del files['model.safetensors']
  lay_out(cache, TIMM_REPO, files)  # config.json only: an interrupted download.
  with pytest.raises(FileNotFoundError, match=(
      r'not in the Hugging Face cache \(.*: no model.safetensors\) and HF_HUB_OFFLINE is set: '
      rf'download it first, on a machine with a network: hf download {TIMM_REPO} \(')):
    hub.resolve(f'hf-hub:{TIMM_REPO}')


@pytest.mark.parametrize('config, problem', [
    (b'{"architecture": ', 'cannot be read as JSON'),
    (b'[' * 100_000 + b']' * 100_000, 'cannot be read as JSON'),  # Deeper than json recurses.
    (b'[1, 2]', 'holds no JSON object')])
def test_a_damaged_config_json_is_one_error_naming_it(cache, config, problem):
  lay_out(cache, TIMM_REPO, {**_timm_files(), 'config.json': config})
  with pytest.raises(ValueError, match=rf'^hf-hub:{TIMM_REPO}: config.json {problem}'):
    hub.resolve(f'hf-hub:{TIMM_REPO}')


@pytest.mark.parametrize('name', ['hf-hub:', 'hf-hub:vit_small', 'hf-hub:a/b/c', 'hf-hub:a/b@',
                                  'hf-hub:a/b@c@d', 'hf-hub:a/../b'])
def test_a_malformed_name_is_refused_with_the_form(name):
  with pytest.raises(ValueError, match=rf"^'{name}' is not a Hub name: write hf-hub:ORG/NAME or "
                     r'hf-hub:ORG/NAME@REVISION \(e\.g\. hf-hub:timm/'):
    storage.normalize(name)


def _config(init_from):
  config = ml_collections.ConfigDict(dict(init_from=init_from, pretrained_dir='',
                                          model=dict(gelu_approximate=True, num_heads=2,
                                                     layer_norm_epsilon=1e-6)))
  return config


def test_the_main_jobs_init_from_takes_a_hub_name(cache):
  lay_out(cache, TIMM_REPO, _timm_files())
  config = _config(f'hf-hub:{TIMM_REPO}')
  resolution._resolve_init_from(config)  # pylint: disable=protected-access
  assert config.init_from == f'hf-hub:{TIMM_REPO}'  # Kept as given (the run's record).
  assert config.model.gelu_approximate is False  # timm's exact GELU, read from the weights.
  with pytest.raises(FileNotFoundError, match=r'hf download timm/other \('):
    resolution._resolve_init_from(_config('hf-hub:timm/other'))  # pylint: disable=protected-access


def _tool(args, home, **hf_env):
  """``python -m ARGS`` with the Hugging Face cache under ``home`` (HF_HOME) and ``hf_env``."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('HF_')}
  env.update(HF_HOME=str(home), JAX_PLATFORMS='cpu', **hf_env)
  return subprocess.run([sys.executable, '-m', *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120, check=False)


@pytest.mark.parametrize('env, why', [
    (dict(HF_HUB_OFFLINE='1'), 'HF_HUB_OFFLINE is set'),
    pytest.param(dict(HF_ENDPOINT='http://127.0.0.1:9'), 'the Hub could not be reached',
                 marks=pytest.mark.slow),  # No network: huggingface_hub retries for 15 s.
])
def test_a_tool_given_a_name_not_in_the_cache_prints_one_fatal_line(tmp_path, env, why):
  proc = _tool(['vit_jax.predict', f'hf-hub:{TIMM_REPO}', 'image.png'], tmp_path, **env)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.splitlines() == [
      f'FATAL: hf-hub:{TIMM_REPO} is not in the Hugging Face cache ({tmp_path}/hub: no '
      f'config.json) and {why}: download it first, on a machine with a network: hf download '
      f'{TIMM_REPO} (HF_HOME or HF_HUB_CACHE names the cache).']


@pytest.mark.slow
def test_convert_reads_a_hub_name_from_the_cache_that_hf_home_names(tmp_path):
  lay_out(tmp_path / 'hub', TIMM_REPO, _timm_files())
  out = tmp_path / 'out.npz'
  proc = _tool(['vit_jax.convert', f'hf-hub:{TIMM_REPO}', str(out), '--set', 'num_heads=2'],
               tmp_path, HF_HUB_OFFLINE='1')
  assert proc.returncode == 0, proc.stderr
  model = models.create('ViT-custom', **DINOV2)
  expected = flatten_params(checkpoint.load(ECOSYSTEM / 'timm_dinov2' / 'model.safetensors',
                                            model=model)['params'])
  written = dict(np.load(out))
  assert written.keys() == expected.keys()
  for key, value in expected.items():
    np.testing.assert_array_equal(written[key], value, err_msg=key)
