"""Pre-logit features of a dataset, sharded like the eval step, gathered onto every process:

  kept = collect(Featurizer(setup), variables, eval_ds, num_classes=10, per_class=75)
  kept.features   # float32 [N, F], rows in reading order; kept.labels: int64 [N]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

from jax.experimental import multihost_utils
import numpy as np

from vit_jax import step as step_lib


class Featurizer:
  """`Setup.jit_features_step` on this process's batches (compiled by `compiler`, default a new
  one), gathered onto every process as numpy."""

  def __init__(self, setup: step_lib.Setup, compiler: Optional[step_lib.Compiler] = None):
    self._setup = setup
    self._jitted = setup.jit_features_step()
    self._compiler = compiler or step_lib.Compiler(setup)

  def gather(self, local: np.ndarray) -> np.ndarray:
    """This process's `[b, ...]` rows -> the global `[B, ...]` rows, as `features`' rows."""
    return np.asarray(multihost_utils.process_allgather(self._setup.to_global(local), tiled=True))

  def features(self, variables: dict[str, Any], images: np.ndarray) -> np.ndarray:
    """float32 [B, F] of the global batch whose local part is `images` [b, H, W, 3]
    (`variables` placed with `setup.variables_shardings`)."""
    out = self._compiler(self._jitted, variables, self._setup.to_global(images))
    return np.asarray(multihost_utils.process_allgather(out, tiled=True), np.float32)


@dataclasses.dataclass(frozen=True)
class Collected:
  """What `collect` kept: float32 [N, F] `features`, int64 [N] `labels`, and `read`, the real
  examples read (all processes)."""
  features: np.ndarray
  labels: np.ndarray
  read: int


def collect(featurizer: Featurizer, variables: dict[str, Any], batches: Iterable[dict],
            *, num_classes: int, per_class: Optional[int] = None,
            max_examples: Optional[int] = None) -> Collected:
  """The features and labels of the real examples of `EvalDataset` batches in reading order:
  only the first `per_class` of each class / `max_examples` (reading stops once all are in).
  Decided from the gathered labels, so every process runs the same steps."""
  counts = np.zeros(num_classes, np.int64)
  features = []
  labels = []
  read = 0
  kept = 0
  for batch in batches:
    label = featurizer.gather(np.argmax(batch["labels"], axis=-1).astype(np.int32))
    keep = featurizer.gather(np.asarray(batch["mask"], bool)).copy()
    read += int(keep.sum())
    if per_class is not None:
      for i in np.flatnonzero(keep):
        keep[i] = counts[label[i]] < per_class
        counts[label[i]] += keep[i]
    if max_examples is not None:
      keep &= np.cumsum(keep) <= max_examples - kept
    if keep.any():
      features.append(featurizer.features(variables, batch["image"])[keep])
      labels.append(label[keep].astype(np.int64))
      kept += int(keep.sum())
    if ((per_class is not None and (counts >= per_class).all())
        or (max_examples is not None and kept >= max_examples)):
      break
  if not labels:
    return Collected(np.zeros((0, 0), np.float32), np.zeros(0, np.int64), read)
  return Collected(np.concatenate(features), np.concatenate(labels), read)
