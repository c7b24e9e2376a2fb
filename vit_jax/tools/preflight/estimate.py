"""The TPU compiler's estimate of a compiled step's time, with every loop counted as it runs.

libtpu's cost analysis (`vit_jax.flops.compiled_cost`) gives `optimal_seconds`, its cost
model's time of one device's program (a lower bound), but counts a while loop's body once
however many trips it makes (the scan over layers, gradient accumulation). The step's scans of 2
or more trips are grouped by level (their trips and those around them: `(4, 12)` for the layers
inside 4 micro-batches); per level the traced step is compiled again (`rejit`) with those scans
running k trips per body (jax's `unroll`), and the difference over k - 1 is one trip's body. The
innermost level is unrolled whole, each trip behind an optimization barrier (else XLA merges a
remat's recomputation with the forward pass and drops it); a level around others takes the
smallest k that leaves a loop. Each level's own body is then counted as often as it runs.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import jax
from jax.extend import core as jax_core

from vit_jax import flops
from vit_jax.tools.preflight import topology

Level = tuple[int, ...]  # A scan's trips after those of the scans around it, outermost first.
SECONDS = "optimal_seconds"


def rejit(traced: jax_core.ClosedJaxpr) -> Callable[..., Any]:
  """A jitted function of `traced` (the jaxpr of a jitted function, perhaps changed: one `jit`
  equation) on its flat arguments, jitted as the function was (shardings, donation), so that an
  unchanged jaxpr compiles to the same program; else `traced` jitted with no more said."""
  eqns = traced.jaxpr.eqns
  if len(eqns) != 1 or "jaxpr" not in eqns[0].params or "donated_invars" not in eqns[0].params:
    return jax.jit(jax_core.jaxpr_as_fun(traced))
  params = eqns[0].params
  unspecified = lambda s: None if type(s).__name__ == "UnspecifiedValue" else s
  inner = jax_core.jaxpr_as_fun(params["jaxpr"])
  return jax.jit(lambda *args: tuple(inner(*args)),
                 in_shardings=tuple(map(unspecified, params["in_shardings"])),
                 out_shardings=tuple(map(unspecified, params["out_shardings"])),
                 donate_argnums=tuple(i for i, d in enumerate(params["donated_invars"]) if d))


def _sub_jaxprs(param: Any) -> Iterator[jax_core.Jaxpr]:
  for value in param if isinstance(param, (tuple, list)) else (param,):
    if isinstance(value, jax_core.ClosedJaxpr):
      yield value.jaxpr
    elif isinstance(value, jax_core.Jaxpr):
      yield value


def _map_jaxprs(param: Any, fn: Callable[[jax_core.Jaxpr], jax_core.Jaxpr]) -> Any:
  """`param` (an equation's) with each jaxpr in it, closed or not, in a tuple or not, `fn`'s;
  the same object where `fn` changed none."""
  if isinstance(param, (tuple, list)):
    mapped = [_map_jaxprs(value, fn) for value in param]
    return param if all(a is b for a, b in zip(mapped, param)) else type(param)(mapped)
  if isinstance(param, jax_core.ClosedJaxpr):
    jaxpr = fn(param.jaxpr)
    return param if jaxpr is param.jaxpr else param.replace(jaxpr=jaxpr)
  if isinstance(param, jax_core.Jaxpr):
    return fn(param)
  return param


def _level(eqn: jax_core.JaxprEqn, outer: Level) -> Level:
  """The level inside `eqn`: `outer`, and a scan's trips (one trip runs as XLA counts it)."""
  if eqn.primitive.name == "scan" and eqn.params["length"] > 1:
    return (*outer, int(eqn.params["length"]))
  return outer


def scan_levels(jaxpr: jax_core.Jaxpr, outer: Level = ()) -> dict[Level, int]:
  """{level: its scans} of a jaxpr's scans of 2 or more trips, nested jaxprs included."""
  found: collections.Counter = collections.Counter()
  for eqn in jaxpr.eqns:
    inner = _level(eqn, outer)
    found[inner] += inner != outer
    for param in eqn.params.values():
      for sub in _sub_jaxprs(param):
        found.update(scan_levels(sub, inner))
  return {level: count for level, count in found.items() if count}


def _fenced(body: Any) -> Any:
  """A scan's `body` (a jaxpr, closed or not) with its inputs passed through an optimization
  barrier: unrolled, a trip is not merged with the code around it, as the loop kept them apart."""
  closed = body if isinstance(body, jax_core.ClosedJaxpr) else jax_core.ClosedJaxpr(body, ())
  run = jax_core.jaxpr_as_fun(closed)
  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
           for v in closed.jaxpr.invars]
  fenced = jax.make_jaxpr(lambda *args: run(*jax.lax.optimization_barrier(args)))(*specs)
  if isinstance(body, jax_core.ClosedJaxpr):
    return fenced
  if fenced.consts:
    raise AssertionError("A scan's body fenced with constants.")
  return fenced.jaxpr


