"""Looking inside a ViT (the ViT paper's Fig. 6, 7 and 14) from arrays; :mod:`.figures` draws
(matplotlib, imported on its own)."""

from vit_jax.analysis.attention_maps import (HEAD_FUSIONS, class_token_map, layer_class_token_maps,
                                             mean_attention_distance, mean_attention_distances,
                                             patch_distances, rollout, upsample)
from vit_jax.analysis.embeddings import embedding_filter_components, posemb_similarity
