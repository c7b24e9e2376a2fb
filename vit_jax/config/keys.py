"""A config key declared once (:class:`Key`) and its refusal (:class:`ConfigError`); who reads
the declarations: docs/configs.md, "Keys, declared once".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Optional, Tuple

import ml_collections
from ml_collections import config_dict


#: The most characters of a refused value's repr a message shows.
MAX_SHOWN = 100


class ConfigError(ValueError):
  """A config value that cannot run: the ``key`` ('optim.lr', dotted from the top), its
  ``value``, what is wrong with it (``problem``) and the ``fix``, which names settings as
  ``config.KEY`` (``vit_jax.cli.error_text`` spells them as the command line's flags).
  ``str()``: ``config.KEY=VALUE <problem>; <fix>``."""

  def __init__(self, key: str, value: Any, problem: str, fix: str):
    self.key = key
    self.value = value
    self.problem = problem
    self.fix = fix
    shown = repr(value)
    if len(shown) > MAX_SHOWN:
      shown = f"{shown[:MAX_SHOWN - 20]}...{shown[-10:]}"
    super().__init__(f"config.{key}={shown} {problem}; {fix}")


@dataclasses.dataclass(frozen=True)
class Check:
  """What a value must be, in words (``what``, e.g. 'an int >= 0'), the ``test``, and an
  ``example`` setting for a value hard to write (a tuple), shown with the fix."""

  what: str
  test: Callable[[Any], bool]
  example: Optional[str] = None


def number(value: Any) -> bool:
  """A finite int or float (not a bool, NaN or infinity)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(value: Any) -> bool:
  """An int, not a bool."""
  return isinstance(value, int) and not isinstance(value, bool)


def one_of(choices: Iterable[Any]) -> Check:
  choices = tuple(choices)
  return Check(f"one of {choices}", lambda v: v in choices)


#: The most optimizer steps a run can count: the train state's step is an int32.
MAX_STEPS = 2**31 - 1

INT = Check("an int", integer)
POSITIVE_INT = Check("a positive int", lambda v: integer(v) and v > 0)
NON_NEGATIVE_INT = Check("an int >= 0", lambda v: integer(v) and v >= 0)
POSITIVE = Check("> 0", lambda v: number(v) and v > 0)
NON_NEGATIVE = Check(">= 0", lambda v: number(v) and v >= 0)
UNIT = Check("in [0, 1)", lambda v: number(v) and 0 <= v < 1)
PROBABILITY = Check("in [0, 1] (a probability)", lambda v: number(v) and 0 <= v <= 1)
FRACTION = Check("in (0, 1]", lambda v: number(v) and 0 < v <= 1)
BOOL = Check("True or False", lambda v: isinstance(v, bool))
STEP_COUNT = Check(f"a positive int <= {MAX_STEPS:,} (the int32 step counter)",
                   lambda v: integer(v) and 0 < v <= MAX_STEPS)
SPLIT = Check("a non-empty split name", lambda v: isinstance(v, str) and bool(v.strip()))


@dataclasses.dataclass(frozen=True)
class Key:
  """One key of a config section: its ``name``, ``default`` (None: a placeholder of ``type``,
  which then also passes the ``check``), the ``type`` a command-line value parses to, one line of
  ``help``, the ``check`` ``resolve`` applies (None: any value of the type), whether it is
  ``filled`` before the check when None (the regime's value): then None fails it, and whether it
  changes what a run ``trained`` (False: how it runs, logs, evaluates or saves; a resumed run
  refuses a change of the others, `vit_jax.config.resolution.resume_changes`)."""

  name: str
  default: Any
  type: type
  help: str
  check: Optional[Check] = None
  filled: bool = False
  trained: bool = True

  def refuse(self, value: Any, prefix: str = "") -> Optional[ConfigError]:
    """The ConfigError of ``value`` under this key (``prefix``: its section, 'optim.'), or None
    when it passes the check."""
    optional = self.default is None and not self.filled
    if self.check is None or (value is None and optional) or self.check.test(value):
      return None
    expected = self.check.what + (" or None" if optional else "")
    if isinstance(value, float) and not math.isfinite(value):
      expected = f"finite and {expected}"
    key = prefix + self.name
    example = f", e.g. config.{key}={self.check.example}" if self.check.example else ""
    return ConfigError(key, value, f"must be {expected} ({self.help})",
                       f"set config.{key} to such a value{example}.")


def section(keys: Tuple[Key, ...], **defaults: Any) -> ml_collections.ConfigDict:
  """A config section of ``keys`` (their defaults, or ``defaults``' where given; None: a typed
  placeholder), in declaration order."""
  c = ml_collections.ConfigDict()
  for key in keys:
    value = defaults.get(key.name, key.default)
    c[key.name] = config_dict.placeholder(key.type) if value is None else value
  return c


def check(values: Any, keys: Tuple[Key, ...], prefix: str = "") -> None:
  """Raises the ConfigError of the first of ``keys`` whose value in ``values`` (a section)
  fails its check; a key absent from ``values`` (an older config.json) is skipped."""
  for key in keys:
    if key.name in values:
      error = key.refuse(values[key.name], prefix)
      if error is not None:
        raise error


def find(keys: Tuple[Key, ...], name: str) -> Key:
  """The key called ``name``."""
  return next(k for k in keys if k.name == name)
