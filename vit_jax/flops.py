"""Analytic compute (docs/compute_cost.md): multiply-adds (MACs, 2 FLOPs each) of a forward pass's
matrix products (LayerNorm, softmax, GELU, additions: a few percent more, not counted), training
as 3 forward passes, and the ViT paper's Table 2 with the MFU each figure implies."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Tuple

from absl import logging
import flax.linen as nn
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp

from vit_jax import hardware
from vit_jax import kernels
from vit_jax import models

SECONDS_PER_DAY = 86_400

#: Peak dense bfloat16 FLOP/s of one TPU v3 core (`vit_jax.hardware`).
TPU_V3_CORE_PEAK_FLOPS = hardware.kind("TPU v3").peak["bfloat16"]


#: The figures `compiled_cost` reads from XLA's cost analysis ('optimal_seconds': TPU only).
COST_KEYS = ("flops", "bytes accessed", "optimal_seconds")


#: Custom calls that libtpu's cost model prices at -1 seconds ("unknown") and that cost nothing:
#: ConcatBitcast joins slices already laid out side by side (their copies are priced).
UNPRICED_CUSTOM_CALLS = ("ConcatBitcast",)


def compiled_cost(compiled: Any) -> dict[str, float]:
  """XLA's cost analysis of one device's share of a compiled program (``jax.stages.Compiled``):
  the `COST_KEYS` it gives as positive figures (`UNPRICED_CUSTOM_CALLS`' -1 s added back). A
  while loop's body (a `scan`) counts once."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # Older jax.
    cost = cost[0] if cost else None
  found = {key: float(cost[key]) for key in COST_KEYS if cost and cost.get(key) is not None}
  if found.get("optimal_seconds", 1.0) < 0:
    text = compiled.as_text()
    found["optimal_seconds"] += sum(text.count(f'custom_call_target="{target}"')
                                    for target in UNPRICED_CUSTOM_CALLS)
  return {key: value for key, value in found.items() if value > 0}


def compiled_flops(compiled: Any) -> Optional[float]:
  """XLA's FLOP count of `compiled_cost`, None where XLA gives none (e.g. custom calls)."""
  return compiled_cost(compiled).get("flops")


def vit_forward_macs(*, hidden_size: int, mlp_dim: int, num_layers: int, patch_size: int,
                     image_size: int | Tuple[int, int], num_classes: int = 1000,
                     classifier: str = "token", representation_size: Optional[int] = None,
                     channels: int = 3, num_registers: int = 0) -> int:
  """MACs of one image's forward pass through a plain ViT (docs/compute_cost.md).

  N patches of P x P x C, T tokens (N, the class token with 'token', the ``num_registers``
  registers), width D, MLP M: embedding N P^2 C D; per layer 4 T D^2 + 2 T^2 D + 2 T D M;
  'map' over the patches (the model's MAPHead_0 is given the N patches only) 2 D^2 + 2 N D^2 +
  2 N D + 2 D M; pre_logits D R; head (R or D) x classes. LayerScale and fc_norm multiply
  elementwise: no MACs. ValueError: an unknown classifier, negative registers; ImageSizeError: a
  side the patch does not divide."""
  if classifier not in ("token", "gap", "map"):
    raise ValueError(f"classifier must be 'token', 'gap' or 'map', got {classifier!r}.")
  if num_registers < 0:
    raise ValueError(f"num_registers must be 0 or more, got {num_registers}.")
  height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
  if height % patch_size or width % patch_size:
    raise models.ImageSizeError(
        f"Image {height}x{width} is not divisible by the patch size {patch_size}.")
  patches = (height // patch_size) * (width // patch_size)
  tokens = patches + models.vit.prefix_tokens(
      dict(classifier=classifier, num_registers=num_registers))
  d = hidden_size
  embedding = patches * patch_size * patch_size * channels * d
  per_layer = 4 * tokens * d * d + 2 * tokens * tokens * d + 2 * tokens * d * mlp_dim
  pooling = (2 * d * d + 2 * patches * d * d + 2 * patches * d + 2 * d * mlp_dim
             if classifier == "map" else 0)
  features = representation_size or d
  pre_logits = d * representation_size if representation_size else 0
  return embedding + num_layers * per_layer + pooling + pre_logits + features * num_classes


def jaxpr_macs(jaxpr: jax_core.Jaxpr) -> int:
  """MACs of a jaxpr's `dot_general`s, convolutions and vit_jax kernel calls (`ffi_call`), nested
  jaxprs included; a `scan` body counts `length` times (XLA's cost analysis counts it once)."""
  total = 0
  for eqn in jaxpr.eqns:
    out_size = math.prod(eqn.outvars[0].aval.shape) if eqn.outvars else 0
    if eqn.primitive.name == "dot_general":
      (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
      lhs_shape = eqn.invars[0].aval.shape
      total += out_size * math.prod(lhs_shape[d] for d in lhs_contracting)
    elif eqn.primitive.name == "ffi_call":
      target = eqn.params.get("target_name")
      total += sum(k.macs(target, eqn.invars[0].aval.shape) for k in kernels.ATTENTION
                   if target in k.TARGETS)
    elif eqn.primitive.name == "conv_general_dilated":
      kernel_shape = eqn.invars[1].aval.shape
      kernel_spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial) positions.
      total += out_size * kernel_shape[kernel_spec[1]] * math.prod(
          kernel_shape[d] for d in kernel_spec[2:])
    repeats = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for param in eqn.params.values():
      subs = param if isinstance(param, (list, tuple)) else (param,)
      for sub in subs:
        if isinstance(sub, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
          inner = sub.jaxpr if isinstance(sub, jax_core.ClosedJaxpr) else sub
          total += repeats * jaxpr_macs(inner)
  return total


def model_forward_macs(model: Any, image_shape: Tuple[int, int, int]) -> int:
  """MACs of one `(H, W, C)` image's forward pass through a model of `vit_jax.models`, traced
  abstractly. Raises as the model's apply."""
  images = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
  variables = nn.unbox(jax.eval_shape(
      lambda x: model.init(jax.random.key(0), x, train=False), images))
  closed = jax.make_jaxpr(lambda v, x: model.apply(v, x, train=False))(variables, images)
  return jaxpr_macs(closed.jaxpr)


def training_flops(forward_macs: int, images: float) -> float:
  """FLOPs of training on `images` examples: 3 forward passes (forward + backward), 2 per MAC."""
  return 3 * 2 * forward_macs * images


def step_flops(compiled: Any, model: Any, image_shape: Tuple[int, int, int], num_devices: int,
               batch_size: int) -> Tuple[Optional[float], float]:
  """A training step's FLOPs (global batch of `batch_size`), logged: XLA's of the `compiled`
  step on `num_devices` (None: unavailable) and the analytic count, which the MFU uses."""
  per_device = compiled_flops(compiled)
  counted = per_device * num_devices if per_device else None
  analytic = training_flops(model_forward_macs(model, image_shape), batch_size)
  ratio = f"{counted / analytic:.3f}" if counted else "n/a"
  shown = f"{counted:.4g}" if counted else "unavailable"
  logging.info("FLOPs per training step: %s by XLA's cost analysis, %.4g analytic (3 x the "
               "forward matmuls); ratio %s. MFU uses the analytic count.",
               shown, analytic, ratio)
  if counted and not 0.97 <= counted / analytic <= 1.15:
    logging.info("The counts differ: XLA counts a loop body once (scan over layers, gradient "
                 "accumulation) and counts rematerialised work; the analytic count is the "
                 "model's useful work.")
  return counted, analytic


def core_days(flops: float, mfu: float,
              peak_flops_per_core: float = TPU_V3_CORE_PEAK_FLOPS) -> float:
  """Core-days `flops` take at utilisation `mfu` (the estimate before a run)."""
  return flops / (mfu * SECONDS_PER_DAY * peak_flops_per_core)


@dataclasses.dataclass(frozen=True)
class PaperRun:
  """One pretraining run of the ViT paper's Table 2."""
  model: str
  dataset: str
  epochs: float
  examples: float
  num_classes: int
  reported_core_days: float
  hidden_size: int
  mlp_dim: int
  num_layers: int
  patch_size: int
  image_size: int = 224

  @property
  def forward_macs(self) -> int:
    """Pretraining has a representation layer of size D (paper Sec. 4.1)."""
    return vit_forward_macs(hidden_size=self.hidden_size, mlp_dim=self.mlp_dim,
                            num_layers=self.num_layers, patch_size=self.patch_size,
                            image_size=self.image_size, num_classes=self.num_classes,
                            representation_size=self.hidden_size)

  @property
  def flops(self) -> float:
    return training_flops(self.forward_macs, self.epochs * self.examples)

  @property
  def mfu(self) -> float:
    """The model FLOP utilisation (0..1) that the reported core-days imply."""
    return core_days(self.flops, 1.0) / self.reported_core_days


#: ViT paper Table 2: ImageNet-21k has 14M images (21,843 classes), JFT-300M 303M (18,291).
TABLE2: Sequence[PaperRun] = (
    PaperRun("ViT-L/16", "ImageNet-21k", 90, 14e6, 21_843, 230, 1024, 4096, 24, 16),
    PaperRun("ViT-L/16", "JFT-300M", 7, 303e6, 18_291, 680, 1024, 4096, 24, 16),
    PaperRun("ViT-H/14", "JFT-300M", 14, 303e6, 18_291, 2500, 1280, 5120, 32, 14),
)


def table2_markdown() -> str:
  """The Table 2 reproduction as a Markdown table (for docs/compute_cost.md)."""
  return "\n".join(["| model | data | epochs | forward GFLOPs/image | training FLOPs | reported "
                    "TPUv3-core-days | implied MFU |", "|---|---|---|---|---|---|---|"] + [
      f"| {run.model} | {run.dataset} | {run.epochs:g} | {2 * run.forward_macs / 1e9:.1f} | "
      f"{run.flops:.2e} | {run.reported_core_days / 1000:g}k | {run.mfu:.0%} |" for run in TABLE2])
