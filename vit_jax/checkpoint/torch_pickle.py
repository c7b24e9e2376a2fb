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

Damaged and hand-made files raise :class:`DamagedCheckpointError` (the ``.npz`` reader shares it
and the zip helpers :func:`open_zip`, :func:`read_member`): a zip whose directory or a member
cannot be read (truncated download, CRC mismatch), a member that declares more bytes than the
whole file (a zip bomb), a storage smaller than its record, a tensor that addresses more elements
than its storage holds or any element outside it (zero strides included), and tensors adding up
to more bytes than the file (identical views of one storage, e.g. tied weights, are one array,
counted once). So a file of ``n`` bytes never makes this reader allocate much more than ``2 n``.
All the errors of this module are ``ValueError`` subclasses.
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import math
import os
import pickle
import zipfile
import zlib
from typing import Any, BinaryIO, Callable, Dict, Optional, Tuple, Union

import numpy as np

__all__ = [
    'DamagedCheckpointError', 'LegacyTorchFormatError', 'MEMBER_ERRORS', 'MalformedTorchFileError',
    'Namespace', 'SafeUnpickler', 'UnsafePickleError', 'ZIP_MAGICS', 'file_size',
    'has_torch_layout', 'load_torch_zip', 'open_zip', 'read_member',
]

#: The first bytes of a zip archive (a local file header; an empty archive's end record).
ZIP_MAGICS = (b'PK\x03\x04', b'PK\x05\x06')
_FIX = 'Download or copy it again.'


class DamagedCheckpointError(ValueError):
  """A checkpoint file is truncated, corrupt or hand-made (also
  ``vit_jax.checkpoint.DamagedCheckpointError``).

  The message names the file, what cannot be read (its zip directory, a member, a record) and
  the fix. A ``ValueError``, so ``python -m vit_jax.main`` reports it as one ``FATAL:`` line with
  exit code 2.
  """


class MalformedTorchFileError(DamagedCheckpointError, pickle.UnpicklingError):
  """A torch file's pickle, storage or tensor records are inconsistent (damaged or hand-made)."""


class UnsafePickleError(pickle.UnpicklingError, ValueError):
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


class _Budget:
  """The bytes of arrays one load may build: at most ``limit`` (the file's size; None: any)."""

  def __init__(self, limit: Optional[int]):
    self.limit, self.used = limit, 0

  def take(self, nbytes: int) -> None:
    self.used += nbytes
    if self.limit is not None and self.used > self.limit:
      raise MalformedTorchFileError(
          f"its tensors add up to more than the file's {self.limit:,} bytes (overlapping views "
          'of its storages)')


class _Storage:
  """A loaded storage: a 1-D array, its key, the views built from it, and the load's budget."""

  def __init__(self, array: np.ndarray, key: str, budget: _Budget):
    self.array, self.key, self.budget = array, key, budget
    self.views: Dict[Tuple[Any, ...], np.ndarray] = {}


