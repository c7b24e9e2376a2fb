"""Tests of launch/gpu_benchmark.sh's arguments (CPU only, no JAX: well under a second).

The script runs against a fake `python` placed first on PATH: it appends its arguments to a log
(NUL-separated), answers `jax.default_backend()` with $FAKE_BACKEND, and for
`-m benchmarks` prints one line and writes the `--json` file, as the real one does (and records
its PYTHONPATH).
"""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "gpu_benchmark.sh"
PROG = "launch/gpu_benchmark.sh"

FAKE_PYTHON = r"""#!/bin/sh
{ printf '%s\0' "$#"; printf '%s\0' "$@"; } >>"$FAKE_PY_LOG"
case "$2" in
  *default_backend*) echo "$FAKE_BACKEND"; exit 0 ;;
  *devices*) echo "devices: [CudaDevice(id=0)]"; exit 0 ;;
esac
printf '%s\n' "$PYTHONPATH" >"$FAKE_PY_LOG.pythonpath"
json=""
for arg in "$@"; do
  case "$arg" in --json=*) json="${arg#--json=}" ;; esac
done
echo "fake benchmark table"
[ -z "$json" ] || echo '{}' >"$json"
"""


@pytest.fixture
def bench(tmp_path):
  """run(*args, **env) -> CompletedProcess of the script in an empty directory `tmp_path/cwd`,
  with the fake python; run.calls() is the fake's argument lists."""
  bin_dir, cwd, log = tmp_path / "bin", tmp_path / "cwd", tmp_path / "python.log"
  bin_dir.mkdir()
  cwd.mkdir()
  fake = bin_dir / "python"
  fake.write_text(FAKE_PYTHON)
  fake.chmod(0o755)

  def run(*args, **env):
    full_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_PY_LOG": str(log),
                "FAKE_BACKEND": "gpu", "HOME": str(tmp_path)}
    full_env.update(env)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=60, check=False)

  def calls():
    if not log.exists():
      return []
    fields, out = log.read_bytes().decode().split("\0")[:-1], []
    while fields:
      n = int(fields[0])
      out.append(fields[1:1 + n])
      fields = fields[1 + n:]
    return out

  run.calls, run.cwd = calls, cwd
  run.pythonpath = lambda: (tmp_path / "python.log.pythonpath").read_text()
  return run


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_touches_nothing(bench, flag):
  result = bench(flag)
  assert (result.returncode, result.stderr) == (0, "")
  assert result.stdout.startswith(f"Usage: {PROG} [OUT_DIR]\n")
  assert "-h, --help" in result.stdout and "Exit status: 0, 1" in result.stdout
  assert bench.calls() == [] and list(bench.cwd.iterdir()) == []  # No '--help' directory.
  assert bench("out", flag).returncode == 0 and list(bench.cwd.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown option '--bogus' (see 'launch/gpu_benchmark.sh --help')"),
    (["-x"], "unknown option '-x' (see 'launch/gpu_benchmark.sh --help')"),
    (["--out=dir"], "unknown option '--out=dir' (see 'launch/gpu_benchmark.sh --help')"),
    (["out", "--bogus"], "unknown option '--bogus' (see 'launch/gpu_benchmark.sh --help')"),
    (["a", "b"], "one OUT_DIR at most, got 2: a b (see 'launch/gpu_benchmark.sh --help')"),
    (["--", "a", "b"], "one OUT_DIR at most, got 2: a b (see 'launch/gpu_benchmark.sh --help')"),
    ([""], "OUT_DIR is empty: give a directory, or none for $OUT or ./gpu_benchmark"),
])
def test_bad_arguments_exit_2_with_one_line(bench, args, message):
  result = bench(*args)
  assert (result.returncode, result.stdout) == (2, "")
  assert result.stderr == f"{PROG}: error: {message}\n"
  assert bench.calls() == [] and list(bench.cwd.iterdir()) == []


def _benchmark_calls(out):
  return [["-m", "benchmarks", "ViT-B_16", "ViT-L_16", "--dtype", "bfloat16", "--mode",
           "train", "--batch", str(b), "--warmup", "3", "--steps", "10", "--timeout", "240",
           f"--json={out}/bf16_b{b}.json"] for b in (64, 256)]


@pytest.mark.parametrize("args, env, out", [
    (["results"], {}, "results"),
    (["--", "-odd"], {}, "-odd"),  # A directory named like an option, after --.
    ([], {"OUT": "from_env"}, "from_env"),
    ([], {}, "gpu_benchmark"),
])
def test_out_dir_receives_the_reports(bench, args, env, out):
  result = bench(*args, **env)
  assert result.returncode == 0, result.stderr
  calls = bench.calls()
  assert calls[2:] == _benchmark_calls(out)
  assert sorted(p.name for p in (bench.cwd / out).iterdir()) == [
      "bf16_b256.json", "bf16_b256.txt", "bf16_b64.json", "bf16_b64.txt"]
  assert (bench.cwd / out / "bf16_b64.txt").read_text() == "fake benchmark table\n"


def test_the_benchmark_imports_this_checkout_from_any_directory(bench):
  """benchmarks/ is not installed: the script puts the repository root first on PYTHONPATH."""
  assert bench("results", PYTHONPATH="/elsewhere").returncode == 0
  assert bench.pythonpath() == f"{REPO}{os.pathsep}/elsewhere\n"
  assert bench("results").returncode == 0
  assert bench.pythonpath() == f"{REPO}\n"


def test_a_machine_without_gpu_is_refused(bench):
  result = bench("results", FAKE_BACKEND="cpu")
  assert (result.returncode, result.stdout) == (2, "")
  assert result.stderr.startswith(f"{PROG}: error: JAX sees no GPU (backend: cpu).")
  assert list(bench.cwd.iterdir()) == []
