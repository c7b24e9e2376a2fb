"""Fused softmax attention on XLA:CPU, vit_jax's own kernel through the XLA FFI (docs/kernels.md).

``cpu_attention.cc`` computes, per (image, head), the forward and FlashAttention-2's backward
(Dao, 2023, Algorithm 2) over cache-resident tiles, one variant per x86-64 level (:data:`ISAS`;
:func:`isa`). This module loads the library ``_cpu_attention*.so`` (``build.py``), registers its
FFI targets and wraps them as :func:`attention`, differentiable; the forward saves its output
and per-row log-sum-exp as :data:`RESIDUAL_NAMES`. Registered in ``vit_jax.kernels.ATTENTION``.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.machinery
import os
from typing import Any, Optional, Sequence, Tuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

Array = jax.Array

#: Names of the saved forward results, for ``jax.checkpoint_policies.save_only_these_names``.
RESIDUAL_NAMES = ('attention_out', 'attention_lse')

#: The kernel's two FFI targets (custom-call names in the compiled HLO).
FORWARD_TARGET = 'vit_jax_attention_forward'
BACKWARD_TARGET = 'vit_jax_attention_backward'
TARGETS = (FORWARD_TARGET, BACKWARD_TARGET)
#: The models' ``attention`` value that runs this kernel, and what it is, for logs.
NAME = 'cpu_kernel'
LABEL = 'the fused CPU kernel'
#: The library's variants: x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA), baseline (any CPU).
ISAS = ('avx512', 'avx2', 'baseline')

#: Per variant: whether it shortens the training step against XLA's attention, and why (the
#: measurements: docs/kernels.md).
MEASURED = {
    'avx512': (True, "its ViT-Ti/16 training step was measured 14% shorter than with XLA's "
               'attention on a Zen 4 CPU (docs/kernels.md)'),
    'avx2': (True, "its ViT-Ti/16 and ViT-S/16 training steps were measured 8% and 5% shorter "
             "than with XLA's attention on an AVX2 CPU (docs/kernels.md)"),
    'baseline': (False, "its ViT-Ti/16 training step was measured 40% longer than with XLA's "
                 'attention (docs/kernels.md)'),
}

_LIBRARY_GLOB = '_cpu_attention*.so'
_loaded: dict[str, str] = {}  # Path of each loaded library -> its variant (VitJaxAttentionIsa).


def load(path: str) -> Tuple[Optional[str], str]:
  """Loads the library at ``path`` and registers its FFI targets: ``(path, '')``, or ``(None,
  reason)``. :func:`library` loads the installed one; a measurement may load a one-variant build
  first, in a fresh process."""
  try:
    lib = ctypes.CDLL(path)
    lib.VitJaxAttentionIsa.restype = ctypes.c_char_p
    variant = lib.VitJaxAttentionIsa().decode()
    for target, function in zip(TARGETS, (lib.VitJaxAttentionForward, lib.VitJaxAttentionBackward)):
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(function), platform='cpu')
  except (OSError, AttributeError) as e:
    return None, f'{path} could not be loaded: {e}'
  _loaded[path] = variant
  return path, ''


@functools.cache
def library() -> Tuple[Optional[str], str]:
  """The installed library, loaded once: ``(path, '')``, or ``(None, reason)`` when it was not
  built (no C++ compiler at install time) or cannot be loaded."""
  if _loaded:  # A measuring script loaded a variant first (see load): that one is registered.
    return next(iter(_loaded)), ''
  here = os.path.dirname(os.path.abspath(__file__))
  # This interpreter's build first (each builds against its own jaxlib's headers), then any.
  paths = [os.path.join(here, '_cpu_attention' + suffix)
           for suffix in importlib.machinery.EXTENSION_SUFFIXES]
  paths = [p for p in paths if os.path.isfile(p)] + sorted(
      glob.glob(os.path.join(here, _LIBRARY_GLOB)))
  if not paths:
    return None, (f'the extension vit_jax/kernels/{_LIBRARY_GLOB} was not built (install a C++ '
                  'compiler, e.g. `apt-get install g++`, then `pip install -e .` again)')
  return load(paths[0])


def isa() -> Optional[str]:
  """The variant that runs on this CPU (:data:`ISAS`, the best it has, as GCC's
  ``target_clones`` picks); None if not built."""
  path, _ = library()
  return None if path is None else _loaded[path]


def faster_than_xla() -> Tuple[bool, str]:
  """``(faster, why)``: whether the kernel is faster than XLA's attention on this CPU, per the
  variant that runs here, from :data:`MEASURED`; False when not built."""
  path, reason = library()
  if path is None:
    return False, f'the kernel is not available: {reason}'
  variant = _loaded[path]
  faster, why = MEASURED[variant]
  return faster, f'its {variant} variant runs on this CPU; {why}'


def why_not(devices: Sequence[Any], dtype: Any, head_dim: int, dropout: bool) -> Optional[str]:
  """None where the kernel can run in a step compiled for ``devices``, else the reason."""
  platform = devices[0].platform
  if platform != 'cpu':
    return f'the devices are {platform.upper()}s, the kernel is for XLA:CPU'
  if len(devices) > 1:
    return (f"the step runs on {len(devices)} devices and XLA's SPMD partitioner cannot split "
            "the kernel's custom call")
  if jnp.dtype(dtype) != jnp.float32:
    return f'the compute dtype is {jnp.dtype(dtype).name}, the kernel is float32 only'
  if head_dim % 16:
    return f'the head size {head_dim} is not a multiple of 16'
  if dropout:
    return 'attention dropout is on (the kernel has none)'
  return library()[1] or None


def supports(qkv_shape: Tuple[int, ...], dtype: Any) -> bool:
  """Whether :func:`attention` takes a ``qkv`` of ``qkv_shape`` and ``dtype``: float32
  ``[B, N, 3, heads, Dh]``, ``Dh % 16 == 0``. Pure: no devices, environment or library."""
  return (len(qkv_shape) == 5 and qkv_shape[2] == 3 and qkv_shape[-1] % 16 == 0
          and jnp.dtype(dtype) == jnp.float32)


def macs(target_name: str, qkv_shape: Tuple[int, ...]) -> int:
  """Multiply-adds of one call of ``target_name`` on a ``qkv`` of ``qkv_shape``: per (image,
  head) 2 N^2 Dh forward, 5 N^2 Dh backward (for :func:`vit_jax.flops.jaxpr_macs`)."""
  b, n, _, heads, head_dim = qkv_shape
  products = {FORWARD_TARGET: 2, BACKWARD_TARGET: 5}[target_name]
  return products * b * heads * n * n * head_dim


def called_by(compiled: Any) -> bool:
  """Whether a compiled computation (``jax.stages.Compiled``) runs the kernel's forward."""
  return f'custom_call_target="{FORWARD_TARGET}"' in compiled.as_text()


