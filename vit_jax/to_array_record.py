"""`python -m vit_jax.to_array_record`: ArrayRecord files (`vit_jax.tools.to_array_record`)."""
from vit_jax.tools import to_array_record

if __name__ == "__main__":
  to_array_record.run_main()
