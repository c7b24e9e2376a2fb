"""`python -m vit_jax.predict` and `vit_jax.predict.Predictor`: the official fixtures and a trained
workdir through the predictor, the eval preprocessing of image files, the bad inputs of the
command (one FATAL line, exit 2; an undecodable image among good ones skipped with a warning)."""

import errno
import io
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

from vit_jax.data import preprocess
from vit_jax.tools import predict

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
NPZ = str(FIXTURES / "vit_tiny" / "params.npz")
PTH = str(FIXTURES / "t2t_tiny_performer" / "checkpoint.pth.tar")
T2T_FIELDS = dict(embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, token_dim=16,
                  tokens_type="performer", qk_scale=0.125)


def _softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def npz_predictor():
  return predict.Predictor(NPZ, batch_size=2)


def _write_png(path, array):
  Image.fromarray(array).save(path)
  return str(path)


def _random_image(seed, shape):
  return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_the_shim_exports_the_predictor_without_importing_jax():
  code = ("import sys, vit_jax.predict as p; assert 'jax' not in sys.modules; "
          "from vit_jax.predict import Predictor, Prediction; "
          "print(Predictor.__module__, Prediction._fields)")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       check=True).stdout
  assert out.strip() == "vit_jax.tools.predict ('label', 'index', 'probability')"


@pytest.mark.golden
def test_an_official_npz_predicts_the_softmax_of_its_reference_logits(npz_predictor):
  inputs = np.load(FIXTURES / "vit_tiny" / "inputs.npy")
  expected = _softmax(np.load(FIXTURES / "vit_tiny" / "logits.npy").astype(np.float64))
  top = npz_predictor.predict_inputs(inputs, top_k=10)
  assert npz_predictor.label_names is None and npz_predictor.image_size == 32
  for row, predictions in zip(expected, top):
    assert [p.index for p in predictions] == list(np.argsort(-row, kind="stable"))
    assert [p.label for p in predictions] == [str(p.index) for p in predictions]
    np.testing.assert_allclose([p.probability for p in predictions], np.sort(row)[::-1],
                               atol=1e-5)
  assert len(npz_predictor.predict_inputs(inputs, top_k=3)[0]) == 3
  with pytest.raises(ValueError, match=r"top_k=0: give 1 or more classes per image"):
    npz_predictor.predict_inputs(inputs, top_k=0)


def _with_head(path, num_classes, seed=0):
  """The vit_tiny fixture with a random head of ``num_classes`` (an official-format .npz)."""
  with np.load(NPZ) as fixture:
    arrays = {k: fixture[k] for k in fixture.files}
  rng = np.random.default_rng(seed)
  # Small logits: sigmoids far from 1, so that the order of the probabilities is the logits'.
  arrays["head/kernel"] = rng.normal(0, 0.05, (32, num_classes)).astype(np.float32)
  arrays["head/bias"] = np.zeros(num_classes, np.float32)
  np.savez(path, **arrays)
  return str(path)


@pytest.mark.slow
def test_official_imagenet_heads_get_the_imagenet_names_and_their_loss(tmp_path):
  """1,000 classes: ImageNet-1k names, softmax; 21,843: ImageNet-21k names, sigmoids."""
  image = _random_image(5, (32, 32, 3))
  predictor = predict.Predictor(_with_head(tmp_path / "in1k.npz", 1000), batch_size=1)
  assert predictor.label_names[0] == "tench" and predictor.trained.config.loss == "softmax_xent"
  top = predictor.predict(image, top_k=3)[0]
  assert [p.label for p in top] == [predictor.label_names[p.index] for p in top]
  probabilities = predictor.probabilities(image)[0]
  assert probabilities.sum() == pytest.approx(1.0, abs=1e-5)
  predictor = predict.Predictor(_with_head(tmp_path / "in21k.npz", 21843), batch_size=1)
  assert predictor.label_names[-1] == "knothole" and predictor.trained.multi_label
  logits = predictor.runner.logits(predictor.preprocess(image)[None])[0]
  top = predictor.predict(image, top_k=2)[0]
  assert top[0].probability == pytest.approx(1 / (1 + np.exp(-logits.max())), abs=1e-6)
  assert top[0].label == predictor.label_names[int(logits.argmax())]


