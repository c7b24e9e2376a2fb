"""Hugging Face transformers and timm ViT weights (``.safetensors``), read and written without
torch.

:func:`read` converts a transformers directory (:mod:`.hf_vit`) or a timm file (:mod:`.timm_vit`)
exactly, with the model fields the weights need: the architecture and the numerics that differ
by library (:data:`NUMERICS`; transformers' ``hidden_act`` and ``layer_norm_eps``, timm's exact
GELU and 1e-6), which :func:`check_numerics` enforces for evaluation. :func:`write` exports a
ViT to either library (``python -m vit_jax.convert SRC OUT --to timm|hf``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax.checkpoint import hf_vit
from vit_jax.checkpoint import paths
from vit_jax.checkpoint import safetensors_file
from vit_jax.checkpoint import timm_vit
from vit_jax.models import layout

#: The format names (:mod:`.formats`).
HF, TIMM = 'hf', 'timm'

#: The model fields that change what the same weights compute (checked by
#: :func:`check_numerics`, set from ``init_from`` by the training config).
NUMERICS = ('classifier', 'posemb', 'gelu_approximate', 'layer_norm_epsilon')

_FAMILY = {HF: 'transformers ViT', TIMM: 'timm ViT'}


@dataclasses.dataclass(frozen=True)
class Foreign:
  """Weights of another library in this project's layout: ``variables`` (``{'params'}``,
  per-layer), ``fields`` (``vit_jax.models.create`` keywords; ``num_classes`` None without a
  head), ``image_size`` (the position table's side, or None), ``label_names`` (or None) and
  ``family`` ('transformers ViT' or 'timm ViT')."""

  variables: Dict[str, Any]
  fields: Dict[str, Any]
  image_size: Optional[int]
  label_names: Optional[Tuple[str, ...]]
  family: str


def hf_directory(path: str, is_dir: Optional[bool] = None) -> Optional[str]:
  """The transformers directory ``path`` is (or whose weight file it is), else None: one that
  holds ``config.json`` and ``model.safetensors`` (or its shard index). ``is_dir``: whether
  ``path`` is a directory, when the caller knows."""
  is_dir = paths.isdir(path) if is_dir is None else is_dir
  directory = path if is_dir else os.path.dirname(path) or '.'
  names = set(paths.listdir(directory))  # One listing, not one look-up per file.
  if hf_vit.CONFIG_FILE not in names:
    return None
  if is_dir and not names & {hf_vit.WEIGHTS_FILE, hf_vit.INDEX_FILE}:
    return None
  return directory


def detect_file(path: str, directory: Optional[str]) -> str:
  """:data:`HF` or :data:`TIMM` for a ``.safetensors`` file, from its tensor names
  (``directory``: :func:`hf_directory` of ``path``).

  Raises:
    ValueError: transformers names without a ``config.json`` beside the file, or names of
      neither library.
  """
  index, _ = safetensors_file.read_header(path)
  if hf_vit.is_hf_names(index):
    if directory is None:
      raise ValueError(f'{path} holds transformers ViT weights but no config.json lies beside '
                       'it: keep the directory save_pretrained wrote (or the Hub repository) '
                       'together, and give the directory.')
    return HF
  if timm_vit.is_timm_names(index):
    return TIMM
  shown = ', '.join(sorted(index)[:4])
  raise ValueError(f'{path} is a .safetensors file of neither a transformers ViT nor a timm '
                   f'VisionTransformer (its tensors: {shown}, ...).')


def _hf_shapes(directory: str) -> Dict[str, Tuple[int, ...]]:
  shapes = {}
  for file in hf_vit.weight_files(directory):
    shapes.update({k: v[0] for k, v in safetensors_file.read_header(file)[0].items()})
  return shapes


def read_fields(path: str, fmt: str, num_heads: Optional[int] = None,
                directory: Optional[str] = None) -> Dict[str, Any]:
  """The model fields (and ``image_size``) the weights at ``path`` need, from the headers
  only; arguments and errors as :func:`read`."""
  if fmt == HF:
    directory = directory or hf_directory(path)
    return hf_vit.fields_from(_hf_shapes(directory), hf_vit.read_config(directory), directory)
  index, metadata = safetensors_file.read_header(path)
  return timm_vit.fields_from({k: v[0] for k, v in index.items()}, metadata, path, num_heads)


def read(path: str, fmt: str, num_heads: Optional[int] = None,
         directory: Optional[str] = None) -> Foreign:
  """Reads transformers or timm ViT weights into this project's layout (exactly).

  Args:
    path: a transformers directory (``config.json`` + ``model.safetensors`` or shards), its
      weight file, or a timm ``.safetensors`` file; local or ``gs://``.
    fmt: :data:`HF` or :data:`TIMM`.
    num_heads: the heads when known (the model's): needed for timm files of non-standard widths.
    directory: :func:`hf_directory` of ``path`` when known.

  Raises:
    FileNotFoundError: a transformers directory without its weights or config.
    ValueError: another model type or activation, a timm variant without an equivalent here
      (named), unknown tensor names, heads that cannot be told.
    DamagedCheckpointError: a truncated or corrupt file.
  """
  if fmt == HF:  # Each file and the config read once; the fields from the arrays' shapes.
    directory = directory or hf_directory(path)
    arrays = {}
    for file in hf_vit.weight_files(directory):
      arrays.update(safetensors_file.read(file)[0])
    config = hf_vit.read_config(directory)
    fields = hf_vit.fields_from({k: tuple(np.shape(v)) for k, v in arrays.items()}, config,
                                directory)
    image_size = fields.pop('image_size', None)
    params = hf_vit.from_hf(arrays, fields['num_heads'], directory)
    names = hf_vit.label_names(config, fields['num_classes'])
  else:
    fields = read_fields(path, fmt, num_heads)
    image_size = fields.pop('image_size', None)
    arrays, metadata = safetensors_file.read(path)
    params = timm_vit.from_timm(arrays, fields['num_heads'], path)
    names = timm_vit.label_names(metadata, fields['num_classes'])
  return Foreign({'params': params}, fields, image_size, names, _FAMILY[fmt])


def check_numerics(fields: Mapping[str, Any], model: Any, path: str) -> None:
  """Refuses a ``model`` whose :data:`NUMERICS` differ from what the weights need.

  Raises:
    ValueError: naming each differing field with the file's value and the model's, and the
      keywords to build the model with.
  """
  differ = [(k, fields[k], getattr(model, k, None)) for k in NUMERICS
            if k in fields and getattr(model, k, None) != fields[k]]
  if not differ:
    return
  listed = ', '.join(f'{k}={want!r} (the model has {have!r})' for k, want, have in differ)
  fix = ', '.join(f'{k}={want!r}' for k, want, _ in differ)
  raise ValueError(f'{path} computes with {listed}: build the model with {fix} '
                   '(vit_jax.checkpoint.model_fields(path) gives every field), or its logits '
                   'will not be the source library\'s.')


def _exportable(fields: Mapping[str, Any], to: str) -> None:
  """Raises ValueError for what the target library's ViT cannot express."""
  name = {'hf': 'transformers ViT', 'timm': 'timm VisionTransformer'}[to]
  problems = []
  if fields.get('resnet_num_layers') is not None:
    problems.append('a ResNet stem (R+ViT hybrid)')
  if 'hidden_size' not in fields:
    problems.append('not a ViT (T2T-ViT has another layout)')
  if to == 'hf':
    if fields.get('classifier', 'token') != 'token':
      problems.append(f"classifier={fields['classifier']!r} (ViTForImageClassification "
                      'classifies the class token)')
    if fields.get('representation_size') and fields.get('num_classes'):
      problems.append('a pre_logits layer before the head (ViTForImageClassification has none)')
    if not isinstance(fields.get('patch_size'), int):
      problems.append(f"non-square patches {fields.get('patch_size')}")
  else:
    if fields.get('representation_size'):
      problems.append('a pre_logits layer (representation_size; timm has none)')
    epsilon = fields.get('layer_norm_epsilon', 1e-6)
    if epsilon != timm_vit.TIMM_LAYER_NORM_EPSILON:
      problems.append(f'LayerNorm epsilon {epsilon} (timm builds 1e-6; export with --to hf)')
  if problems:
    raise ValueError(f"The model cannot be written as a {name}: it has {'; '.join(problems)}.")


def _hf_paths(dst: str) -> Tuple[str, str]:
  if dst.endswith(safetensors_file.SUFFIX):
    return dst, os.path.join(os.path.dirname(dst) or '.', hf_vit.CONFIG_FILE)
  return os.path.join(dst, hf_vit.WEIGHTS_FILE), os.path.join(dst, hf_vit.CONFIG_FILE)


def output_paths(dst: str, to: str) -> List[str]:
  """The files :func:`write` writes for ``dst`` (to check for existing ones first)."""
  if to != 'hf':
    return [dst]
  weights, config = _hf_paths(dst)
  return [weights, config, os.path.join(os.path.dirname(config), hf_vit.PREPROCESSOR_FILE)]


def write(dst: str, params: Mapping[str, Any], fields: Mapping[str, Any], *, to: str,
          image_size: int, label_names: Optional[Sequence[str]] = None,
          normalization: str = 'minus_one_to_one') -> str:
  """Writes a ViT's parameters as transformers (``to='hf'``) or timm (``to='timm'``) weights.

  Args:
    dst: timm: the ``.safetensors`` file. transformers: a directory (``model.safetensors`` and
      ``config.json`` are written in it), or a ``.safetensors`` path (``config.json`` beside it;
      ``from_pretrained`` reads ``model.safetensors``).
    params: the params tree, per-layer or scanned (unrolled first); boxed or plain.
    fields: the model's fields (``config.model`` of a run, plus ``num_classes``).
    to: 'hf' or 'timm'.
    image_size: the side of the square images it runs at (transformers' config; timm's call).
    label_names: class names: transformers' ``id2label``; timm: the file's metadata (read back
      here; timm itself does not read them).
    normalization: the pixel normalisation the model expects (``config.data.normalization``):
      transformers' ``preprocessor_config.json`` and timm's pretrained config get its mean and
      std, with the input size and a plain bilinear resize, so that their preprocessing
      (``AutoImageProcessor``, ``resolve_model_data_config``) feeds what the model was trained on.

  Returns:
    How to load the result in the target library (one line of Python).

  Raises:
    ValueError: what the target cannot express (named), e.g. a hybrid, ``classifier`` other
      than 'token' for transformers, a ``pre_logits`` layer, timm with another LayerNorm epsilon.
  """
  fields = dict(fields)
  if 'patch_size' in fields:  # A config's (P, P) pair: square patches are one int for both.
    from vit_jax.models import vit  # pylint: disable=g-import-not-at-top
    ph, pw = vit.patch_pair(fields['patch_size'])
    fields['patch_size'] = ph if ph == pw else (ph, pw)
  _exportable(fields, to)
  params = layout.unbox(params)
  if layout.is_scanned(params):
    params = layout.unscan_params(params)
  params = _materialise_posemb(params, fields, image_size)
  if to == 'hf':
    weights, config_path = _hf_paths(dst)
    state, config = hf_vit.to_hf(params, fields, image_size=image_size, names=label_names)
    safetensors_file.write(weights, state)
    directory = os.path.dirname(weights) or '.'
    for name, content in ((config_path, config),
                          (os.path.join(directory, hf_vit.PREPROCESSOR_FILE),
                           hf_vit.preprocessor_config(image_size, normalization))):
      with open(name, 'w') as f:
        json.dump(content, f, indent=2)
    cls = config['architectures'][0]
    return f'transformers.{cls}.from_pretrained({directory!r})'
  state = timm_vit.to_timm(params)
  saved = {k: fields[k] for k in ('num_heads', 'gelu_approximate', 'layer_norm_epsilon',
                                  'classifier') if k in fields}
  if label_names:
    saved['label_names'] = list(label_names)
  metadata = {timm_vit.METADATA_KEY: json.dumps(saved)}
  call = timm_vit.create_model_call(fields, dst, image_size, normalization)
  safetensors_file.write(dst, state, {**metadata, 'timm_create_model': call})
  return call


def _materialise_posemb(params: Mapping[str, Any], fields: Mapping[str, Any],
                        image_size: int) -> Dict[str, Any]:
  """A 'sincos2d' model's fixed table as a learned position embedding (the same values; a zero
  class row in front with a class token), which both libraries' ViTs have."""
  if fields.get('posemb', 'learn') != 'sincos2d':
    return dict(params)
  from vit_jax.models import vit  # pylint: disable=g-import-not-at-top
  ph, pw = vit.patch_pair(fields['patch_size'])
  width = int(fields['hidden_size'])
  table = np.asarray(vit.posemb_sincos_2d(image_size // ph, image_size // pw, width))
  if 'cls' in params:
    table = np.concatenate([np.zeros((1, 1, width), table.dtype), table], axis=1)
  encoder = dict(params['Transformer'], posembed_input={'pos_embedding': table})
  return dict(params, Transformer=encoder)
