"""Tools built on the library (nothing in ``vit_jax`` imports them); ``vit_jax/<tool>.py`` are
their ``python -m vit_jax.<tool>`` entry points, ``common`` their command-line stack."""
