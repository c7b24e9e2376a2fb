"""Tests of launch/tpu.sh's gcsfuse mount (the data bucket mounted on every worker, the default
for data in a bucket; --no-gcsfuse reads gs:// directly) and --slices (multi-slice runs over a
queued resource), against the fake gcloud of test_tpu_sh.py.

The run script that `--command` carries is also executed here, as on a worker: under sh, with a
PATH of fakes (curl answers the TPU metadata, sudo only logs, gcsfuse and mountpoint keep a
mount's state in files, .venv/bin/python records its environment and arguments) and the mount
root /mnt/gcsfuse moved into a temporary directory.
"""

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.launch.test_tpu_sh import (CONFIG, LOC, PROJECT, ZONE, assert_posix_sh,  # noqa: F401
                                      checkout, describe, describe_qr, fails, fake_preflight,
                                      ok, remote_command, ssh, tpu, v3_8, v3_32)

MOUNT_TFDS = "/mnt/gcsfuse/bkt/tensorflow_datasets"
# The gcsfuse command of --bucket bkt with the default file cache (40 GiB in /tmp/gcsfuse-cache).
GCSFUSE_BKT = (
    "  if ! gcsfuse -o ro --implicit-dirs --type-cache-max-size-mb=-1 --stat-cache-max-size-mb=-1 "
    "--kernel-list-cache-ttl-secs=-1 --metadata-cache-ttl-secs=-1 "
    "--cache-dir=/tmp/gcsfuse-cache/bkt --file-cache-max-size-mb=40960 "
    "--file-cache-cache-file-for-range-read=true "
    '--log-file="$HOME"/vit_jax/logs/gcsfuse-bkt.log bkt /mnt/gcsfuse/bkt; then')


def train_line(*args):
  return ("PYTHONUNBUFFERED=1 setsid nohup .venv/bin/python -m vit_jax.main "
          + " ".join(args) + ' >"$log" 2>&1 </dev/null &')


def slices2(**extra):
  """Two slices of v5litepod-16 (4 workers each) from queued resource vit-ms-qr."""
  return {"TPU_NAME": "vit-ms", "TPU_ZONE": ZONE, "TPU_PROJECT": PROJECT,
          "TPU_TYPE": "v5litepod-16", "TPU_SLICES": "2", **extra}


READY_SLICES = {"FAKE_QR": "ACTIVE", "FAKE_TPU": "READY\tv5litepod-16"}


def qr_ssh(node, worker, command, batch=None):
  return ["compute", "tpus", "queued-resources", "ssh", "vit-ms-qr", *LOC, f"--node={node}",
          f"--worker={worker}", *([f"--batch-size={batch}"] if batch else []),
          f"--command={command}"]


def dry_script(tpu, *args, **env):
  """The --command script of a dry run's only ssh line."""
  out = ok(tpu(*args, "--dry-run", **env)).stdout
  (script,) = [a[len("--command="):] for a in shlex.split(out, comments=True)
               if a.startswith("--command=")]
  return script


# --------------------------------------------------------------------------------------------
# --help
# --------------------------------------------------------------------------------------------


def test_help_documents_gcsfuse_and_slices(tpu):
  out = ok(tpu("--help")).stdout
  for word in ("--gcsfuse ", "TPU_GCSFUSE=1", "--no-gcsfuse ", "TPU_GCSFUSE=0",
               "the default when the data is in a bucket", "send the",
               "rest of the file per read", 'docs/data.md "Reading', "--gcsfuse-cache-dir DIR",
               "TPU_GCSFUSE_CACHE_DIR",
               "--gcsfuse-cache-mb MB", "TPU_GCSFUSE_CACHE_MB", "/tmp/gcsfuse-cache",
               "40960 = 40 GiB", "boot disk is about 100 GiB", "/mnt/gcsfuse/BUCKET",
               "--unmount", "--slices N", "TPU_SLICES", "--slice K", "NAME-0 ... NAME-(N-1)",
               "--config.mesh.dcn_data=N", "MEGASCALE_*", "tpu-env", "logs --slice 1 --worker 3"):
    assert word in out, word


# --------------------------------------------------------------------------------------------
# gcsfuse: the default for data in a bucket; --gcsfuse, --no-gcsfuse
# --------------------------------------------------------------------------------------------


def test_run_mounts_the_bucket_by_default_v3_8(tpu):
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/b16", "--bucket", "bkt",
                  **v3_8(FAKE_TPU="READY\tv3-8", FAKE_BUCKET_LOCATION="EUROPE-WEST4")))
  calls = tpu.calls()
  assert [c[:4] for c in calls[:2]] == [describe("vit-v3-8")[:4],
                                        ["storage", "buckets", "describe", "gs://bkt"]]
  assert calls[2] == ssh("vit-v3-8", "all", remote_command(calls[2]))
  assert len(calls) == 3
  lines = remote_command(calls[2]).splitlines()
  train = train_line(f"--config={CONFIG}", "--workdir=gs://bkt/b16",
                     f"--config.data.data_dir={MOUNT_TFDS}")
  assert train in lines
  # Mounted (or kept) and checked before the old run is stopped and the new one started.
  for line in ("gcs_bucket=bkt", "gcs_mount=/mnt/gcsfuse/bkt", f"gcs_data_dir={MOUNT_TFDS}",
               "gcs_cache=/tmp/gcsfuse-cache/bkt", GCSFUSE_BKT,
               'if [ ! -d "$gcs_data_dir" ]; then'):
    assert lines.index(line) < lines.index('if pgrep -f "$pattern" >/dev/null; then'), line
  assert lines.index('if pgrep -f "$pattern" >/dev/null; then') < lines.index(train)
  assert ("gs://bkt/tensorflow_datasets, mounted read-only at /mnt/gcsfuse/bkt on every worker "
          "(--no-gcsfuse reads gs:// directly)") in result.stderr
  # --gcsfuse and TPU_GCSFUSE=1 (and a flag over TPU_GCSFUSE=0) ask for what is the default.
  default = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/b16", "--bucket",
                       "bkt", **v3_8())
  assert default == remote_command(calls[2])
  for flags, env in ((["--gcsfuse"], {}), ([], {"TPU_GCSFUSE": "1"}),
                     ([], {"TPU_GCSFUSE": "true"}), (["--gcsfuse"], {"TPU_GCSFUSE": "0"}),
                     (["--no-gcsfuse", "--gcsfuse"], {}), ([], {"TPU_GCSFUSE": ""})):
    assert dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/b16", "--bucket",
                      "bkt", *flags, **v3_8(**env)) == default, (flags, env)


