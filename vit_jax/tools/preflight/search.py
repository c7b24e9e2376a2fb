"""When a config does not fit a slice: the fewest changes that make it fit, each compiled (a
refused compile is quick). `suggest` tries, each stage keeping the previous ones' changes:
  1. bfloat16 compute (parameters and optimizer state stay float32);
  2. more gradient accumulation (x2, x4, ...): the same recipe, fewer activations at a time;
  3. FSDP over all devices (`mesh.fsdp=-1, mesh.data=1`; of each slice with `mesh.dcn_data`,
     which no candidate changes), then accumulation again;
  4. remat 'nothing_saveable', then accumulation again;
  5. a halved global batch, which changes the recipe.
Then the eval step is compiled with them, its batch halved until it fits. `largest_batch`: the
largest per-device batch that fits (docs/pods.md). `faster`: when a step fits with remat, the
same step without it, if it fits too and its estimated time is shorter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional

import ml_collections

from vit_jax import sharding
from vit_jax import step
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


def candidates(resolved: ml_collections.ConfigDict, num_devices: int,
               batch_shards: int) -> Iterator[Overrides]:
  """The candidate overrides of `suggest`, in order, for a config `resolved` for the slice
  (`fit.resolve`) of `num_devices`, whose mesh splits the batch `batch_shards` ways."""
  base: Overrides = {}
  accum, batch = resolved.grad_accum_steps, resolved.batch_size

  def with_accumulation(fixed: Overrides, shards: int) -> Iterator[Overrides]:
    """`fixed`, then with accumulation x 2, x 4, ... while micro-batches split over `shards`."""
    if fixed:
      yield dict(fixed)
    steps = accum * 2
    while batch % (steps * shards) == 0:
      yield {**fixed, "grad_accum_steps": steps}
      steps *= 2

  if str(resolved.model.dtype) != "bfloat16":
    base["model.dtype"] = "bfloat16"
  yield from with_accumulation(base, batch_shards)
  mesh = resolved.mesh
  per_slice = num_devices // mesh.dcn_data  # mesh.dcn_data stays as given.
  if mesh.tensor == 1 and sharding.axis_sizes(mesh, num_devices)["fsdp"] != per_slice:
    base.update({"mesh.data": 1, "mesh.fsdp": -1})  # The batch still splits num_devices ways.
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
  """The first fitting candidate (module docstring) for the unresolved `config` whose `check`
  gave `first`; `run` is `check` on the same slice (taking `train_step=`, `eval_step=`),
  `report` sees each attempt. None when nothing fits down to one image per device."""
  num_devices = len(first.slice.devices)
  shards = step.batch_shards(first.config.mesh, num_devices)
  overrides: Overrides = {}
  train = first.train
  if train is not None and not train.fits:
    attempts = (_attempt(config, candidate, run, report, train_step=True, eval_step=False)
                for candidate in candidates(first.config, num_devices, shards))
    found = next((attempt for attempt in attempts if _fits(attempt)), None)
    if found is None:
      return None
    overrides, train = found.overrides, found.result.train
    shards = step.batch_shards(found.result.config.mesh, num_devices)
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


def faster(config: ml_collections.ConfigDict, first: fit.Result, run: Runner,
           report: Callable[[Attempt], None] = lambda attempt: None) -> Optional[Attempt]:
  """For `config` whose train step fits with remat and was estimated in `first`: the train step
  without remat (scanned as configured, then unrolled), the first that fits and is estimated
  faster, else None. `run` is `check` with `estimate=True` on the same slice."""
  model, train = first.config.model, first.train
  speed = first.speed(train) if train is not None and train.fits else None
  if not model.get("remat") or speed is None:
    return None
  tries = [{"model.remat": False}]
  if model.get("scan"):
    tries.append({"model.remat": False, "model.scan": False})
  for overrides in tries:
    attempt = _attempt(config, overrides, run, report, train_step=True, eval_step=False)
    if not _fits(attempt):
      continue
    other = attempt.result.speed(attempt.result.train)
    if other is not None and other.seconds < speed.seconds:
      return attempt
  return None


#: Where `largest_batch` starts: per-device batches above it are not tried.
LARGEST_BATCH_LIMIT = 1024


def largest_batch(config: ml_collections.ConfigDict, tpu: topology.Slice,
                  run: Runner,
                  limit: int = LARGEST_BATCH_LIMIT,
                  report: Callable[[int, fit.Result], None] = lambda b, r: None,
                  ) -> tuple[int, Optional[fit.Result]]:
  """(The largest per-device batch, a power of two up to `limit`, that fits, its result),
  halving from `limit` without accumulation; (0, None) when one image does not fit."""
  probe = fit.with_overrides(config, {"grad_accum_steps": 1})
  shards = step.batch_shards(probe.mesh, len(tpu.devices))
  for per_device in (limit >> i for i in range(limit.bit_length())):
    result = run(fit.with_overrides(probe, {"batch_size": per_device * shards}))
    report(per_device, result)
    if result.fits:
      return per_device, result
  return 0, None
