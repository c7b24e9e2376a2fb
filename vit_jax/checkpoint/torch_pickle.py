"""Reads PyTorch ``torch.save`` zip-format files (torch >= 1.6: ``<prefix>/data.pkl``, whose
tensors name storages ``<prefix>/data/<key>``) into NumPy, without torch and without running
code: only :data:`_SAFE_GLOBALS` resolve (the checks: docs/checkpoints.md, "Damaged and hostile
files"). Every error is a ``ValueError``."""

from __future__ import annotations

import _compat_pickle
import collections
import io
import math
import pickle
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO, Callable, Dict, Optional, Tuple

import ml_dtypes
import numpy as np

from vit_jax import storage
from vit_jax.checkpoint import archive as archive_lib
from vit_jax.checkpoint.archive import FIX, DamagedCheckpointError


class MalformedTorchFileError(DamagedCheckpointError, pickle.UnpicklingError):
  """A torch file's pickle, storage or tensor records are inconsistent (damaged or hand-made)."""


class UnsafePickleError(pickle.UnpicklingError, ValueError):
  """The pickle names a global outside the whitelist (nothing was executed)."""


class LegacyTorchFormatError(ValueError):
  """The file is not a zip-format torch checkpoint (legacy torch format or a raw pickle)."""


class _Frozen:
  """Base of the objects ``find_class`` hands out: immutable, since a pickle can apply BUILD
  to any object it obtained and one file must not alter how later files load."""
  __slots__ = ()

  def __setattr__(self, name, value):
    raise UnsafePickleError(f'refusing to set attribute {name!r} of {self!r}')

  def __delattr__(self, name):
    raise UnsafePickleError(f'refusing to delete attribute {name!r} of {self!r}')


class _SafeFunction(_Frozen):
  """A whitelisted callable; wraps one of this module's functions."""
  __slots__ = ('_fn', '_qualname')

  def __init__(self, fn, qualname: str):
    object.__setattr__(self, '_fn', fn)
    object.__setattr__(self, '_qualname', qualname)

  def __call__(self, *args, **kwargs):
    return self._fn(*args, **kwargs)

  def __repr__(self):
    return f'<safe {self._qualname}>'


class _StorageType(_Frozen):
  """Stand-in for ``torch.<Name>Storage``: carries the element dtype, cannot be called."""
  __slots__ = ('name', 'dtype')

  def __init__(self, name: str, dtype: Any):
    object.__setattr__(self, 'name', name)
    object.__setattr__(self, 'dtype', np.dtype(dtype))

  def __repr__(self):
    return f'torch.{self.name}'


_STORAGE_TYPES = {
    name: _StorageType(name, dtype) for name, dtype in (
        ('FloatStorage', np.float32), ('HalfStorage', np.float16),
        ('BFloat16Storage', ml_dtypes.bfloat16), ('DoubleStorage', np.float64),
        ('LongStorage', np.int64), ('IntStorage', np.int32), ('ShortStorage', np.int16),
        ('CharStorage', np.int8), ('ByteStorage', np.uint8), ('BoolStorage', np.bool_))
}


class _Storage:
  """A loaded storage: its 1-D array, key, views and the :class:`SafeUnpickler` (the budget)."""

  def __init__(self, array: np.ndarray, key: str, budget: 'SafeUnpickler'):
    self.array = array
    self.key = key
    self.budget = budget
    self.views: Dict[Tuple[Any, ...], np.ndarray] = {}


