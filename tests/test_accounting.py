"""Compute accounting: core-days with a fake clock, the device table, the per-run cost.json and
checkpointed counters (a killed and resumed run adds up its attempts: in
tests/test_train_failures.py). The estimator's tests are in tests/tools/test_cost.py."""

import dataclasses
import json
import logging
import os
import shutil

import numpy as np
import pytest

from vit_jax import accounting
from vit_jax import config as config_lib
from vit_jax import flops
from vit_jax import ledger as ledger_lib
from vit_jax import models

DAY = 86_400.0


class FakeClock:
  """A clock that only moves when told to."""

  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now

  def advance(self, seconds):
    self.now += seconds


def _accountant(device_kind, devices, batch_size=8):
  clock = FakeClock()
  hw = accounting.hardware(device_kind, devices, "bfloat16")
  return accounting.CostAccountant(hw, batch_size, clock=clock), clock


def test_v3_8_for_a_day_and_a_half_is_12_core_days():
  acct, clock = _accountant("TPU v3", 8)
  with acct.timed("train"):
    clock.advance(1.5 * DAY)
  report = acct.report(step=100)
  assert report["train"] == {"device_days": 12.0, "core_days": 12.0, "chip_days": 6.0}
  assert report["program"]["core_days"] == 12.0
  assert report["hardware"]["cores"] == 8 and report["hardware"]["chips"] == 4


def test_v4_8_has_4_devices_of_2_cores():
  acct, clock = _accountant("TPU v4", 4)
  with acct.timed("train"):
    clock.advance(DAY)
  report = acct.report(step=1)
  assert report["train"]["core_days"] == 8.0
  assert report["train"]["chip_days"] == 4.0
  assert report["train"]["device_days"] == 4.0
  assert "8 cores, 4 chips" in acct.hardware.describe()


def test_eval_pauses_count_in_the_program_not_in_training():
  acct, clock = _accountant("TPU v3", 8)
  clock.advance(0.25 * DAY)  # Start-up: 'other'.
  with acct.timed("train"):
    clock.advance(1.0 * DAY)
    with acct.timed("eval"):
      clock.advance(0.5 * DAY)
    with acct.timed("input"):
      clock.advance(0.125 * DAY)
    with acct.timed("checkpoint"):
      clock.advance(0.125 * DAY)
    # A report in the middle of the loop counts the open blocks' time so far.
    mid = acct.report(step=5)
    assert mid["seconds"]["train"] == 1.0 * DAY
    clock.advance(0.5 * DAY)
  report = acct.report(step=10)
  seconds = report["seconds"]
  assert seconds["train"] == 1.5 * DAY
  assert (seconds["eval"], seconds["input"], seconds["checkpoint"]) == (
      0.5 * DAY, 0.125 * DAY, 0.125 * DAY)
  assert seconds["other"] == 0.25 * DAY
  assert seconds["program"] == 2.5 * DAY == sum(
      seconds[k] for k in (*accounting.CATEGORIES, "other"))
  assert report["train"]["core_days"] == 12.0  # 8 cores x 1.5 days: no eval, no start-up.
  assert report["program"]["core_days"] == 20.0  # 8 cores x 2.5 days.
  with pytest.raises(KeyError, match="Unknown cost category 'evaluation'"):
    with acct.timed("evaluation"):
      pass


