"""timm ``VisionTransformer`` weights (``.safetensors``; ``timm/models/vision_transformer.py``)
read into this project's ViT, and written (docs/checkpoints.md, "Other libraries' weights"). The
fused ``attn.qkv`` holds the q, k, v rows in that order. A file records neither its heads nor its
GELU (the exact one is read) unless this project wrote it (:data:`METADATA_KEY`)."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax.checkpoint import archive
from vit_jax.checkpoint import hf_vit
from vit_jax.checkpoint import torch_layout
from vit_jax.checkpoint import vit_shapes

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
STANDARD_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16, 1408: 16, 1664: 16}

#: Safetensors metadata key of the model fields this project writes.
METADATA_KEY = 'vit_jax_model'

#: timm's LayerNorm epsilon in VisionTransformer.
TIMM_LAYER_NORM_EPSILON = 1e-6


def is_timm_names(names: Any) -> bool:
  """Whether tensor names are timm's ViT names (``patch_embed.proj.weight`` and ``blocks.*``)."""
  names = set(names)
  return 'patch_embed.proj.weight' in names and any(n.startswith('blocks.') for n in names)


def _rename(name: str) -> Dict[str, Tuple[int, int]]:
  """Canonical names a timm name becomes: ``{canonical: (chunk, chunks)}``."""
  fused = re.match(r'^(blocks\.\d+\.attn|attn_pool)\.(qkv|kv)\.(weight|bias)$', name)
  if fused:
    prefix, what, kind = fused.groups()
    return {f'{prefix}.{p}.{kind}': (i, len(what)) for i, p in enumerate(what)}
  return {name: (0, 1)}


def _canonical(tensors: Mapping[str, Any], path: str, chunk: Any) -> Dict[str, Any]:
  """``{canonical name (:mod:`.torch_layout`): chunk(value, index, chunks)}`` of timm tensors
  (fused ``qkv``/``kv`` split); ValueError for a variant without an equivalent here (named) or
  unknown names."""
  out = {canonical: chunk(value, *where) for name, value in tensors.items()
         for canonical, where in _rename(name).items()}
  for marker, what in REFUSED:
    hit = next((n for n in out if marker in n or n.startswith(marker)), None)
    if hit is not None:
      raise ValueError(f'{path} is a timm ViT with {what} (its tensor {hit!r}). This ViT has no '
                       'equivalent, so these weights cannot be read; take a timm model without '
                       'it.')
  unknown = sorted(n for n in out if not _CANONICAL.match(n))
  if unknown:
    shown = ', '.join(unknown[:5]) + (f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else '')
    raise ValueError(f'{path} holds tensors that are not a timm VisionTransformer\'s: {shown}. '
                     "Only timm's VisionTransformer (vit_* models without the variants this "
                     'project lacks) is read.')
  return out


def fields_from(shapes: Mapping[str, Tuple[int, ...]], metadata: Mapping[str, str],
                path: str, num_heads: Optional[int] = None) -> Dict[str, Any]:
  """The model fields (:func:`vit_jax.models.create` keywords, plus ``image_size``: the square
  position grid times the patch size) of a timm file's tensor shapes and metadata; the heads
  are ``num_heads``, else the metadata's, else :data:`STANDARD_HEADS`. Raises ValueError: a
  refused variant, unknown names, or a width whose heads cannot be told."""
  canonical = _canonical(shapes, path, lambda shape, _, chunks: (shape[0] // chunks, *shape[1:]))
  fields = torch_layout.shapes_to_fields(canonical)
  saved = json.loads(metadata[METADATA_KEY]) if METADATA_KEY in metadata else {}
  fields.update(posemb='learn', gelu_approximate=bool(saved.get('gelu_approximate', False)),
                layer_norm_epsilon=TIMM_LAYER_NORM_EPSILON)
  heads = num_heads or saved.get('num_heads') or STANDARD_HEADS.get(fields['hidden_size'])
  if not heads:
    raise ValueError(f'{path}: a timm file does not record its attention heads, and width '
                     f'{fields["hidden_size"]} is not a standard ViT\'s; name them (the model\'s '
                     'num_heads, e.g. --set num_heads=N).')
  fields['num_heads'] = int(heads)
  tokens = canonical['pos_embed'][1] if 'pos_embed' in canonical else 0
  if 'cls_token' in canonical and not vit_shapes.square_side(tokens):
    tokens -= 1
  side = vit_shapes.square_side(tokens)
  patch = fields['patch_size']
  fields['image_size'] = side and side * (patch if isinstance(patch, int) else patch[0])
  return fields


def label_names(metadata: Mapping[str, str], num_classes: Optional[int]
                ) -> Optional[Tuple[str, ...]]:
  """The class names this project wrote into a file's metadata (None otherwise)."""
  try:
    names = json.loads(metadata.get(METADATA_KEY, '{}')).get('label_names')
  except ValueError:
    return None
  return tuple(str(n) for n in names) if names and len(names) == num_classes else None


def read(path: str, header: archive.Header, num_heads: Optional[int] = None
         ) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[Tuple[str, ...]]]:
  """``(params, fields with image_size, class names or None)`` of the timm file at ``path``
  with ``header`` (:func:`~.archive.read_header`), exactly; a ``no_embed_class`` position
  embedding gets a zero class row."""
  fields = fields_from(archive.shapes(header), header[1], path, num_heads)
  arrays = _canonical(archive.read_safetensors(path), path,
                      lambda array, i, chunks: np.split(np.asarray(array), chunks)[i])
  pos = arrays.get('pos_embed')
  if pos is not None and 'cls_token' in arrays and (
      vit_shapes.square_side(pos.shape[1]) and not vit_shapes.square_side(pos.shape[1] - 1)):
    arrays['pos_embed'] = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)
  params = torch_layout.to_params(arrays, fields['num_heads'])
  return params, fields, label_names(header[1], fields['num_classes'])


