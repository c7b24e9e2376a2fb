"""The benchmark's timm model for timm's ViT variants (issue 41): LayerScale, registers,
no_embed_class and fc_norm reach timm.create_model as init_values, reg_tokens, no_embed_class,
fc_norm, where set; so does QK normalisation (issue 51) as qk_norm. The parameter counts are
what timm 1.0.31 gives for these keyword arguments
(`sum(p.numel() for p in timm.create_model(name, num_classes=1000, **kwargs).parameters())`)."""

import jax
import numpy as np
import pytest

from benchmarks import timm as timm_lib
from vit_jax import models

TINY = dict(hidden_size=64, mlp_dim=128, num_heads=2, num_layers=2, patch_size=8)
VARIANTS = dict(num_registers=4, layerscale_init=1e-5, no_embed_class=True)


def _count(name, overrides):
  model = models.create(name, num_classes=1000, **overrides)
  shapes = models.unbox(models.abstract_variables(model, (224, 224)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("name, overrides, timm_name, kwargs, timm_params", [
    ("ViT-S_16", VARIANTS, "vit_small_patch16_224",  # DINOv2-style S/16 with 4 registers.
     dict(init_values=1e-5, reg_tokens=4, no_embed_class=True), 22_061_032),
    ("ViT-custom", dict(TINY, classifier="gap", fc_norm=True, **VARIANTS), "vit_base_patch16_224",
     dict(embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, patch_size=8, class_token=False,
          global_pool="avg", init_values=1e-5, reg_tokens=4, no_embed_class=True, fc_norm=True),
     195_112),
    ("ViT-S_16", dict(qk_norm=True), "vit_small_patch16_224",  # Issue 51: QK normalisation.
     dict(qk_norm=True), 22_053_736),
])
def test_timm_variants_are_passed_to_timm(name, overrides, timm_name, kwargs, timm_params):
  assert timm_lib.timm_equivalent(name, overrides) == (timm_name, kwargs, False)
  assert _count(name, overrides) == timm_params


def test_unset_variants_are_not_passed():
  _, kwargs, _ = timm_lib.timm_equivalent("ViT-S_16", dict(num_registers=0, fc_norm=False,
                                                          no_embed_class=False))
  assert kwargs == {}
  _, kwargs, _ = timm_lib.timm_equivalent("ViT-S_16", dict(layerscale_init=0.0))
  assert kwargs == {"init_values": 0.0}  # Set, even if zero.
