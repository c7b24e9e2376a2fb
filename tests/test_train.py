"""The training loop (vit_jax.train) and the `vit_jax.main` entry point, end to end on tiny data."""

import glob
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import data_utils
from vit_jax import cli
from vit_jax import config as config_lib
from vit_jax import platform
from vit_jax import models as models_lib
from vit_jax import train

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tiny_config(regime="pretrain"):
  config = config_lib.get_config("ViT-custom", "fashion_mnist_local", hidden_size=8,
                                 mlp_dim=16, num_heads=2, num_layers=1, patch_size=4)
  config.regime = regime
  return config


# ----------------------------------------------------------------------------- main


def _run_main(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "vit_jax.main", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_an_unknown_config_key_is_named_with_the_keys_there():
  """The message `python -m vit_jax.main` stops with (exit code 2: the slow test below)."""
  config = ["--config", "configs/fashion_mnist.py"]
  message = cli.unknown_override_message([*config, "--config.unknown_key=1"])
  assert message.startswith("Unknown config key 'unknown_key' in '--config.unknown_key=1': the "
                            "config configs/fashion_mnist.py has no 'unknown_key' at the top "
                            "level. Keys there: analysis, async_checkpointing, batch_size, ")
  message = cli.unknown_override_message([*config, "--config.optim.learning_rate=0.1"])
  assert message.startswith("Unknown config key 'optim.learning_rate' in "
                            "'--config.optim.learning_rate=0.1'")
  assert "has no 'learning_rate' at optim. Keys there: b1, b2, " in message
  assert cli.unknown_override_message([*config, "--config.optim.lr=0.1"]) is None


def test_bad_config_values_stop_the_run_before_the_workdir_is_touched(tmp_path, monkeypatch):
  """Refused in the config phase of `train_and_evaluate`, with a message naming the value."""
  data_utils.skip_cpu_peak_measurement(monkeypatch)
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=2,
                                        size=8)
  workdir = tmp_path / "never_created"
  for overrides, message in [
      ({"data.image_size": 30}, "Image height 30 is not divisible by the patch size 4"),
      ({"data.image_folder": None, "data.name": "no_such_dataset"},
       "config.data.name='no_such_dataset' is neither a registered tfds dataset"),
      ({"label_smoothing": 1.5}, "config.label_smoothing=1.5 must be in [0, 1)"),
      ({"fewshot.every_steps": 1, "fewshot.train_split": "validation"},
       "Bad config.fewshot.train_split='validation'")]:
    with pytest.raises(train.ConfigError, match=re.escape(message)):
      train.train_and_evaluate(_tiny_folder_config(folder, **overrides), str(workdir))
    assert not workdir.exists()


