"""Fused softmax attention on XLA:CPU: vit_jax's own kernel, called through the XLA FFI.

XLA:CPU has no fused attention: it runs ``softmax(q k^T) v`` as batched matrix products with the
softmax in separate passes, and a rematerialised block computes it twice. On a 2-core Zen 4 this
core was the difference between our ViT-Ti/16 training step and timm's, whose PyTorch build has
a fused CPU flash-attention kernel (README "Benchmarks"). ``vit_jax/csrc/fused_attention.cc``
is ours: per (image, head) it computes the forward and the FlashAttention-2 backward in one
pass over cache-resident tiles, using XLA's intra-op thread pool. It is compiled when the
package is installed (``setup.py``; needs a C++17 compiler, e.g. Debian's ``g++``), for
AVX-512, AVX2 and baseline x86-64 at once.

:func:`attention` is the differentiable function; :func:`usable` says whether the kernel can
run here for given inputs. The model code (``attention.py``, ``t2t.py``) uses the kernel when it
is usable and XLA's products otherwise, with the same parameters and results within float32
rounding (the tests compare both). It is used only on a single-device CPU backend (a custom call
is not partitioned by XLA's SPMD partitioner), for float32 inputs, a head size that is a
multiple of 16, and no attention dropout. ``VIT_JAX_FUSED_ATTENTION=0`` in the environment turns
it off (e.g. to measure XLA's core).

Residuals: the forward saves its output and the per-row log-sum-exp, named
``'attention_out'`` and ``'attention_lse'`` for remat policies (see
``vit_jax.models.vit.REMAT_POLICIES``); the backward recomputes the attention weights from them.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from typing import Any, Optional, Tuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

Array = jax.Array

#: Environment variable that turns the kernel off: 0, false, no or off (unset, empty, 1, true,
#: yes or on: the default, on where usable). Any other value is an error.
SWITCH = 'VIT_JAX_FUSED_ATTENTION'
#: Names of the saved forward results, for ``jax.checkpoint_policies.save_only_these_names``.
RESIDUAL_NAMES = ('attention_out', 'attention_lse')

#: The kernel's two FFI targets (custom-call names in the compiled HLO).
FORWARD_TARGET = 'vit_jax_attention_forward'
BACKWARD_TARGET = 'vit_jax_attention_backward'
TARGETS = (FORWARD_TARGET, BACKWARD_TARGET)
#: When the models use the kernel (:func:`usable`), for messages.
CONDITIONS = ('float32 attention with a head size divisible by 16 and no attention dropout, on a '
              'single-device CPU backend')
_OFF, _ON = ('0', 'false', 'no', 'off'), ('', '1', 'true', 'yes', 'on')


@functools.cache
def library() -> Tuple[Optional[str], str]:
  """Loads the compiled kernel once and registers its two FFI targets for the CPU platform.

  Returns:
    ``(path, '')`` when loaded, ``(None, reason)`` when not: the extension was not built (no C++
    compiler at install time; reinstall with ``pip install -e .`` after installing ``g++``) or
    could not be loaded.
  """
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  paths = sorted(glob.glob(os.path.join(here, '_fused_attention*.so')))
  if not paths:
    return None, ('the extension vit_jax/_fused_attention*.so was not built (install a C++ '
                  'compiler, e.g. `apt-get install g++`, then `pip install -e .` again)')
  try:
    lib = ctypes.CDLL(paths[0])
    jax.ffi.register_ffi_target(FORWARD_TARGET, jax.ffi.pycapsule(lib.VitJaxAttentionForward),
                                platform='cpu')
    jax.ffi.register_ffi_target(BACKWARD_TARGET, jax.ffi.pycapsule(lib.VitJaxAttentionBackward),
                                platform='cpu')
  except (OSError, AttributeError) as e:
    return None, f'{paths[0]} could not be loaded: {e}'
  return paths[0], ''


def _switched_off() -> bool:
  value = os.environ.get(SWITCH, '').strip().lower()
  if value not in _OFF + _ON:
    raise ValueError(f'{SWITCH}={os.environ[SWITCH]!r} is neither on (1, true, yes, on) nor off '
                     '(0, false, no, off); set one of those or unset it.')
  return value in _OFF


def enabled() -> bool:
  """True when the kernel is built and loads and :data:`SWITCH` does not say off.

  Raises:
    ValueError: :data:`SWITCH` has a value that is neither on nor off.
  """
  return not _switched_off() and library()[0] is not None


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
  """One line for logs and reports: whether the kernel is on, and why not if it is off.

  Raises:
    ValueError: :data:`SWITCH` has a value that is neither on nor off.
  """
  if _switched_off():
    return f'off ({SWITCH}={os.environ[SWITCH]})'
  path, reason = library()
  if path is None:
    return f'off: {reason}'
  return f'available (the models use it for {CONDITIONS})'


def usable(shape: Tuple[int, ...], dtype: Any, *, dropout: bool) -> bool:
  """Whether :func:`attention` can run here for a ``qkv`` of ``shape`` ``[B, N, 3, heads, Dh]``.

  True on a single-device CPU backend, for float32 ``dtype``, ``Dh % 16 == 0``, no attention
  dropout (``dropout``), the kernel built and not switched off. Decided at trace time.
  """
  return (not dropout and len(shape) == 5 and shape[2] == 3 and jnp.dtype(dtype) == jnp.float32
          and shape[-1] % 16 == 0 and jax.default_backend() == 'cpu'
          and jax.device_count() == 1 and enabled())


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

  Differentiable (``jax.custom_vjp``; the backward is the kernel's too). Called directly it runs
  whatever :data:`SWITCH` says (the switch steers the models, through :func:`usable`).

  Args:
    qkv: ``[B, N, 3, heads, Dh]`` float32, queries, keys and values stacked on axis 2 (the
      output of a fused QKV projection, reshaped); ``Dh`` a multiple of 16.
    logits_scale: multiplies the logits ``q . k`` (e.g. ``Dh ** -0.5``).

  Returns:
    ``[B, N, heads, Dh]`` float32: :func:`vit_jax.models.attention.dot_product_attention` of the
    ``[B, heads, N, Dh]`` transposes, moved back, to float32 rounding (max abs difference about
    1e-6 at ViT-B sizes).

  Raises:
    ValueError: a shape or dtype the kernel does not take, or the kernel unavailable (with the
      reason); :func:`usable` says beforehand.
  """
  qkv = jnp.asarray(qkv)
  if qkv.ndim != 5 or qkv.shape[2] != 3:
    raise ValueError(f'fused attention needs qkv of shape [B, N, 3, heads, Dh], got {qkv.shape}')
  if qkv.shape[-1] % 16 or qkv.dtype != jnp.float32:
    raise ValueError(f'fused attention needs float32 and a head size divisible by 16, got '
                     f'{qkv.dtype} and Dh={qkv.shape[-1]}')
  path, reason = library()
  if path is None:
    raise ValueError(f'fused attention is unavailable: {reason}')
  return _attention(qkv, float(logits_scale))
