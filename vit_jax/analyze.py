"""`python -m vit_jax.analyze`: a model's analysis figures (`vit_jax.tools.analyze`)."""
from vit_jax.tools import analyze

if __name__ == "__main__":
  analyze.run_main()
