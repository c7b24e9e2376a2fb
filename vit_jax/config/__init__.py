"""The training config: its defaults, the one function that resolves and validates it, its JSON.

  config = vit_jax.config.get_config('ViT-B_16', 'imagenet2012')   # every key, with defaults
  resolved = vit_jax.config.resolve(config, num_train_examples=..., num_classes=...,
                                    devices=jax.devices())       # what runs, checked
  text = vit_jax.config.to_json(resolved)                        # WORKDIR/config.json

Submodules: `keys` (a key's declaration, `ConfigError`), `defaults` (every key, declared once),
`resolution` (`resolve`), `args`, `slices`, each saying what it does.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Union

import ml_collections

from vit_jax import rundir
from vit_jax.config import args
from vit_jax.config import keys
from vit_jax.config import slices
from vit_jax.config.defaults import BAD_IMAGES, REGIME_DEFAULTS, get_config
from vit_jax.config.keys import ConfigError
from vit_jax.config.resolution import (attention_choice, check_batch_size, check_host_limits,
                                       check_paths, fill_regime, for_counting, num_train_steps,
                                       remat_choice, resolve, resume_changes, switch_regime,
                                       validate_data)

__all__ = [
    'BAD_IMAGES', 'ConfigError', 'REGIME_DEFAULTS', 'args', 'attention_choice', 'check_batch_size',
    'check_host_limits', 'check_paths', 'fill_regime', 'for_counting', 'from_json', 'get_config',
    'keys', 'num_train_steps', 'remat_choice', 'resolve', 'resume_changes', 'slices',
    'switch_regime', 'to_json', 'validate_data',
]


def to_json(config: ml_collections.ConfigDict) -> str:
  """The config as indented JSON (tuples become lists), e.g. for `WORKDIR/config.json`."""
  return json.dumps(config.to_dict(), indent=1, sort_keys=True, default=str)


def _as_tuples(value: Any) -> Any:
  return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def _update(config: ml_collections.ConfigDict, saved: Dict[str, Any]) -> None:
  """Sets ``config``'s keys to the ``saved`` values (lists as tuples); keys gone are left out."""
  for key, value in saved.items():
    if key not in config:
      continue
    if isinstance(config[key], ml_collections.ConfigDict) and isinstance(value, dict):
      _update(config[key], value)
    else:
      config[key] = _as_tuples(value)


def from_json(saved: Union[str, Dict[str, Any]]) -> ml_collections.ConfigDict:
  """The config of :func:`to_json`'s text or dict (``WORKDIR/config.json``) on this version's
  defaults (a key added since keeps its default; no eval batch: the training batch). Raises
  ValueError (not a JSON object), ValueError or TypeError (a model name or field gone since)."""
  value = rundir.parse_json(saved, 'The config') if isinstance(saved, str) else saved
  if not isinstance(value, dict):
    raise ValueError(f"A config is a JSON object, got {type(value).__name__}.")
  if not isinstance(value.get("model_name"), str):
    raise ValueError(f"A config's model_name is a string, got "
                     f"{repr(value.get('model_name'))[:80]}.")
  for key in ("model", "data"):
    if not isinstance(value.get(key) or {}, dict):
      raise ValueError(f"A config's {key} is a JSON object, got {repr(value[key])[:80]}.")
  model = {k: _as_tuples(v) for k, v in (value.get('model') or {}).items()}
  dataset = (value.get('data') or {}).get('name') or 'imagenet2012'
  config = get_config(value['model_name'], dataset, **model)
  config.unlock()
  _update(config, value)
  if config.eval_batch_size is None:
    config.eval_batch_size = config.batch_size
  return config
