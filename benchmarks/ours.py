"""Our side of the benchmark: the trainer's own step (`Setup.jit_train_step()`: its function,
shardings and donation; tests/tools/test_benchmark_step.py compares the HLOs) or the bare
forward in eval mode (as timm's inference), built from a resolved config, compiled and timed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from benchmarks.common import BenchmarkError
from benchmarks.common import check_sizes
from benchmarks.common import fill_rates
from benchmarks.common import peak_rss_mib
from benchmarks.common import rss_now_mib
from benchmarks.common import thread_facts
from benchmarks.common import timed
from vit_jax import accounting
from vit_jax import config as config_lib
from vit_jax import flops
from vit_jax import kernels
from vit_jax import step

DATASET = "imagenet2012"  # The config's data.name: nothing is read.
NUM_TRAIN_EXAMPLES = 1_281_167  # ImageNet's training split, for config.resolve.
TOTAL_STEPS = 1_000_000  # Longer than the pretraining regime's warmup: a valid schedule.


def benchmark_config(model: str, *, batch: int, resolution: int, dtype: str = "float32",
                     overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
                     total_steps: int = TOTAL_STEPS, warmup_steps: Optional[int] = None):
  """`vit_jax.config.get_config(model, DATASET, **overrides)` in the 'pretrain' regime with the
  sizes, dtype and schedule set; not resolved. `overrides`: `config.model` fields but dtype.
  Raises BenchmarkError: an unknown model name or override, or dtype as an override."""
  overrides = dict(overrides or {})
  if "dtype" in overrides:
    raise BenchmarkError("Give the compute dtype with --dtype, not --set dtype=...")
  try:
    config = config_lib.get_config(model, DATASET, **overrides)
  except (ValueError, TypeError, NotImplementedError) as e:
    raise BenchmarkError(str(e)) from e
  config.update(regime="pretrain", batch_size=batch, total_steps=total_steps,
                num_classes=num_classes)
  if warmup_steps is not None:
    config.optim.warmup_steps = warmup_steps
  config.data.image_size = resolution
  config.model.dtype = dtype
  return config


def resolve(config, devices: Sequence[Any]):
  """`(resolved config, dispatch.Choice)`: `vit_jax.config.resolve` of a `benchmark_config`
  for `devices`. Raises BenchmarkError with what `resolve` refuses (e.g. cudnn on a CPU)."""
  try:
    resolved = config_lib.resolve(config, num_train_examples=NUM_TRAIN_EXAMPLES,
                                  num_classes=config.num_classes, devices=devices)
  except (ValueError, TypeError, NotImplementedError) as e:
    raise BenchmarkError(f"{config.model_name}: {e}") from e
  return resolved, config_lib.attention_choice(resolved, config.model.attention, devices)


def forward_macs(model: str, *, resolution: int, dtype: str = "float32",
                 overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000) -> int:
  """Multiply-adds of one image's forward pass (`vit_jax.flops.model_forward_macs`), traced on
  abstract shapes. Raises BenchmarkError: a bad model, override, or resolution."""
  config = config_lib.fill_regime(benchmark_config(
      model, batch=1, resolution=resolution, dtype=dtype, overrides=overrides,
      num_classes=num_classes))
  module = step.create_model(config_lib.for_counting(config))
  try:
    return flops.model_forward_macs(module, (resolution, resolution, 3))
  except (ValueError, TypeError) as e:
    raise BenchmarkError(f"{model} at {resolution}x{resolution} px: {e}") from e


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """A step compiled for abstract arguments, with its timings."""
  compiled: Any  # jax.stages.Compiled
  lower_seconds: float
  compile_seconds: float


def _lower_and_compile(setup, jitted, *args) -> CompiledStep:
  """`Setup.compile`, with the lowering and the compilation timed apart."""

  def run(*abstract):
    start = time.perf_counter()
    lowered = jitted.lower(*abstract)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return CompiledStep(compiled, lowered_at - start, time.perf_counter() - lowered_at)

  return setup.in_mesh(run)(*args)


def jit_forward(setup):
  """`(jitted, variables' shardings)`: `model.apply(variables, images, train=False)` over the
  mesh, sharded as the trainer's state and batches; images `[B, H, W, C]` float32."""
  shardings = step.variables_of(setup.state_shardings)
  forward = lambda variables, images: setup.model.apply(variables, images, train=False)
  return jax.jit(forward, in_shardings=(shardings, setup.batch_sharding)), shardings


def compile_step(setup, mode: str, batch: int) -> CompiledStep:
  """The 'train' step or the 'inference' forward of `setup`, compiled for `batch` images."""
  abstract_batch = setup.abstract_batch(batch)
  if mode == "train":
    return _lower_and_compile(setup, setup.jit_train_step(), setup.abstract_state,
                              abstract_batch)
  jitted, _ = jit_forward(setup)
  return _lower_and_compile(setup, jitted, step.variables_of(setup.abstract_state),
                            abstract_batch["image"])


def compile_train_step(config, image_shape: Sequence[int], devices: Optional[Sequence[Any]] = None):
  """The compiled training step of a config resolved for `devices` (default all)."""
  setup = step.build(config, image_shape=image_shape, devices=devices)
  return compile_step(setup, "train", config.batch_size).compiled