def test_mfu_images_per_core_and_restarts_add_up():
  acct, clock = _accountant("TPU v3", 8, batch_size=4096)
  acct.set_step_flops(compiled=1.01e13, analytic=1e13)
  with acct.timed("train"):
    clock.advance(100.0)
    acct.count_step(1000)
  first = acct.report(step=1000)
  # 1e16 model FLOPs in 100 s on 8 x 61.5 TFLOP/s: an MFU of 20% (1e18 was 2,033%).
  assert first["mfu"] == pytest.approx(1e16 / (100 * 8 * 61.5e12))
  assert first["achieved_flops_per_sec"] == pytest.approx(1e14)
  assert first["images_per_sec_per_core"] == pytest.approx(4096 * 1000 / (100 * 8))
  assert first["images_seen"] == 4096 * 1000 and first["restarts"] == 0

  # The run is resumed on a v4-8 (4 devices, 8 cores) from the first attempt's record.
  second, clock2 = _accountant("TPU v4", 4, batch_size=4096)
  second.resume(json.loads(json.dumps(first)), start_step=1000)
  second.set_step_flops(compiled=1e13, analytic=1e13)
  with second.timed("train"):
    clock2.advance(50.0)
    second.count_step(500)
  report = second.report(step=1500)
  assert report["restarts"] == 1
  assert [a["start_step"] for a in report["attempts"]] == [0, 1000]
  assert report["seconds"]["train"] == 150.0
  assert report["train"]["core_days"] == pytest.approx((100 * 8 + 50 * 8) / DAY)
  assert report["train"]["chip_days"] == pytest.approx((100 * 4 + 50 * 4) / DAY)
  assert report["images_seen"] == 4096 * 1500
  assert report["mfu"] == pytest.approx(1.5e16 / (100 * 8 * 61.5e12 + 50 * 4 * 275e12))


def test_an_evaluate_only_rerun_keeps_the_flops_and_core_days():
  """A finished run resumed to evaluate only compiles no training step: its report keeps the
  saved FLOPs per step (it wrote null before), and a CPU rerun keeps the TPU core-days."""
  acct, clock = _accountant("TPU v3", 8, batch_size=4096)
  acct.set_step_flops(compiled=1.01e13, analytic=1e13)
  with acct.timed("train"):
    clock.advance(100.0)
    acct.count_step(1000)
  saved = json.loads(json.dumps(acct.report(step=1000)))  # As in cost.json.

  rerun, clock2 = _accountant("TPU v3", 8, batch_size=4096)
  rerun.resume(saved, start_step=1000)
  with rerun.timed("eval"):
    clock2.advance(30.0)
  report = rerun.report(step=1000)
  assert (report["flops_per_step"], report["model_flops_per_step"]) == (1.01e13, 1e13)
  assert report["attempts"][1]["flops_per_step"] is None  # This attempt compiled none.
  assert report["attempts"][1]["steps"] == 0 and report["restarts"] == 1
  assert report["mfu"] == pytest.approx(1e16 / (100 * 8 * 61.5e12))
  assert report["train"]["core_days"] == pytest.approx(100 * 8 / DAY)

  # A cost.json written by the old code (null at the top) is repaired from the attempts.
  damaged = json.loads(json.dumps(report))
  damaged["flops_per_step"] = damaged["model_flops_per_step"] = None
  on_cpu, clock3 = _accountant("cpu", 1, batch_size=4096)
  on_cpu.resume(damaged, start_step=1000)
  with on_cpu.timed("train"):  # The training loop runs no step: a few microseconds.
    clock3.advance(1e-5)
  with on_cpu.timed("eval"):
    clock3.advance(60.0)
  report = on_cpu.report(step=1000)
  assert (report["flops_per_step"], report["model_flops_per_step"]) == (1.01e13, 1e13)
  # Training happened on TPU only: its core-days stand; the CPU's program time has no cores.
  assert report["train"]["core_days"] == pytest.approx(100 * 8 / DAY)
  assert report["program"]["core_days"] is None
  assert report["program"]["device_days"] == pytest.approx((100 * 8 + 30 * 8 + 60) / DAY)
  assert report["train"]["device_days"] == pytest.approx((100 * 8 + 1e-5) / DAY)

  # Compiling a step (here: another batch size's) replaces the saved figures; another batch
  # size does not inherit them.
  other, _ = _accountant("TPU v3", 8, batch_size=1024)
  other.resume(saved, start_step=1000)
  assert other.report(step=1000)["flops_per_step"] is None
  other.set_step_flops(compiled=2.6e14, analytic=2.5e14)
  assert other.report(step=1000)["flops_per_step"] == 2.6e14


