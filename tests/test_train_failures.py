"""Fault injection: SIGTERM (preemption), Ctrl-C and SIGKILL of a running `python -m vit_jax.main`, a second
run on a workdir in use, a full disk during a save, a partial checkpoint left by a crash, and
non-finite updates."""

import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import data_utils
from vit_jax import checkpoint
from vit_jax import cli
from vit_jax import data
from vit_jax import optim
from vit_jax import stops
from vit_jax import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _folder(tmp_path):
  return data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=8,
                                      size=8)


def _main_overrides(folder, width=8, **extra):
  """The `--config.<key>` overrides of a tiny run of configs/fashion_mnist.py on `folder`."""
  return {"data.image_folder": folder, "data.image_size": 8, "model.hidden_size": width,
          "model.mlp_dim": 2 * width, "model.num_heads": 2, "model.num_layers": 1,
          "model.patch_size": (4, 4), "batch_size": 4, "optim.warmup_steps": 1,
          "eval_every_steps": 100000, **extra}


def _main_args(workdir, overrides):
  """`python -m vit_jax.main` with `overrides` as --config.<key>=<value> flags."""
  return [sys.executable, "-m", "vit_jax.main", "--config", "configs/fashion_mnist.py",
          "--workdir", str(workdir), *data_utils.main_flags(overrides)]


def _main_config(overrides):
  """The config that `_main_args(workdir, overrides)` runs, for `train_and_evaluate` in this
  process (where the test is about resuming, not about the command line)."""
  return data_utils.override(cli.load_config_file("configs/fashion_mnist.py"), overrides)


def _resume(overrides, workdir, caplog):
  """Reruns the config of `overrides` in `workdir` in this process; returns (results, log)."""
  caplog.clear()
  with caplog.at_level(logging.INFO):
    results = train.train_and_evaluate(_main_config(overrides), str(workdir))
  return results, caplog.text