def test_run_mounts_a_data_dir_bucket_by_default_and_never_a_local_one(tpu):
  script = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/pod", "--data-dir",
                      "gs://data-eu/tfds/v2", **v3_32())
  assert "gcs_url=gs://data-eu/tfds/v2" in script.splitlines()
  assert train_line(f"--config={CONFIG}", "--workdir=gs://bkt/pod",
                    "--config.data.data_dir=/mnt/gcsfuse/data-eu/tfds/v2") in script.splitlines()
  # A local --data-dir, or no data_dir at all: nothing to mount, and nothing said about it.
  for flags, data_dir in ((["--data-dir", "/mnt/disks/data/tfds"],
                           ["--config.data.data_dir=/mnt/disks/data/tfds"]), ([], [])):
    result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", *flags, "--dry-run",
                    **v3_8()))
    assert "gcsfuse" not in result.stdout and "gcsfuse" not in result.stderr
    script = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/x", *flags,
                        **v3_8())
    assert train_line(f"--config={CONFIG}", "--workdir=gs://bkt/x",
                      *data_dir) in script.splitlines()


@pytest.mark.parametrize("flags,env", [
    (["--no-gcsfuse"], {}), ([], {"TPU_GCSFUSE": "0"}), ([], {"TPU_GCSFUSE": "no"}),
    (["--no-gcsfuse"], {"TPU_GCSFUSE": "1"}), (["--gcsfuse", "--no-gcsfuse"], {}),
], ids=["flag", "env", "env-no", "flag-over-env", "last-flag"])
def test_no_gcsfuse_reads_the_bucket_directly(tpu, flags, env):
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/pod", "--bucket", "bkt",
                  "--config.batch_size=4096", *flags,
                  **v3_32(FAKE_TPU="READY\tv3-32", FAKE_BUCKET_LOCATION="EUROPE-WEST4", **env)))
  calls = tpu.calls()
  assert [c[:4] for c in calls[:2]] == [describe("vit-v3-32")[:4],
                                        ["storage", "buckets", "describe", "gs://bkt"]]
  assert calls[2] == ssh("vit-v3-32", "all", remote_command(calls[2]))
  assert len(calls) == 3
  script = remote_command(calls[2])
  assert "gcsfuse" not in script and "gcs_" not in script
  assert train_line(f"--config={CONFIG}", "--workdir=gs://bkt/pod",
                    "--config.data.data_dir=gs://bkt/tensorflow_datasets",
                    "--config.batch_size=4096") in script.splitlines()
  assert "gcsfuse" not in result.stderr and "warning" not in result.stderr
  # Nothing to mount, nothing checked: what would be refused with a mount is not.
  for more in (["--data-dir", "/data/tfds"], [], ["--gcsfuse-cache-mb", "40G"],
               ["--bucket", "bkt", "--config.data.data_dir=gs://other/tfds"]):
    out = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", *flags, *more,
                 "--dry-run", **v3_32(**env)))
    assert "gcsfuse" not in out.stdout and "gcsfuse" not in out.stderr, more


OVERRIDE_LINE = ("'--config.data.data_dir=gs://other/tfds' wins over gs://bkt/tensorflow_datasets: "
                 "no gcsfuse mount (the default for data in a bucket), vit_jax.main reads that "
                 "data_dir as it is (give it as --data-dir gs://BUCKET/PATH instead to read it "
                 "through the mount)")


def test_a_data_dir_override_turns_the_default_mount_off(tpu):
  """The user's --config.data.data_dir wins: no mount, one line that says so."""
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket", "bkt",
                  "--config.data.data_dir=gs://other/tfds",
                  **v3_8(FAKE_TPU="READY\tv3-8", FAKE_BUCKET_LOCATION="EUROPE-WEST4")))
  assert result.stderr.splitlines().count(OVERRIDE_LINE) == 1
  assert result.stderr.count("gcsfuse") == 1  # that line, and no mount reported
  calls = tpu.calls()
  # The region is checked for the bucket that is read: the override's.
  assert [c[3] for c in calls if c[0] == "storage"] == ["gs://bkt", "gs://other"]
  script = remote_command(calls[-1])
  assert "gcsfuse" not in script and "gcs_" not in script
  assert train_line(f"--config={CONFIG}", "--workdir=gs://bkt/x",
                    "--config.data.data_dir=gs://other/tfds") in script.splitlines()
  # The same with --data-dir gs://..., and for the override after -- as absl takes it
  # (--config.data.data_dir DIR); the dry run says it too.
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--data-dir",
                  "gs://bkt/tensorflow_datasets", "--dry-run", "--", "--config.data.data_dir",
                  "gs://other/tfds", **v3_8()))
  assert result.stderr.splitlines() == [OVERRIDE_LINE.replace("_dir=gs://", "_dir gs://")]
  (script,) = [a[len("--command="):] for a in shlex.split(result.stdout, comments=True)
               if a.startswith("--command=")]
  assert train_line(f"--config={CONFIG}", "--workdir=gs://bkt/x", "--config.data.data_dir",
                    "gs://other/tfds") in script.splitlines()
  assert "gcsfuse" not in script
  # A local override too. Without a bucket (nothing to mount) or with --no-gcsfuse: no line.
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket", "bkt",
                  "--config.data.data_dir=/mnt/disks/data/tfds", "--dry-run", **v3_8()))
  assert result.stderr.count("no gcsfuse mount") == 1
  assert "--config.data.data_dir=/mnt/disks/data/tfds" in result.stdout
  for flags in ([], ["--bucket", "bkt", "--no-gcsfuse"]):
    result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", *flags,
                    "--config.data.data_dir=gs://other/tfds", "--dry-run", **v3_8()))
    assert result.stderr == "" and "gcsfuse" not in result.stdout, flags


@pytest.mark.parametrize("flags,env", [
    (["--gcsfuse", "--config.data.data_dir=gs://other/tfds"], {}),
    (["--config.data.data_dir=gs://other/tfds"], {"TPU_GCSFUSE": "1"}),
    (["--gcsfuse", "--", "--config.data.data_dir", "gs://other/tfds"], {}),
])
def test_explicit_gcsfuse_refuses_a_data_dir_override(tpu, flags, env):
  for dry in ([], ["--dry-run"]):
    result = fails(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket", "bkt",
                       *dry, *flags, **v3_8(FAKE_TPU="READY\tv3-8", **env)),
                   "would replace the data_dir that --gcsfuse sets (the mounted path): give the "
                   "data as --data-dir gs://BUCKET/PATH instead, or drop --gcsfuse (the override "
                   "then turns the mount off")
    assert result.stdout == "" and tpu.calls() == []


