"""The containers of checkpoint files and the checks every reader shares: a file's kind from its
first bytes, zip archives (``.npz``, PyTorch), ``.safetensors`` files, the damaged-file error."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import struct
import zipfile
import zlib
from typing import Any, BinaryIO, Dict, Iterator, Mapping, Optional, Tuple, Union

import numpy as np

from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import durable

#: The first bytes of a zip archive (a local file header; an empty archive's end record).
ZIP_MAGICS = (b'PK\x03\x04', b'PK\x05\x06')
#: The most header bytes a safetensors file may declare (the format's own limit, 100 MB).
_MAX_SAFETENSORS_HEADER = 100_000_000
SAFETENSORS_SUFFIX = '.safetensors'
#: What zipfile raises for an archive or member it cannot read: a bad directory or CRC, a
#: corrupt deflate stream, data that ends early, an unsupported compression or encryption.
MEMBER_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError)
FIX = 'Download or copy it again.'

File = Union[str, os.PathLike, BinaryIO]


class DamagedCheckpointError(ValueError):
  """A checkpoint file is truncated, corrupt or hand-made (named, with what cannot be read)."""


def damaged(name: str, problem: str, size: int) -> DamagedCheckpointError:
  return DamagedCheckpointError(f'{name!r} is truncated or damaged: {problem}; the file has '
                                f'{size:,} bytes. {FIX}')


def kind(head: bytes) -> Optional[str]:
  """``'zip'``, ``'safetensors'``, ``'npy'``, ``'pickle'`` or None, from a file's first 9 bytes
  (a safetensors file starts with its 8-byte little-endian header length, then ``{``)."""
  if head[:4] in ZIP_MAGICS:
    return 'zip'
  if len(head) >= 9 and head[8:9] == b'{' and (
      1 < struct.unpack('<Q', head[:8])[0] <= _MAX_SAFETENSORS_HEADER):
    return 'safetensors'
  if head.startswith(b'\x93NUMPY'):
    return 'npy'
  return 'pickle' if head.startswith(b'\x80') else None


def file_size(file: File) -> int:
  """The size in bytes of a local or remote file or a seekable file object (position kept)."""
  if isinstance(file, (str, os.PathLike)):
    return storage.size(os.fspath(file))
  position = file.tell()
  end = file.seek(0, io.SEEK_END)
  file.seek(position)
  return end


def _open_zip(file: File, name: str) -> zipfile.ZipFile:
  """``zipfile.ZipFile(file)``; DamagedCheckpointError when its directory cannot be read."""
  try:
    return zipfile.ZipFile(file)
  except (zipfile.BadZipFile, EOFError, ValueError) as e:
    raise damaged(name, f'its zip directory cannot be read ({storage.first_line(e)})',
                  file_size(file)) from None


@dataclasses.dataclass(frozen=True)
class Zip:
  """A zip archive, listed once: ``name`` (its path, for errors), ``source`` (a local path, or
  a remote file read into memory once) and ``names`` (its members)."""
  name: str
  source: Any
  names: Tuple[str, ...]

  @classmethod
  def of(cls, path: str) -> 'Zip':
    """The archive of the local or remote file at ``path``."""
    source = io.BytesIO(storage.read_bytes(path)) if storage.is_remote(path) else path
    with _open_zip(source, path) as archive:
      return cls(path, source, tuple(archive.namelist()))

  @property
  def size(self) -> int:
    return file_size(self.source)

  @contextlib.contextmanager
  def open(self) -> Iterator[zipfile.ZipFile]:
    if hasattr(self.source, 'seek'):
      self.source.seek(0)
    with _open_zip(self.source, self.name) as archive:
      yield archive

  def damaged(self, problem: str) -> DamagedCheckpointError:
    return damaged(self.name, problem, self.size)

  def read(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """The bytes of member ``info``; DamagedCheckpointError for a bad CRC or corrupt data."""
    try:
      return archive.read(info)
    except MEMBER_ERRORS as e:
      raise self.damaged(f'its member {info.filename!r} cannot be read '
                         f'({storage.first_line(e)})') from None


#: ``({tensor name: (shape, dtype name)}, metadata)``: what a safetensors file's header says.
Header = Tuple[Dict[str, Tuple[Tuple[int, ...], str]], Dict[str, str]]


def read_header(path: str, head: bytes = b'') -> Header:
  """The header of the safetensors file at ``path``, no array read (``head``: its first bytes,
  when read); DamagedCheckpointError for a header cut short or not JSON."""
  damaged_file = lambda problem: damaged(path, problem, file_size(path))
  head = head if len(head) >= 8 else storage.read_bytes(path, 8)
  if len(head) < 8:
    raise damaged_file('it ends inside the header length')
  size = struct.unpack('<Q', head[:8])[0]
  if size > _MAX_SAFETENSORS_HEADER:
    raise damaged_file(f'its header length ({size:,} bytes) is not a safetensors one')
  data = storage.read_bytes(path, 8 + size)[8:]
  try:
    header = rundir.parse_json(data, path, max_bytes=_MAX_SAFETENSORS_HEADER)
  except ValueError:  # Not JSON, or nested deeper than any header (rundir.MAX_JSON_DEPTH).
    raise damaged_file(f'its {size:,}-byte JSON header cannot be read') from None
  if not isinstance(header, dict):
    raise damaged_file('its header is not a JSON object')
  metadata = header.pop('__metadata__', None) or {}
  try:
    index = {name: (tuple(int(d) for d in entry['shape']), str(entry['dtype']))
             for name, entry in header.items()}
    end = 8 + size + max((int(entry['data_offsets'][1]) for entry in header.values()), default=0)
  except (KeyError, TypeError, ValueError, IndexError):
    raise damaged_file('its header does not describe tensors') from None
  if file_size(path) < end:  # Before any question about what the tensors mean.
    raise damaged_file(f'its header describes {end:,} bytes')
  return index, {str(k): str(v) for k, v in metadata.items()}


def shapes(header: Header) -> Dict[str, Tuple[int, ...]]:
  return {name: shape for name, (shape, _) in header[0].items()}


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
  """``{tensor name: array}`` of the safetensors file at ``path`` (local or ``gs://``);
  DamagedCheckpointError for data that cannot be read (e.g. a truncated download)."""
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  try:
    if storage.is_remote(path):
      return dict(st_numpy.load(storage.read_bytes(path)))
    return dict(st_numpy.load_file(path))
  except (SafetensorError, ValueError, TypeError) as e:
    raise damaged(path, f'its tensors cannot be read ({e})', file_size(path)) from None


def write_safetensors(path: str, arrays: Mapping[str, Any],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
  """Writes ``arrays`` to ``path`` (:func:`.durable.write_atomically`) with ``metadata`` and
  ``format: 'pt'``, which transformers' ``from_pretrained`` requires."""
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  tensors = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
  meta = {'format': 'pt', **{str(k): str(v) for k, v in (metadata or {}).items()}}
  durable.write_atomically(path, st_numpy.save(tensors, metadata=meta))  # (save_file: 0600.)
