"""How the blocks run, chosen once from the devices the step is compiled for: the attention
implementation and the remat policy.

The models take the implementation as a field (`attention='xla' | 'cudnn' | 'cpu_kernel'`,
see `vit_jax.models.attention`) and never look at the machine. `choose_attention` turns a
config's request ('auto' or one of those) into that field from the *target* devices (their
platform and count), not from the host that traces the step: a step lowered on a CPU host for a
TPU mesh gets the TPU's choice.

'auto' picks
  TPU             'xla'
  GPU             'cudnn' (cuDNN's fused attention through `jax.nn.dot_product_attention`) for
                  bfloat16/float16 compute without attention dropout; else 'xla'
  CPU, 1 device   'cpu_kernel' (vit_jax's fused kernel, `vit_jax.kernels.cpu_attention`) when
                  it is built, the compute is float32, the head size a multiple of 16, there is
                  no attention dropout, and the kernel is faster than XLA's attention on this
                  CPU's instruction set (`cpu_attention.faster_than_xla`); else 'xla'
  CPU, several    'xla' (XLA's SPMD partitioner cannot split the kernel's custom call)
so it never picks something slower than XLA's attention where that is known.

`choose_remat_policy` turns `remat_policy='auto'` into what a rematerialised block keeps for the
backward pass (`vit_jax.models.execution.REMAT_POLICIES`). On accelerators it goes by the
compute dtype's bytes, doubled for models of width D >= 1024 (ViT-L, H, g, G), so that the step
needs at most 0.8 times the per-device memory of the official unrematerialised model at the
same batch (measured with the pre-flight for ViT-B/16 and ViT-L/16; docs/pods.md):
  TPU, GPU   2 (bfloat16/float16, D < 1024): 'dots_and_attention_saveable' (all the dense
             projections' outputs: only LayerNorm, softmax and GELU are recomputed)
             4 (float32 D < 1024, or 16-bit D >= 1024): 'qkv_saveable' (only the attention's
             query, key and value: about a seventh more FLOPs per step)
             8 (float32, D >= 1024): 'nothing_saveable' (each block's input: a third more)
  CPU        'dots_and_attention_saveable' (memory is the host's; the fused kernel's outputs
             kept too)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp

from vit_jax.kernels import cpu_attention
from vit_jax.models import attention as attention_lib
from vit_jax.models import execution

#: What `choose_attention` accepts: 'auto' or a concrete implementation.
CHOICES = ("auto",) + attention_lib.IMPLEMENTATIONS
#: What `choose_remat_policy` accepts: 'auto' or a policy name.
REMAT_CHOICES = ("auto",) + execution.REMAT_POLICIES


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation for the models' `attention` field, and why, for logs and reports."""
  implementation: str
  reason: str


def _why_not_cpu_kernel(devices: Sequence[Any], dtype: str, head_dim: int,
                        dropout: bool) -> str:
  """'' when the CPU kernel can run for these targets, else the reason it cannot."""
  platform = devices[0].platform
  if platform != "cpu":
    return f"the devices are {platform.upper()}s, the kernel is for XLA:CPU"
  if len(devices) > 1:
    return (f"the step runs on {len(devices)} devices and XLA's SPMD partitioner cannot split "
            "the kernel's custom call")
  if jnp.dtype(dtype) != jnp.float32:
    return f"the compute dtype is {jnp.dtype(dtype).name}, the kernel is float32 only"
  if head_dim % 16:
    return f"the head size {head_dim} is not a multiple of 16"
  if dropout:
    return "attention dropout is on (the kernel has none)"
  path, reason = cpu_attention.library()
  return "" if path else reason


