"""Exact evaluation: every example of every eval set counted once (padded, masked batches), the
eval step's sums added up here (`sum_batches`, run by the trainer and `python -m
vit_jax.evaluate`); a hit is a top class among the true labels (precision@1 for multi-label).
Submodules: `fewshot`, `features`, `pictures`.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Callable, Iterable, Iterator, Optional

from absl import logging
import jax
import ml_collections

from vit_jax import data


def eval_name(split: str) -> str:
  """'test' -> 'test', 'train[98%:]' -> 'train_98': a TensorBoard-friendly name of a split."""
  return re.sub(r"[^A-Za-z0-9]+", "_", split).strip("_")


def eval_sets(config: ml_collections.ConfigDict, info: data.DatasetInfo) -> dict[str, Any]:
  """{name: (split, `EvalDataset`)} of `data.eval_split` and `extra_eval` (same classes and
  preprocessing, e.g. ImageNet ReaL); ValueError: an extra eval set of other classes."""
  evals = {eval_name(config.data.eval_split): (
      config.data.eval_split,
      data.create_eval_dataset(config.data, global_batch_size=config.eval_batch_size))}
  if config.extra_eval.name:
    extra = ml_collections.ConfigDict(config.data.to_dict())
    extra.update(name=config.extra_eval.name, eval_split=config.extra_eval.split, image_folder=None)
    extra_ds = data.create_eval_dataset(extra, global_batch_size=config.eval_batch_size)
    extra_classes = extra_ds.dataset.element_spec["labels"].shape[-1]
    if extra_classes != info.num_classes:
      raise ValueError(
          f"config.extra_eval.name={config.extra_eval.name!r} has {extra_classes} classes, "
          f"the training data {info.num_classes}: an extra eval needs the same label set.")
    base = config.extra_eval.name.rstrip("/").rsplit("/", 1)[-1]
    evals[eval_name(f"{base}_{config.extra_eval.split}")] = (config.extra_eval.split, extra_ds)
  return evals


class Stopped(Exception):
  """An evaluation ended at a batch boundary by a stop notice (`Stoppable`): no results."""


class Stoppable:
  """`batches` (re-iterable, e.g. an `EvalDataset`) that raise `Stopped` before a batch once
  `stop()` is true; `stop` is called before every batch (on a pod: on every process at the same
  batch, see `vit_jax.stops.StopNotice.agreed`)."""

  def __init__(self, batches: Iterable[dict], stop: Callable[[], bool]):
    self.batches = batches
    self.stop = stop

  def __iter__(self) -> Iterator[dict]:
    for batch in self.batches:
      if self.stop():
        raise Stopped()
      yield batch

  def __len__(self) -> int:
    return len(self.batches)


def sum_batches(predict: Callable[[Any, dict], Any], state, batches: Iterable[dict],
                on_batch: Optional[Callable[[int, dict, Any], None]] = None) -> dict[str, Any]:
  """The sums over this process's `batches` of `predict(state, batch)`'s sums (or of `(sums,
  outputs)`), on the host; `on_batch(i, batch, what predict returned)` after each batch."""
  totals: dict[str, Any] = {}
  for i, batch in enumerate(batches):
    outputs = predict(state, batch)
    sums = outputs[0] if isinstance(outputs, tuple) else outputs
    for k, v in jax.device_get(sums).items():
      totals[k] = totals.get(k, 0) + v
    if on_batch is not None:
      on_batch(i, batch, outputs)
  return totals


def evaluate(predict: Callable[[Any, dict], Any], state, evals: dict[str, Any], *,
             with_ema: bool, step: int) -> dict[str, float]:
  """`{'<name>[_ema]/accuracy', '.../loss', '.../top5_accuracy' (>= 5 classes)}` of every eval
  set of `eval_sets`, with `predict(state, numpy batch) -> sums` (the eval step), for the
  parameters and `with_ema` `state['ema_params']`. ValueError: a split without labelled examples;
  `Stopped`: a `Stoppable` eval set was stopped.
  """
  weights = {"": state}
  if with_ema:
    weights["_ema"] = dict(state, params=state["ema_params"])
  logging.info("Evaluating step %d: %d batches.", step,
               len(weights) * sum(len(eval_ds) for _, eval_ds in evals.values()))
  results = {}
  for (name, (split, eval_ds)), (suffix, weights_state) in itertools.product(
      evals.items(), weights.items()):
    totals = sum_batches(predict, weights_state, eval_ds)
    count = int(totals.pop("count"))
    if count == 0:
      raise ValueError(f"The eval split '{split}' has no (labelled) examples; choose a "
                       "non-empty split (--config.data.eval_split / extra_eval.split).")
    name += suffix
    metrics = {f"{name}/accuracy": totals["correct"] / count,
               f"{name}/loss": totals["loss"] / count}
    if "correct_top5" in totals:
      metrics[f"{name}/top5_accuracy"] = totals["correct_top5"] / count
    logging.info("Evaluated %d examples of '%s' at step %d: %s", count, split, step,
                 ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    results.update(metrics)
  return results
