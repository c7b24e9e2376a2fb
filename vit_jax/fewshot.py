"""`python -m vit_jax.fewshot`: few-shot linear evaluation, which lives in `vit_jax.tools.fewshot`."""
if __name__ == "__main__":
  from vit_jax.tools import fewshot
  fewshot.run_main()
