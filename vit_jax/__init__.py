"""vit_jax: Vision Transformer (ViT) and Tokens-to-Token ViT (T2T-ViT) in JAX/Flax."""

__version__ = "0.1.0"

import os as _os
import time as _time

#: When this package was first imported (`time.monotonic()`): the start of the compute account.
STARTED = _time.monotonic()

#: Cloud Storage retries: TensorFlow's variables (set here, where unset, before its first gs://
#: access), given to TensorStore too (docs/pods.md, "When Cloud Storage stops answering").
GCS_RETRY_DEFAULTS = {
    "GCS_RETRY_CONFIG_MAX_RETRIES": "5",
    "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "1000000",
    "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": "16000000",
}
for _name, _value in GCS_RETRY_DEFAULTS.items():
  _os.environ.setdefault(_name, _value)


def gcs_retries() -> dict[str, int]:
  """The ``GCS_RETRY_CONFIG_*`` values as ints, by the name's end (``MAX_RETRIES``,
  ``INIT_DELAY_TIME_US``, ``MAX_DELAY_TIME_US``). ValueError naming one that is no whole number."""
  values = {}
  for name in GCS_RETRY_DEFAULTS:
    value = _os.environ.get(name, GCS_RETRY_DEFAULTS[name]).strip()
    if not value.isdigit():
      raise ValueError(f'{name}={value!r} must be a whole number (docs/pods.md, "When Cloud '
                       'Storage stops answering"); unset it for the default.')
    values[name[len("GCS_RETRY_CONFIG_"):]] = int(value)
  return values


def skip_absent_tpu() -> None:
  """JAX on the CPU where its TPU backend would fail with a page of libtpu errors
  (`hardware.tpu_absent`): JAX_PLATFORMS=cpu before JAX loads, else JAX's `jax_platforms`."""
  import sys  # pylint: disable=g-import-not-at-top
  from vit_jax import hardware  # pylint: disable=g-import-not-at-top
  if not hardware.tpu_absent():
    return
  jax = sys.modules.get("jax")
  if jax is None:
    _os.environ["JAX_PLATFORMS"] = "cpu"
  elif not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")


skip_absent_tpu()
