"""vit_jax's compiled kernels: each one's C++ source, its build and its JAX loader side by side.

``cpu_attention``: fused softmax attention for XLA:CPU (``cpu_attention.cc``, built by
``build.py`` through the top-level ``setup.py``, loaded by ``cpu_attention.py``;
docs/kernels.md).
"""
