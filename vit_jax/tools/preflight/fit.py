"""Compiles a config's train and eval steps (`vit_jax.step.build`) for a TPU slice with libtpu
and reads the per-device memory. The compiler refuses a program whose temporaries exceed the HBM
but does not count its inputs: a step fits when it is accepted and its temporaries and code
(`memory_analysis()`), train state and batch shards together are within the HBM.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Optional

import jax
import ml_collections
import numpy as np

from vit_jax import config as config_lib
from vit_jax import flops
from vit_jax import hardware
from vit_jax import sharding
from vit_jax import step as step_lib
from vit_jax.tools import cost
from vit_jax.tools.preflight import collectives
from vit_jax.tools.preflight import estimate as estimate_lib
from vit_jax.tools.preflight import topology
from vit_jax.tools.preflight.topology import parse_refusal

GIB = hardware.GIB


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with `{'model.dtype': 'bfloat16', ...}` set, as `--config.<key>=` would.
  Raises KeyError for a key the config does not have."""
  config = copy.deepcopy(config)
  for key, value in overrides.items():
    *sections, name = key.split(".")
    node = config
    for section in sections:
      node = node[section]
    if name not in node:
      raise KeyError(f"The config has no key {key!r}.")
    node[name] = value
  return config


def flags_of(overrides: dict[str, Any]) -> str:
  """`--config.key=value ...`, ready to paste."""
  return " ".join(f"--config.{k}={v}" for k, v in overrides.items())


@dataclasses.dataclass(frozen=True)
class Memory:
  """A step's memory on one device, bytes: the train state's shard by part ('params', ...) and
  the batch's; from the compiled program (None when refused) its `temporaries`, `code`, and
  `outputs` that reuse no donated buffer."""
  state: dict[str, int]
  batch: int
  temporaries: Optional[int] = None
  code: Optional[int] = None
  outputs: Optional[int] = None

  @property
  def total(self) -> Optional[int]:
    """What the device holds at the step's peak (None when refused)."""
    if self.temporaries is None:
      return None
    return (sum(self.state.values()) + self.batch + self.temporaries + (self.code or 0) +
            (self.outputs or 0))


@dataclasses.dataclass(frozen=True)
class StepCheck:
  """The 'train' or 'eval' step compiled for the slice: `accepted` (else the compiler's
  `message` and the temporaries it `required`, bytes), `memory`, the device's `hbm`, compile
  `seconds`, XLA's FLOPs per device (partial with `scan=True`), the collectives that cross
  slices (None when refused), the `cost` with loops counted (None: not estimated)."""
  name: str
  accepted: bool
  memory: Memory
  hbm: int
  required: Optional[int] = None
  message: str = ""
  seconds: float = 0.0
  xla_flops: Optional[float] = None
  cross_slice: Optional[collectives.CrossSlice] = None
  cost: Optional[estimate_lib.StepCost] = None

  @property
  def needs(self) -> int:
    """Per-device bytes: the total, or for a refused program at least what it asked for."""
    if self.accepted:
      return self.memory.total
    return (self.required or 0) + sum(self.memory.state.values()) + self.memory.batch

  @property
  def fits(self) -> bool:
    return self.accepted and self.memory.total <= self.hbm

  @property
  def verdict(self) -> str:
    """Why it does not fit, in one line ('' when it fits)."""
    if self.fits:
      return ""
    if not self.accepted:
      return f"the {self.name} step: {self.message}"
    return (f"the {self.name} step: the compiler accepted its temporaries "
            f"({self.memory.temporaries / GIB:.2f} GiB), but with the train state and the batch "
            f"it needs {self.memory.total / GIB:.2f} GiB of the {self.hbm / GIB:.2f} GiB per "
            "device.")


@dataclasses.dataclass(frozen=True)
class Speed:
  """A step's estimated `seconds`, images per second in all, per chip and per TensorCore, and
  `mfu` (analytic FLOPs over the time and the slice's peak; None without a peak)."""
  seconds: float
  images_per_second: float
  per_chip: float
  per_core: float
  mfu: Optional[float]


@dataclasses.dataclass(frozen=True)
class Result:
  """A config checked on a slice (`check`): the resolved `config`, the steps (None when not
  compiled), the parameters (count, bytes of one copy, replicated share), the images per host,
  device and micro-batch, and the analytic FLOPs of a train step and of an eval step."""
  config: ml_collections.ConfigDict
  slice: topology.Slice
  train: Optional[StepCheck]
  eval: Optional[StepCheck]
  parameters: int
  parameter_bytes: int
  replicated_fraction: float
  batch_per_host: int
  batch_per_device: int
  micro_batch_per_device: int
  train_flops: float
  eval_flops: Optional[float] = None

  @property
  def steps(self) -> list[StepCheck]:
    return [s for s in (self.train, self.eval) if s is not None]

  @property
  def fits(self) -> bool:
    return all(s.fits for s in self.steps)

  @property
  def refused(self) -> Optional[StepCheck]:
    """The first step that does not fit, else None."""
    return next((s for s in self.steps if not s.fits), None)

  @property
  def peak(self) -> Optional[int]:
    """The larger step's per-device bytes (None unless both fit)."""
    return max(s.memory.total for s in self.steps) if self.fits else None

  @property
  def peak_flops(self) -> Optional[float]:
    """The slice's peak FLOP/s (all devices) in the compute dtype, from `vit_jax.hardware`."""
    kind = hardware.kind(self.slice.hardware.device_kind)
    peak = kind.peak.get(str(self.config.model.dtype)) if kind else None
    return peak * len(self.slice.devices) if peak else None

  def speed(self, step: StepCheck) -> Optional[Speed]:
    """What `step`'s estimated time implies (None: not estimated, or no estimate)."""
    seconds = step.cost.seconds if step.cost else None
    if not seconds:
      return None
    train = step.name == "train"
    images = self.config.batch_size if train else self.config.eval_batch_size
    analytic = self.train_flops if train else self.eval_flops
    hw, slices, peak = self.slice.hardware, self.slice.num_slices, self.peak_flops
    rate = images / seconds
    return Speed(seconds, rate, rate / (hw.chips * slices), rate / (hw.cores * slices),
                 analytic / (seconds * peak) if peak and analytic else None)