def _wait_for(predicate, proc, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if predicate():
      return True
    time.sleep(0.1)
  return False


def _step_in_cost_json(workdir):
  path = workdir / "cost.json"
  try:
    return json.loads(path.read_text())["step"] if path.exists() else 0
  except ValueError:
    return 0


def _params(workdir):
  return checkpoint.flatten_params(checkpoint.load(str(workdir), use_ema=False)["params"])


@pytest.mark.slow
def test_sigterm_saves_the_current_step_exits_75_and_the_rerun_resumes(tmp_path, caplog):
  folder, workdir = _folder(tmp_path), tmp_path / "workdir"
  # checkpoint_every_steps=1: the preemption save falls on a step that is saved anyway.
  overrides = _main_overrides(folder, log_every_steps=5, checkpoint_every_steps=1,
                              keep_checkpoints=2)
  proc = subprocess.Popen(_main_args(workdir, dict(overrides, total_steps=1000000)), cwd=ROOT,
                          env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert _wait_for(lambda: _step_in_cost_json(workdir) >= 10, proc), proc.communicate()[1][-3000:]
    # A second run on the same workdir (another learning rate) is refused while this one runs.
    second = subprocess.run(_main_args(workdir, dict(overrides, **{"optim.lr": 0.5})), cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    fatal = [l for l in second.stderr.splitlines() if l.startswith("FATAL:")]
    assert len(fatal) == 1 and "Traceback" not in second.stderr
    assert fatal[0].startswith(f"FATAL: --workdir {workdir} is in use by another run (host ")
    assert f", pid {proc.pid}, started " in fatal[0] and "python -m vit_jax.main" in fatal[0]
    assert proc.poll() is None  # The first run goes on.
    assert json.loads((workdir / "config.json").read_text())["optim"]["lr"] != 0.5
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == stops.PREEMPTED_EXIT_CODE == 75, stderr[-3000:]
  line = next(l for l in stderr.splitlines() if "Preempted: saved the checkpoint of step" in l)
  step = int(line.split("of step ")[1].split()[0])
  assert step >= 10
  steps = sorted(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  assert steps[-1] == step
  assert json.loads((workdir / "cost.json").read_text())["step"] == step

  # The rerun (here in this process) resumes from the saved step.
  results, log = _resume(dict(overrides, total_steps=step + 3, resume_with_changes=True), workdir,
                         caplog)
  assert f"Resuming from the checkpoint at step {step}" in log
  assert results["step"] == step + 3


def test_ctrl_c_saves_the_current_step_and_says_it_was_interrupted(tmp_path, monkeypatch):
  """A first Ctrl-C in the loop (here while the second batch is read) saves that step and stops
  with `Preempted(interrupted=True)`, which `main` turns into exit 130. (During the set-up it
  stops at once: tests/test_pod_faults.py.)"""
  overrides = _main_overrides(_folder(tmp_path), total_steps=50, checkpoint_every_steps=1000)
  create = data.create_train_iterator

  def ctrl_c_at_the_second_batch(*args, **kwargs):
    for i, batch in enumerate(create(*args, **kwargs)):
      if i == 1:
        os.kill(os.getpid(), signal.SIGINT)
      yield batch

  monkeypatch.setattr(data, "create_train_iterator", ctrl_c_at_the_second_batch)
  workdir, handler = tmp_path / "workdir", signal.getsignal(signal.SIGINT)
  with pytest.raises(train.Preempted) as e:
    train.train_and_evaluate(_main_config(overrides), str(workdir))
  assert e.value.interrupted and e.value.step == 2
  assert str(e.value) == (f"Interrupted (Ctrl-C): saved the checkpoint of step 2 in {workdir}; "
                          "rerun the same command to resume from it.")
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
  assert signal.getsignal(signal.SIGINT) is handler  # Restored.


@pytest.mark.slow
def test_sigkill_and_resume_end_with_the_same_parameters_bitwise(tmp_path, caplog):
  """A run killed after its first checkpoint and resumed ends where an uninterrupted run does
  (the uninterrupted run and the resumption run in this process), and its cost.json adds up
  exactly the killed attempt (as last recorded) and the rerun."""
  folder = _folder(tmp_path)
  total = 120
  overrides = _main_overrides(folder, width=32, log_every_steps=10, checkpoint_every_steps=10,
                              total_steps=total, **{"data.augment": "flip"})
  train.train_and_evaluate(_main_config(overrides), str(tmp_path / "straight"))

  workdir = tmp_path / "killed"
  proc = subprocess.Popen(_main_args(workdir, overrides), cwd=ROOT, env=ENV,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    # Killed somewhere after the first checkpoint: possibly in the middle of a save.
    assert _wait_for(lambda: (workdir / "checkpoints" / "20").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  killed = json.loads((workdir / "cost.json").read_text())
  assert 10 <= killed["step"] < total  # Recorded at its first checkpoint or later.

  results, log = _resume(overrides, workdir, caplog)
  assert "Resuming from the checkpoint at step" in log and results["step"] == total
  assert f"Taking over the lock of host {socket.gethostname()}, pid {proc.pid}, started" in log
  assert not (workdir / "lock.json").exists()
  expected, got = _params(tmp_path / "straight"), _params(workdir)
  assert expected.keys() == got.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
  final = json.loads((workdir / "cost.json").read_text())
  first, second = final["attempts"]
  assert first == killed["attempts"][0]
  assert final["restarts"] == 1 and second["start_step"] <= killed["step"]
  for part in ("train", "program"):
    days = final[part]["device_days"]
    assert days > killed[part]["device_days"] and days > second["seconds"][part] / 86_400
    assert days == pytest.approx((first["seconds"][part] + second["seconds"][part]) / 86_400,
                                 rel=1e-12)


def _tiny(folder, total_steps, **overrides):
  config = data_utils.folder_run_config("ViT-custom", folder, 8, total_steps=total_steps,
                                        hidden_size=8, mlp_dim=16, num_heads=2, num_layers=1,
                                        patch_size=4)
  config.log_every_steps = config.checkpoint_every_steps = config.eval_every_steps = 2
  config.async_checkpointing = False
  for key, value in overrides.items():
    node = config
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(folder, workdir) of a 4-step `_tiny` run (checkpoints 2 and 4), shared by the tests of this
  module that read it; a test that changes it works on a copy."""
  tmp = tmp_path_factory.mktemp("trained")
  folder, workdir = _folder(tmp), str(tmp / "workdir")
  train.train_and_evaluate(_tiny(folder, 4), workdir)
  return folder, workdir


@pytest.mark.slow
def test_a_partial_checkpoint_is_ignored_and_removed(trained, tmp_path):
  folder, workdir = trained[0], str(tmp_path / "workdir")
  shutil.copytree(trained[1], workdir)
  partial = os.path.join(workdir, "checkpoints", "6.orbax-checkpoint-tmp")
  os.makedirs(os.path.join(partial, "state.orbax-checkpoint-tmp"))
  with open(os.path.join(partial, "state.orbax-checkpoint-tmp", "half_written"), "wb") as f:
    f.write(b"\0" * 100)
  results = train.train_and_evaluate(_tiny(folder, 6, resume_with_changes=True), workdir)
  assert results["step"] == 6
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4", "6"]


@pytest.mark.slow
def test_a_failed_save_names_the_intact_checkpoint(tmp_path, monkeypatch):
  folder, workdir = _folder(tmp_path), str(tmp_path / "workdir")
  real_save = ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    if step == 4:  # The disk fills up during the second save.
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  with pytest.raises(train.CheckpointSaveError) as error:
    train.train_and_evaluate(_tiny(folder, 6), workdir)
  message = str(error.value)
  assert "No space left on device" in message and "step 4" in message
  assert "The checkpoint of step 2 is intact (the partial save is removed at the next start); free disk space" in message
  monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
  assert train.train_and_evaluate(_tiny(folder, 6), workdir)["step"] == 6


@pytest.mark.slow
def test_a_full_disk_keeps_the_last_checkpoint(tmp_path, caplog):
  """A real 2 MiB filesystem: a checkpoint does not fit, the one before stays readable;
  `python -m vit_jax.main` (saving in the background) exits with 1 and one FATAL line, the rerun
  (in this process) resumes and removes a partial save."""
  mount = tmp_path / "small_disk"
  mount.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                    capture_output=True).returncode:
    pytest.skip("mounting a tmpfs needs root (CI runs as root)")
  try:
    folder, workdir = _folder(tmp_path), mount / "workdir"
    # About 0.85 MiB per checkpoint (70k parameters and two Adam moments): the third does not fit.
    overrides = _main_overrides(folder, width=32, **{"model.mlp_dim": 1024})
    proc = subprocess.run(
        _main_args(workdir, dict(overrides, total_steps=6, log_every_steps=2,
                                 checkpoint_every_steps=2)),
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # The FATAL line ends the output, with no library traceback before it: either the save was
    # refused before it started (too little free space) or Orbax's failure is reported.
    lines = proc.stderr.splitlines()
    assert lines[-2].startswith("FATAL: ") and lines[-1] == "(--verbosity=1 shows the traceback.)"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    fatal = lines[-2]
    assert "No space left on device" in fatal and "; free disk space" in fatal
    intact = int(fatal.split("The checkpoint of step ")[1].split()[0])
    assert 2 <= intact < 6 and (workdir / "checkpoints" / str(intact) / "state").exists()
    # The user frees disk space, as the message says, and reruns.
    subprocess.run(["mount", "-o", "remount,size=8m", str(mount)], check=True)
    _, log = _resume(dict(overrides, total_steps=intact, resume_with_changes=True), workdir,
                     caplog)
    assert f"Resuming from the checkpoint at step {intact}" in log
    assert not [p for p in os.listdir(workdir / "checkpoints") if "tmp" in p]
  finally:
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
def test_non_finite_loss_stops_or_is_skipped(tmp_path, monkeypatch):
  folder = _folder(tmp_path)
  real_loss = optim.loss_fn

  def loss_fn(logits, labels, *args, **kwargs):  # NaN loss and gradients: class 0 first.
    loss = real_loss(logits, labels, *args, **kwargs)
    return loss * jnp.where(labels[0, 0] > 0, jnp.nan, 1.0)

  monkeypatch.setattr(optim, "loss_fn", loss_fn)
  with pytest.raises(FloatingPointError, match=r"Training diverged at step \d+.*(The last good "
                     r"checkpoint \(step \d+\) is kept|There is no checkpoint yet); lower "):
    train.train_and_evaluate(_tiny(folder, 6), str(tmp_path / "stops"))
  workdir = str(tmp_path / "skips")
  results = train.train_and_evaluate(_tiny(folder, 6, **{"optim.max_skipped_updates": 6}),
                                     workdir)
  assert results["step"] == 6
  from tests.test_train import _scalars  # pylint: disable=g-import-not-at-top
  skipped = _scalars(workdir)["train/skipped_updates"]
  assert 0 < sum(skipped.values()) < 6
  assert all(np.isfinite(v).all() for v in _params(workdir).values())


@pytest.mark.slow
def test_a_workdir_of_another_model_is_refused(trained):
  folder, workdir = trained  # Only read: the refused runs write nothing.
  before = sorted(os.listdir(workdir))
  with pytest.raises(train.ConfigError) as error:
    train.train_and_evaluate(_tiny(folder, 4, **{"model.hidden_size": 16}), workdir)
  message = str(error.value)
  assert "checkpoints/4/state does not fit this model:\n  shape mismatches (22): " in message
  assert "params/Transformer/encoder_norm/bias: saved (8,), this run (16,)" in message
  assert "The checkpoint is a ViT with patch_size=4, hidden_size=8, num_layers=1" in message
  assert message.endswith("start a new run in another --workdir.")
  assert sorted(os.listdir(workdir)) == before  # No events file of the refused run.
  # The same model in the other encoder layout (the training default is scanned).
  with pytest.raises(train.ConfigError, match=r"written with the scanned block layout: resume "
                     r"with --config\.model\.scan=True"):
    train.train_and_evaluate(_tiny(folder, 4, **{"model.scan": False}), workdir)
  assert sorted(os.listdir(workdir)) == before


@pytest.mark.slow
def test_a_step_that_is_a_symbolic_link_is_refused_before_training(trained, tmp_path):
  """WORKDIR/checkpoints/2 -> elsewhere: the rerun stops before training (ConfigError: exit 2)
  naming the link and the fix, nothing changed, the linked step untouched (was: each rerun
  trained, saved one more step, then failed on 'Cannot call rmtree on a symbolic link')."""
  folder, workdir = trained[0], tmp_path / "workdir"
  shutil.copytree(trained[1], workdir)
  steps, elsewhere = workdir / "checkpoints", tmp_path / "elsewhere"
  elsewhere.mkdir()
  os.rename(steps / "2", elsewhere / "2")
  os.symlink(elsewhere / "2", steps / "2")
  listing = lambda: [sorted(os.listdir(d)) for d in (workdir, steps, elsewhere / "2")]
  before = listing()
  with pytest.raises(train.ConfigError, match=re.escape(
      f"its checkpoint step {steps}/2 is a symbolic link (to {elsewhere}/2), which the run "
      "cannot remove") + ".*" + re.escape(
          f"(rm {steps}/2 && cp -a {elsewhere}/2 {steps}/2), then rerun.")):
    train.train_and_evaluate(_tiny(folder, 8), str(workdir))
  assert listing() == before


@pytest.mark.slow
def test_init_from_a_patch_size_of_another_grid_of_as_many_tokens_resizes_the_table(
    trained, tmp_path, caplog):
  """FlexiViT from the run of 2x2 grids (patch 4 at 8 px) to patch (8, 2), a 1x4 grid of as many
  tokens: the position table is resized from the grid the run recorded, with the resize line
  (was: kept as it is, read row-major as the 1x4 grid)."""
  folder, workdir = trained
  config = _tiny(folder, 1, **{"model.patch_size": (8, 2), "init_from": workdir})
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(config, str(tmp_path / "finetuned"))
  assert ("pos_embedding (1, 5, 8) -> (1, 5, 8) (2x2 -> 1x4 grid, 1 class-token / register rows "
          "kept, linear_corners)") in caplog.text

def test_a_workdir_that_cannot_be_written_fails_before_any_work(tmp_path, monkeypatch):
  data_utils.skip_cpu_peak_measurement(monkeypatch)
  folder = _folder(tmp_path)
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(train.ConfigError, match=r"--workdir .* cannot be used: .*a_file \(where it "
                     r"would be created\) is not a directory"):
    train.train_and_evaluate(_tiny(folder, 2), str(blocker / "run"))
  # cost.json a directory: refused before training, the workdir as it was (was: the run trained,
  # then failed writing cost.json with "free disk space", which never fixes it).
  (tmp_path / "run" / "cost.json").mkdir(parents=True)
  with pytest.raises(train.ConfigError, match=re.escape(
      f"{tmp_path}/run/cost.json is a directory, where the run writes its cost.json (a file). "
      f"Move it away (mv {tmp_path}/run/cost.json {tmp_path}/run/cost.json.moved) or choose")):
    train.train_and_evaluate(_tiny(folder, 2), str(tmp_path / "run"))
  assert os.listdir(tmp_path / "run") == ["cost.json"]
  mount = tmp_path / "read_only"
  mount.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
                    capture_output=True).returncode:
    return  # Mounting needs root (CI runs as root); the case above still ran.
  try:
    with pytest.raises(train.ConfigError, match=r"read_only \(where it would be created\) is "
                       r"not writable"):
      train.train_and_evaluate(_tiny(folder, 2), str(mount / "run"))
  finally:
    subprocess.run(["umount", str(mount)], check=False)
