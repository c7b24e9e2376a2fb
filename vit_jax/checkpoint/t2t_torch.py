"""T2T-ViT's PyTorch names (yitu-opensource/T2T-ViT; docs/reference.md section 2) <-> the
variables of :class:`vit_jax.models.t2t.T2TViT`, one-to-one: ``.`` becomes ``/``, a numeric
component joins the one before it (``blocks.3`` -> ``blocks_3``), a Linear ``weight`` becomes a
transposed ``kernel`` and a LayerNorm's (``norm*``) ``scale``; the fixed ``pos_embed`` and a
Performer's random features ``w`` go to the ``'constants'`` collection, the rest to ``'params'``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from flax import traverse_util
import numpy as np

from vit_jax import models
from vit_jax.checkpoint import mismatch
from vit_jax.checkpoint import vit_shapes
from vit_jax.models import layout
from vit_jax.models import t2t


def torch_key_to_flax(key: str) -> Tuple[str, Tuple[str, ...]]:
  """``(collection, path)`` of one PyTorch key (``'module.'`` stripped), e.g.
  ``'blocks.3.attn.qkv.weight'`` -> ``('params', ('blocks_3', 'attn', 'qkv', 'kernel'))``."""
  key = key.removeprefix('module.')
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


def _image_size_from_pos_embed(state_dict: Mapping[str, Any]) -> Tuple[int, int]:
  for key, value in state_dict.items():
    if key.split('.')[-1] == 'pos_embed' and key.count('.') <= 1:
      n = int(np.shape(value)[1]) - 1
      side = vit_shapes.square_side(n)
      if side:
        return 16 * side, 16 * side  # 16 g px gives a g x g token grid.
      raise ValueError(f'pos_embed has {n} token rows, not a square grid: pass image_size')
  raise ValueError('The state_dict has no pos_embed: pass image_size')


def from_torch_state_dict(state_dict: Mapping[str, Any], model: t2t.T2TViT, *,
                          image_size: Union[None, int, Sequence[int]] = None
                          ) -> Dict[str, Dict[str, Any]]:
  """``model``'s ``{'params', 'constants'}`` (NumPy copies in its dtypes; ``blocks`` stacked
  if ``model.scan``) from a PyTorch T2T-ViT state dict (keys may start ``'module.'``), for
  images of ``image_size`` (``H`` or ``(H, W)``; default 16 px per ``pos_embed`` grid row).
  Raises ModelMismatchError naming what does not fit, in PyTorch's names and shapes."""
  if image_size is None:
    height, width = _image_size_from_pos_embed(state_dict)
  else:
    height, width = (image_size,) * 2 if isinstance(image_size, int) else map(int, image_size)
  unrolled = model.clone(scan=False, remat=False)  # The checkpoint's per-block layout.
  shapes = layout.unbox(models.abstract_variables(unrolled, (height, width)))
  expected = traverse_util.flatten_dict({c: shapes.get(c, {}) for c in ('params', 'constants')})

  converted: Dict[Tuple[str, ...], np.ndarray] = {}
  unexpected = []
  mismatched = []
  mismatched_paths = set()
  saved_shapes = {}  # Our names, kernels in Flax's (in, out) order: what the file holds.
  for key, value in state_dict.items():
    collection, path = torch_key_to_flax(key)
    full = (collection,) + path
    shape = tuple(np.shape(value))
    saved_shapes['/'.join(full)] = shape[::-1] if path[-1] == 'kernel' else shape
    array = np.asarray(value)
    if path[-1] == 'kernel' and array.ndim == 2:
      array = array.T  # PyTorch Linear weight (out, in) -> Flax kernel (in, out).
    if full not in expected:
      unexpected.append(f'{key} {shape}')
      continue
    want = expected[full]
    if tuple(array.shape) != tuple(want.shape):
      want_torch = tuple(want.shape[::-1]) if path[-1] == 'kernel' else tuple(want.shape)
      mismatched.append(f'{key}: checkpoint {shape}, model {want_torch}')
      mismatched_paths.add(full)
      continue
    converted[full] = np.array(array, dtype=want.dtype)
  missing = [_flax_to_torch_name(p) for p in expected
             if p not in converted and p not in mismatched_paths]
  if missing or unexpected or mismatched:
    hint = describe_architecture(saved_shapes)
    raise mismatch.ModelMismatchError(mismatch.mismatch_report(
        'The state_dict does not fit the model '
        f'(tokens_type={model.tokens_type!r}, embed_dim={model.embed_dim}, depth={model.depth}, '
        f'token_dim={model.token_dim}, num_classes={model.num_classes}, image {height}x{width}):',
        sorted(missing), unexpected, mismatched,
        hint and hint + ' Build the model with these values.'), hint)
  tree = traverse_util.unflatten_dict(converted)
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
  """The T2T-ViT fields ``shapes`` (``'/'``-joined names, per-layer or scanned) imply, in a
  sentence for error messages; None for shapes not a T2T-ViT's."""
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
  mlp_ratio = fc1[-1] / width if fc1 else None
  tokens_type = 'performer' if performer else 'transformer'
  fields = [f'embed_dim={width}', f'depth={depth}', f'mlp_ratio={mlp_ratio}',
            f'token_dim={token_dim}', f'tokens_type={tokens_type!r}']
  return f'The checkpoint is a T2T-ViT with {", ".join(fields)}{classes}.'
