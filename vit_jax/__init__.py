"""vit_jax: Vision Transformer (ViT) and Tokens-to-Token ViT in JAX/Flax."""

__version__ = "0.1.0"
