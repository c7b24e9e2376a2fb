"""The ViT's fields checked without building a model (re-exported by :mod:`vit_jax.models.vit`)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Tuple, Union

import numpy as np

from vit_jax.models import fields
from vit_jax.models import resample
from vit_jax.models import resnet
from vit_jax.models.fields import REQUIRED, Field

#: Poolings: the class token, the tokens' mean, big_vision's MAPHead.
CLASSIFIERS = ('token', 'gap', 'map')

#: Position embeddings: learned (official) or big_vision's fixed 2-D sin-cos table.
POSEMBS = ('learn', 'sincos2d')

#: The official (flax) LayerNorm epsilon; transformers' ``google/vit-*`` have 1e-12.
LAYERNORM_EPSILON = 1e-6

#: The attention's QK normalisation parameters (:mod:`vit_jax.models.attention`), in a block.
QUERY_LN = 'Transformer/encoderblock/MultiHeadDotProductAttention_0/query_ln/scale'


def _check_layerscale(name: str, value: Any) -> None:
  if value is not None and (
      isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
      or not math.isfinite(float(value))):
    raise ValueError(f'{name} must be None (no LayerScale) or a finite float (the scales\' '
                     f'initial value, e.g. 1e-5), got {value!r}')


def _check_registers(name: str, value: Any) -> None:
  if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)
      or value < 0):
    raise ValueError(f'{name} must be an int >= 0 (register tokens, e.g. 4 for DINOv2 with '
                     f'registers), got {value!r}')


def _check_gelu(name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{name} must be a bool (True: tanh approximation, False: exact erf '
                     f'GELU), got {value!r}')


def _check_epsilon(name: str, value: Any) -> None:
  if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
      or not 0.0 < float(value) < math.inf):
    raise ValueError(f'{name} must be a positive float (e.g. 1e-6), got {value!r}')


def _check_grid(name: str, value: Any) -> None:
  if value is not None and (
      not isinstance(value, (tuple, list)) or len(value) != 2
      or any(isinstance(g, (bool, np.bool_)) or not isinstance(g, numbers.Integral) or g <= 0
             for g in value)):
    raise ValueError(f'{name} must be None or the (rows, columns) of the learned position '
                     f'table\'s token grid, two positive ints, got {value!r}')


#: The ViT's fields (:mod:`vit_jax.models.fields`), the architecture first in the order a
#: checkpoint is described; the hybrid's ResNet stem in :data:`HYBRID_FIELDS`.
VIT_FIELDS: Tuple[Field, ...] = (
    Field('patch_size', REQUIRED, tuple, 'P or (Ph, Pw): pixels per patch', True,
          check=lambda _, value: patch_pair(value)),
    Field('hidden_size', REQUIRED, int, 'D, the width of every token', True,
          timm='embed_dim', hf='hidden_size', check=fields.positive()),
    Field('num_layers', REQUIRED, int, 'L, the encoder blocks', True,
          timm='depth', hf='num_hidden_layers', check=fields.positive()),
    Field('num_heads', REQUIRED, int, 'attention heads', True,
          timm='num_heads', hf='num_attention_heads', check=fields.positive()),
    Field('mlp_dim', REQUIRED, int, 'MLP size', True, hf='intermediate_size',
          check=fields.positive()),
    Field('representation_size', None, int, 'pre-logits width (None: no pre-logits layer)', True,
          check=fields.positive(allow_none=True)),
    Field('classifier', 'token', str, f'pooling: one of {CLASSIFIERS}', True,
          check=fields.one_of(CLASSIFIERS)),
    Field('posemb', 'learn', str, f'position embedding: one of {POSEMBS}', True,
          check=fields.one_of(POSEMBS)),
    Field('layerscale_init', None, float,
          "LayerScale's initial value (None: no LayerScale; DeiT III, DINOv2)", True,
          timm='init_values', check=_check_layerscale),
    Field('num_registers', 0, int, 'register tokens after the class token', True,
          timm='reg_tokens', check=_check_registers),
    Field('no_embed_class', False, bool, 'the position table covers the patches only', True,
          timm='no_embed_class', check=fields.boolean),
    Field('fc_norm', False, bool, "a LayerNorm after classifier='gap''s pooling", True,
          timm='fc_norm', check=fields.boolean, param='fc_norm/scale'),
    Field('qk_norm', False, bool, 'a LayerNorm of the queries and keys per head (ViT-22B)', True,
          timm='qk_norm', check=fields.boolean, param=QUERY_LN),
    Field('dropout_rate', 0.0, float, 'dropout after the embeddings and in the MLPs',
          check=fields.rate),
    Field('attention_dropout_rate', 0.0, float, "dropout of the attention's weights",
          timm='attn_drop_rate', check=fields.rate),
    Field('head_bias_init', 0.0, float, "the head's initial bias (training: the regime's)"),
    *fields.EXECUTION_FIELDS,
    Field('gelu_approximate', True, bool, 'tanh GELU (official), False: exact erf GELU',
          check=_check_gelu),
    Field('layer_norm_epsilon', LAYERNORM_EPSILON, float, 'every LayerNorm\'s epsilon',
          hf='layer_norm_eps', check=_check_epsilon),
    Field('posemb_resize', 'linear_corners', str,
          'how the position table is resized to another grid (vit_jax.models.resample)',
          check=fields.one_of(resample.RESIZE_METHODS)),
    Field('posemb_grid', None, tuple,
          "the learned table's token grid when it differs from the image's (FlexiViT)",
          check=_check_grid),
)

#: The hybrid's (R+ViT) ResNet stem, after the ViT's fields (checked together:
#: :func:`vit_jax.models.resnet.validate_resnet`).
HYBRID_FIELDS: Tuple[Field, ...] = (
    Field('resnet_num_layers', REQUIRED, tuple, "the stem's units per stage, e.g. (3, 4, 9)",
          True),
    Field('resnet_width_factor', 1, float, "the stem's width over 64 channels", True),
)

_DEFAULTS = {**fields.defaults(VIT_FIELDS), 'resnet_num_layers': None,
             **fields.defaults(HYBRID_FIELDS)}

#: The ViT's field values (:data:`VIT_FIELDS`, :data:`HYBRID_FIELDS`) as one frozen object: what
#: the encoder and its blocks take whole, as the official ``Encoder`` takes ``transformer``.
Config = fields.frozen_config(VIT_FIELDS + HYBRID_FIELDS)


def value(config: Any, name: str) -> Any:
  """The field ``name`` of ``config`` (a mapping such as a config or a checkpoint's fields, or an
  object with the fields as attributes, such as a model), its default where absent."""
  if isinstance(config, Mapping) or hasattr(config, 'get'):  # A ConfigDict too.
    return config.get(name, _DEFAULTS[name])
  return getattr(config, name, _DEFAULTS[name])


def prefix_tokens(config: Any) -> int:
  """The tokens in front of the patch grid of a ViT of ``config`` (as :func:`value`): the class
  token (``classifier='token'``), then the ``num_registers`` registers (timm's
  ``num_prefix_tokens``)."""
  cls = 1 if value(config, 'classifier') == 'token' else 0
  return cls + int(value(config, 'num_registers'))


def posemb_prefix_rows(config: Any) -> int:
  """The rows of the learned position table in front of the grid's: one per prefix token
  (:func:`prefix_tokens`), none with ``no_embed_class`` (the table covers the patches only)."""
  return 0 if value(config, 'no_embed_class') else prefix_tokens(config)


def posemb_table_rows(posemb_grid: Tuple[int, int], config: Any) -> int:
  """The rows of a learned position table made for the ``posemb_grid`` token grid: one per cell,
  after the :func:`posemb_prefix_rows`."""
  return posemb_prefix_rows(config) + math.prod(posemb_grid)


def patch_pair(patch_size: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
  """``P``, ``(P,)`` or ``(Ph, Pw)`` -> ``(Ph, Pw)`` ints; ValueError unless positive ints."""
  if isinstance(patch_size, bool):
    raise ValueError(f'patch_size must be an int or a (height, width) pair, got {patch_size!r}')
  if isinstance(patch_size, int):
    pair = (patch_size, patch_size)
  else:
    try:
      pair = tuple(patch_size)
    except TypeError:
      raise ValueError(
          f'patch_size must be an int or a (height, width) pair, got {patch_size!r}') from None
    if len(pair) == 1:  # '--config.model.patch_size=4' on a tuple field gives (4,): square.
      pair = pair * 2
  if (len(pair) != 2 or any(isinstance(p, bool) or not isinstance(p, int) or p <= 0
                            for p in pair)):
    raise ValueError(
        f'patch_size must be a positive int or a pair of positive ints, got {patch_size!r}')
  return int(pair[0]), int(pair[1])


def validate_config(*, num_classes: Any = None, **config: Any) -> None:
  """Checks the ViT's fields (the declared ones: :data:`VIT_FIELDS`, :data:`HYBRID_FIELDS`; the
  absent ones' defaults; extras ignored), each by its ``check``, then together; ValueError naming
  one, TypeError for a missing required one."""
  fields.validate(VIT_FIELDS, config, num_classes)  # The hybrid's: validate_resnet below.
  values = {**_DEFAULTS, **config}
  if values['fc_norm'] and values['classifier'] != 'gap':
    raise ValueError(f"fc_norm=True (the final LayerNorm after the average pooling, timm's "
                     f"fc_norm) needs classifier='gap', got classifier={values['classifier']!r}.")
  hidden = values['hidden_size']
  heads = values['num_heads']
  if hidden % heads:
    raise ValueError(f'hidden_size ({hidden}) must be divisible by num_heads ({heads})')
  if values['posemb'] == 'sincos2d' and (hidden % 4 or hidden < 8):
    raise ValueError(f"posemb='sincos2d' needs a hidden_size that is a multiple of 4 and at least "
                     f"8, got hidden_size={hidden}; use posemb='learn' or another width.")
  resnet.validate_resnet(values['resnet_num_layers'], values['resnet_width_factor'])
  if values['posemb_grid'] is not None and values['posemb'] != 'learn':
    raise ValueError(f"posemb_grid={tuple(values['posemb_grid'])} is the learned table's grid: "
                     f"it needs posemb='learn', got posemb={values['posemb']!r} (drop "
                     'posemb_grid).')
