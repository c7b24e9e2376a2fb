"""timm ``VisionTransformer`` weights (``.safetensors``) to and from this project's ViT.

timm's names (``timm/models/vision_transformer.py``): ``cls_token`` (1, 1, D), ``pos_embed``
(1, 1 + N, D; the class row first, or N rows with ``no_embed_class=True``: the class token then
gets no position embedding, read as a zero row), ``patch_embed.proj``, ``blocks.{i}.norm1``,
a fused ``blocks.{i}.attn.qkv`` ((3D, D): the query, key and value rows in that order, heads
contiguous within each), ``attn.proj``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``, ``norm``, ``head``;
``attn_pool.{latent, q, kv, proj, norm, mlp}`` for ``global_pool='map'`` (big_vision's MAP
head). LayerNorm epsilon 1e-6 and the exact (erf) GELU unless the model was built with another
``act_layer``; the file does not say, nor how many heads there are (given by the model or taken
from the standard ViT widths, :func:`standard_heads`).

Variants without an equivalent here are refused by name (:data:`REFUSED`): the LayerNorm after
average pooling (``fc_norm``, timm's default with ``global_pool='avg'``), register tokens,
LayerScale, QK normalisation, a norm before the blocks (CLIP), DeiT's distillation token.

Files this project writes (:func:`to_timm`) carry their model fields in the safetensors
metadata (``vit_jax_model``), so that they read back exactly (the GELU, the heads).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from vit_jax.checkpoint import torch_layout

#: Families of names that have no equivalent in this project's ViT, with what they are.
REFUSED = (
    ('fc_norm.', "a LayerNorm after the average pooling (timm's fc_norm, its default with "
                 "global_pool='avg'); this ViT's 'gap' averages after the final LayerNorm "
                 "(timm's fc_norm=False)"),
    ('reg_token', 'register tokens (reg_tokens > 0)'),
    ('.ls1.', 'LayerScale (init_values)'), ('.ls2.', 'LayerScale (init_values)'),
    ('.q_norm.', 'QK normalisation (qk_norm=True)'), ('.k_norm.', 'QK normalisation'),
    ('norm_pre.', 'a LayerNorm before the blocks (pre_norm=True, CLIP-style)'),
    ('patch_embed.norm.', 'a LayerNorm after the patch embedding'),
    ('dist_token', "DeiT's distillation token"), ('head_dist.', "DeiT's distillation head"),
    ('.attn.norm.', 'a LayerNorm inside attention (scale_attn_norm)'),
    ('.mlp.norm.', 'a LayerNorm inside the MLP (scale_mlp_norm)'),
    ('attn_pool.pos_embed', 'a position embedding in the attention pooling'),
)

_CANONICAL = re.compile(
    r'^(cls_token|pos_embed|patch_embed\.proj\.(weight|bias)|norm\.(weight|bias)|'
    r'head\.(weight|bias)|blocks\.\d+\.(norm1|norm2|attn\.(q|k|v|proj)|mlp\.fc1|mlp\.fc2)\.'
    r'(weight|bias)|attn_pool\.(latent|(q|k|v|proj|norm|mlp\.fc1|mlp\.fc2)\.(weight|bias)))$')

#: Heads of the standard ViT widths (ViT paper Table 1; Ti and S from DeiT).
_STANDARD_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16, 1408: 16, 1664: 16}

#: Safetensors metadata key of the model fields this project writes.
METADATA_KEY = 'vit_jax_model'

#: timm's LayerNorm epsilon in VisionTransformer.
TIMM_LAYER_NORM_EPSILON = 1e-6


def is_timm_names(names: Any) -> bool:
  """Whether tensor names are timm's ViT names (``patch_embed.proj.weight`` and ``blocks.*``)."""
  names = set(names)
  return 'patch_embed.proj.weight' in names and any(n.startswith('blocks.') for n in names)


def standard_heads(width: int) -> Optional[int]:
  """The head count of a standard ViT of this width (None for other widths)."""
  return _STANDARD_HEADS.get(int(width))


def _split(value: Any, parts: int) -> Tuple[np.ndarray, ...]:
  value = np.asarray(value)
  return tuple(np.split(value, parts, axis=0))