def choose_attention(requested: str, *, devices: Sequence[Any], dtype: Any = "float32",
                     head_dim: int, dropout: bool = False) -> Choice:
  """The attention implementation for a step compiled for `devices`.

  Args:
    requested: 'auto', or 'xla', 'cudnn', 'cpu_kernel' to insist on one.
    devices: the target devices (e.g. `mesh.devices.flat`, or a TPU topology's devices).
    dtype: the models' compute dtype.
    head_dim: the backbone attention's head size (`vit_jax.models.head_dim`).
    dropout: whether attention dropout is on in training (`attention_dropout_rate > 0`).

  Returns:
    A `Choice`: the implementation and the reason in a few words.

  Raises:
    ValueError: an unknown request, no devices, or a requested implementation that cannot run
      on these devices for this model (the message says why and what to use instead).
  """
  if requested not in CHOICES:
    raise ValueError(f"config.model.attention={requested!r} is not one of {CHOICES} ('auto' "
                     "picks from the devices the step runs on).")
  if not devices:
    raise ValueError("choose_attention needs the target devices, got none.")
  platform = devices[0].platform
  half = jnp.dtype(dtype).name in ("bfloat16", "float16")
  kernel_blocker = _why_not_cpu_kernel(devices, dtype, head_dim, dropout)
  if requested == "xla":
    return Choice("xla", "requested")
  if requested == "cpu_kernel":
    if kernel_blocker:
      raise ValueError(f"config.model.attention='cpu_kernel' cannot run: {kernel_blocker}. Use "
                       "--config.model.attention=auto (or xla).")
    return Choice("cpu_kernel", "requested")
  if requested == "cudnn":
    if platform != "gpu" or not half or dropout:
      why = ("the devices are not GPUs" if platform != "gpu" else
             "cuDNN's fused attention needs bfloat16 or float16 compute" if not half else
             "attention dropout is on")
      raise ValueError(f"config.model.attention='cudnn' cannot run: {why}. Use "
                       "--config.model.attention=auto (or xla).")
    return Choice("cudnn", "requested")
  # 'auto'.
  if platform == "gpu":
    if half and not dropout:
      return Choice("cudnn", "GPU with half-precision compute: cuDNN's fused attention")
    return Choice("xla", "GPU: cuDNN's fused attention needs bfloat16/float16 compute and no "
                  "attention dropout")
  if platform != "cpu":
    return Choice("xla", f"{platform.upper()}: XLA's attention")
  if kernel_blocker:
    return Choice("xla", f"the fused CPU kernel does not apply: {kernel_blocker}")
  faster, why = cpu_attention.faster_than_xla()
  if not faster:
    return Choice("xla", "the fused CPU kernel is not known to be faster than XLA's attention "
                  f"on this CPU: {why}")
  return Choice("cpu_kernel", f"vit_jax's fused CPU kernel: {why}")


#: Model widths (hidden size D) from which 'auto' keeps half as much (ViT-L and wider).
WIDE = 1024


def auto_remat_policy(platform: str, dtype: Any, width: int) -> Choice:
  """The policy 'auto' stands for on `platform` ('tpu', 'gpu', 'cpu') at compute `dtype` for a
  model of hidden size `width` (see the module docstring)."""
  if platform == "cpu":
    return Choice("dots_and_attention_saveable", "CPU: host memory; keep the projections")
  name = jnp.dtype(dtype).name
  load = jnp.dtype(dtype).itemsize * (2 if width >= WIDE else 1)
  why = f"{platform.upper()}, {name}, D={width}"
  if load <= 2:
    return Choice("dots_and_attention_saveable", f"{why}: keep the projections' outputs")
  if load <= 4:
    return Choice("qkv_saveable", f"{why}: keep only q, k and v")
  return Choice("nothing_saveable", f"{why}: keep only each block's input")


def choose_remat_policy(requested: str, *, devices: Sequence[Any], dtype: Any = "float32",
                        width: int = 0) -> Choice:
  """The remat policy of a step compiled for `devices`: `requested` unless it is 'auto'.

  Args:
    requested: 'auto' or a name in `vit_jax.models.execution.REMAT_POLICIES`.
    devices: the target devices; dtype: the models' compute dtype; width: the model's hidden
      size D (ViT `hidden_size`, T2T-ViT `embed_dim`).

  Raises:
    ValueError: an unknown request (listing the choices), or no devices.
  """
  if requested not in REMAT_CHOICES:
    raise ValueError(f"config.model.remat_policy={requested!r} is not one of {REMAT_CHOICES} "
                     "('auto' picks from the devices and the compute dtype); set "
                     "--config.model.remat_policy to one of them.")
  if requested != "auto":
    return Choice(requested, "requested")
  if not devices:
    raise ValueError("choose_remat_policy needs the target devices, got none.")
  return auto_remat_policy(devices[0].platform, dtype, width)
