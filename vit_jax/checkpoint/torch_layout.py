"""A ViT's parameters in PyTorch's layout (timm's ``VisionTransformer``, transformers'
``ViTModel``) to and from this project's tree, exactly. :mod:`.timm_vit` and :mod:`.hf_vit`
rename their tensors to canonical names (timm's, ``qkv`` split into ``q``, ``k``, ``v``), which
convert by a transpose and a reshape: a Linear weight ``(out, in)`` is a kernel ``(in, out)``,
the patch convolution ``(D, C, Ph, Pw)`` ``(Ph, Pw, C, D)``, an attention projection ``(D, D)``
``(D, heads, D/heads)`` (``(heads, D/heads, D)`` for the output). A projection without bias
reads as a zero bias, which computes the same.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Tuple

import numpy as np

from vit_jax.checkpoint.tree import flatten_params, unflatten_params

_ATTENTION = 'MultiHeadDotProductAttention_0'
_PROJECTIONS = (('q', 'query'), ('k', 'key'), ('v', 'value'))

# Canonical module -> our module, for the modules that are a LayerNorm or a plain Dense.
_NORMS = {'norm1': 'LayerNorm_0', 'norm2': 'LayerNorm_1'}
_DENSES = {'mlp.fc1': 'MlpBlock_0/Dense_0', 'mlp.fc2': 'MlpBlock_0/Dense_1'}


def _dense(weight: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(weight).T)


def _heads_in(weight: np.ndarray, heads: int) -> np.ndarray:
  """``(heads * Dh, D)`` -> ``(D, heads, Dh)``."""
  weight = np.asarray(weight)
  return np.ascontiguousarray(weight.T.reshape(weight.shape[1], heads, -1))


def _heads_out(weight: np.ndarray, heads: int) -> np.ndarray:
  """``(D, heads * Dh)`` -> ``(heads, Dh, D)``."""
  weight = np.asarray(weight)
  return np.ascontiguousarray(weight.T.reshape(heads, -1, weight.shape[0]))


def _attention(source: Mapping[str, np.ndarray], prefix: str, heads: int,
               width: int) -> Dict[str, np.ndarray]:
  """Our attention's arrays from the canonical ``{prefix}.{q,k,v,proj}.{weight,bias}``."""
  out = {}
  for short, name in _PROJECTIONS:
    weight = source[f'{prefix}.{short}.weight']
    bias = source.get(f'{prefix}.{short}.bias')
    if bias is None:  # qkv_bias=False: a zero bias computes the same.
      bias = np.zeros((weight.shape[0],), weight.dtype)
    out[f'{name}/kernel'] = _heads_in(weight, heads)
    out[f'{name}/bias'] = np.asarray(bias).reshape(heads, -1)
  out['out/kernel'] = _heads_out(source[f'{prefix}.proj.weight'], heads)
  out['out/bias'] = np.asarray(source.get(f'{prefix}.proj.bias',
                                          np.zeros((width,), np.float32)))
  return out


def _norm(source: Mapping[str, np.ndarray], prefix: str) -> Dict[str, np.ndarray]:
  return {'scale': np.asarray(source[f'{prefix}.weight']),
          'bias': np.asarray(source[f'{prefix}.bias'])}


def _linear(source: Mapping[str, np.ndarray], prefix: str) -> Dict[str, np.ndarray]:
  return {'kernel': _dense(source[f'{prefix}.weight']),
          'bias': np.asarray(source[f'{prefix}.bias'])}


