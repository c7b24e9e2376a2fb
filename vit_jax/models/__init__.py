"""Model registry: ``create('ViT-B_16', num_classes=1000, **overrides)``; one :class:`Family`
per name form in :data:`FAMILIES` (its ``forms``; adding a family is one entry). Overrides are
the model's fields (``*-custom``: the architecture too); names and sizes: docs/models.md and
docs/reference.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import attention
from vit_jax.models import fields
from vit_jax.models import layout
from vit_jax.models import resnet
from vit_jax.models import t2t
from vit_jax.models import vit_fields
from vit_jax.models.execution import ImageSizeError
from vit_jax.models.layout import (LOGICAL_AXIS_NAMES, is_scanned, scan_params, unbox,
                                   unscan_params)
from vit_jax.models.t2t import T2TViT
from vit_jax.models.vit import (CLASSIFIERS, POSEMBS, VisionTransformer, patch_pair,
                                validate_config)

#: Values of the models' ``attention`` field (:mod:`vit_jax.models.attention`).
ATTENTION_IMPLEMENTATIONS = attention.IMPLEMENTATIONS

__all__ = [
    'ATTENTION_IMPLEMENTATIONS', 'CLASSIFIERS', 'FAMILIES', 'FIELD_TYPES', 'Family',
    'HYBRID_CONFIGS', 'HYBRID_MODEL_NAMES', 'HYBRID_OVERRIDE_KEYS', 'ImageSizeError',
    'LOGICAL_AXIS_NAMES', 'MODEL_NAMES', 'OVERRIDE_KEYS', 'POSEMBS', 'T2TViT', 'T2T_MODEL_NAMES',
    'T2T_OVERRIDE_KEYS', 'T2T_SIZES', 'VIT_SIZES', 'VisionTransformer', 'abstract_variables',
    'attention', 'create', 'fields', 'head_dim', 'is_scanned', 'layout', 'logical_axes',
    'model_config', 'resnet', 'resolve', 'scan_params', 't2t', 'unbox', 'unscan_params',
    'vit_fields',
]

#: ViT sizes: (num_layers, hidden_size, mlp_dim, num_heads, dropout_rate): paper Table 1 and the
#: official configs (g and G specify no dropout).
VIT_SIZES: Dict[str, Tuple[int, int, int, int, float]] = {
    'Ti': (12, 192, 768, 3, 0.0),
    'S': (12, 384, 1536, 6, 0.0),
    'B': (12, 768, 3072, 12, 0.0),
    'L': (24, 1024, 4096, 16, 0.1),
    'H': (32, 1280, 5120, 16, 0.1),
    'g': (40, 1408, 6144, 16, 0.0),
    'G': (48, 1664, 8192, 16, 0.0),
}

#: Override keys of the ViT family.
OVERRIDE_KEYS: Tuple[str, ...] = fields.names(vit_fields.VIT_FIELDS)

#: Keys accepted as overrides for the hybrid (R+ViT) family: the ViT keys plus the ResNet stem.
HYBRID_OVERRIDE_KEYS: Tuple[str, ...] = OVERRIDE_KEYS + fields.names(vit_fields.HYBRID_FIELDS)

#: Override keys of the T2T-ViT families (the reference's constructor names).
T2T_OVERRIDE_KEYS: Tuple[str, ...] = fields.names(t2t.T2T_FIELDS)

_VIT_DEFAULTS: Dict[str, Any] = fields.defaults(vit_fields.VIT_FIELDS)


@dataclasses.dataclass(frozen=True)
class Family:
  """A family: names fully matching ``pattern``, ``base_config(match)`` before the overrides,
  the ``module`` class, the accepted and ``required`` override keys, ``forms`` for messages and
  ``validate(**config)`` raising ValueError."""

  name: str
  pattern: re.Pattern
  base_config: Callable[[re.Match], Dict[str, Any]]
  module: type
  override_keys: Tuple[str, ...]
  forms: str
  required: Tuple[str, ...] = ()
  validate: Optional[Callable[..., None]] = None


def _custom(name: str, module: type, declared: Tuple[fields.Field, ...],
            validate: Callable[..., None]) -> Family:
  """The ``*-custom`` family ``name``: the ``declared`` fields' defaults; the required given."""
  required = fields.required(declared)
  pattern = re.compile('(?i:' + name.replace('+', r'\+').replace('-', '[-_]') + ')')
  return Family(name, pattern, lambda _: fields.defaults(declared), module, fields.names(declared),
                f"'{name}' ({', '.join(required)} given as overrides)", required, validate)