@pytest.mark.parametrize("kind, devices, cores, chips, peak", [
    ("TPU v2", 8, 8, 4, 22.5e12),
    ("TPU v5 lite", 8, 8, 8, 197e12),
    ("TPU v5p", 4, 8, 4, 459e12),
    ("TPU v6 lite", 4, 4, 4, 918e12),
])
def test_device_table(kind, devices, cores, chips, peak):
  hw = accounting.hardware(kind, devices, "bfloat16")
  assert (hw.platform, hw.cores, hw.chips, hw.peak_flops_per_device) == (
      "tpu", cores, chips, peak)


def test_gpu_and_cpu_are_reported_as_devices():
  gpu = accounting.hardware("NVIDIA H100 80GB HBM3", 8, "bfloat16")
  assert (gpu.platform, gpu.unit, gpu.cores, gpu.peak_flops_per_device) == (
      "gpu", "device", None, 989e12)
  unknown = accounting.hardware("Some Future GPU", 2, "bfloat16")
  assert unknown.peak_flops_per_device is None
  acct = accounting.CostAccountant(unknown, 8, clock=FakeClock())
  acct.set_step_flops(1e9, 1e9)
  report = acct.report(0)
  assert report["mfu"] is None and report["train"]["core_days"] is None
  assert "MFU unavailable" in accounting.summary(report)
  assert "cost/mfu" not in accounting.scalars(report)
  cpu = accounting.local_hardware()
  assert cpu.platform == "cpu" and cpu.unit == "device"
  assert 1e8 < cpu.peak_flops_per_device < 1e14  # Measured with a matmul.


def _cpu_measured(peak):
  hw = accounting.hardware("cpu", 1, "float32", "cpu", peak_flops_per_device=peak)
  return dataclasses.replace(hw, peak_source="measured: float32 2048^3 matmul")


def _cpu_run(monkeypatch, remeasured_peaks, achieved=2e9):
  """One CPU attempt of `achieved` model FLOP/s against a measured peak of 1 GFLOP/s; each
  re-measurement gives the next of `remeasured_peaks` (one too many fails the test)."""
  monkeypatch.setattr(accounting, "local_hardware", lambda dtype, remeasure=False: (
      _cpu_measured(remeasured_peaks.pop(0))))
  clock = FakeClock()
  acct = accounting.CostAccountant(_cpu_measured(1e9), 8, clock=clock)
  acct.set_step_flops(None, achieved)
  with acct.timed("train"):
    clock.advance(1.0)
    acct.count_step(1)
  return acct


def test_a_cpu_peak_measured_below_the_achieved_rate_is_measured_again(monkeypatch):
  acct = _cpu_run(monkeypatch, [5e9])
  report = acct.report(1)
  assert report["mfu"] == pytest.approx(0.4) and report["mfu_note"] is None
  assert report["hardware"]["peak_flops_per_device"] == 5e9
  assert report["achieved_flops_per_sec"] == pytest.approx(2e9)


def test_mfu_is_never_above_one(monkeypatch):
  """A CPU peak still below the achieved rate after a second measurement (a busy machine) makes
  the MFU unknown, with the figures; it is measured again only once per attempt."""
  acct = _cpu_run(monkeypatch, [1.5e9])
  report = acct.report(1)
  assert acct.report(1)["mfu"] is None  # (No third measurement: the list is empty.)
  assert report["mfu"] is None and report["achieved_flops_per_sec"] == pytest.approx(2e9)
  assert report["mfu_note"] == (
      "MFU unknown: 2 GFLOP/s per device achieved, above the 1.5 GFLOP/s peak measured (a busy, "
      "shared CPU measures its peak low)")
  assert report["mfu_note"] in accounting.summary(report)
  assert "cost/mfu" not in accounting.scalars(report)
  # Resumed by an attempt within its peak: the MFU is that attempt's, the note says what is out.
  second = accounting.CostAccountant(_cpu_measured(4e9), 8, clock=FakeClock())
  second.resume(json.loads(json.dumps(report)), start_step=1)
  second.set_step_flops(None, 2e9)
  with second.timed("train"):
    second._clock.advance(1.0)  # pylint: disable=protected-access
    second.count_step(1)
  report = second.report(2)
  assert report["mfu"] == pytest.approx(0.5)
  assert report["mfu_note"].startswith("MFU of the other attempts (1 of 2 left out): 2 GFLOP/s")


