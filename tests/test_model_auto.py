"""`--config.model_name=auto` (the ViT the weights of `init_from` record), the refusals of
weights that do not fit the config, and the fine-tuning regime's recipe (issue 52, item 1;
docs/checkpoints.md "The architecture from the weights")."""

import os
import subprocess
import sys

import numpy as np
import pytest

from configs import fashion_mnist
from tests import sharding_worker
from vit_jax.config import resolution
from vit_jax.config.keys import ConfigError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ecosystem")
DEIT3 = os.path.join(FIXTURES, "timm_deit3", "model.safetensors")
DINOV2 = os.path.join(FIXTURES, "timm_dinov2", "model.safetensors")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(arg="vit", **top):
  config = fashion_mnist.get_config(arg)
  config.unlock()
  config.total_steps = 30
  config.update(top)
  return config


def _resolve(config):
  return resolution.resolve(config, num_train_examples=60_000, num_classes=10)


def test_auto_takes_the_deit3_fields_from_the_weights():
  config = _config(model_name="auto", init_from=DEIT3, regime="finetune")
  config.model.num_heads = 2  # A timm file at width 16 does not record its heads.
  resolved = _resolve(config)
  model = resolved.model
  assert resolved.model_name == "ViT-custom"
  assert (model.patch_size, model.hidden_size, model.num_layers, model.mlp_dim,
          model.num_heads) == ((8, 8), 16, 2, 32, 2)
  assert (model.layerscale_init, model.no_embed_class, model.num_registers) == (1e-5, True, 0)
  assert (model.gelu_approximate, model.layer_norm_epsilon) == (False, 1e-6)
  assert resolved.num_classes == 10  # The data's; the head is replaced.
  assert resolved.data.image_size == 32  # 28 is not a multiple of patch 8: the weights' size.


def test_auto_takes_the_dinov2_fields_and_keeps_a_fitting_image_size():
  config = _config(model_name="auto", init_from=DINOV2, regime="finetune")
  config.model.num_heads = 2
  config.data.image_size = 56  # Another resolution than the weights' 42 px.
  model = _resolve(config).model
  assert (model.patch_size, model.hidden_size, model.layerscale_init,
          model.no_embed_class) == ((14, 14), 16, 1e-5, False)
  assert _resolve(config).data.image_size == 56


@pytest.mark.parametrize("heads", [None, 3])
def test_auto_asks_for_heads_the_file_does_not_record(heads):
  config = _config("t2t" if heads is None else "vit", model_name="auto", init_from=DEIT3)
  if heads is not None:
    config.model.num_heads = heads  # Does not divide the width, 16.
  with pytest.raises(ConfigError) as e:
    _resolve(config)
  assert e.value.key == "model.num_heads"
  assert "does not record its attention heads (width 16" in str(e.value)
  assert "--config.model.num_heads=N" in str(e.value)


def test_vit_config_auto_reads_the_weights_and_never_a_placeholders_heads():
  from configs import vit  # pylint: disable=g-import-not-at-top
  config = vit.get_config("auto,fashion_mnist_local,finetune")
  assert config.model.get_type("num_heads") is int  # So --config.model.num_heads=N parses.
  config.unlock()
  config.update(init_from=DINOV2, batch_size=8)
  config.data.image_size = 56
  with pytest.raises(ConfigError) as e:
    _resolve(config)
  assert (e.value.key, e.value.value) == ("model.num_heads", None)
  config.model.num_heads = 2
  resolved = _resolve(config)
  assert (resolved.model.hidden_size, resolved.model.patch_size, resolved.optim.lr) == (
      16, (14, 14), 0.03)


def test_tools_take_model_auto_as_the_weights_model():
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  loaded = inference.load(DEIT3, model_name="auto", overrides={"num_heads": 2})
  model = loaded.config.model
  assert (loaded.config.model_name, model.hidden_size, model.no_embed_class,
          model.layerscale_init, loaded.num_classes) == ("ViT-custom", 16, True, 1e-5, 3)


def test_auto_needs_init_from():
  with pytest.raises(ConfigError) as e:
    _resolve(_config(model_name="auto"))
  assert e.value.key == "model_name"


def test_a_named_model_that_does_not_fit_the_weights_is_the_mismatch_report():
  config = _config(init_from=DEIT3)  # ViT-custom D=96, 4 layers, patch 7; heads 6 would crash.
  config.model.num_heads = 6
  with pytest.raises(ConfigError) as e:
    _resolve(config)
  text = str(e.value)
  assert e.value.key == "init_from"
  # The patch size is not compared: another one resizes the patch embedding (FlexiViT).
  assert "field mismatches (5): model.hidden_size: weights 16, config 96; " in text
  assert "patch_size" not in text.split("field mismatches")[1]
  assert "model.no_embed_class: weights True, config False" in text
  assert "--config.model_name=auto" in text


def test_a_fitting_named_model_resolves():
  config = _config(init_from=DEIT3, regime="finetune")
  config.model.update(patch_size=(8, 8), hidden_size=16, num_layers=2, mlp_dim=32, num_heads=2,
                      layerscale_init=1e-5, no_embed_class=True)
  config.data.image_size = 32
  assert _resolve(config).model.hidden_size == 16


