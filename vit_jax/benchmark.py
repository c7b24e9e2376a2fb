r"""Throughput, compile time, memory and FLOP utilisation of a model, optionally beside timm.

Usage:
  python -m vit_jax.benchmark MODEL [MODEL ...] [--batch 8] [--resolution 224]
      [--dtype float32|bfloat16] [--mode train|inference|both] [--warmup 2] [--steps 5]
      [--threads N] [--override KEY=VALUE ...] [--compare timm] [--rounds R] [--compile-only]
      [--input-pipeline] [--json PATH]

Examples:
  # ViT-B/16, batch 8 at 224 px: our training step and inference beside timm's, 3 rounds.
  python -m vit_jax.benchmark ViT-B_16 --batch 8 --compare timm --rounds 3 --json b16.json
  # Only the compile time of ViT-H/14's training step, scanned (the default) and unrolled.
  python -m vit_jax.benchmark ViT-H_14 --batch 1 --mode train --compile-only
  python -m vit_jax.benchmark ViT-H_14 --batch 1 --mode train --compile-only --override scan=False

Our model runs with the execution settings `python -m vit_jax.main` trains with
(`vit_jax.models.TRAINING_DEFAULTS`; for ViT and T2T-ViT: scan=True, remat=True,
remat_policy='dots_and_attention_saveable'), each replaceable with --override (e.g.
--override scan=False --override remat=False for the plain unrolled model). On a CPU its
attention runs in vit_jax's fused kernel (vit_jax.models.fused_attention) when it is float32
with a head size divisible by 16 and no attention dropout (so not with --dtype bfloat16), on
one device; the environment variable VIT_JAX_FUSED_ATTENTION=0 measures XLA's attention
instead. The report's notes say which ran. timm runs its
default model, without gradient checkpointing unless --override remat=True is given.

What is measured, for every model and mode (one row each):
  train      one step of `vit_jax.train`: forward, backward, global-norm clipping at 1, AdamW
             (the pretraining regime of `vit_jax.optim`, weight decay on kernels) and the step's
             metrics (loss, gradient and parameter norms), jitted with the state donated; the
             loss is softmax cross-entropy. timm: `torch.optim.AdamW` (weight decay 0.1 on
             matrices), `clip_grad_norm_(1.0)`, `CrossEntropyLoss`.
  inference  the forward pass in eval mode (`train=False`; timm: `model.eval()` under
             `torch.inference_mode()`).
  For each: the time to lower and to compile the jitted step (ours; timm runs eagerly), the
  first execution apart from that, then --warmup untimed steps and --steps timed ones, each
  waited for with `block_until_ready`; images/s = batch / the median step time. Peak memory:
  the process's peak resident set (`getrusage(RUSAGE_SELF).ru_maxrss`, host RSS) on CPU and,
  on GPU/TPU, the device's `memory_stats()['peak_bytes_in_use']` too. Every configuration
  (model x mode x framework x round) runs in a fresh subprocess, so peaks do not mix.
  FLOPs per step: XLA's cost analysis of the compiled step (it counts a `scan` body once, so a
  model with `scan=True` shows about 1/num_layers of the layers' work, and it counts the
  elementwise work and the optimizer too) and the analytic count of the matrix products,
  3 x 2 x `flops.model_forward_macs` x batch for training, 2 x MACs x batch for inference.
  Achieved FLOP/s = analytic FLOPs / median step time, as a fraction of the device's peak
  (`accounting.local_hardware`: a measured float32 2048^3 matmul on CPU, the published table on
  GPU/TPU); timm's rows use the same analytic count and peak.

--input-pipeline also measures the training input pipeline alone (`measure_input`): images/s
of `vit_jax.data.create_train_iterator` with the training defaults (Inception crop fused with
decoding, flip, resize to --resolution, normalisation, prefetch) at the same batch and threads,
on the offline Fashion-MNIST builder and on a generated folder of 500x375 JPEGs, with the
multiple of our fastest measured training step (> 1: the input is not the bottleneck).

Threads (--threads N, default: every core this process may run on): the subprocesses are
pinned to N cores (`sched_setaffinity`); JAX's CPU client sizes its intra-op (Eigen) thread
pool from NPROC=N (which XLA reads, otherwise the schedulable cores), torch gets
`torch.set_num_threads(N)` and OMP_NUM_THREADS=N. The counts used, XLA_FLAGS, the versions and
the CPU are recorded in the JSON under 'environment'.

Memory allocator: like `vit_jax.main`, the command re-executes itself with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35, transparent huge pages 'madvise' or
'always'; `vit_jax.cli.huge_pages_environment`), and every measuring subprocess, timm's
included, inherits it, so both frameworks run under the same allocator. XLA:CPU allocates each
step's temporaries afresh, and without huge pages it page-faults on all of them every step.
VIT_JAX_HUGE_PAGES=0 measures without (a note in the report says which).

--compare timm runs timm's equivalent model (`timm.create_model('vit_base_patch16_224',
pretrained=False, num_classes=..., img_size=...)` for ViT-B_16; Ti, S, L, H likewise; other
architectures through timm's keyword arguments) with the same batch, resolution, dtype
(bfloat16: `torch.autocast`), optimizer and thread count, in separate processes alternating
with ours over --rounds rounds (the order flips every round), and prints the medians and the
ratios ours / timm of images/s and peak RSS. It needs the optional extra
`pip install -e '.[bench]'` (torch and timm). T2T-ViT and hybrid models have no timm
equivalent: only ours is measured (a note says so).

Absolute figures depend on the machine (CPU model, cores, memory bandwidth, other load); the
ratios between the frameworks on one machine are what to compare. Exit status: 0, 1 when a
measurement failed, 2 for bad input (a one-line message, no traceback).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

MODES = ("train", "inference")
DTYPES = ("float32", "bfloat16")

#: timm names of the official ViT sizes (timm 1.0 `vit_{size}_patch{P}_224`).
TIMM_SIZES = {"Ti": "tiny", "S": "small", "B": "base", "L": "large", "H": "huge"}
#: (size, patch) pairs timm registers under their own name; others go through keyword arguments.
TIMM_NAMED = {("Ti", 16), ("S", 16), ("S", 32), ("B", 8), ("B", 16), ("B", 32), ("L", 16),
              ("L", 32), ("H", 14)}
#: Architecture fields that the timm model receives as keyword arguments when they differ from
#: the named configuration.
_ARCH_KEYS = ("hidden_size", "mlp_dim", "num_heads", "num_layers", "patch_size", "classifier")

#: Fields of a result that are medians over rounds.
_MEDIAN_KEYS = ("images_per_sec", "step_seconds", "lower_seconds", "compile_seconds",
                "first_step_seconds", "peak_rss_mib", "device_peak_mib",
                "achieved_flops_per_sec", "fraction_of_peak", "flops_per_step_xla")

#: What the JSON's numbers are in.
UNITS = {
    "images_per_sec": "images/s (batch / median step time)",
    "step_seconds": "s (median of the timed steps)",
    "step_seconds_all": "s (every timed step)",
    "lower_seconds": "s (jax.jit(...).lower)", "compile_seconds": "s (.compile())",
    "first_step_seconds": "s (first execution after compiling; timm: first eager step)",
    "peak_rss_mib": "MiB (ru_maxrss of the measuring process)",
    "rss_after_imports_mib": "MiB (VmRSS before the model is built)",
    "device_peak_mib": "MiB (peak_bytes_in_use of device 0; None on CPU)",
    "flops_per_step_xla": "FLOPs (XLA cost analysis of the compiled step)",
    "flops_per_step_analytic": "FLOPs (2 x forward MACs x batch, x3 for training)",
    "achieved_flops_per_sec": "FLOP/s (analytic FLOPs / median step time)",
    "fraction_of_peak": "0..1 (achieved / peak_flops_per_device)",
    "peak_flops_per_device": "FLOP/s",
}


class BenchmarkError(Exception):
  """Bad input: main() prints the message and exits with status 2."""


class NoTimmModel(BenchmarkError):
  """The model has no timm equivalent."""


class MeasurementFailed(RuntimeError):
  """A measuring subprocess failed (e.g. out of memory)."""


# ---------------------------------------------------------------------------------------------
# Validation and the timm equivalent (no JAX backend, no torch needed).


def parse_override(text: str) -> tuple[str, Any]:
  """'num_layers=4' -> ('num_layers', 4); values are Python literals, else strings."""
  key, sep, value = text.partition("=")
  if not sep or not key.strip():
    raise BenchmarkError(f"--override {text!r} is not KEY=VALUE (e.g. --override num_layers=4).")
  value = value.strip()
  lowered = value.lower()
  if lowered in ("true", "false"):
    return key.strip(), lowered == "true"
  try:
    return key.strip(), ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key.strip(), value


def training_overrides(model: str, overrides: dict[str, Any]) -> dict[str, Any]:
  """`overrides` plus the training defaults of `model`'s execution fields not overridden.

  These are what `python -m vit_jax.main` trains with (`vit_jax.models.TRAINING_DEFAULTS`:
  for ViT and T2T-ViT a scanned encoder, each block rematerialised keeping the dense
  projections' outputs),
  so the benchmark measures the step a user gets. Raises BenchmarkError for an unknown model.
  """
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  try:
    fields = models.model_config(model, **overrides)
  except (ValueError, TypeError, NotImplementedError) as e:
    raise BenchmarkError(str(e)) from e
  return {**{k: v for k, v in models.TRAINING_DEFAULTS.items()
             if k in fields and k not in overrides}, **overrides}


def model_fields(model: str, overrides: dict[str, Any], dtype: str) -> dict[str, Any]:
  """The resolved model configuration measured: `models.model_config` of the training overrides.

  Args:
    model, overrides: as given on the command line; `training_overrides` adds the defaults.
    dtype: the compute dtype.

  Raises:
    BenchmarkError: unknown model name, bad override or a value the model rejects.
  """
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  if "dtype" in overrides:
    raise BenchmarkError("Give the compute dtype with --dtype, not --override dtype=...")
  try:
    return models.model_config(model, **training_overrides(model, overrides), dtype=dtype)
  except (ValueError, TypeError, NotImplementedError) as e:
    raise BenchmarkError(str(e)) from e


def timm_equivalent(model: str, overrides: Optional[dict[str, Any]] = None
                    ) -> tuple[str, dict[str, Any], bool]:
  """The timm model that matches one of ours: `(name, create_model kwargs, grad checkpointing)`.

  The official sizes map to timm's names (ViT-B_16 -> 'vit_base_patch16_224', Ti -> tiny,
  S -> small, L -> large, H -> huge); a changed architecture (overrides, 'ViT-custom', another
  patch size) is passed as timm's keyword arguments (embed_dim, depth, num_heads, mlp_ratio,
  patch_size, class_token / global_pool), dropout as pos_drop_rate / proj_drop_rate /
  attn_drop_rate, and remat=True as timm's gradient checkpointing.

  Raises:
    NoTimmModel: T2T-ViT, hybrids, ViT-g/G and representation_size have no timm equivalent.
  """
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  overrides = dict(overrides or {})
  family, match = models.resolve(model)
  if family.name not in ("ViT", "ViT-custom"):
    raise NoTimmModel(f"{model}: timm has no {family.name} model; only ours is measured "
                      "(the timm comparison covers plain ViTs).")
  config = models.model_config(model, **overrides)
  if config.get("representation_size"):
    raise NoTimmModel(f"{model}: timm's ViT has no representation (pre_logits) layer; only "
                      "ours is measured.")
  kwargs: dict[str, Any] = {}
  if family.name == "ViT":
    size = match.group("size")
    size = size if size in ("g", "G") else {k.lower(): k for k in TIMM_SIZES}[size.lower()]
    if size not in TIMM_SIZES:
      raise NoTimmModel(f"{model}: ViT-{size} has no timm equivalent; only ours is measured.")
    patch = int(match.group("patch"))
    base = models.model_config(model)
    name = (f"vit_{TIMM_SIZES[size]}_patch{patch}_224" if (size, patch) in TIMM_NAMED else
            f"vit_{TIMM_SIZES[size]}_patch16_224")
    changed = (size, patch) not in TIMM_NAMED or any(config[k] != base[k] for k in _ARCH_KEYS)
  else:
    name, changed = "vit_base_patch16_224", True
  if changed:
    ph, pw = config["patch_size"]
    kwargs.update(embed_dim=config["hidden_size"], depth=config["num_layers"],
                  num_heads=config["num_heads"],
                  mlp_ratio=config["mlp_dim"] / config["hidden_size"],
                  patch_size=ph if ph == pw else (ph, pw))
    if config["classifier"] == "gap":
      kwargs.update(class_token=False, global_pool="avg")
  if config.get("dropout_rate"):
    kwargs.update(pos_drop_rate=config["dropout_rate"], proj_drop_rate=config["dropout_rate"])
  if config.get("attention_dropout_rate"):
    kwargs["attn_drop_rate"] = config["attention_dropout_rate"]
  return name, kwargs, bool(config.get("remat"))


def _missing_bench_packages() -> list[str]:
  """The packages of the 'bench' extra that cannot be imported."""
  return [name for name in ("torch", "timm") if importlib.util.find_spec(name) is None]


# ---------------------------------------------------------------------------------------------
# Measurements (run in the measuring subprocess; usable in-process too).


def _rss_now_mib() -> Optional[float]:
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return None


def _peak_rss_mib() -> float:
  """This process's peak resident set in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _timed(fn, steps: int) -> list[float]:
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def _rates(result: dict[str, Any], batch: int, times: list[float]) -> None:
  """Fills the throughput and utilisation fields of `result` from the timed steps (None
  without timed steps)."""
  result.update(step_seconds=None, step_seconds_all=times, images_per_sec=None,
                achieved_flops_per_sec=None, fraction_of_peak=None)
  if not times:
    return
  median = statistics.median(times)
  result.update(step_seconds=median, step_seconds_all=times, images_per_sec=batch / median)
  if result.get("flops_per_step_analytic"):
    result["achieved_flops_per_sec"] = result["flops_per_step_analytic"] / median
    if result.get("peak_flops_per_device"):
      result["fraction_of_peak"] = (result["achieved_flops_per_sec"]
                                    / result["peak_flops_per_device"])