def _cpu_of(peak, host="Some CPU, 2 cores", devices=1):
  hw = accounting.hardware("cpu", devices, "float32", "cpu", peak_flops_per_device=peak)
  return dataclasses.replace(hw, peak_source="measured: float32 2048^3 matmul", host=host)


def _train(acct, steps, seconds, model_flops_per_step):
  acct.set_step_flops(None, model_flops_per_step)
  with acct.timed("train"):
    acct._clock.advance(seconds)  # pylint: disable=protected-access
    acct.count_step(steps)


def test_a_resumed_run_keeps_the_cpu_peak_of_its_first_attempt():
  """One run, one CPU peak (was: each attempt measured its own, 141 then 194 GFLOP/s, and the
  faster attempt showed the lower MFU). Another CPU or device count measures its own."""
  first = accounting.CostAccountant(_cpu_of(141e9), 8, clock=FakeClock())
  _train(first, 10, 10.0, 5e9)  # 5 GFLOP/s: 3.5% of 141.
  report = json.loads(json.dumps(first.report(10)))
  assert report["hardware"]["host"] == "Some CPU, 2 cores"
  assert report["attempts"][0]["host"] == "Some CPU, 2 cores"
  second = accounting.CostAccountant(_cpu_of(194e9), 8, clock=FakeClock())
  second.resume(report, start_step=10)
  _train(second, 20, 10.0, 5e9)  # Twice as fast: 10 GFLOP/s.
  resumed = second.report(30)
  assert resumed["hardware"]["peak_flops_per_device"] == 141e9
  assert [a["peak_flops_per_device"] for a in resumed["attempts"]] == [141e9, 141e9]
  assert resumed["mfu"] == pytest.approx(30 * 5e9 / (20.0 * 141e9))
  for other in (_cpu_of(194e9, host="Other CPU, 8 cores"), _cpu_of(97e9, devices=2)):
    elsewhere = accounting.CostAccountant(other, 8, clock=FakeClock())
    elsewhere.resume(report, start_step=10)
    assert elsewhere.report(10)["hardware"]["peak_flops_per_device"] == other.peak_flops_per_device


def test_a_cpu_peak_measured_again_holds_for_the_earlier_attempts_on_that_cpu(monkeypatch):
  first = accounting.CostAccountant(_cpu_of(1e9), 8, clock=FakeClock())
  _train(first, 1, 1.0, 0.5e9)
  report = json.loads(json.dumps(first.report(1)))
  # The resumed attempt runs above the recorded peak: measured again (5 GFLOP/s), for both.
  again = dataclasses.replace(
      _cpu_of(5e9), peak_source="measured: float32 2048^3 matmul, the best of two measurements")
  monkeypatch.setattr(accounting, "local_hardware", lambda dtype, remeasure=False: again)
  second = accounting.CostAccountant(_cpu_of(3e9), 8, clock=FakeClock())
  second.resume(report, start_step=1)
  assert second.hardware.peak_flops_per_device == 1e9
  _train(second, 1, 1.0, 2e9)
  resumed = second.report(2)
  assert [a["peak_flops_per_device"] for a in resumed["attempts"]] == [5e9, 5e9]
  assert resumed["mfu"] == pytest.approx((0.5e9 + 2e9) / (2.0 * 5e9))
  assert resumed["hardware"]["peak_source"].endswith("the best of two measurements")


def test_float32_peaks_say_which_matmuls_they_are_of():
  assert accounting.accelerator("v3-8", "float32").describe() == (
      "8 x TPU v3 (8 cores, 4 chips), peak 61.5 TFLOP/s per device (bfloat16 matmuls, as "
      "float32 runs at JAX's default precision; published)")
  assert accounting.accelerator("v3-8", "bfloat16").describe().endswith(
      "peak 61.5 TFLOP/s per device (bfloat16; published)")
  assert "156 TFLOP/s per device (tf32 matmuls, as float32" in accounting.accelerator(
      "a100-8", "float32").describe()
  assert "15.7 TFLOP/s per device (float32; published)" in accounting.accelerator(
      "v100-8", "float32").describe()


