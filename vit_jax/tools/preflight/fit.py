"""Compiles a config's train and eval steps for a TPU slice and reads the per-device memory.

The steps are the trainer's own (`vit_jax.step.build`: the config's model, mesh, logical-axis
rules, compute dtype, remat and accumulation), lowered with abstract inputs (`jax.ShapeDtypeStruct`
with their shardings) and compiled by libtpu's TPU compiler for the slice's compile-only devices.
The compiler lays out every buffer of the program and refuses one whose temporaries do not fit
the HBM ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
temporaries (20.42G) exceeds available HBM (15.48G)"). It does not count the inputs, which are
in HBM too when the step runs: a compiled step's `memory_analysis()` gives its temporaries
(activations, gradients, optimizer update, collectives' buffers) and code, the shardings give
the train state's and the batch's shards, and the step fits when the compiler accepted it and
their sum is within the HBM.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import time
from typing import Any, Optional

import jax
import ml_collections
import numpy as np

from vit_jax import config as config_lib
from vit_jax import flops
from vit_jax import sharding
from vit_jax import step as step_lib
from vit_jax.tools import cost
from vit_jax.tools.preflight import topology

GIB = 2**30
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with `{'model.dtype': 'bfloat16', ...}` set, as `--config.<key>=` would.

  Raises:
    KeyError: a key the config does not have.
  """
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
  """A step's memory on one device, bytes.

  `state` is the train state's shard by part ('params', 'opt_state', 'ema_params',
  'model_state', 'step'); `batch` the input batch's shard (both known before compiling). From the
  compiled program: `temporaries`, everything it allocates while it runs; `code`, its
  executable; `outputs`, outputs that do not reuse a donated input's buffer; None when the
  compiler refused the program.
  """
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
  """One step compiled for the slice.

  The compiler checks only the program's temporaries against the HBM; the train state and the
  batch are in HBM too when the step runs, so a step fits when the compiler accepts it and its
  total (state, batch, temporaries, code) is within the device's HBM.

  Attributes:
    name: 'train' or 'eval'.
    accepted: the TPU compiler compiled the program.
    memory: its per-device memory (only the state and batch when refused).
    hbm: the device's HBM for a program, bytes (`topology.Slice.hbm_bytes`).
    required: the temporaries a refused program asked for, bytes (the compiler's message).
    message: the compiler's refusal, else ''.
    seconds: compile time (tracing and lowering included).
    xla_flops: XLA's FLOP count of the per-device program (a scanned loop's body counted once:
      partial with `scan=True`), or None.
  """
  name: str
  accepted: bool
  memory: Memory
  hbm: int
  required: Optional[int] = None
  message: str = ""
  seconds: float = 0.0
  xla_flops: Optional[float] = None

  @property
  def needs(self) -> int:
    """Per-device bytes the step needs: the compiled total, or for a refused program the
    temporaries it asked for plus the state and batch (at least)."""
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
class Result:
  """A config checked on a slice (`check`).

  Attributes:
    config: the resolved config, as the trainer would run it there.
    slice: the TPU slice (`topology.Slice`).
    train, eval: the steps (None when not compiled).
    parameters: parameter count; parameter_bytes: their bytes (one copy).
    replicated_fraction: the share of parameter bytes every device holds whole.
    batch_per_host, batch_per_device: images of a step per host and per device;
    micro_batch_per_device: per device and accumulation micro-batch.
    train_flops: analytic FLOPs of one training step, whole slice (3 forward passes of the
      matrix products, `vit_jax.flops`).
  """
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

  @property
  def steps(self) -> list[StepCheck]:
    """The compiled steps, train first."""
    return [s for s in (self.train, self.eval) if s is not None]

  @property
  def fits(self) -> bool:
    """Every compiled step fits."""
    return all(s.fits for s in self.steps)

  @property
  def refused(self) -> Optional[StepCheck]:
    """The first step the compiler refused, else None."""
    return next((s for s in self.steps if not s.fits), None)

  @property
  def peak(self) -> Optional[int]:
    """The larger step's per-device bytes (None when one was refused)."""
    return max(s.memory.total for s in self.steps) if self.fits else None


