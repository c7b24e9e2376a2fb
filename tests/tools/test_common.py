"""What the command-line tools share (vit_jax.tools.common): one-line FATAL messages, the help."""

import argparse
import pathlib
import subprocess
import sys

import pytest

from vit_jax.tools import common

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_multi_line_error_is_one_fatal_line(capsys):
  assert common.fatal(ValueError("x does not fit:\n  missing keys (2): a, b\n  The checkpoint "
                                 "is a ViT with patch_size=4."), 2) == 2
  assert capsys.readouterr().err == ("FATAL: x does not fit: missing keys (2): a, b The "
                                     "checkpoint is a ViT with patch_size=4.\n")
  common.fatal(FileNotFoundError(2, "No such file or directory", "/nope"), 2)
  assert capsys.readouterr().err == "FATAL: No such file or directory: '/nope'\n"


@pytest.mark.parametrize("tool, argv, fatal", [
    ("predict", ["gs:///x.npz", "x.png"],
     "FATAL: SOURCE gs:///x.npz names no bucket: write gs://BUCKET/x.npz.\n"),
    ("convert", ["x.npz", "gs://"], "FATAL: DST gs:// names no bucket: write gs://BUCKET/PATH.\n"),
    ("to_array_record", ["x", "--data-dir", "gs://My_Bucket/tfds"],
     "FATAL: --data-dir gs://My_Bucket/tfds: 'My_Bucket' is not a Cloud Storage bucket name (3-63 "
     "characters of a-z, 0-9, '-', '_' and '.', beginning and ending with a letter or digit): "
     "write gs://BUCKET/tfds with the name of your bucket.\n"),
], ids=["predict", "convert", "to_array_record"])
def test_a_gs_url_without_a_bucket_is_a_usage_error_of_every_tool(tool, argv, fatal, capsys):
  """Every tool's parser checks each gs:// argument (SOURCE, DST, --data-dir, ...): one FATAL line
  naming the argument and the fix, exit 2, before anything reads it (was: TensorFlow's traceback
  "GCS path doesn't contain a bucket name")."""
  import importlib  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(f"vit_jax.tools.{tool}")
  with pytest.raises(SystemExit) as info:
    module.main(argv)
  assert info.value.code == 2 and capsys.readouterr().err == fatal


def test_settings_are_python_literals_or_strings():
  assert common.parse_setting("embed_dim=64") == ("embed_dim", 64)
  assert common.parse_setting("tokens_type=performer") == ("tokens_type", "performer")
  with pytest.raises(ValueError, match=r"--set 'embed_dim': expected KEY=VALUE"):
    common.parse_setting("embed_dim")


