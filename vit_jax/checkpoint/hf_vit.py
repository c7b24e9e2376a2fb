"""Hugging Face transformers ViT directories read into this project's ViT (the names and config
keys read: docs/checkpoints.md, "Other libraries' weights"), and written: :func:`to_hf` writes
transformers 4's names, which every version reads."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import archive
from vit_jax.checkpoint import durable
from vit_jax.checkpoint import torch_layout
from vit_jax.checkpoint import vit_shapes
from vit_jax.models import vit_fields

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
PREPROCESSOR_FILE = 'preprocessor_config.json'

#: ``normalization`` -> the mean and std of pixels in [0, 1] (``vit_jax.data.preprocess``).
MEAN_STD = {'minus_one_to_one': ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
            'imagenet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}
#: The fix of a config.json or index that cannot be read.
_FIX = 'take it again from the same Hub repository (or write it with python -m vit_jax.convert)'
#: How transformers' ViT resamples its position table to another grid
#: (``ViTEmbeddings.interpolate_pos_encoding``: ``F.interpolate(mode='bicubic',
#: align_corners=False)``, no antialiasing): the fields' ``posemb_resize``.
POSEMB_RESIZE = 'bicubic'
#: ``hidden_act`` values -> ``gelu_approximate``.
GELUS = {'gelu': False, 'gelu_pytorch_tanh': True, 'gelu_new': True, 'gelu_fast': True}
#: The fields the weights record without a ViTConfig key that transformers' ViT expresses in
#: part, checked by name (:func:`export_problems`); every other such field keeps its default.
_CHECKED_APART = ('classifier', 'patch_size', 'representation_size', 'posemb')

#: The ``config.json`` key (transformers keeps unknown keys) of the kept fields that neither a
#: ``ViTConfig`` key, ``hidden_act`` nor the weights record (:data:`KEPT_IN_CONFIG`).
CONFIG_KEY = 'vit_jax_model'
KEPT_IN_CONFIG = tuple(f.name for f in vit_fields.VIT_FIELDS
                       if f.name in vit_shapes.KEPT_FIELDS and not f.in_weights and not f.hf
                       and f.name != 'gelu_approximate')

_BLOCK = re.compile(r'^(?:vit\.)?(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$')
_BLOCK_MODULES = {
    'layernorm_before': 'norm1', 'layernorm_after': 'norm2',
    'attention.attention.query': 'attn.q', 'attention.q_proj': 'attn.q',
    'attention.attention.key': 'attn.k', 'attention.k_proj': 'attn.k',
    'attention.attention.value': 'attn.v', 'attention.v_proj': 'attn.v',
    'attention.output.dense': 'attn.proj', 'attention.o_proj': 'attn.proj',
    'intermediate.dense': 'mlp.fc1', 'mlp.fc1': 'mlp.fc1',
    'output.dense': 'mlp.fc2', 'mlp.fc2': 'mlp.fc2',
}
_OTHERS = {
    'embeddings.cls_token': 'cls_token', 'embeddings.position_embeddings': 'pos_embed',
    'embeddings.patch_embeddings.projection.weight': 'patch_embed.proj.weight',
    'embeddings.patch_embeddings.projection.bias': 'patch_embed.proj.bias',
    'layernorm.weight': 'norm.weight', 'layernorm.bias': 'norm.bias',
    'pooler.dense.weight': 'pre_logits.weight', 'pooler.dense.bias': 'pre_logits.bias',
}
#: Tensors of a ViTModel that classification does not use (masked image modelling).
_UNUSED = ('embeddings.mask_token',)


def is_hf_names(names: Any) -> bool:
  """Whether tensor names are transformers ViT names."""
  return any(n.endswith('embeddings.patch_embeddings.projection.weight') for n in names)


def _canonical_name(name: str) -> Optional[str]:
  """The canonical (:mod:`.torch_layout`) name of a transformers tensor; '' for one that
  classification does not use; None for an unknown one."""
  block = _BLOCK.match(name)
  if block:
    index, module, kind = block.groups()
    canonical = _BLOCK_MODULES.get(module)
    return f'blocks.{index}.{canonical}.{kind}' if canonical else None
  if name.startswith('classifier.'):
    return 'head.' + name[len('classifier.'):]
  bare = name.removeprefix('vit.')
  return '' if bare in _UNUSED else _OTHERS.get(bare)


def canonical(tensors: Mapping[str, Any], path: str) -> Dict[str, Any]:
  """Canonical name -> value (arrays or shapes) of a transformers ViT state dict; ValueError
  listing names that are not a transformers ViT's."""
  renamed = {name: _canonical_name(name) for name in tensors}
  unknown = [name for name, new in renamed.items() if new is None]
  if unknown:
    shown = ', '.join(sorted(unknown)[:5]) + (f' (+{len(unknown) - 5} more)'
                                              if len(unknown) > 5 else '')
    raise ValueError(f"{path} holds tensors that are not a transformers ViT's: {shown}. Only "
                     'ViTModel / ViTForImageClassification weights are read.')
  return {new: tensors[name] for name, new in renamed.items() if new}


