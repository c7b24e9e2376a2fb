"""Tests of the training loop, optimizer, schedules, configs and the `vit_jax.main` entry point."""

import glob
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests import data_utils
from vit_jax import cli
from vit_jax import defaults
from vit_jax import models as models_lib
from vit_jax import optim
from vit_jax import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.py"))
# Every shipped config file with the arguments it is run with in the consumed-keys test.
SHIPPED = [("configs/fashion_mnist.py", None),
           ("configs/fashion_mnist.py", "t2t"),
           ("configs/t2t.py", "14"),
           ("configs/vit.py", "ti16,cifar10"),
           ("configs/vit.py", "b16,imagenet21k"),
           ("configs/vit.py", "b16,imagenet2012,finetune")]


# ----------------------------------------------------------------------------- schedules


def test_cosine_schedule_matches_reference_values():
  base, total, warmup = 0.03, 100, 10
  lr = optim.lr_schedule(base, total, warmup, "cosine")
  # optax counts updates from 0; the reference numbers steps from 1.
  np.testing.assert_allclose(lr(0), base / warmup, rtol=1e-6)  # step 1
  np.testing.assert_allclose(lr(warmup - 1), base, rtol=1e-6)  # end of warmup
  step = 55  # progress = (55 - 10) / 90 = 0.5
  np.testing.assert_allclose(lr(step - 1), base * 0.5 * (1 + math.cos(math.pi * 0.5)), rtol=1e-6)
  np.testing.assert_allclose(lr(total - 1), 0.0, atol=1e-9)  # step = total: zero
  assert float(lr(total + 5)) == pytest.approx(0.0, abs=1e-9)  # clipped afterwards


def test_linear_and_constant_schedules():
  lr = optim.lr_schedule(1e-3, 110, 10, "linear")
  np.testing.assert_allclose(lr(0), 1e-4, rtol=1e-6)
  np.testing.assert_allclose(lr(59), 1e-3 * 0.5, rtol=1e-6)  # step 60: progress 0.5
  np.testing.assert_allclose(lr(109), 0.0, atol=1e-10)
  const = optim.lr_schedule(0.1, 50, 0, "constant")
  np.testing.assert_allclose([const(0), const(49)], [0.1, 0.1], rtol=1e-6)
  with_end = optim.lr_schedule(1.0, 10, 0, "cosine", end_lr=0.1)
  np.testing.assert_allclose(with_end(9), 0.1, rtol=1e-6)


def test_timm_style_warmup_from_init_lr_and_cooldown():
  # T2T-ViT recipe shape: warmup from 1e-6, cosine to end_lr, then a cooldown at end_lr.
  lr = optim.lr_schedule(1e-3, 120, 10, "cosine", 1e-5, warmup_init_lr=1e-6, cooldown_steps=10)
  np.testing.assert_allclose(lr(-1), 1e-6, rtol=1e-6)  # step 0 (before the first update)
  np.testing.assert_allclose(lr(4), 1e-6 + (1e-3 - 1e-6) * 0.5, rtol=1e-6)  # step 5 of 10
  np.testing.assert_allclose(lr(9), 1e-3, rtol=1e-6)
  step = 60  # progress = (60 - 10) / (120 - 10 - 10) = 0.5
  np.testing.assert_allclose(lr(step - 1), 1e-5 + (1e-3 - 1e-5) * 0.5, rtol=1e-6)
  np.testing.assert_allclose([lr(109), lr(115), lr(119)], [1e-5] * 3, rtol=1e-5)  # cooldown


