"""`python -m vit_jax.analyze`: the ViT paper's analysis figures of a trained model; the command
lives in `vit_jax.tools.analyze`, the computations in `vit_jax.analysis`."""
from vit_jax.tools import analyze

if __name__ == "__main__":
  analyze.run_main()