@pytest.mark.parametrize("name, devices, cores, chips", [
    ("v3-8", 8, 8, 4), ("v3-256", 256, 256, 128), ("v4-32", 16, 32, 16),
    ("v5p-8", 4, 8, 4), ("v5litepod-16", 16, 16, 16), ("v6e-8", 8, 8, 8), ("v4-384", 192, 384, 192),
    ("a100-8", 8, None, None),
])
def test_accelerator_types(name, devices, cores, chips):
  hw = accounting.accelerator(name)
  assert (hw.num_devices, hw.cores, hw.chips) == (devices, cores, chips)


def test_accelerator_type_errors():
  with pytest.raises(ValueError, match="Unknown accelerator 'v9-8'.*v3-8, v3-256"):
    accounting.accelerator("v9-8")
  for name in ("v4-7", "v3-24", "v3-0", "v3-4096", "v5litepod-2", "h100-0"):
    with pytest.raises(ValueError, match="does not exist|Unknown accelerator"):
      accounting.accelerator(name)
  with pytest.raises(ValueError, match="Cloud TPU calls it v5litepod-16"):
    accounting.accelerator("v5e-16")


# ----------------------------------------------------------------------------- goodput ledger


class FakeCache:
  """`vit_jax.step.compile_seconds_saved` of a process: seconds saved so far, set by the test."""

  def __init__(self, saved):
    self.saved = saved

  def __call__(self):
    return self.saved


def _preempted_and_resumed():
  """Attempt 1 on a v3-8: 100 s of set-up, 10 s of input, 50 s of compiling, steps 1-300 at 1 s
  each; killed, its cost.json at step 300. Attempt 2 resumes from the checkpoint of step 200:
  30 s of set-up, the step loaded from the cache in 5 s (35 s of compiling saved), steps 201-400
  at 1 s each, a 10 s save. Returns (attempt 1's report, attempt 2's report)."""
  acct, clock = _accountant("TPU v3", 8)
  clock.advance(100.0)
  with acct.timed("train"):
    with acct.timed("input"):
      clock.advance(10.0)
    with acct.timed("compile"):
      clock.advance(50.0)
    acct.count_step()
    clock.advance(300.0)
    acct.count_step(299)
  first = json.loads(json.dumps(acct.report(step=300)))
  cache = FakeCache(12.0)  # Saved by an earlier run in this process: not this attempt's.
  clock2 = FakeClock()
  second = accounting.CostAccountant(accounting.hardware("TPU v3", 8, "bfloat16"), 8,
                                     clock=clock2, compile_saved=cache)
  clock2.advance(30.0)
  second.resume(first, start_step=200)
  with second.timed("train"):
    with second.timed("compile"):
      clock2.advance(5.0)
      cache.saved += 35.0
    second.count_step()
    clock2.advance(200.0)
    second.count_step(199)
    with second.timed("checkpoint"):
      clock2.advance(10.0)
  return first, second.report(step=400)


