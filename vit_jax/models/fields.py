"""A model family's fields declared once (:class:`Field`; ``vit_fields.VIT_FIELDS``,
``t2t.T2T_FIELDS``) and their checks; who reads them: docs/models.md, "Fields, declared once".
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from vit_jax.models import attention
from vit_jax.models import execution


class _Required:
  """The default of a field that a ``*-custom`` model must be given."""

  def __repr__(self) -> str:
    return 'REQUIRED'


REQUIRED: Any = _Required()


#: A field's check: ``check(name, value)`` raises ValueError naming the field and the value.
Check = Callable[[str, Any], None]


@dataclasses.dataclass(frozen=True)
class Field:
  """One model field (its attributes: docs/models.md, "Fields, declared once"); ``default``
  :data:`REQUIRED`: a ``*-custom`` model must be given it; ``check`` None: the family's own
  checks; ``param``: :func:`recorded`."""

  name: str
  default: Any
  type: type
  help: str
  in_weights: bool = False
  timm: Optional[str] = None
  hf: Optional[str] = None
  check: Optional[Check] = None
  param: Optional[str] = None


def boolean(name: str, value: Any) -> None:
  """ValueError unless ``value`` is True or False (NumPy's too)."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{name} must be True or False, got {value!r}')


def python_bool(name: str, value: Any) -> None:
  """ValueError unless ``value`` is Python's True or False (an execution switch)."""
  if not isinstance(value, bool):
    raise ValueError(f'{name} must be True or False, got {value!r}')


def one_of(choices: Tuple[Any, ...]) -> Check:
  """The check that a value is one of ``choices``."""

  def check(name: str, value: Any) -> None:
    if value not in choices:
      raise ValueError(f'{name} must be one of {choices}, got {value!r}')

  return check


def positive(kind: type = int, allow_none: bool = False) -> Check:
  """The check that a value is > 0 and an int (``kind`` float: an int or a float), never a bool;
  or None with ``allow_none``."""
  types, word = ((int, float), 'number') if kind is float else ((int,), 'int')

  def check(name: str, value: Any) -> None:
    if value is None and allow_none:
      return
    if isinstance(value, bool) or not isinstance(value, types) or value <= 0:
      extra = ' or None' if allow_none else ''
      raise ValueError(f'{name} must be a positive {word}{extra}, got {value!r}')

  return check


def rate(name: str, value: Any) -> None:
  """ValueError unless ``value`` is a number in [0, 1) (a rate)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
    raise ValueError(f'{name} must be a float in [0, 1), got {value!r}')


def float_dtype(name: str, value: Any) -> None:
  """ValueError unless ``value`` is a floating dtype (or None)."""
  if value is None:
    return
  try:
    ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f'{name} must be a floating dtype (e.g. jnp.float32, jnp.bfloat16), '
                     f'got {value!r}')


def validate(declared: Tuple[Field, ...], config: Mapping[str, Any], num_classes: Any) -> None:
  """TypeError naming the ``declared`` required fields ``config`` lacks; ValueError: a bad
  ``num_classes`` or field value (each field's ``check``, of its default where absent)."""
  missing = [k for k in required(declared) if k not in config]
  if missing:
    raise TypeError(f'validate_config() needs the fields {missing}')
  positive(allow_none=True)('num_classes', num_classes)
  for field in declared:
    if field.check is not None:
      field.check(field.name, config.get(field.name, field.default))


#: How the blocks run, in every family: not in the weights, never in a checkpoint's fields.
EXECUTION_FIELDS: Tuple[Field, ...] = (
    Field('dtype', 'float32', str, 'compute dtype (float32, bfloat16)', check=float_dtype),
    Field('param_dtype', 'float32', str, 'parameter dtype', check=float_dtype),
    Field('scan', False, bool, 'one scanned block stack instead of L named blocks',
          check=python_bool),
    Field('remat', False, bool, 'rematerialise each block in the backward pass',
          check=python_bool),
    Field('remat_policy', 'nothing_saveable', str,
          "what remat keeps (training: 'auto' picks from the devices, docs/configs.md)",
          check=one_of(execution.REMAT_POLICIES)),
    Field('attention', 'xla', str, "attention implementation (training: 'auto', docs/kernels.md)",
          check=lambda _, value: attention.check_implementation(value)),
)


def defaults(fields: Iterable[Field]) -> Dict[str, Any]:
  """``{name: default}`` of the fields that have one, in declaration order."""
  return {f.name: f.default for f in fields if f.default is not REQUIRED}


def frozen_config(declared: Iterable[Field]) -> type:
  """A frozen dataclass ``Config`` of the ``declared`` fields' values, attributes named as the
  fields (defaults theirs, None where required): what a family's modules take whole."""
  specs = []
  for f in declared:
    default = None if f.default is REQUIRED else f.default
    specs.append((f.name, Any, dataclasses.field(default=default)))
  return dataclasses.make_dataclass('Config', specs, frozen=True)


def required(fields: Iterable[Field]) -> Tuple[str, ...]:
  """The names a ``*-custom`` model must be given."""
  return tuple(f.name for f in fields if f.default is REQUIRED)


def names(fields: Iterable[Field]) -> Tuple[str, ...]:
  """The fields' names, in declaration order (a family's override keys)."""
  return tuple(f.name for f in fields)


def recorded(declared: Iterable[Field], names: Iterable[str]) -> Dict[str, bool]:
  """``{name: True}`` of the bool fields whose ``param`` is among the ``'/'``-joined parameter
  ``names`` (collection first; a block's ``encoderblock`` matches per-layer ``encoderblock_{i}``
  and scanned ``encoderblock`` alike)."""
  plain = {re.sub(r'/encoderblock_\d+/', '/encoderblock/', n) for n in names}
  return {f.name: True for f in declared if f.param and f'params/{f.param}' in plain}
