"""A ViT's parameters in PyTorch's layout (timm's ``VisionTransformer``, transformers'
``ViTModel``) to and from this project's tree, exactly. :mod:`.timm_vit` and :mod:`.hf_vit`
rename their tensors to canonical names (timm's, ``qkv`` split into ``q``, ``k``, ``v``), which
convert by a transpose and a reshape (:data:`_WEIGHTS`; an attention projection ``(D, D)`` is
``(D, heads, D/heads)``, ``(heads, D/heads, D)`` for the output); a projection without bias
reads as a zero bias. timm's variants map by name too (:func:`_modules`)."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint.tree import flatten_params, unflatten_params

_ATTENTION = 'MultiHeadDotProductAttention_0'
_PROJECTIONS = (('q', 'query'), ('k', 'key'), ('v', 'value'))
_MLP = (('mlp.fc1', 'MlpBlock_0/Dense_0'), ('mlp.fc2', 'MlpBlock_0/Dense_1'))

#: Kind of module (a weight and a bias) -> (our weight's name, canonical -> ours, inverse).
_WEIGHTS = {
    'norm': ('scale', lambda w: w, lambda w: w),
    'linear': ('kernel', np.transpose, np.transpose),
    'conv': ('kernel', lambda w: np.transpose(w, (2, 3, 1, 0)),
             lambda k: np.transpose(k, (3, 2, 0, 1))),
}


def _modules(layers: int) -> List[Tuple[str, str, str, bool]]:
  """``(canonical prefix, our prefix, kind, required)`` of every module a ViT of ``layers``
  blocks may have (kind: ``tensor``, ``attention`` or one of :data:`_WEIGHTS`)."""
  modules = [('patch_embed.proj', 'embedding', 'conv', True),
             ('cls_token', 'cls', 'tensor', False), ('reg_token', 'registers', 'tensor', False),
             ('pos_embed', 'Transformer/posembed_input/pos_embedding', 'tensor', False)]
  for i in range(layers):
    ours = f'Transformer/encoderblock_{i}'
    modules += [(f'blocks.{i}.norm1', f'{ours}/LayerNorm_0', 'norm', True),
                (f'blocks.{i}.norm2', f'{ours}/LayerNorm_1', 'norm', True),
                (f'blocks.{i}.attn', f'{ours}/{_ATTENTION}', 'attention', True),
                (f'blocks.{i}.attn.q_norm', f'{ours}/{_ATTENTION}/query_ln', 'norm', False),
                (f'blocks.{i}.attn.k_norm', f'{ours}/{_ATTENTION}/key_ln', 'norm', False),
                (f'blocks.{i}.ls1.gamma', f'{ours}/LayerScale_0/scale', 'tensor', False),
                (f'blocks.{i}.ls2.gamma', f'{ours}/LayerScale_1/scale', 'tensor', False)]
    modules += [(f'blocks.{i}.{c}', f'{ours}/{o}', 'linear', True) for c, o in _MLP]
  modules += [('norm', 'Transformer/encoder_norm', 'norm', False),
              ('fc_norm', 'fc_norm', 'norm', False),
              ('attn_pool.latent', 'MAPHead_0/probe', 'tensor', False),
              ('attn_pool', f'MAPHead_0/{_ATTENTION}', 'attention', False),
              ('attn_pool.norm', 'MAPHead_0/LayerNorm_0', 'norm', False)]
  modules += [(f'attn_pool.{c}', f'MAPHead_0/{o}', 'linear', False) for c, o in _MLP]
  return modules + [('pre_logits', 'pre_logits', 'linear', False),
                    ('head', 'head', 'linear', False)]


def _present(names: Any, prefix: str, sep: str) -> bool:
  """Whether ``names`` hold the tensor ``prefix`` or one of its module's (``prefix + sep``)."""
  return any(n == prefix or n.startswith(prefix + sep) for n in names)


def _names(kind: str) -> List[Tuple[str, str]]:
  """``(canonical suffix, our suffix)`` of a module's tensors (``''``: the prefix itself)."""
  if kind == 'tensor':
    return [('', '')]
  if kind == 'attention':
    parts = [(s, o) for s, o in _PROJECTIONS] + [('proj', 'out')]
    return [(f'.{s}.{w}', f'/{o}/{v}') for s, o in parts
            for w, v in (('weight', 'kernel'), ('bias', 'bias'))]
  return [('.weight', f'/{_WEIGHTS[kind][0]}'), ('.bias', '/bias')]


def our_names(names: Any) -> Dict[str, str]:
  """``{canonical tensor name: our '/'-joined name}`` of the canonical ``names`` that map (the
  rest left out)."""
  names = set(names)
  out = {}
  for canonical, ours, kind, _ in _modules(num_layers(names)):
    for theirs, mine in _names(kind):
      if canonical + theirs in names:
        out[canonical + theirs] = ours + mine
  return out


