"""A stop notice during an evaluation (issue 50, item 13): SIGTERM or a first Ctrl-C ends it at
the next batch, the step is saved, `Preempted` (exit 75 / 130) with nothing of the evaluation
written, and the rerun evaluates again (was: held until the evaluation ended, then exit 0)."""

import io
import os
import signal
import subprocess
import threading
import time

import numpy as np
import PIL.Image
import psutil
import pytest

from tests import data_utils
from tests.test_pod_faults import _free_port
from tests.test_train import _scalars
from tests.test_train_failures import ENV, ROOT, _main_args, _main_config, _main_overrides
from vit_jax import data
from vit_jax import stops
from vit_jax import train

_NO_PICTURES = {"analysis.attention_images": 0, "analysis.rollout_images": 0}


def _folder(tmp_path):
  return data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=8,
                                      size=8)


def _signal_at_eval_batch(monkeypatch, signum, at):
  """Sends `signum` to this process as the eval batch number `at` (counted over all the eval
  passes, from 0) is read; returns the list of the batch numbers read."""
  create, read = data.create_eval_dataset, []

  class Signalling:

    def __init__(self, eval_ds):
      self.eval_ds = eval_ds

    def __len__(self):
      return len(self.eval_ds)

    def __iter__(self):
      for batch in self.eval_ds:
        read.append(len(read))
        if read[-1] == at:
          os.kill(os.getpid(), signum)
        yield batch

  monkeypatch.setattr(data, "create_eval_dataset", lambda *a, **k: Signalling(create(*a, **k)))
  return read


def test_sigterm_during_the_final_evaluation_ends_it_at_the_next_batch(tmp_path, monkeypatch):
  """The final evaluation (6 batches of 4) gets SIGTERM as its second batch is read: it ends
  before the third, the last step (saved before the evaluation) is kept, nothing is written as
  its results, and `Preempted` says so (`main`: exit 75)."""
  overrides = _main_overrides(_folder(tmp_path), total_steps=2, **_NO_PICTURES)
  read = _signal_at_eval_batch(monkeypatch, signal.SIGTERM, at=1)
  workdir = tmp_path / "workdir"
  with pytest.raises(train.Preempted) as e:
    train.train_and_evaluate(_main_config(overrides), str(workdir))
  assert e.value.step == 2 and not e.value.interrupted
  assert read == [0, 1]  # Was: all 6 batches, then the results returned.
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
  assert not [tag for tag in _scalars(str(workdir)) if tag.startswith("test/")]


@pytest.mark.slow
def test_a_periodic_evaluation_stopped_saves_its_step_and_the_rerun_redoes_it(tmp_path,
                                                                              monkeypatch):
  """A first Ctrl-C in the evaluation of step 2, not a checkpoint step: step 2 is saved
  (`main`: exit 130); the rerun resumes there, evaluates step 2 first, then trains on to the end.
  A rerun of the finished run evaluates only; SIGTERM there stops at once (as in the set-up:
  there is nothing to save)."""
  overrides = _main_overrides(_folder(tmp_path), total_steps=4, eval_every_steps=2,
                              checkpoint_every_steps=1000, **_NO_PICTURES)
  read = _signal_at_eval_batch(monkeypatch, signal.SIGINT, at=0)
  workdir = tmp_path / "workdir"
  with pytest.raises(train.Preempted) as e:
    train.train_and_evaluate(_main_config(overrides), str(workdir))
  assert e.value.step == 2 and e.value.interrupted and read == [0]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
  monkeypatch.undo()
  results = train.train_and_evaluate(_main_config(overrides), str(workdir))
  assert results["step"] == 4
  assert sorted(_scalars(str(workdir))["test/accuracy"]) == [2, 4]  # Step 2's redone.
  read = _signal_at_eval_batch(monkeypatch, signal.SIGTERM, at=1)
  with pytest.raises(stops.StopRequested) as stop:
    train.train_and_evaluate(_main_config(overrides), str(workdir))
  assert stop.value.exit_code == 75 and read == [0, 1]


