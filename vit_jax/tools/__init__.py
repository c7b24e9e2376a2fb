"""Tools built on the library, apart from it: nothing in ``vit_jax`` imports them.

Each module's docstring says what it does; ``vit_jax/<tool>.py`` are the
``python -m vit_jax.<tool>`` entry points (README, code map).
"""
