"""timm ``VisionTransformer`` weights (``.safetensors``; ``timm/models/vision_transformer.py``)
read into this project's ViT, and written (docs/checkpoints.md, "Other libraries' weights"). The
fused ``attn.qkv`` holds the q, k, v rows in that order. A file records neither its heads nor its
GELU unless this project wrote it (:data:`METADATA_KEY`). timm's variants map by name
(:mod:`.torch_layout`); timm's keywords are the fields' ``timm`` names (``vit_fields``)."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import archive
from vit_jax.checkpoint import hf_vit
from vit_jax.checkpoint import torch_layout
from vit_jax.checkpoint import vit_shapes
from vit_jax.models import fields as fields_lib
from vit_jax.models import vit_fields

#: Families of names that have no equivalent in this project's ViT, with what they are.
REFUSED = (
    ('norm_pre.', 'a LayerNorm before the blocks (pre_norm=True, CLIP-style)'),
    ('patch_embed.norm.', 'a LayerNorm after the patch embedding'),
    ('dist_token', "DeiT's distillation token"), ('head_dist.', "DeiT's distillation head"),
    ('.attn.norm.', 'a LayerNorm inside attention (scale_attn_norm)'),
    ('.mlp.norm.', 'a LayerNorm inside the MLP (scale_mlp_norm)'),
    ('attn_pool.pos_embed', 'a position embedding in the attention pooling'),
)

#: Heads of the standard ViT widths (ViT paper Table 1; Ti and S from DeiT).
STANDARD_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16, 1408: 16, 1664: 16}

#: Safetensors metadata key of the model fields this project writes.
METADATA_KEY = 'vit_jax_model'

#: timm's LayerNorm epsilon in VisionTransformer.
TIMM_LAYER_NORM_EPSILON = 1e-6

#: How timm resamples a learned position table to another grid (``resample_abs_pos_embed``'s
#: defaults): the fields' ``posemb_resize``.
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
  out = {}
  for name, value in tensors.items():
    for canonical, where in _rename(name).items():
      out[canonical] = chunk(value, *where)
  for marker, what in REFUSED:
    hit = next((n for n in out if marker in n), None)
    if hit is not None:
      raise ValueError(f'{path} is a timm ViT with {what} (its tensor {hit!r}). This ViT has no '
                       'equivalent, so these weights cannot be read; take a timm model without '
                       'it.')
  if 'fc_norm.weight' in out and ({'cls_token', 'attn_pool.latent', 'norm.weight'} & set(out)):
    if 'cls_token' in out:
      pooled = 'a class token and a LayerNorm after the average pooling'
    elif 'attn_pool.latent' in out:
      pooled = 'a LayerNorm after the attention pooling'
    else:
      pooled = 'a LayerNorm both before and after the average pooling'
    raise ValueError(
        f"{path} is a timm ViT with {pooled} (timm's fc_norm, its default with "
        "global_pool='avg'; its tensor 'fc_norm.weight'). This ViT has fc_norm only with "
        "classifier='gap' and no class token (timm's class_token=False, global_pool='avg'), so "
        'these weights cannot be read; take a timm model without it.')
  known = torch_layout.our_names(out)  # The names this ViT has (timm's variants included).
  unknown = sorted(n for n in out if n not in known)
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
           'gelu_approximate': (bool, 'true or false'), 'label_names': (list, 'a list'),
           'no_embed_class': (bool, 'true or false'), 'image_size': (int, 'an integer'),
           'posemb_resize': (str, 'a string'), 'normalization': (str, 'a string'),
           'eval_crop_pct': ((int, float), 'a number')}
  if not isinstance(saved, dict):
    raise ValueError(f'{name} is not a JSON object; {fix}.')
  for key, (kind, what) in kinds.items():
    if saved.get(key) is not None and not isinstance(saved[key], kind):
      raise ValueError(f'{name}: {key} is {repr(saved[key])[:80]}, not {what}; {fix}.')
  return saved


#: The config timm's Hub repositories keep beside ``model.safetensors`` (``architecture``,
#: ``num_classes``, ``model_args``, ``pretrained_cfg`` with ``input_size``).
HUB_CONFIG = 'config.json'


def _hub_config_file(path: str) -> Tuple[str, Dict[str, Any]]:
  """``(its path, timm's :data:`HUB_CONFIG` beside the file at path)``, the config ``{}``
  without one (or with transformers' config.json, which has no ``architecture``). Raises
  ValueError for a damaged file (named)."""
  file = storage.join(os.path.dirname(path) or '.', HUB_CONFIG)
  if not storage.exists(file):
    return file, {}
  config = rundir.read_json(file, fix='restore the config.json timm saved with the weights, '
                            'or remove it') or {}
  return file, config if 'architecture' in config else {}


def _pretrained_cfg(config: Mapping[str, Any]) -> Dict[str, Any]:
  """A Hub config's ``pretrained_cfg`` over its top-level keys (where timm before 0.9 kept
  them)."""
  cfg = config.get('pretrained_cfg')
  return {**config, **(cfg if isinstance(cfg, dict) else {})}


def hub_config(path: str) -> Dict[str, Any]:
  """What timm's :data:`HUB_CONFIG` beside the file at ``path`` settles: ``image_size`` (its
  ``pretrained_cfg`` ``input_size``, else ``model_args`` ``img_size``) and the fields its
  ``model_args`` give by timm's names (e.g. ``no_embed_class``, ``reg_tokens``); ``{}`` without
  one (or with transformers' config.json, which has no ``architecture``). Raises ValueError for
  a damaged file (named)."""
  config = _hub_config_file(path)[1]
  if not config:
    return {}
  args = config.get('model_args') if isinstance(config.get('model_args'), dict) else {}
  size = _pretrained_cfg(config).get('input_size') or args.get('img_size')
  found = {f.name: args[f.timm] for f in vit_fields.VIT_FIELDS
           if f.timm and f.timm in args and f.in_weights}
  if size:
    found['image_size'] = int(np.ravel(size)[-1])
  return found


#: The warning for a timm file whose preprocessing nothing records (:func:`preprocessing`;
#: docs/checkpoints.md, "A workdir alone rebuilds its model").
ASSUMED_PREPROCESSING = (
    "{path}: nothing records this timm file's preprocessing (no timm config.json with a "
    "pretrained_cfg mean and std lies beside it), so its images are preprocessed as the ViT "
    "paper's (pixels in [-1, 1], a plain resize); timm's DeiT III and DINOv2, among others, "
    "take ImageNet's mean and std. State it: put the model's config.json from its Hub "
    "repository (its pretrained_cfg mean, std and crop_pct) beside the file, or give it as "
    "hf-hub:timm/NAME, which brings it.")


def _normalization_named(mean: Any, std: Any) -> Optional[str]:
  """The ``hf_vit.MEAN_STD`` name of a per-channel ``mean`` and ``std`` (of pixels in [0, 1],
  within 1e-3, as timm states them), else None."""
  try:
    mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
  except (TypeError, ValueError):
    return None
  return next((name for name, (m, s) in hf_vit.MEAN_STD.items()
               if mean.shape == std.shape == (3,)
               and np.allclose(mean, m, atol=1e-3, rtol=0)
               and np.allclose(std, s, atol=1e-3, rtol=0)), None)


def preprocessing(path: str, metadata: Mapping[str, str]) -> Dict[str, Any]:
  """The evaluation preprocessing the timm file at ``path`` records (``normalization`` and
  ``eval_crop_pct``, ``vit_jax.data`` names): this project's metadata's (:func:`_saved`), else
  the ``pretrained_cfg`` of timm's :data:`HUB_CONFIG` beside it, ``mean`` and ``std`` as one of
  ``hf_vit.MEAN_STD`` and ``crop_pct`` (with ``crop_mode`` 'center': timm's eval transform,
  the shorter side to ``size / crop_pct``, then the central crop); ``{}`` where neither records
  a mean and std. Raises ValueError naming values without an equivalent here."""
  saved = _saved(metadata, path)
  if saved.get('normalization') is not None:
    if saved['normalization'] not in hf_vit.MEAN_STD:
      raise ValueError(f"The {METADATA_KEY!r} metadata of {path}: normalization "
                       f"{saved['normalization']!r} is not one of "
                       f"{', '.join(hf_vit.MEAN_STD)}; write the file again with python -m "
                       'vit_jax.convert.')
    return {'normalization': saved['normalization'], 'eval_crop_pct': saved.get('eval_crop_pct')}
  file, config = _hub_config_file(path)
  cfg = _pretrained_cfg(config) if config else {}
  if cfg.get('mean') is None and cfg.get('std') is None:
    return {}
  name = _normalization_named(cfg.get('mean'), cfg.get('std'))
  if name is None:
    known = '; '.join(f'{k}: mean {m}, std {s}' for k, (m, s) in hf_vit.MEAN_STD.items())
    raise ValueError(f"{file}: pretrained_cfg mean {cfg.get('mean')} and std {cfg.get('std')} "
                     f'have no equivalent here (the evaluation normalises as {known}), and no '
                     'other is guessed; fine-tuning from these weights (--config.init_from) does '
                     'not need it.')
  found = {'normalization': name}
  crop = cfg.get('crop_pct')
  mode = cfg.get('crop_mode') or 'center'
  if crop is not None:
    if (isinstance(crop, bool) or not isinstance(crop, (int, float)) or not 0 < crop <= 1
        or mode != 'center'):
      raise ValueError(f'{file}: pretrained_cfg crop_pct {crop!r} with crop_mode {mode!r} has '
                       "no equivalent here (timm's 'center' crop, crop_pct in (0, 1]: "
                       'config.data.eval_crop_pct).')
    found['eval_crop_pct'] = float(crop)
  return found


def fields_from(shapes: Mapping[str, Tuple[int, ...]], metadata: Mapping[str, str],
                path: str, num_heads: Optional[int] = None,
                gelu_approximate: Optional[bool] = None,
                no_embed_class: Optional[bool] = None, strict: bool = True) -> Dict[str, Any]:
  """The model fields (:func:`vit_jax.models.create` keywords, plus ``image_size``) of a timm
  file's tensor shapes and metadata. The metadata's (:func:`_saved`) come first; else the heads
  are ``num_heads``, else :data:`STANDARD_HEADS`; the GELU ``gelu_approximate``, else timm's
  exact one; a position table that fits two layouts is read as timm's config.json beside says
  (:func:`hub_config`), else as ``no_embed_class``, else with ``strict=False`` without it.
  Raises ValueError: a refused variant, unknown names, a width whose heads cannot be told, or a
  table that fits two layouts and nothing settles (``vit_shapes.AmbiguousTableError``)."""
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
  # Our names with timm's shapes: the variants' fields need only what both layouts share.
  ours = {f'params/{name}': canonical[theirs]
          for theirs, name in torch_layout.our_names(canonical).items()}
  beside = hub_config(path) if path else {}
  settled = saved.get('no_embed_class', beside.get('no_embed_class'))  # The file's records.
  read = lambda strict_read: vit_shapes.variant_fields(
      ours, fields['classifier'], saved.get('image_size') or beside.get('image_size'),
      strict=strict_read and settled is None, patch_size=fields['patch_size'])
  try:
    fields.update(read(True))
  except vit_shapes.AmbiguousTableError as e:
    if strict and no_embed_class is None:
      raise vit_shapes.AmbiguousTableError(f'{path}: {e}') from None
    settled = no_embed_class  # The model's, stated; else left out (strict=False).
    fields.update(read(False))
  if settled is not None:
    fields['no_embed_class'] = bool(settled)
  if 'layerscale_init' in fields and saved.get('layerscale_init'):
    fields['layerscale_init'] = float(saved['layerscale_init'])
  if saved.get('posemb_resize'):
    fields['posemb_resize'] = saved['posemb_resize']
  fields['image_size'] = vit_shapes.image_size(ours, fields)
  return fields


def label_names(metadata: Mapping[str, str], num_classes: Optional[int]
                ) -> Optional[Tuple[str, ...]]:
  """The class names this project wrote into a file's metadata (None otherwise)."""
  try:
    names = _saved(metadata, '').get('label_names')
  except ValueError:
    return None
  return tuple(str(n) for n in names) if names and len(names) == num_classes else None


def read(path: str, header: archive.Header, num_heads: Optional[int] = None,
         gelu_approximate: Optional[bool] = None, no_embed_class: Optional[bool] = None
         ) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[Tuple[str, ...]]]:
  """``(params, fields with image_size, class names or None)`` of the timm file at ``path``
  with ``header`` (:func:`~.archive.read_header`), exactly (``num_heads``, ``gelu_approximate``,
  ``no_embed_class``: as :func:`fields_from`)."""
  fields = fields_from(archive.shapes(header), header[1], path, num_heads, gelu_approximate,
                       no_embed_class)
  arrays = _canonical(archive.read_safetensors(path), path,
                      lambda array, i, chunks: np.split(np.asarray(array), chunks)[i])
  params = torch_layout.to_params(arrays, fields['num_heads'])
  return params, fields, label_names(header[1], fields['num_classes'])


