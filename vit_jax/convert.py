"""`python -m vit_jax.convert`: the checkpoint converter (`vit_jax.tools.convert`)."""
from vit_jax.tools import convert

if __name__ == "__main__":
  convert.run_main()
