"""`python -m vit_jax.cost`: the cost estimator (`vit_jax.tools.cost`)."""
from vit_jax.tools import cost

if __name__ == "__main__":
  cost.run_main()
