"""Loading and saving model parameters.

Formats read by :func:`load`:

* **Official ``.npz``** (google-research/vision_transformer releases and ``vit_jax`` test files):
  a flat ``np.savez`` archive whose keys are ``/``-joined parameter paths without a ``params``
  prefix, e.g. ``Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel``. Files from 2020 use the
  pre-Linen module numbering inside each block (``LayerNorm_0``, ``MultiHeadDotProductAttention_1``,
  ``LayerNorm_2``, ``MlpBlock_3``); they are renumbered to the Linen names (``LayerNorm_0``,
  ``MultiHeadDotProductAttention_0``, ``LayerNorm_1``, ``MlpBlock_0``) that the model uses.
  GroupNorm ``gn*/scale|bias`` stored as ``(1, 1, 1, C)`` are reshaped to ``(C,)``. Archives are
  always read with ``allow_pickle=False``; object arrays are rejected.
* **Orbax checkpoints written by the training loop**: ``CheckpointManager(<workdir>/checkpoints)``
  saving ``ocp.args.Composite(state=ocp.args.StandardSave(state))`` with
  ``state = {'step', 'params', 'opt_state', 'model_state'}``. ``load`` accepts the workdir, the
  ``checkpoints`` directory (latest finalized step) or one step directory, restores only
  ``params`` and ``model_state`` as NumPy arrays (no target needed, the optimizer state is not
  read), and returns ``{'params': params, **model_state}``.

* **PyTorch checkpoints** (``.pth``, ``.pth.tar``, ``.pt``; recognised by content: a zip archive
  with one ``<name>/data.pkl``), e.g. the released T2T-ViT files: a timm ``CheckpointSaver`` dict
  (``state_dict``, ``state_dict_ema``, ``epoch``, ``args``, ...) or a plain state dict. Read
  without torch and without running code (:mod:`vit_jax.torch_pickle`: a whitelisting unpickler;
  any other global such as ``posix.system`` is refused). Only the zip format of
  ``torch.save`` (torch >= 1.6) is read; the legacy format is refused. :func:`load_pth` returns
  the raw PyTorch state dict (names -> ``np.ndarray``; ``state_dict_ema`` preferred); ``load(path,
  model=model)`` converts it for a :class:`~vit_jax.models.t2t.T2TViT` with
  :func:`vit_jax.models.t2t.from_torch_state_dict` (the model's structure is needed)::

    model = models.create('T2T-ViT-14', num_classes=1000)
    variables = load('81.5_T2T_ViT_14.pth.tar', model=model)   # {'params', 'constants'}
    logits = model.apply(variables, images, train=False)

Paths may be local or, for any ``scheme://`` path such as ``gs://bucket/x.npz``, go through
``tf.io.gfile`` (TensorFlow is imported lazily, only for such paths; Orbax reads remote
directories itself).

Layout: ``load`` never changes the encoder layout. ``.npz`` files are always in the unrolled
``encoderblock_{i}`` layout; an Orbax checkpoint of a ``scan=True`` model holds a stacked
``encoderblock`` (T2T-ViT: ``blocks``; a ``.pth.tar`` converts into the layout of the ``model``
given). Convert explicitly::

  from vit_jax.models import scan_params, unscan_params
  variables = load('ViT-B_16.npz')
  variables = scan_params(variables, num_layers=12)   # for create(..., scan=True)
"""

from __future__ import annotations

import errno
import io
import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from vit_jax.models import layout

__all__ = [
    'ACCEPTED_FORMATS', 'TORCH_SUFFIXES', 'check_fits', 'convert_pre_linen',
    'describe_architecture', 'fix_groupnorm', 'flatten_params', 'init_for_finetuning',
    'is_torch_checkpoint', 'load', 'load_for_finetuning', 'load_npz', 'load_orbax', 'load_pth',
    'load_torch_as_saved', 'mismatch_report', 'resize_posemb', 'save_npz', 'unflatten_params',
]

ACCEPTED_FORMATS = (
    "an official ViT '.npz' file (flat '/'-joined parameter names, Linen or pre-Linen numbering), "
    "or an Orbax checkpoint written by the training loop (a workdir containing 'checkpoints/', a "
    "'checkpoints' directory of numbered steps, or one step directory containing 'state/'), "
    "or a PyTorch T2T-ViT checkpoint ('.pth', '.pth.tar', '.pt' in the zip format of torch.save "
    ">= 1.6; load(path, model=t2t_model))")

# File names treated as PyTorch checkpoints (a zip with '<name>/data.pkl' is one whatever its name).
TORCH_SUFFIXES = ('.pth', '.pth.tar', '.pt')
_PICKLE_MAGIC = b'\x80'

# Name of the Composite item the training loop saves the train state under.
_STATE_ITEM = 'state'
_ZIP_MAGICS = (b'PK\x03\x04', b'PK\x05\x06')
_NPY_MAGIC = b'\x93NUMPY'


# ----------------------------------------------------------------------------------------------
# Flat <-> nested trees.
# ----------------------------------------------------------------------------------------------


def flatten_params(tree: Mapping, sep: str = '/') -> Dict[str, Any]:
  """Flattens a nested mapping into ``{'a/b/c': leaf}`` (keys in insertion order).

  Args:
    tree: nested ``dict``/``FrozenDict`` (e.g. ``variables['params']``); leaves are anything that
      is not a mapping. Empty sub-mappings are dropped (they cannot be represented). Leaves
      boxed with logical axis names (``nn.LogicallyPartitioned``, as ``model.init`` returns
      them) are unboxed (:func:`vit_jax.models.layout.unbox`).
    sep: separator.

  Returns:
    A flat dict of plain (unboxed) leaves.

  Raises:
    ValueError: if a key contains ``sep`` (the flattening would be ambiguous) or is not a str.
  """
  flat: Dict[str, Any] = {}

  def visit(node, prefix):
    for key, value in node.items():
      if not isinstance(key, str) or sep in key:
        raise ValueError(f'Cannot flatten key {key!r} (must be a str without {sep!r})')
      path = f'{prefix}{sep}{key}' if prefix else key
      if isinstance(value, Mapping):
        visit(value, path)
      else:
        flat[path] = layout.unbox(value)

  if not isinstance(tree, Mapping):
    raise ValueError(f'flatten_params expects a mapping, got {type(tree).__name__}')
  visit(tree, '')
  return flat


