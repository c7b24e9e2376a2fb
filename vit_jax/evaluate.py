"""`python -m vit_jax.evaluate`: model evaluation (`vit_jax.tools.evaluate`)."""
from vit_jax.tools import evaluate

if __name__ == "__main__":
  evaluate.run_main()