def _check_sizes(batch: int, resolution: int, warmup: int, steps: int) -> None:
  for name, value, least in (("batch", batch, 1), ("resolution", resolution, 1),
                             ("warmup", warmup, 0), ("steps", steps, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise BenchmarkError(f"{name} must be an integer >= {least}, got {value!r}.")


def measure_ours(model: str, *, batch: int, resolution: int, dtype: str = "float32",
                 mode: str = "train", warmup: int = 2, steps: int = 5,
                 overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
                 compile_only: bool = False, peak_flops: Optional[float] = None
                 ) -> dict[str, Any]:
  """Measures our jitted training step or forward pass in this process.

  Args:
    model: a `vit_jax.models` name; overrides: its configuration fields (not dtype).
    batch, resolution: images per step, square image side in pixels.
    dtype: compute dtype, 'float32' or 'bfloat16' (parameters stay float32).
    mode: 'train' (the step of `vit_jax.train`: forward, backward, clipping, AdamW, metrics)
      or 'inference' (forward, train=False).
    warmup, steps: untimed steps after the first execution, then timed steps.
    compile_only: only lower and compile, on abstract shapes (nothing is allocated).
    peak_flops: the device peak to compare with; None measures it (`local_hardware`) after the
      peak RSS is read.

  Returns:
    A dict of the `UNITS` fields plus the configuration, platform, device and thread facts.
    The peak RSS is this whole process's (run it in a fresh process to isolate it).

  Raises:
    BenchmarkError: bad model, override, sizes or a resolution the model cannot take.
  """
  if mode not in MODES:
    raise BenchmarkError(f"mode must be one of {MODES}, got {mode!r}.")
  if dtype not in DTYPES:
    raise BenchmarkError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
  _check_sizes(batch, resolution, warmup, steps)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from vit_jax import accounting, flops, models, optim  # pylint: disable=g-import-not-at-top
  from vit_jax.models import fused_attention  # pylint: disable=g-import-not-at-top
  rss_after_imports = _rss_now_mib()
  overrides = dict(overrides or {})
  config = model_fields(model, overrides, dtype)
  net = models.create(model, num_classes=num_classes,
                      **dict(training_overrides(model, overrides), dtype=jnp.dtype(dtype)))
  image_shape = (resolution, resolution, 3)
  try:
    macs = flops.model_forward_macs(net, image_shape)
  except ValueError as e:
    raise BenchmarkError(str(e)) from e
  train = mode == "train"
  analytic = (3 if train else 1) * 2 * macs * batch

  rng = jax.random.key(0)
  init = lambda r: models.unbox(net.init(r, jnp.zeros((1, *image_shape)), train=False))
  variables = jax.eval_shape(init, rng) if compile_only else jax.jit(init)(rng)
  num_params = sum(x.size for x in jax.tree.leaves(variables["params"]))
  image_spec = jax.ShapeDtypeStruct((batch, *image_shape), jnp.float32)
  label_spec = jax.ShapeDtypeStruct((batch, num_classes), jnp.float32)
  if compile_only:
    images, labels = image_spec, label_spec
  else:
    k1, k2 = jax.random.split(jax.random.key(1))
    images = jax.random.normal(k1, image_spec.shape, jnp.float32)
    labels = jax.nn.one_hot(jax.random.randint(k2, (batch,), 0, num_classes), num_classes)

  if train:
    # The pretraining regime's optimizer (AdamW, clipping at 1) and schedule, as vit_jax.train.
    optim_config = ml_collections.ConfigDict(dict(optim.REGIME_DEFAULTS["pretrain"],
                                                  max_skipped_updates=0))
    schedule = optim.lr_schedule(optim_config.lr, 1_000_000, optim_config.warmup_steps,
                                 optim_config.schedule)
    tx = optim.make_optimizer(optim_config, schedule)
    dropout_rng = jax.random.key(2)

    def state_of(variables):
      variables = dict(variables)
      params = variables.pop("params")
      state = {"step": jnp.zeros((), jnp.int32), "params": params,
               "opt_state": tx.init(params)}
      if variables:
        state["model_state"] = variables
      return state

    state = (jax.eval_shape(state_of, variables) if compile_only
             else jax.jit(state_of)(variables))
    del variables

    def train_step(state, batch_):
      """vit_jax.train's step with grad_accum_steps=1 and no EMA."""
      step_rng = jax.random.fold_in(dropout_rng, state["step"])

      def loss_of(params):
        logits = net.apply({"params": params, **state.get("model_state", {})}, batch_["image"],
                           train=True, rngs={"dropout": step_rng})
        return optim.loss_fn(logits, batch_["labels"], "softmax_xent").mean()

      loss, grads = jax.value_and_grad(loss_of)(state["params"])
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
                 "param_norm": optax.global_norm(params), "lr": schedule(state["step"])}
      return dict(state, step=state["step"] + 1, params=params, opt_state=opt_state), metrics

    jitted = jax.jit(train_step, donate_argnums=0)
    args = (state, {"image": images, "labels": labels})
  else:
    jitted = jax.jit(lambda variables, x: net.apply(variables, x, train=False))
    args = (variables, images)

  start = time.perf_counter()
  lowered = jitted.lower(*args)
  lower_seconds = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost["flops"]) if cost and cost.get("flops") else None
  fused = fused_attention.called_by(compiled)  # Which attention the step runs.

  times: list[float] = []
  first = None
  if not compile_only:
    if train:
      holder = {"state": args[0]}

      def run():
        holder["state"], metrics = compiled(holder["state"], args[1])
        jax.block_until_ready((holder["state"], metrics))
    else:
      def run():
        jax.block_until_ready(compiled(*args))
    first = _timed(run, 1)[0]
    _timed(run, warmup)
    times = _timed(run, steps)

  device = jax.devices()[0]
  result: dict[str, Any] = {
      "framework": "ours", "model": model, "overrides": overrides, "mode": mode,
      "batch": batch, "resolution": resolution, "dtype": dtype, "num_classes": num_classes,
      "num_params": int(num_params), "scan": bool(config.get("scan")),
      "remat": bool(config.get("remat")), "remat_policy": config.get("remat_policy"),
      "attention_core": "fused CPU kernel" if fused else "XLA", "compile_only": compile_only,
      "warmup_steps": warmup, "timed_steps": 0 if compile_only else steps,
      "lower_seconds": lower_seconds, "compile_seconds": compile_seconds,
      "first_step_seconds": first, "flops_per_step_xla": xla_flops,
      "flops_per_step_analytic": float(analytic),
      "xla_to_analytic": xla_flops / analytic if xla_flops else None,
      "peak_rss_mib": _peak_rss_mib(), "rss_after_imports_mib": rss_after_imports,
      "device_peak_mib": None, "platform": device.platform, "device_kind": device.device_kind,
      "num_devices": jax.device_count(), "threads": _thread_facts(),
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
  _rates(result, batch, times)
  return result


def measure_timm(model: str, *, batch: int, resolution: int, dtype: str = "float32",
                 mode: str = "train", warmup: int = 2, steps: int = 5,
                 overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
                 threads: Optional[int] = None, peak_flops: Optional[float] = None,
                 analytic_flops: Optional[float] = None, device: str = "cpu"
                 ) -> dict[str, Any]:
  """Measures timm's equivalent of `model` (see `timm_equivalent`) in this process.

  The same batch, resolution and dtype (bfloat16: `torch.autocast`) as `measure_ours`; training
  is `zero_grad`, forward, `CrossEntropyLoss`, backward, `clip_grad_norm_(1.0)` and
  `torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999))` with weight decay 0.1 on the matrices
  (not on biases, norms, `pos_embed`, `cls_token`). `analytic_flops` and `peak_flops` (ours)
  give the utilisation; `threads` is `torch.set_num_threads`.

  Raises:
    NoTimmModel: see `timm_equivalent`; BenchmarkError: bad sizes; ImportError without torch.
  """
  if mode not in MODES or dtype not in DTYPES:
    raise BenchmarkError(f"mode must be one of {MODES} and dtype one of {DTYPES}.")
  _check_sizes(batch, resolution, warmup, steps)
  name, kwargs, checkpointing = timm_equivalent(model, overrides)
  timm, torchvision_ops = _import_timm()
  import torch  # pylint: disable=g-import-not-at-top
  rss_after_imports = _rss_now_mib()
  if threads:
    torch.set_num_threads(threads)
  torch.manual_seed(0)
  dev = torch.device("cuda" if device == "gpu" and torch.cuda.is_available() else "cpu")
  net = timm.create_model(name, pretrained=False, num_classes=num_classes, img_size=resolution,
                          **kwargs).to(dev)
  if checkpointing:
    net.set_grad_checkpointing(True)
  num_params = sum(p.numel() for p in net.parameters())
  images = torch.randn(batch, 3, resolution, resolution, device=dev)
  labels = torch.randint(0, num_classes, (batch,), device=dev)
  autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if dtype == "bfloat16"
              else contextlib.nullcontext())
  sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
  train = mode == "train"
  if train:
    net.train()
    skip = set(net.no_weight_decay()) if hasattr(net, "no_weight_decay") else set()
    decay, no_decay = [], []
    for pname, param in net.named_parameters():
      (decay if param.ndim >= 2 and pname not in skip else no_decay).append(param)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.999))
    loss_fn = torch.nn.CrossEntropyLoss()

    def run():
      opt.zero_grad(set_to_none=True)
      with autocast:
        logits = net(images)
      loss = loss_fn(logits.float(), labels)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
      opt.step()
      loss.item()
      sync()
  else:
    net.eval()

    def run():
      with torch.inference_mode(), autocast:
        net(images)
      sync()

  first = _timed(run, 1)[0]
  _timed(run, warmup)
  times = _timed(run, steps)
  result: dict[str, Any] = {
      "framework": "timm", "model": model, "timm_model": name, "timm_kwargs": kwargs,
      "grad_checkpointing": checkpointing, "overrides": dict(overrides or {}), "mode": mode,
      "batch": batch, "resolution": resolution, "dtype": dtype, "num_classes": num_classes,
      "num_params": int(num_params), "warmup_steps": warmup, "timed_steps": steps,
      "lower_seconds": None, "compile_seconds": None, "first_step_seconds": first,
      "flops_per_step_xla": None, "flops_per_step_analytic": analytic_flops,
      "peak_rss_mib": _peak_rss_mib(), "rss_after_imports_mib": rss_after_imports,
      "device_peak_mib": (torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda"
                          else None),
      "platform": "gpu" if dev.type == "cuda" else "cpu", "device_kind": str(dev),
      "torchvision_ops": torchvision_ops,
      "peak_flops_per_device": peak_flops, "peak_source": "ours (same device)",
      "threads": dict(_thread_facts(), torch_num_threads=torch.get_num_threads(),
                      torch_num_interop_threads=torch.get_num_interop_threads()),
  }
  _rates(result, batch, times)
  return result


