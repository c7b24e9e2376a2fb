"""The ViT's fields checked without building a model (re-exported by :mod:`vit_jax.models.vit`)."""

from __future__ import annotations

import math
import numbers
from typing import Tuple, Union

import numpy as np

from vit_jax.models import execution
from vit_jax.models import resnet

#: Poolings: the class token, the tokens' mean, big_vision's MAPHead.
CLASSIFIERS = ('token', 'gap', 'map')

#: Position embeddings: learned (official) or big_vision's fixed 2-D sin-cos table.
POSEMBS = ('learn', 'sincos2d')

#: The official (flax) LayerNorm epsilon; transformers' ``google/vit-*`` have 1e-12.
LAYERNORM_EPSILON = 1e-6


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
                    **unused) -> None:
  """Checks the ViT's fields (the hybrid's optional; extras ignored); ValueError naming one."""
  del unused
  if classifier not in CLASSIFIERS:
    raise ValueError(f'classifier must be one of {CLASSIFIERS}, got {classifier!r}')
  if posemb not in POSEMBS:
    raise ValueError(f'posemb must be one of {POSEMBS}, got {posemb!r}')
  if not isinstance(gelu_approximate, (bool, np.bool_)):
    raise ValueError(f'gelu_approximate must be a bool (True: tanh approximation, False: exact '
                     f'erf GELU), got {gelu_approximate!r}')
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