def _as_int_tuple(value: Any, what: str) -> Tuple[int, ...]:
  if not isinstance(value, (tuple, list)) or not all(
      isinstance(v, int) and not isinstance(v, bool) for v in value):
    raise MalformedTorchFileError(
        f'malformed tensor record: {what} {value!r:.100} is not a tuple of ints')
  return tuple(int(v) for v in value)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> np.ndarray:
  """``torch._utils._rebuild_tensor``: a contiguous copy of the strided view of ``storage``
  (checked inside it, counted against the budget; an identical view once)."""
  if not isinstance(storage, _Storage):
    raise MalformedTorchFileError('malformed tensor record: its storage is not a persistent '
                                  f'storage record (got {type(storage).__name__})')
  (offset,) = _as_int_tuple((storage_offset,), 'storage_offset')
  shape = _as_int_tuple(size, 'size')
  strides = _as_int_tuple(stride, 'stride')
  if len(shape) != len(strides) or min((offset, *shape, *strides)) < 0:
    raise MalformedTorchFileError(f'malformed tensor record: offset {offset}, size {shape}, '
                                  f'stride {strides}')
  flat = storage.array
  view_key = (offset, shape, strides)
  if view_key in storage.views:
    return storage.views[view_key]
  numel = math.prod(shape)
  if numel == 0:
    return np.zeros(shape, flat.dtype)
  where = f'a tensor of shape {shape}, strides {strides}, offset {offset}'
  if numel > flat.size:
    raise MalformedTorchFileError(f'{where} addresses {numel:,} elements of storage '
                                  f'{storage.key!r}, which holds {flat.size:,}')
  last = offset + sum((n - 1) * st for n, st in zip(shape, strides))
  if last >= flat.size:
    raise MalformedTorchFileError(f'{where} would reach element {last:,} of storage '
                                  f'{storage.key!r}, which holds {flat.size:,}')
  itemsize = flat.dtype.itemsize
  storage.budget.take(numel * itemsize)
  view = np.lib.stride_tricks.as_strided(
      flat[offset:], shape=shape, strides=tuple(st * itemsize for st in strides), writeable=False)
  array = np.array(view, order="C", copy=True)
  storage.views[view_key] = array
  return array


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
  del requires_grad, backward_hooks, metadata  # Autograd state: irrelevant for arrays.
  return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
  del requires_grad, backward_hooks
  if not isinstance(data, np.ndarray):
    raise MalformedTorchFileError('malformed parameter record: its data is not a tensor')
  return data


def _codecs_encode(text: Any, encoding: str = 'utf-8', errors: str = 'strict') -> bytes:
  """``_codecs.encode`` as protocol 2 uses it for ``bytes``: latin-1 only (no codec lookup)."""
  if not isinstance(text, str) or encoding not in ('latin1', 'latin-1') or errors != 'strict':
    raise UnsafePickleError('refusing _codecs.encode other than str.encode("latin1")')
  return text.encode('latin1')


class _FrozenClass(type):
  """Metaclass: class attributes cannot be set or deleted after creation (see :class:`_Frozen`)."""
  __setattr__, __delattr__ = _Frozen.__setattr__, _Frozen.__delattr__


class Namespace(metaclass=_FrozenClass):
  """Inert stand-in for ``argparse.Namespace`` (e.g. timm's saved ``args``): attributes only."""

  def __init__(self, **kwargs):
    self.__dict__.update(kwargs)

  def __setstate__(self, state):
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
      raise MalformedTorchFileError('malformed argparse.Namespace state')
    self.__dict__.update(state)

  def __eq__(self, other):
    return isinstance(other, Namespace) and vars(self) == vars(other)

  def __repr__(self):
    return 'Namespace(' + ', '.join(f'{k}={v!r}' for k, v in vars(self).items()) + ')'


_SAFE_GLOBALS = {
    ('collections', 'OrderedDict'): collections.OrderedDict,
    **{('torch._utils', fn.__name__): _SafeFunction(fn, f'torch._utils.{fn.__name__}')
       for fn in (_rebuild_tensor, _rebuild_tensor_v2, _rebuild_parameter)},
    **{('builtins', cls.__name__): cls for cls in (set, frozenset, complex, slice)},
    ('_codecs', 'encode'): _SafeFunction(_codecs_encode, '_codecs.encode'),
    ('argparse', 'Namespace'): Namespace,
    **{('torch', name): marker for name, marker in _STORAGE_TYPES.items()},
}