def _rename(name: str) -> Dict[str, Optional[Tuple[str, int, int]]]:
  """Canonical names a timm name becomes: ``{canonical: (timm name, chunk, chunks)}``."""
  fused = re.match(r'^(blocks\.\d+\.attn|attn_pool)\.(qkv|kv)\.(weight|bias)$', name)
  if fused:
    prefix, what, kind = fused.groups()
    return {f'{prefix}.{p}.{kind}': (name, i, len(what)) for i, p in enumerate(what)}
  return {name: (name, 0, 1)}


def canonical_shapes(shapes: Mapping[str, Tuple[int, ...]], path: str
                     ) -> Dict[str, Tuple[int, ...]]:
  """Canonical name -> shape (see :mod:`.torch_layout`) of timm tensor shapes.

  Raises:
    ValueError: a variant without an equivalent here (named), or unknown tensor names.
  """
  out = {}
  for name, shape in shapes.items():
    for canonical, (_, _, chunks) in _rename(name).items():
      out[canonical] = (shape[0] // chunks,) + tuple(shape[1:])
  _check_names(out, path)
  return out


def _check_names(canonical: Mapping[str, Any], path: str) -> None:
  for marker, what in REFUSED:
    hit = next((n for n in canonical if marker in n or n.startswith(marker)), None)
    if hit is not None:
      raise ValueError(f'{path} is a timm ViT with {what} (its tensor {hit!r}). This ViT has no '
                       'equivalent, so these weights cannot be read; take a timm model without '
                       'it.')
  unknown = sorted(n for n in canonical if not _CANONICAL.match(n))
  if unknown:
    shown = ', '.join(unknown[:5]) + (f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else '')
    raise ValueError(f'{path} holds tensors that are not a timm VisionTransformer\'s: {shown}. '
                     "Only timm's VisionTransformer (vit_* models without the variants this "
                     'project lacks) is read.')


def canonical_arrays(arrays: Mapping[str, np.ndarray], path: str) -> Dict[str, np.ndarray]:
  """Canonical name -> array of a timm state dict (fused ``qkv``/``kv`` split; a
  ``no_embed_class`` position embedding gets a zero class row)."""
  out = {}
  for name, value in arrays.items():
    for canonical, (_, index, chunks) in _rename(name).items():
      out[canonical] = _split(value, chunks)[index] if chunks > 1 else np.asarray(value)
  _check_names(out, path)
  pos = out.get('pos_embed')
  if pos is not None and 'cls_token' in out:
    tokens = pos.shape[1]
    if math.isqrt(tokens) ** 2 == tokens and math.isqrt(tokens - 1) ** 2 != tokens - 1:
      out['pos_embed'] = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)
  return out


def fields_from(shapes: Mapping[str, Tuple[int, ...]], metadata: Mapping[str, str],
                path: str, num_heads: Optional[int] = None) -> Dict[str, Any]:
  """The model fields (:func:`vit_jax.models.create` keywords) a timm file implies.

  Args:
    shapes: the file's tensor names -> shapes (timm names).
    metadata: its safetensors metadata (:data:`METADATA_KEY` when this project wrote it).
    path: for messages.
    num_heads: the heads when known (the model's); else the metadata's, else the standard ViT
      head count of the width.

  Returns:
    The architecture fields plus ``posemb='learn'``, ``gelu_approximate`` (False: timm's exact
    GELU, unless the metadata says otherwise), ``layer_norm_epsilon`` 1e-6, ``num_heads`` and
    ``image_size`` (the position grid times the patch size; square grids).

  Raises:
    ValueError: a refused variant, unknown names, or a width whose heads cannot be told.
  """
  canonical = canonical_shapes(shapes, path)
  fields = torch_layout.shapes_to_fields(canonical)
  saved = json.loads(metadata[METADATA_KEY]) if METADATA_KEY in metadata else {}
  fields.update(posemb='learn', gelu_approximate=bool(saved.get('gelu_approximate', False)),
                layer_norm_epsilon=TIMM_LAYER_NORM_EPSILON)
  heads = num_heads or saved.get('num_heads') or standard_heads(fields['hidden_size'])
  if not heads:
    raise ValueError(f'{path}: a timm file does not record its attention heads, and width '
                     f'{fields["hidden_size"]} is not a standard ViT\'s; name them (the model\'s '
                     'num_heads, e.g. --set num_heads=N).')
  fields['num_heads'] = int(heads)
  tokens = canonical['pos_embed'][1] if 'pos_embed' in canonical else 0
  if 'cls_token' in canonical and math.isqrt(tokens) ** 2 != tokens:
    tokens -= 1
  side = math.isqrt(tokens)
  patch = fields['patch_size']
  fields['image_size'] = side * (patch if isinstance(patch, int) else patch[0]) if (
      side * side == tokens and tokens) else None
  return fields


