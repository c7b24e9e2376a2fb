"""vit_jax: Vision Transformer (ViT) and Tokens-to-Token ViT (T2T-ViT) in JAX/Flax."""

__version__ = "0.1.0"

import time as _time

#: When this package was first imported (`time.monotonic()`): with `python -m vit_jax.main` that
#: is the start of the program, before JAX and TensorFlow load; the compute account starts here.
STARTED = _time.monotonic()
