"""How the blocks run, chosen once from the devices the step is compiled for: the attention
implementation and the remat policy.

The models take the implementation as a field (`attention`, one of
`vit_jax.models.attention.IMPLEMENTATIONS`) and never look at the machine. `choose_attention`
turns a config's request ('auto' or one of those) into that field from the *target* devices
(their platform and count), not from the host that traces the step: a step lowered on a CPU host
for a TPU mesh gets the TPU's choice.

'auto' takes the first implementation of `ATTENTION` that can run on the target devices (its
`why_not` says None) and is worth it there: vit_jax's kernels (`vit_jax.kernels.ATTENTION`, each
only where measured faster than XLA's attention: its `faster_than_xla`), then cuDNN's fused
attention, then XLA's, which runs everywhere. So it never picks something slower than XLA's
attention where that is known.

`choose_remat_policy` turns `remat_policy='auto'` into one of
`vit_jax.models.execution.REMAT_POLICIES`: on CPU 'dots_and_attention_saveable' (the memory is
the host's); on TPU and GPU by the compute dtype's bytes, doubled from width `WIDE`: 2
'dots_and_attention_saveable', 4 'qkv_saveable', 8 'nothing_saveable', so that the step needs
at most 0.8 times the per-device memory of the unrematerialised model at the same batch
(measured with the pre-flight for ViT-B/16 and ViT-L/16; docs/pods.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax.numpy as jnp

from vit_jax import kernels
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


def _why_not_cudnn(devices: Sequence[Any], dtype: Any, head_dim: int,
                   dropout: bool) -> Optional[str]:
  """None where cuDNN's fused attention can run for these targets, else the reason."""
  del head_dim  # cuDNN takes any head size.
  if devices[0].platform != "gpu":
    return "the devices are not GPUs"
  if jnp.dtype(dtype).name not in ("bfloat16", "float16"):
    return "it needs bfloat16 or float16 compute"
  return "attention dropout is on" if dropout else None


def _always() -> tuple[bool, str]:
  return True, ""


#: name -> (what it is, for logs; `why_not(devices, dtype, head_dim, dropout)`, None where it
#: can run; `() -> (worth it, why)`), in the order 'auto' tries them.
ATTENTION: dict[str, tuple[str, Callable[..., Optional[str]], Callable[[], tuple[bool, str]]]] = {
    **{k.NAME: (k.LABEL, k.why_not, k.faster_than_xla) for k in kernels.ATTENTION},
    "cudnn": ("cuDNN's fused attention", _why_not_cudnn, _always),
    "xla": ("XLA's attention", lambda *unused: None, _always),
}


def choose_attention(requested: str, *, devices: Sequence[Any], dtype: Any = "float32",
                     head_dim: int, dropout: bool = False) -> Choice:
  """The attention implementation for a step compiled for `devices` (see the module docstring).

  Args:
    requested: 'auto', or one of `vit_jax.models.attention.IMPLEMENTATIONS` to insist on one.
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
  if requested != "auto":
    why = ATTENTION[requested][1](devices, dtype, head_dim, dropout)
    if why:
      raise ValueError(f"config.model.attention={requested!r} cannot run: {why}. Use "
                       "--config.model.attention=auto (or xla).")
    return Choice(requested, "requested")
  passed = []
  for name, (label, why_not, worth) in ATTENTION.items():
    why = why_not(devices, dtype, head_dim, dropout)
    if why is None:
      chosen, because = worth()
      if chosen:
        return Choice(name, "; ".join(passed + [f"{label}: {because}" if because else label]))
      why = f"not known to be faster than XLA's attention here: {because}"
    passed.append(f"{label} does not apply: {why}")
  raise AssertionError("XLA's attention runs everywhere.")


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
