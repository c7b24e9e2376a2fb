"""The device mesh, the logical-axis rules, and sharded training on 8 simulated CPU devices."""

import json
import pathlib
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from tests import data_utils
from tests import sharding_worker
from vit_jax import checkpoint
from vit_jax import config as config_lib
from vit_jax import models
from vit_jax import sharding
from vit_jax import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Meshes of 8 devices that a tiny run must train on exactly as on one device, per family: ViT
#: on FSDP, and on FSDP with tensor parallelism; T2T-ViT (whose own rules are those of its token
#: transformer and fixed tables) on the mesh that splits both ways. Pure data parallelism is the
#: two-process test's mesh (data=4 over 2 processes); the checkpoint test restores ViT's first
#: run (data=2,fsdp=4) onto other meshes.
MESHES = {"vit": ("data=2,fsdp=4", "fsdp=2,tensor=4"), "t2t": ("fsdp=2,tensor=4",)}


def _mesh_cfg(**sizes):
  cfg = config_lib.defaults.mesh_config()
  cfg.update(sizes)
  return cfg


# ------------------------------------------------------------------------------ config checks


def test_axis_sizes_fill_the_rest_and_check_the_device_count():
  assert sharding.axis_sizes(_mesh_cfg(), 8) == {"data": 8, "fsdp": 1, "tensor": 1}
  assert sharding.axis_sizes(_mesh_cfg(data=2, fsdp=-1), 8) == {"data": 2, "fsdp": 4, "tensor": 1}
  assert sharding.axis_sizes(_mesh_cfg(data=-1, dcn_data=2, tensor=2), 8) == {
      "data": 4, "fsdp": 1, "tensor": 2}
  with pytest.raises(ValueError, match=r"data=2 x fsdp=4 x tensor=1 has 8 devices but there are "
                     r"4 \(jax.device_count\(\)\)\. .*--config.mesh.data=-1"):
    sharding.axis_sizes(_mesh_cfg(data=2, fsdp=4), 4)
  with pytest.raises(ValueError, match="cannot fill 8 devices: the fixed axes use 3"):
    sharding.axis_sizes(_mesh_cfg(tensor=3), 8)
  with pytest.raises(ValueError, match="at most one -1"):
    sharding.axis_sizes(_mesh_cfg(fsdp=-1), 8)


def test_rules_parse_and_name_only_mesh_axes():
  rules = dict(sharding.parse_rules("embed=,mlp=fsdp,batch=data+fsdp+tensor"))
  assert rules["embed"] is None and rules["mlp"] == "fsdp"
  assert rules["batch"] == ("data", "fsdp", "tensor") and rules["heads"] == "tensor"
  with pytest.raises(ValueError, match="names the mesh axis 'fsdq', which is not one of"):
    sharding.parse_rules("embed=fsdq")
  with pytest.raises(ValueError, match="is not 'logical=mesh_axis'"):
    sharding.parse_rules("embed")


def test_batch_that_the_mesh_cannot_split_is_a_config_error():
  with pytest.raises(ValueError, match=r"batch_size=12 cannot be split into 2 micro-batch\(es\) "
                     r"over 4 batch shard\(s\).*; use config.batch_size=8 or 16"):
    config_lib.check_batch_size(12, 2, 4)


def test_fsdp_that_leaves_most_bytes_replicated_is_refused():
  devices = np.asarray(jax.devices() * 4)[:4]  # Shapes only: a 4-way mesh of one CPU device.
  mesh = jax.sharding.Mesh(devices.reshape(1, 4, 1), sharding.MESH_AXES)
  model = models.create("ViT-custom", num_classes=10, hidden_size=64, mlp_dim=256, num_heads=4,
                        num_layers=2, patch_size=4)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 16, 16, 3)),
                                            train=False))
  params = models.unbox(boxed)["params"]
  shardings = sharding.variable_shardings(boxed, mesh, sharding.parse_rules(""))["params"]
  report = sharding.check_replication(params, shardings, mesh, 0.5)
  assert "replicated on every device" in report
  kernel = shardings["Transformer"]["encoderblock_0"]["MlpBlock_0"]["Dense_0"]["kernel"]
  assert kernel.shard_shape((64, 256)) == (16, 256)  # 'embed' split 4 ways over fsdp.
  unsharded = sharding.variable_shardings(boxed, mesh, sharding.parse_rules("embed="))["params"]
  with pytest.raises(ValueError, match="FSDP was asked for .* stay replicated"):
    sharding.check_replication(params, unsharded, mesh, 0.5)


class _Device:
  """A device as `sharding.check_slices` and `mesh_utils` read it."""

  def __init__(self, i, platform, process_index, slice_index=None):
    self.id, self.platform, self.process_index = i, platform, process_index
    self.device_kind = {"tpu": "TPU v5 lite", "cpu": "cpu"}[platform]
    if slice_index is not None:
      self.slice_index = slice_index

  def __repr__(self):
    return f"d{self.id}"


