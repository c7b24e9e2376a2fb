"""Tools built on the library, apart from it: nothing in `vit_jax` imports them.

  benchmark   throughput, compile time, memory and MFU of the trainer's step, beside timm's
              (`python -m vit_jax.benchmark`; a package, one module per concern)
  cost        what a training run will cost before it runs: FLOPs, TPU-core-days, wall time
              (`python -m vit_jax.cost`)
  convert     checkpoint conversion between the formats (`python -m vit_jax.convert`)
  preflight   the trainer's steps compiled for a TPU slice on any machine, with libtpu: memory
              per device, fits or not, and the overrides that would (`python -m vit_jax.preflight`)

`vit_jax/benchmark.py`, `cost.py`, `convert.py` and `preflight.py` are the entry points that keep
those commands.
"""