def test_the_ledger_counts_redone_steps_resume_time_and_goodput():
  first, report = _preempted_and_resumed()
  assert first["attempts"][0]["resume_s"] == 160.0 and first["attempts"][0]["setup_s"] == 100.0
  assert first["attempts"][0]["redone"] is None and not first["attempts"][0]["resumed"]
  assert first["goodput"] == pytest.approx(300 / 460)
  one, two = report["attempts"]
  assert one == first["attempts"][0]
  assert (two["resumed"], two["resume_s"], two["setup_s"]) == (True, 35.0, 30.0)
  assert two["compile_saved_s"] == 35.0
  # Steps 201-300 again, at attempt 1's 300 s / 300 steps, on its 8 cores (4 chips).
  assert two["redone"] == {"steps": 100, "seconds": 100.0, "from_attempt": 1,
                           "device_days": 800 / DAY, "core_days": 800 / DAY,
                           "chip_days": 400 / DAY}
  assert report["redone_steps"] == 100
  assert report["redone"] == {"device_days": 800 / DAY, "core_days": 800 / DAY,
                              "chip_days": 400 / DAY}
  assert report["train"]["core_days"] == 500 * 8 / DAY
  assert report["productive"]["core_days"] == pytest.approx(400 * 8 / DAY)
  assert report["program"]["core_days"] == 705 * 8 / DAY
  assert report["goodput"] == pytest.approx(400 / 705)
  assert (report["resume_seconds"], report["compile_saved_seconds"]) == (35.0, 35.0)
  rows = ledger_lib.ledger(report)
  assert [r["segments"] for r in rows] == [
      {"training": 200.0, "redone": 100.0, "compile": 50.0, "eval": 0.0, "input": 10.0,
       "checkpoint": 0.0, "setup": 100.0, "other": 0.0},
      {"training": 200.0, "redone": 0.0, "compile": 5.0, "eval": 0.0, "input": 0.0,
       "checkpoint": 10.0, "setup": 30.0, "other": 0.0}]
  assert [sum(r["segments"].values()) for r in rows] == [r["program_s"] for r in rows] == [
      460.0, 245.0]
  assert [(r["redone_steps"], r["resume_s"], r["units"], r["unit"]) for r in rows] == [
      (0, 160.0, 8, "core"), (100, 35.0, 8, "core")]
  assert ", 1 restart(s), goodput 56.7% (100 step(s) redone); seconds: " in accounting.summary(
      report)
  assert accounting.scalars(report)["cost/goodput"] == pytest.approx(400 / 705)
  assert ledger_lib.format_ledger(report).splitlines() == [
      "attempt  steps    on       program s  training  redone  compile  eval  input wait  "
      "checkpoint  set-up/resume  other  resume s  redid steps  cache saved s",
      "1        0-300    8 cores      460.0     200.0   100.0     50.0   0.0        10.0  "
      "       0.0          100.0    0.0     160.0            0            0.0",
      "2        200-400  8 cores      245.0     200.0     0.0      5.0   0.0         0.0  "
      "      10.0           30.0    0.0      35.0          100           35.0",
      "goodput 56.7%: 0.03704 core-days in productive training steps of 0.06528 (1 restart(s)).",
      "redone after preemptions: 100 step(s) (0.009259 core-days); resumes: 35.0 s; compiling "
      "saved by the persistent cache: 35.0 s."]


def test_a_resume_from_the_last_step_redoes_nothing_and_old_accounts_still_add_up():
  """A preemption notice saves the current step (nothing redone); an account written before the
  ledger (no resume, set-up or redone fields) reads as 0 of them; an attempt that never trained
  leaves the redone steps' cost unknown."""
  first, _ = _preempted_and_resumed()
  nothing = accounting.redone_steps(first["attempts"], 300)
  assert nothing == {"steps": 0, "seconds": 0.0, "from_attempt": 1, "device_days": 0.0,
                     "core_days": 0.0, "chip_days": 0.0}
  old = json.loads(json.dumps(first))
  for key in ("resumed", "resume_s", "setup_s", "redone", "compile_saved_s"):
    del old["attempts"][0][key]
  assert ledger_lib.ledger(old)[0]["segments"] == {
      "training": 300.0, "redone": 0.0, "compile": 50.0, "eval": 0.0, "input": 10.0,
      "checkpoint": 0.0, "setup": 0.0, "other": 100.0}
  idle = dict(first["attempts"][0], steps=0, end_step=50)
  assert accounting.redone_steps([idle], 20)["steps"] == 30
  assert accounting.redone_steps([idle], 20)["core_days"] is None


