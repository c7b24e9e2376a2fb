"""The training log's progress line, one per `log_every_steps` window (docs/compute_cost.md, "The
log"): loss, learning rate, images/s, MFU and an ETA, timed by the run's cost account."""

from __future__ import annotations

from typing import Any, Optional

from absl import logging
import numpy as np

from vit_jax import accounting


def input_wait_fix(data: Any) -> str:
  """What to change when training waits on input, for `data` (a config.data)."""
  fixes = []
  if data.get("num_parallel_calls", -1) != -1:
    fixes.append(f"config.data.num_parallel_calls=-1 (tf.data's AUTOTUNE uses every core; now "
                 f"{data.num_parallel_calls})")
  if not data.get("cache", True):
    fixes.append("config.data.cache=True when the decoded training images fit in host memory")
  if (data.get("randaugment_num_layers", 0) or data.get("random_erasing", 0)
      or data.get("mixup_alpha", 0) or data.get("cutmix_alpha", 0)):
    fixes.append("lighter augmentation (RandAugment, random erasing and Mixup/CutMix cost the "
                 "most CPU per image)")
  fixes.append("a host with more CPU cores per accelerator")
  return ("Fix: " + "; or ".join(fixes) + ". `python -m benchmarks --input-pipeline` (in the "
          "repository's root) measures the pipeline's images/s alone.")


class Progress:
  """The training metrics since the last progress line, and the line. Throughput and ETA come
  from the accountant's training time (`CostAccountant.training_seconds`); images/s is the
  window's, the ETA at this attempt's mean time per step (big_vision's measure)."""

  def __init__(self, accountant: accounting.CostAccountant, batch_size: int, total_steps: int,
               start_step: int, input_wait_warning: float = 0.0, input_fix: str = ""):
    """`input_wait_warning`: warn (once, saying `input_fix`) when a window waited on input more
    than this share of its training time (0: never)."""
    self._accountant = accountant
    self._batch_size = batch_size
    self._total = total_steps
    self._warn_above = input_wait_warning
    self._input_fix = input_fix
    self._warned = False
    self._metrics: list[dict[str, np.ndarray]] = []
    self.restart(start_step)

  def restart(self, step: int) -> None:
    """Measures the throughput and the ETA from here (after the compiling step)."""
    self._window(step)
    self._origin = (step, self._seconds)

  def _window(self, step: int) -> None:
    self._step = step
    self._seconds = self._accountant.training_seconds()
    self._input = self._accountant.seconds()["input"]

  def add(self, metrics: dict[str, np.ndarray]) -> None:
    """One step's fetched metrics (float scalars: 'loss', 'lr', ... and maybe 'skipped')."""
    self._metrics.append(metrics)

  def eta_seconds(self, step: int) -> Optional[float]:
    """Seconds of training steps left after `step` at this attempt's mean rate; None before a
    step was timed."""
    steps = step - self._origin[0]
    seconds = self._accountant.training_seconds() - self._origin[1]
    return (self._total - step) * seconds / steps if steps > 0 and seconds > 0 else None

  def summary(self, step: int, skipping: bool, mfu: Optional[float] = None) -> dict[str, float]:
    """The window's means (without skipped updates' non-finite values) and rates, as
    'train/<name>' scalars; logs the progress line (with `mfu`, the run's so far, when known)."""
    metrics, self._metrics = self._metrics, []
    out = {}
    for k in metrics[0]:
      if k == "skipped":
        continue
      finite = [m[k] for m in metrics if np.isfinite(m[k])]
      out[f"train/{k}"] = float(np.mean(finite or [np.nan]))
    out["train/lr"] = float(metrics[-1]["lr"])
    if skipping:
      out["train/skipped_updates"] = float(sum(m["skipped"] for m in metrics))
      if out["train/skipped_updates"]:
        logging.warning("Step %d: skipped %d update(s) with non-finite gradients in the last "
                        "%d steps.", step, out["train/skipped_updates"], len(metrics))
    parts = [f"loss {out['train/loss']:.4f}"]
    if "train/accuracy" in out:
      parts.append(f"accuracy {out['train/accuracy']:.4f}")
    parts.append(f"lr {out['train/lr']:.3g}")
    seconds = self._accountant.training_seconds() - self._seconds
    if step > self._step and seconds > 0:  # (Not a window of the compiling step alone.)
      steps_per_sec = (step - self._step) / seconds
      out["train/steps_per_sec"] = steps_per_sec
      out["train/images_per_sec"] = steps_per_sec * self._batch_size
      parts.append(f"{out['train/images_per_sec']:,.0f} images/s")
      waited = self._accountant.seconds()["input"] - self._input
      out["train/input_wait_share"] = waited / seconds
      parts += self._input_wait(step, waited, seconds)
    if mfu is not None:
      parts.append(f"MFU {mfu:.1%}")
    eta = self.eta_seconds(step)
    if eta is not None and step < self._total:
      parts.append(f"ETA {accounting.duration(eta)}")
    logging.info("Step %d/%d (%.1f%%): %s.", step, self._total, 100 * step / self._total,
                 ", ".join(parts))
    self._window(step)
    return out

  def _input_wait(self, step: int, waited: float, seconds: float) -> list[str]:
    """The window's input wait above the threshold: warned of once, then on the progress line."""
    if not self._warn_above or waited <= self._warn_above * seconds:
      return []
    if self._warned:
      return [f"input wait {waited / seconds:.0%}"]
    self._warned = True
    logging.warning(
        "Steps %d-%d waited for their input %.0f%% of the time (%.3g of %.3g s), above "
        "config.input_wait_warning=%g: the host prepares batches slower than the devices take "
        "them. %s Later windows above it say 'input wait N%%' on their progress line.",
        self._step + 1, step, 100 * waited / seconds, waited, seconds, self._warn_above,
        self._input_fix)
    return []
