"""When a config does not fit a slice: the smallest changes that make it fit, compiled to be sure.

`suggest` tries candidates in this order, each one compiled (a refused compile is quick: the
compiler stops at buffer assignment), and returns the first that fits:
  1. bfloat16 compute (`model.dtype`), parameters and optimizer state staying float32;
  2. more gradient accumulation (x2, x4, ... down to one image per device and micro-batch): the
     same recipe, the same global batch, fewer activations at a time;
  3. FSDP over all devices (`mesh.fsdp=-1, mesh.data=1`): parameters, gradients and optimizer
     state split instead of replicated, then accumulation again;
  4. the leanest remat policy ('nothing_saveable': only each block's input kept), then
     accumulation again;
  5. a smaller global batch (halved), which changes the recipe (the learning rate's scaling).
Each stage keeps the previous stages' changes, so the answer is the fewest levers that fit.
Then the eval step, which has no accumulation, is compiled with those changes and its global
batch (`eval_batch_size`) halved until it fits.

`largest_batch` finds the largest per-device batch (a power of two) that fits a config on a
slice: the figures of docs/pods.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Optional

import ml_collections

from vit_jax import sharding
from vit_jax.tools.preflight import fit
from vit_jax.tools.preflight import topology

Overrides = dict[str, Any]
Runner = Callable[..., fit.Result]  # `check` of a config on one slice.


@dataclasses.dataclass(frozen=True)
class Attempt:
  """A candidate and its result (None: the config refused it, e.g. a batch the mesh cannot
  split; `error` says why)."""
  overrides: Overrides
  result: Optional[fit.Result]
  error: str = ""


def _accumulations(batch_size: int, accum: int, shards: int) -> Iterator[int]:
  """accum x 2, x 4, ... while the micro-batches still split over the batch shards."""
  steps = accum * 2
  while batch_size % (steps * shards) == 0:
    yield steps
    steps *= 2


def candidates(resolved: ml_collections.ConfigDict, num_devices: int,
               batch_shards: int) -> Iterator[Overrides]:
  """The candidate overrides of `suggest`, in order, for a config resolved for the slice.

  Args:
    resolved: the config as it runs on the slice (`fit.resolve`).
    num_devices: the slice's devices; batch_shards: how many ways its mesh splits the batch.
  """
  base: Overrides = {}
  accum, batch = resolved.grad_accum_steps, resolved.batch_size

  def with_accumulation(fixed: Overrides, shards: int) -> Iterator[Overrides]:
    if fixed:
      yield dict(fixed)
    for steps in _accumulations(batch, accum, shards):
      yield {**fixed, "grad_accum_steps": steps}

  if str(resolved.model.dtype) != "bfloat16":
    base["model.dtype"] = "bfloat16"
  yield from with_accumulation(base, batch_shards)
  mesh = resolved.mesh
  if mesh.tensor == 1 and mesh.dcn_data == 1 and mesh.fsdp != num_devices:
    base.update({"mesh.data": 1, "mesh.fsdp": -1})
    yield from with_accumulation(base, num_devices)
    batch_shards = num_devices
  model = resolved.model
  if "remat" in model and (not model.remat or model.remat_policy != "nothing_saveable"):
    base.update({"model.remat": True, "model.remat_policy": "nothing_saveable"})
    yield from with_accumulation(base, batch_shards)
  smaller = batch // 2
  while smaller >= batch_shards and smaller % batch_shards == 0:
    yield {**base, "batch_size": smaller}
    smaller //= 2


def _attempt(config: ml_collections.ConfigDict, overrides: Overrides, run: Runner,
             report: Callable[[Attempt], None], **steps: bool) -> Attempt:
  try:
    attempt = Attempt(overrides, run(fit.with_overrides(config, overrides), **steps))
  except ValueError as e:  # A candidate the config refuses (e.g. FSDP of an odd width).
    attempt = Attempt(overrides, None, str(e))
  report(attempt)
  return attempt


def _fits(attempt: Attempt) -> bool:
  return attempt.result is not None and attempt.result.fits


def suggest(config: ml_collections.ConfigDict, first: fit.Result, run: Runner,
            report: Callable[[Attempt], None] = lambda attempt: None) -> Optional[Attempt]:
  """The first candidate (see the module docstring) with which `config` fits.

  The train step's levers are tried with the train step alone; then the eval step (which has
  no accumulation) is compiled with them, its batch (`eval_batch_size`) halved until it fits.

  Args:
    config: the unresolved config that did not fit; first: its `check` result.
    run: `check` on the same slice (e.g. `functools.partial(check, tpu=...)`), taking
      `train_step=` and `eval_step=`.
    report: called with each attempt as it finishes (progress).

  Returns:
    The fitting `Attempt` (both steps compiled, the result of the last compiles), or None when
    nothing fits down to one image per device.
  """
  num_devices = len(first.slice.devices)
  shards = batch_shards(first.config.mesh, num_devices)
  overrides: Overrides = {}
  train = first.train
  if train is not None and not train.fits:
    found = None
    for candidate in candidates(first.config, num_devices, shards):
      attempt = _attempt(config, candidate, run, report, train_step=True, eval_step=False)
      if _fits(attempt):
        found = attempt
        break
    if found is None:
      return None
    overrides, train = found.overrides, found.result.train
    shards = batch_shards(found.result.config.mesh, num_devices)
  eval_batch = None
  while True:
    extra = {} if eval_batch is None else {"eval_batch_size": eval_batch}
    attempt = _attempt(config, {**overrides, **extra}, run, report, train_step=False,
                       eval_step=True)
    if _fits(attempt):
      return Attempt(attempt.overrides, dataclasses.replace(attempt.result, train=train))
    if attempt.result is None:
      return None
    eval_batch = (eval_batch or attempt.result.config.eval_batch_size) // 2
    if eval_batch < shards or eval_batch % shards:
      return None


#: Where `largest_batch` starts: per-device batches above it are not tried.
LARGEST_BATCH_LIMIT = 1024


def largest_batch(config: ml_collections.ConfigDict, tpu: topology.Slice,
                  run: Runner,
                  limit: int = LARGEST_BATCH_LIMIT,
                  report: Callable[[int, fit.Result], None] = lambda b, r: None,
                  ) -> tuple[int, Optional[fit.Result]]:
  """The largest per-device batch, a power of two up to `limit`, with which `config` fits.

  Halves from `limit` until the compiler accepts, so the answer compiled and twice the answer
  was refused (or is above `limit`); refusals are quick, so this compiles one fitting program.
  The global batch is the per-device batch times the mesh's batch shards, accumulation 1.

  Returns:
    (per-device batch, its result), or (0, None) when one image per device does not fit.
  """
  probe = fit.with_overrides(config, {"grad_accum_steps": 1})
  shards = batch_shards(probe.mesh, len(tpu.devices))
  per_device = limit
  while per_device >= 1:
    result = run(fit.with_overrides(probe, {"batch_size": per_device * shards}))
    report(per_device, result)
    if result.fits:
      return per_device, result
    per_device //= 2
  return 0, None


def batch_shards(mesh: ml_collections.ConfigDict, num_devices: int) -> int:
  """How many ways `config.mesh` splits the batch on `num_devices` devices.

  Raises:
    ValueError: a mesh that does not fit the devices (`vit_jax.sharding.axis_sizes`).
  """
  sizes = sharding.axis_sizes(mesh, num_devices)
  return math.prod(sizes[a] for a in sharding.batch_axes(sharding.parse_rules(mesh.rules)))
