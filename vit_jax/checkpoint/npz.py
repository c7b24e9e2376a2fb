"""Official and big_vision ViT ``.npz`` files (flat ``np.savez`` of ``/``-joined names): read
without unpickling into the official per-layer layout; and written, with what the arrays do not
say in a JSON file beside (:func:`fields_path`; docs/checkpoints.md, "What a conversion keeps")."""

from __future__ import annotations

import itertools
import json
import math
import re
import zipfile
from collections.abc import Mapping
from typing import Any, Dict, Iterator, Optional, Tuple

from absl import logging
import numpy as np

from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import archive
from vit_jax.checkpoint import durable
from vit_jax.checkpoint import tree as tree_lib
from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint.tree import flatten_params, unflatten_params
from vit_jax.models import layout

_NUMBERED = re.compile(r'^(.*)_(\d+)$')
_MAP_PARTS = ('probe', 'MlpBlock_0', 'MultiHeadDotProductAttention_0', 'LayerNorm_0')


def convert_pre_linen(tree: Any) -> Any:
  """A new tree with pre-Linen numbering (one sequence per parent: ``LayerNorm_0,
  MultiHeadDotProductAttention_1, LayerNorm_2``) renumbered per class as Linen does
  (``LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1``); Linen trees are unchanged."""
  if not isinstance(tree, Mapping):
    return tree
  numbered = sorted((m.group(1), int(m.group(2)), k) for k in tree if (m := _NUMBERED.match(k)))
  rename = {key: f'{prefix}_{i}' for _, group in itertools.groupby(numbered, lambda n: n[0])
            for i, (prefix, _, key) in enumerate(group)}
  return {rename.get(k, k): convert_pre_linen(v) for k, v in tree.items()}


def fix_groupnorm(tree: Any, parent: str = '', key: str = '') -> Any:
  """A new tree with GroupNorm ``gn*/scale``, ``gn*/bias`` of ``(1, 1, 1, C)`` (older hybrid
  files) reshaped to ``(C,)``; ``parent``, ``key``: where ``tree`` sits (the recursion's)."""
  if isinstance(tree, Mapping):
    return {k: fix_groupnorm(v, key, k) for k, v in tree.items()}
  if (parent.startswith('gn') and key in ('scale', 'bias') and np.ndim(tree) == 4
      and all(d == 1 for d in np.shape(tree)[:3])):
    return np.reshape(tree, (-1,))
  return tree


def is_big_vision(params: Mapping[str, Any]) -> bool:
  """Whether a ViT params tree is in big_vision's layout: a position table outside
  ``Transformer/posembed_input`` (or none), or a MAP head."""
  encoder = params.get('Transformer')
  return 'embedding' in params and isinstance(encoder, Mapping) and (
      'posembed_input' not in encoder or 'pos_embedding' in encoder
      or any(k in params for k in ('pos_embedding', 'MAPHead_0', 'probe')))


def from_big_vision(params: Mapping[str, Any]) -> Dict[str, Any]:
  """The official per-layer tree that computes what a big_vision (``big_vision/models/vit.py``)
  params tree does (other trees unchanged; docs/checkpoints.md, "Other libraries' weights"): a
  zero class row in front of its learned table (added before the class token there), a
  top-level MAP head moved into ``MAPHead_0``, scanned blocks unrolled."""
  if not is_big_vision(params):
    return dict(params)
  out = dict(params)
  encoder = dict(params['Transformer'])
  table = out.pop('pos_embedding', None)
  if table is None:
    table = encoder.pop('pos_embedding', None)
  if 'probe' in out:
    out['MAPHead_0'] = {k: out.pop(k) for k in _MAP_PARTS if k in out}
  if table is not None:
    table = np.asarray(table)
    if 'cls' in out and not vit_shapes.square_side(table.shape[1] - 1):
      table = np.concatenate([np.zeros_like(table[:, :1]), table], axis=1)
    encoder['posembed_input'] = {'pos_embedding': table}
  out['Transformer'] = encoder
  if layout.is_scanned(out, prefix='encoderblock'):
    out = layout.unscan_params(out, prefix='encoderblock')
  return out