def _shard_bytes(tree: Any) -> int:
  """Bytes of one device's shard of the `jax.ShapeDtypeStruct`s in `tree`."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(tuple(leaf.shape))
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * _UNITS[unit.upper()])


def parse_refusal(message: str) -> tuple[Optional[int], Optional[int]]:
  """(required, available) bytes from the TPU compiler's out-of-memory message, else None.

  Two forms: "the total memory required for HLO temporaries (20.42G) exceeds available HBM
  (15.48G)" and "Used 17.43G of 15.48G hbm" (XLA's G is GiB).
  """
  number = r"([\d.]+)\s*([KMGT]?)i?B?"
  required = (re.search(rf"required for [\w ]+\({number}\)", message) or
              re.search(rf"Used {number} of", message))
  available = (re.search(rf"available HBM \({number}\)", message) or
               re.search(rf"Used [\d.]+\s*[KMGT]?i?B? of {number} hbm", message))
  return (_bytes(*required.groups()) if required else None,
          _bytes(*available.groups()) if available else None)


def _is_refusal(error: Exception) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


def compile_step(setup: step_lib.Setup, name: str, hbm: int) -> StepCheck:
  """Compiles the 'train' or 'eval' step of `setup` for its mesh with abstract inputs; `hbm`:
  the device's HBM for a program, bytes.

  Raises:
    jax.errors.JaxRuntimeError: the compiler failed for a reason other than memory.
  """
  config = setup.config
  if name == "train":
    jitted, batch = setup.jit_train_step(), setup.abstract_batch(config.batch_size)
  else:
    jitted = setup.jit_eval_step()
    batch = setup.abstract_batch(config.eval_batch_size, eval_batch=True)
  state = {key: _shard_bytes(value) for key, value in setup.abstract_state.items()}
  known = Memory(state=state, batch=_shard_bytes(batch))
  start = time.perf_counter()
  try:
    compiled = setup.compile(jitted, setup.abstract_state, batch)
  except Exception as e:  # pylint: disable=broad-except
    if not _is_refusal(e):
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
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # Older jax: one dict per program.
    analysis = analysis[0] if analysis else {}
  xla_flops = (analysis or {}).get("flops")
  return StepCheck(name, True, memory, hbm, seconds=seconds,
                   xla_flops=float(xla_flops) if xla_flops is not None else None)


def resolve(config: ml_collections.ConfigDict, tpu: topology.Slice, *,
            num_train_examples: Optional[int] = None,
            num_classes: Optional[int] = None) -> ml_collections.ConfigDict:
  """`vit_jax.config.resolve` for the slice's devices, the dataset sized without data.

  The fine-tuning source (`init_from`, `pretrained_dir`) is dropped: its weights take the same
  memory as fresh ones and need not exist on this host.

  Raises:
    ValueError: what `resolve` refuses, or a dataset that cannot be sized (give the counts).
  """
  config = with_overrides(config, {"init_from": "", "pretrained_dir": ""})
  examples, classes, _ = cost.dataset_facts(config, num_train_examples, num_classes)
  return config_lib.resolve(config, num_train_examples=examples, num_classes=classes,
                            devices=tpu.devices)


def check(config: ml_collections.ConfigDict, tpu: topology.Slice, *, train_step: bool = True,
          eval_step: bool = True, num_train_examples: Optional[int] = None,
          num_classes: Optional[int] = None) -> Result:
  """Compiles the trainer's steps of `config` (unresolved) for the slice `tpu`.

  Args:
    config: a config of `configs/*.py`, overrides applied.
    tpu: `topology.tpu_slice(...)`.
    train_step: compile the train step.
    eval_step: also compile the eval step (at `config.eval_batch_size`, as the trainer evaluates).
    num_train_examples, num_classes: the dataset's size when it is not a known one.

  Returns:
    A `Result`; `result.fits` says whether the compiled steps fit.

  Raises:
    ValueError: the config cannot run on the slice (a bad value, a batch the mesh cannot split,
      an image size the patch size does not divide, FSDP that leaves most parameters
      replicated, an unknown dataset size).
    jax.errors.JaxRuntimeError: the compiler failed for a reason other than memory.
  """
  resolved = resolve(config, tpu, num_train_examples=num_train_examples, num_classes=num_classes)
  size = resolved.data.image_size
  setup = step_lib.build(resolved, image_shape=(size, size, 3), devices=tpu.devices)
  params, shardings = setup.abstract_state["params"], setup.state_shardings["params"]
  sharding.check_replication(params, shardings, setup.mesh,
                             resolved.mesh.max_replicated_fraction)  # Raises as the trainer.
  replicated, total = sharding.replicated_bytes(params, shardings)
  train = compile_step(setup, "train", tpu.hbm_bytes) if train_step else None
  evaluation = compile_step(setup, "eval", tpu.hbm_bytes) if eval_step else None
  shards = sharding.data_parallel_size(setup.mesh, setup.rules)
  macs = flops.model_forward_macs(setup.model, setup.image_shape)
  return Result(
      config=resolved, slice=tpu, train=train, eval=evaluation,
      parameters=sum(x.size for x in jax.tree.leaves(params)), parameter_bytes=total,
      replicated_fraction=replicated / max(total, 1),
      batch_per_host=resolved.batch_size // tpu.num_hosts,
      batch_per_device=resolved.batch_size // shards,
      micro_batch_per_device=resolved.batch_size // shards // resolved.grad_accum_steps,
      train_flops=flops.training_flops(macs, resolved.batch_size))
