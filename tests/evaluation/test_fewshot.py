"""Few-shot linear evaluation: the closed-form solver against a direct ridge solve, features with
a known answer, the shot draws, the pool read from real datasets, the evaluator of a tiny model,
the config checks, the training loop's scalars and `python -m vit_jax.fewshot`."""

import contextlib
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests import data_utils
from vit_jax import config as config_lib
from vit_jax import data
from vit_jax import inference
from vit_jax.evaluation import features as features_lib
from vit_jax.evaluation import fewshot
from vit_jax.tools import fewshot as fewshot_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _clusters(rng, num_classes, per_class, dim, spread):
  """Gaussian clusters: class c around a random centre at distance ~`spread`, unit noise."""
  centres = rng.normal(size=(num_classes, dim)) * spread
  labels = np.repeat(np.arange(num_classes), per_class)
  return centres[labels] + rng.normal(size=(len(labels), dim)), labels


def _direct_ridge(features, labels, num_classes, l2):
  """W = (X^T X + l2 I)^-1 X^T Y on the probe's design matrix, with np.linalg.solve."""
  x = (features - features.mean(0)) / (features.std(0) + fewshot.STD_EPSILON)
  x = np.concatenate([x, np.full((len(x), 1), fewshot.BIAS_FEATURE)], axis=1)
  y = 2.0 * np.eye(num_classes)[labels] - 1.0
  return np.linalg.solve(x.T @ x + l2 * np.eye(x.shape[1]), x.T @ y)


@pytest.mark.parametrize("n, dim", [(60, 12), (12, 40)])
def test_both_solver_branches_equal_a_direct_ridge_solve(n, dim):
  rng = np.random.default_rng(n)
  x, y = rng.normal(size=(n, dim)) * 3 + 1, rng.integers(0, 4, n)
  auto = fewshot.LinearProbe.fit(x, y, 4)
  assert auto.branch == ("primal" if n >= dim + 1 else "dual")
  for branch in ("primal", "dual"):
    probe = fewshot.LinearProbe.fit(jnp.asarray(x, jnp.float32) if branch == "dual" else x,
                                    y, 4, branch=branch)
    for l2 in (0.5, 1024.0):
      direct = _direct_ridge(np.asarray(x, np.float32) if branch == "dual" else x, y, 4, l2)
      np.testing.assert_allclose(probe.weights(l2), direct, rtol=1e-5,
                                 atol=1e-5 * np.abs(direct).max())
  with pytest.raises(ValueError, match="branch='svd' must be 'auto', 'primal' or 'dual'"):
    fewshot.LinearProbe.fit(x, y, 4, branch="svd")
  with pytest.raises(ValueError, match=r"must lie in \[0, 3\), got \[0, 3\]"):
    fewshot.LinearProbe.fit(x, y, 3)
  with pytest.raises(ValueError, match="hold NaN or infinite values"):
    fewshot.LinearProbe.fit(np.full((n, dim), np.nan), y, 4)


def test_separated_clusters_are_classified_perfectly_and_random_labels_at_chance():
  rng = np.random.default_rng(0)
  pool_x, pool_y = _clusters(rng, 10, 80, 16, spread=10.0)
  test_x, test_y = pool_x[::2] + rng.normal(size=pool_x[::2].shape) * 0.1, pool_y[::2]
  results = fewshot.evaluate_features(pool_x, pool_y, test_x, test_y, num_classes=10)
  assert list(results) == [1, 5, 10, 25]
  for k, r in results.items():
    assert r.shots == k and r.accuracies == (1.0, 1.0, 1.0) and r.std == 0.0
    assert r.l2_regs == (1024.0,) * 3
  assert fewshot.scalars("clusters", results)["fewshot/clusters_10shot"] == 1.0

  labels = rng.integers(0, 10, len(pool_y))
  test_labels = rng.integers(0, 10, 2000)
  noise = fewshot.evaluate_features(rng.normal(size=pool_x.shape), labels,
                                    rng.normal(size=(2000, 16)), test_labels, num_classes=10)
  for r in noise.values():
    assert abs(r.mean - 0.1) < 0.03, r  # Chance is 1/10; 3 x 2000 draws: std ~0.004.
  probe = fewshot.LinearProbe.fit(pool_x, pool_y, 10)
  assert [probe.accuracy(test_x, test_y, l2) for l2 in (1.0, 1e4)] == [1, 1]


