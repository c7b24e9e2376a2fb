"""A host crash right after a save, simulated for real: the workdir lives on an ext4 image mounted
with `errors=remount-ro`, and writing ext4's `trigger_fs_error` aborts its journal at once, so
what was not forced to disk is lost, as in a crash within the kernel's writeback window (about
30 s). Needs root (mount, loop devices), as CI has; skipped elsewhere."""

import json
import os
import subprocess
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import data_utils
from vit_jax import checkpoint
from vit_jax import train
from vit_jax.checkpoint import durable


class Ext4:
  """An ext4 image on a loop device, mounted at `path`; `crash()` forces a filesystem error
  (the journal aborts; unforced data is lost), unmounts, repairs and mounts it again."""

  def __init__(self, tmp_path):
    self.image, self.path = tmp_path / "disk.img", tmp_path / "mnt"
    self.path.mkdir()
    with open(self.image, "wb") as f:
      f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], check=True, capture_output=True)
    self.mount()

  def mount(self):
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(self.image), str(self.path)],
                   check=True, capture_output=True)

  def unmount(self):
    subprocess.run(["umount", str(self.path)], check=True, capture_output=True)

  def crash(self):
    device = os.path.basename(os.path.realpath(_source_of(self.path)))
    with open(f"/sys/fs/ext4/{device}/trigger_fs_error", "w") as f:
      f.write("1")
    self.unmount()
    fsck = subprocess.run(["e2fsck", "-fy", str(self.image)], capture_output=True, text=True)
    assert fsck.returncode in (0, 1, 2), fsck.stdout + fsck.stderr  # 1, 2: errors corrected.
    self.mount()


def _source_of(mount_point) -> str:
  with open("/proc/self/mounts") as f:
    return next(l.split()[0] for l in f if l.split()[1] == str(mount_point))


@pytest.fixture
def disk(tmp_path):
  if os.geteuid() != 0:
    pytest.skip("mounting an ext4 image needs root")
  try:
    ext4 = Ext4(tmp_path)
  except (subprocess.CalledProcessError, FileNotFoundError) as e:
    pytest.skip(f"cannot mount an ext4 image here: {getattr(e, 'stderr', e)}")
  yield ext4
  subprocess.run(["umount", str(ext4.path)], capture_output=True)


def _state(value: float):
  return {"step": jnp.int32(int(value)), "params": {"w": jnp.full((256, 256), value)},
          "opt_state": {}, "model_state": {}}


def _abstract():
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                      _state(0.0))


def test_unforced_writes_are_lost_in_the_simulated_crash(disk):
  """The control: Orbax's own commit, and a plain file write, do not survive the crash."""
  manager = ocp.CheckpointManager(disk.path / "plain")
  manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(1.0)),
                                          cost=ocp.args.JsonSave({"step": 1})))
  manager.wait_until_finished()
  manager.close()
  (disk.path / "plain.json").write_text('{"step": 1}')
  disk.crash()
  lost = lambda path: not path.exists() or path.stat().st_size == 0
  assert lost(disk.path / "plain.json")
  step = disk.path / "plain" / "1"
  assert not step.exists() or durable.damaged_files(step)  # E.g. cost/metadata, empty.


def test_saved_steps_and_workdir_files_survive_a_crash_right_after_the_save(disk):
  run_dir = checkpoint.Workdir(str(disk.path / "run"))
  checkpoints = run_dir.checkpoints(keep=None, asynchronous=True)
  for step in (1, 2):
    checkpoints.save(step, _state(float(step)), cost={"step": step}, config={"seed": 0},
                     dataset={"num_classes": 3})
  checkpoints.wait_until_finished()
  checkpoints.close()
  run_dir.write_config({"seed": 0})
  from tests.test_accounting import _preempted_and_resumed  # pylint: disable=g-import-not-at-top
  report = _preempted_and_resumed()[1]  # A real account: cost.json's shape is checked.
  run_dir.write_cost(report)
  disk.crash()

  run_dir = checkpoint.Workdir(str(disk.path / "run"))
  assert run_dir.saved_steps() == [1, 2]
  for step in (1, 2):
    assert durable.damaged_files(run_dir.checkpoints_dir / str(step)) == []
  assert run_dir.read_config() == {"seed": 0}
  assert run_dir.read_cost() == report
  run_dir.check_state_fits(_abstract())
  checkpoints = run_dir.checkpoints(keep=None, asynchronous=False)
  state, cost = checkpoints.restore(2, _abstract())
  checkpoints.close()
  np.testing.assert_array_equal(state["params"]["w"], np.full((256, 256), 2.0, np.float32))
  assert cost == {"step": 2}


def test_a_step_left_empty_by_a_crash_names_the_newest_intact_step(tmp_path):
  """Steps written before saves were forced (or by another program) can hold empty files after
  a crash: the resume advice skips every such step."""
  run_dir = checkpoint.Workdir(str(tmp_path / "run"))
  checkpoints = run_dir.checkpoints(keep=None, asynchronous=False)
  for step in (1, 2, 3):
    checkpoints.save(step, _state(float(step)), cost={"step": step})
  checkpoints.close()
  for step in (2, 3):  # What the crash of the control test leaves.
    open(run_dir.checkpoints_dir / str(step) / "cost" / "metadata", "w").close()
  with pytest.raises(ValueError) as error:
    run_dir.check_state_fits(_abstract())
  message = str(error.value)
  assert message.startswith(f"The checkpoint of step 3 in {run_dir.checkpoints_dir} cannot be "
                            "read (1 empty files, e.g. cost/metadata: lost in a host crash)")
  assert f"mv {run_dir.checkpoints_dir}/3 " in message and "to resume from step 1," in message


@pytest.mark.slow
# The crash may cut a compilation cache entry written last: JAX warns and compiles again.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
def test_a_training_run_resumes_exactly_after_a_crash_at_its_end(disk, caplog):
  """A real run (checkpoints every 2 steps, asynchronous), the host crashing the moment it
  returns; the rerun finds every file intact and evaluates its last step to the same figures."""
  folder = data_utils.make_image_folder(str(disk.path.parent / "images"), num_classes=3,
                                        per_class=4, size=8)
  config = data_utils.folder_run_config("ViT-custom", folder, 8, total_steps=6, hidden_size=8,
                                        mlp_dim=16, num_heads=2, num_layers=1, patch_size=4)
  config.log_every_steps = config.checkpoint_every_steps = 2
  config.eval_every_steps = 6
  workdir = str(disk.path / f"run-{uuid.uuid4().hex[:6]}")
  first = train.train_and_evaluate(config, workdir)
  disk.crash()

  for name in ("config.json", "dataset.json", "cost.json"):
    json.loads((disk.path / workdir / name).read_text())  # Not empty, valid.
  run_dir = checkpoint.Workdir(workdir)
  assert run_dir.saved_steps() == [2, 4, 6]
  assert all(not durable.damaged_files(run_dir.checkpoints_dir / str(s)) for s in (2, 4, 6))
  again = train.train_and_evaluate(config, workdir)
  assert again == first and again["step"] == 6
