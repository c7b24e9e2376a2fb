"""The training log's progress line (vit_jax.progress) with a fake clock: its fields, the ETA
at the attempt's mean rate, the input-wait warning once."""

import logging

import numpy as np
import pytest

from vit_jax import accounting
from vit_jax import config as config_lib
from vit_jax import progress
from tests.test_accounting import FakeClock


def _window(total_steps=1000, input_wait_warning=0.0, batch_size=8):
  clock = FakeClock()
  hw = accounting.hardware("TPU v3", 8, "bfloat16")
  acct = accounting.CostAccountant(hw, batch_size, clock=clock)
  window = progress.Progress(acct, batch_size, total_steps, 0, input_wait_warning,
                             "Fix: config.data.cache=True.")
  return window, acct, clock


def _steps(window, acct, clock, first, last, step_s, input_s=0.0, lr=1e-3, loss=2.0):
  with acct.timed("train"):
    for _ in range(first, last + 1):
      with acct.timed("input"):
        clock.advance(input_s)
      clock.advance(step_s)
      window.add({"loss": np.float32(loss), "lr": np.float32(lr),
                  "accuracy": np.float32(0.25)})


def _lines(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_one_line_per_window_with_loss_lr_images_per_second_mfu_and_eta(caplog):
  window, acct, clock = _window()
  with caplog.at_level(logging.INFO, logger="absl"):
    _steps(window, acct, clock, 1, 100, 0.5)
    out = window.summary(100, skipping=False, mfu=0.381)
  assert _lines(caplog) == [
      "Step 100/1000 (10.0%): loss 2.0000, accuracy 0.2500, lr 0.001, 16 images/s, MFU 38.1%, "
      "ETA 7 min 30 s."]
  assert out["train/images_per_sec"] == pytest.approx(16.0)
  assert out["train/steps_per_sec"] == pytest.approx(2.0)
  assert out["train/lr"] == pytest.approx(1e-3)
  caplog.clear()
  # The last window: no ETA; no MFU known: none said.
  with caplog.at_level(logging.INFO, logger="absl"):
    _steps(window, acct, clock, 101, 1000, 0.5, lr=0.0)
    window.summary(1000, skipping=False)
  assert _lines(caplog) == ["Step 1000/1000 (100.0%): loss 2.0000, accuracy 0.2500, lr 0, "
                            "16 images/s."]


def test_the_eta_is_at_the_attempts_mean_rate_not_the_windows(caplog):
  """Windows of 0.5, 1.0 and 0.5 s per step (a busy machine for a while): the per-window ETA
  would jump 7:30 -> 13:20 -> 5:50; the attempt's mean gives 7:30 -> 10:00 -> 7:47. Evaluating
  and checkpointing between windows is not training time."""
  window, acct, clock = _window()
  etas = []
  for first, step_s in ((1, 0.5), (101, 1.0), (201, 0.5)):
    _steps(window, acct, clock, first, first + 99, step_s)
    with acct.timed("eval"):
      clock.advance(60.0)
    etas.append(window.eta_seconds(first + 99))
    window.summary(first + 99, skipping=False)
  assert etas == pytest.approx([900 * 0.5, 800 * 0.75, 700 * (200 / 300)])
  assert window.eta_seconds(300) == pytest.approx(700 * (200 / 300))


def test_the_eta_is_measured_from_the_compiled_step():
  """`restart` after the compiling step: its compile and first step are not the rate."""
  window, acct, clock = _window(total_steps=101)
  with acct.timed("train"):
    clock.advance(30.0)  # The first step's call, which compiled (timed as train here).
  window.restart(1)
  _steps(window, acct, clock, 2, 51, 0.5)
  assert window.eta_seconds(51) == pytest.approx(50 * 0.5)


def test_the_input_wait_is_warned_of_once_then_said_on_the_progress_line(caplog):
  window, acct, clock = _window(total_steps=100, input_wait_warning=0.1)
  with caplog.at_level(logging.INFO, logger="absl"):
    _steps(window, acct, clock, 1, 10, 0.7, input_s=0.3)
    out = window.summary(10, skipping=False)
    assert out["train/input_wait_share"] == pytest.approx(0.3)
    _steps(window, acct, clock, 11, 20, 0.95, input_s=0.05)  # 5%: below the threshold.
    assert window.summary(20, skipping=False)["train/input_wait_share"] == pytest.approx(0.05)
    _steps(window, acct, clock, 21, 30, 0.8, input_s=0.2)
    window.summary(30, skipping=False)
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == [
      "Steps 1-10 waited for their input 30% of the time (3 of 10 s), above "
      "config.input_wait_warning=0.1: the host prepares batches slower than the devices take "
      "them. Fix: config.data.cache=True. Later windows above it say 'input wait N%' on their "
      "progress line."]
  lines = _lines(caplog)
  assert len(lines) == 3 and "input wait" not in lines[0] + lines[1]
  assert ", 8 images/s, input wait 20%, ETA " in lines[2], lines[2]


def test_the_input_wait_fix_names_what_this_config_can_change():
  data = config_lib.get_config("ViT-B_16", "imagenet2012").data
  assert progress.input_wait_fix(data) == (
      "Fix: config.data.cache=True when the decoded training images fit in host memory; or a "
      "host with more CPU cores per accelerator. `python -m benchmarks --input-pipeline` (in the "
      "repository's root) measures the pipeline's images/s alone.")
  data.num_parallel_calls, data.cache, data.mixup_alpha = 4, True, 0.8
  assert progress.input_wait_fix(data).startswith(
      "Fix: config.data.num_parallel_calls=-1 (tf.data's AUTOTUNE uses every core; now 4); or "
      "lighter augmentation (RandAugment, random erasing and Mixup/CutMix cost the most CPU per "
      "image); or a host with more CPU cores per accelerator.")
