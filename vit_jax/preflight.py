"""`python -m vit_jax.preflight`: the pod pre-flight (`vit_jax.tools.preflight`)."""
from vit_jax.tools.preflight import cli

if __name__ == "__main__":
  cli.run_main()
