"""Official ViT ``.npz`` files (flat ``np.savez`` of ``/``-joined names, per-layer blocks):
reading, with the fixes of older files (pre-Linen numbering: :func:`convert_pre_linen`; 4-D
GroupNorm: :func:`fix_groupnorm`), and writing. Arrays are read with ``allow_pickle=False``.
Truncated or corrupt files (zip directory, CRC, a ``.npy`` header declaring more bytes than its
member holds) raise :class:`~.torch_pickle.DamagedCheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import io
import math
import os
import re
import zipfile
from collections.abc import Mapping
from typing import Any, Dict, Iterator, Tuple

import numpy as np

from vit_jax.checkpoint import big_vision
from vit_jax.checkpoint import paths
from vit_jax.checkpoint import torch_pickle
from vit_jax.checkpoint.tree import flatten_params, unflatten_params
from vit_jax.models import layout

_NUMBERED = re.compile(r'^(.*)_(\d+)$')


def convert_pre_linen(tree: Any) -> Any:
  """Renumbers pre-Linen module names to Linen names, recursively.

  Pre-Linen flax numbered all child modules of a parent in one sequence
  (``LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3``); Linen numbers each
  class separately (``LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0``). In
  every mapping the keys ``<prefix>_<n>`` are grouped by prefix, sorted by ``n`` and renumbered
  ``0, 1, ...``. Trees already in Linen numbering (contiguous from 0) are returned unchanged.
  Returns a new plain-dict tree; leaves are not copied.
  """
  if not isinstance(tree, Mapping):
    return tree
  groups: Dict[str, list] = {}
  for key in tree:
    m = _NUMBERED.match(key)
    if m:
      groups.setdefault(m.group(1), []).append((int(m.group(2)), key))
  rename = {}
  for prefix, items in groups.items():
    for new_index, (_, key) in enumerate(sorted(items)):
      rename[key] = f'{prefix}_{new_index}'
  return {rename.get(k, k): convert_pre_linen(v) for k, v in tree.items()}


def fix_groupnorm(tree: Any) -> Any:
  """Reshapes GroupNorm ``gn*/scale`` and ``gn*/bias`` from ``(1, 1, 1, C)`` to ``(C,)``.

  Older hybrid (R+ViT) files store them 4-D. Returns a new plain-dict tree.
  """

  def visit(node, parent):
    out = {}
    for key, value in node.items():
      if isinstance(value, Mapping):
        out[key] = visit(value, key)
      elif (parent.startswith('gn') and key in ('scale', 'bias') and np.ndim(value) == 4
            and all(d == 1 for d in np.shape(value)[:3])):
        out[key] = np.reshape(value, (-1,))
      else:
        out[key] = value
    return out

  return visit(tree, '') if isinstance(tree, Mapping) else tree


class _Archive:
  """An ``.npz`` file open for reading: its zip archive, name (for errors) and size in bytes.
  ``source``: the file (a local path or a ``BytesIO``) when the caller has checked that it is a
  zip (:func:`vit_jax.checkpoint.open`)."""

  def __init__(self, path: Any, source: Any = None):
    if source is None:
      path = paths.normalize(path)
      if not paths.exists(path):
        raise paths.not_found(path, 'No .npz file')
      if paths.isdir(path):
        raise ValueError(f'{path!r} is a directory, not an .npz file')
      if paths.read_head(path, 4) not in torch_pickle.ZIP_MAGICS:
        raise ValueError(f'{path!r} is not an .npz archive (not a zip file); '
                         'vit_jax.checkpoint.load reads the other formats.')
      source = io.BytesIO(paths.read_bytes(path)) if paths.is_remote(path) else path
    self.path, self.size = path, torch_pickle.file_size(source)
    self.zip = torch_pickle.open_zip(source, path)

  def damaged(self, info: zipfile.ZipInfo, problem: str) -> ValueError:
    return torch_pickle.DamagedCheckpointError(
        f'{self.path!r} is truncated or damaged: its member {info.filename!r} {problem}; the '
        f'file has {self.size:,} bytes. Download or copy it again.')

  def members(self) -> Iterator[Tuple[str, zipfile.ZipInfo]]:
    """``(array name, member)`` for every member (``<name>.npy``); other members are refused."""
    for info in self.zip.infolist():
      if info.is_dir():
        continue
      if not info.filename.endswith('.npy'):
        raise ValueError(f'{self.path!r}: member {info.filename!r} is not a .npy array; an .npz '
                         'checkpoint holds only arrays (np.savez).')
      yield info.filename[:-len('.npy')], info

  def header(self, info: zipfile.ZipInfo) -> Tuple[Tuple[int, ...], np.dtype]:
    """The shape and dtype that ``info``'s ``.npy`` header declares, checked against the bytes
    the member holds; object dtypes are refused (nothing is unpickled)."""
    key = info.filename[:-len('.npy')]
    try:
      with self.zip.open(info) as f:
        version = np.lib.format.read_magic(f)
        # Version 3.0 differs from 2.0 only in the encoding of field names (utf8).
        reader = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                  np.lib.format.read_array_header_2_0)
        shape, _, dtype = reader(f)
        data_bytes = info.file_size - f.tell()
    except (ValueError, *torch_pickle.MEMBER_ERRORS) as e:
      raise self.damaged(info, f'cannot be read ({e})') from None
    if dtype.hasobject:
      raise ValueError(
          f'{self.path!r}: array {key!r} is an object (pickled) array; refusing to unpickle it '
          f'(np.load(allow_pickle=False)). Checkpoints must hold numeric arrays only.')
    nbytes = math.prod(shape) * dtype.itemsize
    if data_bytes < nbytes:
      raise self.damaged(info, f'declares a {dtype} array of shape {shape} ({nbytes:,} bytes) '
                         f'but holds {max(data_bytes, 0):,} bytes')
    return tuple(shape), dtype

  def read(self, info: zipfile.ZipInfo) -> np.ndarray:
    self.header(info)
    try:
      with self.zip.open(info) as f:
        return np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, *torch_pickle.MEMBER_ERRORS) as e:
      raise self.damaged(info, f'cannot be read ({e})') from None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.zip.close()


def read_npz_index(path: Any, source: Any = None) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
  """``{array name: (shape, dtype)}`` of the ``.npz`` file at ``path``, from the ``.npy``
  headers only (no array is read). Names as stored (``/``-joined, no renaming).

  Raises:
    FileNotFoundError, ValueError, DamagedCheckpointError: as :func:`load_npz`.
  """
  with _Archive(path, source) as archive:
    return {key: archive.header(info) for key, info in archive.members()}


def load_npz(path: Any, source: Any = None) -> Dict[str, Any]:
  """Loads an official flat ``.npz`` file; returns ``{'params': nested dict of np.ndarray}``.

  Keys are ``/``-split into a nested dict (a leading ``params/`` on every key is removed), the
  pre-Linen numbering is converted (:func:`convert_pre_linen`) and GroupNorm parameters are
  squeezed (:func:`fix_groupnorm`). A big_vision file is converted to the official layout
  (:mod:`.big_vision`: position table, MAP head, scanned blocks unrolled). Never unpickles.

  Args:
    path: local or ``scheme://`` path of the ``.npz`` file.
    source: as for :class:`_Archive`.

  Raises:
    FileNotFoundError: missing file.
    vit_jax.checkpoint.DamagedCheckpointError: a truncated or corrupt file (its zip directory or
      a member cannot be read, a header declares more than its member holds); a ``ValueError``.
    ValueError: not an ``.npz`` archive, empty, containing object arrays or other members than
      ``.npy`` arrays, or holding PyTorch state-dict names.
  """
  with _Archive(path, source) as archive:
    path = archive.path
    flat = {key: archive.read(info) for key, info in archive.members()}
  if not flat:
    raise ValueError(f'{path!r} contains no arrays')
  if not any('/' in k for k in flat) and any('.' in k for k in flat):
    example = next(k for k in flat if '.' in k)
    raise ValueError(
        f'{path!r} holds PyTorch state-dict names (e.g. {example!r}), not the official ViT '
        "'/'-joined Flax names. Load the PyTorch checkpoint itself (.pth.tar, with model=...), "
        'or convert the arrays with vit_jax.checkpoint.t2t_torch.from_torch_state_dict.')
  if all(k.startswith('params/') for k in flat):
    flat = {k[len('params/'):]: v for k, v in flat.items()}
  params = fix_groupnorm(convert_pre_linen(unflatten_params(flat)))
  if big_vision.is_big_vision(params):
    params = big_vision.to_official(params)
  return {'params': params}


def save_npz(path: Any, params: Mapping) -> None:
  """Writes parameters as an official-layout flat ``.npz`` (Linen names, unrolled, float32).

  Args:
    path: destination (local or ``scheme://``); written as given (no ``.npz`` is appended);
      local parent directories are created.
    params: a params tree, or a variables dict with a ``'params'`` key (only ``params`` is
      written). A scanned tree (stacked ``encoderblock``) is first converted to
      ``encoderblock_{i}``. JAX arrays are fetched to host; non-standard float dtypes
      (``bfloat16``) are written as float32, like the published files.

  Raises:
    ValueError: for non-numeric leaves or keys that cannot be flattened.
  """
  path = paths.normalize(path)
  if isinstance(params, Mapping) and isinstance(params.get('params'), Mapping):
    params = params['params']
  if layout.is_scanned(params):
    params = layout.unscan_params(params)
  flat = {}
  for key, value in sorted(flatten_params(params).items()):
    array = np.asarray(value)
    if array.dtype.kind not in 'biufV' or array.dtype.hasobject:
      raise ValueError(f'Parameter {key!r} has non-numeric dtype {array.dtype}')
    if array.dtype.kind == 'V':  # ml_dtypes (bfloat16, float8_*): store float32.
      try:
        array = array.astype(np.float32)
      except (TypeError, ValueError):
        raise ValueError(f'Parameter {key!r} has non-numeric dtype {array.dtype}') from None
    flat[key] = array
  if paths.is_remote(path):
    buffer = io.BytesIO()
    np.savez(buffer, **flat)
    with paths.open_file(path, 'wb') as f:
      f.write(buffer.getvalue())
  else:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'wb') as f:
      np.savez(f, **flat)