def _zip(path: Any) -> archive.Zip:
  """The ``.npz`` file at ``path``, checked to be one (when no detection opened it)."""
  path, names, head = storage.probe(path, 4, 'No .npz file')
  if names is not None or archive.kind(head) != 'zip':
    raise ValueError(f'{path!r} is not an .npz archive (a zip file); vit_jax.checkpoint.load '
                     'reads the other formats.')
  return archive.Zip.of(path)


def _members(npz: archive.Zip) -> Iterator[Tuple[str, str]]:
  """``(array name, member)`` for every member (``<name>.npy``); other members are refused."""
  for member in npz.names:
    if member.endswith('/'):
      continue
    if not member.endswith('.npy'):
      raise ValueError(f'{npz.name!r}: member {member!r} is not a .npy array; an .npz '
                       'checkpoint holds only arrays (np.savez).')
    yield member[:-len('.npy')], member


def _header(npz: archive.Zip, opened: zipfile.ZipFile, member: str
            ) -> Tuple[Tuple[int, ...], np.dtype]:
  """The shape and dtype the member's ``.npy`` header declares, checked against the bytes it
  holds; object dtypes are refused (nothing is unpickled)."""
  info = opened.getinfo(member)
  try:
    with opened.open(info) as f:
      version = np.lib.format.read_magic(f)
      # Version 3.0 differs from 2.0 only in the encoding of field names (utf8).
      reader = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                np.lib.format.read_array_header_2_0)
      shape, _, dtype = reader(f)
      data_bytes = info.file_size - f.tell()
  except (ValueError, *archive.MEMBER_ERRORS) as e:
    raise npz.damaged(f'its member {member!r} cannot be read ({e})') from None
  if dtype.hasobject:
    raise ValueError(
        f'{npz.name!r}: array {member[:-4]!r} is an object (pickled) array; refusing to unpickle '
        'it (np.load(allow_pickle=False)). Checkpoints must hold numeric arrays only.')
  nbytes = math.prod(shape) * dtype.itemsize
  if data_bytes < nbytes:
    raise npz.damaged(f'its member {member!r} declares a {dtype} array of shape {shape} '
                      f'({nbytes:,} bytes) but holds {max(data_bytes, 0):,} bytes')
  return tuple(shape), dtype


def _read(npz: archive.Zip, opened: zipfile.ZipFile, member: str) -> np.ndarray:
  _header(npz, opened, member)
  try:
    with opened.open(member) as f:
      return np.lib.format.read_array(f, allow_pickle=False)
  except (ValueError, *archive.MEMBER_ERRORS) as e:
    raise npz.damaged(f'its member {member!r} cannot be read ({e})') from None


def read_npz_index(path: Any, npz: Optional[archive.Zip] = None
                   ) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
  """``{array name: (shape, dtype)}`` from the ``.npy`` headers only (names as stored); raises
  as :func:`load_npz`."""
  npz = npz or _zip(path)
  with npz.open() as opened:
    return {key: _header(npz, opened, member) for key, member in _members(npz)}


def image_tower(params: Mapping[str, Any], path: Optional[str] = None) -> Dict[str, Any]:
  """The image tower ``img`` of a big_vision two-tower params tree (SigLIP, LiT:
  ``big_vision/models/proj/image_text/two_towers.py``; the rest dropped, logged when ``path`` is
  given); other trees unchanged."""
  tower = params.get('img')
  if not (isinstance(tower, Mapping) and 'embedding' in tower):
    return dict(params)
  if path is not None:
    dropped = ', '.join(f'{k}/' if isinstance(v, Mapping) else k
                        for k, v in sorted(params.items()) if k != 'img')
    logging.info('%s is a big_vision two-tower model (SigLIP, LiT): its image tower img/ is '
                 'read as the ViT; %s ignored (the text tower and the logit scale and bias).',
                 path, dropped or 'nothing else')
  return dict(tower)


def _params(flat: Dict[str, Any], path: Optional[str] = None) -> Dict[str, Any]:
  """The nested tree of an ``.npz`` file's flat arrays, ``params/`` stripped, the image tower
  taken, older files fixed (not yet from big_vision's layout)."""
  if all(k.startswith('params/') for k in flat):
    flat = {k[len('params/'):]: v for k, v in flat.items()}
  return fix_groupnorm(convert_pre_linen(image_tower(unflatten_params(flat), path)))


