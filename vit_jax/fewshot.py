"""`python -m vit_jax.fewshot`: few-shot linear evaluation (`vit_jax.tools.fewshot`)."""
from vit_jax.tools import fewshot

if __name__ == "__main__":
  fewshot.run_main()
