"""`python -m vit_jax.preflight`: the pod pre-flight, which lives in `vit_jax.tools.preflight`."""
if __name__ == "__main__":
  from vit_jax.tools.preflight import cli
  cli.run_main()
