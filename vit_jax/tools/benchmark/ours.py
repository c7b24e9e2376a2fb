"""Our side of the benchmark: the trainer's very train step (or the model's forward), built and
compiled from a resolved config as `vit_jax.train` builds and compiles it, then timed.

  config = benchmark_config('ViT-B_16', batch=8, resolution=224)   # what the flags ask for
  config, choice = resolve(config, jax.devices())                  # vit_jax.config.resolve
  setup = vit_jax.step.build(config, image_shape=(224, 224, 3))
  compiled = compile_step(setup, 'train', 8).compiled              # setup.jit_train_step()

The config is `vit_jax.config.get_config(model, DATASET, **overrides)` in the pretraining regime
(AdamW, global-norm clipping at 1, linear warmup and decay, sigmoid cross-entropy with the head
bias at -10; docs/reference.md section 3), with the model's training execution defaults (scan,
remat; `vit_jax.config.TRAINING_DEFAULTS`), the batch, `data.image_size` = the resolution,
`model.dtype` = the compute dtype and a long schedule (`TOTAL_STEPS`). Training mode compiles
`Setup.jit_train_step()`: the same function, shardings and donation as the trainer's, so
`tests/tools/test_benchmark_step.py` can compare the two compiled programs' HLO. Inference mode
compiles the model's forward in eval mode, `model.apply(variables, images, train=False)`, with
the parameters sharded as the trainer's state (not `Setup.jit_eval_step()`, which adds the
evaluation's loss and top-k sums: timm's inference is the bare forward too).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Optional, Sequence

from vit_jax.tools.benchmark.common import BenchmarkError
from vit_jax.tools.benchmark.common import check_mode_and_dtype
from vit_jax.tools.benchmark.common import check_sizes
from vit_jax.tools.benchmark.common import fill_rates
from vit_jax.tools.benchmark.common import peak_rss_mib
from vit_jax.tools.benchmark.common import rss_now_mib
from vit_jax.tools.benchmark.common import thread_facts
from vit_jax.tools.benchmark.common import timed

#: The dataset the config names (its `data.name`); nothing is read and no value of the step
#: depends on it.
DATASET = "imagenet2012"
#: Examples of an epoch, for `vit_jax.config.resolve` (only lengths given in epochs use it, and
#: the benchmark's are in steps): ImageNet's training split.
NUM_TRAIN_EXAMPLES = 1_281_167
#: Optimizer steps of the benchmark's schedule: long enough for the regime's warmup (10,000 steps
#: in the pretraining regime), so that the schedule is valid and its constants those of a run.
TOTAL_STEPS = 1_000_000


def benchmark_config(model: str, *, batch: int, resolution: int, dtype: str = "float32",
                     overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
                     total_steps: int = TOTAL_STEPS, warmup_steps: Optional[int] = None):
  """The training config that the benchmark measures (not resolved yet).

  Args:
    model: a `vit_jax.models` name; overrides: its `config.model` fields (not dtype), e.g.
      `{'scan': False}` or `{'attention': 'xla'}` to force an attention implementation.
    batch: `config.batch_size`, images per step; resolution: `config.data.image_size` (pixels).
    dtype: `config.model.dtype`, 'float32' or 'bfloat16' (parameters stay float32).
    num_classes: `config.num_classes`, classes of the head.
    total_steps: the schedule's length; warmup_steps: None keeps the regime's.

  Returns:
    `vit_jax.config.get_config(model, DATASET, **overrides)` in the 'pretrain' regime with those
    values set (a locked ConfigDict; `resolve` fills and checks the rest).

  Raises:
    BenchmarkError: an unknown model name or override, or dtype given as an override.
  """
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  overrides = dict(overrides or {})
  if "dtype" in overrides:
    raise BenchmarkError("Give the compute dtype with --dtype, not --override dtype=...")
  try:
    config = config_lib.get_config(model, DATASET, **overrides)
  except (ValueError, TypeError, NotImplementedError) as e:
    raise BenchmarkError(str(e)) from e
  config.regime = "pretrain"
  config.batch_size = batch
  config.total_steps = total_steps
  if warmup_steps is not None:
    config.optim.warmup_steps = warmup_steps
  config.data.image_size = resolution
  config.model.dtype = dtype
  config.num_classes = num_classes
  return config


def resolve(config, devices: Sequence[Any]):
  """`vit_jax.config.resolve` of a `benchmark_config` for `devices`, and the attention choice.

  Returns:
    `(resolved config, dispatch.Choice)`.

  Raises:
    BenchmarkError: what `resolve` refuses (e.g. `--override attention=cudnn` on a CPU, or a
      batch the devices cannot split), with its message.
  """
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  try:
    resolved = config_lib.resolve(config, num_train_examples=NUM_TRAIN_EXAMPLES,
                                  num_classes=config.num_classes, devices=devices)
  except (ValueError, TypeError, NotImplementedError) as e:
    raise BenchmarkError(f"{config.model_name}: {e}") from e
  return resolved, config_lib.attention_choice(resolved, config.model.attention, devices)


def forward_macs(model: str, *, resolution: int, dtype: str = "float32",
                 overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000) -> int:
  """Multiply-adds of one image's forward pass (`vit_jax.flops.model_forward_macs`), traced on
  abstract shapes with XLA's attention (every implementation does the same products).

  Raises:
    BenchmarkError: a bad model, override, or a resolution the model cannot take.
  """
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from vit_jax import flops, step  # pylint: disable=g-import-not-at-top
  config = config_lib.fill_regime(benchmark_config(
      model, batch=1, resolution=resolution, dtype=dtype, overrides=overrides,
      num_classes=num_classes))
  config_lib.for_counting(config)
  try:
    return flops.model_forward_macs(step.create_model(config), (resolution, resolution, 3))
  except (ValueError, TypeError) as e:
    raise BenchmarkError(f"{model} at {resolution}x{resolution} px: {e}") from e


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """A step of a `vit_jax.step.Setup` compiled for abstract arguments, with its timings."""
  compiled: Any  # jax.stages.Compiled
  lower_seconds: float
  compile_seconds: float


def _lower_and_compile(setup, jitted, *args) -> CompiledStep:
  """What `Setup.compile` does (`jitted.lower(*args).compile()` inside the mesh and the
  logical-axis rules), with the lowering and the compilation timed apart."""

  def run(*abstract):
    start = time.perf_counter()
    lowered = jitted.lower(*abstract)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return CompiledStep(compiled, lowered_at - start, time.perf_counter() - lowered_at)

  return setup.in_mesh(run)(*args)


def jit_forward(setup):
  """`model.apply(variables, images, train=False)` jitted over the mesh: variables sharded as
  the trainer's parameters and collections, images `[B, H, W, C]` float32 as its batches.

  Returns:
    `(jitted, variables' shardings)`; logits `[B, num_classes]`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from vit_jax import step  # pylint: disable=g-import-not-at-top
  shardings = step.variables_of(setup.state_shardings)
  forward = lambda variables, images: setup.model.apply(variables, images, train=False)
  return jax.jit(forward, in_shardings=(shardings, setup.batch_sharding)), shardings


