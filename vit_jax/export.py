"""`python -m vit_jax.export`: a model exported for serving (`vit_jax.tools.export`)."""
from vit_jax.tools.export import run_main

if __name__ == "__main__":
  run_main()