def _import_timm():
  """`import timm`, also next to a torchvision whose C++ ops do not load.

  torchvision 0.28 fails on import when its `_C` extension cannot load (e.g. a CUDA torchvision
  wheel beside a CPU-only torch): it registers fake kernels for `torchvision::nms` and `qnms`
  without checking that the ops exist. timm imports torchvision, but its ViT uses none of its
  ops, so the two schemas are declared and the import retried.

  Returns:
    `(timm module, whether torchvision's ops loaded)`.
  """
  import torch  # pylint: disable=g-import-not-at-top
  try:
    import timm  # pylint: disable=g-import-not-at-top
    return timm, True
  except RuntimeError as e:
    if "torchvision::" not in str(e):
      raise
  for name in [m for m in sys.modules if m.split(".")[0] in ("torchvision", "timm")]:
    del sys.modules[name]
  library = torch.library.Library("torchvision", "FRAGMENT")
  for op in ("nms", "qnms"):
    library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
  _import_timm.library = library  # Registrations last as long as the library object.
  import timm  # pylint: disable=g-import-not-at-top,redefined-outer-name
  return timm, False


def _thread_facts() -> dict[str, Any]:
  affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
  return {"cpu_affinity": affinity, "NPROC": os.environ.get("NPROC"),
          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
          "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
          "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", "")}


