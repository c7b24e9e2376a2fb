"""The attention implementation and the remat policy, chosen from the devices the step is
compiled for (not the host that traces it).

The 'auto' attention rule, stated here only: the first implementation of `ATTENTION` that can
run there (`why_not` is None) and is worth it: vit_jax's kernels (each where its
`faster_than_xla` says so), then cuDNN's, then XLA's, which runs everywhere. The 'auto' remat
policy: `auto_remat_policy` (measured: docs/pods.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax.numpy as jnp

from vit_jax import kernels
from vit_jax.config.keys import ConfigError
from vit_jax.models import attention as attention_lib
from vit_jax.models import execution

#: What `choose_attention` accepts: 'auto' or a concrete implementation.
CHOICES = ("auto",) + attention_lib.IMPLEMENTATIONS
#: What `choose_remat_policy` accepts: 'auto' or a policy name.
REMAT_CHOICES = ("auto",) + execution.REMAT_POLICIES
#: Model widths (hidden size D) from which 'auto' keeps half as much (ViT-L and wider).
WIDE = 1024


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


#: The attention registry, in 'auto''s order: name -> (label, `why_not`, `() -> (worth, why)`).
ATTENTION: dict[str, tuple[str, Callable[..., Optional[str]], Callable[[], tuple[bool, str]]]] = {
    **{k.NAME: (k.LABEL, k.why_not, k.faster_than_xla) for k in kernels.ATTENTION},
    "cudnn": ("cuDNN's fused attention", _why_not_cudnn, lambda: (True, "")),
    "xla": ("XLA's attention", lambda *unused: None, lambda: (True, "")),
}


def choose_attention(requested: str, *, devices: Sequence[Any], dtype: Any = "float32",
                     head_dim: int, dropout: bool = False) -> Choice:
  """The implementation for `requested` ('auto' or one of `CHOICES`) on the target `devices`,
  and why. ConfigError: an unknown request, or one that cannot run here; ValueError: no devices."""
  if requested not in CHOICES:
    raise ConfigError("model.attention", requested, f"is not one of {CHOICES} ('auto' picks "
                      "from the devices the step runs on)", "set config.model.attention to one "
                      "of them.")
  if not devices:
    raise ValueError("choose_attention needs the target devices, got none.")
  if requested != "auto":
    why = ATTENTION[requested][1](devices, dtype, head_dim, dropout)
    if why:
      raise ConfigError("model.attention", requested, f"cannot run: {why}",
                        "use config.model.attention=auto (or xla).")
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


def auto_remat_policy(platform: str, dtype: Any, width: int) -> Choice:
  """The policy 'auto' stands for on `platform` at compute `dtype`, hidden size `width`: on CPU
  'dots_and_attention_saveable'; else by the dtype's bytes, doubled from width `WIDE`: 2
  'dots_and_attention_saveable', 4 'qkv_saveable', 8 'nothing_saveable'."""
  if platform == "cpu":
    return Choice("dots_and_attention_saveable", "CPU: host memory; keep the projections")
  widening = 2 if width >= WIDE else 1
  load = jnp.dtype(dtype).itemsize * widening
  if load <= 2:
    policy, keep = "dots_and_attention_saveable", "the projections' outputs"
  elif load <= 4:
    policy, keep = "qkv_saveable", "only q, k and v"
  else:
    policy, keep = "nothing_saveable", "only each block's input"
  return Choice(policy, f"{platform.upper()}, {jnp.dtype(dtype).name}, D={width}: keep {keep}")


def choose_remat_policy(requested: str, *, devices: Sequence[Any], dtype: Any = "float32",
                        width: int = 0) -> Choice:
  """`requested`, or for 'auto' `auto_remat_policy` on `devices`; ConfigError: unknown;
  ValueError: no devices."""
  if requested not in REMAT_CHOICES:
    raise ConfigError("model.remat_policy", requested, f"is not one of {REMAT_CHOICES} ('auto' "
                      "picks from the devices and the compute dtype)",
                      "set config.model.remat_policy to one of them.")
  if requested != "auto":
    return Choice(requested, "requested")
  if not devices:
    raise ValueError("choose_remat_policy needs the target devices, got none.")
  return auto_remat_policy(devices[0].platform, dtype, width)