def unflatten_params(flat: Mapping[str, Any], sep: str = '/') -> Dict[str, Any]:
  """Inverse of :func:`flatten_params`: ``{'a/b': x}`` -> ``{'a': {'b': x}}``.

  Raises:
    ValueError: if a path is both a leaf and a prefix of another path, or has empty components.
  """
  tree: Dict[str, Any] = {}
  for path, value in flat.items():
    parts = path.split(sep)
    if any(not p for p in parts):
      raise ValueError(f'Invalid parameter path {path!r}')
    node = tree
    for part in parts[:-1]:
      child = node.setdefault(part, {})
      if not isinstance(child, dict):
        raise ValueError(f'{path!r} conflicts with the leaf {part!r} of another path')
      node = child
    if parts[-1] in node:
      raise ValueError(f'Duplicate or conflicting parameter path {path!r}')
    node[parts[-1]] = value
  return tree


# ----------------------------------------------------------------------------------------------
# Name fixes for official files.
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# File system access: local paths with os, 'scheme://' paths with tf.io.gfile.
# ----------------------------------------------------------------------------------------------


def _is_remote(path: str) -> bool:
  return '://' in path


def _gfile():
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - tensorflow is a project dependency.
    raise ImportError('Reading remote paths (e.g. gs://) needs TensorFlow (tf.io.gfile)') from e
  return tf.io.gfile


def _exists(path: str) -> bool:
  return _gfile().exists(path) if _is_remote(path) else os.path.exists(path)


def _isdir(path: str) -> bool:
  return _gfile().isdir(path) if _is_remote(path) else os.path.isdir(path)


def _listdir(path: str):
  if _is_remote(path):
    return [name.rstrip('/') for name in _gfile().listdir(path)]
  return os.listdir(path)


def _open(path: str, mode: str):
  return _gfile().GFile(path, mode) if _is_remote(path) else open(path, mode)


def _join(path: str, *names: str) -> str:
  if _is_remote(path):
    return '/'.join([path.rstrip('/'), *names])
  return os.path.join(path, *names)


def _normalize(path: Any) -> str:
  path = os.fspath(path)
  if not isinstance(path, str):
    path = os.fsdecode(path)
  return path if _is_remote(path) else os.path.expanduser(path)


def _not_found(path: str, what: str = 'No checkpoint') -> FileNotFoundError:
  return FileNotFoundError(errno.ENOENT, f'{what} at {path!r}', path)


# ----------------------------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------------------------


def load(path: Any, *, model: Any = None, use_ema: bool = True,
         image_size: Any = None) -> Dict[str, Any]:
  """Loads model variables from an official ``.npz``, an Orbax checkpoint or a PyTorch file.

  Args:
    path: local path or ``scheme://`` path (``gs://``) of a ``.npz`` file, a training workdir, its
      ``checkpoints`` directory (the latest finalized step is used), one step directory, or a
      PyTorch ``.pth``/``.pth.tar``/``.pt`` checkpoint (zip format).
    model: the model (from ``vit_jax.models.create``) the weights are for. Required for PyTorch
      checkpoints (a :class:`~vit_jax.models.t2t.T2TViT`; the state dict is converted with
      :func:`vit_jax.models.t2t.from_torch_state_dict`). For ``.npz`` and Orbax checkpoints,
      given together with ``image_size``, the restored variables are checked against the model
      (restore for evaluation: everything must fit as saved, the head included).
    use_ema: prefer the parameter EMA: ``state_dict_ema`` of a PyTorch checkpoint (see
      :func:`load_pth`), ``ema_params`` of an Orbax checkpoint (see :func:`load_orbax`).
    image_size: ``H`` or ``(H, W)`` the model will run at. PyTorch checkpoints: passed to
      ``from_torch_state_dict`` (default: the checkpoint's own ``pos_embed`` grid). Others: see
      ``model``.

  Returns:
    ``{'params': nested dict of np.ndarray, **other collections}`` ready for ``model.apply``
    (Linen names, unchanged encoder layout; see the module docstring to convert layouts). For a
    PyTorch checkpoint: ``{'params': ..., 'constants': ...}``.

  Raises:
    FileNotFoundError: nothing exists at ``path`` (or a checkpoint directory holds no step).
    ValueError: the file/directory is not one of the accepted formats, an ``.npz`` contains
      object (pickled) arrays, a PyTorch file is given without ``model``, the variables do not
      fit ``model`` (see :func:`check_fits`), or a torch
      file is in the legacy (non-zip) format.
    vit_jax.torch_pickle.UnsafePickleError: a PyTorch file's pickle names a global other than
      tensors and plain containers (nothing is executed).
  """
  path = _normalize(path)
  if not _exists(path):
    raise _not_found(path)
  if _isdir(path):
    variables = load_orbax(path, use_ema=use_ema)
  elif is_torch_checkpoint(path):
    return _load_torch_variables(path, model=model, use_ema=use_ema, image_size=image_size)
  else:
    variables = _load_file(path)
  if model is not None and image_size is not None:
    check_fits(variables, _expected_variables(model, image_size), what=path)
  return variables


