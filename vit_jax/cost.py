"""`python -m vit_jax.cost`: the cost estimator, which lives in `vit_jax.tools.cost`."""
if __name__ == "__main__":
  from vit_jax.tools import cost
  cost.run_main()