def test_finetune_regime_replaces_the_files_pretraining_recipe():
  resolved = _resolve(_config(regime="finetune"))
  optim = resolved.optim
  assert (optim.optimizer, optim.lr, optim.weight_decay, optim.schedule) == (
      "sgd", 0.03, 0.0, "cosine")
  assert optim.warmup_steps == 3  # The regime's 500 lowered to a tenth of the 30 steps.
  kept = _resolve(_config(regime="finetune", recipe_regime="finetune", total_steps=300)).optim
  assert (kept.optimizer, kept.lr, kept.weight_decay, kept.warmup_steps) == (
      "sgd", 2e-3, 0.05, 200)  # Stated to be chosen for fine-tuning: kept.
  # What the command line set is kept (python -m vit_jax.main passes its --config.* flags).
  config = _config(regime="finetune", total_steps=300)
  config.optim.lr = 0.5
  given = _resolve(resolution.switch_regime(config, given=["optim.lr"])).optim
  assert (given.optimizer, given.lr, given.weight_decay) == ("sgd", 0.5, 0.0)
  pretrain = _resolve(_config(total_steps=300)).optim
  assert (pretrain.optimizer, pretrain.lr, pretrain.weight_decay, pretrain.warmup_steps) == (
      "adamw", 2e-3, 0.05, 200)


def _main(workdir, *flags):
  """`python -m vit_jax.main` on Fashion-MNIST; its train losses.

  The data: the first 3,840 training images (the 30 batches of 128 the runs take; not all 60,000
  decoded into the config's cache) and 256 test images for the final evaluation, which no test
  reads (was the whole splits: 25 s more CPU per run)."""
  command = [sys.executable, "-m", "vit_jax.main", "--config", "configs/fashion_mnist.py",
             *flags, "--config.log_every_steps=5", "--config.eval_every_steps=1000",
             "--config.data.train_split=train[:3840]", "--config.data.eval_split=test[:256]",
             f"--workdir={workdir}"]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stderr, sharding_worker.train_losses(str(workdir))


@pytest.mark.slow
def test_acceptance_finetunes_deit3_with_model_auto(tmp_path):
  """Issue 52's acceptance command: no model field but the heads the file cannot record."""
  log, losses = _main(tmp_path / "w", "--config.regime=finetune", "--config.model_name=auto",
                      f"--config.init_from={DEIT3}", "--config.model.num_heads=2",
                      "--config.total_steps=30")
  assert "replaced by the 'finetune' recipe" in log
  assert sorted(losses) == [5, 10, 15, 20, 25, 30]
  assert losses[30] < losses[5], losses


@pytest.mark.slow
@pytest.mark.parametrize("weights", [DINOV2, DEIT3])
def test_docs_example_finetunes_at_another_resolution_with_layer_decay(tmp_path, weights):
  """docs/checkpoints.md's example on the fixtures (heads named: 16 wide; a lr for that width)."""
  size = 56 if weights == DINOV2 else 48  # Weights' 42 and 32 px.
  log, losses = _main(
      tmp_path / "w", "--config.regime=finetune", "--config.model_name=auto",
      f"--config.init_from={weights}", "--config.model.num_heads=2",
      f"--config.data.image_size={size}", "--config.optim.layer_decay=0.75",
      "--config.optim.lr=1.0",
      "--config.optim.weight_decay=0", "--config.optim.warmup_steps=3",
      "--config.total_steps=30")
  assert "layer decay" in log.lower() or "layer_decay" in log
  assert np.mean([losses[25], losses[30]]) < losses[5] - 0.05, losses


def test_vit_config_custom_takes_its_fields_as_flags():
  """configs/vit.py:ViT-custom,... builds (its five fields None until given), then resolves."""
  from configs import vit  # pylint: disable=g-import-not-at-top
  config = vit.get_config("ViT-custom,fashion_mnist_local,finetune")
  config.unlock()
  assert config.model.hidden_size is None and config.model.patch_size is None
  with pytest.raises(ValueError, match="patch_size must be an int or a .height, width. pair, "
                     "got None"):
    _resolve(config)
  config.model.update(patch_size=(7, 7), hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32)
  config.update(batch_size=8, total_steps=2)
  config.data.image_size = 28
  config.optim.warmup_steps = 1
  assert _resolve(config).model.hidden_size == 16


def test_main_asks_for_heads_rather_than_take_the_config_files(tmp_path):
  """Under auto the file's num_heads (4, chosen for its own ViT) is not a guess for the weights'
  (2): only a --config.model.num_heads flag is taken; nothing is written before the question."""
  workdir = tmp_path / "w"
  done = subprocess.run(
      [sys.executable, "-m", "vit_jax.main", "--config", "configs/fashion_mnist.py",
       "--config.model_name=auto", f"--config.init_from={DEIT3}", f"--workdir={workdir}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 2, done.stderr[-2000:]
  assert "does not record its attention heads" in done.stderr
  assert "set --config.model.num_heads=N (N divides 16" in done.stderr
  assert not workdir.exists()
