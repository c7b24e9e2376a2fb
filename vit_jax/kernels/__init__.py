"""vit_jax's compiled kernels, each one's C++ source, build and JAX loader side by side
(docs/kernels.md). :data:`ATTENTION` registers the attention kernels, the models' and
`dispatch`'s only way to them; each gives what :mod:`vit_jax.kernels.cpu_attention` gives
(``NAME``, ``LABEL``, ``why_not``, ``faster_than_xla``, ``attention``, ``RESIDUAL_NAMES``,
``TARGETS``, ``macs``, ``called_by``).
"""

from typing import Any, Optional

from vit_jax.kernels import cpu_attention

ATTENTION = (cpu_attention,)


def called_by(compiled: Any) -> Optional[str]:
  """The ``LABEL`` of the kernel a compiled step (``jax.stages.Compiled``) calls, else None: which
  attention the step runs, whatever the config asked."""
  return next((k.LABEL for k in ATTENTION if k.called_by(compiled)), None)