def _expected_variables(model: Any, image_size: Any) -> Dict[str, Any]:
  """``jax.eval_shape`` of ``model.init`` at ``image_size`` (``H`` or ``(H, W)``)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
  return layout.unbox(jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, int(height), int(width), 3), jnp.float32), train=False)))


_MAX_LISTED = 8  # Entries listed per kind of problem; the rest are counted.


def _listing(items, sep: str) -> str:
  shown = sep.join(items[:_MAX_LISTED])
  return shown + (f'{sep}... and {len(items) - _MAX_LISTED} more' if len(items) > _MAX_LISTED
                  else '')


def mismatch_report(header: str, missing, unexpected, mismatched,
                    hint: Optional[str] = None) -> str:
  """The message of a checkpoint that does not fit: counts, the first entries, and a hint."""
  lines = [header]
  if missing:
    lines.append(f'  missing keys ({len(missing)}): {_listing(missing, ", ")}')
  if unexpected:
    lines.append(f'  unexpected keys ({len(unexpected)}): {_listing(unexpected, ", ")}')
  if mismatched:
    lines.append(f'  shape mismatches ({len(mismatched)}): {_listing(mismatched, "; ")}')
  if hint:
    lines.append(f'  {hint}')
  return '\n'.join(lines)


def describe_architecture(variables: Mapping) -> Optional[str]:
  """The architecture fields a checkpoint's shapes imply, for error messages (None if unknown).

  ViT: ``patch_size``, ``hidden_size``, ``num_layers``, ``num_heads``, ``mlp_dim``,
  ``representation_size`` and the class count, read from ``embedding``, the encoder blocks,
  ``pre_logits`` and ``head``; T2T-ViT: ``embed_dim``, ``depth``, ``mlp_ratio``, ``token_dim``,
  ``tokens_type`` and the class count.
  """
  flat = flatten_params(variables)
  shape = lambda key: tuple(np.shape(flat[key])) if key in flat else None
  head = shape('params/head/kernel')
  classes = f', {head[-1]} classes' if head else ''
  if shape('params/embedding/kernel'):
    kh, kw, _, width = shape('params/embedding/kernel')
    blocks = {k.split('/')[2] for k in flat if k.startswith('params/Transformer/encoderblock')}
    query = next((np.shape(v) for k, v in flat.items()
                  if k.endswith('MultiHeadDotProductAttention_0/query/kernel')), None)
    mlp = next((np.shape(v)[-1] for k, v in flat.items()
                if k.endswith('MlpBlock_0/Dense_0/kernel')), None)
    layers = (int(np.shape(flat[next(k for k in flat if '/encoderblock/' in k)])[0])
              if blocks == {'encoderblock'} else len(blocks))
    fields = [f'patch_size={kh if kh == kw else (kh, kw)}', f'hidden_size={width}',
              f'num_layers={layers}']
    if query is not None:
      fields.append(f'num_heads={query[-2]}')
    if mlp is not None:
      fields.append(f'mlp_dim={mlp}')
    pre_logits = shape('params/pre_logits/kernel')
    fields.append(f'representation_size={pre_logits[-1] if pre_logits else None}')
    units = {}
    for key in flat:
      match = re.match(r'params/block(\d+)/unit(\d+)/', key)
      if match:
        stage, unit = int(match.group(1)), int(match.group(2))
        units[stage] = max(units.get(stage, 0), unit)
    if 'params/conv_root/kernel' in flat:
      fields.append(f'resnet_num_layers={tuple(units[s] for s in sorted(units))}')
    stem = ' with a ResNet stem' if 'params/conv_root/kernel' in flat else ''
    return f'The checkpoint is a ViT{stem} with {", ".join(fields)}{classes}.'
  if shape('params/cls_token') and shape('params/tokens_to_token/project/kernel'):
    width = shape('params/cls_token')[-1]
    if shape('params/blocks/mlp/fc1/kernel'):  # Scanned: (depth, D, MLP).
      depth, *fc1 = shape('params/blocks/mlp/fc1/kernel')
    else:
      depth = len({k.split('/')[1] for k in flat if k.startswith('params/blocks_')})
      fc1 = shape('params/blocks_0/mlp/fc1/kernel')
    token_dim = shape('params/tokens_to_token/project/kernel')[0] // 9
    performer = any(k.endswith('attention1/w') for k in flat)
    fields = [f'embed_dim={width}', f'depth={depth}',
              f'mlp_ratio={fc1[-1] / width if fc1 else None}', f'token_dim={token_dim}',
              f"tokens_type={'performer' if performer else 'transformer'!r}"]
    return f'The checkpoint is a T2T-ViT with {", ".join(fields)}{classes}.'
  return None


def check_fits(variables: Mapping, expected: Mapping, *, what: str = 'The checkpoint') -> None:
  """Checks that ``variables`` has exactly the keys and shapes of ``expected``.

  Args:
    variables: ``{'params': ..., **collections}`` (e.g. from :func:`load`).
    expected: the same from ``model.init`` or its ``jax.eval_shape`` (boxed with logical axis
      names or plain). A scanned checkpoint for an unrolled model (or the reverse) is reported
      as such, with the conversion to use.

  Raises:
    ValueError: with the counts of missing keys, unexpected keys and shape mismatches, the first
      entries of each (:func:`mismatch_report`) and the architecture the checkpoint implies.
  """
  variables, expected = layout.unbox(variables), layout.unbox(expected)
  have, want = flatten_params(variables), flatten_params(expected)
  missing = [k for k in want if k not in have]
  unexpected = [f'{k} {tuple(np.shape(v))}' for k, v in have.items() if k not in want]
  mismatched = [f'{k}: checkpoint {tuple(np.shape(have[k]))}, model {tuple(want[k].shape)}'
                for k in want if k in have and tuple(np.shape(have[k])) != tuple(want[k].shape)]
  if missing or unexpected or mismatched:
    header = f'{what} does not fit the model:'
    scanned = layout.is_scanned(variables.get('params', {}))
    if scanned != layout.is_scanned(expected.get('params', {})):
      header += (' it is in the ' + ('scanned' if scanned else 'per-layer') + ' block layout; '
                 'convert it with vit_jax.models.' + ('unscan_params' if scanned else
                                                      'scan_params') + ' first.')
    hint = describe_architecture(variables)
    if hint:
      hint += ' Build the model with these values.'
    if not missing and not unexpected and all(POSEMB_KEY in m or 'pos_embed' in m
                                              for m in mismatched):
      hint = ('Only the position table differs: the checkpoint is for another image size. '
              'Evaluate at the size it was trained at, or use init_for_finetuning '
              '(--config.init_from) to resize it for a new resolution.')
    raise ValueError(mismatch_report(header, missing, unexpected, mismatched, hint))


def _load_file(path: str) -> Dict[str, Any]:
  """An official ``.npz`` (anything else is refused with the reason)."""
  with _open(path, 'rb') as f:
    magic = f.read(6)
  if magic[:4] in _ZIP_MAGICS:
    return load_npz(path)
  if magic == _NPY_MAGIC:
    raise ValueError(f'{path!r} is a single-array .npy file, not a checkpoint. '
                     f'Accepted formats: {ACCEPTED_FORMATS}')
  raise ValueError(f'Unrecognised checkpoint format at {path!r}. Accepted formats: '
                   f'{ACCEPTED_FORMATS}')


def is_torch_checkpoint(path: str) -> bool:
  """A torch zip (one '<name>/data.pkl'), a raw pickle, or a non-zip file with a torch suffix."""
  with _open(path, 'rb') as f:
    magic = f.read(6)
  is_torch_name = path.lower().endswith(TORCH_SUFFIXES)
  return bool((magic[:4] in _ZIP_MAGICS and _is_torch_zip(path)) or (
      is_torch_name and magic[:4] not in _ZIP_MAGICS) or magic[:1] == _PICKLE_MAGIC)


def _load_torch_variables(path: str, *, model: Any, use_ema: bool,
                          image_size: Any) -> Dict[str, Any]:
  from vit_jax.models import t2t  # pylint: disable=g-import-not-at-top
  if model is None:
    raise ValueError(
        f'{path!r} is a PyTorch checkpoint: converting it into Flax variables needs the model. '
        'Pass model= (e.g. load(path, model=vit_jax.models.create("T2T-ViT-14", '
        'num_classes=1000))), or use vit_jax.checkpoint.load_pth(path) for the raw PyTorch state '
        'dict (names -> np.ndarray).')
  if not isinstance(model, t2t.T2TViT):
    raise ValueError(f'load(model=...) of a PyTorch checkpoint supports T2T-ViT models only '
                     f'(vit_jax.models.t2t.T2TViT), got {type(model).__name__}')
  state_dict = load_pth(path, use_ema=use_ema)
  return t2t.from_torch_state_dict(state_dict, model, image_size=image_size)


def _read_torch_file(path: str) -> Any:
  """Loads a torch zip-format file safely (:mod:`vit_jax.torch_pickle`); tensors -> ndarray."""
  from vit_jax import torch_pickle  # pylint: disable=g-import-not-at-top
  if _is_remote(path):
    with _open(path, 'rb') as f:
      return torch_pickle.load_torch_zip(io.BytesIO(f.read()), name=path)
  return torch_pickle.load_torch_zip(path)


def _is_torch_zip(path: str) -> bool:
  from vit_jax import torch_pickle  # pylint: disable=g-import-not-at-top
  if _is_remote(path):
    with _open(path, 'rb') as f:
      return torch_pickle.is_torch_zip(io.BytesIO(f.read()))
  return torch_pickle.is_torch_zip(path)


_STATE_DICT_KEYS = ('state_dict_ema', 'state_dict')


def _is_state_dict(obj: Any) -> bool:
  return (isinstance(obj, Mapping) and len(obj) > 0 and
          all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()))


def load_pth(path: Any, *, use_ema: bool = True) -> Dict[str, np.ndarray]:
  """Reads the PyTorch state dict of a ``torch.save`` zip-format checkpoint, without torch.

  Nothing in the file is executed: the pickle is read by a whitelisting unpickler
  (:mod:`vit_jax.torch_pickle`) that builds tensors as NumPy arrays and refuses any other global.

  Args:
    path: local or ``scheme://`` path of a ``.pth``/``.pth.tar``/``.pt`` file.
    use_ema: if the file is a training checkpoint holding ``state_dict_ema`` (timm's
      ``CheckpointSaver``, as the released T2T-ViT weights), return that; otherwise (or with
      ``use_ema=False``) return its ``state_dict``. A file that is a plain state dict (a mapping
      of names to tensors) is returned as is.

  Returns:
    ``{PyTorch name: np.ndarray}`` in the saved order and dtype (e.g. ``blocks.0.attn.qkv.weight``
    of shape ``(out, in)``), a leading ``module.`` (DataParallel / ModelEma) stripped.

  Raises:
    FileNotFoundError: missing file.
    ValueError: not a zip-format torch file (legacy torch format: re-save it with a recent torch),
      or no state dict in it (the error lists its top-level keys).
    vit_jax.torch_pickle.UnsafePickleError: the pickle names a global other than tensors and plain
      containers.
  """
  path = _normalize(path)
  if not _exists(path) or _isdir(path):
    raise _not_found(path, 'No PyTorch checkpoint file')
  obj = _read_torch_file(path)
  state_dict = None
  if isinstance(obj, Mapping):
    keys = _STATE_DICT_KEYS if use_ema else _STATE_DICT_KEYS[1:]
    for key in keys:
      if key in obj and obj[key] is not None:
        state_dict = obj[key]
        if not _is_state_dict(state_dict):
          raise ValueError(f'{path!r}: {key!r} is not a mapping of names to tensors '
                           f'(got {type(state_dict).__name__})')
        break
    if state_dict is None and _is_state_dict(obj):
      state_dict = obj
  if state_dict is None:
    if isinstance(obj, Mapping):
      top = ', '.join(repr(k) for k in obj)
      raise ValueError(f'{path!r} holds no state dict: expected a "state_dict_ema" (with '
                       f'use_ema=True) or "state_dict" entry, or a plain mapping of names to '
                       f'tensors; top-level keys: [{top}]')
    raise ValueError(f'{path!r} holds a {type(obj).__name__}, not a state dict')
  out: Dict[str, np.ndarray] = {}
  for key, value in state_dict.items():
    name = key[len('module.'):] if key.startswith('module.') else key
    if name in out:
      raise ValueError(f'{path!r}: duplicate parameter {name!r} after stripping "module."')
    out[name] = value
  return out


def load_npz(path: Any) -> Dict[str, Any]:
  """Loads an official flat ``.npz`` file; returns ``{'params': nested dict of np.ndarray}``.

  Keys are ``/``-split into a nested dict (a leading ``params/`` on every key is removed), the
  pre-Linen numbering is converted (:func:`convert_pre_linen`) and GroupNorm parameters are
  squeezed (:func:`fix_groupnorm`). Never unpickles.

  Raises:
    FileNotFoundError: missing file.
    ValueError: not an ``.npz`` archive, empty, or containing object arrays.
  """
  path = _normalize(path)
  if not _exists(path):
    raise _not_found(path, 'No .npz file')
  with _open(path, 'rb') as f:
    data = f.read() if _is_remote(path) else None
  source = io.BytesIO(data) if data is not None else path
  try:
    archive = np.load(source, allow_pickle=False)
  except ValueError as e:
    raise ValueError(f'{path!r} is not a readable .npz archive ({e}). Accepted formats: '
                     f'{ACCEPTED_FORMATS}') from None
  if not isinstance(archive, np.lib.npyio.NpzFile):
    raise ValueError(f'{path!r} is not an .npz archive. Accepted formats: {ACCEPTED_FORMATS}')
  flat = {}
  with archive:
    for key in archive.files:
      try:
        value = archive[key]
      except ValueError as e:
        raise ValueError(
            f'{path!r}: array {key!r} is an object (pickled) array; refusing to unpickle it '
            f'(np.load(allow_pickle=False)). Checkpoints must hold numeric arrays only.') from e
      if value.dtype.hasobject:
        raise ValueError(f'{path!r}: array {key!r} has object dtype; refusing it.')
      flat[key] = value
  if not flat:
    raise ValueError(f'{path!r} contains no arrays')
  if not any('/' in k for k in flat) and any('.' in k for k in flat):
    example = next(k for k in flat if '.' in k)
    raise ValueError(
        f'{path!r} holds PyTorch state-dict names (e.g. {example!r}), not the official ViT '
        "'/'-joined Flax names. Load the PyTorch checkpoint itself (.pth.tar, with model=...), "
        'or convert the arrays with vit_jax.models.t2t.from_torch_state_dict.')
  if all(k.startswith('params/') for k in flat):
    flat = {k[len('params/'):]: v for k, v in flat.items()}
  params = fix_groupnorm(convert_pre_linen(unflatten_params(flat)))
  return {'params': params}


def _has(path: str, name: str) -> bool:
  return _exists(_join(path, name))


def _is_pytree_item(path: str) -> bool:
  # An Orbax PyTree item directory has a '_METADATA' file (and 'manifest.ocdbt' with OCDBT).
  return _has(path, '_METADATA') and _isdir(path)


def _latest_step_dir(path: str) -> Optional[str]:
  """Newest numbered step directory of ``path`` holding a finalized PyTree item, or None."""
  # Orbax writes into '<step>.orbax-checkpoint-tmp-*' and renames when done, so digit-only names
  # are finalized steps (on GCS the item's commit marker is checked through '_METADATA').
  steps = {int(n): n for n in _listdir(path) if n.isdigit()}
  for step in sorted(steps, reverse=True):
    candidate = _join(path, steps[step])
    if _is_pytree_item(candidate) or _is_pytree_item(_join(candidate, _STATE_ITEM)):
      return candidate
  return None


def _find_state_item(path: str) -> str:
  """Returns the Orbax PyTree item directory holding the train state for ``path``."""
  if _isdir(_join(path, 'checkpoints')):  # A workdir.
    path = _join(path, 'checkpoints')
  for candidate in (path, _join(path, _STATE_ITEM)):
    if _is_pytree_item(candidate):
      return candidate
  step_dir = _latest_step_dir(path)
  if step_dir is not None:
    for candidate in (step_dir, _join(step_dir, _STATE_ITEM)):
      if _is_pytree_item(candidate):
        return candidate
  is_manager_dir = os.path.basename(path.rstrip('/')) == 'checkpoints'
  if is_manager_dir or any(n.isdigit() for n in _listdir(path)):
    raise _not_found(path, 'No finalized Orbax checkpoint step')
  raise ValueError(f'Unrecognised checkpoint directory {path!r}. Accepted formats: '
                   f'{ACCEPTED_FORMATS}')


def load_orbax(path: Any, *, use_ema: bool = True) -> Dict[str, Any]:
  """Loads ``params`` and ``model_state`` from an Orbax checkpoint of the training loop.

  Args:
    path: a workdir (containing ``checkpoints/``), a ``checkpoints`` directory (latest step), a
      step directory (containing ``state/``) or the ``state`` item directory itself.
    use_ema: return the parameter EMA (``ema_params``, saved by runs with
      ``config.ema_decay > 0``) as ``params`` when the checkpoint has one.

  Returns:
    ``{'params': ..., **model_state}`` with NumPy leaves, in the layout they were saved in.

  Raises:
    FileNotFoundError: missing path or no finalized step.
    ValueError: not an Orbax checkpoint, or one without a ``params`` entry.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  path = _normalize(path)
  if not _exists(path):
    raise _not_found(path)
  item = _find_state_item(path)
  checkpointer = ocp.PyTreeCheckpointer()
  # Reading the 'state' item on its own, Orbax looks for the step's _CHECKPOINT_METADATA in the
  # item directory and warns that it is missing; that file is one level up and not needed here.
  absl_logger = logging.getLogger('absl')
  absl_logger.addFilter(_ignore_missing_step_metadata)
  try:
    return _restore_params(checkpointer, item, use_ema=use_ema)
  finally:
    absl_logger.removeFilter(_ignore_missing_step_metadata)


