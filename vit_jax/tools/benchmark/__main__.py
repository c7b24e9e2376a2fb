"""`python -m vit_jax.tools.benchmark`: the benchmark's command line (`cli.run_main`)."""

from vit_jax.tools.benchmark import cli

if __name__ == "__main__":
  cli.run_main()