def find(path: str, names: Optional[Sequence[str]] = None
         ) -> Tuple[Optional[str], Tuple[str, ...]]:
  """``(directory, its listing)`` of the transformers directory ``path`` is (``names``: its
  listing) or whose weight file it is; ``(None, ())`` unless it holds ``config.json`` (and, given
  as a directory, ``model.safetensors`` or its index)."""
  if names is not None:
    directory = path
    listing = set(names)
  else:
    directory = os.path.dirname(path) or '.'
    listing = set(storage.listdir(directory))
  if CONFIG_FILE not in listing or (names is not None
                                    and not listing & {WEIGHTS_FILE, INDEX_FILE}):
    return None, ()
  return directory, tuple(sorted(listing))


def _field_problem(config: Mapping[str, Any]) -> Optional[str]:
  """What is wrong with the type of a field of a transformers ``config.json`` (None: nothing)."""
  number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
  positive_int = lambda v: number(v) and isinstance(v, int) and v > 0
  # An int, or [H, W] (as ``np.ravel`` reads it).
  sizes = lambda v: positive_int(v) or (isinstance(v, list) and 0 < len(v) <= 2
                                        and all(positive_int(x) for x in v))
  checks = [(key, lambda v: isinstance(v, str), 'a string')
            for key in ('model_type', 'hidden_act', 'pooler_act')]
  checks += [(key, positive_int, 'a positive integer') for key in (
      'hidden_size', 'num_hidden_layers', 'num_attention_heads', 'intermediate_size',
      'num_channels')]
  checks += [(key, sizes, 'a positive integer or a list of two')
             for key in ('image_size', 'patch_size')]
  checks += [('layer_norm_eps', lambda v: number(v) and 0 < v < 1, 'a number in (0, 1)'),
             ('id2label', lambda v: v is None or isinstance(v, dict), 'an object')]
  for key, valid, what in checks:
    if key in config and not valid(config[key]):
      return f'{key} is {repr(config[key])[:80]}, not {what}'
  return None if 'num_attention_heads' in config else 'it has no num_attention_heads'


def read_config(directory: str) -> Dict[str, Any]:
  """The ``config.json`` of a transformers directory (:func:`find`; ``{}``: gone since the
  listing); ValueError (naming the file, the field and the fix) for one not a bounded JSON object
  (:func:`rundir.read_json`), with a field of the wrong type (or no ``num_attention_heads``), of
  another ``model_type`` (e.g. 'deit') or a ``hidden_act`` without an equivalent."""
  path = storage.join(directory, CONFIG_FILE)
  config = rundir.read_json(path, fix=_FIX) or {}
  problem = _field_problem(config)
  if problem:
    raise ValueError(f'{path} is not the config.json of a transformers ViT: {problem}; {_FIX}.')
  model_type = config.get('model_type')
  if model_type != 'vit':
    raise ValueError(f"{path} is a transformers {model_type!r} model, not 'vit': only ViT "
                     '(ViTModel, ViTForImageClassification) weights are read.')
  act = config.get('hidden_act', 'gelu')
  if act not in GELUS:
    raise ValueError(f"{path}: hidden_act {act!r} has no equivalent here (GELU only: "
                     f"{', '.join(sorted(GELUS))}).")
  if 'pooler_act' in config and config['pooler_act'] != 'tanh':
    raise ValueError(f"{path}: pooler_act {config['pooler_act']!r}; only the tanh pooler (the "
                     'official pre_logits) has an equivalent here.')
  return config


def weight_files(directory: str, names: Sequence[str]) -> Tuple[str, ...]:
  """The safetensors files of a transformers directory listing ``names`` (one, or the shards
  of its index); FileNotFoundError without (naming a ``pytorch_model.bin``)."""
  if WEIGHTS_FILE in names:
    return (storage.join(directory, WEIGHTS_FILE),)
  if INDEX_FILE in names:
    path = storage.join(directory, INDEX_FILE)
    weight_map = (rundir.read_json(path, fix=_FIX) or {}).get('weight_map')
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(f, str) and f for f in weight_map.values())):
      raise ValueError(f'{path} is not a safetensors index: it needs a weight_map object of tensor '
                       f'names to file names; {_FIX}.')
    return tuple(storage.join(directory, f) for f in sorted(set(weight_map.values())))
  extra = (' (it has pytorch_model.bin only: take model.safetensors from the same Hub '
           'repository)') if 'pytorch_model.bin' in names else ''
  raise FileNotFoundError(f'{directory} has no {WEIGHTS_FILE}{extra}.')