def to_timm(params: Mapping[str, Any]) -> Dict[str, np.ndarray]:
  """A timm ViT state dict (float32, fused ``qkv``/``kv``; timm's variants by their names:
  :mod:`.torch_layout`) from a per-layer params tree."""
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
          label_names: Optional[Sequence[str]], normalization: str,
          eval_crop_pct: Optional[float] = None) -> str:
  """Writes the ``.safetensors`` file ``dst``, the fields, class names and eval preprocessing
  in its metadata; returns the ``timm.create_model`` call that loads it (the keywords: the
  architecture; the overlay: the file, class count and eval preprocessing; the model name only
  picks the class)."""
  saved = dict(vit_shapes.kept_fields(fields), image_size=int(image_size),
               normalization=normalization, eval_crop_pct=eval_crop_pct)
  if label_names:
    saved['label_names'] = list(label_names)
  patch = fields['patch_size']
  mean, std = hf_vit.MEAN_STD[normalization]
  size = int(image_size)
  crop = ("crop_pct=1.0, interpolation='bilinear'" if eval_crop_pct is None else
          f"crop_pct={float(eval_crop_pct)!r}, interpolation='bicubic'")
  overlay = (f'dict(file={dst!r}, num_classes={fields["num_classes"] or 0}, '
             f'input_size=(3, {size}, {size}), {crop}, mean={mean}, std={std})')
  patch_size = patch if isinstance(patch, int) else tuple(patch)
  args = ["'vit_base_patch16_224'", 'pretrained=True', f'pretrained_cfg_overlay={overlay}',
          f'img_size={size}', f'patch_size={patch_size}',
          f'mlp_ratio={fields["mlp_dim"] / fields["hidden_size"]!r}',
          f'num_classes={fields["num_classes"] or 0}']
  args += {'gap': ['class_token=False', "global_pool='avg'"],
           'map': ['class_token=False', "global_pool='map'"]}.get(fields.get('classifier'), [])
  if fields.get('classifier') == 'gap' and not fields.get('fc_norm'):
    args.append('fc_norm=False')  # timm's default with 'avg' pooling is True.
  # The fields timm takes as they are: the architecture's, and the variants' where set.
  args += [f'{f.timm}={fields[f.name]!r}' for f in vit_fields.VIT_FIELDS
           if f.timm and f.name in fields and (f.default is fields_lib.REQUIRED
                                               or fields[f.name] != f.default)]
  if fields.get('gelu_approximate', True):
    args.append("act_layer='gelu_tanh'")
  call = 'timm.create_model(' + ', '.join(args) + ')'
  archive.write_safetensors(dst, to_timm(params), {METADATA_KEY: json.dumps(saved),
                                                'timm_create_model': call})
  return call