@pytest.mark.slow
@pytest.mark.golden
def test_a_t2t_pth_tar_predicts_the_softmax_of_its_reference_ema_logits():
  predictor = predict.Predictor(PTH, model_name="T2T-ViT-custom", overrides=T2T_FIELDS,
                                batch_size=2)
  inputs = np.load(FIXTURES / "t2t_tiny_performer" / "inputs_nhwc.npy")
  expected = _softmax(np.load(FIXTURES / "t2t_tiny_performer" / "logits.npy").astype(np.float64))
  for row, predictions in zip(expected, predictor.predict_inputs(inputs, top_k=10)):
    assert [p.index for p in predictions] == list(np.argsort(-row, kind="stable"))
    np.testing.assert_allclose([p.probability for p in predictions], np.sort(row)[::-1],
                               atol=1e-5)
  # Files get the T2T-ViT evaluation: resize to 64 / 0.9 = 71 px, central 64 px, mean/std.
  data = predictor.trained.config.data
  assert (data.image_size, data.eval_crop_pct, data.normalization) == (64, 0.9, "imagenet")


def test_a_file_is_preprocessed_as_the_eval_pipeline_and_pil_and_arrays_as_the_file(
    npz_predictor, tmp_path):
  """A 20x13 RGB PNG predicted through its path has the probabilities of `Runner.logits` of
  `preprocess.eval_image` of the file's bytes; the same pixels as a PIL image or an array give
  the same; a grey image is the grey value in three channels (as `decode_rgb` makes it)."""
  rgb = _random_image(0, (20, 13, 3))
  path = _write_png(tmp_path / "rgb.png", rgb)
  trained, runner = npz_predictor.trained, npz_predictor.runner
  reference = preprocess.eval_image(tf.io.read_file(path), encoded=True, size=32,
                                    normalization="minus_one_to_one", crop_pct=None).numpy()
  expected = trained.probabilities(runner.logits(reference[None]))[0]
  np.testing.assert_array_equal(npz_predictor.preprocess(path), reference)
  for image in (path, pathlib.Path(path), Image.open(path), rgb, np.concatenate(
      [rgb, np.full((20, 13, 1), 255, np.uint8)], -1)):  # RGBA: the alpha is dropped.
    np.testing.assert_allclose(npz_predictor.probabilities(image)[0], expected, atol=1e-6)
  top = npz_predictor.predict([path, rgb], top_k=2)
  assert [len(t) for t in top] == [2, 2] and top[0] == top[1]
  assert top[0][0].index == int(np.argmax(expected))
  assert top[0][0].probability == pytest.approx(float(expected.max()), abs=1e-6)

  grey = _random_image(1, (9, 9))
  grey_path = _write_png(tmp_path / "grey.png", grey)
  as_rgb = np.repeat(grey[..., None], 3, -1)
  np.testing.assert_array_equal(npz_predictor.preprocess(grey_path),
                                npz_predictor.preprocess(as_rgb))
  np.testing.assert_array_equal(npz_predictor.preprocess(grey),
                                npz_predictor.preprocess(as_rgb))
  np.testing.assert_array_equal(npz_predictor.preprocess(Image.fromarray(grey)),
                                npz_predictor.preprocess(as_rgb))
  with pytest.raises(ValueError, match=r"an array of shape \(4, 4, 2\); an image is \[H, W\]"):
    npz_predictor.predict(np.zeros((4, 4, 2), np.uint8))


