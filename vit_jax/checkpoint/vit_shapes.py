"""What a ViT checkpoint's parameter shapes (``'/'``-joined names, collection first, as in the
official checkpoints) say about the model that wrote it."""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from vit_jax.models import fields as fields_lib
from vit_jax.models import resnet
from vit_jax.models import vit_fields
from vit_jax.models.resample import square_side

#: The learned position embedding ``[1, T, D]`` (class-token and register rows first).
POSEMB_KEY = 'params/Transformer/posembed_input/pos_embedding'

#: What LayerScale weights read as (DINOv2's ``init_values``; a file holds the trained scales).
LAYERSCALE_INIT = 1e-5

_LAYERSCALE = re.compile(r'^params/Transformer/encoderblock(_\d+)?/LayerScale_[01]/scale$')

#: Declared fields that say nothing of what trained weights compute: how the blocks run and
#: training alone (dropout, the head's initial bias).
_NOT_KEPT = fields_lib.names(fields_lib.EXECUTION_FIELDS) + (
    'dropout_rate', 'attention_dropout_rate', 'head_bias_init')

#: The fields a checkpoint this project writes keeps beside its arrays (docs/checkpoints.md,
#: "What a conversion keeps"): every declared ViT field but :data:`_NOT_KEPT`, so that what the
#: shapes do not record survives every conversion.
KEPT_FIELDS = tuple(f.name for f in vit_fields.VIT_FIELDS + vit_fields.HYBRID_FIELDS
                    if f.name not in _NOT_KEPT)


class AmbiguousTableError(ValueError):
  """A learned position table whose row count fits two layouts (:func:`table_layouts`)."""


def kept_fields(fields: Any) -> Dict[str, Any]:
  """The :data:`KEPT_FIELDS` of ``fields`` (a mapping, e.g. a config's ``model``), JSON-able:
  tuples as lists, absent ones left out."""
  plain = lambda v: [plain(x) for x in v] if isinstance(v, (tuple, list)) else v
  return {k: plain(fields[k]) for k in KEPT_FIELDS if k in fields}


def from_kept(record: Any) -> Dict[str, Any]:
  """The model fields in a kept ``record`` (:func:`kept_fields`, read back from JSON): the
  :data:`KEPT_FIELDS` only, JSON lists as tuples."""
  if not isinstance(record, dict):
    return {}
  tupled = lambda v: tuple(tupled(x) for x in v) if isinstance(v, list) else v
  return {k: tupled(record[k]) for k in KEPT_FIELDS if k in record}


def classifier_from(shapes: Any, *, probe: str, class_token: str) -> str:
  """The classifier the parameter names in ``shapes`` imply: 'map' with the attention-pooling
  ``probe``, 'token' with the ``class_token``, else 'gap' (each format passes its names)."""
  if probe in shapes:
    return 'map'
  if class_token in shapes:
    return 'token'
  return 'gap'


def architecture_fields(shapes: dict, image_size: Optional[int] = None,
                        strict: bool = True) -> Optional[Dict[str, Any]]:
  """The :class:`~vit_jax.models.vit.VisionTransformer` fields that ``shapes`` (``'/'``-joined
  name -> shape, per-layer or scanned) imply: the architecture (``num_heads``, ``mlp_dim``,
  ``num_classes``: None without their kernels), ``classifier``, ``posemb`` and timm's variants
  (:func:`variant_fields`, ``image_size`` and ``strict`` as there); not the numerics, which
  leave no trace. None for shapes not a ViT's (no 4-D ``embedding/kernel``)."""
  embedding = shapes.get('params/embedding/kernel')
  if not embedding or len(embedding) != 4:
    return None
  kh, kw, _, width = embedding
  head = shapes.get('params/head/kernel')
  blocks = {k.split('/')[2] for k in shapes if k.startswith('params/Transformer/encoderblock')}
  query = next((s for k, s in shapes.items()
                if k.endswith('MultiHeadDotProductAttention_0/query/kernel')), None)
  mlp = next((s[-1] for k, s in shapes.items() if k.endswith('MlpBlock_0/Dense_0/kernel')), None)
  if blocks == {'encoderblock'}:  # Scanned: the layers are the stacked axis.
    stacked = next(k for k in shapes if '/encoderblock/' in k)
    layers = int(shapes[stacked][0])
  else:
    layers = len(blocks)
  pre_logits = shapes.get('params/pre_logits/kernel')
  classifier = classifier_from(shapes, probe='params/MAPHead_0/probe', class_token='params/cls')
  patch_size = kh if kh == kw else (kh, kw)
  num_heads = query[-2] if query is not None else None
  representation_size = pre_logits[-1] if pre_logits else None
  posemb = 'learn' if POSEMB_KEY in shapes else 'sincos2d'
  num_classes = head[-1] if head else None
  fields = dict(patch_size=patch_size, hidden_size=width, num_layers=layers,
                num_heads=num_heads, mlp_dim=mlp, representation_size=representation_size,
                classifier=classifier, posemb=posemb, num_classes=num_classes)
  fields.update(variant_fields(shapes, fields['classifier'], image_size, strict))
  if 'params/conv_root/kernel' in shapes:  # ResNet stem: params/block{stage}/unit{unit}/...
    units = {}
    for m in filter(None, map(re.compile(r'^params/block(\d+)/unit(\d+)/.').match, shapes)):
      units[int(m[1])] = max(units.get(int(m[1]), 0), int(m[2]))
    fields['resnet_num_layers'] = tuple(units[s] for s in sorted(units))
    fields['resnet_width_factor'] = shapes['params/conv_root/kernel'][-1] / 64
  return fields


