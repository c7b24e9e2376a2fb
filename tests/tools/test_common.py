"""What the command-line tools share (vit_jax.tools.common): one-line FATAL messages, the help."""

import subprocess
import sys

import pytest

from vit_jax.tools import common


def test_a_multi_line_error_is_one_fatal_line(capsys):
  assert common.fatal(ValueError("x does not fit:\n  missing keys (2): a, b\n  The checkpoint "
                                 "is a ViT with patch_size=4."), 2) == 2
  assert capsys.readouterr().err == ("FATAL: x does not fit: missing keys (2): a, b The "
                                     "checkpoint is a ViT with patch_size=4.\n")
  common.fatal(FileNotFoundError(2, "No such file or directory", "/nope"), 2)
  assert capsys.readouterr().err == "FATAL: No such file or directory: '/nope'\n"


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
