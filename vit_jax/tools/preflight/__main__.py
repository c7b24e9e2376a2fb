"""`python -m vit_jax.tools.preflight` (also `python -m vit_jax.preflight`)."""
from vit_jax.tools.preflight import cli

cli.run_main()