def _size(match: re.Match) -> str:
  raw = match.group('size')  # Case-insensitive but g (giant) and G (Gigantic).
  return raw if raw in ('g', 'G') else {k.lower(): k for k in VIT_SIZES}[raw.lower()]


def _vit_config(match: re.Match, **fields: Any) -> Dict[str, Any]:
  """The fields of the named size, then ``fields`` (a hybrid's)."""
  num_layers, hidden, mlp, heads, dropout = VIT_SIZES[_size(match)]
  return {**_VIT_DEFAULTS, 'num_layers': num_layers, 'hidden_size': hidden, 'mlp_dim': mlp,
          'num_heads': heads, 'dropout_rate': dropout, 'patch_size': int(match.group('patch')),
          **fields}


#: The official hybrids (``configs/models.py``): (depth in the name, ViT size, advertised patch)
#: -> (resnet_num_layers, patch_size, dropout_rate); width factor 1.
HYBRID_CONFIGS: Dict[Tuple[str, str, int], Tuple[Tuple[int, ...], int, float]] = {
    ('', 'Ti', 16): ((), 8, 0.0),              # R+ViT-Ti_16: stem stride 4 x patch 8 = 32.
    ('50', 'B', 16): ((3, 4, 9), 1, 0.1),      # R50+ViT-B_16: stride 16.
    ('26', 'B', 32): ((2, 2, 2, 2), 1, 0.0),   # R26+ViT-B_32: stride 32.
    ('26', 'S', 32): ((2, 2, 2, 2), 1, 0.0),   # R26+ViT-S_32: stride 32.
    ('50', 'L', 32): ((3, 4, 6, 3), 1, 0.1),   # R50+ViT-L_32: stride 32.
}

#: Canonical names of the official hybrid configurations, plus 'R+ViT-custom'.
HYBRID_MODEL_NAMES: Tuple[str, ...] = tuple(
    f'R{depth}+ViT-{size}_{patch}' for depth, size, patch in HYBRID_CONFIGS) + ('R+ViT-custom',)

_HYBRID_FIELDS = vit_fields.VIT_FIELDS + vit_fields.HYBRID_FIELDS


def _hybrid_config(match: re.Match) -> Dict[str, Any]:
  key = (match.group('depth'), _size(match), int(match.group('patch')))
  if key not in HYBRID_CONFIGS:
    raise ValueError(
        f'{match.group(0)!r} is not one of the official hybrid models '
        f'({", ".join(HYBRID_MODEL_NAMES[:-1])}). For another combination use \'R+ViT-custom\' '
        f'with the overrides {", ".join(fields.required(_HYBRID_FIELDS))}, or an official name '
        f'with overrides (e.g. resnet_num_layers=(3, 4, 6, 3)).')
  resnet_num_layers, patch, dropout = HYBRID_CONFIGS[key]
  return _vit_config(match, dropout_rate=dropout, patch_size=patch,
                     resnet_num_layers=resnet_num_layers, resnet_width_factor=1)


#: T2T-ViT sizes by depth: (embed_dim, depth, num_heads, mlp_ratio), official ``t2t_vit.py``;
#: token_dim 64; 7, 10, 12 with the Performer T2T module only.
T2T_SIZES: Dict[int, Tuple[int, int, int, float]] = {
    7: (256, 7, 4, 2.0),
    10: (256, 10, 4, 2.0),
    12: (256, 12, 4, 2.0),
    14: (384, 14, 6, 3.0),
    19: (448, 19, 7, 3.0),
    24: (512, 24, 8, 3.0),
}


