"""What a ViT checkpoint's parameter shapes (``'/'``-joined names, collection first, as in the
official checkpoints) say about the model that wrote it."""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional, Tuple

from vit_jax.models import resnet
from vit_jax.models import vit_fields

#: The learned position embedding (``[1, T, D]``, class token row first with classifier 'token'),
#: resized to the new token grid when fine-tuning (:func:`vit_jax.checkpoint.resize_posemb`).
POSEMB_KEY = 'params/Transformer/posembed_input/pos_embedding'

#: What LayerScale weights read as (DINOv2's ``init_values``): a file holds the trained scales,
#: not the value they started from, which only a fresh model's initialisation uses.
LAYERSCALE_INIT = 1e-5

_LAYERSCALE = re.compile(r'^params/Transformer/encoderblock(_\d+)?/LayerScale_[01]/scale$')


def architecture_fields(shapes: dict) -> Optional[Dict[str, Any]]:
  """The :class:`~vit_jax.models.vit.VisionTransformer` fields that ``shapes`` (``'/'``-joined
  name -> shape, per-layer or scanned) imply: the architecture (``num_heads``, ``mlp_dim`` None
  without their kernels; the ResNet stem's), ``classifier`` ('map' with ``MAPHead_0/probe``,
  'token' with ``cls``, else 'gap'), ``posemb`` ('sincos2d' without :data:`POSEMB_KEY`) and
  ``num_classes`` (None without a head); not the numerics, which leave no trace. None for
  shapes not a ViT's (no 4-D ``embedding/kernel``). timm's variants, only where present:
  ``layerscale_init`` (:data:`LAYERSCALE_INIT`) with ``LayerScale_*`` scales, ``num_registers``
  the rows of ``registers``, ``fc_norm`` with an ``fc_norm``, ``no_embed_class`` with a table
  of the grid only (:func:`table_has_prefix`)."""
  embedding = shapes.get('params/embedding/kernel')
  if not embedding or len(embedding) != 4:
    return None
  kh, kw, _, width = embedding
  head = shapes.get('params/head/kernel')
  blocks = {k.split('/')[2] for k in shapes if k.startswith('params/Transformer/encoderblock')}
  query = next((s for k, s in shapes.items()
                if k.endswith('MultiHeadDotProductAttention_0/query/kernel')), None)
  mlp = next((s[-1] for k, s in shapes.items() if k.endswith('MlpBlock_0/Dense_0/kernel')), None)
  layers = (int(shapes[next(k for k in shapes if '/encoderblock/' in k)][0])
            if blocks == {'encoderblock'} else len(blocks))
  pre_logits = shapes.get('params/pre_logits/kernel')
  fields = dict(patch_size=kh if kh == kw else (kh, kw), hidden_size=width, num_layers=layers,
                num_heads=query[-2] if query is not None else None, mlp_dim=mlp,
                representation_size=pre_logits[-1] if pre_logits else None,
                classifier=('map' if 'params/MAPHead_0/probe' in shapes
                            else 'token' if 'params/cls' in shapes else 'gap'),
                posemb='learn' if POSEMB_KEY in shapes else 'sincos2d',
                num_classes=head[-1] if head else None)
  fields.update(variant_fields(shapes, fields['classifier']))
  if 'params/conv_root/kernel' in shapes:  # ResNet stem: params/block{stage}/unit{unit}/...
    units = {}
    for m in filter(None, map(re.compile(r'^params/block(\d+)/unit(\d+)/.').match, shapes)):
      units[int(m[1])] = max(units.get(int(m[1]), 0), int(m[2]))
    fields['resnet_num_layers'] = tuple(units[s] for s in sorted(units))
    fields['resnet_width_factor'] = shapes['params/conv_root/kernel'][-1] / 64
  return fields


def variant_fields(shapes: dict, classifier: str) -> Dict[str, Any]:
  """The fields of timm's variants that ``shapes`` (as :func:`architecture_fields`) hold, the
  non-default ones only: ``layerscale_init``, ``num_registers``, ``fc_norm``,
  ``no_embed_class``."""
  fields = {}
  if any(_LAYERSCALE.match(k) for k in shapes):
    fields['layerscale_init'] = LAYERSCALE_INIT
  registers = shapes.get('params/registers')
  if registers:
    fields['num_registers'] = int(registers[1])
  if 'params/fc_norm/scale' in shapes:
    fields['fc_norm'] = True
  table = shapes.get(POSEMB_KEY)
  prefix = vit_fields.prefix_tokens(classifier, fields.get('num_registers', 0))
  if table and not table_has_prefix(table[1], prefix):
    fields['no_embed_class'] = True
  return fields


