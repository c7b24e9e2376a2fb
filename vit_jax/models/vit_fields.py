"""The ViT's fields checked without building a model (re-exported by :mod:`vit_jax.models.vit`)."""

from __future__ import annotations

import math
import numbers
from typing import Tuple, Union

import numpy as np

from vit_jax.models import execution
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

#: The ViT's fields (:mod:`vit_jax.models.fields`), the architecture first in the order a
#: checkpoint is described; the hybrid's ResNet stem in :data:`HYBRID_FIELDS`.
VIT_FIELDS: Tuple[Field, ...] = (
    Field('patch_size', REQUIRED, tuple, 'P or (Ph, Pw): pixels per patch', True),
    Field('hidden_size', REQUIRED, int, 'D, the width of every token', True,
          timm='embed_dim', hf='hidden_size'),
    Field('num_layers', REQUIRED, int, 'L, the encoder blocks', True,
          timm='depth', hf='num_hidden_layers'),
    Field('num_heads', REQUIRED, int, 'attention heads', True,
          timm='num_heads', hf='num_attention_heads'),
    Field('mlp_dim', REQUIRED, int, 'MLP size', True, hf='intermediate_size'),
    Field('representation_size', None, int, 'pre-logits width (None: no pre-logits layer)', True),
    Field('classifier', 'token', str, f'pooling: one of {CLASSIFIERS}', True),
    Field('posemb', 'learn', str, f'position embedding: one of {POSEMBS}', True),
    Field('layerscale_init', None, float,
          "LayerScale's initial value (None: no LayerScale; DeiT III, DINOv2)", True,
          timm='init_values'),
    Field('num_registers', 0, int, 'register tokens after the class token', True,
          timm='reg_tokens'),
    Field('no_embed_class', False, bool, 'the position table covers the patches only', True,
          timm='no_embed_class'),
    Field('fc_norm', False, bool, "a LayerNorm after classifier='gap''s pooling", True,
          timm='fc_norm'),
    Field('dropout_rate', 0.0, float, 'dropout after the embeddings and in the MLPs'),
    Field('attention_dropout_rate', 0.0, float, "dropout of the attention's weights",
          timm='attn_drop_rate'),
    Field('head_bias_init', 0.0, float, "the head's initial bias (training: the regime's)"),
    *fields.EXECUTION_FIELDS,
    Field('gelu_approximate', True, bool, 'tanh GELU (official), False: exact erf GELU'),
    Field('layer_norm_epsilon', LAYERNORM_EPSILON, float, 'every LayerNorm\'s epsilon',
          hf='layer_norm_eps'),
    Field('posemb_resize', 'linear_corners', str,
          'how the position table is resized to another grid (vit_jax.models.resample)'),
    Field('posemb_grid', None, tuple,
          "the learned table's token grid when it differs from the image's (FlexiViT)"),
)

#: The hybrid's (R+ViT) ResNet stem, after the ViT's fields.
HYBRID_FIELDS: Tuple[Field, ...] = (
    Field('resnet_num_layers', REQUIRED, tuple, "the stem's units per stage, e.g. (3, 4, 9)",
          True),
    Field('resnet_width_factor', 1, float, "the stem's width over 64 channels", True),
)


def prefix_tokens(classifier: str, num_registers: int = 0) -> int:
  """The tokens in front of the patch grid: the class token (``classifier='token'``), then the
  ``num_registers`` registers (timm's ``num_prefix_tokens``)."""
  return (1 if classifier == 'token' else 0) + int(num_registers)


def posemb_prefix_rows(classifier: str, num_registers: int = 0,
                       no_embed_class: bool = False) -> int:
  """The rows of the learned position table in front of the grid's: one per prefix token
  (:func:`prefix_tokens`), none with ``no_embed_class`` (the table covers the patches only)."""
  return 0 if no_embed_class else prefix_tokens(classifier, num_registers)


def posemb_table_rows(posemb_grid: Tuple[int, int], classifier: str, num_registers: int = 0,
                      no_embed_class: bool = False) -> int:
  """The rows of a learned position table made for the ``posemb_grid`` token grid: one per cell,
  after the :func:`posemb_prefix_rows`."""
  return posemb_prefix_rows(classifier, num_registers, no_embed_class) + math.prod(posemb_grid)


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


