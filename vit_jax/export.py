"""`python -m vit_jax.export`: a trained model as a `jax.export` (StableHLO) artifact for
serving, with its preprocessing stated beside it; the command lives in `vit_jax.tools.export`."""
from vit_jax.tools.export import run_main

if __name__ == "__main__":
  run_main()
