"""`python -m vit_jax.benchmark`: the benchmark tool (`vit_jax.tools.benchmark`)."""
from vit_jax.tools.benchmark import cli

if __name__ == "__main__":
  cli.run_main()
