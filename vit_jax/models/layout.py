"""Conversion between the unrolled and the scanned (``nn.scan``) parameter layouts.

Unrolled (official, what ``.npz`` checkpoints hold)::

  Transformer/encoderblock_0/LayerNorm_0/scale        (D,)
  ...
  Transformer/encoderblock_{L-1}/LayerNorm_0/scale    (D,)

Scanned (``VisionTransformer(scan=True)``)::

  Transformer/encoderblock/LayerNorm_0/scale          (L, D)

T2T-ViT's backbone likewise: ``blocks_{i}/norm1/scale`` (D,) unrolled (the reference's
``blocks.i``), ``blocks/norm1/scale`` (depth, D) with ``T2TViT(scan=True)``. The functions below
convert every block prefix of :data:`BLOCK_PREFIXES` unless given one ``prefix``.

Both functions are pure (the input tree is not modified), accept a ``params`` tree or a whole
variables dict (``{'params': ..., ...}``: every collection is converted), accept ``dict`` and
``FrozenDict`` nodes and return plain nested ``dict`` trees. Leaves may be NumPy or JAX arrays;
NumPy leaves stay NumPy. Boxed leaves (``nn.LogicallyPartitioned``, what ``model.init`` returns,
see :func:`unbox`) are unboxed first: the logical names are not carried over.

Logical axes: every parameter of the models is created with ``nn.with_logical_partitioning``,
so ``model.init`` returns its ``'params'`` as ``nn.LogicallyPartitioned`` boxes carrying one
logical axis name (or None) per array axis, from :data:`LOGICAL_AXIS_NAMES`. :func:`unbox`
strips the boxes (plain arrays, same values); :func:`logical_axes` gives the tree of logical
``PartitionSpec`` s of a model without allocating anything.
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
  """Strips Flax axis-metadata boxes (``nn.LogicallyPartitioned``) from a tree.

  ``model.init`` returns the parameters boxed with their logical axis names; ``model.apply``
  takes boxed and plain variables alike. Use this for plain arrays (e.g. to compare, save or
  feed an optimizer that looks at key paths). Unlike ``flax.linen.unbox`` it never adds a
  sharding constraint (it is meant for host-side code; inside ``jax.jit`` under a mesh,
  ``nn.unbox`` also constrains each value to its sharding).

  Args:
    tree: any pytree (variables, params, or a ``jax.eval_shape`` of them); ``dict`` and
      ``FrozenDict`` containers are kept as they are.

  Returns:
    The same structure (mappings keep their key order) with every box replaced by its value
    (the same array object); a tree without boxes is returned as it is.
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
  """Stacks ``encoderblock_{i}`` subtrees into one ``encoderblock`` subtree (leading axis L).

  Args:
    params: nested params (or variables) dict in the unrolled layout.
    num_layers: expected number of blocks; ``None`` accepts whatever is present.
    prefix: block name prefix (``'encoderblock'`` or T2T-ViT's ``'blocks'``); ``None``: each of
      :data:`BLOCK_PREFIXES`.

  Returns:
    A new nested dict in which every mapping holding ``{prefix}_0 .. {prefix}_{L-1}`` holds
    ``{prefix}`` instead, each leaf of shape ``(L, *shape)``.

  Raises:
    ValueError: if no ``{prefix}_{i}`` blocks are found (e.g. the tree is already scanned), the
      block indices are not ``0..L-1``, their count differs from ``num_layers``, the blocks do not
      have identical structure/shapes, or the same mapping already has a ``{prefix}`` entry.
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
  """Splits a stacked ``encoderblock`` subtree into ``encoderblock_{i}`` subtrees.

  Args:
    params: nested params (or variables) dict in the scanned layout.
    prefix: block name prefix (``'encoderblock'`` or T2T-ViT's ``'blocks'``); ``None``: each of
      :data:`BLOCK_PREFIXES`.

  Returns:
    A new nested dict in which every ``{prefix}`` mapping with leaves of shape ``(L, *shape)`` is
    replaced by ``{prefix}_0 .. {prefix}_{L-1}`` with leaves of shape ``shape``.

  Raises:
    ValueError: if no ``{prefix}`` subtree is found (e.g. the tree is already unrolled), its
      leaves disagree on the leading axis, or the mapping also has ``{prefix}_{i}`` entries.
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
  """True if any mapping in ``params`` has a stacked ``{prefix}`` subtree (scanned layout).

  ``prefix`` None looks for each of :data:`BLOCK_PREFIXES`.
  """
  if not isinstance(params, Mapping):
    return False
  if any(isinstance(params.get(p), Mapping) for p in _prefixes(prefix)):
    return True
  return any(is_scanned(v, prefix=prefix) for v in params.values())
