"""``.safetensors`` files (the Hugging Face and timm weights) through the ``safetensors``
package's NumPy API: no torch, nothing executed (the format is a JSON header and raw arrays).

A file is recognised by its first bytes (:func:`is_safetensors`): an 8-byte little-endian header
length, then the JSON header (``{``). A file whose header or data is cut short or corrupt raises
:class:`~vit_jax.checkpoint.torch_pickle.DamagedCheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from vit_jax.checkpoint import paths
from vit_jax.checkpoint.torch_pickle import DamagedCheckpointError

SUFFIX = '.safetensors'

#: The most header bytes :func:`read_header` accepts (the format's own limit is 100 MB).
_MAX_HEADER = 100_000_000


def is_safetensors(head: bytes) -> bool:
  """Whether a file's first 9 bytes are a safetensors header's start."""
  if len(head) < 9:
    return False
  size = struct.unpack('<Q', head[:8])[0]
  return 1 < size <= _MAX_HEADER and head[8:9] == b'{'


def _damaged(path: str, problem: str) -> DamagedCheckpointError:
  size = paths.read_bytes(path).__len__() if paths.is_remote(path) else os.path.getsize(path)
  return DamagedCheckpointError(
      f'{path!r} is truncated or damaged: {problem}; the file has {size:,} bytes. Download or '
      'copy it again.')


def read_header(path: str) -> Tuple[Dict[str, Tuple[Tuple[int, ...], str]], Dict[str, str]]:
  """``({tensor name: (shape, dtype name)}, metadata)`` from the header only (no array read).

  Raises:
    DamagedCheckpointError: the header is cut short or is not valid JSON.
  """
  head = paths.read_head(path, 8)
  if len(head) < 8:
    raise _damaged(path, 'it ends inside the header length')
  size = struct.unpack('<Q', head)[0]
  if size > _MAX_HEADER:
    raise _damaged(path, f'its header length ({size:,} bytes) is not a safetensors one')
  data = paths.read_head(path, 8 + size)[8:]
  try:
    header = json.loads(data.decode('utf-8'))
  except (UnicodeDecodeError, ValueError):
    raise _damaged(path, f'its {size:,}-byte JSON header cannot be read') from None
  if not isinstance(header, dict):
    raise _damaged(path, 'its header is not a JSON object')
  metadata = header.pop('__metadata__', None) or {}
  try:
    index = {name: (tuple(int(d) for d in entry['shape']), str(entry['dtype']))
             for name, entry in header.items()}
  except (KeyError, TypeError, ValueError):
    raise _damaged(path, 'its header does not describe tensors') from None
  return index, {str(k): str(v) for k, v in metadata.items()}


def read(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
  """``({tensor name: array}, metadata)`` of the file at ``path`` (local or ``gs://``).

  Raises:
    DamagedCheckpointError: a header or data that cannot be read (e.g. a truncated download).
  """
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  _, metadata = read_header(path)
  try:
    if paths.is_remote(path):
      arrays = st_numpy.load(paths.read_bytes(path))
    else:
      arrays = st_numpy.load_file(path)
  except (SafetensorError, ValueError, TypeError) as e:
    raise _damaged(path, f'its tensors cannot be read ({e})') from None
  return dict(arrays), metadata


def write(path: str, arrays: Mapping[str, Any], metadata: Optional[Mapping[str, str]] = None
          ) -> None:
  """Writes ``arrays`` (NumPy, C-contiguous copies are made) to ``path`` with ``metadata``.

  ``metadata`` gets ``format: 'pt'``, which transformers' ``from_pretrained`` requires.
  Local parent directories are created.
  """
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  tensors = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
  meta = {'format': 'pt', **{str(k): str(v) for k, v in (metadata or {}).items()}}
  if paths.is_remote(path):
    with paths.open_file(path, 'wb') as f:
      f.write(st_numpy.save(tensors, metadata=meta))
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  st_numpy.save_file(tensors, path, metadata=meta)
  umask = os.umask(0)  # save_file creates the file 0600: the usual mode, as other writes get.
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)
