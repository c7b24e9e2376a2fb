"""timm ``VisionTransformer`` weights (``.safetensors``; ``timm/models/vision_transformer.py``)
read into this project's ViT, and written (docs/checkpoints.md, "Other libraries' weights"). The
fused ``attn.qkv`` holds the q, k, v rows in that order. A file records neither its heads nor its
GELU (the model's, else the exact one) unless this project wrote it (:data:`METADATA_KEY`).
timm's variants map to the model's fields: LayerScale ``blocks.N.ls{1,2}.gamma`` (DeiT III,
DINOv2) to ``LayerScale_{0,1}/scale``, ``reg_token`` to ``registers``, ``fc_norm`` to
``fc_norm``, a table of the patches only (``no_embed_class``) to ``no_embed_class=True``."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax import rundir
from vit_jax.checkpoint import archive
from vit_jax.checkpoint import hf_vit
from vit_jax.checkpoint import torch_layout
from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint.tree import flatten_params, unflatten_params
from vit_jax.models import vit_fields

#: Families of names that have no equivalent in this project's ViT, with what they are.
REFUSED = (
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
    r'(weight|bias)|attn_pool\.(latent|(q|k|v|proj|norm|mlp\.fc1|mlp\.fc2)\.(weight|bias))|'
    r'reg_token|fc_norm\.(weight|bias)|blocks\.\d+\.ls[12]\.gamma)$')

#: timm's LayerScale (``blocks.{i}.ls{1,2}.gamma``) and this ViT's (``LayerScale_{0,1}``).
_TIMM_LAYERSCALE = re.compile(r'^blocks\.(\d+)\.ls([12])\.gamma$')
_OUR_LAYERSCALE = re.compile(r'^Transformer/encoderblock_(\d+)/LayerScale_([01])/scale$')

#: Heads of the standard ViT widths (ViT paper Table 1; Ti and S from DeiT).
STANDARD_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16, 1408: 16, 1664: 16}

#: Safetensors metadata key of the model fields this project writes.
METADATA_KEY = 'vit_jax_model'

#: timm's LayerNorm epsilon in VisionTransformer.
TIMM_LAYER_NORM_EPSILON = 1e-6

#: How timm resamples a learned position table to another grid (``resample_abs_pos_embed``'s
#: defaults, at load and with ``dynamic_img_size``: bicubic, antialiased): the fields'
#: ``posemb_resize`` (``ecosystem.RESAMPLING``).
POSEMB_RESIZE = 'bicubic_antialias'


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
  if 'fc_norm.weight' in out and ({'cls_token', 'attn_pool.latent', 'norm.weight'} & set(out)):
    pooled = ('a class token and a LayerNorm after the average pooling' if 'cls_token' in out
              else 'a LayerNorm after the attention pooling' if 'attn_pool.latent' in out
              else 'a LayerNorm both before and after the average pooling')
    raise ValueError(
        f"{path} is a timm ViT with {pooled} (timm's fc_norm, its default with "
        "global_pool='avg'; its tensor 'fc_norm.weight'). This ViT has fc_norm only with "
        "classifier='gap' and no class token (timm's class_token=False, global_pool='avg'), so "
        'these weights cannot be read; take a timm model without it.')
  unknown = sorted(n for n in out if not _CANONICAL.match(n))
  if unknown:
    shown = ', '.join(unknown[:5]) + (f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else '')
    raise ValueError(f'{path} holds tensors that are not a timm VisionTransformer\'s: {shown}. '
                     "Only timm's VisionTransformer (vit_* models without the variants this "
                     'project lacks) is read.')
  return out


def _saved(metadata: Mapping[str, str], path: str) -> Dict[str, Any]:
  """The model facts this project wrote into a file's metadata (:data:`METADATA_KEY`; ``{}``
  without), read bounded (:func:`rundir.parse_json`). Raises ValueError naming the file: not a
  JSON object, or a field of the wrong type."""
  if METADATA_KEY not in metadata:
    return {}
  name = f'the {METADATA_KEY!r} metadata of {path}'
  fix = 'write the file again with python -m vit_jax.convert'
  saved = rundir.parse_json(metadata[METADATA_KEY], name, fix=fix)
  kinds = {'num_heads': (int, 'an integer'), 'layerscale_init': ((int, float), 'a number'),
           'gelu_approximate': (bool, 'true or false'), 'label_names': (list, 'a list')}
  if not isinstance(saved, dict):
    raise ValueError(f'{name} is not a JSON object; {fix}.')
  for key, (kind, what) in kinds.items():
    if saved.get(key) is not None and not isinstance(saved[key], kind):
      raise ValueError(f'{name}: {key} is {repr(saved[key])[:80]}, not {what}; {fix}.')
  return saved


def fields_from(shapes: Mapping[str, Tuple[int, ...]], metadata: Mapping[str, str],
                path: str, num_heads: Optional[int] = None,
                gelu_approximate: Optional[bool] = None) -> Dict[str, Any]:
  """The model fields (:func:`vit_jax.models.create` keywords, plus ``image_size``: the square
  position grid times the patch size) of a timm file's tensor shapes and metadata; the heads
  are ``num_heads``, else the metadata's, else :data:`STANDARD_HEADS`; the GELU the metadata's,
  else ``gelu_approximate`` (the model's), else timm's exact one; ``posemb_resize`` timm's
  (:data:`POSEMB_RESIZE`). timm's variants (LayerScale,
  registers, ``fc_norm``, ``no_embed_class``) only where present. Raises ValueError: a refused
  variant, unknown names, or a width whose heads cannot be told."""
  canonical = _canonical(shapes, path, lambda shape, _, chunks: (shape[0] // chunks, *shape[1:]))
  fields = torch_layout.shapes_to_fields(canonical)
  saved = _saved(metadata, path)
  gelu = saved.get('gelu_approximate', gelu_approximate)
  fields.update(posemb='learn', gelu_approximate=bool(gelu),
                layer_norm_epsilon=TIMM_LAYER_NORM_EPSILON, posemb_resize=POSEMB_RESIZE)
  heads = num_heads or saved.get('num_heads') or STANDARD_HEADS.get(fields['hidden_size'])
  if not heads:
    raise ValueError(f'{path}: a timm file does not record its attention heads, and width '
                     f'{fields["hidden_size"]} is not a standard ViT\'s; name them (the model\'s '
                     'num_heads, e.g. --set num_heads=N).')
  fields['num_heads'] = int(heads)
  if any(_TIMM_LAYERSCALE.match(n) for n in canonical):
    fields['layerscale_init'] = float(saved.get('layerscale_init') or vit_shapes.LAYERSCALE_INIT)
  if 'reg_token' in canonical:
    fields['num_registers'] = int(canonical['reg_token'][1])
  if 'fc_norm.weight' in canonical:
    fields['fc_norm'] = True
  tokens = canonical['pos_embed'][1] if 'pos_embed' in canonical else 0
  prefix = vit_fields.prefix_tokens(fields['classifier'], fields.get('num_registers', 0))
  if tokens and not vit_shapes.table_has_prefix(tokens, prefix):
    fields['no_embed_class'] = True
  side = vit_shapes.square_side(tokens - vit_fields.posemb_prefix_rows(
      fields['classifier'], fields.get('num_registers', 0), fields.get('no_embed_class', False)))
  patch = fields['patch_size']
  fields['image_size'] = side and side * (patch if isinstance(patch, int) else patch[0])
  return fields


def _as_norm(canonical: Dict[str, Any]) -> Dict[str, Any]:
  """``canonical`` with timm's ``fc_norm`` (after the pooling) as the final ``norm`` that
  :mod:`.torch_layout` converts (the two are exclusive in timm); see :func:`_timm_only`."""
  if 'fc_norm.weight' not in canonical:
    return canonical
  out = {k: v for k, v in canonical.items() if not k.startswith('fc_norm.')}
  out.update({'norm.weight': canonical['fc_norm.weight'], 'norm.bias': canonical['fc_norm.bias']})
  return out


def _timm_only(params: Dict[str, Any], arrays: Mapping[str, Any]) -> Dict[str, Any]:
  """``params`` (:func:`.torch_layout.to_params` of :func:`_as_norm` ``arrays``) with timm's
  variants that transformers' ViT lacks: ``registers``, ``LayerScale_{0,1}/scale`` per block,
  and ``fc_norm`` (read as the final norm) moved out of ``Transformer/encoder_norm``."""
  flat = flatten_params(params)
  if 'fc_norm.weight' in arrays:
    for ours in ('scale', 'bias'):
      flat[f'fc_norm/{ours}'] = flat.pop(f'Transformer/encoder_norm/{ours}')
  if 'reg_token' in arrays:
    flat['registers'] = np.asarray(arrays['reg_token'])
  for name, value in arrays.items():
    match = _TIMM_LAYERSCALE.match(name)
    if match:
      block, which = match.groups()
      flat[f'Transformer/encoderblock_{block}/LayerScale_{int(which) - 1}/scale'] = (
          np.asarray(value))
  return unflatten_params(flat)


def label_names(metadata: Mapping[str, str], num_classes: Optional[int]
                ) -> Optional[Tuple[str, ...]]:
  """The class names this project wrote into a file's metadata (None otherwise)."""
  try:
    names = _saved(metadata, '').get('label_names')
  except ValueError:
    return None
  return tuple(str(n) for n in names) if names and len(names) == num_classes else None