def test_shot_draws_are_deterministic_nested_and_differ_between_seeds():
  labels = np.array([0, 1, 2] * 20)
  draws = {seed: fewshot.shot_indices(labels, 5, seed, 3) for seed in range(3)}
  assert np.array_equal(draws[1], fewshot.shot_indices(labels, 5, 1, 3))
  assert not np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[1], draws[2])
  for drawn in draws.values():
    assert np.bincount(labels[drawn]).tolist() == [5, 5, 5] and len(set(drawn)) == 15
  # big_vision's draws: default_rng(seed), one permutation per class in class order.
  rng = np.random.default_rng(2)
  expected = [rng.permutation(np.flatnonzero(labels == c))[:5] for c in range(3)]
  assert np.array_equal(draws[2], np.concatenate(expected))
  one_shot = fewshot.shot_indices(labels, 1, 2, 3)
  assert set(one_shot) <= set(draws[2])  # A seed's 1-shot set is inside its 5-shot set.

  with pytest.raises(fewshot.NotEnoughExamplesError,
                     match=r"1 of 4 classes have fewer than 5 examples for 5-shot \(class 3: 0\)"):
    fewshot.shot_indices(labels, 5, 0, 4)
  x = np.random.default_rng(0).normal(size=(60, 4))
  kept = fewshot.evaluate_features(x, labels, x, labels, num_classes=3, shots=(5, 25),
                                   skip_short=True)
  assert list(kept) == [5]  # 20 per class: 25-shot skipped (logged).
  with pytest.raises(fewshot.NotEnoughExamplesError) as error:
    fewshot.evaluate_features(x, labels, x, labels, num_classes=3, shots=(5, 25))
  assert error.value.shots == 25 and error.value.short == {0: 20, 1: 20, 2: 20}


def test_several_l2_values_are_chosen_on_held_out_training_examples_only():
  rng = np.random.default_rng(1)
  pool_x, pool_y = _clusters(rng, 5, 40, 16, spread=0.7)
  test_x, test_y = _clusters(np.random.default_rng(2), 5, 40, 16, spread=0.7)
  l2_regs = (0.01, 1.0, 100.0, 1e4)
  first = fewshot.evaluate_features(pool_x, pool_y, test_x, test_y, num_classes=5,
                                    shots=(1, 5), seeds=3, l2_regs=l2_regs)
  shuffled = fewshot.evaluate_features(pool_x, pool_y, test_x, rng.permutation(test_y),
                                       num_classes=5, shots=(1, 5), seeds=3, l2_regs=l2_regs)
  for k in (1, 5):  # The eval labels never choose the l2.
    assert first[k].l2_regs == shuffled[k].l2_regs
    assert set(first[k].l2_regs) <= set(l2_regs)
  two = np.concatenate([np.flatnonzero(pool_y == c)[:2] for c in range(5)])
  x, y = pool_x[two], pool_y[two]  # 2 per class: nothing beyond 2 shots to hold out.
  with pytest.raises(ValueError, match="Choosing among 4 l2 values needs held-out"):
    fewshot.evaluate_features(x, y, x, y, num_classes=5, shots=(2,), l2_regs=l2_regs)
  assert fewshot.default_train_per_class((1, 5, 25), 3, (1024.0,)) == 75
  assert fewshot.default_train_per_class((1, 5, 25), 3, l2_regs) == 85


class _PixelFeaturizer:
  """A `Featurizer` whose feature of an image is its pixel value (the example's id)."""

  def __init__(self):
    self.featurised = 0

  def gather(self, local):
    return np.asarray(local)

  def features(self, variables, images):
    del variables
    self.featurised += 1
    return data_utils.pixel_ids(images)[:, None].astype(np.float32)


