"""Looking inside a ViT (the ViT paper's Fig. 6, 7 and 14) from arrays; :mod:`.figures` draws
(matplotlib, imported on its own)."""

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
