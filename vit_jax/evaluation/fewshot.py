"""Few-shot linear evaluation of frozen pre-logit features (ViT paper, Sec. 4.1 and App. B):
big_vision's `fewshot_lsr` protocol, a closed-form ridge probe of k shots per class, mean and
spread over seeds (the protocol and its differences: docs/evaluation.md).

  evaluator = Evaluator.from_config(config, setup)             # during training
  scalars = evaluator.run(variables)   # {'fewshot/<dataset>_<k>shot': mean, ..._std: std}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from absl import logging
import ml_collections
import numpy as np

from vit_jax import data
from vit_jax import evaluation
from vit_jax.evaluation import features as features_lib

#: The constant feature appended to the standardised features (big_vision's BIAS_CONSTANT).
BIAS_FEATURE = 100.0
#: Added to the per-dimension standard deviation (big_vision's value).
STD_EPSILON = 1e-5
DEFAULT_SHOTS = (1, 5, 10, 25)
#: big_vision's default `l2_reg` (2^10).
DEFAULT_L2_REGS = (1024.0,)
DEFAULT_SEEDS = 3
#: Held-out examples per class that choose the l2 when several are given.
HELD_OUT_PER_CLASS = 10


class NotEnoughExamplesError(ValueError):
  """Some class has fewer pool examples than `shots`; `short`: {class: its examples}."""

  def __init__(self, message: str, shots: int, short: dict[int, int]):
    super().__init__(message)
    self.shots = shots
    self.short = short


def _features(x: Any, what: str) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or not x.shape[0]:
    raise ValueError(f"{what} must be a non-empty [N, F] array, got shape {x.shape}.")
  if not np.isfinite(x).all():
    raise ValueError(f"{what} hold NaN or infinite values (a diverged model?).")
  return x


def _labels(y: Any, n: int, num_classes: int, what: str) -> np.ndarray:
  y = np.asarray(y)
  if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f"{what} must be {n} integer labels (shape ({n},)), got {y.dtype} {y.shape}.")
  if n and (y.min() < 0 or y.max() >= num_classes):
    raise ValueError(f"{what} must lie in [0, {num_classes}), got [{y.min()}, {y.max()}].")
  return y.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LinearProbe:
  """The closed-form ridge regression of standardised features (+ the bias feature) to {-1, 1}
  one-hot targets for any l2, W(l2) = lhs diag(1 / (eigs + l2)) rhs: float64 `mean`, `std` [F];
  `eigs` [R] of X^T X (R = F + 1, 'primal' `branch`) or X X^T (R = N, 'dual'); `lhs` [F + 1, R];
  `rhs` [R, C]."""

  mean: np.ndarray
  std: np.ndarray
  eigs: np.ndarray
  lhs: np.ndarray
  rhs: np.ndarray
  branch: str

  @classmethod
  def fit(cls, features: Any, labels: Any, num_classes: int, *,
          branch: str = "auto") -> "LinearProbe":
    """Fits `features` [N, F] (any float array) to int `labels` [N]; `branch` 'auto': 'primal'
    when N >= F + 1, else 'dual'. ValueError: bad shapes or labels, non-finite features."""
    x = _features(features, "The training features")
    y = _labels(labels, x.shape[0], num_classes, "The training labels")
    mean = x.mean(axis=0)
    std = x.std(axis=0) + STD_EPSILON
    probe = cls(mean, std, np.zeros(0), np.zeros((0, 0)), np.zeros((0, 0)), "")
    x = probe.design(x)
    targets = 2.0 * np.eye(num_classes)[y] - 1.0
    n, d = x.shape
    if branch == "auto":
      branch = "primal" if n >= d else "dual"
    if branch == "primal":  # (X^T X + l2 I)^-1 X^T Y, X^T X = Q diag(eigs) Q^T.
      eigs, q = np.linalg.eigh(x.T @ x)
      lhs, rhs = q, q.T @ (x.T @ targets)
    elif branch == "dual":  # X^T (X X^T + l2 I)^-1 Y, X X^T = Q diag(eigs) Q^T.
      eigs, q = np.linalg.eigh(x @ x.T)
      lhs, rhs = x.T @ q, q.T @ targets
    else:
      raise ValueError(f"branch={branch!r} must be 'auto', 'primal' or 'dual'.")
    return dataclasses.replace(probe, eigs=eigs, lhs=lhs, rhs=rhs, branch=branch)

  @property
  def num_classes(self) -> int:
    return self.rhs.shape[1]

  def design(self, features: Any) -> np.ndarray:
    """[N, F] features -> [N, F + 1] float64: standardised, the bias feature appended."""
    x = (np.asarray(features, np.float64) - self.mean) / self.std
    return np.concatenate([x, np.full((x.shape[0], 1), BIAS_FEATURE)], axis=1)

  def weights(self, l2: float) -> np.ndarray:
    """float64 [F + 1, C]: W = (X^T X + l2 I)^-1 X^T Y (the last row: the bias weights)."""
    if not l2 > 0:
      raise ValueError(f"l2={l2!r} must be > 0.")
    return (self.lhs / (self.eigs + l2)) @ self.rhs

  def predict(self, features: Any, l2: float) -> np.ndarray:
    """int64 [N]: the argmax class of each example's regression output."""
    x = self.design(_features(features, "The eval features")).astype(np.float32)
    return np.argmax(x @ self.weights(l2).astype(np.float32), axis=1)

  def accuracy(self, features: Any, labels: Any, l2: float) -> float:
    """The fraction of `labels` (int [N]) that `predict` gets right."""
    x = _features(features, "The eval features")
    y = _labels(labels, x.shape[0], self.num_classes, "The eval labels")
    return float(np.mean(self.predict(x, l2) == y))


