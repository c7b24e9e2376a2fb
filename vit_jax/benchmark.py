"""`python -m vit_jax.benchmark` moved to `python -m benchmarks`, which runs from the repository's
root (benchmarks/README.md): a development tool, not installed with the package."""
import sys

if __name__ == "__main__":
  print("FATAL: the benchmark is no longer part of the package: run `python -m benchmarks` from "
        "the root of the vit_jax repository (benchmarks/README.md).", file=sys.stderr)
  sys.exit(2)