def label_names(config: Mapping[str, Any], num_classes: Optional[int]
                ) -> Optional[Tuple[str, ...]]:
  """The class names of ``id2label`` in class order; None for transformers' placeholder
  names (``LABEL_0``, ...) or a count other than the head's."""
  id2label = config.get('id2label') or {}
  try:
    names = tuple(str(id2label[k]) for k in sorted(id2label, key=int))
  except (TypeError, ValueError):
    return None
  if not names or len(names) != num_classes or all(
      n == f'LABEL_{i}' for i, n in enumerate(names)):
    return None
  return names


def fields_from(shapes: Mapping[str, Tuple[int, ...]], config: Mapping[str, Any],
                path: str) -> Dict[str, Any]:
  """The model fields (:func:`vit_jax.models.create` keywords, plus ``image_size``): the
  architecture from the tensor shapes, heads, GELU, LayerNorm epsilon and image size from the
  config, transformers' position-table resize (:data:`POSEMB_RESIZE`); the fields this project
  kept under :data:`CONFIG_KEY` over them."""
  fields = torch_layout.shapes_to_fields(canonical(shapes, path))
  # The config's keys that are fields (``hf`` names; the shapes' architecture first).
  fields.update({f.name: f.type(config[f.hf]) for f in vit_fields.VIT_FIELDS
                 if f.hf and f.hf in config and f.name not in fields})
  fields.update(posemb='learn', gelu_approximate=GELUS[config.get('hidden_act', 'gelu')],
                layer_norm_epsilon=float(config.get('layer_norm_eps', 1e-12)),
                posemb_resize=POSEMB_RESIZE)
  kept = vit_shapes.from_kept(config.get(CONFIG_KEY))
  fields.update({k: kept[k] for k in KEPT_IN_CONFIG if k in kept})
  size = config.get('image_size')
  fields['image_size'] = int(np.ravel(size)[0]) if size else None
  return fields


def read_fields(directory: str, names: Sequence[str]) -> Dict[str, Any]:
  """:func:`fields_from` a transformers directory (:func:`find`), from the headers only."""
  shapes = {}
  for file in weight_files(directory, names):
    shapes.update(archive.shapes(archive.read_header(file)))
  return fields_from(shapes, read_config(directory), directory)


def read(directory: str, names: Sequence[str]
         ) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[Tuple[str, ...]]]:
  """``(params, fields with image_size, class names or None)`` of a transformers directory
  (:func:`find`), exactly; each file read once."""
  arrays = {}
  for file in weight_files(directory, names):
    arrays.update(archive.read_safetensors(file))
  config = read_config(directory)
  fields = fields_from({k: tuple(np.shape(v)) for k, v in arrays.items()}, config, directory)
  params = torch_layout.to_params(canonical(arrays, directory), fields['num_heads'])
  return params, fields, label_names(config, fields['num_classes'])


def normalization(directory: str, names: Sequence[str]) -> Optional[str]:
  """'minus_one_to_one' or 'imagenet' from the ``image_mean`` of the directory's
  ``preprocessor_config.json`` (as :func:`write` writes it), else None."""
  if PREPROCESSOR_FILE not in names:
    return None
  try:
    config = rundir.read_json(storage.join(directory, PREPROCESSOR_FILE), fix=_FIX) or {}
    mean = tuple(round(float(m), 3) for m in config.get('image_mean', []))
  except (ValueError, TypeError, AttributeError):
    return None
  return next((k for k, (m, _) in MEAN_STD.items() if m == mean), None)


def export_problems(fields: Mapping[str, Any]) -> List[str]:
  """What a transformers ViT cannot express of a model with ``fields``."""
  problems = []
  if fields.get('classifier', 'token') != 'token':
    problems.append(f"classifier={fields['classifier']!r} (ViTForImageClassification "
                    'classifies the class token)')
  if fields.get('representation_size') and fields.get('num_classes'):
    problems.append('a pre_logits layer before the head (ViTForImageClassification has none)')
  if not isinstance(fields.get('patch_size'), int):
    problems.append(f"non-square patches {fields.get('patch_size')}")
  # The recorded fields a ViTConfig has no key for (timm's variants: export with --to timm).
  for f in vit_fields.VIT_FIELDS:
    value = fields.get(f.name, f.default)
    if f.in_weights and not f.hf and f.name not in _CHECKED_APART and value != f.default:
      fix = '; export with --to timm' if f.timm else ''
      problems.append(f'{f.name}={value!r} (a ViTConfig has no {f.name}{fix})')
  return problems