def test_schedule_from_config_scales_lr_and_converts_epochs():
  config = defaults.get_config("T2T-ViT-7", "imagenet2012")
  config.optim.update(lr=5e-4, lr_base_batch_size=512, warmup_epochs=2.0, cooldown_epochs=1.0,
                      schedule="cosine", warmup_init_lr=0.0)
  # 1024 images per batch, 50 updates per epoch: peak 1e-3, warmup 100, cooldown 50 updates.
  lr = optim.schedule_from_config(config.optim, batch_size=1024, total_steps=500,
                                  steps_per_epoch=50)
  np.testing.assert_allclose(lr(99), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(lr(49), 0.5e-3, rtol=1e-6)
  np.testing.assert_allclose(lr(449), 0.0, atol=1e-12)  # decay ends 50 updates early
  config.optim.lr_base_batch_size = 0
  with pytest.raises(ValueError, match="lr_base_batch_size=0 must be positive"):
    optim.schedule_from_config(config.optim, batch_size=8, total_steps=5, steps_per_epoch=1)


def test_schedule_rejects_bad_arguments():
  with pytest.raises(ValueError, match=r"warmup_steps=100 \(\+ cooldown_steps=0\) must be smaller"):
    optim.lr_schedule(0.1, 100, 100, "cosine")
  with pytest.raises(ValueError, match="cooldown_steps=60\\) must be smaller"):
    optim.lr_schedule(0.1, 100, 40, "cosine", cooldown_steps=60)
  with pytest.raises(ValueError, match="Unknown schedule 'step'"):
    optim.lr_schedule(0.1, 100, 0, "step")


# ----------------------------------------------------------------------------- regimes


def _tiny_config(regime="pretrain"):
  config = defaults.get_config("ViT-custom", "fashion_mnist_local", hidden_size=8, mlp_dim=16,
                               num_heads=2, num_layers=1, patch_size=4)
  config.regime = regime
  return config


def test_regime_defaults_follow_the_paper():
  pre = optim.resolve_regime(_tiny_config("pretrain"))
  assert (pre.optim.optimizer, pre.optim.schedule, pre.loss) == ("adamw", "linear", "sigmoid_xent")
  assert (pre.optim.lr, pre.optim.b1, pre.optim.b2, pre.optim.weight_decay) == (1e-3, 0.9, 0.999, 0.1)
  assert pre.model.head_bias_init == -10.0
  fine = optim.resolve_regime(_tiny_config("finetune"))
  assert (fine.optim.optimizer, fine.optim.schedule, fine.loss) == ("sgd", "cosine", "softmax_xent")
  assert (fine.optim.momentum, fine.optim.grad_clip_norm, fine.optim.weight_decay) == (0.9, 1.0, 0.0)
  assert (fine.optim.warmup_steps, fine.model.head_bias_init) == (500, 0.0)


def test_regime_keeps_explicit_values_and_rejects_unknown_regime():
  config = _tiny_config("finetune")
  config.optim.lr = 0.01
  config.loss = "sigmoid_xent"
  resolved = optim.resolve_regime(config)
  assert (resolved.optim.lr, resolved.loss) == (0.01, "sigmoid_xent")
  assert config.optim.optimizer is None  # The caller's config is not modified.
  config.regime = "pretraining"
  with pytest.raises(ValueError, match="'pretraining' is not a regime"):
    optim.resolve_regime(config)


def test_losses_give_reference_values():
  logits = jnp.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
  labels = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
  softmax = optim.loss_fn(logits, labels, "softmax_xent")
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  np.testing.assert_allclose(softmax, [-log_p[0, 0], -(log_p[1, 1] + log_p[1, 2]) / 2], rtol=1e-6)
  sigmoid = optim.loss_fn(logits, labels, "sigmoid_xent")
  p = 1 / (1 + np.exp(-np.asarray(logits)))
  expected = -(labels * np.log(p) + (1 - labels) * np.log(1 - p)).sum(-1)
  np.testing.assert_allclose(sigmoid, expected, rtol=1e-5)


def test_sgd_finetune_optimizer_clips_and_uses_momentum():
  config = optim.resolve_regime(_tiny_config("finetune"))
  config.optim.warmup_steps = 0
  config.optim.schedule = "constant"
  config.optim.lr = 0.5
  tx = optim.make_optimizer(config.optim, optim.lr_schedule(0.5, 10, 0, "constant"))
  params = {"kernel": jnp.zeros(2)}
  state = tx.init(params)
  grads = {"kernel": jnp.array([3.0, 4.0])}  # global norm 5 -> clipped to 1: [0.6, 0.8]
  updates, state = tx.update(grads, state, params)
  np.testing.assert_allclose(updates["kernel"], [-0.3, -0.4], rtol=1e-6)
  updates, state = tx.update(grads, state, params)  # momentum 0.9: 1.9 * clipped grad
  np.testing.assert_allclose(updates["kernel"], [-0.57, -0.76], rtol=1e-6)


def test_batch_size_and_schedule_length_checks():
  train.check_batch_size(512, 2, 8)
  with pytest.raises(ValueError, match=r"multiple of 16\. Use --config.batch_size=496 or 512"):
    train.check_batch_size(500, 2, 8)
  config = _tiny_config()
  with pytest.raises(ValueError, match="Set the schedule length"):
    train.num_train_steps(config, 1000)
  config.batch_size = 64
  config.num_epochs = 2.5
  assert train.num_train_steps(config, 1000) == 40  # ceil(2500 / 64)
  config.total_steps = 7  # Takes precedence over epochs.
  assert train.num_train_steps(config, 1000) == 7
  config.total_steps = 0
  with pytest.raises(ValueError, match="0 training steps"):
    train.num_train_steps(config, 1000)


# ----------------------------------------------------------------------------- configs


def _load_config(path, arg):
  return cli.load_config_file(f"{path}:{arg}" if arg else path)


def test_shipped_configs_are_covered():
  """Every configs/*.py is exercised by the consumed-keys test below."""
  assert sorted({p for p, _ in SHIPPED}) == CONFIGS


@pytest.mark.parametrize("path,arg", SHIPPED)
def test_shipped_configs_build_and_resolve(path, arg):
  config = _load_config(path, arg)
  assert config.is_locked
  resolved = optim.resolve_regime(config)
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  models.model_config(resolved.model_name, **resolved.model.to_dict())


def _record_consumed_keys(monkeypatch):
  """Patches ConfigDict to record (keys of the section, key) for every read of a key."""
  seen = set()
  original = ml_collections.ConfigDict.__getitem__

  def getitem(self, key):
    seen.add((tuple(sorted(self._fields)), key))
    return original(self, key)

  monkeypatch.setattr(ml_collections.ConfigDict, "__getitem__", getitem)
  return seen


def _leaf_keys(config):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaf_keys(value)
    else:
      yield tuple(sorted(config.keys())), key


@pytest.mark.slow
def test_every_config_key_is_consumed(tmp_path, monkeypatch):
  """Runs each shipped config for two steps on tiny data; every key must be read by the code."""
  folder = data_utils.make_image_folder(str(tmp_path / "images"),
                                        num_classes=data_utils.MULTILABEL_NUM_CLASSES,
                                        per_class=2, size=8)
  multi_label = data_utils.make_multilabel_dataset(str(tmp_path / "tfds"))
  seen = _record_consumed_keys(monkeypatch)
  unread = None
  for i, (path, arg) in enumerate(SHIPPED):
    config = _load_config(path, arg)
    all_keys = set(_leaf_keys(config))
    with config.unlocked():
      # Same keys, tiny values: a 2-step run on an 8x8 image folder.
      config.data.image_folder = folder
      config.data.train_split, config.data.eval_split = "train", "test"
      if config.extra_eval.name:  # ImageNet ReaL in the ImageNet config: a tiny stand-in.
        config.extra_eval.name, config.extra_eval.split = multi_label, "test"
      config.data.image_size = 8
      config.data.shuffle_buffer = 16
      if "embed_dim" in config.model:  # T2T-ViT
        config.model.update(embed_dim=16, depth=1, num_heads=2, token_dim=8)
      else:
        config.model.update(hidden_size=8, mlp_dim=16, num_heads=2, num_layers=1,
                            patch_size=(4, 4))
      if config.model.get("representation_size") is not None:
        config.model.representation_size = 8
      config.batch_size = 4
      config.total_steps = 2
      config.optim.warmup_steps = 1
      if config.optim.warmup_epochs is not None:  # The T2T recipe: 2 of 16 images per epoch.
        config.optim.warmup_epochs = config.optim.cooldown_epochs = 0.125
      config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = 1
    results = train.train_and_evaluate(config, str(tmp_path / f"run{i}"))
    assert results["step"] == 2 and 0.0 <= results["test/accuracy"] <= 1.0
    if config.extra_eval.name:
      assert 0.0 <= results["1_0_0_test/accuracy"] <= 1.0  # '<dir basename>_<split>' 
    unread = (all_keys - seen) if unread is None else (unread & (all_keys - seen))
  assert not unread, f"Config keys no code reads: {sorted(k for _, k in unread)}"


# ----------------------------------------------------------------------------- main


def _run_main(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "vit_jax.main", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_unknown_config_key_fails_with_a_clear_message(tmp_path):
  proc = _run_main("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path),
                   "--config.unknown_key=1")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Unknown config key 'unknown_key'" in proc.stderr
  assert "Keys there:" in proc.stderr
  proc = _run_main("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path),
                   "--config.optim.learning_rate=0.1")
  assert proc.returncode == 2
  assert "Unknown config key 'optim.learning_rate'" in proc.stderr
  assert not list(tmp_path.iterdir())  # Nothing was started.


def test_bad_config_values_fail_in_one_line_before_the_workdir_is_touched(tmp_path):
  workdir = tmp_path / "never_created"
  proc = _run_main("--config", "configs/fashion_mnist.py", "--workdir", str(workdir),
                   "--config.data.image_size=30")
  assert proc.returncode == 2, proc.stderr[-2000:]
  fatal = [l for l in proc.stderr.splitlines() if l.startswith("FATAL:")]
  assert fatal and "Image height 30 is not divisible by the patch size 7" in fatal[0]
  assert "Traceback" not in proc.stderr
  assert not workdir.exists()
  proc = _run_main("--config", "configs/fashion_mnist.py", "--workdir", str(workdir),
                   "--config.data.name=no_such_dataset")
  assert proc.returncode == 2
  assert "config.data.name='no_such_dataset' is neither a registered tfds dataset" in proc.stderr
  assert not workdir.exists()
  proc = _run_main("--config", "configs/fashion_mnist.py", "--workdir", str(workdir),
                   "--config.label_smoothing=1.5")
  assert proc.returncode == 2 and "config.label_smoothing=1.5 must be in [0, 1)" in proc.stderr
  proc = _run_main("--config", "configs/fashion_mnist.py", "--workdir", str(workdir),
                   "--config.batch_size=abc")  # A wrong type.
  assert proc.returncode == 2
  assert "FATAL: flag --config.batch_size=abc: invalid literal for int()" in proc.stderr
  # A config file that refuses its argument: one line, the file's own message, no traceback.
  proc = _run_main("--config", "configs/t2t.py:99", "--workdir", str(workdir))
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  fatal = [l for l in proc.stderr.splitlines() if l.startswith("FATAL:")]
  assert fatal and "configs/t2t.py: unknown model '99'; use one of 7, 10, 12" in fatal[0]
  assert not workdir.exists()


def _scalars(workdir):
  """{tag: {step: value}} from the TensorBoard event files in workdir."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {}
  for path in glob.glob(os.path.join(workdir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        number = tf.make_ndarray(value.tensor) if value.HasField("tensor") else value.simple_value
        if np.ndim(number) == 0 and np.asarray(number).dtype.kind == "f":  # Scalars, not hparams.
          out.setdefault(value.tag, {})[event.step] = float(number)
  return out


@pytest.mark.slow
def test_main_trains_writes_metrics_and_resumes(tmp_path):
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=5,
                                        size=8)
  workdir = str(tmp_path / "workdir")
  common = ["--config", "configs/fashion_mnist.py", "--workdir", workdir,
            f"--config.data.image_folder={folder}", "--config.data.image_size=8",
            "--config.model.hidden_size=8", "--config.model.mlp_dim=16",
            "--config.model.num_heads=2", "--config.model.num_layers=1",
            "--config.model.patch_size=(4,4)", "--config.batch_size=4",
            "--config.optim.warmup_steps=1",
            "--config.log_every_steps=2", "--config.eval_every_steps=2",
            "--config.checkpoint_every_steps=2"]
  first = _run_main(*common, "--config.total_steps=4")
  assert first.returncode == 0, first.stderr[-3000:]
  if cli.huge_pages_environment({}) is not None:  # It re-executed itself with huge pages.
    assert "malloc: transparent huge pages for large allocations" in first.stderr
  assert "Final evaluation at step 4: test/accuracy=" in first.stdout
  # Head size 4: the fused CPU kernel does not apply, and the log says so (not just "available").
  assert "Attention: XLA's; the fused CPU kernel is " in first.stderr
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
  scalars = _scalars(workdir)
  assert sorted(scalars["train/loss"]) == [2, 4]
  assert sorted(scalars["test/accuracy"]) == [2, 4]

  second = _run_main(*common, "--config.total_steps=6")
  assert second.returncode == 0, second.stderr[-3000:]
  assert "Resuming from the checkpoint at step 4" in second.stderr
  assert "Final evaluation at step 6" in second.stdout
  scalars = _scalars(workdir)
  assert sorted(scalars["train/loss"]) == [2, 4, 6]  # Steps 1-4 were not trained again.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == "6"

  third = _run_main(*common, "--config.total_steps=6")  # Finished: no more training.
  assert third.returncode == 0, third.stderr[-3000:]
  assert "already finished its 6 steps" in third.stderr
  assert sorted(_scalars(workdir)["train/loss"]) == [2, 4, 6]


def _tiny_folder_config(folder, **overrides):
  config = _tiny_config("finetune")
  config.data.image_folder = folder
  config.data.image_size = 8
  config.data.augment = "none"
  config.data.shuffle_buffer = 16
  config.batch_size = 4
  config.total_steps = 2
  config.optim.warmup_steps = 0
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = 1
  config.async_checkpointing = False
  for key, value in overrides.items():
    section, _, name = key.rpartition(".")
    (config[section] if section else config)[name] = value
  return config


@pytest.mark.slow
def test_gradient_accumulation_matches_the_full_batch(tmp_path):
  """Two micro-batches of 2 give the same update as one batch of 4 (no dropout)."""
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=4,
                                        size=8)
  params = []
  for accum in (1, 2):
    workdir = str(tmp_path / f"accum{accum}")
    config = _tiny_folder_config(folder, grad_accum_steps=accum, total_steps=1)
    train.train_and_evaluate(config, workdir)
    params.append(checkpoint.load(workdir)["params"])
  first = jax.tree_util.tree_leaves(params[0])
  second = jax.tree_util.tree_leaves(params[1])
  assert len(first) == len(second) > 0
  for a, b in zip(first, second):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="cannot be split into 3 micro-batch"):
    train.train_and_evaluate(_tiny_folder_config(folder, grad_accum_steps=3),
                             str(tmp_path / "accum3"))


@pytest.mark.slow
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
  """From the third batch on the images are NaN: the run stops at step 3, step 2 is kept."""
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=4,
                                        size=8)
  create = train.data.create_train_iterator

  def poisoned(*args, **kwargs):
    for i, batch in enumerate(create(*args, **kwargs)):
      if i >= 2:
        batch = dict(batch, image=np.full_like(batch["image"], np.nan))
      yield batch

  monkeypatch.setattr(train.data, "create_train_iterator", poisoned)
  workdir = str(tmp_path / "workdir")
  with pytest.raises(FloatingPointError, match=r"Training diverged at step 3: loss=nan.*"
                     r"The last good checkpoint \(step 2\) is kept"):
    train.train_and_evaluate(_tiny_folder_config(folder, total_steps=10), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  kept = checkpoint.load(workdir)["params"]
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(kept))


def test_eval_sums_count_hits_precision_at_1_and_skip_padding():
  logits = jnp.array([[5.0, 1, 0, 0, 0, 0],   # top1 = 0 (a true label): hit
                      [1.0, 5, 4, 3, 2, 0],   # top1 = 1, true {5}: miss; 5 ranks 6th: no top-5 hit
                      [0.0, 1, 2, 3, 4, 5],   # top1 = 5, true {2, 5}: hit
                      [9.0, 0, 0, 0, 0, 0]])  # padding: ignored although it would hit
  labels = jnp.array([[1.0, 0, 0, 1, 0, 0],
                      [0.0, 0, 0, 0, 0, 1],
                      [0.0, 0, 1, 0, 0, 1],
                      [1.0, 0, 0, 0, 0, 0]])
  mask = jnp.array([True, True, True, False])
  sums = train.eval_sums(logits, labels, mask, "sigmoid_xent")
  assert (int(sums["count"]), int(sums["correct"]), int(sums["correct_top5"])) == (3, 2, 2)
  per_example = optim.loss_fn(logits, labels, "sigmoid_xent")
  np.testing.assert_allclose(sums["loss"], per_example[:3].sum(), rtol=1e-6)
  assert "correct_top5" not in train.eval_sums(logits[:, :4], labels[:, :4], mask, "softmax_xent")


@pytest.mark.slow
def test_multi_label_pretraining_runs_with_sigmoid_loss(tmp_path):
  """The ImageNet-21k/JFT path: multi-hot targets, sigmoid loss, head bias -10, precision@1."""
  name = data_utils.make_multilabel_dataset(str(tmp_path / "tfds"))
  config = _tiny_config("pretrain")
  config.data.name = name
  config.data.data_dir = str(tmp_path / "tfds")
  config.data.image_size = 8
  config.data.shuffle_buffer = 16
  config.batch_size = 4
  config.total_steps = 3
  config.optim.warmup_steps = 1
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = 3
  results = train.train_and_evaluate(config, str(tmp_path / "workdir"))
  assert results["step"] == 3
  assert 0.0 <= results["test/accuracy"] <= 1.0 and np.isfinite(results["test/loss"])


def test_extra_eval_with_other_classes_is_a_config_error(tmp_path):
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=2,
                                        size=8)
  multi_label = data_utils.make_multilabel_dataset(str(tmp_path / "tfds"))  # 5 classes
  config = _tiny_folder_config(folder, **{"extra_eval.name": multi_label,
                                          "extra_eval.split": "test"})
  workdir = tmp_path / "workdir"
  with pytest.raises(train.ConfigError, match="has 5 classes, the training data 3"):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


@pytest.mark.slow
def test_t2t_trains_and_keeps_its_fixed_tables_out_of_training(tmp_path):
  """T2T-ViT's sinusoid table and Performer features ride in 'model_state': saved, not trained."""
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=4,
                                        size=16)
  config = data_utils.folder_run_config("T2T-ViT-custom", folder, 16, embed_dim=16, depth=1,
                                        num_heads=2, mlp_ratio=2.0, token_dim=8,
                                        tokens_type="performer")
  workdir = str(tmp_path / "workdir")
  results = train.train_and_evaluate(config, workdir)
  assert results["step"] == 2
  variables = checkpoint.load(workdir)
  assert sorted(variables) == ["constants", "params"]
  model = models_lib.create("T2T-ViT-custom", num_classes=3, **config.model.to_dict())
  fresh = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)), train=False)
  # The sinusoid table is a function of the shape only: unchanged by training.
  np.testing.assert_array_equal(variables["constants"]["pos_embed"], fresh["constants"]["pos_embed"])
  assert "pos_embed" not in variables["params"]
  # Trained with the backbone scanned (the default): resuming unrolled is refused, and the
  # message describes the checkpoint from its parameters and fixed tables (a Performer).
  assert "blocks" in variables["params"] and config.model.scan
  config.model.scan = False
  with pytest.raises(train.ConfigError, match=r"(?s)written with the scanned block layout: resume "
                     r"with --config\.model\.scan=True.*depth=1.*tokens_type='performer'"):
    train.train_and_evaluate(config, workdir)


