"""Fused softmax attention on XLA:CPU: vit_jax's own kernel, called through the XLA FFI.

XLA:CPU has no fused attention: it runs ``softmax(q k^T) v`` as batched matrix products with the
softmax in separate passes, and a rematerialised block computes it twice. ``cpu_attention.cc``
(beside this file) computes, per (image, head), the forward and FlashAttention-2's backward
(Dao, 2023, Algorithm 2) in one pass over cache-resident tiles, using XLA's intra-op thread
pool. ``pip install`` compiles it (``vit_jax/kernels/build.py``, used by ``setup.py``; needs a
C++17 compiler, e.g. Debian's ``g++``) into ``vit_jax/kernels/_cpu_attention*.so``, with one
variant per x86-64 instruction set (:data:`ISAS`), of which the library runs the best that the
CPU has (:func:`isa`).

This module loads the library, registers its two FFI targets for the CPU and wraps them as
:func:`attention`, differentiable. ``vit_jax.dispatch`` decides where it runs, from
:func:`why_not` and :func:`faster_than_xla`; other modules reach it through
``vit_jax.kernels.ATTENTION``. The forward saves its output and per-row log-sum-exp as
:data:`RESIDUAL_NAMES` (for remat policies); the backward recomputes the weights from them.
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
#: The library's variants, one per x86-64 level: x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA),
#: the x86-64 baseline (SSE2; also every non-x86 build).
ISAS = ('avx512', 'avx2', 'baseline')

#: Per variant: whether it shortens the training step against XLA's attention, and the
#: measurement that says so (docs/kernels.md has the tables and the command that reproduces
#: them). The automatic choice uses the kernel only where this says True.
MEASURED = {
    'avx512': (True, 'measured on a Zen 4 CPU with AVX-512 (2 cores): the ViT-Ti/16 training '
               "step at batch 32 took 14% less time than with XLA's attention "
               '(docs/kernels.md)'),
    'avx2': (True, 'measured on an AMD EPYC with AVX2 and no AVX-512: the ViT-Ti/16 and '
             "ViT-S/16 training steps at batch 32 took 8% and 5% less time than with XLA's "
             'attention, the attention core alone about 0.7 of its time (docs/kernels.md)'),
    'baseline': (False, 'measured on an AVX2 CPU with the kernel built for the x86-64 '
                 "baseline (SSE2) alone: the attention core took twice XLA's time and the "
                 "ViT-Ti/16 training step 40% more time than with XLA's attention "
                 '(docs/kernels.md)'),
}

_LIBRARY_GLOB = '_cpu_attention*.so'
_loaded: dict[str, str] = {}  # Path of each loaded library -> its variant (VitJaxAttentionIsa).


def load(path: str) -> Tuple[Optional[str], str]:
  """Loads the kernel library at ``path`` and registers its two FFI targets for the CPU.

  :func:`library` calls this once for the installed library; a measuring script may call it
  first, in a fresh process, with a build of one variant (``vit_jax/tools/measure_attention.py``).

  Returns:
    ``(path, '')`` when loaded, ``(None, reason)`` when the file cannot be loaded or lacks the
    kernel's symbols.
  """
  try:
    lib = ctypes.CDLL(path)
    lib.VitJaxAttentionIsa.restype = ctypes.c_char_p
    variant = lib.VitJaxAttentionIsa().decode()
    jax.ffi.register_ffi_target(FORWARD_TARGET, jax.ffi.pycapsule(lib.VitJaxAttentionForward),
                                platform='cpu')
    jax.ffi.register_ffi_target(BACKWARD_TARGET, jax.ffi.pycapsule(lib.VitJaxAttentionBackward),
                                platform='cpu')
  except (OSError, AttributeError) as e:
    return None, f'{path} could not be loaded: {e}'
  _loaded[path] = variant
  return path, ''


@functools.cache
def library() -> Tuple[Optional[str], str]:
  """Loads the installed kernel once and registers its two FFI targets for the CPU platform.

  Returns:
    ``(path, '')`` when loaded, ``(None, reason)`` when not: the extension was not built (no C++
    compiler at install time; reinstall with ``pip install -e .`` after installing ``g++``) or
    could not be loaded.
  """
  if _loaded:  # A measuring script loaded a variant first (see load): that one is registered.
    return next(iter(_loaded)), ''
  here = os.path.dirname(os.path.abspath(__file__))
  # This interpreter's build first (each Python's install builds its own, against the headers
  # of its jaxlib), then any other.
  paths = [os.path.join(here, '_cpu_attention' + suffix)
           for suffix in importlib.machinery.EXTENSION_SUFFIXES]
  paths = [p for p in paths if os.path.isfile(p)] + sorted(
      glob.glob(os.path.join(here, _LIBRARY_GLOB)))
  if not paths:
    return None, (f'the extension vit_jax/kernels/{_LIBRARY_GLOB} was not built (install a C++ '
                  'compiler, e.g. `apt-get install g++`, then `pip install -e .` again)')
  return load(paths[0])


def isa() -> Optional[str]:
  """The variant of the kernel that runs on this CPU, one of :data:`ISAS`; None if not built.

  The library picks it when it loads, as GCC's ``target_clones`` would: ``'avx512'`` where
  the CPU has x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), else ``'avx2'`` where it has x86-64-v3
  (AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE), else ``'baseline'``.
  """
  path, _ = library()
  return None if path is None else _loaded[path]


def faster_than_xla() -> Tuple[bool, str]:
  """Whether the kernel is faster than XLA's attention on this CPU, and why (a phrase for logs).

  Per the variant that runs here (:func:`isa`), from measurements of the whole training step
  (:data:`MEASURED`, docs/kernels.md), never from the machine's load. False when not built.
  """
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
  """Multiply-adds of one call of the kernel's ``target_name`` on a ``qkv`` of ``qkv_shape``.

  Per (image, head) with N tokens of head size Dh: the forward's two products (q k^T and the
  weights times v) are 2 N^2 Dh; the backward's five (S^T, dP^T, dV, dK, dQ) 5 N^2 Dh. For
  :func:`vit_jax.flops.jaxpr_macs`, which counts XLA's products and cannot see into the call.
  """
  b, n, _, heads, head_dim = qkv_shape
  products = {FORWARD_TARGET: 2, BACKWARD_TARGET: 5}[target_name]
  return products * b * heads * n * n * head_dim


def called_by(compiled: Any) -> bool:
  """Whether a compiled computation (``jax.stages.Compiled``) runs the kernel's forward."""
  return f'custom_call_target="{FORWARD_TARGET}"' in compiled.as_text()