def test_default_mount_checks_the_cache_settings(tpu):
  fails(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket", "bkt",
            "--gcsfuse-cache-mb", "40G", **v3_8(FAKE_TPU="READY\tv3-8")),
        "--gcsfuse-cache-mb must be a size in MiB (0 turns the file cache off), got '40G'")
  fails(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--data-dir", "gs://bkt/d",
            "--gcsfuse-cache-dir", "/mnt/gcsfuse/c", "--dry-run", **v3_8()),
        "--gcsfuse-cache-dir /mnt/gcsfuse/c is under /mnt/gcsfuse")
  fails(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket", "bkt",
            "--dry-run", **v3_8(TPU_GCSFUSE="maybe")), "expected a boolean", "'maybe'")
  assert tpu.calls() == []


def test_run_gcsfuse_v3_32_dry_run_prints_the_exact_command(tpu):
  """Every worker (--worker=all), --data-dir's path inside the bucket, the cache settings."""
  args = ("run", "--config", CONFIG, "--workdir", "gs://bkt/pod", "--data-dir",
          "gs://data-eu/tfds/v2/", "--gcsfuse", "--gcsfuse-cache-dir", "/mnt/disks/ssd/cache/",
          "--gcsfuse-cache-mb", "100000", "--config.batch_size=4096")
  out = ok(tpu(*args, "--dry-run", **v3_32())).stdout
  script = dry_script(tpu, *args, **v3_32())
  assert out.endswith("'\n") and out.count("\ngcloud ") == 0  # one command
  assert shlex.split(out) == ["gcloud", *ssh("vit-v3-32", "all", script)]
  lines = script.splitlines()
  assert ("  if ! gcsfuse -o ro --implicit-dirs --type-cache-max-size-mb=-1 "
          "--stat-cache-max-size-mb=-1 --kernel-list-cache-ttl-secs=-1 "
          "--metadata-cache-ttl-secs=-1 --cache-dir=/mnt/disks/ssd/cache/data-eu "
          "--file-cache-max-size-mb=100000 --file-cache-cache-file-for-range-read=true "
          '--log-file="$HOME"/vit_jax/logs/gcsfuse-data-eu.log data-eu /mnt/gcsfuse/data-eu; then'
          ) in lines
  assert train_line(f"--config={CONFIG}", "--workdir=gs://bkt/pod",
                    "--config.data.data_dir=/mnt/gcsfuse/data-eu/tfds/v2",
                    "--config.batch_size=4096") in lines
  assert "gcs_url=gs://data-eu/tfds/v2" in lines
  # Without a file cache: no --cache-dir; the metadata caches stay.
  script = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/pod", "--bucket",
                      "bkt", **v3_32(TPU_GCSFUSE="1", TPU_GCSFUSE_CACHE_MB="0"))
  (line,) = [l for l in script.splitlines() if "if ! gcsfuse " in l]
  assert line == ("  if ! gcsfuse -o ro --implicit-dirs --type-cache-max-size-mb=-1 "
                  "--stat-cache-max-size-mb=-1 --kernel-list-cache-ttl-secs=-1 "
                  "--metadata-cache-ttl-secs=-1 "
                  '--log-file="$HOME"/vit_jax/logs/gcsfuse-bkt.log bkt /mnt/gcsfuse/bkt; then')
  # With --no-gcsfuse nothing is mounted and the data_dir stays gs://.
  out = ok(tpu(*args, "--no-gcsfuse", "--dry-run", **v3_32())).stdout
  script = dry_script(tpu, *args, "--no-gcsfuse", **v3_32())
  assert shlex.split(out) == ["gcloud", *ssh("vit-v3-32", "all", script)]
  assert "gcsfuse" not in script  # (the last of --gcsfuse ... --no-gcsfuse wins)
  assert train_line(f"--config={CONFIG}", "--workdir=gs://bkt/pod",
                    "--config.data.data_dir=gs://data-eu/tfds/v2/",
                    "--config.batch_size=4096") in script.splitlines()


@pytest.mark.parametrize("flags,env,message", [
    (["--data-dir", "/data/tfds"], {},
     "--gcsfuse mounts a Cloud Storage bucket, but --data-dir /data/tfds is a local path: give "
     "--data-dir gs://BUCKET/PATH (or --bucket BUCKET), or drop --gcsfuse"),
    ([], {}, "--gcsfuse needs the bucket to mount: pass --bucket BUCKET (data in "
             "gs://BUCKET/tensorflow_datasets) or --data-dir gs://BUCKET/PATH"),
    (["--bucket", "bkt", "--config.data.data_dir=gs://other/tfds"], {},
     "'--config.data.data_dir=gs://other/tfds' would replace the data_dir that --gcsfuse sets"),
    (["--bucket", "bkt", "--gcsfuse-cache-mb", "40G"], {},
     "--gcsfuse-cache-mb must be a size in MiB (0 turns the file cache off), got '40G'"),
    (["--bucket", "bkt"], {"TPU_GCSFUSE_CACHE_MB": "-1"},
     "--gcsfuse-cache-mb must be a size in MiB (0 turns the file cache off), got '-1'"),
    (["--bucket", "bkt", "--gcsfuse-cache-dir", "cache"], {},
     "--gcsfuse-cache-dir 'cache' is not an absolute path without spaces on the worker"),
    (["--bucket", "bkt", "--gcsfuse-cache-dir", "/mnt/gcsfuse/cache"], {},
     "--gcsfuse-cache-dir /mnt/gcsfuse/cache is under /mnt/gcsfuse, where the buckets are "
     "mounted"),
    (["--data-dir", "gs:/bkt/tfds"], {}, "--data-dir (or --bucket) 'gs:/bkt/tfds' is not a "
                                         "gs://BUCKET/PATH URL"),
])
def test_gcsfuse_refuses_bad_settings(tpu, flags, env, message):
  for dry in ([], ["--dry-run"]):
    fails(tpu("run", "--gcsfuse", "--config", CONFIG, "--workdir", "gs://bkt/x", *flags, *dry,
              **v3_32(FAKE_TPU="READY\tv3-32", **env)), message)
    assert tpu.calls() == []  # refused before gcloud is asked anything


