"""`python -m vit_jax.export`: the artifact, loaded by a process that imports only jax and numpy,
gives `vit_jax.predict`'s logits at two batch sizes (an official .npz, a T2T-ViT with a crop and
the ImageNet mean/std, a trained workdir with uint8 input); `serving.json` states the
preprocessing; bad input is one FATAL line and loses nothing."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest

from vit_jax.checkpoint import durable
from vit_jax.data import files
from vit_jax.tools import common
from vit_jax.tools import export
from vit_jax.tools import predict

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
NPZ = str(FIXTURES / "vit_tiny" / "params.npz")
PTH = str(FIXTURES / "t2t_tiny_performer" / "checkpoint.pth.tar")
T2T_SET = ["embed_dim=64", "depth=2", "num_heads=2", "mlp_ratio=2.0", "token_dim=16",
           "tokens_type='performer'", "qk_scale=0.125"]

#: Serves requests, one JSON line each on stdin, [OUT, RESULT, *BATCHES]: runs OUT's artifact
#: on each .npy of pixels (jax and numpy only), saves the logits to RESULT.npz and answers one
#: JSON line: the serving.json input dtype and the vit_jax/flax/TF modules imported so far (or
#: the traceback of a failure).
LOADER = r"""
import json, sys, traceback
import numpy as np
import jax
for line in sys.stdin:
  try:
    out, result, *batches = json.loads(line)
    with open(out + '/model.jax_export', 'rb') as f:
      exported = jax.export.deserialize(bytearray(f.read()))
    with open(out + '/serving.json') as f:
      spec = json.load(f)
    logits = [np.asarray(exported.call(np.load(b).astype(spec['input']['dtype'])))
              for b in batches]
    np.savez(result, *logits)
    answer = [spec['input']['dtype'], sorted(
        m for m in sys.modules if m.split('.')[0] in ('vit_jax', 'flax', 'tensorflow'))]
  except Exception:  # pylint: disable=broad-except
    answer = {'error': traceback.format_exc()}
  print(json.dumps(answer), flush=True)
"""


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
  """The LOADER process, shared by this module's tests (on each xdist worker): starting one
  (importing jax) takes 1.9 s of CPU."""
  cwd = tmp_path_factory.mktemp("loader")
  with open(cwd / "stderr.txt", "w+") as stderr:
    with subprocess.Popen([sys.executable, "-c", LOADER], cwd=cwd, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=stderr, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu")) as process:

      def run(*request):
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
        stderr.seek(0)
        assert line, f"the loader ended ({process.poll()}): {stderr.read()[-3000:]}"
        return json.loads(line)

      yield run
      process.stdin.close()
      process.wait(timeout=60)


def _run_artifact(loader, out, tmp_path, *batches):
  """The logits of OUT's artifact on each batch of pixels, in the `loader` process (jax, numpy
  alone)."""
  paths = []
  for i, pixels in enumerate(batches):
    paths.append(str(tmp_path / f"pixels{i}.npy"))
    np.save(paths[-1], pixels)
  result = tmp_path / "logits.npz"
  answer = loader(str(out), str(result), *paths)
  assert "error" not in answer, answer["error"][-3000:]
  dtype, modules = answer
  assert modules == [], f"the loader imported {modules}"
  with np.load(result) as logits:
    return dtype, [logits[f"arr_{i}"] for i in range(len(batches))]


def _pngs(tmp_path, shapes, seed=0):
  rng = np.random.default_rng(seed)
  paths = []
  for i, shape in enumerate(shapes):
    paths.append(str(tmp_path / f"image{i}.png"))
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(paths[-1])
  return paths


def _predict_logits(predictor, paths):
  """`python -m vit_jax.predict`'s logits of image files (its preprocessing, its runner)."""
  return predictor.runner.logits(np.stack([predictor.preprocess(p) for p in paths]))


def _pixels(trained, paths):
  """The float32 pixels in [0, 255] predict's preprocessing gives before it normalises."""
  data = trained.config.data
  return np.stack([files.eval_input(p, size=trained.image_size, normalization=None,
                                    crop_pct=data.eval_crop_pct) for p in paths])


def _export(capsys, *argv):
  assert export.main([str(a) for a in argv]) == 0, capsys.readouterr().err
  return capsys.readouterr().out