def _as_int_tuple(value: Any, what: str) -> Tuple[int, ...]:
  if not isinstance(value, (tuple, list)) or not all(
      isinstance(v, int) and not isinstance(v, bool) for v in value):
    raise MalformedTorchFileError(
        f'malformed tensor record: {what} {value!r:.100} is not a tuple of ints')
  return tuple(int(v) for v in value)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> np.ndarray:
  """``torch._utils._rebuild_tensor``: a contiguous copy of the strided view of ``storage``.

  The view may address neither more elements than the storage holds nor any element outside
  it; its bytes count against the load's budget (the file's size), an identical view of the
  same storage (tied weights) is the same array and is counted once.
  """
  if not isinstance(storage, _Storage):
    raise MalformedTorchFileError('malformed tensor record: its storage is not a persistent '
                                  f'storage record (got {type(storage).__name__})')
  (offset,) = _as_int_tuple((storage_offset,), 'storage_offset')
  shape = _as_int_tuple(size, 'size')
  strides = _as_int_tuple(stride, 'stride')
  if len(shape) != len(strides) or offset < 0 or any(s < 0 for s in shape) or any(
      st < 0 for st in strides):
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
      raise MalformedTorchFileError('malformed argparse.Namespace state')
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
    read_storage: ``(key, nbytes) -> bytes`` of ``data/<key>``, where ``nbytes`` is the size its
      record declares (check it against the member before reading; shorter data is refused).
    byteorder: ``'little'`` or ``'big'``, the byte order of the storages.
    max_bytes: the most bytes all tensors together may take (see :func:`_rebuild_tensor`); the
      file's size in :func:`load_torch_zip`. None: no bound.
  """

  def __init__(self, file: BinaryIO, read_storage: Callable[[str, int], bytes],
               byteorder: str = 'little', max_bytes: Optional[int] = None):
    super().__init__(file)
    self._read_storage = read_storage
    self._byteorder = byteorder
    self._storages: Dict[str, _Storage] = {}
    self._budget = _Budget(max_bytes)

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
    data = self._read_storage(key, nbytes)
    if len(data) < nbytes:
      raise MalformedTorchFileError(f'storage {key!r} holds {len(data):,} bytes but its record '
                                    f'declares {nbytes:,}')
    raw = np.frombuffer(data, dtype=np.dtype(f'u{dtype.itemsize}'), count=numel)
    if dtype.itemsize > 1 and self._byteorder != _native_byteorder():
      raw = raw.byteswap()
    storage = _Storage(raw.view(dtype), key, self._budget)
    self._storages[key] = storage
    return storage


def _native_byteorder() -> str:
  import sys  # pylint: disable=g-import-not-at-top
  return sys.byteorder


# ------------------------------------------------------------------------------------------------
# Zip archives (shared with the .npz reader).
# ------------------------------------------------------------------------------------------------

#: What zipfile raises for an archive or member it cannot read: a bad directory or CRC, a
#: corrupt deflate stream, data that ends early, an unsupported compression or encryption.
MEMBER_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError)


def file_size(file: Union[str, os.PathLike, BinaryIO]) -> int:
  """The size in bytes of a local file or of a seekable file object (its position is kept)."""
  if isinstance(file, (str, os.PathLike)):
    return os.path.getsize(file)
  position = file.tell()
  end = file.seek(0, io.SEEK_END)
  file.seek(position)
  return end


def _damaged(name: str, problem: str, size: int) -> DamagedCheckpointError:
  return DamagedCheckpointError(f'{name!r} is truncated or damaged: {problem}; the file has '
                                f'{size:,} bytes. {_FIX}')


def _reason(error: BaseException) -> str:
  return str(error) or type(error).__name__


def open_zip(file: Union[str, os.PathLike, BinaryIO], name: str) -> zipfile.ZipFile:
  """``zipfile.ZipFile(file)``; an archive whose directory cannot be read (a truncated download)
  raises :class:`DamagedCheckpointError` naming ``name``, the reason and the file's size.

  Raises:
    DamagedCheckpointError: see above (also for a file that is no zip at all: call it only for
      files that start with :data:`ZIP_MAGICS`).
    OSError: the file cannot be opened (missing, a directory, no permission).
  """
  try:
    return zipfile.ZipFile(file)
  except (zipfile.BadZipFile, EOFError, ValueError) as e:
    raise _damaged(name, f'its zip directory cannot be read ({_reason(e)})',
                   file_size(file)) from None


def read_member(archive: zipfile.ZipFile, member: Union[str, zipfile.ZipInfo], name: str,
                size: int) -> bytes:
  """The bytes of ``member``; CRC mismatches and corrupt data raise DamagedCheckpointError."""
  info = member if isinstance(member, zipfile.ZipInfo) else archive.getinfo(member)
  try:
    return archive.read(info)
  except MEMBER_ERRORS as e:
    raise _damaged(name, f'its member {info.filename!r} cannot be read ({_reason(e)})',
                   size) from None


def _find_prefix(names) -> str:
  pkls = [n[:-len('data.pkl')] for n in names if n.endswith('data.pkl') and n.count('/') <= 1 and (
      n == 'data.pkl' or n.endswith('/data.pkl'))]
  if len(pkls) != 1:
    raise LegacyTorchFormatError(
        f'not a torch zip checkpoint: expected one "<name>/data.pkl" entry, found {len(pkls)}')
  return pkls[0]


def has_torch_layout(names) -> bool:
  """Whether zip member ``names`` have torch.save's layout (one top-level ``<name>/data.pkl``)."""
  try:
    _find_prefix(names)
    return True
  except LegacyTorchFormatError:
    return False


