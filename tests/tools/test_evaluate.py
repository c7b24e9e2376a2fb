"""`python -m vit_jax.evaluate` (vit_jax.tools.evaluate): the official-format fixtures and a
trained workdir evaluated on tiny image folders, checked against a direct computation and
against the training's own evaluation; the written files; bad input."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest

from tests import data_utils
from vit_jax import inference
from vit_jax import rundir
from vit_jax import train
from vit_jax.data import preprocess
from vit_jax.tools import eval_data
from vit_jax.tools import eval_report
from vit_jax.tools import common
from vit_jax.tools import evaluate

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
NPZ = str(FIXTURES / "vit_tiny" / "params.npz")
PTH = str(FIXTURES / "t2t_tiny_performer" / "checkpoint.pth.tar")
T2T_FLAGS = ["--model", "T2T-ViT-custom", "--set", "embed_dim=64", "--set", "depth=2",
             "--set", "num_heads=2", "--set", "mlp_ratio=2.0", "--set", "token_dim=16",
             "--set", "tokens_type=performer", "--set", "qk_scale=0.125"]
T2T_OVERRIDES = dict(embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, token_dim=16,
                     tokens_type="performer", qk_scale=0.125)
PER_CLASS = 3  # Test images per class of the 10-class folder.


@pytest.fixture(scope="module")
def folder10(tmp_path_factory):
  """10 classes, 3 constant 8x6 images per class and split (the models' inputs are 32 and 64
  px: the preprocessing resizes)."""
  return data_utils.make_image_folder(str(tmp_path_factory.mktemp("ten") / "images"),
                                      num_classes=10, per_class=PER_CLASS, size=(8, 6))


def _run(capsys, *args):
  """`main(args)` -> (exit status, stdout, the FATAL lines of stderr)."""
  status = evaluate.main([str(a) for a in args])
  out, err = capsys.readouterr()
  return status, out, [line for line in err.splitlines() if line.startswith("FATAL:")]


def _direct(trained, folder):
  """Labels, top-1 predictions and mean loss of the folder's test images, computed here: the
  constant images preprocessed by hand, the logits of `inference.Runner`."""
  labels, values = [], []
  for c in range(10):
    for k in range(PER_CLASS):
      labels.append(c)
      values.append(data_utils.folder_pixel_value("test", c, k, PER_CLASS))
  size = trained.image_size
  pixels = np.broadcast_to(np.asarray(values, np.float32)[:, None, None, None],
                           (len(values), size, size, 3))
  if trained.config.data.normalization == "minus_one_to_one":
    images = pixels / 127.5 - 1.0
  else:
    images = (pixels / 255.0 - np.asarray(preprocess.IMAGENET_MEAN, np.float32)) / np.asarray(
        preprocess.IMAGENET_STD, np.float32)
  logits = inference.Runner(trained).logits(images.astype(np.float32)).astype(np.float64)
  labels = np.asarray(labels)
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  top5 = np.argsort(-logits, axis=-1)[:, :5]
  return (labels, logits.argmax(-1), -log_probs[np.arange(len(labels)), labels].mean(),
          int((top5 == labels[:, None]).any(-1).sum()))


def _check_against_direct_computation(folder10, out, source, flags, overrides, stdout):
  metrics = json.loads((out / eval_report.METRICS_JSON).read_text())
  trained = inference.load(source, model_name=flags[1] if flags else None, overrides=overrides)
  labels, predicted, loss, top5 = _direct(trained, folder10)
  expected = np.zeros((10, 10), np.int64)
  np.add.at(expected, (labels, predicted), 1)
  assert metrics["count"] == 30 and metrics["correct"] == int((predicted == labels).sum())
  assert metrics["accuracy"] == metrics["correct"] / 30
  assert metrics["top5_accuracy"] == top5 / 30
  assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
  assert [c["correct"] for c in metrics["per_class"]] == list(np.diag(expected))
  assert [c["count"] for c in metrics["per_class"]] == [PER_CLASS] * 10
  assert [c["name"] for c in metrics["per_class"]] == [f"class_{c}" for c in range(10)]
  rows = (out / eval_report.CONFUSION_CSV).read_text().splitlines()
  assert rows[0] == "true \\ predicted," + ",".join(f"class_{c}" for c in range(10))
  assert [[int(v) for v in r.split(",")[1:]] for r in rows[1:]] == expected.tolist()
  assert metrics["data"] == {"name": folder10, "split": "test", "image_folder": True,
                             "num_classes": 10, "multi_label": False, "label_key": "label",
                             "bad_images": "fail"}
  assert (metrics["source"], metrics["step"], metrics["out"]) == (source, None, str(out))
  assert sorted(os.listdir(out)) == sorted(
      [eval_report.METRICS_JSON, eval_report.CONFUSION_PNG, eval_report.CONFUSION_CSV])
  with Image.open(out / eval_report.CONFUSION_PNG) as picture:
    assert picture.format == "PNG" and picture.size[0] >= 700 and picture.size[1] >= 600
  lines = stdout.splitlines()  # The summary.
  assert lines[0] == f"Evaluated {source} on {folder10}:test"
  assert lines[2] == f"  accuracy        {metrics['accuracy']:.4f}  ({metrics['correct']} of 30)"
  assert lines[3] == f"  top-5 accuracy  {metrics['top5_accuracy']:.4f}"
  assert lines[5] == "  per class:" and len(lines) == 6 + 10 + 1
  assert lines[6] == (f"    class_0  {metrics['per_class'][0]['accuracy']:.4f}  "
                      f"({expected[0, 0]} of 3)")
  assert lines[-1] == f"Wrote metrics.json, confusion_matrix.png, confusion_matrix.csv to {out}"
  return metrics


def test_an_official_npz_on_an_image_folder_matches_a_direct_computation(folder10, tmp_path,
                                                                         capsys):
  out = tmp_path / "out"
  status, stdout, fatal = _run(capsys, NPZ, "--image-folder", folder10, "--out", out)
  assert (status, fatal) == (0, [])
  metrics = _check_against_direct_computation(folder10, out, NPZ, [], None, stdout)
  assert metrics["preprocessing"] == {
      "image_size": 32, "eval_crop_pct": None, "normalization": "minus_one_to_one",
      "description": "bilinear resize of the whole image to 32x32; pixels / 127.5 - 1, in "
                     "[-1, 1]"}
  assert (metrics["batch_size"], metrics["loss_function"]) == (64, "softmax_xent")


@pytest.mark.slow
def test_a_t2t_file_on_an_image_folder_matches_a_direct_computation(folder10, tmp_path, capsys):
  """T2T-ViT files are evaluated as timm does: resize, central crop, ImageNet mean/std."""
  out = tmp_path / "out"
  status, stdout, fatal = _run(capsys, PTH, *T2T_FLAGS, "--image-folder", folder10, "--out", out)
  assert (status, fatal) == (0, [])
  metrics = _check_against_direct_computation(folder10, out, PTH, T2T_FLAGS, T2T_OVERRIDES,
                                              stdout)
  assert metrics["preprocessing"] == {
      "image_size": 64, "eval_crop_pct": 0.9, "normalization": "imagenet",
      "description": "bicubic resize of the shorter side to 71, central 64x64 crop; "
                     "(pixels / 255 - ImageNet mean) / ImageNet std"}


# ------------------------------------------------------------------------- a trained workdir


@pytest.fixture(scope="module")
def trained_run(shared_dir):
  """(folder, workdir, the training's final results) of a 2-step run on 3 classes that keeps a
  parameter EMA (so its evaluation reports 'test/...' and 'test_ema/...'). Trained once per run
  for all xdist workers (`shared_dir`, tests/conftest.py): a test that writes into the workdir
  copies it first."""

  def build(root):
    folder = data_utils.make_image_folder(str(root / "images"), num_classes=3, per_class=5,
                                          size=8)
    config = data_utils.folder_run_config("ViT-custom", folder, 8, total_steps=2, batch_size=4,
                                          hidden_size=8, mlp_dim=16, num_heads=2, num_layers=1,
                                          patch_size=4)
    config.async_checkpointing = False
    config.ema_decay = 0.5
    config.eval_batch_size = 4  # 15 test images: 4 batches, the last one padded.
    results = train.train_and_evaluate(config, str(root / "workdir"))
    (root / "results.json").write_text(json.dumps(
        {k: int(v) if k == "step" else float(v) for k, v in results.items()}))

  root = shared_dir("evaluate_run", build)
  return (str(root / "images"), str(root / "workdir"),
          json.loads((root / "results.json").read_text()))


@pytest.mark.slow
def test_a_workdir_reproduces_its_training_evaluation_exactly(trained_run, tmp_path, capsys):
  """The EMA by default ('test_ema/...' of the training), the parameters with --no-ema
  ('test/...'): the same numbers, at the config's eval batch size, from the same eval step."""
  folder, workdir, results = trained_run
  workdir = str(shutil.copytree(workdir, tmp_path / "workdir"))  # Results are written into it.
  status, stdout, fatal = _run(capsys, workdir, "--json")
  assert (status, fatal) == (0, [])
  ema = json.loads(stdout)
  assert ema["source"] == f"{workdir} (step 2, EMA parameters)"
  assert ema["accuracy"] == results["test_ema/accuracy"]  # Exactly.
  assert ema["loss"] == pytest.approx(results["test_ema/loss"], rel=1e-6)
  assert (ema["count"], ema["batch_size"], ema["step"]) == (15, 4, 2)
  assert ema["data"]["name"] == folder and ema["data"]["split"] == "test"
  out = os.path.join(workdir, "eval_images_test_step2")  # The default: inside the workdir.
  assert ema["out"] == out and os.path.isfile(os.path.join(out, eval_report.METRICS_JSON))
  # A second run never replaces it silently; the program says so before its set-up (the
  # folder told by the flags, the saved steps and config.json).
  status, _, fatal = _run(capsys, workdir)
  assert status == 2 and fatal == [
      f"FATAL: {out} already holds a result (metrics.json): pass --overwrite to replace it, or "
      "--out DIR for another directory."]
  parse = evaluate._parser().parse_args  # pylint: disable=protected-access
  assert eval_report.planned_out(parse([workdir])) == out
  assert eval_report.planned_out(parse([workdir, "--no-ema", "--step", "2"])) == out + "_no_ema"
  precheck = evaluate._precheck  # pylint: disable=protected-access
  assert f"FATAL: {common.reason(precheck(parse([workdir])))}" == fatal[0]
  status, stdout, _ = _run(capsys, workdir, "--no-ema", "--json")
  params = json.loads(stdout)
  assert status == 0 and params["out"] == out + "_no_ema"
  assert params["source"] == f"{workdir} (step 2, parameters)"
  assert params["accuracy"] == results["test/accuracy"]
  assert params["loss"] == pytest.approx(results["test/loss"], rel=1e-6)
  # Another batch size scores the same examples, each once.
  status, stdout, _ = _run(capsys, workdir, "--no-ema", "--batch-size", 2, "--json", "--out",
                           os.path.join(workdir, "b2"))
  assert status == 0 and json.loads(stdout)["correct"] == params["correct"]
  # Writing fails (a file where a directory should be): exit status 1, after the evaluation.
  blocker = os.path.join(workdir, "a_file")
  open(blocker, "w").close()
  status, stdout, fatal = _run(capsys, workdir, "--out", os.path.join(blocker, "out"))
  assert (status, stdout, fatal) == (1, "", [f"FATAL: {blocker} is not a directory"])


@pytest.mark.slow
def test_the_command_line(trained_run, tmp_path):
  """`python -m vit_jax.evaluate` in a subprocess: the summary, exit status 0, the files."""
  folder, workdir, results = trained_run
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  command = [sys.executable, "-m", "vit_jax.evaluate", workdir, "--out", str(tmp_path / "out")]
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  accuracy = results["test_ema/accuracy"]
  lines = proc.stdout.splitlines()
  assert lines[0] == f"Evaluated {workdir} (step 2, EMA parameters) on {folder}:test"
  assert lines[2] == f"  accuracy        {accuracy:.4f}  ({round(accuracy * 15)} of 15)"
  assert lines[-1] == ("Wrote metrics.json, confusion_matrix.png, confusion_matrix.csv to "
                       f"{tmp_path / 'out'}")
  assert (tmp_path / "out" / eval_report.CONFUSION_PNG).is_file()
  assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------- bad input


def _npz_with_classes(path, classes):
  """The tiny ViT .npz with a random head of `classes` classes, written to `path`."""
  with np.load(NPZ) as saved:
    params = dict(saved)
  rng = np.random.default_rng(0)
  params["head/kernel"] = rng.normal(size=(32, classes)).astype(np.float32)
  params["head/bias"] = np.zeros(classes, np.float32)
  np.savez(path, **params)
  return str(path)


@pytest.fixture(scope="module")
def imagenet_npz(tmp_path_factory):
  """A 1000-class ('ImageNet') model for --real."""
  return _npz_with_classes(tmp_path_factory.mktemp("in1k") / "in1k.npz", 1000)


@pytest.mark.slow
def test_multi_label_data_is_scored_with_precision_at_1(tmp_path, capsys):
  """As training scores it: a hit when the top class is among the labels; no per-class
  accuracy or confusion matrix."""
  dataset = data_utils.make_multilabel_dataset(str(tmp_path / "tfds"), num_test=10)
  source = _npz_with_classes(tmp_path / "five.npz", data_utils.MULTILABEL_NUM_CLASSES)
  capsys.readouterr()  # What tfds printed while preparing the dataset.
  status, stdout, fatal = _run(capsys, source, "--data", f"{dataset}:test", "--out",
                               tmp_path / "out", "--json")
  assert (status, fatal) == (0, [])
  metrics = json.loads(stdout)
  trained = inference.load(source)
  ids = np.arange(data_utils.MULTILABEL_TEST_START, data_utils.MULTILABEL_TEST_START + 10)
  images = np.broadcast_to((ids / 127.5 - 1.0).astype(np.float32)[:, None, None, None],
                           (10, 32, 32, 3))
  top1 = inference.Runner(trained).logits(images).argmax(-1)
  hits = sum(int(t) in data_utils.multilabel_labels(i) for t, i in zip(top1, ids))
  assert (metrics["metric"], metrics["count"], metrics["correct"]) == ("precision@1", 10, hits)
  assert metrics["per_class"] is None and metrics["note"].startswith("multi-label data")
  assert metrics["data"]["multi_label"] and metrics["data"]["label_key"] == "labels"
  assert os.listdir(tmp_path / "out") == [eval_report.METRICS_JSON]


def _check_fatal(capsys, cases):
  for args, message in cases:
    status, stdout, fatal = _run(capsys, *args)
    assert (status, fatal, stdout) == (2, [f"FATAL: {message}"], ""), args


def test_bad_data_is_one_fatal_line_and_exit_status_2(folder10, tmp_path, capsys):
  three = data_utils.make_image_folder(str(tmp_path / "three"), num_classes=3, per_class=1,
                                       size=8)
  (tmp_path / "no_images" / "test" / "cat").mkdir(parents=True)
  (tmp_path / "empty").mkdir()
  cases = [
      ([NPZ, "--image-folder", tmp_path / "missing"],
       f"--image-folder {tmp_path / 'missing'}: no such directory; give a folder of "
       "<split>/<class>/*.jpg (e.g. test/cat/1.jpg)."),
      ([NPZ, "--image-folder", tmp_path / "no_images"],
       f"--image-folder {tmp_path / 'no_images'}: split 'test' has no images "
       f"({tmp_path / 'no_images'}/test/<class>/*.{{jpg,jpeg,png}}); choose another split."),
      ([NPZ, "--image-folder", tmp_path / "empty"],
       f"No images found under {tmp_path / 'empty'}/<split>/<class>/*.{{jpg,jpeg,png}}."),
      ([NPZ, "--data", "no_such_dataset:test"],
       "--data no_such_dataset: no tfds dataset is registered under that name (nor is it a "
       "directory): give a tfds name (e.g. fashion_mnist_local, cifar10), the path of a "
       "prepared tfds dataset, or --image-folder DIR."),
      ([NPZ, "--image-folder", three],
       f"--image-folder {three} has 3 classes (class_0, class_1, class_2); the model's head has "
       "10: evaluate it on data with the same 10 classes, in the same order."),
      ([NPZ, "--image-folder", folder10, "--split", "validation"],
       f"--image-folder {folder10} has no split 'validation' (its splits: test, train): choose "
       "one with --split or --data NAME:SPLIT."),
  ]
  _check_fatal(capsys, cases)


def test_a_bad_source_or_arguments_are_one_fatal_line_and_exit_status_2(
    folder10, imagenet_npz, tmp_path, capsys):
  (tmp_path / "done").mkdir()
  (tmp_path / "done" / "metrics.json").write_text("{}")
  tfds_dir = tmp_path / "tfds"
  cases = [
      (["/no/such.npz", "--image-folder", folder10],
       f"/no/such.npz does not exist: give {inference.SOURCES}."),
      ([NPZ], f"{NPZ} is not a training workdir, so it has no dataset of its own: give --data "
              "NAME[:SPLIT] or --image-folder DIR."),
      ([NPZ, "--real"],
       "--real scores the ImageNet ReaL labels of the 1000 ImageNet classes; this model has 10 "
       "classes: evaluate it with --data or --image-folder instead."),
      ([imagenet_npz, "--real", "--data-dir", tfds_dir],
       f"--real: the tfds dataset imagenet2012_real is not prepared in {tfds_dir}. It needs the "
       "ImageNet validation images, a manual download (ILSVRC2012_img_val.tar from "
       "image-net.org): put the file in DIR, run `tfds build imagenet2012_real --manual_dir=DIR "
       "--data_dir=DATA` and pass --data-dir DATA."),
      ([NPZ, "--image-folder", folder10, "--out", tmp_path / "done"],
       f"{tmp_path / 'done'} already holds a result (metrics.json): pass --overwrite to replace "
       "it, or --out DIR for another directory."),
      ([NPZ, "--data", "fashion_mnist_local:test", "--split", "train"],
       "--data fashion_mnist_local:test names a split and --split train another: give one."),
      ([PTH, "--image-folder", folder10],
       f"{PTH} is a PyTorch checkpoint: name its model with --model (e.g. --model T2T-ViT-14 or "
       "--model T2T-ViT_t-14)."),
  ]
  _check_fatal(capsys, cases)
  assert not (tmp_path / "done" / "confusion_matrix.png").exists()


def test_the_model_s_classes_in_another_order_are_refused(folder10):
  """E.g. Fashion-MNIST images in folders named by class: sorted, they are not in label order."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  trained = inference.load(NPZ)
  reverse = tuple(f"class_{c}" for c in reversed(range(10)))
  with pytest.raises(ValueError) as error:
    eval_data.choose_data(dataclasses.replace(trained, label_names=reverse),
                          image_folder=folder10)
  assert str(error.value) == (
      f"--image-folder {folder10} has the model's classes in another order (the data's: "
      "class_0, class_1, class_2, ...; the model's: class_9, class_8, class_7, ...; an image "
      "folder's classes are its folder names, sorted): give the data the model's class order "
      "(e.g. folders named 0_<name>, 1_<name>, ...).")
  # The same names up to case and punctuation ('T-shirt/top' cannot name a folder): refused too.
  spelled = tuple(f"Class-{c}" for c in (1, 0, *range(2, 10)))
  with pytest.raises(ValueError, match="has the model's classes in another order"):
    eval_data.choose_data(dataclasses.replace(trained, label_names=spelled),
                          image_folder=folder10)
  chosen = eval_data.choose_data(trained, image_folder=folder10)
  other = dataclasses.replace(trained, label_names=tuple(f"n{c}" for c in range(10)))
  assert eval_report.names_note(trained, chosen) is None
  assert eval_report.names_note(other, chosen) == (
      "note: the data's class names differ from the model's (class 0: 'class_0' in the data, "
      "'n0' for the model); classes are matched by index.")
  assert eval_report.class_names(other, chosen)[:2] == ("n0", "n1")
  assert eval_report.class_names(trained, chosen)[:2] == ("class_0", "class_1")


def test_usage_errors(capsys):
  for args, message in [
      ([NPZ, "--data", "mnist", "--real"], "FATAL: give one of --data, --image-folder and --real."),
      ([NPZ, "--data", "mnist", "--batch-size", "0"],
       "FATAL: --batch-size 0: give a positive number.")]:
    with pytest.raises(SystemExit) as exit_info:
      evaluate.main(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == message


def test_an_undecodable_image_is_named_in_one_line(folder10, tmp_path, capsys):
  folder = str(tmp_path / "images")
  shutil.copytree(folder10, folder)
  bad = os.path.join(folder, "test", "class_3", "img_1.png")
  with open(bad, "wb") as f:
    f.write(b"not an image")
  status, _, fatal = _run(capsys, NPZ, "--image-folder", folder, "--out", tmp_path / "a")
  assert (status, fatal) == (2, [
      f"FATAL: 1 image(s) of split 'test' of {folder} cannot be decoded: {bad}; remove or "
      "replace them, or pass --skip-bad-images to leave them out."])
  status, stdout, _ = _run(capsys, NPZ, "--image-folder", folder, "--out", tmp_path / "b",
                           "--skip-bad-images", "--json")
  metrics = json.loads(stdout)
  assert status == 0 and metrics["count"] == 29 and metrics["per_class"][3]["count"] == 2


# ---------------------------------------------------------------------------------- helpers


def test_parse_data():
  assert eval_data.parse_data("cifar10") == ("cifar10", None)
  assert eval_data.parse_data("cifar10:test[:50%]") == ("cifar10", "test[:50%]")
  assert eval_data.parse_data("mnist:3.0.1") == ("mnist:3.0.1", None)
  assert eval_data.parse_data("mnist:3.0.1:train[:10]") == ("mnist:3.0.1", "train[:10]")
  assert eval_data.parse_data("imagenet2012_real/x:validation") == ("imagenet2012_real/x",
                                                                   "validation")
  assert eval_data.parse_data("gs://bucket/ds/1.0.0:test") == ("gs://bucket/ds/1.0.0", "test")


def test_the_output_folder_is_told_before_the_set_up(tmp_path):
  """`planned_out`: the folder of a workdir's own data (config.json), of --data NAME:SPLIT and
  of a file; None where only the dataset can tell (its default split)."""
  workdir = tmp_path / "w"
  (workdir / "checkpoints" / "30" / "state").mkdir(parents=True)
  (workdir / "checkpoints" / "30" / "state" / "_METADATA").write_text("{}")
  (workdir / "checkpoints" / "40.orbax-checkpoint-tmp-1").mkdir()
  (workdir / "config.json").write_text(json.dumps(
      {"data": {"name": "fashion_mnist_local", "image_folder": None, "eval_split": "test"}}))
  parse = evaluate._parser().parse_args  # pylint: disable=protected-access
  w = str(workdir)
  assert eval_report.planned_out(parse([w])) == f"{w}/eval_fashion_mnist_local_test_step30"
  assert eval_report.planned_out(parse([w, "--data", "cifar10:train[:10%]", "--no-ema"])) == (
      f"{w}/eval_cifar10_train_10_step30_no_ema")
  assert eval_report.planned_out(parse([w, "--image-folder", "/x/imgs/", "--split", "val"])) == (
      f"{w}/eval_imgs_val_step30")
  assert eval_report.planned_out(parse([NPZ, "--real"])) == (
      "./eval_params_imagenet2012_real_validation")
  for unknown in ([w, "--data", "cifar10"], [w, "--image-folder", "/x"], [NPZ],
                  [f"{w}/checkpoints", "--data", "cifar10:test"], [w, "--data", "a:b", "--real"]):
    assert eval_report.planned_out(parse(unknown)) is None, unknown
  out = workdir / "eval_fashion_mnist_local_test_step30"
  out.mkdir()
  precheck = evaluate._precheck  # pylint: disable=protected-access
  assert precheck(parse([w])) is None
  (out / eval_report.METRICS_JSON).write_text("{}")
  assert isinstance(precheck(parse([w])), FileExistsError)
  assert precheck(parse([w, "--overwrite"])) is None
  from vit_jax import evaluation  # pylint: disable=g-import-not-at-top
  eval_name = eval_report._eval_name  # pylint: disable=protected-access
  for text in ("train[98%:]", "a-b:c", "test"):
    assert eval_name(text) == evaluation.eval_name(text)


def test_workdir_of(tmp_path):
  workdir = tmp_path / "w"
  (workdir / "checkpoints" / "4" / "state").mkdir(parents=True)
  assert rundir.find(str(workdir)).workdir == str(workdir)
  assert rundir.find(str(workdir / "checkpoints")).workdir == str(workdir)
  assert rundir.find(str(workdir / "checkpoints" / "4")).workdir == str(workdir)
  assert rundir.find(NPZ).workdir is None


def test_the_confusion_matrix_picture_with_many_classes():
  """Indices instead of names on the axes beyond 30 classes; rows normalised; empty rows 0."""
  counts = np.zeros((40, 40), np.int64)
  counts[np.arange(39), np.arange(39)] = 3
  counts[0, 1] = 1
  rows = eval_report.normalized_rows(counts)
  assert rows[0, 0] == 0.75 and rows[0, 1] == 0.25 and not rows[39].any()
  import io  # pylint: disable=g-import-not-at-top
  with Image.open(io.BytesIO(eval_report.png_bytes(counts, [f"c{i}" for i in range(40)],
                                                     "title"))) as picture:
    assert picture.format == "PNG" and picture.size == (1350, 1200)