def test_an_npz_serves_predicts_logits_at_two_batch_sizes_with_jax_alone(tmp_path, capsys,
                                                                          loader):
  out = tmp_path / "serving"
  printed = _export(capsys, NPZ, out)
  assert sorted(os.listdir(out)) == [export.ARTIFACT, export.SPEC]
  assert "float32 [B, 32, 32, 3] RGB pixels in [0, 255]" in printed
  spec = json.loads((out / export.SPEC).read_text())
  assert spec["platforms"] == ["cpu", "tpu"]  # TPU lowered here, without one.
  assert spec["input"]["shape"] == ["B", 32, 32, 3] and spec["output"]["shape"] == ["B", 10]
  assert spec["input"]["normalization_in_graph"]["formula"] == "pixels / 127.5 - 1"
  assert spec["preprocessing"]["resize"] == {"method": "bilinear", "antialias": False,
                                             "size": [32, 32], "keep_aspect_ratio": False}
  assert spec["classes"] == {"count": 10, "names": None}
  assert spec["model"]["name"] == "ViT-custom" and spec["model"]["fields"]["hidden_size"] == 32
  assert spec["model"]["fields"]["attention"] == "xla"  # No custom call in the artifact.
  # Images of other sizes: predict resizes them (bilinear, fractional pixels).
  paths = _pngs(tmp_path, [(20, 24, 3), (40, 32, 3), (32, 32, 3), (9, 50, 3), (32, 33, 3)])
  predictor = predict.Predictor(NPZ, batch_size=2)
  expected = _predict_logits(predictor, paths)
  pixels = _pixels(predictor.trained, paths)
  dtype, (three, five) = _run_artifact(loader, out, tmp_path, pixels[:3], pixels)
  assert dtype == "float32" and three.shape == (3, 10) and five.shape == (5, 10)
  np.testing.assert_allclose(three, expected[:3], rtol=0, atol=1e-5)
  np.testing.assert_allclose(five, expected, rtol=0, atol=1e-5)
  assert np.abs(expected).max() > 0.1  # Not a degenerate model.


@pytest.mark.golden
def test_the_artifact_gives_the_official_reference_logits(tmp_path, capsys, loader):
  out = tmp_path / "serving"
  _export(capsys, NPZ, out, "--platforms", "cpu", "--batch-size", "2")
  spec = json.loads((out / export.SPEC).read_text())
  assert spec["platforms"] == ["cpu"] and spec["input"]["shape"] == [2, 32, 32, 3]
  inputs = np.load(FIXTURES / "vit_tiny" / "inputs.npy")[:2]  # In [-1, 1].
  _, (logits,) = _run_artifact(loader, out, tmp_path, (inputs + 1.) * 127.5)
  np.testing.assert_allclose(logits, np.load(FIXTURES / "vit_tiny" / "logits.npy")[:2],
                             rtol=0, atol=1e-5)


def test_a_t2t_vit_serves_with_its_crop_and_the_imagenet_mean_std(tmp_path, capsys, loader):
  out = tmp_path / "t2t"
  _export(capsys, PTH, out, "--model", "T2T-ViT-custom",
          *(a for s in T2T_SET for a in ("--set", s)))
  spec = json.loads((out / export.SPEC).read_text())
  assert spec["preprocessing"]["resize"] == {
      "method": "bicubic", "antialias": True, "shorter_side": 71, "center_crop": [64, 64],
      "crop_pct": 0.9, "keep_aspect_ratio": True}
  norm = spec["input"]["normalization_in_graph"]
  assert norm["mean"] == [0.485, 0.456, 0.406] and norm["std"] == [0.229, 0.224, 0.225]
  assert spec["model"]["name"] == "T2T-ViT-custom"
  assert spec["model"]["fields"]["tokens_type"] == "performer"
  paths = _pngs(tmp_path, [(64, 80, 3), (70, 64, 3), (100, 100, 3)], seed=1)
  predictor = predict.Predictor(PTH, model_name="T2T-ViT-custom", batch_size=3,
                                overrides=dict(common.parse_setting(s) for s in T2T_SET))
  expected = _predict_logits(predictor, paths)
  pixels = _pixels(predictor.trained, paths)  # Bicubic: fractional values.
  _, (one, three) = _run_artifact(loader, out, tmp_path, pixels[:1], pixels)
  np.testing.assert_allclose(one, expected[:1], rtol=0, atol=1e-5)
  np.testing.assert_allclose(three, expected, rtol=0, atol=1e-5)


