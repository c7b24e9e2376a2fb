"""A model family's fields declared once: name, default, type, help and the ecosystems' names.

Each family declares a tuple of :class:`Field` (``vit_fields.VIT_FIELDS``, ``t2t.T2T_FIELDS``);
the registry's defaults and override keys, the config's command-line types, the checkpoints'
"fields the weights record" and timm's keywords are read from it (docs/models.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Optional, Tuple


class _Required:
  """The default of a field that a ``*-custom`` model must be given."""

  def __repr__(self) -> str:
    return 'REQUIRED'


REQUIRED: Any = _Required()


@dataclasses.dataclass(frozen=True)
class Field:
  """One model field: its ``name``, ``default`` (:data:`REQUIRED`: a ``*-custom`` model must be
  given it), the ``type`` ``--config.model.NAME`` parses to, one line of ``help``, whether the
  parameter shapes record it (``in_weights``: read back from any checkpoint), and its name in
  timm's ``VisionTransformer`` (``timm``) and transformers' ``ViTConfig`` (``hf``) where they take
  the value as it is (None: no such keyword)."""

  name: str
  default: Any
  type: type
  help: str
  in_weights: bool = False
  timm: Optional[str] = None
  hf: Optional[str] = None


#: How the blocks run, in every family: not in the weights, never in a checkpoint's fields.
EXECUTION_FIELDS: Tuple[Field, ...] = (
    Field('dtype', 'float32', str, 'compute dtype (float32, bfloat16)'),
    Field('param_dtype', 'float32', str, 'parameter dtype'),
    Field('scan', False, bool, 'one scanned block stack instead of L named blocks'),
    Field('remat', False, bool, 'rematerialise each block in the backward pass'),
    Field('remat_policy', 'nothing_saveable', str,
          "what remat keeps (training: 'auto' picks from the devices, docs/configs.md)"),
    Field('attention', 'xla', str, "attention implementation (training: 'auto', docs/kernels.md)"),
)


def defaults(fields: Iterable[Field]) -> Dict[str, Any]:
  """``{name: default}`` of the fields that have one, in declaration order."""
  return {f.name: f.default for f in fields if f.default is not REQUIRED}


def required(fields: Iterable[Field]) -> Tuple[str, ...]:
  """The names a ``*-custom`` model must be given."""
  return tuple(f.name for f in fields if f.default is REQUIRED)


def names(fields: Iterable[Field]) -> Tuple[str, ...]:
  """The fields' names, in declaration order (a family's override keys)."""
  return tuple(f.name for f in fields)
