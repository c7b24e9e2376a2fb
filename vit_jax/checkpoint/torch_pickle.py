"""Reads PyTorch ``torch.save`` zip-format files into NumPy without torch and without running code.

A file written by ``torch.save`` (torch >= 1.6, the default "zip" format) is a zip archive::

  <prefix>/data.pkl        pickled object; tensors refer to storages by persistent id
  <prefix>/data/<key>      raw bytes of storage <key>
  <prefix>/byteorder       'little' or 'big' (absent in files from old torch: little)
  <prefix>/version, .format_version, .storage_alignment, ...   (not needed)

:func:`load_torch_zip` unpickles ``data.pkl`` with :class:`SafeUnpickler`, whose ``find_class``
knows only a fixed whitelist, each entry mapped to a function of this module that builds plain
data (no torch, no imports of the named modules):

* ``collections.OrderedDict``
* ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_tensor`` / ``_rebuild_parameter`` -> a
  contiguous ``np.ndarray`` (bounds-checked against its storage)
* ``torch.<T>Storage`` type markers (Float, Half, BFloat16 via ``ml_dtypes``, Double, Long, Int,
  Short, Char, Byte, Bool)
* ``builtins.set`` / ``frozenset`` / ``complex`` / ``slice``, ``_codecs.encode`` (how protocol 2
  pickles ``bytes``; latin-1 only) and ``argparse.Namespace`` (timm saves its training ``args``
  as one; it becomes an inert :class:`Namespace` holding the attributes).

Any other global (``posix.system``, ``builtins.eval``, ``numpy...``, user classes) raises
:class:`UnsafePickleError` before anything is called. Persistent ids must be
``('storage', <storage type>, key, location, numel)``. The legacy (pre-1.6, non-zip) format is
refused with :class:`LegacyTorchFormatError`.
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import pickle
import zipfile
from typing import Any, BinaryIO, Dict, Tuple, Union

import numpy as np

__all__ = [
    'LegacyTorchFormatError', 'Namespace', 'SafeUnpickler', 'UnsafePickleError', 'is_torch_zip',
    'load_torch_zip',
]


class UnsafePickleError(pickle.UnpicklingError):
  """The pickle names a global outside the whitelist (nothing was executed)."""


class LegacyTorchFormatError(ValueError):
  """The file is not a zip-format torch checkpoint (legacy torch format or a raw pickle)."""


def _bfloat16():
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  return np.dtype(ml_dtypes.bfloat16)


class _Frozen:
  """Base of the objects ``find_class`` hands out: no ``__dict__``, attributes cannot be set.

  A pickle can apply BUILD (``setattr``/``__dict__`` updates) to any object it obtained, so the
  shared whitelist objects must not be mutable, or one file could alter how later files load.
  """
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
  __slots__ = ('name', '_dtype')

  def __init__(self, name: str, dtype: Any):
    object.__setattr__(self, 'name', name)
    object.__setattr__(self, '_dtype', dtype)

  @property
  def dtype(self) -> np.dtype:
    return _bfloat16() if self._dtype == 'bfloat16' else np.dtype(self._dtype)

  def __repr__(self):
    return f'torch.{self.name}'


_STORAGE_TYPES = {
    name: _StorageType(name, dtype) for name, dtype in (
        ('FloatStorage', np.float32), ('HalfStorage', np.float16), ('BFloat16Storage', 'bfloat16'),
        ('DoubleStorage', np.float64), ('LongStorage', np.int64), ('IntStorage', np.int32),
        ('ShortStorage', np.int16), ('CharStorage', np.int8), ('ByteStorage', np.uint8),
        ('BoolStorage', np.bool_))
}


class _Storage:
  """A loaded storage: a 1-D array of ``numel`` elements."""

  def __init__(self, array: np.ndarray):
    self.array = array


def _as_int_tuple(value: Any, what: str) -> Tuple[int, ...]:
  if not isinstance(value, (tuple, list)) or not all(
      isinstance(v, int) and not isinstance(v, bool) for v in value):
    raise pickle.UnpicklingError(
        f'Malformed tensor record: {what} {value!r:.100} is not a tuple of ints')
  return tuple(int(v) for v in value)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> np.ndarray:
  """``torch._utils._rebuild_tensor``: a contiguous copy of the strided view of ``storage``."""
  if not isinstance(storage, _Storage):
    raise pickle.UnpicklingError('Malformed tensor record: its storage is not a persistent storage '
                                 f'record (got {type(storage).__name__})')
  (offset,) = _as_int_tuple((storage_offset,), 'storage_offset')
  shape = _as_int_tuple(size, 'size')
  strides = _as_int_tuple(stride, 'stride')
  if len(shape) != len(strides) or offset < 0 or any(s < 0 for s in shape) or any(
      st < 0 for st in strides):
    raise pickle.UnpicklingError(f'Malformed tensor record: offset {offset}, size {shape}, '
                                 f'stride {strides}')
  flat = storage.array
  if 0 in shape:
    return np.zeros(shape, flat.dtype)
  last = offset + sum((n - 1) * st for n, st in zip(shape, strides))
  if last >= flat.size:
    raise pickle.UnpicklingError(
        f'Malformed tensor record: size {shape}, stride {strides}, offset {offset} reach element '
        f'{last} of a storage of {flat.size} elements')
  itemsize = flat.dtype.itemsize
  view = np.lib.stride_tricks.as_strided(
      flat[offset:], shape=shape, strides=tuple(st * itemsize for st in strides), writeable=False)
  return np.array(view, order="C", copy=True)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
  del requires_grad, backward_hooks, metadata  # Autograd state: irrelevant for arrays.
  return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
  del requires_grad, backward_hooks
  if not isinstance(data, np.ndarray):
    raise pickle.UnpicklingError('Malformed parameter record: its data is not a tensor')
  return data


def _codecs_encode(text: Any, encoding: str = 'utf-8', errors: str = 'strict') -> bytes:
  """``_codecs.encode`` as protocol 2 uses it for ``bytes``: latin-1 only (no codec lookup)."""
  if not isinstance(text, str) or encoding not in ('latin1', 'latin-1') or errors != 'strict':
    raise UnsafePickleError('refusing _codecs.encode other than str.encode("latin1")')
  return text.encode('latin1')


class _FrozenClass(type):
  """Metaclass: class attributes cannot be set or deleted after creation (see :class:`_Frozen`)."""

  def __setattr__(cls, name, value):
    raise UnsafePickleError(f'refusing to set attribute {name!r} of {cls.__name__}')

  def __delattr__(cls, name):
    raise UnsafePickleError(f'refusing to delete attribute {name!r} of {cls.__name__}')


class Namespace(metaclass=_FrozenClass):
  """Inert stand-in for ``argparse.Namespace`` (e.g. timm's saved ``args``): attributes only."""

  def __init__(self, **kwargs):
    self.__dict__.update(kwargs)

  def __setstate__(self, state):
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
      raise pickle.UnpicklingError('Malformed argparse.Namespace state')
    self.__dict__.update(state)

  def __eq__(self, other):
    return isinstance(other, Namespace) and vars(self) == vars(other)

  def __repr__(self):
    return 'Namespace(' + ', '.join(f'{k}={v!r}' for k, v in vars(self).items()) + ')'


_SAFE_GLOBALS = {
    ('collections', 'OrderedDict'): collections.OrderedDict,
    ('torch._utils', '_rebuild_tensor'): _SafeFunction(_rebuild_tensor,
                                                       'torch._utils._rebuild_tensor'),
    ('torch._utils', '_rebuild_tensor_v2'): _SafeFunction(_rebuild_tensor_v2,
                                                          'torch._utils._rebuild_tensor_v2'),
    ('torch._utils', '_rebuild_parameter'): _SafeFunction(_rebuild_parameter,
                                                          'torch._utils._rebuild_parameter'),
    ('builtins', 'set'): set,
    ('builtins', 'frozenset'): frozenset,
    ('builtins', 'complex'): complex,
    ('builtins', 'slice'): slice,
    ('_codecs', 'encode'): _SafeFunction(_codecs_encode, '_codecs.encode'),
    ('argparse', 'Namespace'): Namespace,
    **{('torch', name): marker for name, marker in _STORAGE_TYPES.items()},
}


class SafeUnpickler(pickle.Unpickler):
  """Unpickles tensors (as NumPy) and plain containers only; refuses every other global.

  Args:
    file: the pickle stream (``data.pkl``).
    read_storage: ``key -> bytes`` of ``data/<key>``.
    byteorder: ``'little'`` or ``'big'``, the byte order of the storages.
  """

  def __init__(self, file: BinaryIO, read_storage, byteorder: str = 'little'):
    super().__init__(file)
    self._read_storage = read_storage
    self._byteorder = byteorder
    self._storages: Dict[str, _Storage] = {}

  def find_class(self, module: str, name: str) -> Any:
    # Protocol <= 2 pickles name Python 2 modules ('__builtin__.set'); map them like the stdlib
    # Unpickler(fix_imports=True) does. Pure string mapping: nothing is imported.
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
      raise pickle.UnpicklingError(f'Unsupported persistent id {pid!r:.200}: expected '
                                   "('storage', type, key, location, numel)")
    _, storage_type, key, location, numel = pid
    if not isinstance(storage_type, _StorageType):
      raise pickle.UnpicklingError(f'Unsupported storage type {storage_type!r:.100}')
    if not isinstance(key, str) or not isinstance(location, str) or not isinstance(
        numel, int) or isinstance(numel, bool) or numel < 0:
      raise pickle.UnpicklingError(f'Malformed storage record {pid!r:.200}')
    cached = self._storages.get(key)
    if cached is not None:
      if cached.array.dtype != storage_type.dtype:
        raise pickle.UnpicklingError(f'Storage {key!r} is used with two dtypes')
      return cached
    dtype = storage_type.dtype
    data = self._read_storage(key)
    nbytes = numel * dtype.itemsize
    if len(data) < nbytes:
      raise pickle.UnpicklingError(f'Storage {key!r} has {len(data)} bytes, expected {numel} '
                                   f'elements of {dtype.itemsize} bytes')
    raw = np.frombuffer(data, dtype=np.dtype(f'u{dtype.itemsize}'), count=numel)
    if dtype.itemsize > 1 and self._byteorder != _native_byteorder():
      raw = raw.byteswap()
    storage = _Storage(raw.view(dtype))
    self._storages[key] = storage
    return storage


def _native_byteorder() -> str:
  import sys  # pylint: disable=g-import-not-at-top
  return sys.byteorder


def _find_prefix(names) -> str:
  pkls = [n[:-len('data.pkl')] for n in names if n.endswith('data.pkl') and n.count('/') <= 1 and (
      n == 'data.pkl' or n.endswith('/data.pkl'))]
  if len(pkls) != 1:
    raise LegacyTorchFormatError(
        f'not a torch zip checkpoint: expected one "<name>/data.pkl" entry, found {len(pkls)}')
  return pkls[0]


def is_torch_zip(file: Union[str, BinaryIO]) -> bool:
  """True if ``file`` is a zip archive with one top-level ``<name>/data.pkl`` (torch layout)."""
  try:
    with zipfile.ZipFile(file) as archive:
      _find_prefix(archive.namelist())
      return True
  except (zipfile.BadZipFile, LegacyTorchFormatError, OSError):
    return False
  finally:
    if hasattr(file, 'seek'):
      file.seek(0)


_LEGACY_HINT = ('Only the zip format that torch.save writes since torch 1.6 is read (safely, '
                'without torch). Re-save it with a recent torch: '
                'torch.save(torch.load(path, weights_only=True), new_path).')


def load_torch_zip(file: Union[str, BinaryIO], name: str = '') -> Any:
  """Loads a ``torch.save`` zip-format file: tensors become contiguous ``np.ndarray``.

  Args:
    file: a local path or a seekable binary file object.
    name: how to call the file in errors (default: ``file`` if it is a path).

  Returns:
    The saved object with every tensor replaced by an ``np.ndarray`` (``OrderedDict``s, dicts,
    lists, tuples, numbers and strings as saved; ``argparse.Namespace`` as :class:`Namespace`).

  Raises:
    UnsafePickleError: the pickle names a global outside the whitelist (nothing is executed).
    LegacyTorchFormatError: not a zip archive in the torch layout (legacy torch format, tar,
      raw pickle, ...).
    pickle.UnpicklingError: malformed tensor or storage records.
  """
  name = name or (file if isinstance(file, str) else '<file>')
  try:
    archive = zipfile.ZipFile(file)
  except zipfile.BadZipFile:
    raise LegacyTorchFormatError(
        f'{name!r} is not a zip archive, so not a zip-format torch checkpoint (it may be in the '
        f'legacy torch serialization format, which needs unpickling arbitrary code to read). '
        f'{_LEGACY_HINT}') from None
  with archive:
    names = archive.namelist()
    try:
      prefix = _find_prefix(names)
    except LegacyTorchFormatError as e:
      raise LegacyTorchFormatError(f'{name!r}: {e}. {_LEGACY_HINT}') from None
    byteorder = 'little'
    if prefix + 'byteorder' in names:
      byteorder = archive.read(prefix + 'byteorder').decode('ascii', 'replace').strip()
      if byteorder not in ('little', 'big'):
        raise pickle.UnpicklingError(f'{name!r}: unknown byteorder {byteorder!r}')
    members = set(names)

    def read_storage(key: str) -> bytes:
      member = f'{prefix}data/{key}'
      if '/' in key or member not in members:
        raise pickle.UnpicklingError(f'{name!r}: storage {key!r} is not in the archive')
      return archive.read(member)

    unpickler = SafeUnpickler(io.BytesIO(archive.read(prefix + 'data.pkl')), read_storage,
                              byteorder)
    try:
      return unpickler.load()
    except UnsafePickleError as e:
      raise UnsafePickleError(f'{name!r}: {e}') from None
    except pickle.UnpicklingError:
      raise
    except Exception as e:  # Malformed pickles: TypeError, EOFError, IndexError, ...
      raise pickle.UnpicklingError(f'{name!r}: malformed torch checkpoint pickle '
                                   f'({type(e).__name__}: {e})') from None