def test_a_timm_file_serves_with_the_preprocessing_of_its_config_json(tmp_path, capsys,
                                                                       loader):
  """timm's Hub config.json beside a DeiT III file states ImageNet's mean and std and
  crop_pct 1.0 (before: the ViT paper's pixels in [-1, 1], a plain resize)."""
  source = tmp_path / "deit3"
  source.mkdir()
  shutil.copy(FIXTURES / "ecosystem" / "timm_deit3" / "model.safetensors", source)
  (source / "config.json").write_text(json.dumps({
      "architecture": "deit3_small_patch16_224", "num_classes": 3,
      "pretrained_cfg": {"input_size": [3, 32, 32], "crop_pct": 1.0, "crop_mode": "center",
                         "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}))
  out = tmp_path / "serving"
  weights = source / "model.safetensors"
  _export(capsys, weights, out, "--set", "num_heads=2", "--platforms", "cpu")
  spec = json.loads((out / export.SPEC).read_text())
  assert spec["input"]["normalization_in_graph"] == {
      "name": "imagenet", "formula": "(pixels / 255 - mean) / std",
      "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
  assert spec["preprocessing"]["resize"] == {
      "method": "bicubic", "antialias": True, "shorter_side": 32, "center_crop": [32, 32],
      "crop_pct": 1.0, "keep_aspect_ratio": True}
  paths = _pngs(tmp_path, [(32, 40, 3), (48, 32, 3)], seed=3)
  predictor = predict.Predictor(str(weights), batch_size=2, overrides={"num_heads": 2})
  assert predictor.trained.config.data.normalization == "imagenet"
  expected = _predict_logits(predictor, paths)
  _, (logits,) = _run_artifact(loader, out, tmp_path, _pixels(predictor.trained, paths))
  np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)


def test_a_trained_workdir_serves_uint8_pixels_with_its_class_names(tiny_workdir, tmp_path,
                                                                      capsys, loader):
  workdir, _, _ = tiny_workdir
  out = tmp_path / "run"
  printed = _export(capsys, workdir, out, "--input-dtype", "uint8", "--platforms", "cpu")
  assert "uint8 [B, 8, 8, 3]" in printed
  spec = json.loads((out / export.SPEC).read_text())
  predictor = predict.Predictor(workdir, batch_size=4)
  assert spec["classes"]["names"] == list(predictor.label_names)
  assert spec["step"] == predictor.trained.step == 12
  assert spec["input"]["dtype"] == "uint8" and spec["preprocessing"]["round_to_integers"]
  assert spec["model"]["fields"]["scan"] is True  # Its scanned blocks: a loop in the graph.
  rng = np.random.default_rng(2)
  images = rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)  # The model's size: no resize.
  expected = predictor.runner.logits(np.stack([predictor.preprocess(x) for x in images]))
  dtype, (two, four) = _run_artifact(loader, out, tmp_path, images[:2], images)
  assert dtype == "uint8"
  np.testing.assert_allclose(two, expected[:2], rtol=0, atol=1e-5)
  np.testing.assert_allclose(four, expected, rtol=0, atol=1e-5)


def _command(*argv, cwd=ROOT):
  """`python -m vit_jax.export ARGV`: (exit status, stderr)."""
  done = subprocess.run([sys.executable, "-m", "vit_jax.export", *map(str, argv)], cwd=cwd,
                        capture_output=True, text=True, check=False)
  return done.returncode, done.stderr


def _before_setup(*argv):
  """`python -m vit_jax.export ARGV` in a process that reports whether JAX or TensorFlow loaded:
  (exit status, stdout, stderr)."""
  code = (f"import runpy, sys; sys.argv = ['x', *{[str(a) for a in argv]!r}]\n"
          "try:\n"
          "  runpy.run_module('vit_jax.export', run_name='__main__')\n"
          "except SystemExit as e:\n"
          "  print('exit', e.code)\n"
          "print('loaded:', sorted(m for m in ('jax', 'tensorflow') if m in sys.modules))")
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        check=False)
  return done.returncode, done.stdout, done.stderr


def test_the_help_and_an_existing_out_answer_before_jax_loads(tmp_path):
  _, out, _ = _before_setup("--help")
  assert "jax.export" in out and "Exit status" in out and "``" not in out
  assert out.rstrip().endswith("exit 0\nloaded: []")
  existing = tmp_path / "existing"
  existing.mkdir()
  (existing / "keep.txt").write_text("mine")
  _, out, err = _before_setup(NPZ, existing)
  assert err == (f"FATAL: {existing} exists; choose a new OUT or pass --overwrite (it is "
                 "replaced whole).\n")
  assert out == "exit 2\nloaded: []\n" and os.listdir(existing) == ["keep.txt"]


def test_bad_input_is_one_fatal_line_and_writes_nothing(tmp_path):
  missing = tmp_path / "missing.npz"
  code, err = _command(missing, tmp_path / "new")
  assert code == 2 and err == subprocess.run(  # The same line as predict's.
      [sys.executable, "-m", "vit_jax.predict", str(missing), NPZ], capture_output=True,
      text=True, check=False, cwd=ROOT).stderr
  assert err.startswith(f"FATAL: SOURCE '{missing}' does not exist: give ")
  code, err = _command(NPZ, tmp_path / "new", "--platforms", "cpu,gpu")
  assert (code, err) == (2, "FATAL: --platforms 'cpu,gpu': unknown gpu; give some of cpu, "
                            "cuda, rocm, tpu (comma-separated, e.g. cpu,tpu).\n")
  code, err = _command(tmp_path, tmp_path / "inside")
  assert code == 2 and err == (f"FATAL: {tmp_path / 'inside'} is (or contains, or is inside) the "
                               f"source {tmp_path}: write the export to a new path outside it.\n")
  assert not os.listdir(tmp_path)


def test_an_out_in_a_bucket_source_is_refused_before_the_setup():
  """The overlap is read from the names: a gs:// OUT inside a gs:// SOURCE is refused too."""
  parse = export._parser().parse_args
  error = export._precheck(parse(["gs://bkt/run", "gs://bkt/run/serving"]))
  assert str(error) == ("gs://bkt/run/serving is (or contains, or is inside) the source "
                        "gs://bkt/run: write the export to a new path outside it.")
  assert export._precheck(parse(["gs://bkt/run", "gs://bkt/run2"])) is None


def test_an_invalid_source_gets_predicts_error(tmp_path, capsys):
  bad = tmp_path / "weights.npz"
  bad.write_bytes(b"not a zip file")
  assert export.main([str(bad), str(tmp_path / "out")]) == 2
  expected = capsys.readouterr().err
  assert predict.main([str(bad), NPZ]) == 2
  assert capsys.readouterr().err == expected and expected.startswith("FATAL: ")
  assert expected.count("\n") == 1 and not (tmp_path / "out").exists()


def test_overwrite_replaces_whole_and_a_failed_write_keeps_the_old_export(tmp_path, capsys,
                                                                           monkeypatch):
  out = tmp_path / "serving"
  out.mkdir()
  (out / "old.txt").write_text("old")

  def fail(staging, target):
    raise OSError(28, "No space left on device", str(target))

  monkeypatch.setattr(durable, "move_into_place", fail)
  assert export.main([NPZ, str(out), "--overwrite", "--platforms", "cpu"]) == 1
  assert capsys.readouterr().err == f"FATAL: No space left on device: '{out}'\n"
  assert os.listdir(tmp_path) == ["serving"] and os.listdir(out) == ["old.txt"]
  monkeypatch.undo()
  _export(capsys, NPZ, out, "--overwrite", "--platforms", "cpu")
  assert sorted(os.listdir(out)) == [export.ARTIFACT, export.SPEC]
  assert sorted(os.listdir(tmp_path)) == ["serving"]  # No staging left beside it.


def test_a_model_that_needs_a_fixed_batch_or_is_too_large_is_one_fatal_line(tmp_path, capsys,
                                                                             monkeypatch):
  from vit_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  features_step = step_lib.make_features_step

  def batch_dependent(model, *, head=False):  # Python control flow on the batch size.
    step = features_step(model, head=head)
    return lambda state, images: step(state, images) * (2. if images.shape[0] > 1 else 1.)

  monkeypatch.setattr(step_lib, "make_features_step", batch_dependent)
  out = tmp_path / "out"
  assert export.main([NPZ, str(out), "--platforms", "cpu"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("FATAL: ViT-custom for cpu: the model needs a fixed batch size (")
  assert err.endswith("); give --batch-size N.\n") and err.count("\n") == 1
  assert not out.exists()
  _export(capsys, NPZ, out, "--platforms", "cpu", "--batch-size", "3")
  assert json.loads((out / export.SPEC).read_text())["input"]["shape"] == [3, 32, 32, 3]
  monkeypatch.setattr(export, "MAX_ARTIFACT_BYTES", 80_000)  # The fixture: 21,162 float32.
  assert export.main([NPZ, str(tmp_path / "big"), "--platforms", "cpu"]) == 2
  assert capsys.readouterr().err == (
      "FATAL: ViT-custom: its weights are 84,648 bytes, more than the 80,000 a jax.export "
      "artifact holds (a flatbuffer; the weights are constants in it): serve it with "
      "vit_jax.predict.Predictor.\n")
  assert sorted(os.listdir(tmp_path)) == ["out"]