def test_stop_keeps_the_mounts_unless_unmount(tpu):
  script = dry_script(tpu, "stop", **v3_32())
  assert "fusermount" not in script and "gcsfuse" not in script
  script = dry_script(tpu, "stop", "--unmount", **v3_32())
  lines = script.splitlines()
  assert "gcs_root=/mnt/gcsfuse" in lines
  assert '  fusermount -u "$mount" || sudo umount "$mount"' in lines
  # Training is stopped first: a mount in use cannot be unmounted.
  assert (lines.index('  sudo pkill -KILL -f "$pattern" || true')
          < lines.index('  fusermount -u "$mount" || sudo umount "$mount"'))


# --------------------------------------------------------------------------------------------
# --slices: create, setup, run, logs, status, stop, delete
# --------------------------------------------------------------------------------------------

CREATE_MS = ["compute", "tpus", "queued-resources", "create", "vit-ms-qr", "--node-count=2",
             "--node-prefix=vit-ms", *LOC, "--accelerator-type=v5litepod-16",
             "--runtime-version=v2-alpha-tpuv5-lite"]


def test_create_two_slices(tpu):
  result = ok(tpu("create", "--spot", **slices2()))
  # Exists already? Slice 0 and the queued resource are asked first.
  assert tpu.calls() == [describe("vit-ms-0"), describe_qr("vit-ms-qr"), [*CREATE_MS, "--spot"]]
  assert "2 slices vit-ms-0 ... vit-ms-1 (v5litepod-16, 4 worker(s) each)" in result.stderr
  assert ("Next: launch/tpu.sh status --name vit-ms --zone europe-west4-a --project my-proj "
          "--slices 2 (wait for ACTIVE and every slice READY)") in result.stderr.replace(
              str(tpu.script), "launch/tpu.sh")
  out = ok(tpu("create", "--slices", "2", "--dry-run", "--", "--reserved",
               **slices2(TPU_SLICES=None))).stdout
  assert out == shlex.join(["gcloud", *CREATE_MS, "--reserved"]) + "\n"
  # Idempotent: the queued resource or its first slice already there.
  result = ok(tpu("create", **slices2(FAKE_QR="WAITING_FOR_RESOURCES")))
  assert "Queued resource vit-ms-qr already exists (WAITING_FOR_RESOURCES)" in result.stderr
  assert len(tpu.calls()) == 2
  result = ok(tpu("create", **slices2(FAKE_TPU_vit_ms_0="READY\tv5litepod-16")))
  assert "TPU vit-ms-0 already exists (READY, v5litepod-16)" in result.stderr
  assert tpu.calls() == [describe("vit-ms-0")]


@pytest.mark.parametrize("args,env,message", [
    (("create",), {"TPU_SLICES": "1"},
     "--slices 1: a multi-slice run has 2 or more slices; for one slice leave --slices "
     "(TPU_SLICES) out"),
    (("create", "--slices", "two"), {}, "--slices must be a number of slices (2 or more), "
                                        "got 'two'"),
    (("create",), {"TPU_TYPE": "v3-32"},
     "--slices 2: multi-slice needs TPU v4 or newer (v4, v5p, v5litepod, v6e), not a v3-32"),
    (("create", "--preemptible"), {}, "queued resources take --spot, not --preemptible"),
    (("preflight", "--config", CONFIG, "--config.mesh.dcn_data=3"), {},
     "--config.mesh.dcn_data=3 conflicts with --slices 2"),
    (("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--config.mesh.dcn_data=4"), {},
     "--config.mesh.dcn_data=4 conflicts with --slices 2: a 2-slice run splits the data axis "
     "over its slices (run and preflight pass --config.mesh.dcn_data=2 themselves)"),
    (("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--", "--config.mesh.dcn_data", "3"),
     {}, "--config.mesh.dcn_data=3 conflicts with --slices 2"),
    (("run", "--config", CONFIG, "--workdir", "/tmp/ckpt"), {},
     "--workdir /tmp/ckpt is not on GCS, but 2 slices of v5litepod-16 have 8 workers"),
    (("run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--config.mesh.dcn_data=2"),
     {"TPU_SLICES": None},
     "--config.mesh.dcn_data=2 splits the data axis over 2 slices, but this run is on one TPU: "
     "create and run that many with --slices 2, or drop the override"),
    (("logs", "--slice", "2"), {}, "--slice 2: --slices 2 has slices 0 to 1"),
    (("logs", "--slice", "1"), {"TPU_SLICES": None},
     "--slice 1: a single TPU has no slices to choose from: pass --slices N"),
    (("logs", "--worker", "4"), {}, "--worker 4: a v5litepod-16 has workers 0 to 3"),
    (("status",), {"TPU_TYPE": None}, "TPU_TYPE is not set: pass --type TYPE"),
])
def test_slices_refuse_bad_input(tpu, args, env, message):
  result = fails(tpu(*args, "--dry-run", **slices2(**env)), message)
  assert result.stdout == "" and tpu.calls() == []


def test_preflight_compiles_for_the_slices(tpu, checkout, fake_preflight):
  """preflight gets the dcn_data that run gives vit_jax.main: N slices of TPU_TYPE."""
  env, log = fake_preflight
  ok(tpu("preflight", "--config", CONFIG, "--config.batch_size=8192", **slices2(**env)))
  assert log.read_text().splitlines() == [
      str(checkout), "-m", "vit_jax.preflight", f"--config={CONFIG}",
      "--accelerator=v5litepod-16", "--config.mesh.dcn_data=2", "--config.batch_size=8192"]
  assert tpu.calls() == []
  # run --preflight: the same, before gcloud is asked anything; nothing starts if it does not fit.
  fails(tpu("run", "--preflight", "--config", CONFIG, "--workdir", "gs://bkt/x",
            **slices2(FAKE_PREFLIGHT_RC="1", **env)), "does not fit a v5litepod-16")
  assert "--config.mesh.dcn_data=2" in log.read_text().splitlines()
  assert tpu.calls() == []
  # Without --slices a dcn_data override reaches the pre-flight as it is (no TPU involved).
  ok(tpu("preflight", "--config", CONFIG, "--config.mesh.dcn_data=2",
         **slices2(TPU_SLICES=None, **env)))
  assert log.read_text().splitlines()[-1] == "--config.mesh.dcn_data=2"
  assert tpu("preflight", "--config", CONFIG, **slices2(TPU_TYPE="v3-32", **env)).returncode == 2


