"""Few-shot linear evaluation of frozen pre-logit features (ViT paper, Sec. 4.1 and App. B).

For k shots: k labelled training images per class are featurised by the model without its head
(`vit_jax.step.make_features_step`); a regularised least-squares regression maps the features to
{-1, 1} one-hot targets, solved in closed form; its argmax classifies the eval split's features.
Reported: the accuracy averaged over several seeds (different k-shot draws) and its spread.

  evaluator = Evaluator.from_config(config, setup)             # during training
  scalars = evaluator.run(variables)   # {'fewshot/<dataset>_<k>shot': mean, ..._std: std}

The protocol is big_vision's `evaluators/fewshot_lsr.py` (the ViT authors' public evaluator):
standardised features with a bias feature (`BIAS_FEATURE`), targets 2 * one_hot - 1, l2 = 2^10,
the shots of seed s drawn by `numpy.random.default_rng(s)`. Its differences (a prefix of the
train split as the pool, `NotEnoughExamplesError`, several l2 chosen on held-out pool examples,
mean and spread over seeds, float64 on the host) and the full statement: docs/evaluation.md.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Sequence

from absl import logging
import ml_collections

from vit_jax.evaluation import features as features_lib
from vit_jax.evaluation.linear_probe import (  # noqa: F401  (the protocol's API here too)
    BIAS_FEATURE, DEFAULT_L2_REGS, DEFAULT_SEEDS, DEFAULT_SHOTS, HELD_OUT_PER_CLASS, STD_EPSILON,
    LinearProbe, NotEnoughExamplesError, ShotResult, class_permutations, default_train_per_class,
    evaluate_features, linear_accuracy, scalars, shot_indices)


# ------------------------------------------------------------------------------------------
# Datasets and the evaluator.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
  """One few-shot dataset.

  Attributes:
    name: its name in the scalars ('fashion_mnist_local', 'cifar10', an image folder's basename).
    data_config: the `config.data` it is read with (the model's eval preprocessing).
    num_classes: C. label_names: the class names (or None when the data has none).
    train, test: `vit_jax.data.EvalDataset`s of `data_config.train_split` and `.eval_split`.
  """

  name: str
  data_config: ml_collections.ConfigDict
  num_classes: int
  label_names: Optional[tuple[str, ...]]
  train: Any
  test: Any

  def class_name(self, c: int) -> str:
    return repr(self.label_names[c]) if self.label_names else f"class {c}"


def task_name(data_config: ml_collections.ConfigDict) -> str:
  """A TensorBoard-friendly name of the dataset: 'cars196:2.1.0' -> 'cars196_2_1_0', an image
  folder or a prepared directory -> its basename."""
  name = (data_config.image_folder or data_config.name).rstrip("/").rsplit("/", 1)[-1]
  return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "dataset"


#: How `make_task`'s messages name the settings during training (`config.fewshot.*`).
TRAINING_FLAGS = {"config.data.train_split": "config.fewshot.train_split",
                  "config.data.eval_split": "config.fewshot.eval_split",
                  "config.data.name": "config.fewshot.datasets"}


def make_task(data_config: ml_collections.ConfigDict, *, global_batch_size: int,
              flags: Optional[dict[str, str]] = None) -> Task:
  """The few-shot datasets of `data_config` (`config.data` with the few-shot dataset's name or
  image folder and splits in it): checked, both splits opened for reading.

  Args:
    global_batch_size: the batch of the features step (all processes).
    flags: `{'config.data.<key>': what to call it}` in the error messages (e.g.
      `TRAINING_FLAGS`, or a tool's '--train-split'); first match first.

  Raises:
    ValueError: a missing dataset, an unknown split, multi-hot labels (few-shot needs one label
      per image), plus the errors of `vit_jax.data.get_info` (reworded as ValueErrors).
  """
  from vit_jax import data  # pylint: disable=g-import-not-at-top  (TensorFlow: only when used)
  name = data_config.image_folder or data_config.name
  try:
    info = data.get_info(data_config)
  except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
    message = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    for setting, flag in (flags or {}).items():
      message = message.replace(setting, flag)
    raise ValueError(f"Few-shot dataset {name!r}: {message}") from e
  if info.multi_label:
    raise ValueError(f"Few-shot dataset {name!r} has multi-hot labels; few-shot linear "
                     "evaluation needs one label per image: choose a single-label dataset.")
  for key, count in (("train_split", info.num_train_examples),
                     ("eval_split", info.num_eval_examples)):
    if not count:
      flag = (flags or {}).get(f"config.data.{key}", f"config.data.{key}")
      raise ValueError(f"Few-shot dataset {name!r}: the split {data_config[key]!r} ({flag}) "
                       "has no examples; choose a non-empty split.")
  label_names = getattr(info, "label_names", None)
  open_split = lambda split: data.create_eval_dataset(
      data_config, global_batch_size=global_batch_size, split=split)
  return Task(task_name(data_config), data_config, info.num_classes,
              tuple(label_names) if label_names else None,
              open_split(data_config.train_split), open_split(data_config.eval_split))


def task_data_configs(config: ml_collections.ConfigDict) -> list[ml_collections.ConfigDict]:
  """The `config.data` of each few-shot dataset of a training config: its eval preprocessing
  with `config.fewshot.datasets`' names (none: the training data itself) and splits
  (`config.fewshot.train_split` / `eval_split`; None: the training data's splits for the
  training data, 'train' / 'test' for the others); never cached in memory."""
  fewshot, configs = config.fewshot, []
  for name in tuple(fewshot.datasets) or (None,):
    data_config = ml_collections.ConfigDict(config.data.to_dict())
    if name is None:
      splits = (data_config.train_split, data_config.eval_split)
    else:
      data_config.update(name=name, image_folder=None, label_key=None)
      splits = ("train", "test")
    data_config.update(train_split=fewshot.train_split or splits[0],
                       eval_split=fewshot.eval_split or splits[1], cache=False)
    configs.append(data_config)
  return configs


@dataclasses.dataclass(frozen=True)
class TaskResult:
  """One dataset's results: `pool` (training examples kept), `read` (training examples read),
  `test` (eval examples), `shots` ({k: ShotResult})."""
  task: Task
  pool: int
  read: int
  test: int
  shots: dict[int, ShotResult]


class Evaluator:
  """Few-shot linear evaluation of a model's features on some datasets.

  Args:
    tasks: the datasets (`make_task`).
    featurizer: the model's `features.Featurizer`.
    shots, seeds, l2_regs: as `evaluate_features`.
    train_per_class: training examples kept per class (None: `default_train_per_class`).
    max_eval_examples: eval examples used, the first ones (None: the whole eval split).
    strict: a shot count some class has too few examples for raises `NotEnoughExamplesError`;
      False: that shot count is skipped with a warning (during training).
  """

  def __init__(self, tasks: Sequence[Task], featurizer: features_lib.Featurizer, *,
               shots: Sequence[int] = DEFAULT_SHOTS, seeds: int = DEFAULT_SEEDS,
               l2_regs: Sequence[float] = DEFAULT_L2_REGS,
               train_per_class: Optional[int] = None, max_eval_examples: Optional[int] = None,
               strict: bool = True, hint: str = "lower the shots or use a larger train split"):
    self.tasks, self.featurizer = list(tasks), featurizer
    self.shots, self.seeds = tuple(int(k) for k in shots), int(seeds)
    self.l2_regs = tuple(float(v) for v in l2_regs)
    self.train_per_class = train_per_class or default_train_per_class(
        self.shots, self.seeds, self.l2_regs)
    self.max_eval_examples, self.strict, self._hint = max_eval_examples, strict, hint

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, setup: Any, *,
                  compiler: Any = None) -> "Evaluator":
    """The evaluator of a resolved training config's `config.fewshot` (shot counts a class has
    too few examples for are skipped with a warning); `compiler`: as `features.Featurizer`'s.

    Raises:
      ValueError: as `make_task`, the message naming the `config.fewshot` flags.
    """
    fewshot = config.fewshot
    tasks = [make_task(c, global_batch_size=config.eval_batch_size, flags=TRAINING_FLAGS)
             for c in task_data_configs(config)]
    return cls(tasks, features_lib.Featurizer(setup, compiler), shots=fewshot.shots,
               seeds=fewshot.seeds, l2_regs=fewshot.l2_regs,
               train_per_class=fewshot.train_per_class,
               max_eval_examples=fewshot.max_eval_examples, strict=False,
               hint="lower --config.fewshot.shots or use a larger --config.fewshot.train_split")

  def evaluate(self, variables: dict[str, Any]) -> list[TaskResult]:
    """Every task's results for `variables` (`{'params', ['model_state']}` placed with the
    setup's `variables_shardings`).

    Raises:
      NotEnoughExamplesError: (strict) a class of a task's train split has fewer than k
        examples, naming the class and the fix.
      ValueError: several l2 values and no held-out example.
    """
    results = []
    for task in self.tasks:
      pool = features_lib.collect(self.featurizer, variables, task.train,
                                  num_classes=task.num_classes, per_class=self.train_per_class)
      test = features_lib.collect(self.featurizer, variables, task.test,
                                  num_classes=task.num_classes,
                                  max_examples=self.max_eval_examples)
      try:
        shots = evaluate_features(pool.features, pool.labels, test.features, test.labels,
                                  num_classes=task.num_classes, shots=self.shots,
                                  seeds=self.seeds, l2_regs=self.l2_regs,
                                  skip_short=not self.strict)
      except NotEnoughExamplesError as e:
        raise self._not_enough(task, e) from e
      results.append(TaskResult(task, len(pool.labels), pool.read, len(test.labels), shots))
      logging.info("Few-shot %s (%d training examples kept of %d read, %d eval examples): %s",
                   task.name, len(pool.labels), pool.read, len(test.labels),
                   ", ".join(f"{k}-shot {r.mean:.4f} +- {r.std:.4f}" for k, r in shots.items()))
    return results

  def run(self, variables: dict[str, Any]) -> dict[str, float]:
    """`scalars` of every task: `{'fewshot/<dataset>_<k>shot': mean, '..._std': std}`."""
    out = {}
    for result in self.evaluate(variables):
      out.update(scalars(result.task.name, result.shots))
    return out

  def _not_enough(self, task: Task, error: NotEnoughExamplesError) -> NotEnoughExamplesError:
    short = error.short
    listed = ", ".join(f"{task.class_name(c)}: {n}" for c, n in list(short.items())[:5])
    more = f" and {len(short) - 5} more" if len(short) > 5 else ""
    return NotEnoughExamplesError(
        f"{error.shots}-shot on {task.name}: {len(short)} of {task.num_classes} classes have "
        f"fewer than {error.shots} examples in the train split "
        f"{task.data_config.train_split!r} ({listed}{more}); {self._hint}.",
        error.shots, short)
