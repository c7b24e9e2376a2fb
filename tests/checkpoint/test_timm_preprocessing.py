"""The evaluation preprocessing of a timm file (issue 52): taken from timm's Hub config.json
beside it (``pretrained_cfg`` mean, std and crop_pct), kept by every conversion, refused where
it has no equivalent, and named in one warning where nothing records it. Before, every timm
file was evaluated as the ViT paper's (pixels in [-1, 1]), DeiT III and DINOv2 too, which
timm evaluates with ImageNet's mean and std."""

import json
import logging
import pathlib
import shutil

import numpy as np
from PIL import Image
import pytest

from vit_jax import checkpoint
from vit_jax import inference
from vit_jax.checkpoint import timm_vit
from vit_jax.tools import convert
from vit_jax.tools import predict

ECOSYSTEM = pathlib.Path(__file__).resolve().parents[1] / 'fixtures' / 'ecosystem'
DEIT3 = ECOSYSTEM / 'timm_deit3' / 'model.safetensors'
HEADS = {'num_heads': 2}
#: timm's Hub config.json of a DeiT III (push_to_hf_hub's keys; the fixture's 32 px).
IMAGENET_CFG = {'input_size': [3, 32, 32], 'interpolation': 'bicubic', 'crop_pct': 1.0,
                'crop_mode': 'center', 'mean': [0.485, 0.456, 0.406],
                'std': [0.229, 0.224, 0.225]}
#: OpenAI CLIP's mean and std (timm's OPENAI_CLIP_MEAN / _STD): no equivalent here.
CLIP_CFG = dict(IMAGENET_CFG, mean=[0.48145466, 0.4578275, 0.40821073],
                std=[0.26862954, 0.26130258, 0.27577711])
#: The start of timm_vit.ASSUMED_PREPROCESSING.
ASSUMED = "nothing records this timm file's preprocessing"


def _timm_file(directory, pretrained_cfg=None):
  """The DeiT III fixture in ``directory``, with timm's config.json beside it when given."""
  path = directory / 'model.safetensors'
  shutil.copy(DEIT3, path)
  if pretrained_cfg is not None:
    (directory / 'config.json').write_text(json.dumps({
        'architecture': 'deit3_small_patch16_224', 'num_classes': 3, 'num_features': 16,
        'global_pool': 'token', 'pretrained_cfg': pretrained_cfg}))
  return path


def _assumed(caplog):
  return [r for r in caplog.records if ASSUMED in r.getMessage()]


def _preprocessing(trained):
  return trained.config.data.normalization, trained.config.data.eval_crop_pct


def test_a_timm_config_json_states_the_preprocessing_and_conversions_keep_it(tmp_path, capsys,
                                                                             caplog):
  path = _timm_file(tmp_path, IMAGENET_CFG)
  with caplog.at_level(logging.WARNING):
    assert _preprocessing(inference.load(path, overrides=HEADS)) == ('imagenet', 1.0)
  assert not _assumed(caplog)
  # .npz, Orbax, timm (this project's metadata), .npz: each read back with it.
  source = str(path)
  for step, dst in enumerate(('a.npz', 'b_orbax', 'c.safetensors', 'd.npz')):
    target = str(tmp_path / dst)
    args = [source, target] + (['--to', 'timm'] if dst.endswith('.safetensors') else [])
    assert convert.main(args + ['--set', 'num_heads=2']) == 0, capsys.readouterr().err
    assert _preprocessing(inference.load(target)) == ('imagenet', 1.0), (step, dst)
    source = target
  assert not _assumed(caplog)
  # The timm call printed states it as well (timm's resolve_model_data_config reads it).
  out = capsys.readouterr().out
  assert ("crop_pct=1.0, interpolation='bicubic', mean=(0.485, 0.456, 0.406), "
          'std=(0.229, 0.224, 0.225))') in out, out


def test_timm_inception_mean_and_std_are_pixels_in_minus_one_to_one(tmp_path):
  cfg = dict(IMAGENET_CFG, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5], crop_pct=0.9)
  path = _timm_file(tmp_path, cfg)
  assert _preprocessing(inference.load(path, overrides=HEADS)) == ('minus_one_to_one', 0.9)


def test_without_a_config_the_paper_preprocessing_is_named_in_one_warning(tmp_path, capsys,
                                                                          caplog):
  path = _timm_file(tmp_path)
  with caplog.at_level(logging.WARNING):
    assert _preprocessing(inference.load(path, overrides=HEADS)) == ('minus_one_to_one', None)
  (record,) = _assumed(caplog)
  assert record.getMessage() == timm_vit.ASSUMED_PREPROCESSING.format(path=path)
  for words in ('pixels in [-1, 1]', "ImageNet's mean and std", 'config.json',
                'hf-hub:timm/NAME'):
    assert words in record.getMessage(), words
  # predict: the same line, once.
  caplog.clear()
  image = tmp_path / 'image.png'
  Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
  with caplog.at_level(logging.WARNING):
    assert predict.main([str(path), str(image), '--set', 'num_heads=2', '--top-k', '1']) == 0
  assert len(_assumed(caplog)) == 1
  capsys.readouterr()
  # A timm config.json without a mean and std records nothing either.
  (tmp_path / 'config.json').write_text(json.dumps({'architecture': 'deit3_small_patch16_224'}))
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert _preprocessing(inference.load(path, overrides=HEADS)) == ('minus_one_to_one', None)
  assert len(_assumed(caplog)) == 1


@pytest.mark.parametrize('cfg, words', [
    (CLIP_CFG, 'pretrained_cfg mean [0.48145466, 0.4578275, 0.40821073] and std '
               '[0.26862954, 0.26130258, 0.27577711] have no equivalent'),
    (dict(IMAGENET_CFG, crop_mode='squash'), "crop_pct 1.0 with crop_mode 'squash' has no "
                                             'equivalent here'),
])
def test_preprocessing_without_an_equivalent_is_refused_by_name(tmp_path, capsys, cfg, words):
  path = _timm_file(tmp_path, cfg)
  with pytest.raises(ValueError, match='config.json: ') as e:
    inference.load(path, overrides=HEADS)
  assert words in str(e.value), str(e.value)
  assert convert.main([str(path), str(tmp_path / 'p.npz'), '--set', 'num_heads=2']) == 2
  assert words in capsys.readouterr().err
  # The weights themselves still read (fine-tuning does not use the preprocessing).
  assert checkpoint.model_fields(path, num_heads=2)['layerscale_init'] == 1e-5