def num_layers(names: Any, pattern: str = r'^blocks\.(\d+)\.') -> int:
  """The number of encoder blocks among canonical names (``blocks.{i}.``; or ``pattern``)."""
  indices = {int(m.group(1)) for m in map(re.compile(pattern).match, names) if m}
  return max(indices) + 1 if indices else 0


def _attention(source: Mapping[str, np.ndarray], prefix: str, heads: int,
               width: int) -> Dict[str, np.ndarray]:
  """Our attention's arrays from the canonical ``{prefix}.{q,k,v,proj}.{weight,bias}``."""
  out = {}
  for short, name in _PROJECTIONS:
    weight = np.asarray(source[f'{prefix}.{short}.weight'])
    bias = source.get(f'{prefix}.{short}.bias')
    if bias is None:  # qkv_bias=False: a zero bias computes the same.
      bias = np.zeros((weight.shape[0],), weight.dtype)
    out[f'{name}/kernel'] = np.ascontiguousarray(weight.T.reshape(weight.shape[1], heads, -1))
    out[f'{name}/bias'] = np.asarray(bias).reshape(heads, -1)
  weight = np.asarray(source[f'{prefix}.proj.weight'])
  out['out/kernel'] = np.ascontiguousarray(weight.T.reshape(heads, -1, weight.shape[0]))
  out['out/bias'] = np.asarray(source.get(f'{prefix}.proj.bias',
                                          np.zeros((width,), np.float32)))
  return out


def to_params(source: Mapping[str, np.ndarray], num_heads: int) -> Dict[str, Any]:
  """The per-layer params tree (arrays as stored) of canonical tensors with ``num_heads``
  heads; KeyError for a missing tensor."""
  width = int(np.shape(source['patch_embed.proj.weight'])[0])
  flat = {}
  for canonical, ours, kind, required in _modules(num_layers(source)):
    if not (required or _present(source, canonical, '.')):
      continue
    if kind == 'tensor':
      flat[ours] = np.asarray(source[canonical])
    elif kind == 'attention':
      flat.update({f'{ours}/{k}': v
                   for k, v in _attention(source, canonical, num_heads, width).items()})
    else:
      name, forward, _ = _WEIGHTS[kind]
      flat[f'{ours}/{name}'] = np.ascontiguousarray(
          forward(np.asarray(source[f'{canonical}.weight'])))
      flat[f'{ours}/bias'] = np.asarray(source[f'{canonical}.bias'])
  return unflatten_params(flat)


def from_params(params: Mapping[str, Any]) -> Dict[str, np.ndarray]:
  """Canonical float32 tensors of a per-layer params tree, the inverse of :func:`to_params`;
  KeyError for a tree not a ViT's."""
  flat = {k: np.asarray(v, np.float32) for k, v in flatten_params(params).items()}
  out = {}
  for canonical, ours, kind, required in _modules(
      num_layers(flat, r'^Transformer/encoderblock_(\d+)/')):
    if not (required or _present(flat, ours, '/')):
      continue
    if kind == 'tensor':
      out[canonical] = flat[ours]
    elif kind == 'attention':
      for short, name in _PROJECTIONS:
        kernel = flat[f'{ours}/{name}/kernel']
        out[f'{canonical}.{short}.weight'] = kernel.reshape(kernel.shape[0], -1).T
        out[f'{canonical}.{short}.bias'] = flat[f'{ours}/{name}/bias'].reshape(-1)
      kernel = flat[f'{ours}/out/kernel']
      out[f'{canonical}.proj.weight'] = kernel.reshape(-1, kernel.shape[-1]).T
      out[f'{canonical}.proj.bias'] = flat[f'{ours}/out/bias']
    else:
      name, _, inverse = _WEIGHTS[kind]
      out[f'{canonical}.weight'] = inverse(flat[f'{ours}/{name}'])
      out[f'{canonical}.bias'] = flat[f'{ours}/bias']
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def shapes_to_fields(shapes: Mapping[str, Tuple[int, ...]]) -> Dict[str, Any]:
  """The ViT fields (no ``num_heads``: not recorded) canonical tensor shapes imply: classifier
  'map' with an ``attn_pool``, 'token' with a class token, else 'gap'."""
  width, _, ph, pw = shapes['patch_embed.proj.weight']
  head = shapes.get('head.weight')
  pre_logits = shapes.get('pre_logits.weight')
  classifier = vit_shapes.classifier_from(shapes, probe='attn_pool.latent',
                                          class_token='cls_token')
  patch_size = ph if ph == pw else (ph, pw)
  representation_size = pre_logits[0] if pre_logits else None
  num_classes = head[0] if head else None
  return dict(patch_size=patch_size, hidden_size=width,
              num_layers=num_layers(shapes), mlp_dim=shapes['blocks.0.mlp.fc1.weight'][0],
              representation_size=representation_size,
              classifier=classifier, num_classes=num_classes)