@pytest.mark.slow
def test_main_stops_on_bad_flags_and_configs_with_one_line_and_exit_code_2(tmp_path):
  """`python -m vit_jax.main`: a bad flag, a config file that refuses its argument and a config
  refused by the config phase each end with one FATAL line, no traceback and exit code 2,
  before the workdir is created."""
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=2,
                                        size=8)
  workdir = tmp_path / "never_created"
  fashion_mnist = ["--config", "configs/fashion_mnist.py", "--workdir", str(workdir)]
  for args, message in [
      ([*fashion_mnist, "--config.unknown_key=1"],
       "FATAL: Unknown config key 'unknown_key' in '--config.unknown_key=1'"),
      ([*fashion_mnist, "--config.batch_size=abc"],  # A wrong type.
       "FATAL: flag --config.batch_size=abc: 'abc' is not an integer: give a whole number"),
      # A config file that refuses its argument: the file's own message.
      (["--config", "configs/t2t.py:99", "--workdir", str(workdir)],
       "configs/t2t.py: unknown model '99'; use one of 7, 10, 12"),
      # Refused by the config phase of the training (vit_jax.train.ConfigError).
      ([*fashion_mnist, f"--config.data.image_folder={folder}", "--config.data.image_size=30",
        "--config.total_steps=1000", "--config.batch_size=4"],
       "FATAL: Image height 30 is not divisible by the patch size 7"),
      # A value its declaration's check refuses: the fix spelled as the flag (vit_jax.cli).
      ([*fashion_mnist, f"--config.data.image_folder={folder}", "--config.optim.lr=-1.0",
        "--config.total_steps=1000", "--config.batch_size=4"],
       "FATAL: config.optim.lr=-1.0 must be > 0 (the peak learning rate; None: the regime's "
       "(REGIME_DEFAULTS)); set --config.optim.lr to such a value.")]:
    proc = _run_main(*args)
    assert proc.returncode == 2, (args, proc.stderr[-2000:])
    fatal = [l for l in proc.stderr.splitlines() if l.startswith("FATAL:")]
    assert len(fatal) == 1 and message in fatal[0], (args, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
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


def _images(workdir):
  """{tag: {step: (height, width)}} of the TensorBoard images in workdir (PNG-encoded)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {}
  for path in glob.glob(os.path.join(workdir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name == "images":
          width, height, png = tf.make_ndarray(value.tensor)[:3]
          assert png.startswith(b"\x89PNG")
          out.setdefault(value.tag, {})[event.step] = (int(height), int(width))
  return out


@pytest.mark.slow
def test_main_trains_writes_metrics_and_resumes(tmp_path, caplog):
  """`python -m vit_jax.main` trains 4 steps; the same config with a longer schedule resumes at
  step 4 (run in this process: resuming is `train_and_evaluate`'s), then only evaluates."""
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=5,
                                        size=8)
  workdir = str(tmp_path / "workdir")
  overrides = {"data.image_folder": folder, "data.image_size": 8, "model.hidden_size": 8,
               "model.mlp_dim": 16, "model.num_heads": 2, "model.num_layers": 1,
               "model.patch_size": (4, 4), "batch_size": 4, "optim.warmup_steps": 1,
               "log_every_steps": 2, "eval_every_steps": 2, "checkpoint_every_steps": 2,
               "fewshot.every_steps": 4, "fewshot.shots": (1, 2), "fewshot.seeds": 2,
               "analysis.attention_images": 4, "analysis.rollout_images": 2,
               "analysis.train_images": 4}
  first = _run_main("--config", "configs/fashion_mnist.py", "--workdir", workdir,
                    *data_utils.main_flags(overrides),
                    "--config.total_steps=4")
  assert first.returncode == 0, first.stderr[-3000:]
  if platform.huge_pages_environment({}) is not None:  # It re-executed itself with huge pages.
    assert "malloc: transparent huge pages for large allocations" in first.stderr
  assert first.stdout.startswith("Final evaluation at step 4: fewshot/images_1shot=")
  assert ", test/accuracy=" in first.stdout
  # Head size 4: the fused CPU kernel does not apply; the log says why and what the step runs.
  assert "Attention: xla (the fused CPU kernel does not apply: the head size 4" in first.stderr
  assert "Attention in the compiled training step: xla." in first.stderr
  assert f"Config (resolved): {workdir}/config.json (--verbosity=1 logs it)." in first.stderr
  assert "total_steps: 4" not in first.stderr
  saved = config_lib.from_json(open(os.path.join(workdir, "config.json")).read())
  assert saved.total_steps == 4 and saved.num_classes == 3 and saved.loss == "softmax_xent"
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
  with open(os.path.join(workdir, "dataset.json")) as f:
    assert json.load(f)["label_names"] == ["class_0", "class_1", "class_2"]
  scalars = _scalars(workdir)
  assert sorted(scalars["train/loss"]) == [2, 4]
  assert sorted(scalars["train/accuracy"]) == [2, 4]
  assert all(0 <= v <= 1 for v in scalars["train/accuracy"].values())
  assert sorted(scalars["test/accuracy"]) == [2, 4]
  assert ", accuracy " in first.stderr  # On the progress line, beside the loss.
  # The log: one progress line per window (with the learning rate), each evaluation once, the
  # metric dicts in TensorBoard only (--verbosity=1 logs them), the account's line at the end.
  progress = re.findall(r"\] Step (\d)/4 \(\d+\.\d%\): loss \d\.\d{4}, accuracy \d\.\d{4}, "
                        r"lr [\d.e-]+, [\d,]+ images/s", first.stderr)
  assert progress == ["2", "4"], first.stderr[-3000:]
  assert first.stderr.count("test/accuracy=") == 2  # "Evaluated ... at step 2: ...", step 4.
  assert "train/grad_norm=" not in first.stderr and "cost/mfu=" not in first.stderr
  assert len(re.findall(r"\] Step \d: cost: ", first.stderr)) == 1
  assert sorted(scalars["fewshot/images_2shot"]) == [4]
  # config.analysis: the attention figures at each evaluation, the training images at the start.
  assert _images(workdir) == {"analysis/attention_distance": {2: (450, 700), 4: (450, 700)},
                              "analysis/rollout": {2: (250, 800), 4: (250, 800)},
                              "analysis/training_images": {0: (250, 800)}}
  distance = scalars["analysis/attention_distance/layer_1"]  # 2x2 patches of 4 px: 0 to 5.7 px.
  assert sorted(distance) == [2, 4] and all(0 < d < np.hypot(4, 4) for d in distance.values())

  def rerun(total_steps, **changes):
    config = data_utils.override(cli.load_config_file("configs/fashion_mnist.py"),
                                 dict(overrides, total_steps=total_steps, **changes))
    caplog.clear()
    with caplog.at_level(logging.INFO):
      results = train.train_and_evaluate(config, workdir)
    return results, caplog.text

  # A longer schedule changes what the run trains: refused unless asked for, config.json kept.
  with pytest.raises(train.ConfigError) as refused:
    rerun(6, **{"optim.lr": 0.5})
  assert cli.error_text(refused.value) == (
      f"config.optim.lr=0.5 differs from the run resumed in {workdir}, which recorded 0.002 in "
      "its config.json (also changed: total_steps: 4 -> 6); to resume that run, set "
      "--config.optim.lr=0.002 and --config.total_steps=4 as recorded; for a new run, use "
      "another --workdir; to resume with the changes, set --config.resume_with_changes=True")
  assert config_lib.from_json(open(os.path.join(workdir, "config.json")).read()).total_steps == 4
  results, log = rerun(6, resume_with_changes=True, log_every_steps=1)
  assert "Resuming from the checkpoint at step 4" in log and results["step"] == 6
  assert f"Resuming {workdir} with config.total_steps=6 (it recorded 4)." in log
  assert f"Resuming {workdir} with config.log_every_steps=1 (it recorded 2)." in log
  # The cosine that ended at step 4 now has 2 steps more: step 5's rate rises from ~0 again.
  rates = re.search(r"The learning rate of step 5 is (\S+) with the changes \((\S+) as "
                    r"recorded\): the schedule is a function of the step and of the changed "
                    r"keys\.", log)
  assert rates, log
  cosine = 0.002 * 0.5 * (1 + np.cos(np.pi * (5 - 1) / (6 - 1)))  # Warm-up 1 step, then 5.
  assert float(rates[1]) == pytest.approx(cosine, rel=1e-3) and float(rates[2]) < 1e-9
  scalars = _scalars(workdir)
  assert sorted(scalars["train/loss"]) == [2, 4, 5, 6]  # Steps 1-4 were not trained again.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == "6"
  assert sorted(scalars["fewshot/images_2shot"]) == [4, 6]
  assert sorted(_images(workdir)["analysis/training_images"]) == [0, 4]  # Where it resumed.
  assert "fewshot/images_2shot_std" in results

  results, log = rerun(6)  # Finished: no more training; config.json recorded the change.
  assert "already finished its 6 steps" in log and results["step"] == 6
  assert f"Resuming {workdir} with config.log_every_steps=2 (it recorded 1)." in log
  assert "with config.resume_with_changes" not in log  # The option is no change of the run.
  assert sorted(_scalars(workdir)["train/loss"]) == [2, 4, 5, 6]


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
  return data_utils.override(config, overrides)


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


def test_extra_eval_with_other_classes_is_a_config_error(tmp_path, monkeypatch):
  data_utils.skip_cpu_peak_measurement(monkeypatch)
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
  model = models_lib.create("T2T-ViT-custom", num_classes=3,
                            **dict(config.model.to_dict(), attention="xla",
                                   remat_policy="dots_and_attention_saveable"))
  fresh = jax.jit(lambda x: model.init(jax.random.PRNGKey(0), x, train=False))(  # Eager: slow.
      jnp.zeros((1, 16, 16, 3)))
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




@pytest.mark.slow
def test_a_restarted_run_loads_its_compiled_steps_from_the_cache(tmp_path, caplog, monkeypatch):
  """JAX's persistent compilation cache under the workdir: the second start of a run loads its
  train step instead of compiling it; 'none' turns the cache off. (Every compilation is cached
  here: the tiny model compiles in less than JAX's 1 s threshold.)"""
  data_utils.skip_cpu_peak_measurement(monkeypatch)
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")  # The tests' shared cache (conftest.py).
  threshold = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=2,
                                        size=8)
  workdir = str(tmp_path / "workdir")

  def run(**overrides):
    caplog.clear()
    with caplog.at_level(logging.INFO):
      train.train_and_evaluate(_tiny_folder_config(folder, **overrides), workdir)
    return caplog.text

  try:
    log = run(total_steps=4)
    assert re.search(r"Compiled \w*train_step\w* in \d+\.\d s\.", log), log
    assert os.listdir(os.path.join(workdir, "compilation_cache"))
    for step in ("3", "4"):  # As if preempted after step 2.
      shutil.rmtree(os.path.join(workdir, "checkpoints", step))
    log = run(total_steps=4)  # The same run again (the schedule is in the step): from step 2.
    assert "Resuming from the checkpoint at step 2" in log
    assert re.search(r"Loaded \w*train_step\w* from the compilation cache in \d+\.\d s", log), log
    assert not re.search(r"Compiled \w*train_step", log)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))
    log = run(total_steps=4, compilation_cache_dir="none")
    assert re.search(r"Compiled \w*train_step\w* in", log) and "compilation cache" not in log
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)