def check_state_fits(state_dir: Any, abstract_state: Mapping) -> None:
  """Checks a saved training state's parameters against the run's, from metadata only.

  Args:
    state_dir: the 'state' item of a training checkpoint (`<workdir>/checkpoints/<step>/state`).
    abstract_state: the run's state tree (arrays or `jax.ShapeDtypeStruct`s); its 'params' and
      'model_state' are compared by name and shape (nothing is read but the metadata).

  Raises:
    ValueError: names or shapes differ; the message lists them (counts and the first 8) and
      what the checkpoint's model is.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  absl_logger = logging.getLogger('absl')
  absl_logger.addFilter(_ignore_missing_step_metadata)
  try:
    metadata = ocp.PyTreeCheckpointer().metadata(state_dir)
  finally:
    absl_logger.removeFilter(_ignore_missing_step_metadata)
  tree = getattr(getattr(metadata, 'item_metadata', metadata), 'tree', None)
  if tree is None:
    tree = getattr(metadata, 'tree', metadata)
  as_structs = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), t)
  saved = {k: v for name in ('params', 'model_state') if isinstance(tree.get(name), Mapping)
           for k, v in flatten_params({name: as_structs(tree[name])}).items()}
  wanted = {k: v for name in ('params', 'model_state') if name in abstract_state
            for k, v in flatten_params({name: abstract_state[name]}).items()}
  missing = sorted(set(wanted) - set(saved))
  unexpected = sorted(set(saved) - set(wanted))
  mismatched = [f'{k}: saved {tuple(saved[k].shape)}, this run {tuple(wanted[k].shape)}'
                for k in sorted(set(saved) & set(wanted))
                if tuple(saved[k].shape) != tuple(wanted[k].shape)]
  if missing or unexpected or mismatched:
    # With the fixed tables ('model_state'): they tell a Performer T2T module from a Transformer.
    described = (describe_architecture({name: as_structs(tree[name])
                                        for name in ('params', 'model_state')
                                        if isinstance(tree.get(name), Mapping)})
                 if isinstance(tree.get('params'), Mapping) else None)
    header = f'The checkpoint {state_dir} does not fit this model:'
    scanned = lambda keys: any(f'/{p}/' in k for k in keys for p in layout.BLOCK_PREFIXES)
    if saved and wanted and scanned(saved) != scanned(wanted):
      setting = 'True' if scanned(saved) else 'False'
      header += (f' it was written with the {"scanned" if scanned(saved) else "per-layer"} '
                 f'block layout: resume with --config.model.scan={setting} (the training '
                 f'default is True).')
    raise ValueError(mismatch_report(header, missing, unexpected, mismatched, described))


def _ignore_missing_step_metadata(record: logging.LogRecord) -> bool:
  return 'Metadata file does not exist' not in record.getMessage()


def _restore_params(checkpointer, item: str, *, use_ema: bool) -> Dict[str, Any]:
  """Restores params (or ema_params) and model_state of one 'state' item as NumPy arrays."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  metadata = checkpointer.metadata(item)
  tree = getattr(getattr(metadata, 'item_metadata', metadata), 'tree', None)
  if tree is None:  # Older Orbax: the metadata is the tree itself.
    tree = getattr(metadata, 'tree', metadata)
  if not isinstance(tree, Mapping) or 'params' not in tree:
    keys = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
    raise ValueError(f'Orbax checkpoint {item!r} has no "params" entry (top level: {keys}). '
                     f'Accepted formats: {ACCEPTED_FORMATS}')
  params_key = 'ema_params' if use_ema and isinstance(tree.get('ema_params'), Mapping) else 'params'
  wanted = {'params': tree[params_key]}
  if isinstance(tree.get('model_state'), Mapping):
    wanted['model_state'] = tree['model_state']
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
  restored = checkpointer.restore(
      item, args=ocp.args.PyTreeRestore(
          item={params_key if k == 'params' else k: v for k, v in wanted.items()},
          restore_args={params_key if k == 'params' else k: v for k, v in restore_args.items()},
          partial_restore=True))
  restored = {'params' if k == params_key else k: v for k, v in restored.items()}
  to_dict = lambda t: {k: to_dict(v) for k, v in t.items()} if isinstance(t, Mapping) else t
  variables = {'params': to_dict(restored['params'])}
  for name, collection in to_dict(restored.get('model_state') or {}).items():
    if name == 'params':
      raise ValueError(f'{item!r}: model_state must not contain a "params" collection')
    variables[name] = collection
  return variables


