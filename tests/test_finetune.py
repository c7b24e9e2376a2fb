"""Fine-tuning from a checkpoint (head reset, T2T table regenerated), EMA, and the converter CLI."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import data_utils
from tests import t2t_fixtures
from vit_jax import checkpoint
from vit_jax import convert
from vit_jax import defaults
from vit_jax import models
from vit_jax import train

FIXTURES = pathlib.Path(__file__).parent / 'fixtures'
ROOT = pathlib.Path(__file__).resolve().parents[1]
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
  return jax.device_get(init(jax.random.PRNGKey(1)))


# ------------------------------------------------------------------------------ init_for_finetuning


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


def test_same_task_finetuning_init_keeps_head_and_logits():
  model = models.create('T2T-ViT-custom', num_classes=10, **_fixture_overrides())
  variables = checkpoint.load_for_finetuning(PERFORMER / 'checkpoint.pth.tar', model,
                                             _init(model, 64))
  np.testing.assert_allclose(_fixture_logits(model, variables),
                             np.load(PERFORMER / 'logits.npy'), rtol=1e-5, atol=1e-5)


def test_finetuning_init_lists_every_mismatch():
  overrides = dict(_fixture_overrides(), depth=3, token_dim=8)
  model = models.create('T2T-ViT-custom', num_classes=3, **overrides)
  with pytest.raises(ValueError) as info:
    checkpoint.load_for_finetuning(PERFORMER / 'checkpoint.pth.tar', model,
                                   _init(models.create('T2T-ViT-custom', num_classes=3,
                                                       **overrides), 64))
  message = str(info.value)  # A PyTorch file: its own names and shapes.
  assert 'missing keys' in message and 'blocks.2.attn.qkv.weight' in message
  assert 'tokens_to_token.attention1.proj.weight: checkpoint (16, 16), model (8, 8)' in message
  assert 'head' not in message  # The head is replaced, not an error.


def test_vit_finetuning_init_resets_head_and_converts_layout():
  saved = checkpoint.load(FIXTURES / 'vit_tiny' / 'params.npz')
  num_classes = saved['params']['head']['kernel'].shape[1]
  config = models.model_config('ViT-custom', **_vit_tiny_fields())
  model = models.create('ViT-custom', num_classes=num_classes + 2, **dict(config, scan=True))
  size = _vit_tiny_image_size()
  fresh = _init(model, size)
  variables = checkpoint.init_for_finetuning(saved, fresh)
  assert models.is_scanned(variables['params'])
  np.testing.assert_array_equal(variables['params']['head']['kernel'],
                                fresh['params']['head']['kernel'])
  unscanned = models.unscan_params(variables['params'])
  np.testing.assert_array_equal(
      unscanned['Transformer']['encoderblock_0']['MlpBlock_0']['Dense_0']['kernel'],
      saved['params']['Transformer']['encoderblock_0']['MlpBlock_0']['Dense_0']['kernel'])
  # A grid the checkpoint's position embedding does not have is an error, not a silent reset;
  # so is a missing parameter. All are listed together.
  del saved['params']['Transformer']['encoder_norm']
  with pytest.raises(ValueError) as info:
    checkpoint.init_for_finetuning(saved, _init(model, size * 2))
  message = str(info.value)
  assert ('params/Transformer/posembed_input/pos_embedding: checkpoint (1, 65, 32), '
          'model (1, 257, 32)') in message
  assert 'missing keys (2): ' in message
  assert {'params/Transformer/encoder_norm/scale', 'params/Transformer/encoder_norm/bias'} <= set(
      message.split('missing keys (2): ')[1].split('\n')[0].split(', '))
  assert 'params/head' not in message


def _vit_tiny_fields():
  """The fixture's model (patch 4, D 32, MLP 64, 2 heads, 2 layers) at 32 x 32 px."""
  return dict(hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2, patch_size=4)


def _vit_tiny_image_size():
  return 32


