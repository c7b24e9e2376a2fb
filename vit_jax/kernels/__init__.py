"""vit_jax's compiled kernels, each one's C++ source, build and JAX loader side by side
(docs/kernels.md).

:data:`ATTENTION` registers the attention kernels; the models and `dispatch` reach them only
through it (tools/measure_attention measures the CPU kernel itself).
Each gives ``NAME`` (the models' ``attention`` value), ``LABEL``, ``why_not(devices, dtype,
head_dim, dropout)``, ``faster_than_xla()``, ``attention(qkv, logits_scale=)``,
``RESIDUAL_NAMES``, ``TARGETS``, ``macs(target, qkv_shape)`` and ``called_by(compiled)``.
"""

from typing import Any, Optional

from vit_jax.kernels import cpu_attention

ATTENTION = (cpu_attention,)


def called_by(compiled: Any) -> Optional[str]:
  """The ``LABEL`` of the kernel a compiled step (``jax.stages.Compiled``) calls, else None: which
  attention the step runs, whatever the config asked."""
  return next((k.LABEL for k in ATTENTION if k.called_by(compiled)), None)