# ----------------------------------------------------------------------------------------------
# Saving.
# ----------------------------------------------------------------------------------------------


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
  path = _normalize(path)
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
  if _is_remote(path):
    buffer = io.BytesIO()
    np.savez(buffer, **flat)
    with _open(path, 'wb') as f:
      f.write(buffer.getvalue())
  else:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'wb') as f:
      np.savez(f, **flat)


# ----------------------------------------------------------------------------------------------
# Initialising a model for fine-tuning from a checkpoint of another task or resolution.
# ----------------------------------------------------------------------------------------------

#: The classifier head, re-initialised for fine-tuning (always, as the official ViT code does, or
#: only for another class count with ``reset_head=False``).
HEAD_KEYS = ('params/head/kernel', 'params/head/bias')
#: ViT's optional representation layer, dropped when the model to fine-tune has none.
PRE_LOGITS_PREFIX = 'params/pre_logits/'
#: ViT's learned position embedding, resized to the new token grid.
POSEMB_KEY = 'params/Transformer/posembed_input/pos_embedding'
#: Fixed tables a model regenerates for its own input size (T2T-ViT's sinusoid position table):
#: taken from the fresh initialisation when the token count differs.
REGENERATED_KEYS = ('constants/pos_embed',)


def _grid_of(num_tokens: int, grid: Optional[Sequence[int]], what: str) -> Tuple[int, int]:
  """``grid`` as (gh, gw), checked against ``num_tokens``; square by default."""
  if grid is None:
    side = math.isqrt(num_tokens)
    if side * side != num_tokens:
      raise ValueError(f'The {what} position embedding has {num_tokens} grid tokens, not a square '
                       f'grid: pass its grid (rows, columns) explicitly.')
    return side, side
  gh, gw = (int(g) for g in grid)
  if gh * gw != num_tokens:
    raise ValueError(f'The {what} grid {gh}x{gw} does not match its {num_tokens} position '
                     'embedding rows.')
  return gh, gw


