"""big_vision's ViT ``.npz`` layout, read as the official one (exactly).

big_vision (google-research/big_vision, ``big_vision/models/vit.py``) writes the official
module names with three differences that :func:`to_official` undoes:

* the learned position embedding is a top-level ``pos_embedding`` (older files:
  ``Transformer/pos_embedding``) that covers the patch tokens only: it is added before the class
  token is prepended, so the class token gets none. The official layout adds its table after
  the class token is prepended: the same computation is a zero row in front of the table, ``cls``
  unchanged. (Files whose table already has the class row, ``N = g^2 + 1``, are in the official
  order as they are.)
* ``posemb='sincos2d'`` models store no position embedding (a fixed table): read as such (the
  ViT's ``posemb`` field, :func:`vit_jax.models.vit.architecture_fields`).
* multihead attention pooling (``pool_type='map'``) stores ``MAPHead_0/{probe,
  MultiHeadDotProductAttention_0, LayerNorm_0, MlpBlock_0}`` (during ViT-G's development these
  sat at the top level: moved under ``MAPHead_0``): the ViT's ``classifier='map'``.

Scanned checkpoints (``Transformer/encoderblock`` with a leading layer axis) are unrolled to
``encoderblock_{i}``, the layout every ``.npz`` is returned in. A file without a class token or
MAP head is read as ``'gap'`` pooling (big_vision's ``pool_type='0'``, the first token without a
class token, cannot be told from the weights and is not supported).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping

import numpy as np

from vit_jax.models import layout

_MAP_PARTS = ('probe', 'MlpBlock_0', 'MultiHeadDotProductAttention_0', 'LayerNorm_0')


def is_big_vision(params: Mapping[str, Any]) -> bool:
  """Whether a ViT params tree read from an ``.npz`` is in big_vision's layout (a position table
  outside ``Transformer/posembed_input``, a MAP head, or no position table at all)."""
  if 'embedding' not in params or not isinstance(params.get('Transformer'), Mapping):
    return False
  encoder = params['Transformer']
  return ('posembed_input' not in encoder or 'pos_embedding' in params
          or 'pos_embedding' in encoder or 'MAPHead_0' in params or 'probe' in params)


def to_official(params: Mapping[str, Any]) -> Dict[str, Any]:
  """The official-layout params tree (per-layer) that computes what big_vision's does.

  Args:
    params: a nested params tree read from a big_vision ``.npz`` (no ``params/`` prefix).

  Returns:
    A new tree: ``Transformer/posembed_input/pos_embedding`` (a zero class row in front of
    big_vision's table when there is a class token), ``MAPHead_0`` gathered, blocks unrolled.
  """
  out = dict(params)
  encoder = dict(out['Transformer'])
  table = out.pop('pos_embedding', None)
  if table is None:
    table = encoder.pop('pos_embedding', None)
  if 'probe' in out:
    out['MAPHead_0'] = {k: out.pop(k) for k in _MAP_PARTS if k in out}
  if table is not None:
    table = np.asarray(table)
    tokens = table.shape[1]
    if 'cls' in out and not (tokens > 1 and math.isqrt(tokens - 1) ** 2 == tokens - 1):
      table = np.concatenate([np.zeros_like(table[:, :1]), table], axis=1)
    encoder['posembed_input'] = {'pos_embedding': table}
  out['Transformer'] = encoder
  if layout.is_scanned(out, prefix='encoderblock'):
    out = layout.unscan_params(out, prefix='encoderblock')
  return out