class SafeUnpickler(pickle.Unpickler):
  """Unpickles tensors (as NumPy) and plain containers only; refuses every other global.
  ``read_storage(key, nbytes)``: the bytes of ``data/<key>`` (at least ``nbytes``, or it raises);
  ``max_bytes``: the most bytes all tensors together may take."""

  def __init__(self, file: BinaryIO, read_storage: Callable[[str, int], bytes], byteorder: str,
               max_bytes: int):
    super().__init__(file)
    self._read_storage = read_storage
    self._byteorder = byteorder
    self._storages: Dict[str, _Storage] = {}
    self._max_bytes = max_bytes
    self._used = 0

  def take(self, nbytes: int) -> None:
    """Counts ``nbytes`` of built arrays against ``max_bytes``."""
    self._used += nbytes
    if self._used > self._max_bytes:
      raise MalformedTorchFileError(
          f"its tensors add up to more than the file's {self._max_bytes:,} bytes (overlapping "
          'views of its storages)')

  def find_class(self, module: str, name: str) -> Any:
    # Python 2 names of protocol <= 2, mapped as Unpickler(fix_imports=True) does (no import).
    if isinstance(module, str) and isinstance(name, str):
      if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
      elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    try:
      return _SAFE_GLOBALS[(module, name)]
    except (KeyError, TypeError):
      raise UnsafePickleError(
          f'refusing to unpickle {module}.{name}: only tensors and plain containers are loaded'
      ) from None

  def persistent_load(self, pid: Any) -> Any:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == 'storage'):
      raise MalformedTorchFileError(f'unsupported persistent id {pid!r:.200}: expected '
                                    "('storage', type, key, location, numel)")
    _, storage_type, key, location, numel = pid
    if not isinstance(storage_type, _StorageType):
      raise MalformedTorchFileError(f'unsupported storage type {storage_type!r:.100}')
    if not isinstance(key, str) or not isinstance(location, str) or not isinstance(
        numel, int) or isinstance(numel, bool) or numel < 0:
      raise MalformedTorchFileError(f'malformed storage record {pid!r:.200}')
    cached = self._storages.get(key)
    if cached is not None:
      if cached.array.dtype != storage_type.dtype:
        raise MalformedTorchFileError(f'storage {key!r} is used with two dtypes')
      return cached
    dtype = storage_type.dtype
    nbytes = numel * dtype.itemsize
    raw = np.frombuffer(self._read_storage(key, nbytes), dtype=np.dtype(f'u{dtype.itemsize}'),
                        count=numel)
    if dtype.itemsize > 1 and self._byteorder != sys.byteorder:
      raw = raw.byteswap()
    storage = _Storage(raw.view(dtype), key, self)
    self._storages[key] = storage
    return storage


def _prefixes(names) -> list:
  """The ``<name>/`` of each top-level ``<name>/data.pkl`` among zip member ``names``."""
  return [n[:-len('data.pkl')] for n in names
          if n.count('/') <= 1 and (n == 'data.pkl' or n.endswith('/data.pkl'))]


def has_torch_layout(names) -> bool:
  """Whether zip member ``names`` have torch.save's layout (one top-level ``<name>/data.pkl``)."""
  return len(_prefixes(names)) == 1


_LEGACY_HINT = ('Only the zip format that torch.save writes since torch 1.6 is read (safely, '
                'without torch). Re-save it with a recent torch: '
                'torch.save(torch.load(path, weights_only=True), new_path).')


def load_torch_zip(path: str) -> Any:
  """The object saved in the ``torch.save`` zip-format file at ``path`` (local or
  ``scheme://``), every tensor a contiguous ``np.ndarray``; raises as :func:`load` and
  LegacyTorchFormatError for a file that is no zip."""
  if storage.read_bytes(path, 4) not in archive_lib.ZIP_MAGICS:
    raise LegacyTorchFormatError(
        f'{path!r} is not a zip archive, so not a zip-format torch checkpoint (it may be in the '
        f'legacy torch serialization format, which needs unpickling arbitrary code to read). '
        f'{_LEGACY_HINT}')
  return load(archive_lib.Zip.of(path))


def load(zip_file: archive_lib.Zip) -> Any:
  """Loads the torch file ``zip_file`` (detected as a zip). Raises UnsafePickleError (a global
  outside the whitelist; nothing is executed), LegacyTorchFormatError (no ``<name>/data.pkl``),
  DamagedCheckpointError (an unreadable member; MalformedTorchFileError: inconsistent records)."""
  name = zip_file.name
  prefixes = _prefixes(zip_file.names)
  if len(prefixes) != 1:
    raise LegacyTorchFormatError(f'{name!r}: not a torch zip checkpoint: expected one '
                                 f'"<name>/data.pkl" entry, found {len(prefixes)}. {_LEGACY_HINT}')
  with zip_file.open() as archive:
    try:
      return _unpickle(zip_file, archive, prefixes[0])
    except UnsafePickleError as e:
      raise UnsafePickleError(f'{name!r}: {e}; nothing was run. Use weights from a trusted '
                              'source, or re-save only the tensors with torch: '
                              'torch.save(model.state_dict(), path).') from None
    except MalformedTorchFileError as e:
      raise MalformedTorchFileError(f'{name!r} is damaged or hand-made: {e}. {FIX}') from None
    except DamagedCheckpointError:
      raise  # A member that cannot be read: the message names the file already.
    except Exception as e:  # Malformed pickles: TypeError, EOFError, IndexError, ...
      raise MalformedTorchFileError(
          f'{name!r} is damaged or hand-made: its pickle cannot be read ({type(e).__name__}: '
          f'{e}). {FIX}') from None