def resize_posemb(posemb: np.ndarray, num_tokens: int, *, has_class_token: bool,
                  old_grid: Optional[Sequence[int]] = None,
                  new_grid: Optional[Sequence[int]] = None) -> np.ndarray:
  """Resizes a learned ViT position embedding to another token grid.

  The official ``vit_jax.checkpoint.load_pretrained`` behaviour (REFERENCE.md section 1): the
  class-token row (first row, if any) is kept unchanged; the grid rows, reshaped to
  ``(gh_old, gw_old, D)``, are resampled to ``(gh_new, gw_new, D)`` bilinearly with the corners
  aligned (``scipy.ndimage.zoom(order=1)``: a 2x2 grid ``[[0, 1], [2, 3]]`` becomes
  ``[[0, .5, 1], [1, 1.5, 2], [2, 2.5, 3]]``). Unlike the official code, 'gap' models (no class
  token row) and non-square grids (e.g. 224x320 px) work: pass the grids.

  Args:
    posemb: ``[1, T_old, D]`` with ``T_old = (1 if has_class_token) + gh_old * gw_old``.
    num_tokens: ``T_new``, the new table's rows (class token included).
    has_class_token: whether row 0 belongs to the class token (classifier 'token').
    old_grid, new_grid: ``(rows, columns)`` of the token grids; square when None.

  Returns:
    ``[1, T_new, D]``, the input's dtype.

  Raises:
    ValueError: a grid that does not match its row count, or is not square when not given.
  """
  posemb = np.asarray(posemb)
  first = 1 if has_class_token else 0
  token_rows, grid_rows = posemb[:, :first], posemb[0, first:]
  gh, gw = _grid_of(grid_rows.shape[0], old_grid, 'checkpoint')
  nh, nw = _grid_of(num_tokens - first, new_grid, "model's")
  from scipy import ndimage  # pylint: disable=g-import-not-at-top
  grid = grid_rows.reshape(gh, gw, -1)
  grid = ndimage.zoom(grid, (nh / gh, nw / gw, 1), order=1)
  grid = grid.reshape(1, nh * nw, -1)
  return np.concatenate([token_rows, grid], axis=1).astype(posemb.dtype)


