"""Tools built on the library, apart from it: nothing in `vit_jax` imports them.

  benchmark   throughput, compile time, memory and MFU of the trainer's step, beside timm's
              (`python -m vit_jax.benchmark`; a package, one module per concern)
  cost        what a training run will cost before it runs: FLOPs, TPU-core-days, wall time
              (`python -m vit_jax.cost`)

`vit_jax/benchmark.py` and `vit_jax/cost.py` are the entry points that keep those commands.
"""
