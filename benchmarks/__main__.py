"""`python -m benchmarks` (from the repository root): the benchmark tool (`benchmarks`)."""
from benchmarks import cli

if __name__ == "__main__":
  cli.run_main()