def status() -> str:
  """One line for logs: built or not, the variant, and :func:`faster_than_xla`."""
  path, reason = library()
  if path is None:
    return f'unavailable: {reason}'
  faster, why = faster_than_xla()
  speed = 'faster' if faster else 'not faster'
  return f"available, {_loaded[path]} variant ({speed} than XLA's attention: {why})"


def _forward_call(qkv: Array, scale: float) -> Tuple[Array, Array]:
  b, n, _, heads, head_dim = qkv.shape
  out_types = (jax.ShapeDtypeStruct((b, n, heads, head_dim), jnp.float32),
               jax.ShapeDtypeStruct((b, heads, n), jnp.float32))
  return jax.ffi.ffi_call(FORWARD_TARGET, out_types, vmap_method='sequential')(
      qkv, scale=np.float32(scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _attention(qkv: Array, scale: float) -> Array:
  return _forward_call(qkv, scale)[0]


def _attention_fwd(qkv, scale):
  out, lse = (checkpoint_name(x, n) for x, n in zip(_forward_call(qkv, scale), RESIDUAL_NAMES))
  return out, (qkv, out, lse)


def _attention_bwd(scale, residuals, d_out):
  qkv, out, lse = residuals
  d_qkv = jax.ffi.ffi_call(BACKWARD_TARGET, jax.ShapeDtypeStruct(qkv.shape, jnp.float32),
                           vmap_method='sequential')(
                               qkv, out, lse, d_out.astype(jnp.float32), scale=np.float32(scale))
  return (d_qkv,)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(qkv: Array, *, logits_scale: float) -> Array:
  """``softmax(logits_scale * q k^T) v`` by the kernel, differentiable; XLA:CPU, one device.

  ``qkv [B, N, 3, heads, Dh]`` float32 (``Dh`` a multiple of 16) -> ``[B, N, heads, Dh]``
  float32, XLA's result to float32 rounding. ValueError: a shape or dtype it does not take
  (:func:`supports`), or the kernel unavailable (:func:`library`).
  """
  qkv = jnp.asarray(qkv)
  if not supports(qkv.shape, qkv.dtype):
    raise ValueError(f'fused attention needs float32 qkv [B, N, 3, heads, Dh], Dh divisible by '
                     f'16, got {qkv.dtype} {qkv.shape}')
  path, reason = library()
  if path is None:
    raise ValueError(f'fused attention is unavailable: {reason}')
  return _attention(qkv, float(logits_scale))
