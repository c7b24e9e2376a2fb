"""`python -m vit_jax.analyze`: the ViT paper's analysis figures (attention rollout, mean
attention distance, position-embedding similarity, patch-embedding filters) of a trained model;
the command lives in `vit_jax.tools.analyze`, the computations in `vit_jax.analysis`."""

if __name__ == "__main__":
  from vit_jax.tools import analyze
  analyze.run_main()