def class_permutations(labels: Any, num_classes: int, seed: int) -> list[np.ndarray]:
  """Per class, the indices of its `labels` permuted by `default_rng(seed)` in class order
  (big_vision's draws); the seed's k-shot set is the first k of each."""
  rng = np.random.default_rng(seed)
  labels = np.asarray(labels)
  return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def shot_indices(labels: Any, shots: int, seed: int, num_classes: int) -> np.ndarray:
  """int [shots * num_classes]: the k-shot set of `seed`, by class (NotEnoughExamplesError)."""
  perms = class_permutations(labels, num_classes, seed)
  _check_enough(perms, shots)
  return np.concatenate([p[:shots] for p in perms])


def _listed(short: dict[int, int], name=lambda c: f"class {c}") -> str:
  more = f" and {len(short) - 5} more" if len(short) > 5 else ""
  return ", ".join(f"{name(c)}: {n}" for c, n in list(short.items())[:5]) + more


def _check_enough(perms: Sequence[np.ndarray], shots: int) -> None:
  short = {c: len(p) for c, p in enumerate(perms) if len(p) < shots}
  if short:
    raise NotEnoughExamplesError(
        f"{len(short)} of {len(perms)} classes have fewer than {shots} examples for "
        f"{shots}-shot ({_listed(short)}).", shots, short)


@dataclasses.dataclass(frozen=True)
class ShotResult:
  """The k-shot accuracy (a fraction) of each seed and the l2 each used."""

  shots: int
  accuracies: tuple[float, ...]
  l2_regs: tuple[float, ...]

  @property
  def mean(self) -> float:
    return float(np.mean(self.accuracies))

  @property
  def std(self) -> float:
    """The sample standard deviation over the seeds (ddof=1); 0 for one seed."""
    return float(np.std(self.accuracies, ddof=1)) if len(self.accuracies) > 1 else 0.0


def _choose_l2(probe: LinearProbe, x: np.ndarray, y: np.ndarray, l2_regs: Sequence[float]) -> float:
  """The l2 of the best held-out accuracy (ties: the largest such l2)."""
  if len(l2_regs) == 1:
    return float(l2_regs[0])
  if not len(y):
    raise ValueError(
        f"Choosing among {len(l2_regs)} l2 values needs held-out training examples beyond the "
        "largest shot count, and no class has more examples than that: give one l2 value, "
        "fewer shots, or more training examples per class.")
  accuracies = [probe.accuracy(x, y, l2) for l2 in l2_regs]
  best = max(accuracies)
  return float(max(l2 for l2, a in zip(l2_regs, accuracies) if a == best))


