"""The unrolled (``encoderblock_{i}``, ``(D,)``; the official ``.npz``) and scanned
(``encoderblock``, ``(L, D)``) parameter layouts, T2T-ViT's ``blocks_{i}``/``blocks`` likewise,
and unboxing. The converters are pure: any variables tree in, plain nested dicts out (NumPy
leaves stay NumPy, boxes dropped).
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

#: The scanned block subtrees (unrolled: ``f'{prefix}_{i}'``) of ViT and T2T-ViT.
BLOCK_PREFIXES = ('encoderblock', 'blocks')


def dict_keys(path) -> tuple[str, ...]:
  """The dict keys of a tree path (``jax.tree_util``'s), e.g. ``('params', 'head', 'kernel')``."""
  return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


#: The logical axis names of the models' parameters and activations (``kv`` the head size,
#: ``tokens`` the T2T layers' width), which the mesh rules map (docs/pods.md).
LOGICAL_AXIS_NAMES = ('batch', 'length', 'embed', 'mlp', 'heads', 'kv', 'qkv', 'classes', 'norm',
                      'conv_in', 'conv_out', 'layers', 'tokens', 'patch')


def _strip(box: Any) -> Any:
  # A box's own value, without the sharding constraint that ``box.unbox()`` adds under a mesh.
  if isinstance(box, meta.Partitioned):  # Includes nn.LogicallyPartitioned.
    return box.unbox(apply_constraint=False)
  return box.unbox()


def unbox(tree: Any) -> Any:
  """Any pytree with its Flax boxes replaced by their values; unlike ``nn.unbox`` it never adds a
  sharding constraint."""
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


def to_dict(tree: Any) -> Any:
  """``tree`` with every mapping in it (a ``FrozenDict``, Orbax's) as a plain dict."""
  if isinstance(tree, Mapping):
    return {k: to_dict(v) for k, v in tree.items()}
  return tree


def _stack(leaves):
  return (np if all(isinstance(x, np.ndarray) for x in leaves) else jnp).stack(leaves, axis=0)


def block_indices(node: Mapping, prefix: str) -> dict:
  """``{i: key}`` of the ``{prefix}_{i}`` keys of ``node``."""
  pattern = re.compile(rf'^{re.escape(prefix)}_(\d+)$')
  return {int(m.group(1)): key for key in node for m in [pattern.match(str(key))] if m}


def _prefixes(prefix: Optional[str]) -> tuple:
  return BLOCK_PREFIXES if prefix is None else (prefix,)


def scan_params(params: Any, num_layers: Optional[int] = None, *,
                prefix: Optional[str] = None) -> dict:
  """Stacks ``{prefix}_0 .. {prefix}_{L-1}`` into one ``{prefix}`` (leaves ``(L, ...)``); prefix
  None: each of :data:`BLOCK_PREFIXES`. ValueError: no blocks, indices not ``0..L-1``, not
  ``num_layers`` of them, blocks of different structure, or a ``{prefix}`` beside them."""
  count = [0]
  params = unbox(params)

  def convert(node):
    if not isinstance(node, Mapping):
      return node
    found = {p: block_indices(node, p) for p in _prefixes(prefix)}
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
    subtrees = [to_dict(node[blocks[i]]) for i in range(n)]
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
  """The inverse of :func:`scan_params`. ValueError: no stacked ``{prefix}``, leaves disagreeing
  on the leading axis, or ``{prefix}_{i}`` entries beside it."""
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
    if block_indices(node, prefix):
      raise ValueError(f'Tree has both {prefix!r} and {prefix}_{{i}} entries; cannot unscan it')
    stacked = to_dict(node[prefix])
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
  """Whether a mapping holds a stacked ``{prefix}`` (None: any of :data:`BLOCK_PREFIXES`)."""
  if not isinstance(params, Mapping):
    return False
  if any(isinstance(params.get(p), Mapping) for p in _prefixes(prefix)):
    return True
  return any(is_scanned(v, prefix=prefix) for v in params.values())