def output_paths(dst: str) -> List[str]:
  """The weights, config and preprocessor config :func:`write` writes for ``dst``: a directory,
  or a ``.safetensors`` path with the configs beside it."""
  if dst.endswith(archive.SAFETENSORS_SUFFIX):
    directory = os.path.dirname(dst) or '.'
    weights = dst
  else:
    directory = dst
    weights = os.path.join(dst, WEIGHTS_FILE)
  return [weights, os.path.join(directory, CONFIG_FILE),
          os.path.join(directory, PREPROCESSOR_FILE)]


def write(dst: str, params: Mapping[str, Any], fields: Mapping[str, Any], image_size: int,
          label_names: Optional[Sequence[str]], normalization: str,
          eval_crop_pct: Optional[float] = None) -> str:
  """Writes :func:`output_paths` (the preprocessor config: a ``ViTImageProcessor`` feeding what
  this project's eval pipeline feeds, a bilinear resize to the square size, pixels / 255, then
  ``normalization``'s mean and std; it has no crop, so ``eval_crop_pct`` is not written);
  returns the ``from_pretrained`` call that loads them."""
  del eval_crop_pct  # ViTImageProcessor resizes without a crop.
  weights, config_path, preprocessor_path = output_paths(dst)
  state, config = to_hf(params, fields, image_size=image_size, names=label_names)
  archive.write_safetensors(weights, state)
  mean, std = MEAN_STD[normalization]
  preprocessor = {
      'image_processor_type': 'ViTImageProcessor',
      'do_resize': True, 'size': {'height': int(image_size), 'width': int(image_size)},
      'resample': 2,  # PIL bilinear.
      'do_rescale': True, 'rescale_factor': 1 / 255,
      'do_normalize': True, 'image_mean': list(mean), 'image_std': list(std)}
  for name, content in ((config_path, config), (preprocessor_path, preprocessor)):
    durable.write_atomically(name, json.dumps(content, indent=2))
  return (f"transformers.{config['architectures'][0]}.from_pretrained("
          f'{os.path.dirname(weights) or "."!r})')


def to_hf(params: Mapping[str, Any], fields: Mapping[str, Any], *, image_size: int,
          names: Optional[Sequence[str]] = None) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """A transformers 4 state dict and ``config.json`` of a per-layer ViT params tree with a
  class token: ``ViTForImageClassification`` with a head, else ``ViTModel`` (its pooler from
  ``pre_logits``). ``names``: ``id2label`` (default ``LABEL_i``)."""
  canonical_arrays = torch_layout.from_params(params)
  classify = 'head.weight' in canonical_arrays
  prefix = 'vit.' if classify else ''
  inverse_blocks = {ours: hf_name for hf_name, ours in _BLOCK_MODULES.items()
                    if '_proj' not in hf_name and not hf_name.startswith('mlp.')}
  inverse_others = {v: k for k, v in _OTHERS.items()}
  state = {}
  for name, value in canonical_arrays.items():
    block = re.match(r'^blocks\.(\d+)\.(.+)\.(weight|bias)$', name)
    if block:
      index, module, kind = block.groups()
      state[f'{prefix}encoder.layer.{index}.{inverse_blocks[module]}.{kind}'] = value
    elif name.startswith('head.'):
      state['classifier.' + name[len('head.'):]] = value
    else:
      state[prefix + inverse_others[name]] = value
  classes = fields.get('num_classes') if classify else None
  if names and classes and len(names) == classes:
    labels = list(names)
  elif classes:
    labels = [f'LABEL_{i}' for i in range(classes)]
  else:
    labels = []
  patch = int(np.ravel(fields['patch_size'])[0])
  config = {
      'architectures': ['ViTForImageClassification' if classify else 'ViTModel'],
      'model_type': 'vit', 'qkv_bias': True, 'hidden_dropout_prob': 0.0,
      'attention_probs_dropout_prob': 0.0, 'initializer_range': 0.02, 'torch_dtype': 'float32',
      **{f.hf: f.type(fields.get(f.name, f.default)) for f in vit_fields.VIT_FIELDS if f.hf},
      'hidden_act': 'gelu_pytorch_tanh' if fields.get('gelu_approximate', True) else 'gelu',
      'image_size': int(image_size), 'patch_size': patch, 'encoder_stride': patch,
      'num_channels': int(canonical_arrays['patch_embed.proj.weight'].shape[1]),
  }
  kept = {k: fields[k] for k in KEPT_IN_CONFIG if k in fields}
  if kept:
    config[CONFIG_KEY] = vit_shapes.kept_fields(kept)
  if labels:
    config['id2label'] = {str(i): n for i, n in enumerate(labels)}
    config['label2id'] = {n: i for i, n in enumerate(labels)}
  if not classify and fields.get('representation_size'):
    config['pooler_output_size'] = int(fields['representation_size'])
    config['pooler_act'] = 'tanh'
  return state, config
