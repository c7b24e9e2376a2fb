"""The training config: its defaults, the one function that resolves and validates it, its JSON.

  config = vit_jax.config.get_config('ViT-B_16', 'imagenet2012')   # every key, with defaults
  resolved = vit_jax.config.resolve(config, num_train_examples=..., num_classes=...,
                                    devices=jax.devices())       # what runs, checked
  text = vit_jax.config.to_json(resolved)                        # WORKDIR/config.json

`defaults` lists every key with its meaning; `resolve` (module `resolution`) fills the regime, the
schedule in steps and the attention implementation and checks every value; `args` parses the
`:<arg>` of `configs/*.py`; `slices` fits a recipe's batch to a TPU slice.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections

from vit_jax.config import args
from vit_jax.config import slices
from vit_jax.config.defaults import ATTENTION_CHOICES
from vit_jax.config.defaults import AUGMENTATIONS
from vit_jax.config.defaults import BAD_IMAGES
from vit_jax.config.defaults import get_config
from vit_jax.config.defaults import NORMALIZATIONS
from vit_jax.config.defaults import REGIME_DEFAULTS
from vit_jax.config.defaults import TRAINING_DEFAULTS
from vit_jax.config.resolution import attention_choice
from vit_jax.config.resolution import check_batch_size
from vit_jax.config.resolution import check_host_limits
from vit_jax.config.resolution import check_value
from vit_jax.config.resolution import fill_regime
from vit_jax.config.resolution import for_counting
from vit_jax.config.resolution import num_train_steps
from vit_jax.config.resolution import remat_choice
from vit_jax.config.resolution import resolve
from vit_jax.config.resolution import validate_data

__all__ = [
    'ATTENTION_CHOICES', 'AUGMENTATIONS', 'BAD_IMAGES', 'NORMALIZATIONS', 'REGIME_DEFAULTS',
    'TRAINING_DEFAULTS', 'args', 'attention_choice', 'check_batch_size', 'check_host_limits',
    'check_value', 'fill_regime', 'for_counting', 'from_json', 'get_config', 'num_train_steps',
    'remat_choice', 'resolve', 'slices', 'to_json', 'validate_data',
]


def to_json(config: ml_collections.ConfigDict) -> str:
  """The config as indented JSON (tuples become lists), e.g. for `WORKDIR/config.json`."""
  return json.dumps(config.to_dict(), indent=1, sort_keys=True, default=str)


def from_json(text: str) -> ml_collections.ConfigDict:
  """A config from :func:`to_json`'s text (tuple fields stay lists); ValueError if not an object."""
  value: Any = json.loads(text)
  if not isinstance(value, dict):
    raise ValueError(f"A config is a JSON object, got {type(value).__name__}.")
  return ml_collections.ConfigDict(value)