@pytest.mark.parametrize("tool", ["predict", "evaluate", "fewshot"])
def test_the_help_explains_exit_statuses_without_loading_jax(tool):
  """`--help` answers before the set-up (no JAX or TensorFlow import), in plain text."""
  code = ("import runpy, sys; sys.argv = ['x', '--help']\n"
          "try:\n"
          f"  runpy.run_module('vit_jax.{tool}', run_name='__main__')\n"
          "except SystemExit as e:\n"
          "  assert e.code == 0, e.code\n"
          "print('loaded:', sorted(m for m in ('jax', 'tensorflow') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert "Exit status" in out.stdout and "``" not in out.stdout
  assert out.stdout.rstrip().endswith("loaded: []")


@pytest.mark.parametrize("tool, flags, message", [
    ("predict", ["--top-k"], "argument --top-k: expected one argument"),
    ("evaluate", ["run", "--bogus"], "unrecognized arguments: --bogus"),
    ("fewshot", ["run", "--shots", "five"], "argument --shots"),
    ("analyze", ["run"], "the following arguments are required: --out"),
    ("predict", ["/no/such/run", "x.png"], "SOURCE '/no/such/run' does not exist: give a "
     "training workdir"),
    ("evaluate", ["no_such_dir"], "SOURCE 'no_such_dir' does not exist"),
])
def test_flags_that_do_not_parse_stop_before_loading_jax(tool, flags, message):
  """A usage error, or a local SOURCE with nothing there, is one FATAL line and exit status 2
  at once, before the set-up's imports."""
  code = (f"import runpy, sys; sys.argv = ['x', *{flags!r}]\n"
          "try:\n"
          f"  runpy.run_module('vit_jax.{tool}', run_name='__main__')\n"
          "except SystemExit as e:\n"
          "  print('exit', e.code)\n"
          "print('loaded:', sorted(m for m in ('jax', 'tensorflow') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.stdout.split("\n")[:2] == ["exit 2", "loaded: []"], (out.stdout, out.stderr)
  fatal = [line for line in out.stderr.splitlines() if line.startswith("FATAL:")]
  assert len(fatal) == 1 and message in fatal[0], out.stderr


def test_a_run_that_has_saved_nothing_is_refused_before_the_set_up(tmp_path):
  """A workdir without a finalized step: one FATAL line that says what to do, told by the file
  system before the set-up (the message's module imports JAX; TensorFlow is never loaded)."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "1000.orbax-checkpoint-tmp-17").mkdir(parents=True)
  (workdir / "config.json").write_text('{"checkpoint_every_steps": 500}')
  code = (f"import runpy, sys; sys.argv = ['x', {str(workdir)!r}]\n"
          "try:\n"
          "  runpy.run_module('vit_jax.evaluate', run_name='__main__')\n"
          "except SystemExit as e:\n"
          "  print('exit', e.code)\n"
          "print('loaded:', sorted(m for m in ('jax', 'tensorflow') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.stdout.split("\n")[:2] == ["exit 2", "loaded: ['jax']"], (out.stdout, out.stderr)
  assert out.stderr.splitlines()[-1] == (
      f"FATAL: No finalized checkpoint step at '{workdir}/checkpoints': the save of step 1000 "
      "is being written (or was cut off; the next start of the run removes it). Wait for its "
      f"first checkpoint, or train it first (python -m vit_jax.main --config ... --workdir "
      f"{workdir}); then give the workdir again, or one step directory "
      "<workdir>/checkpoints/<step>.")
  (workdir / "checkpoints" / "1000.orbax-checkpoint-tmp-17").rmdir()
  error = common.unsaved_run(argparse.Namespace(source=str(workdir), step=None))
  assert common.reason(error).endswith(
      "the run has saved no checkpoint yet. Wait for its first checkpoint (it saves every 500 "
      "steps, checkpoint_every_steps in its config.json, and at its end), or train it first "
      f"(python -m vit_jax.main --config ... --workdir {workdir}); then give the workdir again, "
      "or one step directory <workdir>/checkpoints/<step>.")
  # A step saved (its state item's marker) is left to the tool; a --step that is not is refused.
  (workdir / "checkpoints" / "500" / "state").mkdir(parents=True)
  (workdir / "checkpoints" / "500" / "state" / "_METADATA").write_text("{}")
  assert common.unsaved_run(argparse.Namespace(source=str(workdir), step=None)) is None
  error = common.unsaved_run(argparse.Namespace(source=str(workdir), step=7))
  assert "Step 7 is not saved" in str(error) and "the saved steps are [500]" in str(error)
  assert common.unsaved_run(argparse.Namespace(source=str(tmp_path), step=None)) is None


def test_a_shot_count_no_class_can_give_is_refused_before_the_set_up(tmp_path):
  """fewshot's check from the flags and the file system: an image folder's class folders (its
  file counts bound its images from above), a known dataset's published split size."""
  from vit_jax.tools import fewshot  # pylint: disable=g-import-not-at-top
  parse = fewshot._parser().parse_args  # pylint: disable=protected-access
  precheck = fewshot._precheck  # pylint: disable=protected-access
  for c, files in (("cat", 3), ("dog", 5)):
    (tmp_path / "images" / "train" / c).mkdir(parents=True)
    for i in range(files):
      (tmp_path / "images" / "train" / c / f"{i}.png").write_bytes(b"")
  (tmp_path / "images" / "train" / "dog" / ".hidden.png").write_bytes(b"")
  images = str(tmp_path / "images")
  assert common.reason(precheck(parse(["m.npz", "--image-folder", images, "--shots", "1,6"]))) == (
      f"--shots 6: no class of {images}/train has 6 images (the most files are 5, in 'dog'); "
      "lower --shots to at most 5, or give a larger --train-split.")
  # 4 shots: 'cat' is short, which only reading the data tells (its images may be fewer).
  assert precheck(parse(["m.npz", "--image-folder", images, "--shots", "4"])) is None
  assert common.reason(precheck(parse(["m.npz", "--data", "cifar10", "--shots", "5001"]))) == (
      "--shots 5001: cifar10's split 'train' has 50,000 examples of 10 classes (its published "
      "size), 5,000 per class on average: fewer than 5001; lower --shots, or give a larger "
      "--train-split.")
  assert precheck(parse(["m.npz", "--data", "cifar10", "--shots", "5000"])) is None
  assert precheck(parse(["m.npz", "--data", "cifar10", "--train-split", "train[:10]",
                         "--shots", "5001"])) is None  # Sliced: left to the full check.
  # A workdir's own data, from its config.json.
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  (tmp_path / "run" / "config.json").write_text(
      '{"data": {"name": "fashion_mnist_local", "train_split": "train"}}')
  error = precheck(parse([str(tmp_path / "run"), "--shots", "7000"]))
  assert "fashion_mnist_local's split 'train' has 60,000 examples of 10 classes" in str(error)


def test_the_runner_answers_each_kind_of_error_with_one_line_and_its_status(capsys):
  """common.exit_status: bad input 2, a failure while working 1 (an output that could not be
  written, even a PermissionError), Ctrl-C 130; a config refusal's fix spelled as flags."""
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top

  def raising(error):
    @common.exit_status
    def main():
      raise error
    return main

  def writing():
    with common.output_errors():
      raise PermissionError(13, "Permission denied", "/out/x.png")

  for main, status, line in [
      (raising(ValueError("bad --x")), 2, "FATAL: bad --x"),
      (raising(config_lib.ConfigError("batch_size", 3, "must be even", "set config.batch_size=4.")),
       2, "FATAL: config.batch_size=3 must be even; set --config.batch_size=4."),
      (common.exit_status(writing), 1, "FATAL: Permission denied: '/out/x.png'"),
      (raising(common.WorkFailed("Measuring x failed")), 1, "FATAL: Measuring x failed"),
      (raising(KeyboardInterrupt()), 130, "FATAL: Stopped."),
      (raising(KeyboardInterrupt("Stopped by SIGTERM.")), 130, "FATAL: Stopped by SIGTERM.")]:
    assert main() == status
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize("tool", ["analyze", "convert", "cost", "evaluate", "export_images",
                                  "fewshot", "predict", "to_array_record", "preflight.cli"])
def test_every_tool_follows_one_convention(tool):
  """Each tool's main is wrapped by common.exit_status (it raises, the runner answers) and its
  run_main is the program, which `python -m vit_jax.<tool>` runs (benchmarks/'s tools:
  tests/benchmarks/test_commands.py)."""
  import importlib  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(f"vit_jax.tools.{tool}")
  assert module.main.__wrapped__ and callable(module.run_main)
  assert "common.fatal(" not in inspect.getsource(module.main.__wrapped__)
  entry = ROOT / "vit_jax" / (tool.split(".")[0] + ".py")
  if entry.exists():
    assert "run_main()" in entry.read_text() and "common" not in entry.read_text()