def variant_fields(shapes: dict, classifier: str, image_size: Optional[int] = None,
                   strict: bool = True, patch_size: Any = None) -> Dict[str, Any]:
  """The non-default fields of timm's variants that ``shapes`` (as :func:`architecture_fields`)
  hold: LayerScale, registers, each bool field its parameter records
  (:func:`vit_jax.models.fields.recorded`) and ``no_embed_class`` with a table of the grid only
  (:func:`table_layouts`). A table that fits both is read at ``image_size`` (with ``patch_size``,
  default the ``embedding/kernel``'s), else raises :class:`AmbiguousTableError`, or with
  ``strict=False`` leaves ``no_embed_class`` out."""
  fields = fields_lib.recorded(vit_fields.VIT_FIELDS, shapes)
  if any(_LAYERSCALE.match(k) for k in shapes):
    fields['layerscale_init'] = LAYERSCALE_INIT
  registers = shapes.get('params/registers')
  if registers:
    fields['num_registers'] = int(registers[1])
  table = shapes.get(POSEMB_KEY)
  if not table:
    return fields
  prefix = vit_fields.prefix_tokens(dict(fields, classifier=classifier))
  layouts = table_layouts(table[1], prefix)
  patch = vit_fields.patch_pair(patch_size or shapes['params/embedding/kernel'][0])[0]
  if len(layouts) == 2 and image_size:
    side = int(image_size) // patch
    layouts = [rows for rows in layouts if square_side(table[1] - rows) == side] or layouts
  if len(layouts) == 2:
    if strict:
      raise AmbiguousTableError(_ambiguity(patch, table[1], prefix, image_size))
    return fields
  if layouts == [0] and prefix:
    fields['no_embed_class'] = True
  return fields


def table_layouts(rows: int, prefix: int) -> list:
  """The rows before the grid that a learned table of ``rows`` rows can have with ``prefix``
  class-token and register tokens: ``[prefix]`` (the default; also for a non-square grid),
  ``[0]`` (timm's ``no_embed_class``), or ``[prefix, 0]`` where both leave a square grid."""
  if not prefix or not square_side(rows):
    return [prefix]
  return [prefix, 0] if square_side(rows - prefix) else [0]


def _ambiguity(patch: int, rows: int, prefix: int, image_size: Optional[int]) -> str:
  small, large = square_side(rows - prefix), square_side(rows)
  told = f' (the stated image size {image_size} px fits neither)' if image_size else ''
  return (f'The position table has {rows} rows, which fit two layouts{told}: the {prefix} '
          f'class-token and register rows then a {small}x{small} grid ({small * patch} px, '
          f'no_embed_class=False), or a {large}x{large} grid alone ({large * patch} px, '
          "no_embed_class=True, timm's DINOv2-with-registers layout). The weights cannot tell: "
          'state the field no_embed_class (--config.model.no_embed_class=True or False; '
          '--set no_embed_class=... for the tools), or keep the config.json that came with '
          "the weights (timm's Hub config.json, with pretrained_cfg input_size) beside them.")


def table_prefix_rows(shapes: dict) -> int:
  """The rows of the learned table in ``shapes`` before the grid's (:func:`variant_fields`'s
  ``no_embed_class``, raising as there); 0 without a table."""
  fields = architecture_fields(shapes)
  return 0 if not fields or POSEMB_KEY not in shapes else vit_fields.posemb_prefix_rows(fields)


def image_size(shapes: dict, fields: Dict[str, Any]) -> Optional[int]:
  """The side of the square images the learned position table in ``shapes`` is for, with the
  stride and prefix rows of ``fields`` (:func:`architecture_fields`); None without a square
  table."""
  table = shapes.get(POSEMB_KEY)
  if not table:
    return None
  tokens = table[1] - vit_fields.posemb_prefix_rows(fields)
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


#: Recorded fields that `describe_architecture` does not list as `name=value`.
_DESCRIBED_APART = ('classifier', 'posemb', 'resnet_width_factor')


def describe_architecture(shapes: dict) -> Optional[str]:
  """:func:`architecture_fields` in a sentence for error messages (``'The checkpoint is a
  ViT[ with a ResNet stem] with patch_size=.., ...[, N classes].'``), or None."""
  fields = architecture_fields(shapes, strict=False)  # For messages: never raises.
  if fields is None:
    return None
  names = [f.name for f in vit_fields.VIT_FIELDS + vit_fields.HYBRID_FIELDS
           if f.in_weights and f.name not in _DESCRIBED_APART]
  text = ', '.join(f'{k}={fields[k]}' for k in names
                   if k in fields and (fields[k] is not None or k == 'representation_size'))
  if fields['classifier'] == 'map':  # ('token' and 'gap' are not named.)
    text += ", classifier='map'"
  if fields['posemb'] != 'learn':
    text += f", posemb={fields['posemb']!r}"
  stem = ' with a ResNet stem' if 'resnet_num_layers' in fields else ''
  classes = f', {fields["num_classes"]} classes' if fields['num_classes'] else ''
  return f'The checkpoint is a ViT{stem} with {text}{classes}.'