_LEGACY_HINT = ('Only the zip format that torch.save writes since torch 1.6 is read (safely, '
                'without torch). Re-save it with a recent torch: '
                'torch.save(torch.load(path, weights_only=True), new_path).')
_UNSAFE_HINT = ('Use weights from a trusted source, or re-save only the tensors with torch: '
                'torch.save(model.state_dict(), path).')


def _starts_with_zip_magic(file: Union[str, os.PathLike, BinaryIO]) -> bool:
  if isinstance(file, (str, os.PathLike)):
    with open(file, 'rb') as f:
      return f.read(4) in ZIP_MAGICS
  position = file.tell()
  try:
    return file.read(4) in ZIP_MAGICS
  finally:
    file.seek(position)


def load_torch_zip(file: Union[str, BinaryIO], name: str = '') -> Any:
  """Loads a ``torch.save`` zip-format file: tensors become contiguous ``np.ndarray``.

  Args:
    file: a local path or a seekable binary file object.
    name: how to call the file in errors (default: ``file`` if it is a path).

  Returns:
    The saved object with every tensor replaced by an ``np.ndarray`` (``OrderedDict``s, dicts,
    lists, tuples, numbers and strings as saved; ``argparse.Namespace`` as :class:`Namespace`).
    Identical views of one storage (tied weights) are the same array.

  Raises:
    UnsafePickleError: the pickle names a global outside the whitelist (nothing is executed).
    LegacyTorchFormatError: not a zip archive in the torch layout (legacy torch format, tar,
      raw pickle, ...).
    DamagedCheckpointError: a truncated or corrupt zip (its directory or a member cannot be
      read); :class:`MalformedTorchFileError` (also a ``pickle.UnpicklingError``): a member
      declaring more bytes than the file, malformed pickle, storage or tensor records, a tensor
      addressing more than its storage, tensors adding up to more than the file.
  """
  name = name or (os.fspath(file) if isinstance(file, (str, os.PathLike)) else '<file>')
  if not _starts_with_zip_magic(file):
    raise LegacyTorchFormatError(
        f'{name!r} is not a zip archive, so not a zip-format torch checkpoint (it may be in the '
        f'legacy torch serialization format, which needs unpickling arbitrary code to read). '
        f'{_LEGACY_HINT}')
  size = file_size(file)
  with open_zip(file, name) as archive:
    try:
      prefix = _find_prefix(archive.namelist())
    except LegacyTorchFormatError as e:
      raise LegacyTorchFormatError(f'{name!r}: {e}. {_LEGACY_HINT}') from None
    try:
      return _unpickle(archive, prefix, name, size)
    except UnsafePickleError as e:
      raise UnsafePickleError(f'{name!r}: {e}; nothing was run. {_UNSAFE_HINT}') from None
    except MalformedTorchFileError as e:
      raise MalformedTorchFileError(f'{name!r} is damaged or hand-made: {e}. {_FIX}') from None
    except DamagedCheckpointError:
      raise  # A member that cannot be read: the message names the file already.
    except Exception as e:  # Malformed pickles: TypeError, EOFError, IndexError, ...
      raise MalformedTorchFileError(
          f'{name!r} is damaged or hand-made: its pickle cannot be read ({type(e).__name__}: '
          f'{e}). {_FIX}') from None


def _unpickle(archive: zipfile.ZipFile, prefix: str, name: str, size: int) -> Any:
  """Reads ``<prefix>data.pkl`` and its storages; the members read may not declare more than
  ``size`` bytes, each or together (zip bombs), checked before anything is inflated."""
  members = {info.filename: info for info in archive.infolist()}
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
    return read_member(archive, info, name, size)

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