def test_dcn_data_must_be_the_number_of_slices_the_devices_form():
  two_slices = [_Device(i, "tpu", i // 4, slice_index=i // 4) for i in range(8)]
  one_slice = [_Device(i, "tpu", 0) for i in range(4)]  # libtpu's one-slice topology: no index.
  assert [sharding.num_slices(d) for d in (two_slices, one_slice)] == [2, 1]
  sharding.check_slices(_mesh_cfg(dcn_data=2), two_slices)
  sharding.check_slices(_mesh_cfg(dcn_data=1), one_slice)
  with pytest.raises(ValueError, match=r"^config\.mesh\.dcn_data=1 but the 8 devices form 2 "
                     r"slices \(by their slice_index\): .*; set config\.mesh\.dcn_data=2\.$"):
    sharding.check_slices(_mesh_cfg(dcn_data=1), two_slices)
  with pytest.raises(ValueError, match=r"^config\.mesh\.dcn_data=2 but the 4 devices form 1 "
                     r"slice \(TPU devices without a slice_index\): its data axis cannot span 2 "
                     r"slices; set config\.mesh\.dcn_data=1\.$"):
    sharding.check_slices(_mesh_cfg(dcn_data=2), one_slice)
  # CPU and GPU: mesh_utils's fallback, a process is a slice; one network (1) passes too.
  two_processes = [_Device(i, "cpu", i // 2) for i in range(4)]
  sharding.check_slices(_mesh_cfg(dcn_data=1), two_processes)
  sharding.check_slices(_mesh_cfg(dcn_data=2), two_processes)
  with pytest.raises(ValueError, match=r"dcn_data=3 but the 4 devices form 2 slices \(one per "
                     r"process: CPU devices have no slice_index\).*; set config\.mesh\.dcn_data=1 "
                     r"\(one network\) or 2 \(a slice per process\)\.$"):
    sharding.check_slices(_mesh_cfg(dcn_data=3), two_processes)
  # The hybrid grid puts each process's devices in its half of the data axis.
  grid = sharding.device_grid(_mesh_cfg(dcn_data=2), two_processes)
  assert grid.shape == (4, 1, 1)
  assert [d.process_index for d in grid.flat] == [0, 0, 1, 1]
  with pytest.raises(ValueError, match=r"dcn_data=2 but the \d+ devices? forms? 1 slice"):
    sharding.create_mesh(_mesh_cfg(dcn_data=2))  # This process's CPU devices.


def test_the_trainer_refuses_dcn_data_of_other_slices_before_any_work(tmp_path, folder):
  config = sharding_worker.tiny_config("vit", folder)
  config.mesh.dcn_data = 2
  with pytest.raises(ValueError, match=r"dcn_data=2 but the \d+ devices? forms? 1 slice \(one per "
                     r"process: CPU devices have no slice_index\).*config\.mesh\.dcn_data=1\.$"):
    config_lib.resolve(config, num_train_examples=24, num_classes=3)
  with pytest.raises(train.ConfigError, match=r"config\.mesh\.dcn_data=2 but the \d+ device"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()  # Refused before the workdir was made.


# ------------------------------------------------------------------------------ 8 devices


def _run_worker(*args):
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sharding_worker.py"), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]


def _load(out, name):
  with np.load(out / f"{name}.npz") as f:
    params = {k: f[k] for k in f.files}
  return params, json.loads((out / f"{name}.json").read_text())


def _mesh_name(mesh):
  return mesh.replace(",", "_").replace("=", "")


def _trained(workdir):
  """(flat parameters, {step: train/loss}) of a finished run."""
  return (checkpoint.flatten_params(checkpoint.load(str(workdir))["params"]),
          sharding_worker.train_losses(str(workdir)))


# Built once per test run for all xdist workers (`shared_dir`, tests/conftest.py): the 8-device
# runs are read by two tests, and cost tens of seconds of compiling.


@pytest.fixture(scope="module")
def folder(shared_dir):
  """3 classes of 8 training and 8 test images, 16 px: a run of batch 8 sees 3 different
  batches in its 3 steps."""
  return str(shared_dir("sharding_images", lambda path: data_utils.make_image_folder(
      str(path), num_classes=3, per_class=8, size=16)))


def _train_on_eight_devices(out, folder):
  args = []
  for family, meshes in MESHES.items():
    (out / family).mkdir()
    args += ["--family", family, "--out", str(out / family), "--meshes", ";".join(meshes)]
  _run_worker("train", "--devices", "8", "--folder", folder, *args)


@pytest.fixture(scope="module")
def on_eight_devices(shared_dir, folder):
  """`on_eight_devices(family)`: the directory where tests/sharding_worker.py trained the tiny
  run of `family` on each mesh of MESHES[family] (8 simulated CPU devices): `<mesh>.npz`,
  `<mesh>.json` and the run's workdir `run_<mesh>` per mesh. One process trains every family
  (one start-up of jax, TensorFlow and the trainer for both)."""
  root = shared_dir("sharding_eight_devices", lambda out: _train_on_eight_devices(out, folder))
  return lambda family: root / family


@pytest.mark.slow
@pytest.mark.parametrize("family", ["vit", "t2t"])
def test_meshes_train_like_one_device(tmp_path, folder, on_eight_devices, family):
  """3 steps on each mesh of MESHES (8 simulated CPU devices) give the loss and parameters of the
  1-device run (relative difference <= 1e-5)."""
  train.train_and_evaluate(sharding_worker.tiny_config(family, folder), str(tmp_path / "one"))
  expected, expected_losses = _trained(tmp_path / "one")
  assert sorted(expected_losses) == [1, 2, 3]
  out = on_eight_devices(family)
  for mesh in MESHES[family]:
    params, info = _load(out, _mesh_name(mesh))
    losses = {int(k): v for k, v in info["losses"].items()}
    np.testing.assert_allclose([losses[s] for s in (1, 2, 3)],
                               [expected_losses[s] for s in (1, 2, 3)], rtol=1e-5, err_msg=mesh)
    assert sorted(params) == sorted(expected)
    for key, value in expected.items():
      np.testing.assert_allclose(params[key], value, rtol=1e-5, atol=1e-6,
                                 err_msg=f"{mesh}: {key}")
    assert info["shard_shape"] != info["shape"], (mesh, info)  # The MLP kernel really is split.


@pytest.mark.slow
def test_checkpoint_saved_on_8_devices_restores_on_4_and_on_1(tmp_path, folder, on_eight_devices):
  """The ViT run saved on 8 devices (FSDP: data=2, fsdp=4) restores onto a 4-device mesh that
  splits it another way (data=2, fsdp=2) and onto one device, bit for bit."""
  out8 = on_eight_devices("vit")
  mesh8 = _mesh_name(MESHES["vit"][0])
  saved, info8 = _load(out8, mesh8)  # Restored on its own 8-device mesh.
  assert info8["shard_shape"] != info8["shape"]
  workdir = str(out8 / f"run_{mesh8}")
  out4 = tmp_path / "out4"
  out4.mkdir()
  _run_worker("restore", "--devices", "4", "--family", "vit", "--folder", folder, "--out",
              str(out4), "--workdir", workdir, "--meshes", "data=2,fsdp=2")
  restored, info = _load(out4, "data2_fsdp2")
  assert info["shard_shape"] != info["shape"]  # Restored already split over fsdp.
  assert info["shard_shape"] != info8["shard_shape"]  # ... in other shards than it was saved.
  restored_1 = checkpoint.flatten_params(
      sharding_worker.restore_on_mesh(workdir, sharding_worker.tiny_config("vit", folder))[
          "params"])
  assert sorted(restored) == sorted(saved) == sorted(restored_1)
  for key, value in saved.items():
    np.testing.assert_array_equal(restored[key], value, err_msg=key)
    np.testing.assert_array_equal(np.asarray(restored_1[key]), value, err_msg=key)


# ------------------------------------------------------------------------------ two processes


def _free_port():
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
  """Two `python -m vit_jax.main` processes (2 CPU devices each) on a localhost coordinator.

  The 8 training images are exactly one global batch, so every step sees all of them in both
  runs (each process reads its own 4): the losses and parameters must match the 1-process run.
  """
  import os  # pylint: disable=g-import-not-at-top
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=2,
                                        per_class={"train": 4, "test": 3}, size=16)
  config = sharding_worker.tiny_config("vit", folder)
  config.data.shuffle_buffer = 8
  train.train_and_evaluate(config, str(tmp_path / "one"))
  expected, expected_losses = _trained(tmp_path / "one")

  workdir = tmp_path / "two"
  overrides = [f"--config.data.image_folder={folder}", "--config.data.shuffle_buffer=8"]

  def run_two_processes():
    port, procs = _free_port(), []
    for pid in range(2):
      # Appended: the flags inherited from tests/conftest.py (fast compilation) stay in force.
      env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
          f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"))
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "vit_jax.main", "--config", f"{sharding_worker.__file__}",
           "--workdir", str(workdir), f"--coordinator_address=localhost:{port}",
           "--num_processes=2", f"--process_id={pid}", *overrides],
          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs, [p.communicate(timeout=600) for p in procs]

  procs, outputs = run_two_processes()
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-4000:]
  assert not (workdir / "lock.json").exists()
  assert "Process 0 of 2; 2 local of 4 devices" in outputs[0][1]
  # One metrics stream (process 0 writes events) and one checkpoint.
  assert len(list(workdir.glob("events.out.tfevents.*"))) == 1
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3"]
  losses = sharding_worker.train_losses(str(workdir))
  np.testing.assert_allclose([losses[s] for s in (1, 2, 3)],
                             [expected_losses[s] for s in (1, 2, 3)], rtol=1e-5)
  params = checkpoint.flatten_params(checkpoint.load(str(workdir))["params"])
  for key, value in expected.items():
    np.testing.assert_allclose(params[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