def compile_step(setup, mode: str, batch: int) -> CompiledStep:
  """Compiles the benchmark's step of `setup` for a global batch of `batch` images.

  mode 'train': `setup.jit_train_step()` for `setup.abstract_state` and
  `setup.abstract_batch(batch)`, the trainer's program; 'inference': `jit_forward(setup)`.
  """
  from vit_jax import step  # pylint: disable=g-import-not-at-top
  abstract_batch = setup.abstract_batch(batch)
  if mode == "train":
    return _lower_and_compile(setup, setup.jit_train_step(), setup.abstract_state,
                              abstract_batch)
  jitted, _ = jit_forward(setup)
  return _lower_and_compile(setup, jitted, step.variables_of(setup.abstract_state),
                            abstract_batch["image"])


def compile_train_step(config, image_shape: Sequence[int], devices: Optional[Sequence[Any]] = None):
  """The benchmark's compiled training step of a resolved config (`jax.stages.Compiled`).

  Args:
    config: resolved (`vit_jax.config.resolve`, or `resolve` here) for `devices`.
    image_shape: `(H, W, C)` of the images; devices: the mesh's (default `jax.devices()`).
  """
  from vit_jax import step  # pylint: disable=g-import-not-at-top
  setup = step.build(config, image_shape=image_shape, devices=devices)
  return compile_step(setup, "train", config.batch_size).compiled