@pytest.mark.slow
def test_a_killed_run_resumes_and_its_ledger_counts_the_redone_steps(tmp_path, caplog, capsys):
  """`python -m vit_jax.main` stopped without notice (SIGKILL) after its checkpoint of step 50,
  its cost.json at a later step S; the rerun (in this process) resumes from the latest
  checkpoint R, so its attempt redoes S - R steps, costed at the first attempt's seconds per
  step, and loads its step from the compilation cache; `vit_jax.cost`'s main (WORKDIR) prints
  the ledger and draws it."""
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from tests import test_train_failures as failures  # pylint: disable=g-import-not-at-top
  from vit_jax.tools import cost  # pylint: disable=g-import-not-at-top
  import PIL.Image  # pylint: disable=g-import-not-at-top
  folder, workdir = failures._folder(tmp_path), tmp_path / "workdir"
  overrides = failures._main_overrides(folder, log_every_steps=2, checkpoint_every_steps=50,
                                       total_steps=120)
  env = dict(failures.ENV, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # Cache every step.
  proc = subprocess.Popen(failures._main_args(workdir, overrides), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    assert failures._wait_for(lambda: (workdir / "checkpoints" / "50").exists() and
                              failures._step_in_cost_json(workdir) > 50, proc, timeout=300)
    proc.send_signal(signal.SIGSTOP)  # Frozen: what it wrote is what the rerun finds.
    time.sleep(0.5)
    killed = json.loads((workdir / "cost.json").read_text())
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  reached = killed["step"]
  assert killed["attempts"][0]["end_step"] == reached and 50 < reached < 120

  threshold = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  saved = []  # JAX's own count: each load's compile time minus its retrieval time.

  def on_duration(event, seconds, **_):
    if event == "/jax/compilation_cache/compile_time_saved_sec":
      saved.append(seconds)

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  try:
    results, log = failures._resume(overrides, workdir, caplog)
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    from jax._src import monitoring  # pylint: disable=g-import-not-at-top
    monitoring.unregister_event_duration_listener(on_duration)
  restored = int(re.search(r"Resuming from the checkpoint at step (\d+)", log).group(1))
  assert restored in (50, 100) and restored < reached and results["step"] == 120
  assert re.search(r"Loaded \w*train_step\w* from the compilation cache", log), log
  final = json.loads((workdir / "cost.json").read_text())
  first, second = final["attempts"]
  assert first == killed["attempts"][0] and first["resume_s"] < first["seconds"]["program"]
  per_step = first["seconds"]["train"] / first["steps"]
  assert second["redone"] == {
      "steps": reached - restored, "seconds": pytest.approx((reached - restored) * per_step),
      "from_attempt": 1, "device_days": pytest.approx((reached - restored) * per_step / 86_400),
      "core_days": None, "chip_days": None}
  assert final["redone_steps"] == reached - restored > 0
  assert second["resumed"] and 0 < second["setup_s"] < second["resume_s"] < (
      second["seconds"]["program"])
  # The loads' net saving as JAX reports it (a tiny step can load slower than it compiles).
  assert saved and second["compile_saved_s"] == pytest.approx(max(0.0, sum(saved)), abs=1e-9)
  assert final["resume_seconds"] == second["resume_s"]
  program = first["seconds"]["program"] + second["seconds"]["program"]
  productive = first["seconds"]["train"] + second["seconds"]["train"] - (
      (reached - restored) * per_step)
  assert final["goodput"] == pytest.approx(productive / program)
  assert "Where the time went (python -m vit_jax.cost" in log
  assert f"redone after preemptions: {reached - restored} step(s) (" in log

  capsys.readouterr()
  assert cost.main([str(workdir)]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f"{workdir}: the account at step 120 ({workdir}/cost.json, written ")
  assert out.splitlines()[0].endswith("; no run holds the workdir (finished, stopped or refused).")
  assert out.splitlines()[1].split()[:6] == ["attempt", "steps", "on", "program", "s", "training"]
  rows = out.splitlines()[2:4]
  assert rows[0].startswith(f"1        0-{reached} ") and rows[1].startswith(
      f"2        {restored}-120 ")
  assert rows[1].split()[-2:] == [str(reached - restored), f"{second['compile_saved_s']:.1f}"]
  assert f"goodput {final['goodput']:.1%}: " in out
  with PIL.Image.open(workdir / "cost.png") as image:
    assert (image.format, image.size) == ("PNG", (630, 450))
  # --figure elsewhere (in this process: tests/tools/test_cost.py runs `python -m vit_jax.cost`).
  assert cost.main([str(workdir), "--figure", str(tmp_path / "ledger.png")]) == 0
  assert capsys.readouterr().out.splitlines()[1:] == out.splitlines()[1:-1] + [
      f"Figure: {tmp_path}/ledger.png"]
