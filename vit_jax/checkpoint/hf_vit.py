"""Hugging Face transformers ViT weights (``config.json`` + ``model.safetensors``) to and from
this project's ViT.

A transformers ViT directory (``save_pretrained``, or a ``google/vit-*`` repository from the Hub)
holds ``config.json`` (``model_type: 'vit'``) and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Its tensors are named as transformers 4 names the modules
(the Hub's files)::

  vit.embeddings.{cls_token, position_embeddings, patch_embeddings.projection}
  vit.encoder.layer.{i}.{layernorm_before, attention.attention.{query,key,value},
                         attention.output.dense, layernorm_after, intermediate.dense,
                         output.dense}
  vit.layernorm, classifier            (ViTForImageClassification)
  pooler.dense                         (ViTModel with its pooler: Dense + tanh on the class
                                        token, the official pre_logits; no 'vit.' prefix)

or as transformers 5 names them (``vit.layers.{i}.attention.{q,k,v,o}_proj``,
``vit.layers.{i}.mlp.{fc1,fc2}``); both are read. The config gives what the tensors do not:
``num_attention_heads``, ``layer_norm_eps`` (1e-12 in the google checkpoints, honoured exactly)
and ``hidden_act`` ("gelu" is the exact GELU; "gelu_pytorch_tanh", "gelu_new", "gelu_fast"
the tanh approximation), and ``id2label`` the class names.

:func:`to_hf` writes transformers 4 names, which every transformers version reads.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax.checkpoint import paths
from vit_jax.checkpoint import torch_layout

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
PREPROCESSOR_FILE = 'preprocessor_config.json'

#: ``hidden_act`` values -> ``gelu_approximate``.
GELUS = {'gelu': False, 'gelu_pytorch_tanh': True, 'gelu_new': True, 'gelu_fast': True}

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
  bare = name[len('vit.'):] if name.startswith('vit.') else name
  if bare in _UNUSED:
    return ''
  return _OTHERS.get(bare)


def canonical(tensors: Mapping[str, Any], path: str) -> Dict[str, Any]:
  """Canonical name -> value (arrays or shapes) of a transformers ViT state dict.

  Raises:
    ValueError: names that are not a transformers ViT's (listed).
  """
  out, unknown = {}, []
  for name, value in tensors.items():
    new = _canonical_name(name)
    if new is None:
      unknown.append(name)
    elif new:
      out[new] = value
  if unknown:
    shown = ', '.join(sorted(unknown)[:5]) + (f' (+{len(unknown) - 5} more)'
                                              if len(unknown) > 5 else '')
    raise ValueError(f"{path} holds tensors that are not a transformers ViT's: {shown}. Only "
                     'ViTModel / ViTForImageClassification weights are read.')
  return out


def read_config(directory: str) -> Dict[str, Any]:
  """The ``config.json`` of a transformers directory, checked to be a ViT's.

  Raises:
    FileNotFoundError: no ``config.json``.
    ValueError: not JSON, another ``model_type`` (e.g. 'deit', 'dinov2'), or a ``hidden_act``
      this ViT has no equivalent for.
  """
  path = paths.join(directory, CONFIG_FILE)
  if not paths.exists(path):
    raise FileNotFoundError(f'{directory} has no {CONFIG_FILE}: a transformers ViT needs its '
                            'config (save_pretrained writes both; download both from the Hub).')
  try:
    config = json.loads(paths.read_bytes(path).decode('utf-8'))
  except (UnicodeDecodeError, ValueError) as e:
    raise ValueError(f'{path} is not valid JSON ({e}).') from None
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


def weight_files(directory: str) -> Tuple[str, ...]:
  """The safetensors files of a transformers directory (one, or the shards of its index).

  Raises:
    FileNotFoundError: neither ``model.safetensors`` nor its index (a directory with only
      ``pytorch_model.bin`` is named as such).
  """
  single = paths.join(directory, WEIGHTS_FILE)
  if paths.exists(single):
    return (single,)
  index = paths.join(directory, INDEX_FILE)
  if paths.exists(index):
    weight_map = json.loads(paths.read_bytes(index).decode('utf-8')).get('weight_map', {})
    return tuple(paths.join(directory, f) for f in sorted(set(weight_map.values())))
  extra = (' (it has pytorch_model.bin only: take model.safetensors from the same Hub '
           'repository)') if paths.exists(paths.join(directory, 'pytorch_model.bin')) else ''
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
  """The model fields (:func:`vit_jax.models.create` keywords, plus ``image_size``) of a
  transformers ViT: the architecture from the shapes, heads, GELU, LayerNorm epsilon and image
  size from the config."""
  fields = torch_layout.shapes_to_fields(canonical(shapes, path))
  fields.update(num_heads=int(config['num_attention_heads']), posemb='learn',
                gelu_approximate=GELUS[config.get('hidden_act', 'gelu')],
                layer_norm_epsilon=float(config.get('layer_norm_eps', 1e-12)))
  size = config.get('image_size')
  fields['image_size'] = int(size if not isinstance(size, (list, tuple)) else size[0]) if size \
      else None
  return fields


def preprocessor_config(image_size: int, normalization: str) -> Dict[str, Any]:
  """``preprocessor_config.json`` of a ``ViTImageProcessor`` feeding what this project's eval
  pipeline feeds: a bilinear resize to the square size, pixels / 255, then the normalisation
  ('minus_one_to_one': mean = std = 0.5, i.e. [-1, 1]; 'imagenet': the ImageNet mean/std)."""
  imagenet = normalization == 'imagenet'
  return {
      'image_processor_type': 'ViTImageProcessor',
      'do_resize': True, 'size': {'height': int(image_size), 'width': int(image_size)},
      'resample': 2,  # PIL bilinear.
      'do_rescale': True, 'rescale_factor': 1 / 255,
      'do_normalize': True,
      'image_mean': [0.485, 0.456, 0.406] if imagenet else [0.5, 0.5, 0.5],
      'image_std': [0.229, 0.224, 0.225] if imagenet else [0.5, 0.5, 0.5],
  }


def from_hf(arrays: Mapping[str, np.ndarray], num_heads: int, path: str) -> Dict[str, Any]:
  """This project's params tree (per-layer) from a transformers ViT state dict (exact)."""
  return torch_layout.to_params(canonical(arrays, path), num_heads)