def _t2t_config(match: re.Match) -> Dict[str, Any]:
  size = int(match.group('t_depth') or match.group('depth'))  # T2T-ViT_t-{t_depth}, T2T-ViT-{depth}
  embed_dim, depth, heads, mlp_ratio = T2T_SIZES[size]
  tokens_type = 'performer' if match.group('t') is None else 'transformer'
  return dict(fields.defaults(t2t.T2T_FIELDS), embed_dim=embed_dim, depth=depth,
              num_heads=heads, mlp_ratio=mlp_ratio, tokens_type=tokens_type)


FAMILIES: Tuple[Family, ...] = (
    Family('ViT', re.compile(r'(?i:vit)[-_ ]?(?P<size>(?i:ti|s|b|l|h)|g|G)[-_/]?(?P<patch>\d+)'),
           _vit_config, VisionTransformer, OVERRIDE_KEYS, validate=validate_config,
           forms="'ViT-{Ti,S,B,L,H,g,G}_{patch}' or 'ViT-{size}/{patch}' (e.g. 'ViT-B_16', "
                 "'ViT-B/16', 'vit-b16', 'ViT-Ti_4')"),
    _custom('ViT-custom', VisionTransformer, vit_fields.VIT_FIELDS, validate_config),
    Family('R+ViT (hybrid)', re.compile(
        r'(?i:r)(?P<depth>\d*)(?:\+(?i:vit)[-_ ]?|_)(?P<size>(?i:ti|s|b|l|h)|g|G)[-_/]?'
        r'(?P<patch>\d+)'), _hybrid_config, VisionTransformer, HYBRID_OVERRIDE_KEYS,
           validate=validate_config,
           forms="'R50+ViT-B_16', 'R50+ViT-L_32', 'R26+ViT-B_32', 'R26+ViT-S_32', 'R+ViT-Ti_16' "
                 "(hybrid ResNet + ViT; also 'R50+ViT-B/16', 'r50+vit-b16', AugReg style "
                 "'R26_S_32')"),
    _custom('R+ViT-custom', VisionTransformer, _HYBRID_FIELDS, validate_config),
    Family('T2T-ViT', re.compile(r'(?i:t2t[-_]vit)(?:[-_](?P<t>(?i:t))[-_](?P<t_depth>14|19|24)'
                                 r'|[-_](?P<depth>7|10|12|14|19|24))'),
           _t2t_config, T2TViT, T2T_OVERRIDE_KEYS, validate=t2t.validate_config,
           forms="'T2T-ViT-{7,10,12,14,19,24}' (Performer T2T) or 'T2T-ViT_t-{14,19,24}' "
                 "(Transformer T2T) (Tokens-to-Token ViT)"),
    _custom('T2T-ViT-custom', T2TViT, t2t.T2T_FIELDS, t2t.validate_config),
)

#: The type of every family's every field (what ``--config.model.NAME=...`` parses to).
FIELD_TYPES: Dict[str, type] = {f.name: f.type for f in _HYBRID_FIELDS + t2t.T2T_FIELDS}

#: Canonical names of the official T2T-ViT configurations, plus 'T2T-ViT-custom'.
T2T_MODEL_NAMES: Tuple[str, ...] = (
    'T2T-ViT-7', 'T2T-ViT-10', 'T2T-ViT-12', 'T2T-ViT-14', 'T2T-ViT-19', 'T2T-ViT-24',
    'T2T-ViT_t-14', 'T2T-ViT_t-19', 'T2T-ViT_t-24', 'T2T-ViT-custom')

#: Canonical names of the official ViT configurations, plus 'ViT-custom'.
MODEL_NAMES: Tuple[str, ...] = (
    'ViT-Ti_16', 'ViT-S_16', 'ViT-S_32', 'ViT-B_8', 'ViT-B_16', 'ViT-B_32', 'ViT-L_16',
    'ViT-L_32', 'ViT-H_14', 'ViT-g_14', 'ViT-G_14', 'ViT-custom')


