"""T2T-ViT's PyTorch names: the reference's ``state_dict`` keys <-> this project's variables.

The official T2T-ViT code (yitu-opensource/T2T-ViT; docs/reference.md section 2) saves its weights
as a PyTorch ``state_dict``. Its names map one-to-one to the variables of
:class:`vit_jax.models.t2t.T2TViT`: ``.`` becomes ``/``, a numeric component is joined to the one
before it with ``_`` (``blocks.3`` -> ``blocks_3``, ``mlp.0`` -> ``mlp_0``), Linear ``weight``
(out, in) -> ``kernel`` (in, out) (transposed), LayerNorm ``weight`` -> ``scale``, ``bias`` ->
``bias``; the fixed tables go to the ``'constants'`` collection::

  PyTorch key                                    Flax variable
  cls_token (1, 1, D)                            params/cls_token (1, 1, D)
  pos_embed (1, N+1, D)                          constants/pos_embed (1, N+1, D)
  tokens_to_token.project.{weight,bias}          params/tokens_to_token/project/{kernel,bias}
  -- tokens_type='transformer', a = attention1 (in 147 = 3*7*7) or attention2 (in 9*token_dim):
  tokens_to_token.a.norm1.{weight,bias}          params/tokens_to_token/a/norm1/{scale,bias}
  tokens_to_token.a.attn.qkv.weight (3t, in)     params/tokens_to_token/a/attn/qkv/kernel (in, 3t)
  tokens_to_token.a.attn.proj.{weight,bias}      params/tokens_to_token/a/attn/proj/{kernel,bias}
  tokens_to_token.a.norm2.{weight,bias}          params/tokens_to_token/a/norm2/{scale,bias}
  tokens_to_token.a.mlp.fc{1,2}.{weight,bias}    params/tokens_to_token/a/mlp/fc{1,2}/{kernel,bias}
  -- tokens_type='performer':
  tokens_to_token.a.w (m, t)                     constants/tokens_to_token/a/w (m, t)
  tokens_to_token.a.kqv.{weight,bias}            params/tokens_to_token/a/kqv/{kernel,bias}
  tokens_to_token.a.proj.{weight,bias}           params/tokens_to_token/a/proj/{kernel,bias}
  tokens_to_token.a.norm{1,2}.{weight,bias}      params/tokens_to_token/a/norm{1,2}/{scale,bias}
  tokens_to_token.a.mlp.{0,2}.{weight,bias}      params/tokens_to_token/a/mlp_{0,2}/{kernel,bias}
  -- backbone:
  blocks.i.norm{1,2}.{weight,bias}               params/blocks_i/norm{1,2}/{scale,bias}
  blocks.i.attn.qkv.weight (3D, D)               params/blocks_i/attn/qkv/kernel (D, 3D)
  blocks.i.attn.proj.{weight,bias}               params/blocks_i/attn/proj/{kernel,bias}
  blocks.i.mlp.fc{1,2}.{weight,bias}             params/blocks_i/mlp/fc{1,2}/{kernel,bias}
  norm.{weight,bias}                             params/norm/{scale,bias}
  head.{weight,bias}                             params/head/{kernel,bias}

:func:`torch_key_to_flax` maps one name, :func:`from_torch_state_dict` converts a whole
``state_dict`` for a model (checking every shape), and :func:`describe_architecture` names the
T2T-ViT fields that a checkpoint's shapes imply (for error messages). Reading ``.pth.tar`` files
is :mod:`vit_jax.checkpoint`'s job; this module needs neither torch nor files.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models import layout
from vit_jax.models import t2t
from vit_jax.checkpoint import mismatch

def torch_key_to_flax(key: str) -> Tuple[str, Tuple[str, ...]]:
  """Maps one PyTorch state_dict key to ``(collection, path)`` in our variables.

  E.g. ``'blocks.3.attn.qkv.weight'`` -> ``('params', ('blocks_3', 'attn', 'qkv', 'kernel'))``,
  ``'pos_embed'`` -> ``('constants', ('pos_embed',))``. A leading ``'module.'`` is stripped.
  ``weight`` becomes ``kernel`` for Linear layers and ``scale`` for LayerNorms (told apart by the
  module name: ``norm*`` is a LayerNorm). Pure string mapping; raises nothing.
  """
  if key.startswith('module.'):
    key = key[len('module.'):]
  parts = []
  for part in key.split('.'):
    if part.isdigit() and parts:
      parts[-1] = f'{parts[-1]}_{part}'
    else:
      parts.append(part)
  if parts[-1] == 'weight' and len(parts) > 1:
    parts[-1] = 'scale' if parts[-2].startswith('norm') else 'kernel'
  collection = 'constants' if parts[-1] in ('pos_embed', 'w') else 'params'
  return collection, tuple(parts)


def _flatten(tree: Mapping[str, Any], prefix: Tuple[str, ...] = ()) -> Dict[Tuple[str, ...], Any]:
  flat = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      flat.update(_flatten(v, prefix + (k,)))
    else:
      flat[prefix + (k,)] = v
  return flat


def _unflatten(flat: Mapping[Tuple[str, ...], Any]) -> Dict[str, Any]:
  tree: Dict[str, Any] = {}
  for path, value in flat.items():
    node = tree
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = value
  return tree


def _image_size_from_pos_embed(state_dict: Mapping[str, Any]) -> Tuple[int, int]:
  for key, value in state_dict.items():
    if key.split('.')[-1] == 'pos_embed' and key.count('.') <= 1:
      n = int(np.shape(value)[1]) - 1
      side = math.isqrt(n)
      if side * side == n:
        return 16 * side, 16 * side  # 16 g px gives a g x g token grid.
      raise ValueError(f'pos_embed has {n} token rows, not a square grid: pass image_size')
  raise ValueError('The state_dict has no pos_embed: pass image_size')


def from_torch_state_dict(
    state_dict: Mapping[str, Any],
    model: t2t.T2TViT,
    *,
    image_size: Union[None, int, Sequence[int]] = None,
) -> Dict[str, Dict[str, Any]]:
  """Converts a PyTorch T2T-ViT state_dict into this module's variables.

  Pure: reads only its arguments (no files, no torch needed); arrays are copied.

  Args:
    state_dict: PyTorch key -> array (numpy, or anything ``np.asarray`` accepts), e.g. the
      ``state_dict_ema`` of a released checkpoint or ``np.load('state_dict_ema.npz')``. Keys may
      start with ``'module.'``.
    model: the :class:`~vit_jax.models.t2t.T2TViT` the variables are for; its shapes are checked.
    image_size: ``H`` or ``(H, W)`` the model will be applied at (fixes the ``pos_embed`` rows);
      default: the square image of the checkpoint's own table (16 x its grid side).

  Returns:
    ``{'params': ..., 'constants': ...}`` nested dicts of numpy arrays in ``model.param_dtype``
    (constants float32), Linear kernels transposed to Flax's (in, out) layout, the backbone
    stacked under ``blocks`` if ``model.scan`` (``blocks_{i}`` otherwise); ready for
    ``model.apply(variables, images, train=False)``.

  Raises:
    ValueError: with the counts and first entries of the missing keys, unexpected keys and
      shape mismatches (PyTorch names and shapes), e.g. a 1000-class head loaded into a
      10-class model, a Performer checkpoint into a Transformer-T2T model, or ``pos_embed`` for
      another image size.
  """
  if image_size is None:
    height, width = _image_size_from_pos_embed(state_dict)
  elif isinstance(image_size, int):
    height = width = image_size
  else:
    height, width = (int(s) for s in image_size)
  unrolled = model.clone(scan=False, remat=False)  # The checkpoint's per-block layout.
  shapes = layout.unbox(jax.eval_shape(
      lambda: unrolled.init(jax.random.key(0), jnp.zeros((1, height, width, 3), jnp.float32),
                            train=False)))
  expected = {}
  for collection in ('params', 'constants'):
    for path, leaf in _flatten(shapes.get(collection, {})).items():
      expected[(collection,) + path] = leaf

  converted: Dict[Tuple[str, ...], np.ndarray] = {}
  unexpected, mismatched, mismatched_paths = [], [], set()
  for key, value in state_dict.items():
    collection, path = torch_key_to_flax(key)
    full = (collection,) + path
    array = np.asarray(value)
    if path[-1] == 'kernel' and array.ndim == 2:
      array = array.T  # PyTorch Linear weight (out, in) -> Flax kernel (in, out).
    if full not in expected:
      unexpected.append(f'{key} {tuple(np.shape(value))}')
      continue
    want = expected[full]
    if tuple(array.shape) != tuple(want.shape):
      torch_shape = tuple(np.shape(value))
      want_torch = tuple(want.shape[::-1]) if path[-1] == 'kernel' else tuple(want.shape)
      mismatched.append(f'{key}: checkpoint {torch_shape}, model {want_torch}')
      mismatched_paths.add(full)
      continue
    converted[full] = np.array(array, dtype=want.dtype)
  missing = [_flax_to_torch_name(p) for p in expected
             if p not in converted and p not in mismatched_paths]
  if missing or unexpected or mismatched:
    saved_shapes = {}  # Our names, kernels in Flax's (in, out) order: what the file holds.
    for key, value in state_dict.items():
      collection, path = torch_key_to_flax(key)
      shape = tuple(np.shape(value))
      saved_shapes['/'.join((collection,) + path)] = shape[::-1] if path[-1] == 'kernel' else shape
    hint = describe_architecture(saved_shapes)
    raise ValueError(mismatch.mismatch_report(
        'The state_dict does not fit the model '
        f'(tokens_type={model.tokens_type!r}, embed_dim={model.embed_dim}, depth={model.depth}, '
        f'token_dim={model.token_dim}, num_classes={model.num_classes}, image {height}x{width}):',
        sorted(missing), unexpected, mismatched,
        hint and hint + ' Build the model with these values.'))
  tree = _unflatten(converted)
  params = tree.get('params', {})
  if model.scan:
    params = layout.scan_params(params, model.depth, prefix='blocks')
  return {'params': params, 'constants': tree.get('constants', {})}


def _flax_to_torch_name(full_path: Tuple[str, ...]) -> str:
  """Inverse of :func:`torch_key_to_flax` (for error messages): ('params', 'blocks_0', ...)."""
  parts = []
  for part in full_path[1:]:
    head, sep, tail = part.rpartition('_')
    if sep and tail.isdigit() and head in ('blocks', 'mlp'):
      parts.extend([head, tail])
    else:
      parts.append(part)
  if parts[-1] in ('kernel', 'scale'):
    parts[-1] = 'weight'
  return '.'.join(parts)


def describe_architecture(shapes: Mapping[str, Sequence[int]]) -> Optional[str]:
  """The T2T-ViT fields that a checkpoint's parameter shapes imply, for error messages.

  Args:
    shapes: ``'/'``-joined variable names (collection first, e.g. ``'params/cls_token'``,
      ``'constants/tokens_to_token/attention1/w'``) -> shape, per-block (``blocks_{i}``) or
      scanned (``blocks``, depth first).

  Returns:
    ``'The checkpoint is a T2T-ViT with embed_dim=.., depth=.., mlp_ratio=.., token_dim=..,
    tokens_type=..[, N classes].'``, or None when the shapes are not a T2T-ViT's (no
    ``cls_token`` and ``tokens_to_token/project``).
  """
  cls_token = shapes.get('params/cls_token')
  project = shapes.get('params/tokens_to_token/project/kernel')
  if not cls_token or not project:
    return None
  head = shapes.get('params/head/kernel')
  classes = f', {head[-1]} classes' if head else ''
  width = cls_token[-1]
  if shapes.get('params/blocks/mlp/fc1/kernel'):  # Scanned: (depth, D, MLP).
    depth, *fc1 = shapes['params/blocks/mlp/fc1/kernel']
  else:
    depth = len({k.split('/')[1] for k in shapes if k.startswith('params/blocks_')})
    fc1 = shapes.get('params/blocks_0/mlp/fc1/kernel')
  token_dim = project[0] // 9
  performer = any(k.endswith('attention1/w') for k in shapes)
  fields = [f'embed_dim={width}', f'depth={depth}',
            f'mlp_ratio={fc1[-1] / width if fc1 else None}', f'token_dim={token_dim}',
            f"tokens_type={'performer' if performer else 'transformer'!r}"]
  return f'The checkpoint is a T2T-ViT with {", ".join(fields)}{classes}.'