def _unpickle(zip_file: archive_lib.Zip, archive: Any, prefix: str) -> Any:
  """Reads ``<prefix>data.pkl`` and its storages, refusing members that declare more than the
  file's bytes, each or together (zip bombs), before anything is inflated."""
  members = {info.filename: info for info in archive.infolist()}
  size = zip_file.size
  declared = 0

  def read(member: str) -> bytes:
    nonlocal declared
    info = members[member]
    if info.file_size > size:
      raise MalformedTorchFileError(f'its member {member!r} declares {info.file_size:,} bytes, '
                                    f'more than the whole file ({size:,} bytes)')
    declared += info.file_size
    if declared > size:
      raise MalformedTorchFileError(f'its members declare {declared:,} bytes together, more than '
                                    f'the whole file ({size:,} bytes)')
    return zip_file.read(archive, info)

  byteorder = 'little'
  if prefix + 'byteorder' in members:
    byteorder = read(prefix + 'byteorder').decode('ascii', 'replace').strip()
    if byteorder not in ('little', 'big'):
      raise MalformedTorchFileError(f'unknown byteorder {byteorder!r}')

  def read_storage(key: str, nbytes: int) -> bytes:
    member = f'{prefix}data/{key}'
    if '/' in key or member not in members:
      raise MalformedTorchFileError(f'storage {key!r} is not in the archive')
    if members[member].file_size < nbytes:  # Before reading it.
      raise MalformedTorchFileError(f'storage {key!r} holds {members[member].file_size:,} bytes '
                                    f'but its record declares {nbytes:,}')
    return read(member)

  unpickler = SafeUnpickler(io.BytesIO(read(prefix + 'data.pkl')), read_storage, byteorder,
                            max_bytes=size)
  return unpickler.load()


_STATE_DICT_KEYS = ('state_dict_ema', 'state_dict')


def _is_state_dict(obj: Any) -> bool:
  return (isinstance(obj, Mapping) and len(obj) > 0 and
          all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()))


def load_pth(path: Any, *, use_ema: bool = True,
             zip_file: Optional[archive_lib.Zip] = None) -> Dict[str, np.ndarray]:
  """``{PyTorch name: np.ndarray}`` (``module.`` stripped) of the file at ``path`` (local or
  ``scheme://``; ``zip_file``: its archive when detection opened it): a training checkpoint's
  ``state_dict_ema`` (with ``use_ema``) or ``state_dict``, or a plain state dict. Raises
  FileNotFoundError (missing file), ValueError (no state dict in it: its keys listed) and as
  :func:`load_torch_zip`."""
  if zip_file is None:
    path = storage.normalize(path)
    if not storage.exists(path) or storage.isdir(path):
      raise storage.not_found(path, 'No PyTorch checkpoint file')
    obj = load_torch_zip(path)
  else:
    obj = load(zip_file)
  keys = [k for k in _STATE_DICT_KEYS[0 if use_ema else 1:]
          if isinstance(obj, Mapping) and obj.get(k) is not None]
  state_dict = obj[keys[0]] if keys else obj
  if keys and not _is_state_dict(state_dict):
    raise ValueError(f'{path!r}: {keys[0]!r} is not a mapping of names to tensors '
                     f'(got {type(state_dict).__name__})')
  if not _is_state_dict(state_dict):
    if isinstance(obj, Mapping):
      top = ', '.join(repr(k) for k in obj)
      raise ValueError(f'{path!r} holds no state dict: expected a "state_dict_ema" (with '
                       f'use_ema=True) or "state_dict" entry, or a plain mapping of names to '
                       f'tensors; top-level keys: [{top}]')
    raise ValueError(f'{path!r} holds a {type(obj).__name__}, not a state dict')
  out = {key.removeprefix('module.'): value for key, value in state_dict.items()}
  if len(out) < len(state_dict):  # Both 'x' and 'module.x'.
    name = next(k for k in out if k in state_dict and f'module.{k}' in state_dict)
    raise ValueError(f'{path!r}: duplicate parameter {name!r} after stripping "module."')
  return out
