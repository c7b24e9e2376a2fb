"""vit_jax: the Vision Transformer (ViT) in JAX/Flax; Tokens-to-Token ViT is planned (issue #3)."""

__version__ = "0.1.0"
