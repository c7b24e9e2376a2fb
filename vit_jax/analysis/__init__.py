"""Looking inside a ViT: attention rollout, mean attention distance, position-embedding
similarity and the principal components of the patch-embedding filters (the ViT paper's
Fig. 6, 7 and 14), computed from arrays (NumPy or JAX) that the caller takes from a model.

* :mod:`vit_jax.analysis.attention_maps`: :func:`rollout`, :func:`class_token_map`,
  :func:`layer_class_token_maps`, :func:`upsample`, :func:`mean_attention_distance`,
  :func:`mean_attention_distances`, :func:`patch_distances`.
* :mod:`vit_jax.analysis.embeddings`: :func:`posemb_similarity`,
  :func:`embedding_filter_components`.
* :mod:`vit_jax.analysis.figures` (matplotlib, Agg canvas; imported on its own so that the
  computations do not load matplotlib): the PNG figures and their uint8 RGB arrays.
"""

from vit_jax.analysis.attention_maps import class_token_map
from vit_jax.analysis.attention_maps import HEAD_FUSIONS
from vit_jax.analysis.attention_maps import layer_class_token_maps
from vit_jax.analysis.attention_maps import mean_attention_distance
from vit_jax.analysis.attention_maps import mean_attention_distances
from vit_jax.analysis.attention_maps import patch_distances
from vit_jax.analysis.attention_maps import rollout
from vit_jax.analysis.attention_maps import upsample
from vit_jax.analysis.embeddings import embedding_filter_components
from vit_jax.analysis.embeddings import posemb_similarity
