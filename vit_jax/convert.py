"""`python -m vit_jax.convert`: the checkpoint converter, which lives in `vit_jax.tools.convert`."""
if __name__ == "__main__":
  from vit_jax.tools import convert
  convert.run_main()
