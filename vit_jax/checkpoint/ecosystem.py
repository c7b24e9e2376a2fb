"""Hugging Face transformers and timm ViT weights: what they share, read and written without
torch (each library's names and files: :mod:`.hf_vit`, :mod:`.timm_vit`; detection:
:mod:`.formats`). :func:`write` exports a ViT to either (``python -m vit_jax.convert --to``)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from vit_jax.checkpoint import hf_vit
from vit_jax.checkpoint import timm_vit
from vit_jax.models import layout
from vit_jax.models import vit

#: The model fields that change what the same weights compute (checked by
#: :func:`check_numerics`, set from ``init_from`` by the training config).
NUMERICS = ('classifier', 'posemb', 'gelu_approximate', 'layer_norm_epsilon')

#: The fields the weights' library implies that change nothing at their own image size, only
#: how their learned position table is resampled to another grid (``checkpoint.posemb_resize``);
#: never checked.
RESAMPLING = ('posemb_resize',)

#: The model's ``posemb_resize`` unless set (the official fine-tuning resize).
DEFAULT_POSEMB_RESIZE = vit.VisionTransformer.posemb_resize

#: The export targets (``to``): the library's module and its ViT's name.
_TARGETS = {'hf': (hf_vit, 'transformers ViT'), 'timm': (timm_vit, 'timm VisionTransformer')}


def check_numerics(fields: Mapping[str, Any], model: Any, path: str) -> None:
  """Raises ValueError naming each of :data:`NUMERICS` where ``model`` differs from the weights'
  ``fields``, with the keywords to build the model with."""
  differ = [(k, fields[k], getattr(model, k, None)) for k in NUMERICS
            if k in fields and getattr(model, k, None) != fields[k]]
  if not differ:
    return
  listed = ', '.join(f'{k}={want!r} (the model has {have!r})' for k, want, have in differ)
  fix = ', '.join(f'{k}={want!r}' for k, want, _ in differ)
  raise ValueError(f'{path} computes with {listed}: build the model with {fix} '
                   '(vit_jax.checkpoint.model_fields(path) gives every field), or its logits '
                   'will not be the source library\'s.')


def output_paths(dst: str, to: str) -> List[str]:
  """The files :func:`write` writes for ``dst`` (to check for existing ones first)."""
  return _TARGETS[to][0].output_paths(dst)


def write(dst: str, params: Mapping[str, Any], fields: Mapping[str, Any], *, to: str,
          image_size: int, label_names: Optional[Sequence[str]] = None,
          normalization: str = 'minus_one_to_one',
          eval_crop_pct: Optional[float] = None) -> str:
  """Writes a ViT's params (per-layer or scanned, boxed or plain) with its ``fields`` (a run's
  ``config.model`` and ``num_classes``) as transformers (``to='hf'``) or timm weights at ``dst``
  (:func:`output_paths`), with the class names and the preprocessing it expects; returns the
  line of Python that loads them. Raises ValueError naming what the target cannot express."""
  library, name = _TARGETS[to]
  fields = dict(fields)
  if 'patch_size' in fields:  # A config's (P, P) pair: square patches are one int for both.
    ph, pw = vit.patch_pair(fields['patch_size'])
    fields['patch_size'] = ph if ph == pw else (ph, pw)
  problems = []
  if fields.get('resnet_num_layers') is not None:
    problems.append('a ResNet stem (R+ViT hybrid)')
  if 'hidden_size' not in fields:
    problems.append('not a ViT (T2T-ViT has another layout)')
  problems += library.export_problems(fields)
  if problems:
    raise ValueError(f"The model cannot be written as a {name}: it has {'; '.join(problems)}. "
                     'An Orbax directory or an .npz (with its .vit_jax.json) keeps every field: '
                     'python -m vit_jax.convert SRC DIR (or SRC FILE.npz).')
  params = layout.unbox(params)
  if layout.is_scanned(params):
    params = layout.unscan_params(params)
  params = _materialise_posemb(params, fields, image_size)
  return library.write(dst, params, fields, image_size, label_names, normalization,
                       eval_crop_pct)


def resize_note(fields: Mapping[str, Any], to: str) -> Optional[str]:
  """Where the target library (``to``) resizes a position table otherwise than ``fields``'
  ``posemb_resize`` (which the written file keeps for this project, and the library ignores):
  the sentence that says so, else None."""
  library, name = _TARGETS[to]
  ours = fields.get('posemb_resize') or DEFAULT_POSEMB_RESIZE
  if ours == library.POSEMB_RESIZE:
    return None
  return (f"a {name} resizes its position table to another input size by "
          f"{library.POSEMB_RESIZE!r}, this model by posemb_resize={ours!r}: the file keeps "
          f"{ours!r} for vit_jax, which the library ignores (at the written image size the "
          'outputs are the same).')


def _materialise_posemb(params: Mapping[str, Any], fields: Mapping[str, Any],
                        image_size: int) -> Dict[str, Any]:
  """A 'sincos2d' model's fixed table as the learned position embedding both libraries have
  (the same values, zero rows in front for the class token and registers)."""
  if fields.get('posemb', 'learn') != 'sincos2d':
    return dict(params)
  ph, pw = vit.patch_pair(fields['patch_size'])
  width = int(fields['hidden_size'])
  table = np.asarray(vit.posemb_sincos_2d(image_size // ph, image_size // pw, width))
  classifier = 'token' if 'cls' in params else 'gap'
  rows = vit.posemb_prefix_rows(dict(fields, classifier=classifier))
  if rows:
    table = np.concatenate([np.zeros((1, rows, width), table.dtype), table], axis=1)
  encoder = dict(params['Transformer'], posembed_input={'pos_embedding': table})
  return dict(params, Transformer=encoder)
