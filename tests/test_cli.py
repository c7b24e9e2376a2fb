"""The command line's flag parsing (vit_jax.cli) as `python -m vit_jax.main` and the tools with
--config (cost, preflight) use it."""

import pathlib
import re
import subprocess
import sys

import pytest

from vit_jax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_help_explains_and_exits_0():
  """--help is not a failure: exit 0 (absl's own exit code is 1, vit_jax.main's code for a run
  that failed), the module's usage text on stdout, before JAX or TensorFlow load."""
  for flag in ("--help", "--helpshort", "-h"):
    proc = subprocess.run([sys.executable, "-m", "vit_jax.main", flag], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (flag, proc.stderr[-2000:])
    assert "Trains and evaluates a Vision Transformer" in proc.stdout
    assert "--workdir" in proc.stdout and "Exit codes: 0 done" in proc.stdout


def test_the_tools_load_the_config_as_main_does(monkeypatch):
  """vit_jax.cli.load_config (cost, preflight): ml_collections' --config and overrides; each
  refusal is one ValueError, with main's messages."""
  monkeypatch.chdir(ROOT)
  config = cli.load_config(["--config", "configs/fashion_mnist.py", "--config.batch_size", "7",
                            "--config.model.num_layers=3"])
  assert (config.batch_size, config.model.num_layers) == (7, 3) and config.is_locked
  assert cli.load_config([]) is None
  bad = ["--config=configs/fashion_mnist.py", "--config.optim.learning_rate=0.1"]
  with pytest.raises(ValueError) as refused:
    cli.load_config(bad)
  assert str(refused.value) == cli.unknown_override_message(bad)
  for argv, message in [(["--config=configs/nope.py"], "The config file 'configs/nope.py' "
                         "(--config=configs/nope.py) does not exist. The configs here: "),
                        (["--config=configs/fashion_mnist.py", "true"],
                         "Unexpected arguments: true"),
                        (["--bogus"], "Unknown command line flag 'bogus'")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      cli.load_config(argv)
