"""Pod pre-flight: the trainer's steps compiled for a TPU slice on any machine (`libtpu`).

  from vit_jax.tools import preflight
  tpu = preflight.tpu_slice("v3-8")                 # compile-only devices, no TPU needed
  result = preflight.check(config, tpu)              # config: configs/*.py with overrides
  result.fits, result.train.memory.total             # per device, bytes
  timed = preflight.check(config, tpu, estimate=True)  # + the compiler's estimate of the time
  timed.train.cost.seconds, timed.speed(timed.train).mfu  # loops counted as they run
  found = preflight.suggest(config, result, functools.partial(preflight.check, tpu=tpu))
"""

from vit_jax.tools.preflight.fit import check
from vit_jax.tools.preflight.fit import flags_of
from vit_jax.tools.preflight.fit import Result
from vit_jax.tools.preflight.fit import with_overrides
from vit_jax.tools.preflight.search import largest_batch
from vit_jax.tools.preflight.search import suggest
from vit_jax.tools.preflight.topology import INSTALL_LINE
from vit_jax.tools.preflight.topology import MissingLibtpuError
from vit_jax.tools.preflight.topology import tpu_slice

__all__ = ["INSTALL_LINE", "MissingLibtpuError", "Result", "check", "flags_of", "largest_batch",
           "suggest", "tpu_slice", "with_overrides"]