def status() -> str:
  """One line for logs and reports: whether the kernel is built, which variant runs here, and
  whether it is faster than XLA's attention on this CPU (:func:`faster_than_xla`)."""
  path, reason = library()
  if path is None:
    return f'unavailable: {reason}'
  faster, why = faster_than_xla()
  return (f'available, {_loaded[path]} variant ({"faster" if faster else "not faster"} than '
          f"XLA's attention: {why})")


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
  out, lse = _forward_call(qkv, scale)
  out = checkpoint_name(out, RESIDUAL_NAMES[0])
  lse = checkpoint_name(lse, RESIDUAL_NAMES[1])
  return out, (qkv, out, lse)


def _attention_bwd(scale, residuals, d_out):
  qkv, out, lse = residuals
  d_qkv = jax.ffi.ffi_call(BACKWARD_TARGET, jax.ShapeDtypeStruct(qkv.shape, jnp.float32),
                           vmap_method='sequential')(
                               qkv, out, lse, d_out.astype(jnp.float32), scale=np.float32(scale))
  return (d_qkv,)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(qkv: Array, *, logits_scale: float) -> Array:
  """``softmax(logits_scale * q k^T) v`` for every image and head, by the fused kernel.

  Differentiable (``jax.custom_vjp``; the backward is the kernel's too). Runs on XLA:CPU only,
  on one device; the caller decides when to use it (see the module docstring).

  Args:
    qkv: ``[B, N, 3, heads, Dh]`` float32, queries, keys and values stacked on axis 2 (the
      output of a fused QKV projection, reshaped); ``Dh`` a multiple of 16.
    logits_scale: multiplies the logits ``q . k`` (e.g. ``Dh ** -0.5``).

  Returns:
    ``[B, N, heads, Dh]`` float32: :func:`vit_jax.models.attention.dot_product_attention` of the
    ``[B, heads, N, Dh]`` transposes, moved back, to float32 rounding (max abs difference about
    1e-6 at ViT-B sizes).

  Raises:
    ValueError: a shape or dtype the kernel does not take (:func:`supports` says beforehand),
      or the kernel unavailable (with the reason; :func:`library` says beforehand).
  """
  qkv = jnp.asarray(qkv)
  if not supports(qkv.shape, qkv.dtype):
    raise ValueError(f'fused attention needs float32 qkv [B, N, 3, heads, Dh], Dh divisible by '
                     f'16, got {qkv.dtype} {qkv.shape}')
  path, reason = library()
  if path is None:
    raise ValueError(f'fused attention is unavailable: {reason}')
  return _attention(qkv, float(logits_scale))
