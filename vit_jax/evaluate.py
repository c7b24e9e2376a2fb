"""`python -m vit_jax.evaluate`: model evaluation, which lives in `vit_jax.tools.evaluate`."""
if __name__ == "__main__":
  from vit_jax.tools import evaluate
  evaluate.run_main()