# ---------------------------------------------------------------------------------------------
# The input pipeline.

#: Inputs that `measure_input` reads: the offline Fashion-MNIST builder (28 x 28 grayscale PNGs,
#: upsampled) and a generated folder of 500 x 375 JPEGs (about ImageNet's mean size).
INPUTS = ("fashion_mnist", "jpeg")
INPUT_LABELS = {"fashion_mnist": "Fashion-MNIST (28x28 PNG)",
                "jpeg": "JPEG folder (500x375 JPEG)"}
JPEG_SIZE = (375, 500)  # height, width
JPEG_COUNT = 256


def _write_jpeg_folder(root: str, count: int = JPEG_COUNT) -> None:
  """`count` JPEGs of JPEG_SIZE (smooth random colour fields, quality 90) in root/train/<class>/."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  height, width = JPEG_SIZE
  for i in range(count):
    folder = os.path.join(root, "train", f"class{i % 4}")
    os.makedirs(folder, exist_ok=True)
    coarse = rng.uniform(0, 255, (height // 25, width // 25, 3)).astype(np.float32)
    image = tf.image.resize(coarse, (height, width), method="bicubic")
    image += rng.normal(0, 8, (height, width, 3))  # Some texture, as in photographs.
    image = tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8)
    tf.io.write_file(os.path.join(folder, f"{i:04d}.jpg"), tf.io.encode_jpeg(image, quality=90))


def measure_input(source: str, *, batch: int, resolution: int, warmup: int = 2,
                  steps: int = 20, data_dir: Optional[str] = None) -> dict[str, Any]:
  """Images/s of the training input pipeline (`vit_jax.data.create_train_iterator`) alone.

  The training configuration's data settings (`vit_jax.data.get_default_config`: Inception crop
  fused with the decoding, random flip, bilinear resize to `resolution`, [-1, 1] normalisation,
  AUTOTUNE parallelism, prefetch) on:
    'fashion_mnist': the offline Fashion-MNIST builder (prepared into `data_dir`, default the
      tfds data_dir, from the Debian package's files on first use);
    'jpeg': a generated image folder of JPEG_COUNT 500 x 375 JPEGs (in a temporary directory).
  After `warmup` batches, `steps` batches are drawn as fast as the pipeline delivers them:
  images/s = batch * steps / elapsed seconds (the pipeline's throughput, prefetching included).

  Raises:
    BenchmarkError: an unknown source or sizes; the data cannot be found or prepared.
  """
  if source not in INPUTS:
    raise BenchmarkError(f"input must be one of {INPUTS}, got {source!r}.")
  _check_sizes(batch, resolution, warmup, steps)
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  cfg = data.get_default_config()
  cfg.image_size = resolution
  cfg.shuffle_buffer = 1024
  if data_dir:
    cfg.data_dir = data_dir
  with tempfile.TemporaryDirectory(prefix="vit_jax_input_") as tmp:
    if source == "jpeg":
      _write_jpeg_folder(tmp)
      cfg.image_folder = tmp
      cfg.train_split = "train"
      cfg.eval_split = "train"
    try:
      iterator = data.create_train_iterator(cfg, batch, seed=0, process_index=0,
                                            process_count=1)
    except (ValueError, FileNotFoundError) as e:
      raise BenchmarkError(f"input {source}: {e}") from e
    for _ in range(warmup + 1):
      next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
      images = next(iterator)["image"]
    seconds = time.perf_counter() - start
  return {"framework": "input", "input": source, "batch": batch, "resolution": resolution,
          "image_shape": list(images.shape[1:]), "augment": cfg.augment,
          "timed_steps": steps, "seconds": seconds, "images_per_sec": batch * steps / seconds,
          "peak_rss_mib": _peak_rss_mib(), "threads": _thread_facts()}


# ---------------------------------------------------------------------------------------------
# Subprocesses.


def _worker(spec_path: str, out_path: str) -> int:
  """Entry point of a measuring subprocess: pins the threads, measures, writes JSON."""
  with open(spec_path, encoding="utf-8") as f:
    spec = json.load(f)
  cores = spec.pop("cores", None)
  if cores and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, cores)
  framework = spec.pop("framework")
  try:
    if framework == "input":
      spec.pop("threads", None)
      result = measure_input(**spec)
    elif framework == "ours":
      spec.pop("threads", None)
      spec.pop("analytic_flops", None)
      spec.pop("device", None)
      result = measure_ours(**spec)
    else:
      spec.pop("compile_only", None)
      result = measure_timm(**spec)
  except BenchmarkError as e:
    result = {"error": str(e)}
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(result, f)
  return 0


def run_in_subprocess(spec: dict[str, Any], timeout: Optional[float] = None) -> dict[str, Any]:
  """Runs one measurement (`measure_ours` / `measure_timm` keyword arguments plus 'framework',
  'threads', 'cores') in a fresh Python process and returns its result.

  Raises:
    MeasurementFailed: the process failed, timed out or reported an error.
  """
  threads = spec.get("threads")
  env = dict(os.environ)
  if threads:
    env.update(NPROC=str(threads), OMP_NUM_THREADS=str(threads))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  with tempfile.TemporaryDirectory(prefix="vit_jax_bench_") as tmp:
    spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
    with open(spec_path, "w", encoding="utf-8") as f:
      json.dump(spec, f)
    what = (f"the {spec['source']} input pipeline" if spec["framework"] == "input" else
            f"{spec['model']} {spec['mode']} ({spec['framework']})")
    try:
      proc = subprocess.run([sys.executable, "-m", "vit_jax.benchmark", "--worker", spec_path,
                             out_path], env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
      raise MeasurementFailed(f"Measuring {what} took longer than --timeout {timeout:g} s.") from e
    if proc.returncode != 0 or not os.path.exists(out_path):
      tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
      killed = " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
      raise MeasurementFailed(f"Measuring {what} failed with exit status "
                              f"{proc.returncode}{killed}:\n{tail}")
    with open(out_path, encoding="utf-8") as f:
      result = json.load(f)
  if "error" in result:
    raise MeasurementFailed(f"Measuring {what}: {result['error']}")
  return result


# ---------------------------------------------------------------------------------------------
# The report.


def environment(threads: int) -> dict[str, Any]:
  """Versions, CPU, core and thread counts, XLA_FLAGS: what the figures depend on."""
  versions = {}
  for package in ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "timm"):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  cpu: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        if not line.strip():
          break  # The first processor is enough.
        key, _, value = line.partition(":")
        cpu[key.strip()] = value.strip()
  except OSError:
    pass
  memory_gib = None
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      memory_gib = round(int(f.readline().split()[1]) / 2**20, 1)  # MemTotal, KiB.
  except (OSError, ValueError, IndexError):
    pass
  simd = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
  cpu_features = [flag for flag in cpu.get("flags", "").split() if flag in simd]
  cpu_model = cpu.get("model name") or platform.processor() or None
  available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return {"python": platform.python_version(), "platform": platform.platform(),
          "versions": versions, "cpu_model": cpu_model, "cpu_family": cpu.get("cpu family"),
          "cpu_model_number": cpu.get("model"), "cpu_features": cpu_features,
          "memory_gib": memory_gib, "cpu_count": os.cpu_count(),
          "available_cores": available, "threads": threads,
          "jax_cpu_threads": f"NPROC={threads} (the size of XLA's CPU thread pool), "
                             + (f"pinned to {threads} of {available} cores" if threads < available
                                else f"all {available} cores"),
          "torch_threads": f"torch.set_num_threads({threads}), OMP_NUM_THREADS={threads}",
          "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
          "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}


def _measured_on(results: list[dict[str, Any]]) -> dict[str, Any]:
  """Where each framework ran, from its first result: device and threads."""
  out = {}
  for r in results:
    if r["framework"] not in out:
      out[r["framework"]] = {k: r.get(k) for k in ("platform", "device_kind", "num_devices",
                                                   "threads", "torchvision_ops") if k in r}
  return out


def _aggregate(rounds: list[dict[str, Any]]) -> dict[str, Any]:
  """One result from several rounds of the same configuration: medians of `_MEDIAN_KEYS`."""
  merged = dict(rounds[0])
  for key in _MEDIAN_KEYS:
    values = [r[key] for r in rounds if r.get(key) is not None]
    merged[key] = statistics.median(values) if values else None
  merged["step_seconds_all"] = [t for r in rounds for t in r.get("step_seconds_all", [])]
  merged["rounds"] = [{k: r.get(k) for k in _MEDIAN_KEYS} for r in rounds]
  return merged


def _comparisons(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
  out = []
  by_key = {(r["model"], r["mode"], r["framework"]): r for r in results}
  for (model, mode, framework), ours in by_key.items():
    theirs = by_key.get((model, mode, "timm"))
    if framework != "ours" or theirs is None:
      continue
    ratio = lambda a, b: a / b if a and b else None
    out.append({
        "model": model, "timm_model": theirs["timm_model"], "timm_label": _timm_label(theirs), "mode": mode,
        "ours_images_per_sec": ours["images_per_sec"],
        "timm_images_per_sec": theirs["images_per_sec"],
        "images_per_sec_ratio": ratio(ours["images_per_sec"], theirs["images_per_sec"]),
        "ours_peak_rss_mib": ours["peak_rss_mib"], "timm_peak_rss_mib": theirs["peak_rss_mib"],
        "peak_rss_ratio": ratio(ours["peak_rss_mib"], theirs["peak_rss_mib"]),
        "ours_device_peak_mib": ours["device_peak_mib"],
        "timm_device_peak_mib": theirs["device_peak_mib"],
    })
  return out


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
  """`value * scale` in `spec`; spec 'sig' is 3 significant digits without an exponent."""
  if value is None:
    return "-"
  value *= scale
  if spec != "sig":
    return format(value, spec)
  if value == 0 or abs(value) >= 100:
    return f"{value:,.0f}"
  digits = 2 - int(math.floor(math.log10(abs(value))))
  return f"{value:.{digits}f}"


def _timm_label(result: dict[str, Any]) -> str:
  return result["timm_model"] + ("*" if result.get("timm_kwargs") else "")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(headers)]
  line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths)))
  return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_report(report: dict[str, Any]) -> str:
  """The stdout table of a `run` report: one row per model, framework and mode, then the
  ratios ours / timm, then the notes."""
  headers = ["model", "framework", "mode", "images/s", "step s", "lower s", "compile s",
             "1st step s", "peak RSS MiB", "dev peak MiB", "GFLOPs XLA", "GFLOPs analytic",
             "GFLOP/s", "% of peak"]
  rows = []
  for r in report["results"]:
    name = r["model"] if r["framework"] == "ours" else f"{r['model']} ({_timm_label(r)})"
    rows.append([name, r["framework"], r["mode"], _fmt(r.get("images_per_sec"), "sig"),
                 _fmt(r.get("step_seconds"), "sig"), _fmt(r.get("lower_seconds"), "sig"),
                 _fmt(r.get("compile_seconds"), "sig"), _fmt(r.get("first_step_seconds"), "sig"),
                 _fmt(r.get("peak_rss_mib"), ".0f"), _fmt(r.get("device_peak_mib"), ".0f"),
                 _fmt(r.get("flops_per_step_xla"), "sig", 1e-9),
                 _fmt(r.get("flops_per_step_analytic"), "sig", 1e-9),
                 _fmt(r.get("achieved_flops_per_sec"), "sig", 1e-9),
                 _fmt(r.get("fraction_of_peak"), ".1f", 100)])
  args = report["args"]
  env = report["environment"]
  timing = ("compile only, nothing run" if args["compile_only"] else
            f"medians of {args['steps']} timed step(s) after {args['warmup']} warm-up step(s)"
            + (f", over {args['rounds']} rounds" if args["rounds"] > 1 else ""))
  parts = [f"batch {args['batch']}, {args['resolution']}x{args['resolution']} px, "
           f"{args['dtype']}, {env['threads']} thread(s) on {env['available_cores']} core(s) "
           f"({env['cpu_model']}); {timing}"]
  if rows:
    parts.append(_table(headers, rows))
  if report.get("inputs"):
    train = [r["images_per_sec"] for r in report["results"]
             if r["mode"] == "train" and r["framework"] == "ours" and r.get("images_per_sec")]
    headers = ["input pipeline", "augment", "images/s", "peak RSS MiB"]
    if train:
      headers.append("x our fastest training step")
    rows = []
    for r in report["inputs"]:
      rows.append([INPUT_LABELS[r["input"]], r["augment"], _fmt(r["images_per_sec"], "sig"),
                   _fmt(r["peak_rss_mib"], ".0f")]
                  + ([_fmt(r["images_per_sec"] / max(train), ".1f")] if train else []))
    parts += ["The training input pipeline alone (vit_jax.data, same batch, resolution and "
              "threads" + ("; > 1x: it is not the bottleneck):" if train else "):"),
              _table(headers, rows)]
  if report["comparisons"]:
    headers = ["model", "timm model", "mode", "ours images/s", "timm images/s", "ratio",
               "ours peak RSS MiB", "timm peak RSS MiB", "ratio"]
    rows = [[c["model"], c["timm_label"], c["mode"], _fmt(c["ours_images_per_sec"], "sig"),
             _fmt(c["timm_images_per_sec"], "sig"), _fmt(c["images_per_sec_ratio"], ".2f"),
             _fmt(c["ours_peak_rss_mib"], ".0f"), _fmt(c["timm_peak_rss_mib"], ".0f"),
             _fmt(c["peak_rss_ratio"], ".2f")] for c in report["comparisons"]]
    parts += ["Ours / timm (ratio > 1: ours has more images/s, or more memory):",
              _table(headers, rows)]
  if report["notes"]:
    parts.append("\n".join(f"Note: {n}" for n in report["notes"]))
  return "\n\n".join(parts)


def run(models_: Sequence[str], *, batch: int = 8, resolution: int = 224,
        dtype: str = "float32", modes: Sequence[str] = MODES, warmup: int = 2, steps: int = 5,
        overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
        threads: Optional[int] = None, compare: Optional[str] = None, rounds: int = 1,
        compile_only: bool = False, timeout: Optional[float] = None,
        inputs: Sequence[str] = (), progress=None) -> dict[str, Any]:
  """Measures every model and mode (and timm's, with compare='timm') in fresh subprocesses.

  `inputs` (names in INPUTS) also measures the training input pipeline alone
  (`measure_input`, one subprocess each, same batch, resolution and threads).

  Returns:
    The report: 'args', 'environment', 'results' (medians over rounds; each round's figures
    under 'rounds'), 'comparisons' (ours / timm), 'inputs', 'notes', 'units'.

  Raises:
    BenchmarkError: bad input (checked before anything runs); MeasurementFailed.
  """
  overrides = dict(overrides or {})
  _check_sizes(batch, resolution, warmup, steps)
  if rounds < 1:
    raise BenchmarkError(f"rounds must be >= 1, got {rounds}.")
  if num_classes < 1:
    raise BenchmarkError(f"num_classes must be >= 1, got {num_classes}.")
  if dtype not in DTYPES:
    raise BenchmarkError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
  available = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else list(range(os.cpu_count() or 1)))
  threads = threads or len(available)
  if threads > len(available):
    raise BenchmarkError(f"--threads {threads} is more than the {len(available)} core(s) this "
                         "process may use.")
  if compare not in (None, "timm"):
    raise BenchmarkError(f"--compare {compare!r}: only 'timm' is supported.")
  from vit_jax.models import fused_attention  # pylint: disable=g-import-not-at-top
  try:
    fused_attention.enabled()
  except ValueError as e:  # VIT_JAX_FUSED_ATTENTION is neither on nor off.
    raise BenchmarkError(str(e)) from e
  if compare and compile_only:
    raise BenchmarkError("--compile-only measures only our compilation; drop --compare timm.")
  if compare:
    missing = _missing_bench_packages()
    if missing:
      raise BenchmarkError(f"--compare timm needs {' and '.join(missing)}, which "
                           f"{'is' if len(missing) == 1 else 'are'} not installed: "
                           "pip install -e '.[bench]' (torch, timm).")
  from vit_jax import flops, models  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  notes, plans = [], []
  for model in models_:
    model_fields(model, overrides, dtype)
    net = models.create(model, num_classes=num_classes,
                        **dict(training_overrides(model, overrides), dtype=jnp.dtype(dtype)))
    try:  # Traced with abstract shapes: a resolution the model cannot take fails here.
      macs = flops.model_forward_macs(net, (resolution, resolution, 3))
    except ValueError as e:
      raise BenchmarkError(f"{model} at {resolution}x{resolution} px: {e}") from e
    with_timm = False
    if compare:
      try:
        timm_equivalent(model, overrides)
        with_timm = True
      except NoTimmModel as e:
        notes.append(str(e))
    plans.append((model, macs, with_timm))
  if any(model_fields(m, overrides, dtype).get("scan") for m in models_):
    notes.append("scan=True: XLA's cost analysis counts the scanned layer body once, so "
                 "'GFLOPs XLA' is far below the analytic count; the utilisation uses the "
                 "analytic count.")

  cores = available[:threads] if threads < len(available) else None
  peak = {"flops": None, "platform": "cpu"}
  results = []
  for model, macs, with_timm in plans:
    for mode in modes:
      analytic = (3 if mode == "train" else 1) * 2 * macs * batch
      per_framework: dict[str, list[dict[str, Any]]] = {"ours": [], "timm": []}
      for round_ in range(rounds):
        order = ["ours", "timm"] if with_timm else ["ours"]
        if round_ % 2:
          order.reverse()
        if peak["flops"] is None and "ours" in order:  # Ours first: it measures the peak.
          order.sort(key=lambda f: f != "ours")
        for framework in order:
          spec = dict(framework=framework, model=model, batch=batch, resolution=resolution,
                      dtype=dtype, mode=mode, warmup=warmup, steps=steps, overrides=overrides,
                      num_classes=num_classes, compile_only=compile_only,
                      peak_flops=peak["flops"], threads=threads, cores=cores,
                      analytic_flops=float(analytic), device=peak["platform"])
          if progress:
            progress(f"[{model} {mode}] {'ours' if framework == 'ours' else 'timm'}, round "
                     f"{round_ + 1}/{rounds} ...")
          result = run_in_subprocess(spec, timeout)
          if framework == "ours" and peak["flops"] is None:
            peak.update(flops=result["peak_flops_per_device"], platform=result["platform"])
          per_framework[framework].append(result)
      results += [_aggregate(r) for r in per_framework.values() if r]
  input_results = []
  for source in inputs:
    if source not in INPUTS:
      raise BenchmarkError(f"input must be one of {INPUTS}, got {source!r}.")
    if progress:
      progress(f"[input pipeline] {source} ...")
    input_results.append(run_in_subprocess(
        dict(framework="input", source=source, batch=batch, resolution=resolution,
             threads=threads, cores=cores), timeout))
  if compile_only:
    notes.append("--compile-only: the step was lowered and compiled on abstract shapes, not "
                 "run; peak RSS is the compilation's.")
  if any(r.get("timm_kwargs") for r in results):
    notes.append("timm model*: created with keyword arguments for the architecture or dropout "
                 "that differ from the named model ('timm_kwargs' in the JSON).")
  if any(r.get("torchvision_ops") is False for r in results):
    notes.append("torchvision's C++ ops did not load next to this torch (a mismatched wheel); "
                 "timm's ViT does not use them (see _import_timm).")
  cores_used = sorted({r["attention_core"] for r in results if r.get("attention_core")})
  if "fused CPU kernel" in cores_used:
    notes.append("attention (ours): vit_jax's fused CPU kernel (vit_jax.models.fused_attention; "
                 "VIT_JAX_FUSED_ATTENTION=0 measures XLA's instead). Its products are in the "
                 "analytic count, not in 'GFLOPs XLA' (XLA cannot see into a custom call).")
  elif cores_used and results[0].get("platform") == "cpu":
    notes.append(f"attention (ours): XLA's; the fused CPU kernel is {fused_attention.status()}.")
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  timm_too = ", timm's processes too" if any(r["framework"] == "timm" for r in results) else ""
  notes.append(f"malloc: huge pages for large allocations (GLIBC_TUNABLES={tunables}{timm_too})."
               if "glibc.malloc.hugetlb=1" in tunables else
               f"malloc: no huge pages (GLIBC_TUNABLES={tunables or 'unset'}{timm_too}): "
               "VIT_JAX_HUGE_PAGES=0, a glibc.malloc.hugetlb of your own, or not supported here.")
  if peak["platform"] == "cpu" and peak["flops"]:
    notes.append(f"CPU peak: {peak['flops'] / 1e9:.0f} GFLOP/s, XLA's own float32 2048^3 "
                 "matmul (for bfloat16 too) measured once in this run (it moves with the "
                 "machine's load); a faster GEMM library can exceed 100%."
                 + (" timm's rows use the same peak and our analytic FLOPs."
                    if any(r["framework"] == "timm" for r in results) else ""))
  return {
      "benchmark": "vit_jax.benchmark",
      "args": {"models": list(models_), "batch": batch, "resolution": resolution,
               "dtype": dtype, "modes": list(modes), "warmup": warmup, "steps": steps,
               "overrides": overrides, "num_classes": num_classes, "threads": threads,
               "compare": compare, "rounds": rounds, "compile_only": compile_only,
               "inputs": list(inputs)},
      "environment": dict(environment(threads), measured_on=_measured_on(results)),
      "results": results, "comparisons": _comparisons(results), "inputs": input_results,
      "notes": notes,
      "units": UNITS,
  }


# ---------------------------------------------------------------------------------------------
# Command line.


class _Parser(argparse.ArgumentParser):
  """argparse that reports a bad flag in one line (exit 2) instead of usage + error."""

  def error(self, message):
    raise BenchmarkError(f"{message} (python -m vit_jax.benchmark --help lists the flags)")


def _int_at_least(least: int):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
      raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
    return value
  parse.__name__ = "integer"
  return parse


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="python -m vit_jax.benchmark", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("models", nargs="*", metavar="MODEL",
                      help="model names of vit_jax.models, e.g. ViT-B_16, ViT-Ti_16, ViT-S_16, "
                           "T2T-ViT-14, ViT-custom (with --override for its sizes)")
  parser.add_argument("--batch", type=_int_at_least(1), default=8,
                      help="images per step (default 8)")
  parser.add_argument("--resolution", type=_int_at_least(1), default=224,
                      help="square image side in pixels; the patch size must divide it "
                           "(T2T-ViT: any side the three soft splits accept) (default 224)")
  parser.add_argument("--dtype", choices=DTYPES, default="float32",
                      help="compute dtype; parameters stay float32 (timm: torch.autocast for "
                           "bfloat16) (default float32)")
  parser.add_argument("--mode", choices=(*MODES, "both"), default="both",
                      help="train: forward + backward + AdamW update; inference: forward only; "
                           "both (default)")
  parser.add_argument("--warmup", type=_int_at_least(0), default=2,
                      help="untimed steps after the first execution (default 2)")
  parser.add_argument("--steps", type=_int_at_least(1), default=5,
                      help="timed steps; images/s uses their median (default 5)")
  parser.add_argument("--threads", type=_int_at_least(1), default=None,
                      help="cores / threads for both frameworks (default: all cores this "
                           "process may use); see 'Threads' above")
  parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="a model field, repeatable: e.g. --override scan=False, "
                           "--override num_layers=4 (values are Python literals)")
  parser.add_argument("--num-classes", type=_int_at_least(1), default=1000,
                      help="classes of the head (default 1000)")
  parser.add_argument("--compare", choices=("timm",), default=None,
                      help="also measure timm's equivalent model (needs the 'bench' extra: "
                           "pip install -e '.[bench]')")
  parser.add_argument("--rounds", type=_int_at_least(1), default=None,
                      help="rounds of fresh processes per configuration; the frameworks "
                           "alternate and medians over rounds are reported (default 3 with "
                           "--compare, else 1)")
  parser.add_argument("--compile-only", action="store_true",
                      help="only lower and compile our step on abstract shapes (no memory for "
                           "parameters; for compile times of large models)")
  parser.add_argument("--timeout", type=float, default=3600.0,
                      help="seconds one measuring process may take (default 3600)")
  parser.add_argument("--input-pipeline", action="store_true",
                      help="also measure the training input pipeline alone (images/s of "
                           "vit_jax.data with Inception crop at --resolution): Fashion-MNIST "
                           "(offline builder) and a generated folder of 500x375 JPEGs")
  parser.add_argument("--json", metavar="PATH", default=None,
                      help="also write the report (results, ratios, environment, units) as JSON")
  parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; returns the exit status (0, 1 measurement failed, 2 bad input)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    args = _parser().parse_args(argv)
    if args.worker:
      return _worker(*args.worker)
    if not args.models and not args.input_pipeline:
      raise BenchmarkError("Name at least one model, e.g. python -m vit_jax.benchmark ViT-B_16 "
                           "(or measure only the input pipeline: --input-pipeline)")
    overrides = dict(parse_override(o) for o in args.override)
    modes = MODES if args.mode == "both" else (args.mode,)
    rounds = args.rounds or (3 if args.compare else 1)
    if args.json:
      directory = os.path.dirname(os.path.abspath(args.json))
      if not os.path.isdir(directory):
        raise BenchmarkError(f"--json {args.json}: the directory {directory} does not exist.")
    report = run(args.models, batch=args.batch, resolution=args.resolution, dtype=args.dtype,
                 modes=modes, warmup=args.warmup, steps=args.steps, overrides=overrides,
                 num_classes=args.num_classes, threads=args.threads, compare=args.compare,
                 rounds=rounds, compile_only=args.compile_only, timeout=args.timeout,
                 inputs=INPUTS if args.input_pipeline else (),
                 progress=lambda m: print(m, file=sys.stderr, flush=True))
  except BenchmarkError as e:
    print(f"vit_jax.benchmark: error: {e}", file=sys.stderr)
    return 2
  except MeasurementFailed as e:
    print(f"vit_jax.benchmark: {e}", file=sys.stderr)
    return 1
  print(format_report(report))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
    print(f"\nWrote {args.json}")
  return 0


def _cli() -> None:
  if "--worker" not in sys.argv:
    # As vit_jax.main trains; the measuring subprocesses, timm's too, inherit the environment.
    from vit_jax import cli  # pylint: disable=g-import-not-at-top
    cli.reexec_with_huge_pages()
    # The parent only traces shapes to check the input: keep it off any accelerator (the
    # measuring subprocesses use the default backend).
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_platforms", "cpu")
  sys.exit(main())


if __name__ == "__main__":
  _cli()