def test_an_account_of_another_shape_is_named_by_its_field(caplog):
  """`check_report`, the check of cost.json before its account is continued or shown: every
  account `report()` writes passes (one before the ledger's fields too), another shape is a
  ValueError naming the file, the field and the fix (was: KeyError or TypeError later)."""
  first, report = _preempted_and_resumed()
  old = json.loads(json.dumps(first))
  for key in ("resumed", "resume_s", "setup_s", "redone", "compile_saved_s"):
    del old["attempts"][0][key]
  for key in ("redone", "productive", "goodput", "redone_steps", "resume_seconds"):
    del old[key]
  for good in (first, report, old):
    assert accounting.check_report(good, "cost.json") is good
  cases = [
      (lambda r: r["attempts"][1].pop("end_step"), "attempts[1].end_step is missing"),
      (lambda r: r["attempts"][0].update(steps="x"), "attempts[0].steps is 'x', not an integer"),
      (lambda r: r["attempts"][0]["seconds"].update(train=True),
       "attempts[0].seconds.train is True, not a number"),
      (lambda r: r["attempts"][1].update(redone=5),
       "attempts[1].redone is 5, not null or an object"),
      (lambda r: r["attempts"][1]["redone"].update(from_attempt=3),
       "attempts[1].redone.from_attempt is 3, not 1 to 2"),
      (lambda r: r.update(attempts={}), "attempts is {}, not a list"),
      (lambda r: r["hardware"].update(unit="chip"), "hardware.unit is 'chip', not 'core' or"),
      (lambda r: r.update(seconds=[]), "seconds is [], not an object"),
  ]
  for change, problem in cases:
    bad = json.loads(json.dumps(report))
    change(bad)
    with pytest.raises(ValueError) as info:
      accounting.check_report(bad, "/w/cost.json", "fix it")
    assert str(info.value).startswith("/w/cost.json is not a cost account of python -m "
                                      f"vit_jax.main ({problem}"), str(info.value)
    assert str(info.value).endswith("; fix it.")
  with pytest.raises(ValueError, match=r"\(it is \[1\], not an object\)"):
    accounting.check_report([1], "cost.json")
  # The account a resume continues: a checkpoint's cost item of another shape is left out.
  with caplog.at_level(logging.WARNING):
    assert accounting.latest_report({"attempts": [{}]}, first) is first
  assert ("The checkpoint's cost item is not a cost account of python -m vit_jax.main (hardware "
          "is missing); it is left out of the account.") in caplog.text


# ----------------------------------------------------------------------------- FLOP counts


def test_traced_count_equals_the_formula():
  b16 = dict(hidden_size=768, mlp_dim=3072, num_layers=12, patch_size=16, image_size=224)
  model = models.create("ViT-B_16", num_classes=1000, scan=True)
  # A scanned model's loop body counts once per layer.
  assert flops.model_forward_macs(model, (224, 224, 3)) == flops.vit_forward_macs(**b16)
  two_layers = dict(b16, num_layers=2)  # Unrolled (2 layers: cheaper to trace than 12).
  model = models.create("ViT-custom", num_classes=1000, num_heads=12, scan=False,
                        **{k: v for k, v in two_layers.items() if k != "image_size"})
  assert flops.model_forward_macs(model, (224, 224, 3)) == flops.vit_forward_macs(**two_layers)


@pytest.mark.parametrize("name, giga_macs", [("T2T-ViT-14", 4.8), ("T2T-ViT_t-14", 6.1)])
def test_traced_count_of_t2t_vit_is_the_papers(name, giga_macs):
  """T2T-ViT paper / docs/reference.md section 2: 4.8 G and 6.1 G MACs at 224 px."""
  macs = flops.model_forward_macs(models.create(name, num_classes=1000), (224, 224, 3))
  assert round(macs / 1e9, 1) == giga_macs


# ----------------------------------------------------------------------------- training runs


def _tiny_run(folder, total_steps):
  from tests import data_utils  # pylint: disable=g-import-not-at-top  (TensorFlow: 5 s, slow only)
  config = data_utils.folder_run_config("ViT-custom", folder, 8, total_steps=total_steps,
                                        hidden_size=8, mlp_dim=16, num_heads=2, num_layers=1,
                                        patch_size=4)
  config.log_every_steps = config.checkpoint_every_steps = 2
  config.eval_every_steps = 4
  config.async_checkpointing = False
  return config