def test_collect_keeps_the_first_examples_of_each_class_and_stops_reading(tmp_path):
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3,
                                        per_class={"train": 6, "test": 2}, size=4)
  config = config_lib.defaults.data_config()
  config.update(image_folder=folder, image_size=4)
  dataset = data.create_eval_dataset(config, global_batch_size=2, split="train")
  order = [(int(i), int(c)) for b in dataset for i, c, m in zip(
      data_utils.pixel_ids(b["image"]), b["labels"].argmax(-1), b["mask"]) if m]
  assert len(order) == 18

  featurizer = _PixelFeaturizer()
  kept = features_lib.collect(featurizer, None, dataset, num_classes=3, per_class=2)
  expected = [(i, c) for n, (i, c) in enumerate(order)
              if [cc for _, cc in order[:n]].count(c) < 2]
  assert list(zip(kept.features[:, 0].astype(int), kept.labels)) == expected
  last = order.index(expected[-1])  # Reading stopped in the batch of the last one kept.
  assert kept.read == min(18, (last // 2 + 1) * 2) < 18
  assert featurizer.featurised <= kept.read // 2  # Batches with nothing to keep: not run.

  first = features_lib.collect(_PixelFeaturizer(), None, dataset, num_classes=3,
                               max_examples=5)
  assert first.features[:, 0].astype(int).tolist() == [i for i, _ in order[:5]]


def _fixture_runner(folder, **fewshot_fields):
  """The official-format tiny ViT of tests/fixtures/vit_tiny (32x32 inputs) placed on the
  devices, and a training config that evaluates `folder` with it."""
  trained = inference.load(os.path.join(ROOT, "tests", "fixtures", "vit_tiny", "params.npz"))
  runner = inference.Runner(trained)
  config = ml_collections.ConfigDict(trained.config.to_dict())
  config.data.update(image_folder=folder, name=None)
  config.eval_batch_size = 4
  config.fewshot.update(every_steps=1, **fewshot_fields)
  return runner, config


def test_the_evaluator_of_a_tiny_model_uses_the_sharded_features_step(tmp_path):
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3,
                                        per_class={"train": 8, "test": 3}, size=32)
  runner, config = _fixture_runner(folder, shots=(1, 2), seeds=2)
  evaluator = fewshot.Evaluator.from_config(config, runner.setup)
  assert evaluator.train_per_class == 4 and not evaluator.strict
  [result] = evaluator.evaluate(runner.state)
  assert (result.task.name, result.pool, result.test) == ("images", 12, 9)

  # The same numbers from every example's features, the pool selected by hand.
  def direct(split):
    out = [(evaluator.featurizer.features(runner.state, b["image"])[b["mask"]],
            b["labels"].argmax(-1)[b["mask"]])
           for b in data.create_eval_dataset(config.data, 4, split=split)]
    return np.concatenate([f for f, _ in out]), np.concatenate([y for _, y in out])

  train_x, train_y = direct("train")
  first = np.array([i for i in range(len(train_y)) if (train_y[:i] == train_y[i]).sum() < 4])
  assert result.read == (first[-1] // 4 + 1) * 4 < 24  # Stopped after the batch completing it.
  test_x, test_y = direct("test")
  expected = fewshot.evaluate_features(train_x[first], train_y[first], test_x, test_y,
                                       num_classes=3, shots=(1, 2), seeds=2)
  scalars = evaluator.run(runner.state)
  assert sorted(scalars) == ["fewshot/images_1shot", "fewshot/images_1shot_std",
                             "fewshot/images_2shot", "fewshot/images_2shot_std"]
  for k, r in expected.items():
    assert scalars[f"fewshot/images_{k}shot"] == pytest.approx(r.mean, abs=1e-6)
    assert scalars[f"fewshot/images_{k}shot_std"] == pytest.approx(r.std, abs=1e-6)


def test_the_evaluator_names_the_flags_of_a_bad_split_or_dataset(tmp_path):
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=2, per_class=1,
                                        size=8)
  runner, config = _fixture_runner(folder, train_split="validation")
  setup = runner.setup
  with pytest.raises(ValueError, match=r"Few-shot dataset '.*images': Bad "
                     r"config.fewshot.train_split='validation' .*\(splits: \['test', 'train'\]\)"):
    fewshot.Evaluator.from_config(config, setup)
  multi_label = data_utils.make_multilabel_dataset(str(tmp_path / "tfds"))
  with config.unlocked():
    config.fewshot.update(datasets=(multi_label,), train_split=None)
  with pytest.raises(ValueError, match="has multi-hot labels; few-shot linear evaluation needs "
                     "one label per image"):
    fewshot.Evaluator.from_config(config, setup)
  configs = fewshot.task_data_configs(config)
  assert [(c.name, c.image_folder, c.train_split, c.eval_split, c.cache) for c in configs] == [
      (multi_label, None, "train", "test", False)]


@pytest.mark.parametrize("key, value, message", [
    ("every_steps", -1, r"config.fewshot.every_steps=-1 must be an int >= 0 \(every this many "
     r"steps, and at the end of training; 0 turns few-shot evaluation off\); set "
     r"config.fewshot.every_steps to such a value."),
    ("shots", (0, 5), r"config.fewshot.shots=\(0, 5\) must be a non-empty tuple of distinct "
     r"positive ints \(training examples per class of each probe\); set config.fewshot.shots to "
     r"such a value, e.g. config.fewshot.shots=1,5,10,25."),
    ("shots", (5, 5), r"config.fewshot.shots=\(5, 5\) must be a non-empty tuple of distinct"),
    ("seeds", 0, r"config.fewshot.seeds=0 must be a positive int"),
    ("l2_regs", (-1.0,), r"config.fewshot.l2_regs=\(-1.0,\) must be a non-empty tuple of "
     r"numbers > 0 \(the ridge penalties .*\); set config.fewshot.l2_regs"),
    ("l2_regs", (), r"config.fewshot.l2_regs=\(\) must be a non-empty tuple of numbers > 0 \(the "
     r"ridge penalties \(big_vision's: 1024.0\), .*e.g. config.fewshot.l2_regs=1024.0."),
    ("datasets", ("cifar10", "cifar10"), r"names a dataset twice; list each once in "
     r"config.fewshot.datasets."),
    ("datasets", ("cifar10,",), r"config.fewshot.datasets=\('cifar10,',\) must be a tuple of "
     r"tfds names"),
    ("train_per_class", 10, r"config.fewshot.train_per_class=10 keeps fewer training examples "
     r"per class than the largest shot count, 25; set config.fewshot.train_per_class to at "
     r"least 25 \(or None\)."),
    ("train_split", "", r"config.fewshot.train_split='' must be a non-empty split name or None"),
    ("max_eval_examples", 0, r"config.fewshot.max_eval_examples=0 must be a positive int or "
     r"None"),
])
def test_config_refuses_bad_fewshot_values_naming_the_flag(key, value, message):
  config = config_lib.get_config("ViT-Ti_16", "cifar10")
  config.update(total_steps=10, batch_size=8)
  config.optim.warmup_steps = 0
  config.fewshot[key] = value
  with pytest.raises(ValueError, match=message):
    config_lib.resolve(config, num_train_examples=100, num_classes=10)


def test_config_normalises_fewshot_lists():
  config = config_lib.get_config("ViT-Ti_16", "cifar10")
  config.update(total_steps=10, batch_size=8)
  config.optim.warmup_steps = 0
  assert config.fewshot.every_steps == 0  # Off by default.
  config.fewshot.update(datasets=("cifar10,dtd",), shots=(10, 1), l2_regs=(1, 32))
  fs = config_lib.resolve(config, num_train_examples=100, num_classes=10).fewshot
  assert (fs.datasets, fs.shots, fs.l2_regs) == (("cifar10", "dtd"), (1, 10), (1.0, 32.0))


def _colour_folder(root, size=32, per_class=None):
  """root/{train,test}/{red,green,blue}/*.png: noisy images of three colours."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  per_class = per_class or {"train": 6, "test": 4}
  rng = np.random.default_rng(0)
  for split, count in per_class.items():
    for c, name in enumerate(("red", "green", "blue")):
      os.makedirs(os.path.join(root, split, name))
      for k in range(count):
        image = rng.integers(0, 60, (size, size, 3))
        image[..., c] += 180
        png = tf.io.encode_png(tf.constant(image.astype(np.uint8))).numpy()
        with open(os.path.join(root, split, name, f"{k}.png"), "wb") as f:
          f.write(png)
  return root


@pytest.mark.slow
def test_command_on_the_official_tiny_npz_and_an_image_folder(tmp_path, capsys):
  folder = _colour_folder(str(tmp_path / "colours"))
  npz = os.path.join(ROOT, "tests", "fixtures", "vit_tiny", "params.npz")
  out = subprocess.run([sys.executable, "-m", "vit_jax.fewshot", npz, "--image-folder", folder,
                        "--shots", "1,2,5", "--seeds", "2", "--json"], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                       timeout=120)
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)
  assert {k: report[k] for k in ("source", "dataset", "train_split", "eval_split",
                                 "train_examples", "train_read", "eval_examples", "seeds",
                                 "l2_regs")} == {
      "source": npz, "dataset": folder, "train_split": "train", "eval_split": "test",
      "train_examples": 18, "train_read": 18, "eval_examples": 12, "seeds": 2,
      "l2_regs": [1024.0]}
  assert list(report["results"]) == ["1", "2", "5"]
  five = report["results"]["5"]
  assert five == {"mean": 1.0, "std": 0.0, "accuracies": [1.0, 1.0], "l2": [1024.0, 1024.0]}
  assert report["scalars"]["fewshot/colours_5shot"] == 1.0

  # The same in this process, asking for more shots than a class has.
  assert fewshot_tool.main([npz, "--image-folder", folder, "--shots", "1,10"]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err.splitlines()[-1] == (
      "FATAL: 10-shot on colours: 3 of 3 classes have fewer than 10 examples in the train split "
      "'train' ('blue': 6, 'green': 6, 'red': 6); lower --shots or give a larger --train-split.")


def test_command_reports_bad_input_in_one_line(tmp_path, capsys):
  folder = _colour_folder(str(tmp_path / "colours"))
  os.makedirs(tmp_path / "flat")
  with open(tmp_path / "flat" / "a.png", "wb") as f:
    f.write(open(os.path.join(folder, "train", "red", "0.png"), "rb").read())
  npz = os.path.join(ROOT, "tests", "fixtures", "vit_tiny", "params.npz")
  cases = [
      ([str(tmp_path / "missing"), "--image-folder", folder],
       f"FATAL: {tmp_path / 'missing'} does not exist: give a training workdir"),
      ([npz, "--image-folder", folder, "--shots", "1,1"],
       "FATAL: --shots 1,1 repeats a value; list each once."),
      ([npz, "--image-folder", folder, "--shots", "0,5"],
       "FATAL: argument --shots: '0,5' is not comma-separated integers > 0 (e.g. 1,5,10,25)"),
      ([npz], f"FATAL: {npz} is not a training workdir, so it has no training data to evaluate "
       "on: give --data NAME (tfds) or --image-folder DIR."),
      ([npz, "--data", "no_such_dataset"], "FATAL: Few-shot dataset 'no_such_dataset': "
       "--data='no_such_dataset' is neither a registered tfds dataset nor a directory."),
      ([npz, "--image-folder", str(tmp_path / "flat")],
       f"FATAL: Few-shot dataset '{tmp_path / 'flat'}': No images found under "
       f"{tmp_path / 'flat'}/<split>/<class>/*.{{jpg,jpeg,png}}."),
      ([npz, "--image-folder", folder, "--eval-split", "validation"],
       f"FATAL: Few-shot dataset '{folder}': Bad --eval-split='validation' for dataset"),
  ]  # More shots than a class has: test_command_on_the_official_tiny_npz_and_an_image_folder.
  for argv, message in cases:
    with pytest.raises(SystemExit) if "argument" in message else contextlib.nullcontext():
      code = fewshot_tool.main(argv)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1].startswith(message), (argv, captured.err)
    assert "argument" in message or code == 2


def test_command_table():
  report = {"source": "/w (step 10, parameters)", "dataset": "fashion_mnist_local",
            "train_split": "train", "eval_split": "test", "train_examples": 750,
            "train_read": 1024, "eval_examples": 10000, "seeds": 3, "l2_regs": [1024.0],
            "results": {"1": {"mean": 0.61234, "std": 0.0123}, "10": {"mean": 0.8, "std": 0.0}}}
  assert fewshot_tool.table(report).splitlines() == [
      "Few-shot linear evaluation of /w (step 10, parameters)",
      "on fashion_mnist_local: 750 training examples kept of 1024 read from 'train', 10000 eval "
      "examples of 'test'; 3 seed(s), l2 1024.",
      "shots  accuracy (mean +- std over seeds)",
      "    1   61.23% +- 1.23%",
      "   10   80.00% +- 0.00%"]