def init_for_finetuning(loaded: Mapping, fresh: Mapping, *, reset_head: bool = True,
                        grid: Optional[Sequence[int]] = None,
                        checkpoint_grid: Optional[Sequence[int]] = None) -> Dict[str, Any]:
  """Variables for fine-tuning: the checkpoint's weights fitted to a new task and resolution.

  The *fine-tuning* intent, as opposed to :func:`load` (restore for evaluation, everything as
  saved). Starting from ``loaded`` (the checkpoint) it replaces only what is designed to change:

  * the head (``head/kernel``, ``head/bias``) takes ``fresh``'s values: always (the official ViT
    ``load_pretrained``), or with ``reset_head=False`` only when the class count differs (the
    T2T-ViT reference; e.g. to go on fine-tuning ImageNet at a higher resolution);
  * ViT's ``pre_logits`` is dropped when the model has no representation layer, and kept when
    it has one (official behaviour);
  * ViT's position embedding is resized to the model's token grid (:func:`resize_posemb`);
  * T2T-ViT's fixed sinusoid table (``constants/pos_embed``) is regenerated for the new token
    count (taken from ``fresh``), as the T2T-ViT reference does; the Performer random features
    ``w`` are kept from the checkpoint (the weights were trained with them).

  Everything else must fit exactly. The encoder layout follows ``fresh`` (a scanned checkpoint
  fits an unrolled model and back).

  Args:
    loaded: ``{'params': ..., **collections}`` from :func:`load` (NumPy or JAX leaves).
    fresh: the same structure from ``model.init`` of the model to fine-tune (boxed with logical
      axis names or plain): the replaced entries take its values; of the rest only the
      structure, shapes and dtypes are read.
    reset_head: see above.
    grid: the model's token grid ``(rows, columns)``, needed only for non-square grids (e.g.
      ``(14, 20)`` at 224x320 px with patch 16); checkpoint_grid likewise for the checkpoint's.

  Returns:
    ``{'params': ..., **collections}`` with ``fresh``'s structure, plain (unboxed) leaves cast to
    ``fresh``'s dtypes.

  Raises:
    ValueError: with the counts and first entries of the missing keys, unexpected keys and
      shape mismatches (:func:`mismatch_report`), e.g. a checkpoint of another model size.
  """
  fresh, loaded = layout.unbox(fresh), layout.unbox(loaded)
  for name, tree in (('loaded', loaded), ('fresh', fresh)):
    if not isinstance(tree, Mapping) or 'params' not in tree:
      raise ValueError(f'init_for_finetuning: {name} must be a variables dict '
                       "{'params': ..., **collections} (as checkpoint.load and model.init "
                       f"return), not a bare params tree (top level: {sorted(tree)[:5]}).")
  fresh_flat = flatten_params(fresh)
  loaded = dict(loaded)
  fresh_scanned = layout.is_scanned(fresh.get('params', {}))
  if layout.is_scanned(loaded.get('params', {})) != fresh_scanned:
    convert = layout.scan_params if fresh_scanned else layout.unscan_params
    loaded['params'] = convert(loaded['params'])
  loaded_flat = flatten_params(loaded)
  has_pre_logits = any(k.startswith(PRE_LOGITS_PREFIX) for k in fresh_flat)
  out, notes, mismatched = {}, [], []
  for key, want in fresh_flat.items():
    if key not in loaded_flat:
      continue
    have = loaded_flat[key]
    same_shape = tuple(np.shape(have)) == tuple(want.shape)
    change = f'{key} {tuple(np.shape(have))} -> {tuple(want.shape)}'
    if key in HEAD_KEYS and (reset_head or not same_shape):
      out[key] = np.asarray(want)
      notes.append(f're-initialised {change}')
    elif key in HEAD_KEYS:
      out[key] = np.asarray(have).astype(want.dtype)
      notes.append(f'kept {key} (reset_head=False, same class count)')
    elif same_shape:
      out[key] = np.asarray(have).astype(want.dtype)
    elif key == POSEMB_KEY and np.ndim(have) == 3 and np.shape(have)[2] == want.shape[2]:
      out[key] = resize_posemb(have, want.shape[1], has_class_token='params/cls' in fresh_flat,
                               old_grid=checkpoint_grid, new_grid=grid).astype(want.dtype)
      notes.append(f'resized {change}')
    elif key in REGENERATED_KEYS:
      out[key] = np.asarray(want)
      notes.append(f'regenerated {change}')
    else:
      mismatched.append(f'{key}: checkpoint {tuple(np.shape(have))}, model {tuple(want.shape)}')
  missing = [k for k in fresh_flat if k not in loaded_flat]
  dropped = [k for k in loaded_flat if k.startswith(PRE_LOGITS_PREFIX) and not has_pre_logits]
  notes += [f'dropped {k}' for k in dropped]
  unexpected = [f'{k} {tuple(np.shape(v))}' for k, v in loaded_flat.items()
                if k not in fresh_flat and k not in dropped]
  if missing or unexpected or mismatched:
    hint = describe_architecture(loaded)
    raise ValueError(mismatch_report(
        'The checkpoint does not fit the model to fine-tune (only the head, pre_logits, the '
        'position embedding and the T2T sinusoid table may differ):',
        missing, unexpected, mismatched,
        hint and hint + ' Set the model fields (--config.model.*) to these values.'))
  if notes:
    logging.getLogger('absl').info('Fine-tuning init: %s', '; '.join(notes))
  return unflatten_params(out)