# ------------------------------------------------------------------------------ training: init_from, EMA


def _folder_config(tmp_path, **overrides):
  folder = data_utils.make_image_folder(str(tmp_path / 'images'), num_classes=3, per_class=4,
                                        size=32)
  config = defaults.get_config('T2T-ViT-custom', 'unused', **_fixture_overrides())
  config.regime = 'finetune'
  config.data.image_folder = folder
  config.data.image_size = 32
  config.data.augment = 'none'
  config.data.normalization = 'imagenet'
  config.batch_size = 4
  config.total_steps = 1
  config.optim.warmup_steps = 0
  config.optim.schedule = 'constant'
  for key, value in overrides.items():
    config[key] = value
  return config


def test_training_from_init_from_with_ema(tmp_path):
  """init_from sets the first parameters; the EMA after one update is d * p0 + (1 - d) * p1."""
  config = _folder_config(tmp_path, init_from=str(PERFORMER / 'checkpoint.pth.tar'),
                          ema_decay=0.25)
  workdir = str(tmp_path / 'workdir')
  results = train.train_and_evaluate(config, workdir)
  assert {'test/accuracy', 'test_ema/accuracy', 'test_ema/loss'} <= set(results)
  model = models.create('T2T-ViT-custom', num_classes=3, **_fixture_overrides())
  p0 = checkpoint.load_for_finetuning(PERFORMER / 'checkpoint.pth.tar', model, _init(model, 32))
  p1 = checkpoint.load(workdir, use_ema=False)
  ema = checkpoint.load(workdir)  # use_ema=True by default.
  kqv = ('tokens_to_token', 'attention1', 'kqv', 'kernel')
  pick = lambda v: v['params'][kqv[0]][kqv[1]][kqv[2]][kqv[3]]
  assert not np.allclose(pick(p1), pick(p0))  # One SGD update happened.
  np.testing.assert_allclose(pick(ema), 0.25 * pick(p0) + 0.75 * pick(p1), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(ema['constants']['tokens_to_token']['attention1']['w'],
                                p0['constants']['tokens_to_token']['attention1']['w'])


def test_init_from_that_does_not_fit_is_a_config_error(tmp_path):
  config = _folder_config(tmp_path, init_from=str(PERFORMER / 'checkpoint.pth.tar'))
  config.model.depth = 3
  with pytest.raises(train.ConfigError, match='missing keys'):
    train.train_and_evaluate(config, str(tmp_path / 'workdir'))
  config.init_from = str(tmp_path / 'nothing_here.npz')
  with pytest.raises(train.ConfigError, match='config.init_from=.*does not exist'):
    train.train_and_evaluate(config, str(tmp_path / 'workdir2'))
  assert not (tmp_path / 'workdir2').exists()


# ------------------------------------------------------------------------------ python -m vit_jax.convert


def _run_convert(*args):
  return subprocess.run([sys.executable, '-m', 'vit_jax.convert', *map(str, args)], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)


def test_convert_pth_to_orbax_reproduces_logits(tmp_path):
  dst = tmp_path / 't2t_orbax'
  sets = [f'--set={k}={v!r}' for k, v in _fixture_overrides().items()]
  run = _run_convert(PERFORMER / 'checkpoint.pth.tar', dst, '--model', 'T2T-ViT-custom', *sets)
  assert run.returncode == 0, run.stderr
  assert 'Wrote Orbax checkpoint' in run.stdout and 'constants:' in run.stdout
  variables = checkpoint.load(dst)
  model = models.create('T2T-ViT-custom', num_classes=10, **_fixture_overrides())
  np.testing.assert_allclose(_fixture_logits(model, variables), np.load(PERFORMER / 'logits.npy'),
                             rtol=1e-5, atol=1e-5)
  # The written directory is a valid init_from: same task, same weights.
  again = checkpoint.load_for_finetuning(dst, model, _init(model, 64))
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
  assert 'missing.npz' in capsys.readouterr().err