def read_npz_shapes(path: Any, npz: Optional[archive.Zip] = None
                    ) -> Tuple[Dict[str, Tuple[int, ...]], bool]:
  """``('/'``-joined names -> shapes of what :func:`load_npz` gives, whether the file is in
  big_vision's layout)``, from the headers only (zero-copy stand-ins for the arrays)."""
  params = _params({k: np.broadcast_to(np.zeros((), dtype), shape)
                    for k, (shape, dtype) in read_npz_index(path, npz).items()})
  return tree_lib.shapes({'params': from_big_vision(params)}), is_big_vision(params)


def load_npz(path: Any, npz: Optional[archive.Zip] = None) -> Dict[str, Any]:
  """``{'params': nested dict of np.ndarray}`` of an ``.npz`` file (local or ``scheme://``;
  ``npz``: its archive when detection opened it), in the official layout; never unpickles.
  Raises FileNotFoundError (missing file), DamagedCheckpointError (truncated or corrupt) and
  ValueError: not an ``.npz`` archive, empty, object arrays or other members than ``.npy``,
  PyTorch state-dict names."""
  npz = npz or _zip(path)
  path = npz.name
  with npz.open() as opened:
    flat = {key: _read(npz, opened, member) for key, member in _members(npz)}
  if not flat:
    raise ValueError(f'{path!r} contains no arrays')
  if not any('/' in k for k in flat) and any('.' in k for k in flat):
    example = next(k for k in flat if '.' in k)
    raise ValueError(
        f'{path!r} holds PyTorch state-dict names (e.g. {example!r}), not the official ViT '
        "'/'-joined Flax names. Load the PyTorch checkpoint itself (.pth.tar, with model=...), "
        'or convert the arrays with vit_jax.checkpoint.t2t_torch.from_torch_state_dict.')
  return {'params': from_big_vision(_params(flat, path))}


def save_npz(path: Any, params: Mapping) -> None:
  """Writes a params tree (or the ``params`` of variables) as an official flat ``.npz`` at
  ``path`` (local or ``scheme://``; no suffix added; :func:`.durable.write_atomically`):
  unrolled blocks, ml_dtypes as float32, like the published files. Raises ValueError:
  non-numeric leaves or keys that cannot be flattened."""
  path = storage.normalize(path)
  if isinstance(params, Mapping) and isinstance(params.get('params'), Mapping):
    params = params['params']
  if layout.is_scanned(params):
    params = layout.unscan_params(params)
  flat = {}
  for key, value in sorted(flatten_params(params).items()):
    array = np.asarray(value)
    try:
      if array.dtype.kind not in 'biufV' or array.dtype.hasobject:
        raise TypeError(array.dtype)
      flat[key] = array.astype(np.float32) if array.dtype.kind == 'V' else array  # ml_dtypes.
    except (TypeError, ValueError):
      raise ValueError(f'Parameter {key!r} has non-numeric dtype {array.dtype}') from None
  durable.write_atomically(path, lambda f: np.savez(f, **flat))


#: The suffix of the JSON file beside an ``.npz`` (``X.npz`` -> ``X.vit_jax.json``).
FIELDS_SUFFIX = '.vit_jax.json'


def fields_path(path: Any) -> str:
  """The JSON file :func:`save_npz_facts` writes beside the ``.npz`` at ``path``."""
  path = storage.normalize(path)
  return (path[:-4] if path.endswith('.npz') else path) + FIELDS_SUFFIX


def save_npz_facts(path: Any, facts: Mapping[str, Any]) -> None:
  """Writes ``facts`` (JSON-able: ``model``, ``vit_shapes.KEPT_FIELDS``; the
  ``orbax.EXPORT_FACTS``) to :func:`fields_path` of ``path``, atomically."""
  durable.write_atomically(fields_path(path), json.dumps(dict(facts), indent=1) + '\n')


def read_npz_facts(path: Any) -> Dict[str, Any]:
  """What :func:`save_npz_facts` wrote beside the ``.npz`` at ``path`` (``{}`` without the
  file; ``model`` checked to be an object). Raises ValueError naming a damaged file."""
  where = fields_path(path)
  fix = ('restore it or write the .npz again with python -m vit_jax.convert (or delete it: the '
         'model is then read from the shapes alone, with the official numerics)')
  facts = rundir.read_json(where, fix=fix) or {}
  if not isinstance(facts.get('model', {}), dict):
    raise ValueError(f'{where}: "model" is not a JSON object; {fix}.')
  return facts