def validate_config(*, num_classes, patch_size, hidden_size, mlp_dim, num_heads, num_layers,
                    classifier, representation_size, dropout_rate, attention_dropout_rate, dtype,
                    param_dtype, scan, remat, remat_policy, attention, gelu_approximate,
                    layer_norm_epsilon, posemb, resnet_num_layers=None, resnet_width_factor=1,
                    layerscale_init=None, num_registers=0, no_embed_class=False, fc_norm=False,
                    posemb_resize='linear_corners', posemb_grid=None, **unused) -> None:
  """Checks the ViT's fields (the hybrid's and the later ones optional; extras ignored);
  ValueError naming one."""
  del unused
  if classifier not in CLASSIFIERS:
    raise ValueError(f'classifier must be one of {CLASSIFIERS}, got {classifier!r}')
  if posemb not in POSEMBS:
    raise ValueError(f'posemb must be one of {POSEMBS}, got {posemb!r}')
  if not isinstance(gelu_approximate, (bool, np.bool_)):
    raise ValueError(f'gelu_approximate must be a bool (True: tanh approximation, False: exact '
                     f'erf GELU), got {gelu_approximate!r}')
  for field, value in (('no_embed_class', no_embed_class), ('fc_norm', fc_norm)):
    if not isinstance(value, (bool, np.bool_)):
      raise ValueError(f'{field} must be True or False, got {value!r}')
  if fc_norm and classifier != 'gap':
    raise ValueError(f"fc_norm=True (the final LayerNorm after the average pooling, timm's "
                     f"fc_norm) needs classifier='gap', got classifier={classifier!r}.")
  if (isinstance(num_registers, (bool, np.bool_)) or not isinstance(num_registers, numbers.Integral)
      or num_registers < 0):
    raise ValueError(f'num_registers must be an int >= 0 (register tokens, e.g. 4 for DINOv2 '
                     f'with registers), got {num_registers!r}')
  if layerscale_init is not None and (
      isinstance(layerscale_init, (bool, np.bool_)) or not isinstance(layerscale_init, numbers.Real)
      or not math.isfinite(float(layerscale_init))):
    raise ValueError(f'layerscale_init must be None (no LayerScale) or a finite float (the '
                     f'scales\' initial value, e.g. 1e-5), got {layerscale_init!r}')
  if (isinstance(layer_norm_epsilon, (bool, np.bool_))
      or not isinstance(layer_norm_epsilon, numbers.Real)
      or not 0.0 < float(layer_norm_epsilon) < math.inf):
    raise ValueError(f'layer_norm_epsilon must be a positive float (e.g. 1e-6), got '
                     f'{layer_norm_epsilon!r}')
  execution.check_positive_int('num_classes', num_classes, allow_none=True)
  for field, value in (('hidden_size', hidden_size), ('mlp_dim', mlp_dim),
                       ('num_heads', num_heads), ('num_layers', num_layers)):
    execution.check_positive_int(field, value)
  execution.check_positive_int('representation_size', representation_size, allow_none=True)
  if hidden_size % num_heads:
    raise ValueError(f'hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})')
  if posemb == 'sincos2d' and (hidden_size % 4 or hidden_size < 8):
    raise ValueError(f"posemb='sincos2d' needs a hidden_size that is a multiple of 4 and at least "
                     f"8, got hidden_size={hidden_size}; use posemb='learn' or another width.")
  patch_pair(patch_size)
  execution.check_rate('dropout_rate', dropout_rate)
  execution.check_rate('attention_dropout_rate', attention_dropout_rate)
  execution.check_float_dtypes(dtype=dtype, param_dtype=param_dtype)
  execution.check_execution_fields(scan=scan, remat=remat, remat_policy=remat_policy,
                                   attention=attention)
  resnet.validate_resnet(resnet_num_layers, resnet_width_factor)
  check_posemb_resize(posemb, posemb_resize, posemb_grid)


def check_posemb_resize(posemb: str, posemb_resize: str, posemb_grid) -> None:
  """ValueError unless ``posemb_resize`` is one of :data:`vit_jax.models.resample.RESIZE_METHODS`
  and ``posemb_grid`` None or a pair of positive ints (with ``posemb='learn'`` only)."""
  if posemb_resize not in resample.RESIZE_METHODS:
    raise ValueError(f'posemb_resize must be one of {resample.RESIZE_METHODS}, got '
                     f'{posemb_resize!r}')
  if posemb_grid is None:
    return
  if (not isinstance(posemb_grid, (tuple, list)) or len(posemb_grid) != 2
      or any(isinstance(g, (bool, np.bool_)) or not isinstance(g, numbers.Integral) or g <= 0
             for g in posemb_grid)):
    raise ValueError(f'posemb_grid must be None or the (rows, columns) of the learned position '
                     f'table\'s token grid, two positive ints, got {posemb_grid!r}')
  if posemb != 'learn':
    raise ValueError(f"posemb_grid={tuple(posemb_grid)} is the learned table's grid: it needs "
                     f"posemb='learn', got posemb={posemb!r} (drop posemb_grid).")