def to_hf(params: Mapping[str, Any], fields: Mapping[str, Any], *, image_size: int,
          names: Optional[Sequence[str]] = None) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """A transformers ViT state dict (transformers 4 names) and its ``config.json`` dict.

  With a head: ``ViTForImageClassification`` (``vit.`` prefix, ``classifier``); without:
  ``ViTModel`` (its pooler from ``pre_logits`` when there is one).

  Args:
    params: per-layer params tree of a ViT with a class token.
    fields: its model fields (``hidden_size``, ``num_layers``, ``num_heads``, ``mlp_dim``,
      ``patch_size``, ``gelu_approximate``, ``layer_norm_epsilon``, ``num_classes``,
      ``representation_size``).
    image_size: the side of the square images it runs at.
    names: class names for ``id2label`` (default ``LABEL_i``).
  """
  canonical_arrays = torch_layout.from_params(params)
  classify = 'head.weight' in canonical_arrays
  prefix = 'vit.' if classify else ''
  inverse_blocks = {}
  for hf_name, ours in _BLOCK_MODULES.items():
    if '_proj' not in hf_name and not hf_name.startswith('mlp.'):
      inverse_blocks[ours] = hf_name
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
  labels = list(names) if names and classes and len(names) == classes else (
      [f'LABEL_{i}' for i in range(classes)] if classes else [])
  patch = fields['patch_size']
  config = {
      'architectures': ['ViTForImageClassification' if classify else 'ViTModel'],
      'model_type': 'vit',
      'hidden_size': int(fields['hidden_size']),
      'num_hidden_layers': int(fields['num_layers']),
      'num_attention_heads': int(fields['num_heads']),
      'intermediate_size': int(fields['mlp_dim']),
      'hidden_act': 'gelu_pytorch_tanh' if fields.get('gelu_approximate', True) else 'gelu',
      'layer_norm_eps': float(fields.get('layer_norm_epsilon', 1e-6)),
      'image_size': int(image_size),
      'patch_size': int(patch if isinstance(patch, int) else patch[0]),
      'num_channels': int(canonical_arrays['patch_embed.proj.weight'].shape[1]),
      'qkv_bias': True,
      'hidden_dropout_prob': 0.0,
      'attention_probs_dropout_prob': 0.0,
      'initializer_range': 0.02,
      'encoder_stride': int(patch if isinstance(patch, int) else patch[0]),
      'torch_dtype': 'float32',
  }
  if labels:
    config['id2label'] = {str(i): n for i, n in enumerate(labels)}
    config['label2id'] = {n: i for i, n in enumerate(labels)}
  if not classify and fields.get('representation_size'):
    config['pooler_output_size'] = int(fields['representation_size'])
    config['pooler_act'] = 'tanh'
  return state, config
