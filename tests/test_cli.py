"""The command line's flag parsing (vit_jax.cli) as `python -m vit_jax.main` uses it."""

import pathlib
import subprocess
import sys

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