def test_setup_two_slices(tpu):
  ok(tpu("setup", **slices2(**READY_SLICES)))
  calls = tpu.calls()
  assert calls[:3] == [describe_qr("vit-ms-qr"), describe("vit-ms-0"), describe("vit-ms-1")]
  scp = calls[3]
  assert scp[:4] == ["compute", "tpus", "queued-resources", "scp"]
  assert scp[4].endswith("/vit_jax-src.tar.gz")
  assert scp[5:] == ["vit-ms-qr:vit_jax-src.tar.gz", *LOC, "--node=all", "--worker=all",
                     "--batch-size=8"]
  assert calls[4] == qr_ssh("all", "all", remote_command(calls[4]), batch=8)
  assert ".venv/bin/pip install --quiet -e '.[tpu]'" in remote_command(calls[4])
  assert len(calls) == 5


def test_run_two_slices_of_v5litepod_16(tpu):
  """One ssh to every worker of both TPUs at once; each finds its slice in its own metadata."""
  result = ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/ms", "--bucket", "bkt",
                  "--config.batch_size=4096",
                  **slices2(FAKE_BUCKET_LOCATION="EUROPE-WEST4", **READY_SLICES)))
  # The bucket is mounted on all 8 workers (by default).
  calls = tpu.calls()
  assert calls[:3] == [describe_qr("vit-ms-qr"), describe("vit-ms-0"), describe("vit-ms-1")]
  assert calls[3][:4] == ["storage", "buckets", "describe", "gs://bkt"]
  script = remote_command(calls[4])
  assert calls[4] == qr_ssh("all", "all", script, batch=8)  # 2 slices x 4 workers
  assert len(calls) == 5
  lines = script.splitlines()
  train = train_line(f"--config={CONFIG}", "--workdir=gs://bkt/ms",
                     f"--config.data.data_dir={MOUNT_TFDS}",
                     "--config.mesh.dcn_data=2", "--config.batch_size=4096")
  assert train in lines
  assert lines.index(GCSFUSE_BKT) < lines.index(train)
  assert 'worker="$(tpu_env_value MEGASCALE_SLICE_ID)-$worker"' in lines
  assert 'if [ "$num_slices" != 2 ]; then' in lines
  assert lines.index("  unset \"$name\"") < lines.index(train)
  assert not any(l.startswith("export MEGASCALE") or l.startswith("MEGASCALE") for l in lines)
  stderr = result.stderr.replace(str(tpu.script), "launch/tpu.sh")
  assert ("Training runs on all 8 workers of the 2 slices vit-ms-0 ... vit-ms-1 "
          "(--config.mesh.dcn_data=2)") in stderr
  assert ("launch/tpu.sh logs --name vit-ms --zone europe-west4-a --project my-proj --slices 2 "
          "--slice 1 --worker 1") in stderr
  # The same dcn_data among the overrides is not passed twice.
  ok(tpu("run", "--config", CONFIG, "--workdir", "gs://bkt/ms", "--config.mesh.dcn_data=2",
         **slices2(**READY_SLICES)))
  (line,) = [l for l in remote_command(tpu.calls()[-1]).splitlines() if "setsid nohup" in l]
  assert line.count("--config.mesh.dcn_data=2") == 1


def test_run_refuses_slices_that_are_not_ready(tpu):
  args = ("run", "--config", CONFIG, "--workdir", "gs://bkt/x")
  fails(tpu(*args, **slices2()), "queued resource vit-ms-qr not found",
        "create the slices first ('", "tpu.sh create --slices 2 ...')")
  fails(tpu(*args, **slices2(FAKE_QR="WAITING_FOR_RESOURCES")),
        "queued resource vit-ms-qr is WAITING_FOR_RESOURCES, not ACTIVE")
  fails(tpu(*args, **slices2(FAKE_QR="SUSPENDED")), "vit-ms-qr is SUSPENDED: its slices are gone")
  fails(tpu(*args, **slices2(FAKE_QR="ACTIVE", FAKE_TPU_vit_ms_0="READY\tv5litepod-16")),
        "slice 1 (TPU vit-ms-1) of queued resource vit-ms-qr not found")
  fails(tpu(*args, **slices2(**READY_SLICES, FAKE_TPU_vit_ms_1="CREATING\tv5litepod-16")),
        "slice 1 (TPU vit-ms-1) is CREATING, not READY")
  fails(tpu(*args, **slices2(FAKE_QR="ACTIVE", FAKE_TPU="READY\tv5litepod-32")),
        "TPU_TYPE is v5litepod-16 but slice 0 (TPU vit-ms-0) is a v5litepod-32")
  assert not any(c[3:5] == ["queued-resources", "ssh"] for c in tpu.calls())
  # Without --slices, a multi-slice queued resource is named with its fix.
  fails(tpu(*args, **slices2(TPU_SLICES=None, FAKE_QR="ACTIVE")),
        "queued resource vit-ms-qr is ACTIVE but has no TPU named vit-ms", "pass --slices N")


def test_logs_status_stop_delete_two_slices(tpu):
  ok(tpu("logs", "--slice", "1", "--worker", "3", "--no-follow", **slices2(**READY_SLICES)))
  call = tpu.calls()[-1]
  assert call == qr_ssh(1, 3, remote_command(call))  # one worker: no --batch-size
  assert remote_command(call).endswith('exec tail -n 100 "$log"')

  result = ok(tpu("status", **slices2(**READY_SLICES)))
  calls = tpu.calls()
  assert calls[:3] == [describe_qr("vit-ms-qr"), describe("vit-ms-0"), describe("vit-ms-1")]
  assert calls[3] == qr_ssh("all", "all", remote_command(calls[3]), batch=8)
  assert 'worker="$(tpu_env_value MEGASCALE_SLICE_ID)-$worker"' in remote_command(calls[3])
  for line in ("Queued resource vit-ms-qr: ACTIVE",
               "Slice 0, TPU vit-ms-0: READY, v5litepod-16, 4 worker(s)",
               "Slice 1, TPU vit-ms-1: READY, v5litepod-16, 4 worker(s)"):
    assert line in result.stderr
  result = ok(tpu("status", **slices2(FAKE_QR="PROVISIONING", FAKE_TPU_vit_ms_0="CREATING\tx")))
  assert "Slice 1, TPU vit-ms-1: does not exist (yet)" in result.stderr
  assert len(tpu.calls()) == 3  # no ssh until every slice is READY
  assert tpu("status", **slices2()).returncode == 1

  ok(tpu("stop", **slices2(**READY_SLICES)))
  call = tpu.calls()[-1]
  assert call == qr_ssh("all", "all", remote_command(call), batch=8)
  assert 'sudo pkill -TERM -f "$pattern" || true' in remote_command(call)

  delete_qr = ["compute", "tpus", "queued-resources", "delete", "vit-ms-qr", *LOC, "--force",
               "--quiet"]
  result = ok(tpu("delete", "--yes", **slices2(FAKE_QR="ACTIVE")))
  assert tpu.calls() == [describe_qr("vit-ms-qr"), delete_qr]
  out = ok(tpu("delete", "--yes", "--dry-run", **slices2())).stdout
  assert out == shlex.join(["gcloud", *delete_qr]) + "\n"
  result = ok(tpu("delete", "--yes", **slices2()))
  assert "Nothing to delete: queued resource vit-ms-qr does not exist" in result.stderr