def table_has_prefix(rows: int, prefix: int) -> bool:
  """Whether a learned table of ``rows`` rows has one for each of the ``prefix`` tokens in front
  of the grid (official, timm's default) or covers the grid only (timm's ``no_embed_class``):
  the latter when ``rows`` make a square grid and ``rows - prefix`` none (a non-square grid
  reads as the former)."""
  return not (prefix and square_side(rows) and not square_side(rows - prefix))


def table_prefix_rows(shapes: dict) -> int:
  """The rows of the learned table (:data:`POSEMB_KEY`) in ``shapes`` before the grid's: one
  per class token and register, none when it covers the grid only (:func:`table_has_prefix`);
  0 without a table. What the fine-tuning resize keeps as they are."""
  table = shapes.get(POSEMB_KEY)
  if not table:
    return 0
  registers = shapes.get('params/registers')
  prefix = (1 if 'params/cls' in shapes else 0) + (int(registers[1]) if registers else 0)
  return prefix if table_has_prefix(table[1], prefix) else 0


def image_size(shapes: dict, fields: Dict[str, Any]) -> Optional[int]:
  """The side of the square images the learned position table is for (tokens' grid side times
  the total stride of ``fields``, :func:`architecture_fields`); None without a square table."""
  table = shapes.get(POSEMB_KEY)
  if not table:
    return None
  tokens = table[1] - table_prefix_rows(shapes)
  stride = vit_fields.patch_pair(fields['patch_size'])[0]
  if fields.get('resnet_num_layers') is not None:
    stride *= resnet.resnet_stride(fields['resnet_num_layers'])
  side = square_side(tokens)
  return side and side * stride


def token_grid(image_size: Any, fields: Optional[Dict[str, Any]]) -> Optional[Tuple[int, int]]:
  """The ``(rows, columns)`` token grid of ``image_size`` px images (``S`` or ``(H, W)``) for a
  ViT of ``fields`` (``patch_size``; ``resnet_num_layers``: a hybrid's stem stride); None when
  either is unknown (not a ViT's, not sizes) or the stride does not divide the sides."""
  if not image_size or not fields or fields.get('patch_size') is None:
    return None
  try:
    height, width = vit_fields.patch_pair(image_size)
    stem = fields.get('resnet_num_layers')
    stride = 1 if stem is None else resnet.resnet_stride(stem)
    ph, pw = (p * stride for p in vit_fields.patch_pair(fields['patch_size']))
  except (TypeError, ValueError):  # Not sizes (a damaged record).
    return None
  return None if height % ph or width % pw else (height // ph, width // pw)


def square_side(tokens: int) -> Optional[int]:
  """The side of a square grid of ``tokens`` tokens, or None when they make none."""
  side = math.isqrt(max(int(tokens), 0))
  return side if tokens > 0 and side * side == tokens else None


#: Recorded fields that `describe_architecture` does not list as `name=value`: the pooling and
#: the position embedding are said only where not the default, the stem's width not at all.
_DESCRIBED_APART = ('classifier', 'posemb', 'resnet_width_factor')


def describe_architecture(shapes: dict) -> Optional[str]:
  """:func:`architecture_fields` in a sentence for error messages (``'The checkpoint is a
  ViT[ with a ResNet stem] with patch_size=.., ...[, N classes].'``), or None."""
  fields = architecture_fields(shapes)
  if fields is None:
    return None
  names = [f.name for f in vit_fields.VIT_FIELDS + vit_fields.HYBRID_FIELDS
           if f.in_weights and f.name not in _DESCRIBED_APART]
  text = ', '.join(f'{k}={fields[k]}' for k in names
                   if k in fields and (fields[k] is not None or k == 'representation_size'))
  if fields['classifier'] == 'map':  # ('token' and 'gap' are not named, as before.)
    text += ", classifier='map'"
  if fields['posemb'] != 'learn':
    text += f", posemb={fields['posemb']!r}"
  stem = ' with a ResNet stem' if 'resnet_num_layers' in fields else ''
  classes = f', {fields["num_classes"]} classes' if fields['num_classes'] else ''
  return f'The checkpoint is a ViT{stem} with {text}{classes}.'