def per_body(level: Level, levels: Iterable[Level]) -> int:
  """The trips a variant runs per body for the scans of `level` among `levels`: all of them for
  the innermost; for a level around others, the smallest divisor that leaves a loop of 2 or
  more trips (4: 2, 9: 3), else all of them."""
  trips = level[-1]
  if not any(len(l) > len(level) and l[:len(level)] == level for l in levels):
    return trips
  return next((d for d in range(2, trips // 2 + 1) if trips % d == 0 and trips // d >= 2),
              trips)


def unrolled(jaxpr: jax_core.Jaxpr, level: Level, per_trip: int,
             outer: Level = ()) -> jax_core.Jaxpr:
  """`jaxpr` with the scans of `level` running `per_trip` trips per body (jax's `unroll`); with
  all of them (no loop left), each behind an optimization barrier (`_fenced`). The same object
  where nothing changed."""
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    inner = _level(eqn, outer)
    params = {key: _map_jaxprs(value, lambda sub, inner=inner: unrolled(sub, level, per_trip,
                                                                        inner))
              for key, value in eqn.params.items()}
    if inner == level and inner != outer:
      params["unroll"] = per_trip
      if per_trip == level[-1]:
        params["jaxpr"] = _fenced(params["jaxpr"])
    if any(params[key] is not value for key, value in eqn.params.items()):
      eqn, changed = eqn.replace(params=params), True
    eqns.append(eqn)
  return jaxpr.replace(eqns=eqns) if changed else jaxpr


@dataclasses.dataclass(frozen=True)
class Loop:
  """The `scans` of one `level` (a layer scan's forward and its transpose: 2) and one trip of
  their bodies' cost (`flops.COST_KEYS`, the levels inside counted once)."""
  level: Level
  scans: int
  body: dict[str, float]

  @property
  def runs(self) -> int:
    """How many times a body of this level runs in a step."""
    return math.prod(self.level)


@dataclasses.dataclass(frozen=True)
class StepCost:
  """One device's cost of a compiled step (`flops.COST_KEYS`): `total` with each loop's body
  counted as many times as it runs, `once` as XLA counts it; the `loops`, the `compile_seconds`
  of the variants, and why a figure is missing from `total` ('' when none is)."""
  total: dict[str, float]
  once: dict[str, float]
  loops: tuple[Loop, ...] = ()
  compile_seconds: float = 0.0
  missing: str = ""

  @property
  def seconds(self) -> Optional[float]:
    """The estimated step time, seconds (None: the compiler gave none, `missing` says why)."""
    return self.total.get(SECONDS)

  def describe_loops(self) -> str:
    """How the loops were counted, e.g. '2 scans x 12 inside 1 scan x 4; 1 scan x 4', or
    'no loops'."""
    if not self.loops:
      return "no loops"
    parts = []
    for loop in sorted(self.loops, key=lambda l: (-len(l.level), l.level)):
      around = " inside " + " inside ".join(f"x {n}" for n in reversed(loop.level[:-1]))
      parts.append(f"{loop.scans} scan{'s' * (loop.scans > 1)} x {loop.level[-1]}"
                   + (around if len(loop.level) > 1 else ""))
    return "; ".join(parts)


def _total(once: dict[str, float], loops: tuple[Loop, ...], key: str) -> float:
  bodies = {loop.level: loop.body[key] for loop in loops}
  total = once[key]
  for level, body in bodies.items():
    inner = sum(b for l, b in bodies.items() if len(l) == len(level) + 1 and l[:-1] == level)
    total += (math.prod(level) - 1) * max(body - inner, 0.0)
  return total


def step_cost(compiled: Any, traced: jax_core.ClosedJaxpr,
              compile_fn: Callable[[jax_core.ClosedJaxpr], Any]) -> StepCost:
  """The `StepCost` of `compiled`, the step `traced` (its jaxpr: `jax.make_jaxpr`), whose
  variants `compile_fn` compiles as the step was (one per level). A variant the compiler
  refuses for memory leaves the totals out (`missing` says so). Raises as `compile_fn`."""
  once = flops.compiled_cost(compiled)
  levels = scan_levels(traced.jaxpr)
  loops = []
  start = time.perf_counter()
  for level in sorted(levels):
    per_trip = per_body(level, levels)
    try:
      variant = compile_fn(traced.replace(jaxpr=unrolled(traced.jaxpr, level, per_trip)))
    except Exception as e:  # pylint: disable=broad-except
      if not topology.is_out_of_memory(e):
        raise
      return StepCost({}, once, tuple(loops), time.perf_counter() - start, (
          f"the step with the scans x {level[-1]} running {per_trip} trips per body, compiled "
          "to measure one, does not fit the HBM"))
    cost = flops.compiled_cost(variant)
    loops.append(Loop(level, levels[level], {key: (cost[key] - once[key]) / (per_trip - 1)
                                             for key in once if key in cost}))
  loops_t = tuple(loops)
  total = {key: _total(once, loops_t, key) for key in once
           if all(key in loop.body for loop in loops_t)}
  missing = ""
  if SECONDS not in once:
    missing = "the TPU compiler gave no estimate of the step's time"
  elif SECONDS not in total:
    missing = "the TPU compiler gave no estimate of a variant's time (more trips per body)"
  return StepCost(total, once, loops_t, time.perf_counter() - start, missing)