def _execute(setup, compiled, mode: str, batch: int, warmup: int, steps: int
             ) -> tuple[float, list[float]]:
  """Runs the compiled step on random images and labels: the first execution, `warmup`
  untimed and `steps` timed ones (each waited for). Returns `(first seconds, timed seconds)`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  image_key, label_key = jax.random.split(jax.random.key(1))
  images = jax.device_put(jax.random.normal(image_key, (batch, *setup.image_shape), jnp.float32),
                          setup.batch_sharding)
  if mode == "train":
    classes = setup.config.num_classes
    labels = jax.nn.one_hot(jax.random.randint(label_key, (batch,), 0, classes), classes)
    data = {"image": images, "labels": jax.device_put(labels, setup.batch_sharding)}
    holder = {"state": jax.jit(setup.init_state,
                               out_shardings=setup.state_shardings)(setup.init_rng)}

    def run():
      holder["state"], metrics = compiled(holder["state"], data)
      jax.block_until_ready((holder["state"], metrics))
  else:
    _, shardings = jit_forward(setup)
    variables = jax.jit(setup.init_variables, out_shardings=shardings)(setup.init_rng)

    def run():
      jax.block_until_ready(compiled(variables, images))

  first = timed(run, 1)[0]
  timed(run, warmup)
  return first, timed(run, steps)


def measure_ours(model: str, *, batch: int, resolution: int, dtype: str = "float32",
                 mode: str = "train", warmup: int = 2, steps: int = 5,
                 overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
                 compile_only: bool = False, peak_flops: Optional[float] = None
                 ) -> dict[str, Any]:
  """Measures the trainer's step ('train') or the forward pass ('inference') in this process.

  Args:
    model, overrides, batch, resolution, dtype, num_classes: as `benchmark_config`.
    mode: 'train' or 'inference' (see the module docstring).
    warmup, steps: untimed steps after the first execution, then timed steps.
    compile_only: only lower and compile, on abstract shapes (nothing is allocated).
    peak_flops: the device peak to compare with; None measures it (`local_hardware`) after the
      peak RSS is read.

  Returns:
    A dict of the `common.UNITS` fields plus the configuration (the resolved config under
    'config'), the attention that ran ('attention', 'attention_requested', 'attention_reason',
    'attention_cpu_kernel_called': whether the compiled step calls vit_jax's CPU kernel), the
    platform, device and thread facts. The peak RSS is this whole process's (run it in a fresh
    process to isolate it).

  Raises:
    BenchmarkError: bad model, override, sizes, a resolution the model cannot take or a config
      that `vit_jax.config.resolve` refuses.
  """
  check_mode_and_dtype(mode, dtype)
  check_sizes(batch, resolution, warmup, steps)
  import jax  # pylint: disable=g-import-not-at-top
  from vit_jax import accounting, flops, step  # pylint: disable=g-import-not-at-top
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from vit_jax.kernels import cpu_attention  # pylint: disable=g-import-not-at-top
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
  cost = compiled.compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost["flops"]) if cost and cost.get("flops") else None
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
      "attention_cpu_kernel_called": cpu_attention.called_by(compiled.compiled),
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