def _nest(prefix: str, arrays: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
  return {f'{prefix}/{k}': v for k, v in arrays.items()}


def num_layers(names: Any) -> int:
  """The number of encoder blocks among canonical names (``blocks.{i}.``)."""
  indices = {int(m.group(1)) for m in map(re.compile(r'^blocks\.(\d+)\.').match, names) if m}
  return max(indices) + 1 if indices else 0


def to_params(source: Mapping[str, np.ndarray], num_heads: int) -> Dict[str, Any]:
  """The per-layer params tree (arrays as stored) of canonical tensors (the callers refuse
  other names first) with ``num_heads`` heads; KeyError for a missing tensor."""
  width = int(np.shape(source['patch_embed.proj.weight'])[0])
  flat = {
      'embedding/kernel': np.ascontiguousarray(
          np.transpose(np.asarray(source['patch_embed.proj.weight']), (2, 3, 1, 0))),
      'embedding/bias': np.asarray(source['patch_embed.proj.bias']),
  }
  if 'cls_token' in source:
    flat['cls'] = np.asarray(source['cls_token'])
  if 'pos_embed' in source:
    flat['Transformer/posembed_input/pos_embedding'] = np.asarray(source['pos_embed'])
  for i in range(num_layers(source)):
    block = f'Transformer/encoderblock_{i}'
    for short, name in _NORMS.items():
      flat.update(_nest(f'{block}/{name}', _norm(source, f'blocks.{i}.{short}')))
    flat.update(_nest(f'{block}/{_ATTENTION}', _attention(source, f'blocks.{i}.attn', num_heads,
                                                          width)))
    for short, name in _DENSES.items():
      flat.update(_nest(f'{block}/{name}', _linear(source, f'blocks.{i}.{short}')))
  flat.update(_nest('Transformer/encoder_norm', _norm(source, 'norm')))
  if 'attn_pool.latent' in source:
    flat['MAPHead_0/probe'] = np.asarray(source['attn_pool.latent'])
    flat.update(_nest(f'MAPHead_0/{_ATTENTION}', _attention(source, 'attn_pool', num_heads,
                                                            width)))
    flat.update(_nest('MAPHead_0/LayerNorm_0', _norm(source, 'attn_pool.norm')))
    for short, name in _DENSES.items():
      flat.update(_nest(f'MAPHead_0/{name}', _linear(source, f'attn_pool.{short}')))
  for module in ('pre_logits', 'head'):
    if f'{module}.weight' in source:
      flat.update(_nest(module, _linear(source, module)))
  return unflatten_params(flat)


def from_params(params: Mapping[str, Any]) -> Dict[str, np.ndarray]:
  """Canonical float32 tensors of a per-layer params tree, the inverse of :func:`to_params`;
  KeyError for a tree not a ViT's."""
  flat = {k: np.asarray(v, np.float32) for k, v in flatten_params(params).items()}
  out = {
      'patch_embed.proj.weight': np.transpose(flat['embedding/kernel'], (3, 2, 0, 1)),
      'patch_embed.proj.bias': flat['embedding/bias'],
  }
  if 'cls' in flat:
    out['cls_token'] = flat['cls']
  if 'Transformer/posembed_input/pos_embedding' in flat:
    out['pos_embed'] = flat['Transformer/posembed_input/pos_embedding']

  def attention(prefix: str, ours: str) -> None:
    for short, name in _PROJECTIONS:
      kernel = flat[f'{ours}/{name}/kernel']
      out[f'{prefix}.{short}.weight'] = kernel.reshape(kernel.shape[0], -1).T
      out[f'{prefix}.{short}.bias'] = flat[f'{ours}/{name}/bias'].reshape(-1)
    kernel = flat[f'{ours}/out/kernel']
    out[f'{prefix}.proj.weight'] = kernel.reshape(-1, kernel.shape[-1]).T
    out[f'{prefix}.proj.bias'] = flat[f'{ours}/out/bias']

  def norm(prefix: str, ours: str) -> None:
    out[f'{prefix}.weight'], out[f'{prefix}.bias'] = flat[f'{ours}/scale'], flat[f'{ours}/bias']

  def linear(prefix: str, ours: str) -> None:
    out[f'{prefix}.weight'], out[f'{prefix}.bias'] = flat[f'{ours}/kernel'].T, flat[f'{ours}/bias']

  layers = sorted(int(m.group(1)) for m in
                  (re.match(r'^Transformer/encoderblock_(\d+)/LayerNorm_0/scale$', k)
                   for k in flat) if m)
  for i in layers:
    block = f'Transformer/encoderblock_{i}'
    for short, name in _NORMS.items():
      norm(f'blocks.{i}.{short}', f'{block}/{name}')
    attention(f'blocks.{i}.attn', f'{block}/{_ATTENTION}')
    for short, name in _DENSES.items():
      linear(f'blocks.{i}.{short}', f'{block}/{name}')
  norm('norm', 'Transformer/encoder_norm')
  if 'MAPHead_0/probe' in flat:
    out['attn_pool.latent'] = flat['MAPHead_0/probe']
    attention('attn_pool', f'MAPHead_0/{_ATTENTION}')
    norm('attn_pool.norm', 'MAPHead_0/LayerNorm_0')
    for short, name in _DENSES.items():
      linear(f'attn_pool.{short}', f'MAPHead_0/{name}')
  for module in ('pre_logits', 'head'):
    if f'{module}/kernel' in flat:
      linear(module, module)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def shapes_to_fields(shapes: Mapping[str, Tuple[int, ...]]) -> Dict[str, Any]:
  """The ViT fields (no ``num_heads``: not recorded) canonical tensor shapes imply: classifier
  'map' with an ``attn_pool``, 'token' with a class token, else 'gap'."""
  width, _, ph, pw = shapes['patch_embed.proj.weight']
  head = shapes.get('head.weight')
  pre_logits = shapes.get('pre_logits.weight')
  classifier = ('map' if 'attn_pool.latent' in shapes else
                'token' if 'cls_token' in shapes else 'gap')
  return dict(patch_size=ph if ph == pw else (ph, pw), hidden_size=width,
              num_layers=num_layers(shapes), mlp_dim=shapes['blocks.0.mlp.fc1.weight'][0],
              representation_size=pre_logits[0] if pre_logits else None,
              classifier=classifier, num_classes=head[0] if head else None)
