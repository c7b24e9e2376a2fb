"""Conversion between the unrolled and the scanned (``nn.scan``) parameter layouts, and unboxing.

Unrolled (official, what ``.npz`` holds): ``Transformer/encoderblock_{i}/LayerNorm_0/scale``
``(D,)``; scanned: ``Transformer/encoderblock/LayerNorm_0/scale`` ``(L, D)``. T2T-ViT likewise
(``blocks_{i}`` / ``blocks``). The converters are pure, take a ``params`` tree or a whole
variables dict (every collection converted), ``dict`` or ``FrozenDict``, and return plain
nested dicts; NumPy leaves stay NumPy; boxes are dropped (:func:`unbox`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Optional

from flax.core import FrozenDict
from flax.core import meta
import jax
import jax.numpy as jnp
import numpy as np

#: Name of the scanned block subtree; unrolled blocks are named ``f'{BLOCK_PREFIX}_{i}'``.
BLOCK_PREFIX = 'encoderblock'

#: The block prefixes of all families: ViT's encoder and T2T-ViT's backbone.
BLOCK_PREFIXES = (BLOCK_PREFIX, 'blocks')


#: The logical axis names used by the models' parameters and activations (a mesh's rules map
#: some of them onto mesh axes; an unmapped name is unsharded):
#:
#: ``batch`` examples; ``length`` tokens; ``embed`` the model width (ViT ``hidden_size``, T2T-ViT
#: ``embed_dim``); ``mlp`` the MLP hidden units; ``heads`` attention heads; ``kv`` the per-head
#: width; ``qkv`` a fused query/key/value output axis (T2T-ViT ``qkv``/``kqv`` kernels, and the
#: input of the backbone's attention ``proj``); ``classes`` the head's outputs; ``norm`` the
#: LayerNorm/GroupNorm scale and bias; ``conv_in``/``conv_out`` ResNet convolution channels;
#: ``layers`` the stacked axis of scanned blocks (``scan=True``); ``tokens`` the T2T layers'
#: width (``token_dim``); ``patch`` reserved for patch (convolution window) axes, which are
#: left None.
LOGICAL_AXIS_NAMES = ('batch', 'length', 'embed', 'mlp', 'heads', 'kv', 'qkv', 'classes', 'norm',
                      'conv_in', 'conv_out', 'layers', 'tokens', 'patch')


def _strip(box: Any) -> Any:
  # A box's own value, without the sharding constraint that ``box.unbox()`` adds under a mesh.
  if isinstance(box, meta.Partitioned):  # Includes nn.LogicallyPartitioned.
    return box.unbox(apply_constraint=False)
  return box.unbox()


def unbox(tree: Any) -> Any:
  """Strips Flax axis-metadata boxes (``nn.LogicallyPartitioned``) from any pytree.

  Same structure, each box replaced by its value (the same array). Unlike ``nn.unbox`` it never
  adds a sharding constraint (host-side code).
  """
  return _unbox(tree) if _has_box(tree) else tree


def _has_box(tree: Any) -> bool:
  if isinstance(tree, meta.AxisMetadata):
    return True
  if isinstance(tree, Mapping):  # Any keys (jax.tree_util would sort them).
    return any(_has_box(v) for v in tree.values())
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=meta.is_axis_metadata)
  return any(isinstance(x, meta.AxisMetadata) for x in leaves)


def _unbox(tree: Any) -> Any:
  if isinstance(tree, meta.AxisMetadata):
    return _unbox(_strip(tree))
  if isinstance(tree, FrozenDict):
    return FrozenDict({k: _unbox(v) for k, v in tree.items()})
  if isinstance(tree, Mapping):
    return {k: _unbox(v) for k, v in tree.items()}
  return meta.map_axis_meta(lambda box: _unbox(_strip(box)), tree)


def _to_dict(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {k: _to_dict(v) for k, v in tree.items()}
  return tree


def _stack(leaves):
  if all(isinstance(x, np.ndarray) for x in leaves):
    return np.stack(leaves, axis=0)
  return jnp.stack(leaves, axis=0)


def _block_indices(node: Mapping, prefix: str) -> dict:
  pattern = re.compile(rf'^{re.escape(prefix)}_(\d+)$')
  found = {}
  for key in node:
    m = pattern.match(str(key))
    if m:
      found[int(m.group(1))] = key
  return found


def _prefixes(prefix: Optional[str]) -> tuple:
  return BLOCK_PREFIXES if prefix is None else (prefix,)


def scan_params(params: Any, num_layers: Optional[int] = None, *,
                prefix: Optional[str] = None) -> dict:
  """Stacks ``{prefix}_0 .. {prefix}_{L-1}`` into one ``{prefix}`` subtree (leaves ``(L, ...)``).

  ``prefix``: ``'encoderblock'`` or ``'blocks'``; None: each of :data:`BLOCK_PREFIXES`.
  ``num_layers``: expected L (None: any).

  Raises:
    ValueError: no ``{prefix}_{i}`` blocks (e.g. already scanned), indices not ``0..L-1``, a
      count other than ``num_layers``, blocks of different structure, or a ``{prefix}`` already
      beside them.
  """
  count = [0]
  params = unbox(params)

  def convert(node):
    if not isinstance(node, Mapping):
      return node
    found = {p: _block_indices(node, p) for p in _prefixes(prefix)}
    block_keys = {key for blocks in found.values() for key in blocks.values()}
    out = {key: convert(value) for key, value in node.items() if key not in block_keys}
    for p, blocks in found.items():
      if blocks:
        stack_blocks(node, out, p, blocks)
    return out

  def stack_blocks(node, out, prefix, blocks):
    n = len(blocks)
    if sorted(blocks) != list(range(n)):
      raise ValueError(
          f'{prefix}_{{i}} indices must be 0..{n - 1}, found {sorted(blocks)}')
    if num_layers is not None and n != num_layers:
      raise ValueError(f'Expected {num_layers} {prefix}_{{i}} blocks, found {n}')
    if prefix in out:
      raise ValueError(f'Tree has both {prefix!r} and {prefix}_{{i}} entries; cannot scan it')
    subtrees = [_to_dict(node[blocks[i]]) for i in range(n)]
    ref = jax.tree.structure(subtrees[0])
    for i, sub in enumerate(subtrees[1:], start=1):
      if jax.tree.structure(sub) != ref:
        raise ValueError(f'{prefix}_{i} has a different structure from {prefix}_0')
      shapes = [np.shape(x) for x in jax.tree.leaves(sub)]
      if shapes != [np.shape(x) for x in jax.tree.leaves(subtrees[0])]:
        raise ValueError(f'{prefix}_{i} has different leaf shapes from {prefix}_0')
    out[prefix] = jax.tree.map(lambda *xs: _stack(xs), *subtrees)
    count[0] += n

  result = convert(params)
  if count[0] == 0:
    names = ' or '.join(f'{p}_{{i}}' for p in _prefixes(prefix))
    raise ValueError(
        f'No {names} subtrees found: nothing to scan (is the tree already in the scanned '
        f'layout, with a single {" or ".join(map(repr, _prefixes(prefix)))} entry?)')
  return result


def unscan_params(params: Any, *, prefix: Optional[str] = None) -> dict:
  """Splits a stacked ``{prefix}`` subtree into ``{prefix}_0 .. {prefix}_{L-1}`` (inverse of scan).

  Raises:
    ValueError: no ``{prefix}`` subtree (e.g. already unrolled), leaves disagreeing on the
      leading axis, or ``{prefix}_{i}`` entries beside it.
  """
  count = [0]
  params = unbox(params)

  def convert(node):
    if not isinstance(node, Mapping):
      return node
    stacked = [p for p in _prefixes(prefix) if isinstance(node.get(p), Mapping)]
    out = {key: convert(value) for key, value in node.items() if key not in stacked}
    for p in stacked:
      split_blocks(node, out, p)
    return out

  def split_blocks(node, out, prefix):
    stacked = node[prefix]
    if _block_indices(node, prefix):
      raise ValueError(f'Tree has both {prefix!r} and {prefix}_{{i}} entries; cannot unscan it')
    stacked = _to_dict(stacked)
    leaves = jax.tree.leaves(stacked)
    lengths = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(lengths) != 1 or None in lengths:
      raise ValueError(f'Leaves under {prefix!r} must share one leading (layer) axis, '
                       f'found {sorted(map(str, lengths))}')
    (n,) = lengths
    for i in range(n):
      out[f'{prefix}_{i}'] = jax.tree.map(lambda x, i=i: x[i], stacked)
    count[0] += n

  result = convert(params)
  if count[0] == 0:
    raise ValueError(
        f'No stacked {" or ".join(map(repr, _prefixes(prefix)))} subtree found: nothing to '
        f'unscan (is the tree already in the unrolled '
        f'{" or ".join(p + "_{i}" for p in _prefixes(prefix))} layout?)')
  return result


def is_scanned(params: Any, *, prefix: Optional[str] = None) -> bool:
  """True if any mapping has a stacked ``{prefix}`` subtree (None: any of :data:`BLOCK_PREFIXES`).
  """
  if not isinstance(params, Mapping):
    return False
  if any(isinstance(params.get(p), Mapping) for p in _prefixes(prefix)):
    return True
  return any(is_scanned(v, prefix=prefix) for v in params.values())
