"""`python -m vit_jax.benchmark`: the benchmark tool, which lives in `vit_jax.tools.benchmark`."""
if __name__ == "__main__":
  from vit_jax.tools.benchmark import cli
  cli.run_main()