def evaluate_features(train_features: Any, train_labels: Any, test_features: Any,
                      test_labels: Any, *, num_classes: int, shots: Sequence[int] = DEFAULT_SHOTS,
                      seeds: int = DEFAULT_SEEDS, l2_regs: Sequence[float] = DEFAULT_L2_REGS,
                      skip_short: bool = False) -> dict[int, ShotResult]:
  """`{k: ShotResult}` of the k-shot probes of the pool [N, F] scored on the eval features
  [M, F], for seeds 0 .. seeds-1; several `l2_regs` are chosen on up to `HELD_OUT_PER_CLASS`
  pool examples per class outside the shots.

  Raises:
    NotEnoughExamplesError: a class has fewer than k pool examples (`skip_short`: k skipped).
    ValueError: bad shapes or labels; several l2 values and no held-out example.
  """
  train_x = _features(train_features, "The training features")
  train_y = _labels(train_labels, train_x.shape[0], num_classes, "The training labels")
  test_x = _features(test_features, "The eval features")
  test_y = _labels(test_labels, test_x.shape[0], num_classes, "The eval labels")
  if test_x.shape[1] != train_x.shape[1]:
    raise ValueError(f"Training features have {train_x.shape[1]} dimensions, eval features "
                     f"{test_x.shape[1]}.")
  results: dict[int, list[tuple[float, float]]] = {}
  for seed in range(seeds):
    perms = class_permutations(train_y, num_classes, seed)
    feasible = []
    for k in shots:
      try:
        _check_enough(perms, k)
        feasible.append(k)
      except NotEnoughExamplesError as e:
        if not skip_short:
          raise
        if seed == 0:
          logging.warning("Few-shot: skipping %d-shot: %s", k, e)
    if not feasible:
      continue
    held_out = np.concatenate([p[max(feasible):][:HELD_OUT_PER_CLASS] for p in perms])
    for k in feasible:
      chosen = np.concatenate([p[:k] for p in perms])
      probe = LinearProbe.fit(train_x[chosen], train_y[chosen], num_classes)
      l2 = _choose_l2(probe, train_x[held_out], train_y[held_out], l2_regs)
      results.setdefault(k, []).append((probe.accuracy(test_x, test_y, l2), l2))
  return {k: ShotResult(k, tuple(a for a, _ in r), tuple(l2 for _, l2 in r))
          for k, r in results.items()}


def default_train_per_class(shots: Sequence[int], seeds: int, l2_regs: Sequence[float]) -> int:
  """Pool examples kept per class: max(shots) x seeds (+ `HELD_OUT_PER_CLASS` for several l2)."""
  held_out = HELD_OUT_PER_CLASS if len(l2_regs) > 1 else 0
  return max(shots) * seeds + held_out


def scalars(name: str, results: dict[int, ShotResult]) -> dict[str, float]:
  """`{'fewshot/<name>_<k>shot': mean accuracy, 'fewshot/<name>_<k>shot_std': its std}`."""
  out = {}
  for k, r in results.items():
    out[f"fewshot/{name}_{k}shot"] = r.mean
    out[f"fewshot/{name}_{k}shot_std"] = r.std
  return out


@dataclasses.dataclass(frozen=True)
class Task:
  """One few-shot dataset: its `name` in the scalars, the `data_config` it is read with (eval
  preprocessing), C classes and their names (or None), `EvalDataset`s of both splits."""

  name: str
  data_config: ml_collections.ConfigDict
  num_classes: int
  label_names: Optional[tuple[str, ...]]
  train: Any
  test: Any

  def class_name(self, c: int) -> str:
    return repr(self.label_names[c]) if self.label_names else f"class {c}"


def task_name(data_config: ml_collections.ConfigDict) -> str:
  """'cars196:2.1.0' -> 'cars196_2_1_0'; an image folder or directory -> its basename."""
  name = (data_config.image_folder or data_config.name).rstrip("/").rsplit("/", 1)[-1]
  return evaluation.eval_name(name) or "dataset"


#: How `make_task`'s messages name the settings during training (`config.fewshot.*`).
TRAINING_FLAGS = {"config.data.train_split": "config.fewshot.train_split",
                  "config.data.eval_split": "config.fewshot.eval_split",
                  "config.data.name": "config.fewshot.datasets"}


def make_task(data_config: ml_collections.ConfigDict, *, global_batch_size: int,
              flags: Optional[dict[str, str]] = None) -> Task:
  """The `Task` of `data_config` (the few-shot dataset's `config.data`), checked, both splits
  opened; `flags`: `{'config.data.<key>': its name in the messages}` (e.g. `TRAINING_FLAGS`).

  Raises:
    ValueError: a missing dataset or split, an empty split, multi-hot labels; the errors of
      `vit_jax.data.get_info`, reworded.
  """
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
  open_split = lambda split: data.create_eval_dataset(
      data_config, global_batch_size=global_batch_size, split=split)
  return Task(task_name(data_config), data_config, info.num_classes,
              tuple(info.label_names) or None,
              open_split(data_config.train_split), open_split(data_config.eval_split))