def train_inputs(setup, batch: int, with_state: bool = True):
  """`(fresh train state or None, {'image', 'labels'})`: random float32 images `[B, H, W, C]` and
  one-hot labels, placed as the trainer's."""
  image_key, label_key = jax.random.split(jax.random.key(1))
  classes = setup.config.num_classes
  data = {"image": jax.random.normal(image_key, (batch, *setup.image_shape), jnp.float32),
          "labels": jax.nn.one_hot(jax.random.randint(label_key, (batch,), 0, classes), classes)}
  state = (jax.jit(setup.init_state, out_shardings=setup.state_shardings)(setup.init_rng)
           if with_state else None)
  return state, jax.device_put(data, setup.batch_sharding)


def _execute(setup, compiled, mode: str, batch: int, warmup: int, steps: int
             ) -> tuple[float, list[float]]:
  """Seconds of the first execution and of `steps` timed ones after `warmup` untimed ones."""
  if mode == "train":
    state, data = train_inputs(setup, batch)
    holder = {"state": state}

    def run():
      holder["state"], metrics = compiled(holder["state"], data)
      jax.block_until_ready((holder["state"], metrics))
  else:
    _, shardings = jit_forward(setup)
    variables = jax.jit(setup.init_variables, out_shardings=shardings)(setup.init_rng)
    images = train_inputs(setup, batch, with_state=False)[1]["image"]

    def run():
      jax.block_until_ready(compiled(variables, images))

  return timed(run, warmup, steps)


def measure_ours(model: str, *, batch: int, resolution: int, dtype: str = "float32",
                 mode: str = "train", warmup: int = 2, steps: int = 5,
                 overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
                 compile_only: bool = False, peak_flops: Optional[float] = None
                 ) -> dict[str, Any]:
  """Measures the trainer's step ('train') or the forward pass ('inference') in this process:
  `steps` timed after `warmup` untimed ones (`compile_only`: only compiled). `peak_flops`: the
  device's (None: measured). Returns the `common.UNITS` fields, the resolved 'config', the
  attention that ran and why, device and thread facts (the peak RSS is this process's). Raises
  BenchmarkError: bad model, override, sizes or resolution, or what `resolve` refuses."""
  check_sizes(batch, resolution, warmup, steps, mode, dtype)
  rss_after_imports = rss_now_mib()
  overrides = dict(overrides or {})
  requested = benchmark_config(model, batch=batch, resolution=resolution, dtype=dtype,
                               overrides=overrides, num_classes=num_classes)
  config, choice = resolve(requested, jax.devices())
  try:
    setup = step.build(config, image_shape=(resolution, resolution, 3))
    macs = flops.model_forward_macs(setup.model, setup.image_shape)
  except ValueError as e:
    raise BenchmarkError(f"{model} at {resolution}x{resolution} px: {e}") from e
  analytic = (3 if mode == "train" else 1) * 2 * macs * batch
  compiled = compile_step(setup, mode, batch)
  xla_flops = flops.compiled_flops(compiled.compiled)
  first, times = (None, []) if compile_only else _execute(setup, compiled.compiled, mode, batch,
                                                         warmup, steps)
  device = jax.devices()[0]
  result: dict[str, Any] = {
      "framework": "ours", "model": model, "overrides": overrides, "mode": mode,
      "batch": batch, "resolution": resolution, "dtype": dtype, "num_classes": num_classes,
      "num_params": int(sum(x.size for x in jax.tree.leaves(setup.abstract_state["params"]))),
      "scan": bool(config.model.get("scan")), "remat": bool(config.model.get("remat")),
      "remat_policy": config.model.get("remat_policy"), "loss": config.loss,
      "attention": config.model.attention, "attention_requested": requested.model.attention,
      "attention_reason": choice.reason,
      "attention_cpu_kernel_called": kernels.called_by(compiled.compiled) is not None,
      "compile_only": compile_only, "warmup_steps": warmup,
      "timed_steps": 0 if compile_only else steps, "lower_seconds": compiled.lower_seconds,
      "compile_seconds": compiled.compile_seconds, "first_step_seconds": first,
      "flops_per_step_xla": xla_flops, "flops_per_step_analytic": float(analytic),
      "xla_to_analytic": xla_flops / analytic if xla_flops else None,
      "peak_rss_mib": peak_rss_mib(), "rss_after_imports_mib": rss_after_imports,
      "device_peak_mib": None, "platform": device.platform, "device_kind": device.device_kind,
      "num_devices": jax.device_count(), "threads": thread_facts(),
      "config": json.loads(config_lib.to_json(config)),
  }
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      result["device_peak_mib"] = stats["peak_bytes_in_use"] / 2**20
  # Measured after the peak RSS was read (the CPU peak's matmuls allocate).
  if peak_flops is None:
    hw = accounting.local_hardware(dtype)
    peak_flops, source = hw.peak_flops_per_device, hw.peak_source
  else:
    source = "given"
  result.update(peak_flops_per_device=peak_flops, peak_source=source)
  fill_rates(result, batch, times)
  return result
