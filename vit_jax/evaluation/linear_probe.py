"""The few-shot protocol on features already computed: a closed-form regularised least-squares
probe and the k-shot draws (ViT paper, Sec. 4.1 and App. B; `vit_jax.evaluation.fewshot` states
the protocol and where it follows big_vision's `fewshot_lsr`).

  probe = LinearProbe.fit(features, labels, num_classes)      # [N, F], int [N]
  probe.accuracy(test_features, test_labels, l2=1024.0)        # fraction correct
  results = evaluate_features(pool_x, pool_y, test_x, test_y, num_classes=10,
                              shots=(1, 5, 10, 25), seeds=3, l2_regs=(1024.0,))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from absl import logging
import numpy as np

#: The constant feature appended to the standardised features; large, so that its weight (the
#: bias) is almost unregularised (big_vision's BIAS_CONSTANT).
BIAS_FEATURE = 100.0
#: Added to the per-dimension standard deviation before dividing (big_vision's value).
STD_EPSILON = 1e-5
DEFAULT_SHOTS = (1, 5, 10, 25)
#: big_vision's default `l2_reg` (2^10).
DEFAULT_L2_REGS = (1024.0,)
DEFAULT_SEEDS = 3
#: Held-out examples per class that choose the l2 when several are given.
HELD_OUT_PER_CLASS = 10


class NotEnoughExamplesError(ValueError):
  """Some class has fewer examples in the training pool than a requested number of shots.

  Attributes:
    shots: the shot count that cannot be drawn.
    short: `{class index: examples in the pool}` of the classes with fewer than `shots`.
  """

  def __init__(self, message: str, shots: int, short: dict[int, int]):
    super().__init__(message)
    self.shots, self.short = shots, short


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
    raise ValueError(f"{what} must be {n} integer labels (shape ({n},)), got {y.dtype} "
                     f"{y.shape}.")
  if n and (y.min() < 0 or y.max() >= num_classes):
    raise ValueError(f"{what} must lie in [0, {num_classes}), got [{y.min()}, {y.max()}].")
  return y.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LinearProbe:
  """The closed-form ridge regression of standardised features (+ the bias feature) to {-1, 1}
  one-hot targets, for any l2: W(l2) = lhs diag(1 / (eigs + l2)) rhs.

  Attributes:
    mean, std: float64 [F], the training features' mean and standard deviation (+ STD_EPSILON).
    eigs: float64 [R], eigenvalues of X^T X (R = F + 1, 'primal') or of X X^T (R = N, 'dual'),
      X the [N, F + 1] standardised training features with the bias feature.
    lhs: float64 [F + 1, R]; rhs: float64 [R, C].
    branch: 'primal' or 'dual'.
  """

  mean: np.ndarray
  std: np.ndarray
  eigs: np.ndarray
  lhs: np.ndarray
  rhs: np.ndarray
  branch: str

  @classmethod
  def fit(cls, features: Any, labels: Any, num_classes: int, *,
          branch: str = "auto") -> "LinearProbe":
    """Standardises `features` and eigendecomposes the smaller Gram matrix.

    Args:
      features: [N, F] (numpy or jax, any float dtype); labels: int [N] in [0, num_classes).
      branch: 'auto' ('primal' when N >= F + 1, else 'dual', as big_vision), or either one.

    Raises:
      ValueError: bad shapes, labels out of range, non-finite features, an unknown branch.
    """
    x = _features(features, "The training features")
    y = _labels(labels, x.shape[0], num_classes, "The training labels")
    mean, std = x.mean(axis=0), x.std(axis=0) + STD_EPSILON
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


def linear_accuracy(train_features: Any, train_labels: Any, test_features: Any,
                    test_labels: Any, l2_regs: Sequence[float],
                    num_classes: Optional[int] = None) -> np.ndarray:
  """The eval accuracy of the probe fitted on the training features, for each l2.

  Args:
    train_features: [N, F]; train_labels: int [N]; test_features: [M, F]; test_labels: int [M].
    l2_regs: the l2 values (> 0).
    num_classes: C (default: 1 + the largest label of either set).

  Returns:
    float64 [len(l2_regs)]: fractions in [0, 1].

  Raises:
    ValueError: as `LinearProbe.fit`.
  """
  if num_classes is None:
    num_classes = int(max(np.max(train_labels), np.max(test_labels))) + 1
  probe = LinearProbe.fit(train_features, train_labels, num_classes)
  return np.array([probe.accuracy(test_features, test_labels, l2) for l2 in l2_regs])


def class_permutations(labels: Any, num_classes: int, seed: int) -> list[np.ndarray]:
  """Per class c, the indices of `labels == c` in a random order: `numpy.random.default_rng(seed)`
  permutes the classes' index lists in class order (big_vision's draws). The k-shot set of the
  seed is the first k of each."""
  rng = np.random.default_rng(seed)
  labels = np.asarray(labels)
  return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def shot_indices(labels: Any, shots: int, seed: int, num_classes: int) -> np.ndarray:
  """int [shots * num_classes]: indices into `labels` of the k-shot set of `seed`, by class.

  Raises:
    NotEnoughExamplesError: a class has fewer than `shots` examples in `labels`.
  """
  perms = class_permutations(labels, num_classes, seed)
  _check_enough(perms, shots)
  return np.concatenate([p[:shots] for p in perms])


def _check_enough(perms: Sequence[np.ndarray], shots: int) -> None:
  short = {c: len(p) for c, p in enumerate(perms) if len(p) < shots}
  if short:
    listed = ", ".join(f"class {c}: {n}" for c, n in list(short.items())[:5])
    more = f" and {len(short) - 5} more" if len(short) > 5 else ""
    raise NotEnoughExamplesError(
        f"{len(short)} of {len(perms)} classes have fewer than {shots} examples for "
        f"{shots}-shot ({listed}{more}).", shots, short)


@dataclasses.dataclass(frozen=True)
class ShotResult:
  """The k-shot accuracy of each seed and the l2 each used.

  Attributes:
    shots: k. accuracies: per seed, fractions in [0, 1]. l2_regs: per seed, the l2 used.
  """

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


def _choose_l2(probe: LinearProbe, x: np.ndarray, y: np.ndarray,
               l2_regs: Sequence[float]) -> float:
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
                      seeds: int = DEFAULT_SEEDS,
                      l2_regs: Sequence[float] = DEFAULT_L2_REGS,
                      skip_short: bool = False) -> dict[int, ShotResult]:
  """The protocol on features: for each k and seed, the k-shot probe's eval accuracy.

  Args:
    train_features: [N, F], the training pool; train_labels: int [N].
    test_features: [M, F]; test_labels: int [M].
    num_classes: C. shots: the k values. seeds: seeds 0 .. seeds-1.
    l2_regs: one l2 (used as it is) or several (each (seed, k) takes the best on up to
      `HELD_OUT_PER_CLASS` pool examples per class outside the seed's shots).
    skip_short: leave out a k some class has too few examples for (logged) instead of raising.

  Returns:
    `{k: ShotResult}` in the order of `shots`.

  Raises:
    NotEnoughExamplesError: (not `skip_short`) a class has fewer than k pool examples.
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
  """Pool examples kept per class: max(shots) x seeds, plus `HELD_OUT_PER_CLASS` when several
  l2 values are to be chosen among."""
  return max(shots) * seeds + (HELD_OUT_PER_CLASS if len(l2_regs) > 1 else 0)


def scalars(name: str, results: dict[int, ShotResult]) -> dict[str, float]:
  """`{'fewshot/<name>_<k>shot': mean accuracy, 'fewshot/<name>_<k>shot_std': its std}`."""
  out = {}
  for k, r in results.items():
    out[f"fewshot/{name}_{k}shot"] = r.mean
    out[f"fewshot/{name}_{k}shot_std"] = r.std
  return out