def test_on_a_pod_every_process_gets_the_same_answer_from_any_ones_notice(monkeypatch):
  """`StopNotice.agreed` on a pod of 2 (its all-gather faked): True on every process once any
  has a notice, its own or jax's preemption service's key (SIGTERM there is jax's)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  keys, peer = {}, [False]

  class Client:

    def key_value_try_get(self, key):
      if key not in keys:
        raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
      return keys[key]

  monkeypatch.setattr("jax.process_count", lambda: 2)
  monkeypatch.setattr(distributed.global_state, "client", Client())
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([x, peer[0]]))
  notice = stops.StopNotice()
  assert not notice.agreed()
  peer[0] = True  # The other process has one.
  assert notice.agreed()
  peer[0] = False
  keys["RECEIVED_PREEMPTION_NOTICE"] = "2026-01-01T00:00:00Z"  # jax's, this process.
  assert notice.agreed()
  del keys["RECEIVED_PREEMPTION_NOTICE"]
  notice.notify("SIGTERM")
  assert notice.agreed()


def _large_eval_split(tmp_path, test_per_class):
  """An image folder of 3 classes: 8 train and `test_per_class` test images of 8 x 8 each."""
  root = tmp_path / "images"
  for split, count in (("train", 8), ("test", test_per_class)):
    for c in range(3):
      (root / split / f"class_{c}").mkdir(parents=True)
      png = io.BytesIO()
      PIL.Image.fromarray(np.full((8, 8, 3), 80 * c, np.uint8)).save(png, "PNG")
      for k in range(count):
        (root / split / f"class_{c}" / f"img_{k}.png").write_bytes(png.getvalue())
  return str(root)


@pytest.mark.slow
def test_sigterm_during_the_final_evaluation_exits_75_and_the_rerun_evaluates(tmp_path):
  """`python -m vit_jax.main` with a final evaluation of 3000 batches (seconds): SIGTERM once it
  starts ends it at the next batch with exit 75, the last step saved; the rerun evaluates it
  again and exits 0 with the final evaluation line (was: exit 0 once the evaluation ended)."""
  folder, workdir = _large_eval_split(tmp_path, 1000), tmp_path / "workdir"
  args = _main_args(workdir, _main_overrides(folder, total_steps=2, eval_batch_size=1,
                                             **_NO_PICTURES))
  proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  lines, signalled = [], []

  def read_stderr():
    for line in proc.stderr:
      lines.append(line)
      if "Evaluating step 2: 3000 batches." in line and not signalled:
        signalled.append(time.monotonic())
        proc.send_signal(signal.SIGTERM)

  reader = threading.Thread(target=read_stderr, daemon=True)
  reader.start()
  try:
    proc.wait(timeout=300)
    reader.join(timeout=10)
  finally:
    proc.kill()
  stderr = "".join(lines)
  assert signalled and proc.returncode == 75, stderr[-3000:]
  elapsed = time.monotonic() - signalled[0]
  assert f"Preempted: saved the checkpoint of step 2 in {workdir}; rerun the same command" in (
      stderr)
  # Measured: exit 1.0 s after the signal; the whole evaluation takes 5.2 s (the rerun's).
  assert "Evaluated 3000 examples" not in stderr and elapsed < 60, elapsed
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]

  rerun = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "already finished its 2 steps; evaluating only." in rerun.stderr
  assert "Evaluated 3000 examples of 'test' at step 2: test/accuracy=" in rerun.stderr
  assert rerun.stdout.startswith("Final evaluation at step 2: test/accuracy=")


@pytest.mark.slow
def test_sigterm_to_one_process_of_a_pod_during_its_evaluation_stops_both_at_one_batch(tmp_path):
  """A pod of 2 processes; SIGTERM to process 1 (its supervisor and child) once its final
  evaluation started: jax's preemption service records it, both processes read it before the
  same eval batch (`StopNotice.agreed`: one all-gather, so neither waits in a collective for the
  other), leave the evaluation there and exit 75 with step 2 saved (was: exit 0 after it)."""
  port, folder = _free_port(), _large_eval_split(tmp_path, 500)
  args = _main_args(tmp_path / "workdir", _main_overrides(folder, total_steps=2,
                                                          eval_batch_size=2, **_NO_PICTURES))
  procs = [subprocess.Popen(
      [*args, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={i}", "--distributed_timeout=10"],
      cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True) for i in range(2)]
  lines, signalled = ([], []), []

  def read_stderr(i):
    for line in procs[i].stderr:
      lines[i].append(line)
      if i == 1 and "Evaluating step 2: 750 batches." in line and not signalled:
        signalled.append(time.monotonic())
        child = psutil.Process(procs[1].pid).children()
        for pid in [procs[1].pid] + [c.pid for c in child]:
          os.kill(pid, signal.SIGTERM)

  readers = [threading.Thread(target=read_stderr, args=(i,), daemon=True) for i in range(2)]
  for reader in readers:
    reader.start()
  try:
    for proc in procs:
      proc.wait(timeout=300)
    for reader in readers:
      reader.join(timeout=10)
  finally:
    for proc in procs:
      proc.kill()
  stderrs = ["".join(l) for l in lines]
  assert signalled and [p.returncode for p in procs] == [75, 75], [e[-3000:] for e in stderrs]
  elapsed = time.monotonic() - signalled[0]
  for stderr in stderrs:
    assert (f"Preempted: saved the checkpoint of step 2 in {tmp_path / 'workdir'}; rerun the "
            "same command") in stderr
    assert "Evaluated " not in stderr
  assert sorted(os.listdir(tmp_path / "workdir" / "checkpoints")) == ["2"]
  assert elapsed < 60, elapsed  # Measured: 2.8-4.5 s for both (2 busy cores).
