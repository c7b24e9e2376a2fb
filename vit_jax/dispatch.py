"""Which attention implementation runs: chosen once, from the devices the step is compiled for.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp

from vit_jax.kernels import cpu_attention
from vit_jax.models import attention as attention_lib

#: What `choose_attention` accepts: 'auto' or a concrete implementation.
CHOICES = ("auto",) + attention_lib.IMPLEMENTATIONS


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