def read(path: str, header: archive.Header, num_heads: Optional[int] = None,
         gelu_approximate: Optional[bool] = None
         ) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[Tuple[str, ...]]]:
  """``(params, fields with image_size, class names or None)`` of the timm file at ``path``
  with ``header`` (:func:`~.archive.read_header`), exactly (``num_heads``, ``gelu_approximate``:
  as :func:`fields_from`)."""
  fields = fields_from(archive.shapes(header), header[1], path, num_heads, gelu_approximate)
  arrays = _canonical(archive.read_safetensors(path), path,
                      lambda array, i, chunks: np.split(np.asarray(array), chunks)[i])
  params = _timm_only(torch_layout.to_params(_as_norm(arrays), fields['num_heads']), arrays)
  return params, fields, label_names(header[1], fields['num_classes'])


def to_timm(params: Mapping[str, Any]) -> Dict[str, np.ndarray]:
  """A timm ViT state dict (float32, fused ``qkv``/``kv``; timm's variants: ``reg_token``,
  ``blocks.N.ls{1,2}.gamma``, ``fc_norm``) from a per-layer params tree."""
  flat = {k: np.asarray(v, np.float32) for k, v in flatten_params(params).items()}
  variants = {}
  if 'registers' in flat:
    variants['reg_token'] = flat.pop('registers')
  for name in list(flat):
    match = _OUR_LAYERSCALE.match(name)
    if match:
      block, which = match.groups()
      variants[f'blocks.{block}.ls{int(which) + 1}.gamma'] = flat.pop(name)
  if 'fc_norm/scale' in flat:  # Converted as the final norm, renamed below.
    for ours in ('scale', 'bias'):
      flat[f'Transformer/encoder_norm/{ours}'] = flat.pop(f'fc_norm/{ours}')
  canonical = torch_layout.from_params(unflatten_params(flat))
  if 'fc_norm' in params:
    canonical = {('fc_' + k if k.startswith('norm.') else k): v for k, v in canonical.items()}
  canonical.update({k: np.ascontiguousarray(v) for k, v in variants.items()})
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
                                  'classifier', 'layerscale_init') if k in fields}
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
  args += {'gap': ['class_token=False', "global_pool='avg'",
                   f"fc_norm={bool(fields.get('fc_norm'))}"],
           'map': ['class_token=False', "global_pool='map'"]}.get(fields.get('classifier'), [])
  if fields.get('layerscale_init') is not None:
    args.append(f"init_values={fields['layerscale_init']!r}")
  if fields.get('num_registers'):
    args.append(f"reg_tokens={fields['num_registers']}")
  if fields.get('no_embed_class') and vit_fields.prefix_tokens(
      fields.get('classifier', 'token'), fields.get('num_registers', 0)):
    args.append('no_embed_class=True')
  if fields.get('gelu_approximate', True):
    args.append("act_layer='gelu_tanh'")
  call = 'timm.create_model(' + ', '.join(args) + ')'
  archive.write_safetensors(dst, to_timm(params), {METADATA_KEY: json.dumps(saved),
                                                'timm_create_model': call})
  return call
