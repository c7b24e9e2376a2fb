"""The collectives of a compiled step that cross slices (multi-slice over DCN), read from its
optimized HLO text (`compiled.as_text()`): the megascale runtime's transfers (a `send` marked
`_xla_megascale_transfer_type`, its operand the buffer a device hands the DCN) and, in a program
compiled for every slice's devices, the collectives whose groups span slices (why these:
docs/pods.md, "What crosses the DCN"). A loop's collectives count once per trip (read from its
condition `counter < N` and the counter's start; else once, and `exact` is False); a
conditional's branches as if each ran.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Optional, Sequence

import numpy as np

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                "all-to-all")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([^\s(]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(calls|to_apply|body|branch_computations|true_computation|"
                      r"false_computation)=(\{[^}]*\}|%[^\s,]+)")


@dataclasses.dataclass(frozen=True)
class CrossSlice:
  """Per step: the collectives that cross slices, `count` executions by `kinds`
  ({'all-reduce': 20}), and the `bytes` of the buffers each device hands the DCN (a transfer's
  operand; a collective's largest buffer), as the TPU lays them out (8 x 128 tiles; the volume
  a ring sends: docs/pods.md). `exact`: every loop's trip count was read."""
  count: int = 0
  bytes: int = 0
  kinds: dict[str, int] = dataclasses.field(default_factory=dict)
  exact: bool = True


@dataclasses.dataclass
class _Instruction:
  name: str
  type: str
  op: str
  rest: str


def _bytes(array: re.Match) -> int:
  dtype, dims = array.groups()
  bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
  return math.prod(int(d) for d in dims.split(",") if d) * max(bits // 8, 1)


def _groups(rest: str) -> Optional[list[list[int]]]:
  """The device groups of a collective: explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]` (with a
  `T(1,0)` transpose) or a permute's `source_target_pairs`; None when it has none."""
  explicit = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", rest)
  if explicit:
    return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}",
                                                                      explicit.group(1))]
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
  if not iota:
    return None
  shape, dims = ([int(i) for i in s.split(",")] for s in iota.groups()[:2])
  ids = np.arange(math.prod(dims)).reshape(dims)
  if iota.group(3):
    ids = ids.transpose([int(i) for i in iota.group(3).split(",")])
  return ids.reshape(shape).tolist()


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instruction]], Optional[str], int]:
  """({computation: instructions}, the entry's name, the module's num_partitions)."""
  computations: dict[str, list[_Instruction]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    if current is None:
      match = _COMPUTATION.match(line)
      if match:
        current = computations.setdefault(match.group(1), [])
        entry = match.group(1) if line.startswith("ENTRY") else entry
    elif line.startswith("}"):
      current = None
    else:
      match = _INSTRUCTION.match(line)
      if match:
        current.append(_Instruction(*match.groups()))
  partitions = re.search(r"num_partitions=(\d+)", hlo_text.split("\n", 1)[0])
  return computations, entry, int(partitions.group(1)) if partitions else 1


def _constant(name: str, by_name: dict[str, _Instruction]) -> Optional[int]:
  """The integer `name` holds, following copies, converts and bitcasts to a constant."""
  for _ in range(8):
    inst = by_name.get(name)
    if inst is None:
      return None
    if inst.op == "constant":
      number = re.match(r"\s*(-?\d+)\)", inst.rest)
      return int(number.group(1)) if number else None
    if inst.op not in ("copy", "convert", "bitcast"):
      return None
    name = inst.rest.split(")")[0].strip().lstrip("%")
  return None


def _trip_count(loop: _Instruction, caller: list[_Instruction],
                computations: dict[str, list[_Instruction]]) -> Optional[int]:
  """A while loop's trips when its condition is `counter < N` (or `N > counter`) of a
  counter stepping by one from a constant; else None."""
  condition = re.search(r"condition=%([^\s,]+)", loop.rest)
  body = computations.get(condition.group(1)) if condition else None
  root = next((i for i in reversed(body or []) if i.op == "compare"), None)
  if root is None or not re.search(r"direction=(LT|GT)", root.rest):
    return None
  by_name = {i.name: i for i in body}
  left, right = (o.strip().lstrip("%") for o in root.rest.split(")")[0].split(",")[:2])
  if "direction=GT" in root.rest:
    left, right = right, left
  counter, bound = by_name.get(left), _constant(right, by_name)
  index = re.search(r"index=(\d+)", counter.rest) if counter else None
  if bound is None or counter is None or counter.op != "get-tuple-element" or not index:
    return None
  callers = {i.name: i for i in caller}
  init = callers.get(loop.rest.split(")")[0].strip().lstrip("%"))
  if init is None or init.op != "tuple":
    return None
  operands = [o.strip() for o in re.sub(r"/\*.*?\*/", "", init.rest.split(")")[0]).split(",")]
  start = _constant(operands[int(index.group(1))].lstrip("%"), callers)
  return None if start is None else max(bound - start, 0)


def cross_slice(hlo_text: str, slice_of: Sequence[int]) -> CrossSlice:
  """The `CrossSlice` of a compiled program's HLO text; `slice_of[i]`: the slice of the i-th
  device of its device assignment (the mesh's devices in order), read only when the program
  spans them all (`num_partitions == len(slice_of)`)."""
  computations, entry, partitions = _parse(hlo_text)
  whole = partitions == len(slice_of) and len(set(slice_of)) > 1
  times: dict[str, int] = collections.defaultdict(int)
  exact = True

  def visit(name: str, factor: int) -> None:
    nonlocal exact
    times[name] += factor
    for inst in computations.get(name, ()):
      for field, callees in _CALLEES.findall(inst.rest):
        trips = 1
        if field == "body":
          trips = _trip_count(inst, computations[name], computations)
          exact &= trips is not None
          trips = 1 if trips is None else trips
        for callee in re.findall(r"%([^\s,{}]+)", callees):
          if callee in computations:
            visit(callee, factor * trips)

  if entry is not None:
    visit(entry, 1)
  kinds: dict[str, int] = collections.Counter()
  total = 0
  for name, factor in times.items():
    for inst in computations[name]:
      kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', inst.rest)
      if inst.op == "send" and kind:
        size = _bytes(_ARRAY.search(inst.type))
        label = kind.group(1).lower().replace("_", "-")
      elif whole and inst.op.removesuffix("-start") in _COLLECTIVES:
        groups = _groups(inst.rest) or [list(range(partitions))]
        if all(len({slice_of[i] for i in g}) == 1 for g in groups):
          continue
        label = inst.op.removesuffix("-start")
        size = max(_bytes(a) for a in _ARRAY.finditer(inst.type))
        size *= len(groups[0]) if label == "reduce-scatter" else 1
      else:
        continue
      kinds[label] += factor
      total += size * factor
  return CrossSlice(sum(kinds.values()), total, dict(kinds), exact)