@pytest.mark.slow  # The shared tiny training run (tests/conftest.py) costs 10 s.
def test_a_workdir_predicts_the_class_names_of_its_image_folder(tiny_workdir):
  workdir, folder, _ = tiny_workdir
  with open(os.path.join(workdir, "dataset.json")) as f:
    assert json.load(f)["label_names"] == ["class_0", "class_1", "class_2"]
  predictor = predict.Predictor(workdir, batch_size=4)
  assert predictor.label_names == ("class_0", "class_1", "class_2")
  assert predictor.trained.step == 12
  paths = [os.path.join(folder, "test", f"class_{c}", "img_0.png") for c in range(3)]
  top = predictor.predict(paths, top_k=3)
  for predictions in top:
    assert sorted(p.label for p in predictions) == ["class_0", "class_1", "class_2"]
    assert [p.label for p in predictions] == [f"class_{p.index}" for p in predictions]
    assert sum(p.probability for p in predictions) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_the_command_on_a_workdir_prints_its_class_names(tiny_workdir, capsys):
  workdir, folder, _ = tiny_workdir
  paths = [os.path.join(folder, "test", f"class_{c}", "img_0.png") for c in range(3)]
  top = predict.Predictor(workdir).predict(paths, top_k=3)
  code, out, _ = _main(capsys, workdir, *paths, "--top-k", "3", "--json")
  assert code == 0
  assert [[(p["label"], p["index"]) for p in r["predictions"]] for r in json.loads(out)] == [
      [(p.label, p.index) for p in predictions] for predictions in top]
  code, out, _ = _main(capsys, workdir, paths[0], "--top-k", "1")
  assert code == 0
  assert out.splitlines()[0] == f"# {workdir} (step 12, parameters): 3 classes (softmax)"
  assert out.splitlines()[2:4] == [paths[0], f"  {100 * top[0][0].probability:6.2f}%  "
                                   f"{top[0][0].label}"]
  # A step's state directory is that step (issue 37: it was read as bare weights, and refused).
  state = os.path.join(workdir, "checkpoints", "12", "state")
  code, out, _ = _main(capsys, state, paths[0], "--top-k", "1")
  assert (code, out.splitlines()[0]) == (0, f"# {state} (step 12, parameters): 3 classes "
                                         "(softmax)")
  assert out.splitlines()[2:4] == [paths[0], f"  {100 * top[0][0].probability:6.2f}%  "
                                   f"{top[0][0].label}"]


def _main(capsys, *argv):
  code = predict.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


def test_bad_inputs_are_one_fatal_line_and_exit_status_2(capsys, tmp_path):
  image = _write_png(tmp_path / "a.png", _random_image(2, (8, 8, 3)))
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "notes.txt").write_text("no images here")
  latin1 = os.fsencode(tmp_path) + b"/caf\xe9.png"
  os.link(image, latin1)
  os.mkfifo(tmp_path / "fifo.npz")  # Issue 50: refused by what it is, never opened.
  for argv, message in [
      ([tmp_path / "fifo.npz", image],
       f"FATAL: {tmp_path / 'fifo.npz'} is a FIFO, not a file that can be read: give the path "
       "of a regular file."),
      ([NPZ, os.fsdecode(latin1)], f"FATAL: The file name {latin1!r} is not UTF-8, which "
       "TensorFlow cannot open: rename it (e.g. convmv -f latin1 -t utf8 --notest <file>) or "
       "move it away."),
      ([tmp_path / "no_model", image],
       f"FATAL: {tmp_path / 'no_model'} does not exist: give a training workdir"),
      ([NPZ, tmp_path / "missing.png"],
       f"FATAL: {tmp_path / 'missing.png'} does not exist: give image files or folders of them."),
      ([NPZ, tmp_path / "empty"],
       f"FATAL: {tmp_path / 'empty'} has no image files (.jpg .jpeg .png .bmp .gif .webp, in it "
       "or its subfolders): give image files or a folder of them."),
      ([NPZ, image, "--top-k", "0"], "FATAL: --top-k 0: give 1 or more classes per image."),
      ([NPZ, image, "--batch-size", "0"],
       "FATAL: --batch-size 0: give 1 or more images per batch."),
      ([NPZ, image, "--model", "ViT-B_16"], f"FATAL: {NPZ}")]:
    code, out, err = _main(capsys, *argv)
    assert (code, out) == (2, ""), (argv, err)
    assert err.count("\n") == 1 and err.startswith(message), (argv, err)
  # The wrong model names what the weights are.
  assert "ViT-B_16" in err and "Traceback" not in err


