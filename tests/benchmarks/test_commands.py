"""The commands of benchmarks/ (`python -m benchmarks`, `python -m benchmarks.measure_attention`)
follow the convention of vit_jax's tools (vit_jax.tools.common), and refuse bad input before
measuring."""

import importlib
import inspect
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tool", ["measure_attention", "cli"])
def test_every_tool_follows_one_convention(tool):
  """Each tool's main is wrapped by common.exit_status (it raises, the runner answers) and its
  run_main is the program, which `python -m benchmarks` (benchmarks/__main__.py) runs."""
  module = importlib.import_module(f"benchmarks.{tool}")
  assert module.main.__wrapped__ and callable(module.run_main)
  assert "common.fatal(" not in inspect.getsource(module.main.__wrapped__)
  entry = ROOT / "benchmarks" / "__main__.py"
  if tool == "cli":
    assert "run_main()" in entry.read_text() and "common" not in entry.read_text()


def test_measure_attention_refuses_a_json_folder_that_is_missing_before_measuring(
    monkeypatch, capsys):
  """Exit 2 naming the folder, before the minutes of measuring (no process started)."""
  from benchmarks import measure_attention  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(measure_attention, "measure", lambda *a, **k: pytest.fail("measured"))
  assert measure_attention.main(["--core", "--json", "/no/such/dir/core.json"]) == 2
  assert capsys.readouterr().err == (
      "FATAL: --json /no/such/dir/core.json: the directory /no/such/dir does not exist.\n")


def test_the_old_command_names_the_new_one():
  """`python -m vit_jax.benchmark` (the harness's command until it left the package)."""
  done = subprocess.run([sys.executable, "-m", "vit_jax.benchmark", "ViT-Ti_16"], cwd=ROOT,
                        capture_output=True, text=True, check=False)
  assert (done.returncode, done.stdout) == (2, "")
  assert done.stderr == ("FATAL: the benchmark is no longer part of the package: run `python -m "
                         "benchmarks` from the root of the vit_jax repository "
                         "(benchmarks/README.md).\n")