SLICE_COMMANDS = [("setup",), ("run", "--config", CONFIG, "--workdir", "gs://bkt/x"),
                  ("logs", "--slice", "1"), ("status",), ("stop",), ("delete", "--yes")]


@pytest.mark.parametrize("args", SLICE_COMMANDS, ids=lambda a: a[0])
def test_dry_run_of_slices_matches_the_real_commands(tpu, args):
  ok(tpu(*args, **slices2(**READY_SLICES, FAKE_BUCKET_LOCATION="EUROPE-WEST4")))
  real = [c for c in tpu.calls() if c[3:4] != ["describe"] and c[0] != "storage"]
  dry = ok(tpu(*args, "--dry-run", **slices2())).stdout
  assert tpu.calls() == []
  subprocess.run(["bash", "-c", dry], env=tpu.base_env, check=True)
  dry_calls = [c for c in tpu.calls() if c[3:4] != ["describe"]]
  for calls in (real, dry_calls):  # setup's temporary directories differ
    for call in calls:
      if call[3] == "scp":
        call[4] = Path(call[4]).name
  assert dry_calls == real


def test_new_remote_scripts_are_valid_posix_sh(tpu, tmp_path):
  """The remote scripts of gcsfuse and several slices, as `assert_posix_sh` checks them."""
  scripts = [
      dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket", "bkt",
                 "--gcsfuse", **v3_32()),
      dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket", "bkt",
                 "--gcsfuse", **slices2()),
      dry_script(tpu, "stop", "--unmount", **slices2()),
      dry_script(tpu, "status", **slices2()),
      dry_script(tpu, "logs", "--slice", "1", **slices2()),
  ]
  assert_posix_sh(scripts, tmp_path)


# --------------------------------------------------------------------------------------------
# The run script on a worker
# --------------------------------------------------------------------------------------------

# curl answers the TPU VM metadata server: the worker number (FAKE_WORKER), 'tpu-env'
# (FAKE_TPU_ENV; unset: no such key, exit 22 as curl -f does), the service account; and the apt
# key of packages.cloud.google.com.
FAKE_CURL = r"""#!/bin/sh
echo "curl $*" >>"$FAKE_LOG"
for url; do :; done
case "$url" in
  */agent-worker-number) echo "${FAKE_WORKER:-0}" ;;
  */tpu-env) [ -n "${FAKE_TPU_ENV+set}" ] || exit 22; printf '%s' "$FAKE_TPU_ENV" ;;
  */service-accounts/default/email) echo "tpu-sa@my-proj.iam.gserviceaccount.com" ;;
  */apt-key.gpg) echo "-----BEGIN PGP PUBLIC KEY BLOCK-----" ;;
  *) exit 22 ;;
esac
"""
# sudo logs and runs nothing but apt-get (and tee, whose input it swallows).
FAKE_SUDO = r"""#!/bin/sh
echo "sudo $*" >>"$FAKE_LOG"
case "$1" in
  tee) cat >/dev/null ;;
  apt-get|DEBIAN_FRONTEND=*) exec env "$@" ;;
esac
"""
FAKE_APT_GET = r"""#!/bin/sh
echo "apt-get $*" >>"$FAKE_LOG"
case " $* " in *" install "*" gcsfuse "*) cp "$FAKE_BIN/.gcsfuse" "$FAKE_BIN/gcsfuse" ;; esac
"""
# gcsfuse mounts by creating the bucket's directories (FAKE_BUCKET_DIRS) under the mount point;
# FAKE_GCSFUSE_ERROR: fails with that message, as gcsfuse does.
FAKE_GCSFUSE = r"""#!/bin/sh
echo "gcsfuse $*" >>"$FAKE_LOG"
for mount; do :; done
if [ -n "${FAKE_GCSFUSE_ERROR:-}" ]; then echo "$FAKE_GCSFUSE_ERROR" >&2; exit 1; fi
for dir in ${FAKE_BUCKET_DIRS-tensorflow_datasets}; do mkdir -p "$mount/$dir"; done
touch "$FAKE_STATE/mounted"
"""
FAKE_MOUNTPOINT = '#!/bin/sh\n[ -e "$FAKE_STATE/mounted" ]\n'
# ls fails on a mount whose gcsfuse has died (FAKE_STATE/broken), as on a real worker.
FAKE_LS = '#!/bin/sh\n[ ! -e "$FAKE_STATE/broken" ] || exit 2\nexec @LS@ "$@"\n'
FAKE_FUSERMOUNT = ('#!/bin/sh\necho "fusermount $*" >>"$FAKE_LOG"\n'
                   'rm -f "$FAKE_STATE/mounted" "$FAKE_STATE/broken"\n')
# vit_jax.main "runs" while FAKE_STATE/running exists; the 20 s start check waits for it.
FAKE_PGREP = '#!/bin/sh\n[ -e "$FAKE_STATE/running" ] && echo 4242\n'
FAKE_SLEEP = ('#!/bin/sh\ni=0\nwhile [ ! -e "$FAKE_STATE/running" ] && [ $i -lt 50 ]; do\n'
              '  @SLEEP@ 0.1; i=$((i + 1))\ndone\n')