def _shard_bytes(tree: Any) -> int:
  """Bytes of one device's shard of the `jax.ShapeDtypeStruct`s in `tree`."""
  return sum(math.prod(leaf.sharding.shard_shape(tuple(leaf.shape))) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree.leaves(tree))


def compile_step(setup: step_lib.Setup, name: str, hbm: int, *,
                 estimate: bool = False) -> StepCheck:
  """Compiles the 'train' or 'eval' step of `setup` with abstract inputs against `hbm` bytes;
  `estimate`: if it fits, its `cost` too (compiling a variant per loop level).
  Raises jax.errors.JaxRuntimeError: the compiler failed for a reason other than memory."""
  config = setup.config
  if name == "train":
    jitted = setup.jit_train_step()
    batch = setup.abstract_batch(config.batch_size)
  else:
    jitted = setup.jit_eval_step()
    batch = setup.abstract_batch(config.eval_batch_size, eval_batch=True)
  state = {key: _shard_bytes(value) for key, value in setup.abstract_state.items()}
  known = Memory(state=state, batch=_shard_bytes(batch))
  start = time.perf_counter()
  try:
    compiled = setup.compile(jitted, setup.abstract_state, batch)
  except Exception as e:  # pylint: disable=broad-except
    if not topology.is_out_of_memory(e):
      raise
    required, _ = parse_refusal(str(e))
    message = str(e).strip().splitlines()[0]
    return StepCheck(name, False, known, hbm, required, message, time.perf_counter() - start)
  seconds = time.perf_counter() - start
  stats = compiled.memory_analysis()
  memory = dataclasses.replace(
      known, temporaries=int(stats.temp_size_in_bytes),
      code=int(stats.generated_code_size_in_bytes),
      outputs=max(0, int(stats.output_size_in_bytes - stats.alias_size_in_bytes)))
  slices = sharding.slice_indices(setup.mesh.devices.flat)  # The program's device order.
  result = StepCheck(name, True, memory, hbm, seconds=seconds,
                     xla_flops=flops.compiled_flops(compiled),
                     cross_slice=collectives.cross_slice(compiled.as_text(), slices))
  if estimate and result.fits:
    args = (setup.abstract_state, batch)
    traced = setup.in_mesh(jax.make_jaxpr(jitted))(*args)
    result = dataclasses.replace(result, cost=estimate_lib.step_cost(
        compiled, traced,
        lambda variant: setup.compile(estimate_lib.rejit(variant), *jax.tree.leaves(args))))
  return result


def resolve(config: ml_collections.ConfigDict, tpu: topology.Slice, *,
            num_train_examples: Optional[int] = None,
            num_classes: Optional[int] = None) -> ml_collections.ConfigDict:
  """`vit_jax.config.resolve` for the slice's devices, the dataset sized without data and the
  fine-tuning source dropped (same memory; it need not exist here). Raises ValueError."""
  config = with_overrides(config, {"init_from": "", "pretrained_dir": ""})
  examples, classes, _ = cost.dataset_facts(config, num_train_examples, num_classes)
  return config_lib.resolve(config, num_train_examples=examples, num_classes=classes,
                            devices=tpu.devices)


def check(config: ml_collections.ConfigDict, tpu: topology.Slice, *, train_step: bool = True,
          eval_step: bool = True, num_train_examples: Optional[int] = None,
          num_classes: Optional[int] = None, estimate: bool = False) -> Result:
  """The `Result` of compiling the steps of `config` (unresolved) for the slice `tpu`;
  `num_train_examples`, `num_classes`: the dataset's size when it is not a known one;
  `estimate`: as `compile_step`. Raises ValueError (the config cannot run on the slice, an
  unknown dataset size) or jax.errors.JaxRuntimeError (a compiler failure other than memory)."""
  resolved = resolve(config, tpu, num_train_examples=num_train_examples, num_classes=num_classes)
  size = resolved.data.image_size
  setup = step_lib.build(resolved, image_shape=(size, size, 3), devices=tpu.devices)
  params, shardings = setup.abstract_state["params"], setup.state_shardings["params"]
  sharding.check_replication(params, shardings, setup.mesh,
                             resolved.mesh.max_replicated_fraction)  # Raises as the trainer.
  replicated, total = sharding.replicated_bytes(params, shardings)
  train = (compile_step(setup, "train", tpu.hbm_bytes, estimate=estimate) if train_step
           else None)
  evaluation = (compile_step(setup, "eval", tpu.hbm_bytes, estimate=estimate) if eval_step
                else None)
  shards = step_lib.batch_shards(setup.config.mesh, setup.mesh.size)
  macs = flops.model_forward_macs(setup.model, setup.image_shape)
  return Result(
      config=resolved, slice=tpu, train=train, eval=evaluation,
      parameters=sum(x.size for x in jax.tree.leaves(params)), parameter_bytes=total,
      replicated_fraction=replicated / max(total, 1),
      batch_per_host=resolved.batch_size // tpu.num_hosts,
      batch_per_device=resolved.batch_size // shards,
      micro_batch_per_device=resolved.batch_size // shards // resolved.grad_accum_steps,
      train_flops=flops.training_flops(macs, resolved.batch_size),
      eval_flops=2.0 * macs * resolved.eval_batch_size)
