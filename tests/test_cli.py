"""The command line's flag parsing (vit_jax.cli) as `python -m vit_jax.main` and the tools with
--config (cost, preflight) use it."""

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from vit_jax import cli
from vit_jax import config as config_lib
from vit_jax import train
from vit_jax.tools import cost
from vit_jax.tools.preflight import cli as preflight_cli

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


def _first_token(line):
  """The flag at the start of a `config_help` line (a quoted value may hold spaces)."""
  lexer = shlex.shlex(line, posix=True)
  lexer.whitespace_split = True
  return lexer.get_token()


@pytest.mark.parametrize("argv", [
    ["--config=configs/fashion_mnist.py", "--config.optim.lr=0.5", "--config.fewshot.shots=(2,3)"],
    ["--config=configs/t2t.py:t2t_vit_7,cifar10"],
], ids=["vit", "t2t"])
def test_print_config_lists_every_key_as_a_flag_that_sets_it(argv, monkeypatch):
  """--print_config's lines are the flags that set each key (overrides and the regime applied),
  then the key's help: given back to --config, they rebuild the same config."""
  monkeypatch.chdir(ROOT)
  config = cli.load_config(argv)
  text = cli.config_help(config, argv[0].split("=", 1)[1], width=100)
  assert all(len(line) <= 100 for line in text.splitlines())
  flags = [_first_token(line) for line in text.splitlines() if line.startswith("--config.")]
  unset = [f for f in flags if f.endswith(">")]  # None: no flag sets it, its type is shown.
  assert "--config.num_classes=<int>" in unset and "--config.init_from=<str>" in unset
  leaves = lambda d: sum(leaves(v) if isinstance(v, dict) else 1 for v in d.values())
  assert len(flags) == leaves(config.to_dict())  # Every key, once.
  rebuilt = cli.load_config(argv[:1] + [f for f in flags if f not in unset])
  assert config_lib.fill_regime(rebuilt).to_dict() == config_lib.fill_regime(config).to_dict()
  if "--config.optim.lr=0.5" in argv:
    assert re.search(r"^--config\.optim\.lr=0\.5 +the peak learning rate; None: the regime's",
                     text, re.M)
    assert "--config.optim.optimizer=adamw" in flags  # The regime's value, filled in.
    assert re.search(r"^--config\.model\.num_layers=4 +L, the encoder blocks$", text, re.M)


def test_help_points_to_print_config_and_it_prints_the_keys(monkeypatch, capsys):
  """`vit_jax.main --help` (and cost's, preflight's) names --print_config, which prints every key
  with its help and exits 0 before any work (no --workdir needed).

  main's answers and cost's --help are its processes' (absl's exit code, before JAX loads);
  preflight's --help and the tools' --print_config are their `main(argv)` in this process (the
  same argparse code; a process of theirs imports JAX: 2.5 s of CPU each)."""
  for command in (["vit_jax.main", "--help"], ["vit_jax.cost", "--help"]):
    proc = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--print_config" in proc.stdout, (command, proc.stderr)
  with pytest.raises(SystemExit) as exited:
    preflight_cli.main(["--help"])
  assert exited.value.code == 0 and "--print_config" in capsys.readouterr().out
  argv = ["--config", "configs/fashion_mnist.py", "--config.batch_size=7", "--print_config"]
  proc = subprocess.run([sys.executable, "-m", "vit_jax.main", *argv], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  monkeypatch.chdir(ROOT)
  monkeypatch.setenv("COLUMNS", "100")  # The width a process without a terminal wraps to.
  outputs = {"vit_jax.main": proc.stdout}
  for command, tool_main in (("vit_jax.cost", cost.main), ("vit_jax.preflight",
                                                           preflight_cli.main)):
    assert tool_main(argv) == 0, command
    outputs[command] = capsys.readouterr().out
  for command, stdout in outputs.items():
    assert stdout.startswith("Every key of the config file configs/fashion_mnist.py"), command
    assert re.search(r"^--config\.batch_size=7 +the global batch over all devices", stdout,
                     re.M), command


def test_a_config_refusal_is_spelled_with_the_flags_on_the_command_line():
  """The library's ConfigError names settings as config.KEY; cli.error_text (main's and the
  tools' FATAL line) spells the fix's as flags, also through a wrapping error."""
  error = config_lib.ConfigError("optim.lr", -1.0, "must be > 0", "set config.optim.lr=0.1 or "
                                 "lower config.data.prefetch.")
  assert str(error) == ("config.optim.lr=-1.0 must be > 0; set config.optim.lr=0.1 or lower "
                        "config.data.prefetch.")
  flagged = ("config.optim.lr=-1.0 must be > 0; set --config.optim.lr=0.1 or lower "
             "--config.data.prefetch.")
  assert cli.error_text(error) == flagged
  try:
    try:
      raise error
    except ValueError as e:
      raise train.ConfigError(f"In the set-up: {e}") from e
  except train.ConfigError as wrapped:
    assert cli.error_text(wrapped) == f"In the set-up: {flagged}"
  assert cli.error_text(ValueError("config.x is not a key")) == "config.x is not a key"


def test_a_word_for_a_boolean_key_is_named_with_the_values_it_takes():
  """absl's own message is its args tuple: `('Non-boolean argument to boolean flag', 'maybe')`."""
  with pytest.raises(ValueError) as error:
    cli.load_config(["--config", "configs/fashion_mnist.py", "--config.async_checkpointing=maybe"])
  assert str(error.value) == ("flag --config.async_checkpointing=maybe: 'maybe' is not a boolean: "
                              "give True or False")


@pytest.mark.parametrize("flag,expected", [
    ("--config.batch_size=abc", "'abc' is not an integer: give a whole number, e.g. 128"),
    ("--config.batch_size=12.5", "'12.5' is not an integer: give a whole number, e.g. 128"),
    ("--config.optim.lr=fast", "'fast' is not a number: give one such as 0.5 or 1e-3")])
def test_a_word_for_a_number_key_says_what_the_key_takes(flag, expected):
  """Python's own messages (`invalid literal for int() with base 10: 'abc'`) name no fix."""
  with pytest.raises(ValueError) as error:
    cli.load_config(["--config", "configs/fashion_mnist.py", flag])
  assert str(error.value) == f"flag {flag}: {expected}"