def task_data_configs(config: ml_collections.ConfigDict) -> list[ml_collections.ConfigDict]:
  """The uncached `config.data` of each of `config.fewshot.datasets` (none: the training data),
  with its splits (None: the training data's, else 'train' / 'test')."""
  fewshot = config.fewshot
  configs = []
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
  """One dataset's results: training examples kept (`pool`) and `read`, eval examples, shots."""
  task: Task
  pool: int
  read: int
  test: int
  shots: dict[int, ShotResult]


class Evaluator:
  """Few-shot linear evaluation of `featurizer`'s features on `tasks` (`evaluate_features`'s
  arguments; None: `default_train_per_class`, the whole eval split). Not `strict`: a k some class
  cannot give is skipped with a warning rather than raised (during training)."""

  def __init__(self, tasks: Sequence[Task], featurizer: features_lib.Featurizer, *,
               shots: Sequence[int] = DEFAULT_SHOTS, seeds: int = DEFAULT_SEEDS,
               l2_regs: Sequence[float] = DEFAULT_L2_REGS,
               train_per_class: Optional[int] = None, max_eval_examples: Optional[int] = None,
               strict: bool = True, hint: str = "lower the shots or use a larger train split"):
    self.tasks = list(tasks)
    self.featurizer = featurizer
    self.shots = tuple(int(k) for k in shots)
    self.seeds = int(seeds)
    self.l2_regs = tuple(float(v) for v in l2_regs)
    self.train_per_class = train_per_class or default_train_per_class(
        self.shots, self.seeds, self.l2_regs)
    self.max_eval_examples = max_eval_examples
    self.strict = strict
    self._hint = hint

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, setup: Any, *,
                  compiler: Any = None) -> "Evaluator":
    """The evaluator of a resolved config's `config.fewshot`; ValueError as `make_task`."""
    fewshot = config.fewshot
    tasks = [make_task(c, global_batch_size=config.eval_batch_size, flags=TRAINING_FLAGS)
             for c in task_data_configs(config)]
    return cls(tasks, features_lib.Featurizer(setup, compiler), shots=fewshot.shots,
               seeds=fewshot.seeds, l2_regs=fewshot.l2_regs,
               train_per_class=fewshot.train_per_class,
               max_eval_examples=fewshot.max_eval_examples, strict=False,
               hint="lower --config.fewshot.shots or use a larger --config.fewshot.train_split")

  def evaluate(self, variables: dict[str, Any],
               stop: Optional[Callable[[], bool]] = None) -> list[TaskResult]:
    """Every task's results for `variables` (placed with the setup's `variables_shardings`);
    `stop` is asked before every batch (see `evaluation.Stoppable`).

    Raises NotEnoughExamplesError (`strict`, naming the class and the fix), ValueError (several
    l2 values and no held-out example) or `evaluation.Stopped` (`stop()` was true).
    """
    results = []
    stop = stop or (lambda: False)
    for task in self.tasks:
      pool = features_lib.collect(
          self.featurizer, variables, evaluation.Stoppable(task.train, stop),
          num_classes=task.num_classes, per_class=self.train_per_class)
      test = features_lib.collect(
          self.featurizer, variables, evaluation.Stoppable(task.test, stop),
          num_classes=task.num_classes, max_examples=self.max_eval_examples)
      try:
        shots = evaluate_features(pool.features, pool.labels, test.features, test.labels,
                                  num_classes=task.num_classes, shots=self.shots,
                                  seeds=self.seeds, l2_regs=self.l2_regs,
                                  skip_short=not self.strict)
      except NotEnoughExamplesError as e:
        raise NotEnoughExamplesError(
            f"{e.shots}-shot on {task.name}: {len(e.short)} of {task.num_classes} classes have "
            f"fewer than {e.shots} examples in the train split "
            f"{task.data_config.train_split!r} ({_listed(e.short, task.class_name)}); "
            f"{self._hint}.", e.shots, e.short) from e
      results.append(TaskResult(task, len(pool.labels), pool.read, len(test.labels), shots))
      logging.info("Few-shot %s (%d training examples kept of %d read, %d eval examples): %s",
                   task.name, len(pool.labels), pool.read, len(test.labels),
                   ", ".join(f"{k}-shot {r.mean:.4f} +- {r.std:.4f}" for k, r in shots.items()))
    return results

  def run(self, variables: dict[str, Any],
          stop: Optional[Callable[[], bool]] = None) -> dict[str, float]:
    """The `scalars` of every task; `stop` and errors as `evaluate`."""
    out = {}
    for result in self.evaluate(variables, stop):
      out.update(scalars(result.task.name, result.shots))
    return out