def label_names(metadata: Mapping[str, str], num_classes: Optional[int]
                ) -> Optional[Tuple[str, ...]]:
  """The class names this project wrote into a file's metadata (None otherwise)."""
  try:
    names = json.loads(metadata.get(METADATA_KEY, '{}')).get('label_names')
  except ValueError:
    return None
  return tuple(str(n) for n in names) if names and len(names) == num_classes else None


def from_timm(arrays: Mapping[str, np.ndarray], num_heads: int, path: str) -> Dict[str, Any]:
  """This project's params tree (per-layer) from a timm ViT state dict (exact)."""
  return torch_layout.to_params(canonical_arrays(arrays, path), num_heads)


def to_timm(params: Mapping[str, Any]) -> Dict[str, np.ndarray]:
  """A timm ViT state dict (float32, fused ``qkv``/``kv``) from a per-layer params tree."""
  canonical = torch_layout.from_params(params)
  out = {}
  for name, value in canonical.items():
    match = re.match(r'^(blocks\.\d+\.attn|attn_pool)\.([qkv])\.(weight|bias)$', name)
    if not match:
      out[name] = value
      continue
    prefix, part, kind = match.groups()
    parts = 'qkv' if prefix != 'attn_pool' else 'kv'
    if part == 'q' and prefix == 'attn_pool':
      out[name] = value
    elif part == parts[0]:
      out[f'{prefix}.{parts}.{kind}'] = np.concatenate(
          [canonical[f'{prefix}.{p}.{kind}'] for p in parts], axis=0)
  return out


def create_model_call(fields: Mapping[str, Any], file: str, image_size: int,
                      normalization: str = 'minus_one_to_one') -> str:
  """The ``timm.create_model(...)`` call that loads a file written by :func:`to_timm`.

  timm's model name only picks the class (``VisionTransformer``) and a default config; the
  keywords give the architecture, and the overlay the file, the class count and the evaluation
  preprocessing (input size, a plain resize, the normalisation) that timm's
  ``resolve_model_data_config`` returns.
  """
  patch = fields['patch_size']
  mean = (0.485, 0.456, 0.406) if normalization == 'imagenet' else (0.5, 0.5, 0.5)
  std = (0.229, 0.224, 0.225) if normalization == 'imagenet' else (0.5, 0.5, 0.5)
  size = int(image_size)
  overlay = (f'dict(file={file!r}, num_classes={fields["num_classes"] or 0}, '
             f'input_size=(3, {size}, {size}), crop_pct=1.0, interpolation=\'bilinear\', '
             f'mean={mean}, std={std})')
  args = ["'vit_base_patch16_224'", 'pretrained=True', f'pretrained_cfg_overlay={overlay}',
          f'img_size={size}', f'patch_size={patch if isinstance(patch, int) else tuple(patch)}',
          f'embed_dim={fields["hidden_size"]}', f'depth={fields["num_layers"]}',
          f'num_heads={fields["num_heads"]}',
          f'mlp_ratio={fields["mlp_dim"] / fields["hidden_size"]!r}',
          f'num_classes={fields["num_classes"] or 0}']
  classifier = fields.get('classifier', 'token')
  if classifier == 'gap':
    args += ['class_token=False', "global_pool='avg'", 'fc_norm=False']
  elif classifier == 'map':
    args += ['class_token=False', "global_pool='map'"]
  if fields.get('gelu_approximate', True):
    args.append("act_layer='gelu_tanh'")
  return 'timm.create_model(' + ', '.join(args) + ')'