def load_torch_as_saved(path: Any, model: Any, *, use_ema: bool = True) -> Dict[str, Any]:
  """Converts a PyTorch T2T-ViT file for ``model``'s architecture at the file's own class count
  and input size (read from its ``head.weight`` and ``pos_embed``), whatever ``model``'s are.

  Raises:
    ValueError: ``model`` is not a T2T-ViT, or the file does not fit its architecture.
  """
  from vit_jax.models import t2t  # pylint: disable=g-import-not-at-top
  path = _normalize(path)
  if not isinstance(model, t2t.T2TViT):
    raise ValueError(f'{path!r} is a PyTorch checkpoint; only T2T-ViT models load those, '
                     f'not {type(model).__name__}.')
  state_dict = load_pth(path, use_ema=use_ema)
  head = [np.shape(v)[0] for k, v in state_dict.items() if k.split('.')[-2:] == ['head', 'weight']]
  if head:
    model = model.clone(num_classes=int(head[0]))
  return t2t.from_torch_state_dict(state_dict, model)


def load_for_finetuning(path: Any, model: Any, fresh: Mapping, *, use_ema: bool = True,
                        reset_head: bool = True,
                        grid: Optional[Sequence[int]] = None) -> Dict[str, Any]:
  """:func:`load` a checkpoint of any class count and resolution, then :func:`init_for_finetuning`.

  A PyTorch T2T-ViT file is converted for a copy of ``model`` with the checkpoint's own class
  count and input size (read from its ``head.weight`` and ``pos_embed``), so that a released
  1000-class, 224 px file initialises e.g. a 10-class model at 384 px.

  Args:
    path: as for :func:`load`.
    model: the model to fine-tune (from ``vit_jax.models.create``).
    fresh: its initial variables (see :func:`init_for_finetuning`).
    use_ema: prefer the checkpoint's parameter EMA when it has one.
    reset_head, grid: see :func:`init_for_finetuning`.

  Raises:
    The errors of :func:`load` and :func:`init_for_finetuning`.
  """
  path = _normalize(path)
  if _exists(path) and not _isdir(path) and is_torch_checkpoint(path):
    loaded = load_torch_as_saved(path, model, use_ema=use_ema)
  else:
    loaded = load(path, model=model, use_ema=use_ema)
  return init_for_finetuning(loaded, fresh, reset_head=reset_head, grid=grid)