GIB = 2**30


def test_the_memory_estimate_of_an_image_size_and_a_batch_names_what_fits():
  """vit_tiny (width 32, 2 heads, patch 4) under XLA's attention, per image of S px: 4 float32
  inputs, 4 * S^2 * 3 * 4 B; N = (S / 4)^2 + 1 tokens, 14 * 4 * 32 * N + 4 copies * 2 heads *
  4 * N^2 B. 12000 px: 6.4 + 2,414,003.7 GiB; 480 px: 6.2 GiB fits 80% of 8 GiB, 484: 6.4 not.
  64 images of 224 px: 19.2 GiB; in 1 GiB fit 2 of them, or 64 of 96 px."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict(inference.load(NPZ).config.to_dict())
  config.model.attention = "xla"
  cpu = jax.devices("cpu")[:1]

  def refusal(size, batch, available):
    config.data.image_size = size
    with pytest.raises(ValueError) as raised:
      inference.check_memory(config, cpu, batch, host_bytes=available)
    return str(raised.value)

  assert refusal(12000, 1, 8 * GIB) == (
      "one 12000x12000 px image for ViT-custom needs ~2,414,010.1 GiB (4 float32 copies of the "
      "input: 6.4 GiB; the forward pass (xla attention's [tokens, tokens] matrices included): "
      "2,414,003.7 GiB), more than 80% of the 8.0 GiB available on this host. Give --image-size "
      "480 or less.")
  assert refusal(484, 1, 8 * GIB).endswith("Give --image-size 480 or less.")
  config.data.image_size = 480
  inference.check_memory(config, cpu, host_bytes=8 * GIB)
  assert refusal(224, 64, GIB) == (
      "64 images of 224x224 px for ViT-custom need ~19.2 GiB (4 float32 copies of the input: "
      "147.0 MiB; the forward pass (xla attention's [tokens, tokens] matrices included): 19.1 "
      "GiB), more than 80% of the 1.0 GiB available on this host. Give --image-size 96 or less "
      "or a batch of 2 or fewer images (--batch-size).")
  config.data.image_size = 224
  inference.check_memory(config, cpu, 2, host_bytes=GIB)
  inference.check_memory(config, cpu, 64, host_bytes=0)  # 0: unknown, unchecked.

  class Gpu:  # An accelerator: the forward pass in its memory, 32 of the 64 images each.
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def memory_stats(self):
      return {"bytes_limit": 8 * GIB}

  # 32 x 0.2985 GiB = 9.55 GiB; 42 images (21 each) fit 6.4 GiB, or 64 of 200 px.
  with pytest.raises(ValueError, match=re.escape(
      "the forward pass (xla attention's [tokens, tokens] matrices included): 9.6 GiB), more "
      "than 80% of the 8.0 GiB available on a NVIDIA H100 80GB HBM3. Give --image-size 200 or "
      "less or a batch of 42 or fewer images (--batch-size).")):
    inference.check_memory(config, [Gpu(), Gpu()], 64, host_bytes=1000 * GIB)
  inference.check_memory(config, [Gpu(), Gpu()], 42, host_bytes=1000 * GIB)


def test_an_image_size_beyond_the_memory_is_one_fatal_line_before_any_work(capsys, tmp_path,
                                                                           monkeypatch):
  """Issue 50: --image-size 100000 was TensorFlow's ResourceExhaustedError traceback after 18 s,
  12000 grew past 20 GB until killed. Every tool loads through `inference.load`, which checks."""
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  from vit_jax import platform  # pylint: disable=g-import-not-at-top
  from vit_jax.tools import analyze  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(platform, "available_memory_bytes", lambda: 8 * GIB)
  image = _write_png(tmp_path / "a.png", _random_image(2, (8, 8, 3)))
  for size in (100000, 12000):
    code, out, err = _main(capsys, NPZ, image, "--image-size", size)
    assert (code, out, err.count("\n")) == (2, "", 1), err
    found = re.fullmatch(
        rf"FATAL: one {size}x{size} px image for ViT-custom needs ~[\d,.]+ GiB \(4 float32 "
        r"copies of the input: [\d,.]+ GiB; the forward pass \(cpu_kernel attention's \[tokens, "
        r"tokens\] matrices included\): [\d,.]+ GiB\), more than 80% of the 8.0 GiB available "
        r"on this host. Give --image-size (\d+) or less.\n", err)
    assert found, err
    largest = int(found.group(1))  # A multiple of the patch that fits, the next one does not.
    trained = inference.load(NPZ, image_size=largest)
    with pytest.raises(ValueError, match=f"Give --image-size {largest} or less"):
      inference.load(NPZ, image_size=largest + 4)
    assert largest % 4 == 0 and trained.image_size == largest
  out_dir = tmp_path / "analysis"
  assert analyze.main([NPZ, "--images", image, "--image-size", "100000", "--out",
                       str(out_dir)]) == 2
  assert capsys.readouterr().err.startswith("FATAL: one 100000x100000 px image for ViT-custom")
  assert not out_dir.exists()
  # A batch the model cannot take at once, as a Predictor's (or the evaluation's): refused with
  # one that fits when the Runner is made, before any image is read.
  monkeypatch.setattr(platform, "available_memory_bytes", lambda: 2**20)
  with pytest.raises(ValueError, match=r"^64 images of 32x32 px for ViT-custom need .* more than "
                     r"80% of the 1.0 MiB available on this host. Give --image-size \d+ or less or "
                     r"a batch of \d+ or fewer images \(--batch-size\).$"):
    predict.Predictor(NPZ, batch_size=64)


def test_an_undecodable_image_is_skipped_and_only_bad_images_exit_2(capsys, tmp_path,
                                                                    monkeypatch, npz_predictor):
  # The command's model: the module's predictor (of the same file), compiled once.
  batches = []
  monkeypatch.setattr(predict, "Predictor",
                      lambda trained, batch_size: batches.append(batch_size) or npz_predictor)
  good = [_write_png(tmp_path / f"{i}.png", _random_image(i, (8, 8, 3))) for i in range(2)]
  bad = tmp_path / "broken.png"
  bad.write_bytes(b"this is not a PNG")
  empty = tmp_path / "empty.jpg"
  empty.write_bytes(b"")
  code, out, err = _main(capsys, NPZ, tmp_path, "--json", "--top-k", "2", "--batch-size", "2")
  assert code == 0
  warnings = [line for line in err.splitlines() if line.startswith("WARNING: skipped")]
  assert warnings == [
      f"WARNING: skipped {bad}: not a decodable image: Unknown image file format. One of JPEG, "
      "JPEG XL, PNG, GIF, BMP, WebP required.",
      f"WARNING: skipped {empty}: not a decodable image: Input is empty."]
  records = json.loads(out)
  assert [r["path"] for r in records] == good
  for record in records:
    assert [sorted(p) for p in record["predictions"]] == [["index", "label", "probability"]] * 2
    assert record["predictions"][0]["label"] is None  # The .npz has no class names.
  assert "predict: 4/4 images" in err  # Two batches: the progress line.
  assert batches == [2]

  code, out, err = _main(capsys, NPZ, good[0], "--top-k", "2")  # Text.
  lines = out.splitlines()
  assert (code, lines[0], lines[2], lines[5:]) == (
      0, f"# {NPZ}: 10 classes (softmax, no class names)", good[0], [""])
  for line, prediction in zip(lines[3:5], records[0]["predictions"]):
    assert line == f"  {100 * prediction['probability']:6.2f}%  class {prediction['index']}"

  code, out, err = _main(capsys, NPZ, bad, empty)
  assert (code, out) == (2, "")
  assert err.splitlines()[-1] == ("FATAL: none of the 2 image file(s) could be decoded (see the "
                                  "warnings above): give JPEG, PNG, GIF, BMP or WebP images.")
  assert err.count("WARNING: skipped") == 2


def test_links_back_into_a_folder_and_a_full_disk_end_with_one_line_each(capsys, tmp_path,
                                                                         monkeypatch,
                                                                         npz_predictor):
  """Issue 37: a folder with a link to its parent was walked without end; a link to itself, an
  image that cannot be read, was a traceback; `--json` onto a full disk was a traceback."""
  monkeypatch.setattr(predict, "Predictor", lambda trained, batch_size: npz_predictor)
  (tmp_path / "sub").mkdir()
  good = [_write_png(tmp_path / "a.png", _random_image(5, (8, 8, 3))),
          _write_png(tmp_path / "sub" / "b.png", _random_image(6, (8, 8, 3)))]
  (tmp_path / "sub" / "up").symlink_to("..")
  (tmp_path / "self.png").symlink_to("self.png")
  code, out, err = _main(capsys, NPZ, tmp_path, "--json", "--top-k", "1")
  assert code == 0 and [r["path"] for r in json.loads(out)] == good
  assert err.splitlines() == [
      f"WARNING: not entered {tmp_path / 'sub' / 'up'}: a link to a folder already listed.",
      f"WARNING: skipped {tmp_path / 'self.png'}: cannot be read: Too many levels of symbolic "
      "links"]

  class FullDisk(io.StringIO):
    def write(self, text):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  real = sys.stdout
  for text in ([], ["--json"]):
    monkeypatch.setattr(sys, "stdout", FullDisk())
    code = predict.main([NPZ, good[0], *text])
    monkeypatch.setattr(sys, "stdout", real)
    _, err = capsys.readouterr()
    assert (code, err) == (1, "FATAL: writing the results to standard output failed: No space "
                              "left on device. Free space there or send the output elsewhere "
                              "(> FILE on another disk).\n"), text


@pytest.mark.slow
def test_a_missing_image_is_refused_before_jax_and_tensorflow_load(tmp_path):
  """Issue 37: refused only after 19-50 s of set-up."""
  code = ("import sys; from vit_jax.tools import predict\n"
          f"sys.argv = ['predict', {NPZ!r}, {str(tmp_path / 'missing.png')!r}]\n"
          "try:\n  predict.run_main()\nexcept SystemExit as e:\n"
          "  print(e.code, 'jax' in sys.modules, 'tensorflow' in sys.modules)")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=60)
  assert proc.stdout.split() == ["2", "False", "False"], proc.stderr
  assert proc.stderr == (f"FATAL: {tmp_path / 'missing.png'} does not exist: give image files "
                         "or folders of them.\n")


@pytest.mark.slow
def test_the_command_prints_text_and_json(tmp_path):
  folder = tmp_path / "images"
  (folder / "sub").mkdir(parents=True)
  paths = [_write_png(folder / "b.png", _random_image(3, (10, 10, 3))),
           _write_png(folder / "sub" / "a.PNG", _random_image(4, (40, 30, 3)))]
  (folder / "readme.txt").write_text("not an image, and not taken from a folder")
  env = dict(os.environ, JAX_PLATFORMS="cpu")

  def run(*args):
    return subprocess.run([sys.executable, "-m", "vit_jax.predict", NPZ, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)

  proc = run(str(folder), "--json", "--top-k", "3")
  assert proc.returncode == 0, proc.stderr
  records = json.loads(proc.stdout)
  assert [r["path"] for r in records] == sorted(paths)
  for record in records:
    probabilities = [p["probability"] for p in record["predictions"]]
    assert probabilities == sorted(probabilities, reverse=True) and len(probabilities) == 3
  # Bad input's FATAL line and exit status 2: in process (the bad-input tests above), the
  # program's wiring of main()'s status being the same.