def _valid_forms() -> str:
  return '; '.join(f.forms for f in FAMILIES)


def resolve(name: str) -> Tuple[Family, re.Match]:
  """``(family, match)`` of a model name; ValueError listing the valid forms if none accepts it."""
  if not isinstance(name, str):
    raise ValueError(f'Model name must be a string, got {name!r}. Valid forms: {_valid_forms()}')
  for family in FAMILIES:
    match = family.pattern.fullmatch(name.strip())
    if match:
      return family, match
  raise ValueError(f'Unknown model name {name!r}. Valid forms: {_valid_forms()}. '
                   f'Official names: '
                   f'{", ".join(MODEL_NAMES + HYBRID_MODEL_NAMES + T2T_MODEL_NAMES)}')


def model_config(name: str, **overrides: Any) -> Dict[str, Any]:
  """The model's fields (all but ``num_classes``) for ``name`` and ``overrides``; ``patch_size``
  an ``(h, w)`` tuple. ValueError: an unknown name, a bad value, a missing required override;
  TypeError: an unknown override key."""
  family, match = resolve(name)
  unknown = sorted(set(overrides) - set(family.override_keys))
  if unknown:
    close = difflib.get_close_matches(unknown[0], family.override_keys, n=1)
    raise TypeError(f'Unknown override(s) {unknown} for model {name!r}. Valid keys: '
                    f'{", ".join(family.override_keys)}.'
                    + (f" Did you mean '{close[0]}'?" if close else ''))
  missing = [k for k in family.required if k not in overrides]
  if missing:
    raise ValueError(f'Model {name!r} needs the overrides {missing} '
                     f'(required: {", ".join(family.required)})')
  config = family.base_config(match)
  config.update(overrides)
  if 'patch_size' in config:
    config['patch_size'] = patch_pair(config['patch_size'])
  for key in ('resnet_num_layers', 'posemb_grid'):  # As ml_collections has them: tuples.
    if isinstance(config.get(key), (list, tuple)):
      config[key] = tuple(config[key])
  if family.validate is not None:
    family.validate(num_classes=None, **config)
  return config


def create(name: str, *, num_classes: Optional[int], **overrides: Any) -> nn.Module:
  """The (uninitialised) model of a registry name; ``num_classes=None``: no head. Raises as
  :func:`model_config`, and ValueError for a bad ``num_classes``."""
  config = model_config(name, **overrides)
  family, _ = resolve(name)
  return family.module(num_classes=num_classes, **config)


def head_dim(name: str, **overrides: Any) -> int:
  """The backbone attention's head size ``D / heads``; arguments and errors as :func:`model_config`.
  """
  config = model_config(name, **overrides)
  width = config['hidden_size'] if 'hidden_size' in config else config['embed_dim']
  return width // config['num_heads']


def abstract_variables(model: nn.Module, image_shape: Sequence[int] = (224, 224)) -> Any:
  """``jax.eval_shape`` of ``model.init`` on one ``(H, W[, C=3])`` image, params boxed.
  ValueError: a malformed or unsupported ``image_shape``."""
  shape = tuple(int(s) for s in image_shape) + ((3,) if len(image_shape) == 2 else ())
  if len(shape) != 3:
    raise ValueError(f'image_shape must be (height, width) or (height, width, channels), got '
                     f'{tuple(image_shape)!r}')
  return jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1,) + shape, jnp.float32), train=False))


def logical_axes(model: nn.Module, image_shape: Sequence[int] = (224, 224)) -> Any:
  """The logical ``PartitionSpec`` of every variable (e.g. the head kernel's ``('embed',
  'classes')``; T2T-ViT's constants ``()``). Raises as :func:`abstract_variables`."""
  return nn.get_partition_spec(abstract_variables(model, image_shape))
