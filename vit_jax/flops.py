"""Analytic compute of the ViT: multiply-adds of a forward pass, and what a training run costs.

The ViT paper compares models by pretraining cost in TPUv3-core-days (cores x days; Table 2).
This module counts the matrix work of the model by hand, so that a run's cost can be predicted
before it starts, and reproduces the compute column of Table 2 (REFERENCE.md section 4): given
the reported core-days it shows the model FLOP utilisation (MFU) each figure implies.

Conventions: one multiply-add (MAC) = 2 FLOPs; training costs 3 forward passes (the backward
pass is about twice the forward: gradients with respect to activations and to weights); only the
matrix products are counted (embedding, q/k/v/out projections, the two attention products, MLP,
pre_logits, head), as is usual; LayerNorm, softmax, GELU and additions are a few percent more.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

SECONDS_PER_DAY = 86_400

#: Peak dense bfloat16 FLOP/s of one TPU v3 core (123 TFLOP/s per chip of 2 cores).
TPU_V3_CORE_PEAK_FLOPS = 61.5e12


def vit_forward_macs(*, hidden_size: int, mlp_dim: int, num_layers: int, patch_size: int,
                     image_size: int | Tuple[int, int], num_classes: int = 1000,
                     classifier: str = "token", representation_size: Optional[int] = None,
                     channels: int = 3) -> int:
  """Multiply-adds of one image's forward pass through a plain ViT (matrix products only).

  Per image, with N patches of P x P x C pixels, T = N (+1 with a class token) tokens, hidden
  size D, MLP size M and L layers:
    embedding N P^2 C D; per layer 4 T D^2 (q, k, v, out) + 2 T^2 D (q k^T and attention x v)
    + 2 T D M (MLP); pre_logits D R; head (R or D) x classes.

  Returns:
    MACs (int); FLOPs are twice that. ViT-B/16 at 224 px: 17.56 G MACs (35.1 GFLOPs).

  Raises:
    ValueError: an image side the patch size does not divide.
  """
  height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
  if height % patch_size or width % patch_size:
    raise ValueError(f"Image {height}x{width} is not divisible by the patch size {patch_size}.")
  patches = (height // patch_size) * (width // patch_size)
  tokens = patches + (1 if classifier == "token" else 0)
  d = hidden_size
  embedding = patches * patch_size * patch_size * channels * d
  per_layer = 4 * tokens * d * d + 2 * tokens * tokens * d + 2 * tokens * d * mlp_dim
  features = representation_size or d
  pre_logits = d * representation_size if representation_size else 0
  return embedding + num_layers * per_layer + pre_logits + features * num_classes


def training_flops(forward_macs: int, images: float) -> float:
  """FLOPs of training on `images` examples: 3 forward passes (forward + backward), 2 per MAC."""
  return 3 * 2 * forward_macs * images


def implied_mfu(flops: float, core_days: float,
                peak_flops_per_core: float = TPU_V3_CORE_PEAK_FLOPS) -> float:
  """The model FLOP utilisation that doing `flops` in `core_days` means (0..1)."""
  return flops / (core_days * SECONDS_PER_DAY * peak_flops_per_core)


def core_days(flops: float, mfu: float,
              peak_flops_per_core: float = TPU_V3_CORE_PEAK_FLOPS) -> float:
  """Core-days `flops` take at utilisation `mfu` (the estimate before a run)."""
  return flops / (mfu * SECONDS_PER_DAY * peak_flops_per_core)


@dataclasses.dataclass(frozen=True)
class PaperRun:
  """One pretraining run of the ViT paper's Table 2 (REFERENCE.md section 4)."""
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
    return implied_mfu(self.flops, self.reported_core_days)


#: ViT paper Table 2: ImageNet-21k has 14M images (21,843 classes), JFT-300M 303M (18,291).
TABLE2: Sequence[PaperRun] = (
    PaperRun("ViT-L/16", "ImageNet-21k", 90, 14e6, 21_843, 230, 1024, 4096, 24, 16),
    PaperRun("ViT-L/16", "JFT-300M", 7, 303e6, 18_291, 680, 1024, 4096, 24, 16),
    PaperRun("ViT-H/14", "JFT-300M", 14, 303e6, 18_291, 2500, 1280, 5120, 32, 14),
)


def table2_markdown() -> str:
  """The Table 2 reproduction as a Markdown table (for README.md)."""
  lines = ["| model | data | epochs | forward GFLOPs/image | training FLOPs | reported "
           "TPUv3-core-days | implied MFU |", "|---|---|---|---|---|---|---|"]
  for run in TABLE2:
    lines.append(f"| {run.model} | {run.dataset} | {run.epochs:g} | "
                 f"{2 * run.forward_macs / 1e9:.1f} | {run.flops:.2e} | "
                 f"{run.reported_core_days / 1000:g}k | {run.mfu:.0%} |")
  return "\n".join(lines)