FAKE_TRAIN_PYTHON = r"""#!/bin/sh
env >"$FAKE_STATE/python.env"
printf '%s\n' "$@" >"$FAKE_STATE/python.args"
touch "$FAKE_STATE/running"
"""


class RunWorker:
  """A worker's home (with a finished setup), PATH and metadata, to run the run script on."""

  def __init__(self, tmp_path):
    tmp_path = tmp_path / "worker"  # beside the Launcher's bin and home
    self.home = tmp_path / "home"
    self.bin = tmp_path / "bin"
    self.state = tmp_path / "state"
    self.log = tmp_path / "worker.log"
    self.root = tmp_path / "root"  # stands for / in the mount paths
    venv = self.home / "vit_jax" / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".setup-ok").touch()
    for d in (self.bin, self.state):
      d.mkdir(parents=True)
    for tool in ("sh", "sed", "head", "tr", "env", "printenv", "mkdir", "id", "sort", "xargs",
                 "rm", "date", "ln", "tail", "cat", "cp", "touch", "hostname", "setsid",
                 "nohup", "readlink"):
      (self.bin / tool).symlink_to(shutil.which(tool))
    files = {"curl": FAKE_CURL, "sudo": FAKE_SUDO, "apt-get": FAKE_APT_GET,
             ".gcsfuse": FAKE_GCSFUSE, "mountpoint": FAKE_MOUNTPOINT,
             "ls": FAKE_LS.replace("@LS@", shutil.which("ls")), "fusermount": FAKE_FUSERMOUNT,
             "pgrep": FAKE_PGREP, "pkill": '#!/bin/sh\necho "pkill $*" >>"$FAKE_LOG"\n',
             "lsb_release": "#!/bin/sh\necho jammy\n",
             "sleep": FAKE_SLEEP.replace("@SLEEP@", shutil.which("sleep"))}
    for name, text in files.items():
      (self.bin / name).write_text(text)
      (self.bin / name).chmod(0o755)
    (venv / "bin" / "python").write_text(FAKE_TRAIN_PYTHON)
    (venv / "bin" / "python").chmod(0o755)

  def install_gcsfuse(self):
    shutil.copy(self.bin / ".gcsfuse", self.bin / "gcsfuse")

  def run(self, script, **env):
    """Runs the script as the ssh session would; returns the result and the command log."""
    script = script.replace("/mnt/gcsfuse", f"{self.root}/mnt/gcsfuse")
    script = script.replace("/tmp/gcsfuse-cache", f"{self.root}/tmp/gcsfuse-cache")
    self.log.unlink(missing_ok=True)
    for marker in ("running", "python.env", "python.args"):
      (self.state / marker).unlink(missing_ok=True)
    result = subprocess.run(
        [str(self.bin / "sh"), "-c", script], cwd=self.home, capture_output=True, text=True,
        timeout=60, env={"PATH": str(self.bin), "HOME": str(self.home), "FAKE_LOG": str(self.log),
                         "FAKE_BIN": str(self.bin), "FAKE_STATE": str(self.state), **env})
    log = self.log.read_text().splitlines() if self.log.exists() else []
    return result, log

  def python_env(self):
    lines = (self.state / "python.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)

  def python_args(self):
    return (self.state / "python.args").read_text().splitlines()

  def started(self):
    return (self.state / "python.args").exists()


def tpu_env(num_slices, slice_id, coordinator="10.130.0.2:8080"):
  """A multi-slice node's tpu-env metadata (YAML, as jax's cloud_tpu_cluster.py parses it)."""
  return (f"ACCELERATOR_TYPE: 'v5litepod-16'\nMEGASCALE_COORDINATOR_ADDRESS: '{coordinator}'\n"
          f"MEGASCALE_NUM_SLICES: '{num_slices}'\nMEGASCALE_PORT: '8080'\n"
          f"MEGASCALE_SLICE_ID: '{slice_id}'\nWORKER_ID: '3'\n")


STALE = {"MEGASCALE_NUM_SLICES": "4", "MEGASCALE_SLICE_ID": "3",
         "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.99:8080", "MEGASCALE_PORT": "8080"}


def test_restart_clears_stale_megascale_variables(tpu, tmp_path):
  """A restart after a 4-slice run: the inherited MEGASCALE_* never reach python, whose jax then
  reads this node's metadata (2 slices, slice 1)."""
  script = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/ms", **slices2())
  worker = RunWorker(tmp_path)
  result, _ = worker.run(script, FAKE_WORKER="3", FAKE_TPU_ENV=tpu_env(2, 1), **STALE)
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout.splitlines()
  for name, value in sorted(STALE.items()):
    assert (f"worker 1-3: unsetting the inherited {name}={value} (a stale value would override "
            "the TPU's own tpu-env metadata)") in out
  assert ("worker 1-3: slice 1 of 2, coordinator 10.130.0.2:8080 (MEGASCALE_* from the TPU's "
          "tpu-env metadata)") in out
  env = worker.python_env()
  assert not [k for k in env if k.startswith("MEGASCALE")], env
  assert env["PYTHONUNBUFFERED"] == "1"
  assert worker.python_args() == ["-m", "vit_jax.main", f"--config={CONFIG}",
                                  "--workdir=gs://bkt/ms", "--config.mesh.dcn_data=2"]
  (log,) = (worker.home / "vit_jax" / "logs").glob("train-*-worker1-3.log")
  assert os.readlink(worker.home / "vit_jax" / "logs" / "latest.log") == log.name
  assert "worker 1-3: started vit_jax.main" in result.stdout
  # No stale variables: nothing to unset, the same start.
  result, _ = worker.run(script, FAKE_WORKER="0", FAKE_TPU_ENV=tpu_env(2, 0))
  assert result.returncode == 0, result.stdout + result.stderr
  assert "unsetting" not in result.stdout and "worker 0-0: slice 0 of 2" in result.stdout


@pytest.mark.parametrize("metadata,message", [
    (tpu_env(4, 1), "worker 1-3: this TPU is one of 4 slices (MEGASCALE_NUM_SLICES in its "
                    "tpu-env metadata), not of 2: pass --slices 4"),
    (None, "this TPU's tpu-env metadata has no MEGASCALE_NUM_SLICES: it is not a slice of a "
           "multi-slice queued resource. Create the 2 slices with 'launch/tpu.sh create "
           "--slices 2'"),
    (tpu_env(2, 1, coordinator=""), "lacks MEGASCALE_COORDINATOR_ADDRESS or MEGASCALE_SLICE_ID"),
])
def test_multi_slice_run_refuses_metadata_that_disagrees(tpu, tmp_path, metadata, message):
  script = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/ms", **slices2())
  worker = RunWorker(tmp_path)
  env = {"FAKE_TPU_ENV": metadata} if metadata is not None else {}
  result, log = worker.run(script, FAKE_WORKER="3", **env, **STALE)
  assert result.returncode == 1
  assert message in result.stderr
  assert not worker.started() and not any("pkill" in line for line in log)  # old run untouched


def test_single_slice_run_clears_megascale_and_refuses_a_slice_of_several(tpu, tmp_path):
  script = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/x", **v3_8())
  worker = RunWorker(tmp_path)
  result, _ = worker.run(script, MEGASCALE_NUM_SLICES="4")  # a TPU VM without tpu-env
  assert result.returncode == 0, result.stdout + result.stderr
  assert "worker 0: unsetting the inherited MEGASCALE_NUM_SLICES=4" in result.stdout
  assert "MEGASCALE_NUM_SLICES" not in worker.python_env()
  assert worker.python_args()[-1] == "--workdir=gs://bkt/x"  # no dcn_data on one slice
  result, _ = worker.run(script, FAKE_TPU_ENV=tpu_env(2, 1))
  assert result.returncode == 1 and not worker.started()
  assert ("worker 0: this TPU is slice 1 of a 2-slice queued resource (MEGASCALE_NUM_SLICES in "
          "its tpu-env metadata): run on all slices with --slices 2") in result.stderr
  result, _ = worker.run(script, FAKE_TPU_ENV="ACCELERATOR_TYPE: 'v3-8'\n")
  assert result.returncode == 0, result.stdout + result.stderr


def test_gcsfuse_installs_mounts_and_keeps_the_mount(tpu, tmp_path):
  script = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket",
                      "bkt", "--gcsfuse", **v3_8())
  worker = RunWorker(tmp_path)
  root = worker.root
  result, log = worker.run(script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "worker 0: installing gcsfuse from packages.cloud.google.com/apt" in result.stdout
  apt = "apt-get -o DPkg::Lock::Timeout=600"
  # curl | sudo tee is one pipeline: those two log in either order.
  assert "curl -fsS https://packages.cloud.google.com/apt/doc/apt-key.gpg" in log
  expected = [
      "sudo tee /usr/share/keyrings/cloud.google.asc",
      "sudo tee /etc/apt/sources.list.d/gcsfuse.list",
      f"sudo {apt} update -qq", f"{apt} update -qq",
      f"sudo DEBIAN_FRONTEND=noninteractive {apt} install -y -qq gcsfuse",
      f"{apt} install -y -qq gcsfuse",
      f"sudo mkdir -p {root}/mnt/gcsfuse/bkt {root}/tmp/gcsfuse-cache/bkt",
      f"gcsfuse -o ro --implicit-dirs --type-cache-max-size-mb=-1 --stat-cache-max-size-mb=-1 "
      f"--kernel-list-cache-ttl-secs=-1 --metadata-cache-ttl-secs=-1 "
      f"--cache-dir={root}/tmp/gcsfuse-cache/bkt --file-cache-max-size-mb=40960 "
      f"--file-cache-cache-file-for-range-read=true "
      f"--log-file={worker.home}/vit_jax/logs/gcsfuse-bkt.log bkt {root}/mnt/gcsfuse/bkt",
  ]
  positions = [log.index(line) for line in expected]
  assert positions == sorted(positions), log
  assert f"worker 0: mounted gs://bkt read-only at {root}/mnt/gcsfuse/bkt" in result.stdout
  assert (f"--config.data.data_dir={root}/mnt/gcsfuse/bkt/tensorflow_datasets"
          in worker.python_args())
  # Rerun: installed and mounted, so both are kept.
  result, log = worker.run(script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert (f"worker 0: gs://bkt is already mounted at {root}/mnt/gcsfuse/bkt: kept "
          "('launch/tpu.sh stop --unmount' unmounts it)") in result.stdout
  assert not any(line.startswith(("gcsfuse", "apt-get", "sudo mkdir")) for line in log)
  assert worker.started()
  # A mount whose gcsfuse died is replaced.
  (worker.state / "broken").touch()
  result, log = worker.run(script)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f"fusermount -uz {root}/mnt/gcsfuse/bkt" in log
  assert log.index(f"fusermount -uz {root}/mnt/gcsfuse/bkt") < [
      i for i, line in enumerate(log) if line.startswith("gcsfuse ")][0]


# What gcsfuse prints when the service account may not list the bucket.
DENIED = ("Error: failed to mount bucket: ... storage.objects.list access to the Google Cloud "
          "Storage bucket. Permission 'storage.objects.list' denied on resource")


def test_gcsfuse_mount_failure_names_the_fix(tpu, tmp_path):
  script = dry_script(tpu, "run", "--config", CONFIG, "--workdir", "gs://bkt/x", "--bucket",
                      "bkt", "--gcsfuse", **v3_8())
  worker = RunWorker(tmp_path)
  worker.install_gcsfuse()
  result, log = worker.run(script, FAKE_GCSFUSE_ERROR=DENIED)
  assert result.returncode == 1
  assert DENIED in result.stderr
  assert (f"worker 0: gcsfuse could not mount gs://bkt at {worker.root}/mnt/gcsfuse/bkt (its "
          "message is above, its log in ~/vit_jax/logs/gcsfuse-bkt.log). Usually the TPU VM's "
          "service account tpu-sa@my-proj.iam.gserviceaccount.com may not list the bucket "
          "(storage.objects.list) or read it (storage.objects.get): grant it 'gcloud storage "
          "buckets add-iam-policy-binding gs://bkt "
          "--member=serviceAccount:tpu-sa@my-proj.iam.gserviceaccount.com "
          "--role=roles/storage.objectViewer', then rerun") in result.stderr
  assert not worker.started() and not any("pkill" in line for line in log)
  # Mounted, but the data is not in the bucket.
  result, _ = worker.run(script, FAKE_BUCKET_DIRS="other")
  assert result.returncode == 1 and not worker.started()
  assert ("tensorflow_datasets does not exist: gs://bkt/tensorflow_datasets has no objects. "
          "Check --bucket/--data-dir, or prepare the data there first (e.g. tfds build NAME "
          "--data_dir=gs://bkt/tensorflow_datasets)") in result.stderr
