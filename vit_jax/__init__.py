"""vit_jax: Vision Transformer (ViT) and Tokens-to-Token ViT (T2T-ViT) in JAX/Flax."""

__version__ = "0.1.0"
