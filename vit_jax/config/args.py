"""The argument of a config file, ``configs/<file>.py:<arg>``, parsed one way for every file.

  ARGS = args.Spec("configs/vit.py", ("model", "dataset", "regime"),
                   choices={"regime": ("pretrain", "finetune")},
                   defaults={"regime": "pretrain"})
  def get_config(arg=""):
    a = ARGS.parse(arg)          # {'model': 'b16', 'dataset': 'cifar10', 'regime': 'pretrain'}

Comma-separated values in field order (``b16,cifar10``), ``name=value`` items in any order, or
both (positional first); strings. A field with a ``pattern`` also takes a matching positional
value from an earlier optional place (``b16,imagenet21k,v3-32`` -> slice 'v3-32').
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a config file's argument holds: the ``file`` as users type it (for messages), the
  ``fields`` in positional order, some fields' accepted ``choices``, the optional fields'
  ``defaults``, a few words of ``help`` per field, and ``patterns`` (see the module)."""

  file: str
  fields: Sequence[str]
  choices: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
  defaults: Mapping[str, Optional[str]] = dataclasses.field(default_factory=dict)
  help: Mapping[str, str] = dataclasses.field(default_factory=dict)
  patterns: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def _place(self, index: int, value: str) -> int:
    """The field index a positional `value` at `index` goes to (`patterns`)."""
    for later in range(index, len(self.fields)):
      field = self.fields[later]
      if field in self.patterns and re.fullmatch(self.patterns[field], value):
        skipped = self.fields[index:later]
        if all(f in self.defaults and not (f in self.choices and value in self.choices[f])
               for f in skipped):
          return later
    return index

  def usage(self) -> str:
    """E.g. "configs/vit.py:<model>,<dataset>[,<regime>]"."""
    parts = []
    for i, field in enumerate(self.fields):
      item = f",<{field}>" if i else f"<{field}>"
      parts.append(f"[{item}]" if field in self.defaults else item)
    return f"{self.file}:" + "".join(parts)

  def _describe(self, field: str) -> str:
    if field in self.choices:
      return f"one of {', '.join(self.choices[field])}"
    return self.help.get(field, "")

  def parse(self, arg: Optional[str]) -> dict[str, Optional[str]]:
    """The fields of ``arg``, defaults filled in. Raises ValueError (with the usage): too many
    values, an unknown or repeated name, a missing field, a value outside the choices."""
    values: dict[str, Optional[str]] = {}
    items = [item.strip() for item in (arg or "").split(",")] if arg else []
    positional = True
    index = 0
    for item in items:
      name, sep, value = item.partition("=")
      if sep:
        positional = False
        name = name.strip()
        if name not in self.fields:
          raise ValueError(f"{self.file}: unknown field {name!r} in {arg!r}; the fields are "
                           f"{', '.join(self.fields)} (usage: {self.usage()}).")
      elif not positional:
        raise ValueError(f"{self.file}: the value {item!r} in {arg!r} follows a 'name=value' "
                         f"item; put plain values first (usage: {self.usage()}).")
      elif index >= len(self.fields):
        raise ValueError(f"{self.file} takes at most {len(self.fields)} values, got "
                         f"{len(items)} in {arg!r} (usage: {self.usage()}).")
      else:
        index = self._place(index, item.strip())
        name = self.fields[index]
        value = item
        index += 1
      if name in values:
        raise ValueError(f"{self.file}: {name!r} is given twice in {arg!r}.")
      values[name] = value.strip()
    for field in self.fields:
      if field not in values or values[field] == "":
        if field not in self.defaults:
          described = self._describe(field)
          raise ValueError(f"{self.file} needs <{field}>"
                           + (f" ({described})" if described else "")
                           + f": use {self.usage()}.")
        values[field] = self.defaults[field]
      elif field in self.choices and values[field] not in self.choices[field]:
        raise ValueError(f"{self.file}: <{field}> must be {self._describe(field)}, got "
                         f"{values[field]!r} (usage: {self.usage()}).")
    return values