def test_t2t_qk_scale_is_a_float_override():
  """The released T2T-ViT weights need qk_scale = D**-0.5 (a float) from the command line."""
  config = defaults.get_config("T2T-ViT-14", "imagenet2012")
  assert config.model.qk_scale is None  # head_dim**-0.5, the from-scratch default.
  config.model.qk_scale = 384 ** -0.5
  model = models_lib.create(config.model_name, num_classes=10, **config.model.to_dict())
  assert model.qk_scale == pytest.approx(0.0510310363)


def test_t2t_weight_decay_skips_class_token_norms_biases_and_tables():
  """As the T2T-ViT recipe: decay on the Linear kernels only (tables are not parameters)."""
  model = models_lib.create("T2T-ViT-custom", num_classes=3, embed_dim=16, depth=1,
                            num_heads=2, mlp_ratio=2.0, token_dim=8)
  variables = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False))
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top
  mask = checkpoint.flatten_params(optim._decay_mask(variables["params"]))  # pylint: disable=protected-access
  decayed = sorted(k for k, v in mask.items() if v)
  assert decayed == sorted(k for k in mask if k.endswith("/kernel"))
  assert len(decayed) == 14  # 2 T2T layers x 4, project, one block x 4, head.
  assert not any(mask[k] for k in mask if k == "cls_token" or "norm" in k or k.endswith("bias"))
  assert "pos_embed" not in mask and all("/w" not in k for k in mask)