def to_timm(params: Mapping[str, Any]) -> Dict[str, np.ndarray]:
  """A timm ViT state dict (float32, fused ``qkv``/``kv``) from a per-layer params tree."""
  canonical = torch_layout.from_params(params)
  out = {}
  for name, value in canonical.items():
    match = re.match(r'^(blocks\.\d+\.attn|attn_pool)\.([qkv])\.(weight|bias)$', name)
    prefix, part, kind = match.groups() if match else (None, None, None)
    parts = 'kv' if prefix == 'attn_pool' else 'qkv'  # The MAP head's query is not fused.
    if not match or part not in parts:
      out[name] = value
    elif part == parts[0]:
      out[f'{prefix}.{parts}.{kind}'] = np.concatenate(
          [canonical[f'{prefix}.{p}.{kind}'] for p in parts], axis=0)
  return out


def export_problems(fields: Mapping[str, Any]) -> List[str]:
  """What timm's VisionTransformer cannot express of a model with ``fields``."""
  problems = []
  if fields.get('representation_size'):
    problems.append('a pre_logits layer (representation_size; timm has none)')
  epsilon = fields.get('layer_norm_epsilon', 1e-6)
  if epsilon != TIMM_LAYER_NORM_EPSILON:
    problems.append(f'LayerNorm epsilon {epsilon} (timm builds 1e-6; export with --to hf)')
  return problems


def output_paths(dst: str) -> List[str]:
  return [dst]


def write(dst: str, params: Mapping[str, Any], fields: Mapping[str, Any], image_size: int,
          label_names: Optional[Sequence[str]], normalization: str) -> str:
  """Writes the ``.safetensors`` file ``dst``, the fields and class names in its metadata;
  returns the ``timm.create_model`` call that loads it: the keywords give the architecture, the
  overlay the file, class count and eval preprocessing (``resolve_model_data_config``); the
  model name only picks the class."""
  saved = {k: fields[k] for k in ('num_heads', 'gelu_approximate', 'layer_norm_epsilon',
                                  'classifier') if k in fields}
  if label_names:
    saved['label_names'] = list(label_names)
  patch = fields['patch_size']
  mean, std = hf_vit.MEAN_STD[normalization]
  size = int(image_size)
  overlay = (f'dict(file={dst!r}, num_classes={fields["num_classes"] or 0}, '
             f'input_size=(3, {size}, {size}), crop_pct=1.0, interpolation=\'bilinear\', '
             f'mean={mean}, std={std})')
  args = ["'vit_base_patch16_224'", 'pretrained=True', f'pretrained_cfg_overlay={overlay}',
          f'img_size={size}', f'patch_size={patch if isinstance(patch, int) else tuple(patch)}',
          f'embed_dim={fields["hidden_size"]}', f'depth={fields["num_layers"]}',
          f'num_heads={fields["num_heads"]}',
          f'mlp_ratio={fields["mlp_dim"] / fields["hidden_size"]!r}',
          f'num_classes={fields["num_classes"] or 0}']
  args += {'gap': ['class_token=False', "global_pool='avg'", 'fc_norm=False'],
           'map': ['class_token=False', "global_pool='map'"]}.get(fields.get('classifier'), [])
  if fields.get('gelu_approximate', True):
    args.append("act_layer='gelu_tanh'")
  call = 'timm.create_model(' + ', '.join(args) + ')'
  archive.write_safetensors(dst, to_timm(params), {METADATA_KEY: json.dumps(saved),
                                                'timm_create_model': call})
  return call