@pytest.mark.slow
def test_a_run_writes_its_cost_and_a_resumed_run_continues_it(tmp_path, caplog):
  from tests import data_utils  # pylint: disable=g-import-not-at-top  (as in _tiny_run)
  from vit_jax import train  # pylint: disable=g-import-not-at-top
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=4,
                                        size=8)
  workdir = str(tmp_path / "workdir")
  train.train_and_evaluate(_tiny_run(folder, 4), workdir)
  first = json.loads(open(os.path.join(workdir, "cost.json")).read())
  seconds = first["seconds"]
  assert seconds["program"] == pytest.approx(
      sum(seconds[k] for k in (*accounting.CATEGORIES, "other")))
  assert seconds["train"] > 0 and seconds["compile"] > 0 and seconds["eval"] > 0
  assert first["images_seen"] == 16 and first["step"] == 4 and first["restarts"] == 0
  # XLA's cost analysis of the train step against 3 x the traced forward matmuls: in a model
  # this small (D=8) normalisation, GELU and AdamW are a third of the work (1.01 for ViT-B/16,
  # tests/test_flops.py).
  assert 1.0 < first["flops_per_step"] / first["model_flops_per_step"] < 2.0
  assert first["model_flops_per_step"] == 3 * 2 * 4 * flops.vit_forward_macs(
      hidden_size=8, mlp_dim=16, num_layers=1, patch_size=4, image_size=8, num_classes=3)
  assert 0 < first["mfu"] < 1
  assert first["program"]["device_days"] == pytest.approx(seconds["program"] / DAY)
  # Every checkpoint holds the account as it was when it was saved.
  saved = json.loads(open(os.path.join(workdir, "checkpoints", "4", "cost", "metadata")).read())
  assert saved["step"] == 4 and saved["attempts"][0]["steps"] == 4

  # A cost.json that cannot be an account (here nested 300,000 deep) is ignored with a warning:
  # the checkpoint's account is continued (was: a RecursionError traceback at every rerun).
  with open(os.path.join(workdir, "cost.json"), "w") as f:
    f.write("[" * 300_000)
  longer = _tiny_run(folder, 6)
  longer.resume_with_changes = True  # 2 more steps.
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(longer, workdir)
  assert f"Ignoring {workdir}/cost.json ({workdir}/cost.json is nested more than 64" in caplog.text
  second = json.loads(open(os.path.join(workdir, "cost.json")).read())
  assert second["restarts"] == 1 and second["images_seen"] == 16 + 8
  assert second["attempts"][0] == saved["attempts"][0]
  assert second["attempts"][1]["start_step"] == 4 and second["attempts"][1]["steps"] == 2
  assert second["seconds"]["program"] == pytest.approx(
      saved["attempts"][0]["seconds"]["program"] + second["attempts"][1]["seconds"]["program"])
  scalars = _scalars(workdir)
  assert scalars["cost/restarts"][6] == 1
  assert scalars["cost/program_device_days"][6] == pytest.approx(
      second["program"]["device_days"], rel=1e-5)

  # An evaluate-only rerun of the finished run compiles no training step: the FLOPs stay (they
  # were written as null before).
  train.train_and_evaluate(_tiny_run(folder, 6), workdir)
  third = json.loads(open(os.path.join(workdir, "cost.json")).read())
  assert third["restarts"] == 2 and third["attempts"][2]["steps"] == 0
  assert third["attempts"][2]["flops_per_step"] is None
  assert second["flops_per_step"] is not None
  assert (third["flops_per_step"], third["model_flops_per_step"]) == (
      second["flops_per_step"], second["model_flops_per_step"])
  assert third["mfu"] == pytest.approx(second["mfu"])

  # Its checkpoints lost (as a run killed before its first save): it starts again from step 0 and
  # keeps the account; all 6 steps are redone, at the rate of attempt 2 (the last that trained).
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  train.train_and_evaluate(_tiny_run(folder, 6), workdir)
  fourth = json.loads(open(os.path.join(workdir, "cost.json")).read())
  assert fourth["restarts"] == 3 and fourth["attempts"][:3] == third["attempts"]
  redone = fourth["attempts"][3]["redone"]
  assert (fourth["attempts"][3]["start_step"], redone["steps"], redone["from_attempt"]) == (0, 6, 2)
  assert redone["seconds"] == pytest.approx(6 * third["attempts"][1]["seconds"]["train"] / 2)


def _scalars(workdir):
  from tests.test_train import _scalars as read  # pylint: disable=g-import-not-at-top
  return read(workdir)
