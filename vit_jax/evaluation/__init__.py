"""Exact evaluation: every example of every eval set counted once, top-1, top-5 and loss.

Each process reads its part of the eval split, padded to whole batches with masked examples
(`vit_jax.data.create_eval_dataset`); the compiled eval step (`vit_jax.step.make_eval_step`)
returns sums over the real examples, which are added up here (`sum_batches`, the evaluator that
the trainer and `python -m vit_jax.evaluate` run). A prediction is a hit when its top
class is among the true labels: top-1 accuracy, or precision@1 for multi-label data.

The package's other modules: `fewshot` (few-shot linear evaluation: its tasks and evaluator),
`linear_probe` (the closed-form ridge probe and the k-shot draws), `features` (the pre-logit
features of a dataset, sharded like the eval step), `pictures` (`config.analysis`: attention
figures and training images in TensorBoard).
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Callable, Iterable, Optional

from absl import logging
import jax
import ml_collections

from vit_jax import data


def eval_name(split: str) -> str:
  """'test' -> 'test', 'train[98%:]' -> 'train_98': a TensorBoard-friendly name of a split."""
  return re.sub(r"[^A-Za-z0-9]+", "_", split).strip("_")


def eval_sets(config: ml_collections.ConfigDict, info: data.DatasetInfo) -> dict[str, Any]:
  """{name: (split, `vit_jax.data.EvalDataset`)}: `data.eval_split`, and `extra_eval` (same classes and
  preprocessing, e.g. the ImageNet ReaL labels next to the ImageNet validation labels).

  Raises:
    ValueError: the extra eval set has another number of classes.
  """
  evals = {eval_name(config.data.eval_split): (
      config.data.eval_split,
      data.create_eval_dataset(config.data, global_batch_size=config.eval_batch_size))}
  if config.extra_eval.name:
    extra = ml_collections.ConfigDict(config.data.to_dict())
    extra.update(name=config.extra_eval.name, eval_split=config.extra_eval.split,
                 image_folder=None)
    extra_ds = data.create_eval_dataset(extra, global_batch_size=config.eval_batch_size)
    extra_classes = extra_ds.dataset.element_spec["labels"].shape[-1]
    if extra_classes != info.num_classes:
      raise ValueError(
          f"config.extra_eval.name={config.extra_eval.name!r} has {extra_classes} classes, "
          f"the training data {info.num_classes}: an extra eval needs the same label set.")
    base = config.extra_eval.name.rstrip("/").rsplit("/", 1)[-1]
    evals[eval_name(f"{base}_{config.extra_eval.split}")] = (config.extra_eval.split, extra_ds)
  return evals


def sum_batches(predict: Callable[[Any, dict], Any], state, batches: Iterable[dict],
                on_batch: Optional[Callable[[int, dict, Any], None]] = None) -> dict[str, Any]:
  """The evaluator: sums over `batches` (this process's padded, masked numpy batches) of
  `predict(state, batch)`'s replicated sums (`vit_jax.step.eval_sums`; or `(sums, outputs)`),
  fetched to the host; `on_batch(i, batch, what predict returned)` after each batch."""
  totals: dict[str, Any] = {}
  for i, batch in enumerate(batches):
    outputs = predict(state, batch)
    for k, v in jax.device_get(outputs[0] if isinstance(outputs, tuple) else outputs).items():
      totals[k] = totals.get(k, 0) + v
    if on_batch is not None:
      on_batch(i, batch, outputs)
  return totals


def evaluate(predict: Callable[[Any, dict], Any], state, evals: dict[str, Any], *,
             with_ema: bool, step: int) -> dict[str, float]:
  """Every example of every eval set exactly once (`sum_batches`), with the parameters and (if
  kept) their EMA as '<split>_ema/...'.

  Args:
    predict: `(state, this process's numpy batch) -> sums` of `vit_jax.step.make_eval_step`.
    state: the train state (`vit_jax.step`); with_ema: also evaluate `state['ema_params']`.
    evals: `eval_sets`' {name: (split, dataset)}.
    step: for the log line.

  Returns:
    `{'<name>[_ema]/accuracy', '<name>[_ema]/loss', '<name>[_ema]/top5_accuracy' (>= 5 classes)}`.

  Raises:
    ValueError: an eval split without (labelled) examples.
  """
  weights = {"": state}
  if with_ema:
    weights["_ema"] = dict(state, params=state["ema_params"])
  results = {}
  for (name, (split, eval_ds)), (suffix, weights_state) in itertools.product(
      evals.items(), weights.items()):
    totals = sum_batches(predict, weights_state, eval_ds)
    count = int(totals.pop("count"))
    if count == 0:
      raise ValueError(f"The eval split '{split}' has no (labelled) examples; choose a "
                       "non-empty split (--config.data.eval_split / extra_eval.split).")
    name += suffix
    metrics = {f"{name}/accuracy": totals["correct"] / count, f"{name}/loss": totals["loss"] / count}
    if "correct_top5" in totals:
      metrics[f"{name}/top5_accuracy"] = totals["correct_top5"] / count
    logging.info("Evaluated %d examples of '%s' at step %d: %s", count, split, step,
                 ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    results.update(metrics)
  return results
