"""What a run costs: wall time by category, TPU-core-days (the ViT paper's Table 2 unit), FLOPs
and MFU, over all attempts of a resumed run (docs/compute_cost.md); devices' facts: `hardware`."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import timeit
from typing import Any, Callable, Iterator, Optional

from absl import logging
import jax
import jax.numpy as jnp

from vit_jax import flops
from vit_jax import hardware as hardware_lib

SECONDS_PER_DAY = flops.SECONDS_PER_DAY

#: The wall-time categories; 'other' is the program's time outside them.
CATEGORIES = ("train", "compile", "eval", "checkpoint", "input")
_measured_cpu_peak: Optional[float] = None  # See `measure_cpu_peak`.
_MEASURED = "measured: float32 2048^3 matmul"  # A measured CPU peak's `peak_source`.


@dataclasses.dataclass(frozen=True)
class Hardware:
  """`num_devices` (all processes') of jax's `device_kind`: cores and chips (TPU only, else None),
  peak FLOP/s per device for `dtype` (None: unknown) from `peak_source` ('published', 'measured:
  ...', 'given', 'unknown'), of matmuls in `peak_precision` (`vit_jax.hardware.Kind.runs_as`);
  `host`: the CPU a measured peak is of (`vit_jax.hardware.host_cpu`), else None."""
  device_kind: str
  platform: str
  num_devices: int
  cores: Optional[int]
  chips: Optional[int]
  peak_flops_per_device: Optional[float]
  peak_source: str
  dtype: str = "float32"
  peak_precision: Optional[str] = None
  host: Optional[str] = None

  @property
  def unit(self) -> str:
    """What the '-days' figures count: 'core' on TPU, else 'device'."""
    return "core" if self.cores is not None else "device"

  def describe(self) -> str:
    """E.g. '8 x TPU v3 (8 cores, 4 chips), peak 61.5 TFLOP/s per device (bfloat16, published)'."""
    counts = f" ({self.cores} cores, {self.chips} chips)" if self.cores is not None else ""
    precision = self.peak_precision or self.dtype
    what = (self.dtype if precision == self.dtype else
            f"{precision} matmuls, as {self.dtype} runs at JAX's default precision")
    peak = ("peak unknown" if self.peak_flops_per_device is None else
            f"peak {self.peak_flops_per_device / 1e12:.4g} TFLOP/s per device "
            f"({what}; {self.peak_source})")
    return f"{self.num_devices} x {self.device_kind}{counts}, {peak}"


def hardware(device_kind: str, num_devices: int, dtype: str = "float32",
             platform: Optional[str] = None,
             peak_flops_per_device: Optional[float] = None) -> Hardware:
  """The `Hardware` of `num_devices` devices of `device_kind` computing in `dtype` (`platform`:
  jax's `device.platform`, if None the catalogue kind's, else 'unknown'; `peak_flops_per_device`
  overrides the catalogue's). An unknown kind gets no peak, an unknown TPU one core per device."""
  kind = hardware_lib.kind(device_kind)
  platform = platform or (kind.platform if kind else "unknown")
  cores = chips = None
  if platform == "tpu":
    per_device = (kind and kind.cores_per_device) or 1
    cores = num_devices * per_device
    chips = max(1, cores // ((kind and kind.cores_per_chip) or per_device))
  dtype = precision = str(dtype)
  source = "published" if peak_flops_per_device is None else "given"
  if peak_flops_per_device is None and kind is not None:
    peak_flops_per_device = kind.peak.get(dtype)
    precision = kind.runs_as.get(dtype, dtype)
  source = "unknown" if peak_flops_per_device is None else source
  return Hardware(device_kind, platform, num_devices, cores, chips, peak_flops_per_device, source,
                  dtype, precision)


def accelerator(name: str, dtype: str = "bfloat16") -> Hardware:
  """The `Hardware` of an accelerator name ('v3-8', 'a100-8'); raises as `hardware.accelerator`."""
  kind, devices = hardware_lib.accelerator(name)
  return hardware(kind.device_kind, devices, dtype, kind.platform)


def measure_cpu_peak(size: int = 2048, repeats: int = 3, again: bool = False) -> float:
  """Dense float32 FLOP/s of this host's CPU backend (all local devices): the best of `repeats`
  `size`^3 matmuls, measured once per process; `again` measures once more and keeps the highest."""
  global _measured_cpu_peak
  if _measured_cpu_peak is None or again:
    x = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    best = min(timeit.repeat(lambda: matmul(x).block_until_ready(), number=1, repeat=repeats))
    _measured_cpu_peak = max(2 * size**3 / best, _measured_cpu_peak or 0.0)
  return _measured_cpu_peak


def local_hardware(dtype: str = "float32", remeasure: bool = False) -> Hardware:
  """The `Hardware` of all devices of this JAX program (a CPU's peak: `measure_cpu_peak`)."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    peak = measure_cpu_peak(again=remeasure) / jax.local_device_count()
    hw = hardware("cpu", jax.device_count(), dtype, "cpu", peak_flops_per_device=peak)
    return dataclasses.replace(hw, host=hardware_lib.host_cpu(), peak_source=_MEASURED + (
        ", the best of two measurements" if remeasure else ""))
  return hardware(device.device_kind, jax.device_count(), dtype, device.platform)


def _same_measured_cpu(hw: Hardware, recorded: dict[str, Any]) -> bool:
  """Whether `recorded` (hardware or an attempt) has a peak measured on `hw`'s CPU and devices."""
  return (hw.platform == "cpu" and hw.peak_source.startswith("measured") and hw.host is not None
          and recorded.get("platform") == "cpu" and recorded.get("host") == hw.host
          and recorded.get("devices") == hw.num_devices
          and bool(recorded.get("peak_flops_per_device")))


class CostAccountant:
  """A run's compute account: `clock` seconds in `timed` categories (a nested block's time is
  not the enclosing one's) from `start` (default now); `compile_saved()`: this process's compile
  seconds saved by JAX's persistent cache (`vit_jax.step.compile_seconds_saved`)."""

  def __init__(self, hw: Hardware, batch_size: int,
               clock: Callable[[], float] = time.monotonic, start: Optional[float] = None,
               compile_saved: Optional[Callable[[], float]] = None):
    self.hardware = hw
    self.batch_size = batch_size
    self._clock = clock
    self._start = clock() if start is None else start
    self._compile_saved = compile_saved or (lambda: 0.0)
    self._saved_before = self._compile_saved()  # This attempt's count starts here.
    # At the first training step: (seconds since the start, 'other' seconds so far).
    self._first_step: Optional[tuple[float, float]] = None
    self._redone: Optional[dict[str, Any]] = None  # What this resume redoes (`resume`).
    self._seconds = dict.fromkeys(CATEGORIES, 0.0)
    # The open `timed` blocks, outermost first: [category, start time, seconds in children].
    self._open: list[list[Any]] = []
    self._steps = self._start_step = 0
    self._previous: list[dict[str, Any]] = []
    self.flops_per_step: Optional[float] = None  # From XLA's cost analysis of the step.
    self.model_flops_per_step: Optional[float] = None  # Analytic: 3 x forward matmuls.
    # The resumed account's (flops_per_step, model_flops_per_step), until a step compiles.
    self._resumed_flops: tuple[Optional[float], Optional[float]] = (None, None)
    self._remeasured = False  # The measured CPU peak was measured again (see `report`).

  @contextlib.contextmanager
  def timed(self, category: str) -> Iterator[None]:
    """Counts the block's wall time in `category` (KeyError if not in `CATEGORIES`)."""
    if category not in self._seconds:
      raise KeyError(f"Unknown cost category {category!r}; use one of {CATEGORIES}.")
    start = self._clock()
    self._open.append([category, start, 0.0])
    try:
      yield
    finally:
      elapsed = self._clock() - start
      self._seconds[category] += elapsed - self._open.pop()[2]
      if self._open:
        self._open[-1][2] += elapsed

  def seconds(self) -> dict[str, float]:
    """This attempt's seconds per category so far (`CATEGORIES`), the open blocks' included."""
    seconds = dict(self._seconds)
    now = self._clock()
    for i, (category, start, in_children) in enumerate(self._open):
      in_open_child = now - self._open[i + 1][1] if i + 1 < len(self._open) else 0.0
      seconds[category] += now - start - in_children - in_open_child
    return seconds

  def training_seconds(self) -> float:
    """This attempt's seconds in 'train' and 'input': the clock of the throughput and ETA."""
    seconds = self.seconds()
    return seconds["train"] + seconds["input"]

  def count_step(self, steps: int = 1) -> None:
    """Records `steps` optimizer updates; the first ends the set-up (the attempt's `resume_s`)."""
    if self._first_step is None:
      program = self._clock() - self._start
      self._first_step = (program, max(0.0, program - sum(self.seconds().values())))
    self._steps += steps

  def set_step_flops(self, compiled: Optional[float], analytic: Optional[float]) -> None:
    """One step's FLOPs (global batch): XLA's `compiled` count and the `analytic` one of the MFU."""
    self.flops_per_step = compiled
    self.model_flops_per_step = analytic

  def resume(self, report: Optional[dict[str, Any]], start_step: int) -> None:
    """Continues an earlier `report()` from the checkpoint of `start_step`: its attempts and
    (same `batch_size` only) its FLOPs per step until this attempt compiles a step; the steps
    after `start_step` are redone (`redone_steps`)."""
    self._previous = list(report["attempts"]) if report else []
    self._start_step = start_step
    self._redone = redone_steps(self._previous, start_step) if self._previous else None
    recorded = (report or {}).get("hardware", {})
    if _same_measured_cpu(self.hardware, recorded):
      # One run, one CPU peak: measured by its first attempt on this CPU, kept by the others.
      self.hardware = dataclasses.replace(
          self.hardware, peak_flops_per_device=recorded["peak_flops_per_device"],
          peak_source=recorded.get("peak_source") or self.hardware.peak_source)
    self._resumed_flops = (None, None)
    if report and report.get("batch_size") == self.batch_size:
      self._resumed_flops = tuple(
          next((r[key] for r in (report, *reversed(self._previous)) if r.get(key) is not None),
               None)
          for key in ("flops_per_step", "model_flops_per_step"))

  def _attempt(self, step: int) -> dict[str, Any]:
    hw = self.hardware
    seconds = self.seconds()
    program = self._clock() - self._start
    seconds["other"] = max(0.0, program - sum(seconds.values()))
    seconds["program"] = program
    resume_s, setup_s = self._first_step or (None, seconds["other"])
    return {
        "device_kind": hw.device_kind, "platform": hw.platform, "devices": hw.num_devices,
        "cores": hw.cores, "chips": hw.chips, "peak_flops_per_device": hw.peak_flops_per_device,
        "host": hw.host, "start_step": self._start_step, "end_step": step, "steps": self._steps,
        "images": self._steps * self.batch_size, "seconds": seconds,
        "flops_per_step": self.flops_per_step, "model_flops_per_step": self.model_flops_per_step,
        "model_flops": (self.model_flops_per_step or 0.0) * self._steps,
        "resumed": bool(self._previous), "resume_s": resume_s, "redone": self._redone,
        "setup_s": min(setup_s, seconds["other"]),
        "compile_saved_s": max(0.0, self._compile_saved() - self._saved_before),
    }

  def report(self, step: int) -> dict[str, Any]:
    """The account of all attempts so far, JSON-able (docs/compute_cost.md); 'mfu' and 'goodput'
    in 0..1 or None. An attempt above its peak has a wrong peak: a measured CPU peak is measured
    again once, and one still above is left out of the MFU ('mfu_note' says so)."""
    current = self._attempt(step)
    hw = self.hardware
    if (_above_peak(current) and not self._remeasured and hw.platform == "cpu"
        and hw.peak_source.startswith("measured")):
      self._remeasured = True
      again = local_hardware(hw.dtype, remeasure=True)
      if again.peak_flops_per_device > hw.peak_flops_per_device:
        hw = again
      else:
        hw = dataclasses.replace(hw, peak_source=again.peak_source)
      self.hardware = hw
      self._previous = [dict(a, peak_flops_per_device=hw.peak_flops_per_device)
                        if _same_measured_cpu(hw, a) else a for a in self._previous]
      current = self._attempt(step)
    attempts = self._previous + [current]
    seconds = {k: sum(a["seconds"].get(k, 0.0) for a in attempts)
               for k in (*CATEGORIES, "other", "program")}

    def days(part: str, count: str) -> Optional[float]:
      # Unknown only if an attempt without that unit (cores off TPU) worked in that part.
      without = [a for a in attempts if a[count] is None]
      if part == "train":
        worked = any(a["steps"] > 0 for a in without)
      else:
        worked = any(a["seconds"][part] > 0 for a in without)
      if len(without) == len(attempts) or worked:
        return None
      return sum(a["seconds"][part] * (a[count] or 0) for a in attempts) / SECONDS_PER_DAY

    figures = {part: {f"{unit}_days": days(part, unit + "s") for unit in ("device", "core", "chip")}
               for part in ("train", "program")}
    redone = [a["redone"] for a in attempts if a.get("redone")]
    figures["redone"] = {key: _sum_known(r[key] for r in redone if r["steps"])
                         for key in ("device_days", "core_days", "chip_days")}
    figures["productive"] = {
        key: None if None in (lost, figures["train"][key]) else figures["train"][key] - lost
        for key, lost in figures["redone"].items()}
    train_unit_seconds = sum(a["seconds"]["train"] * units(a) for a in attempts)
    images = sum(a["images"] for a in attempts)
    # MFU of the attempts whose peak is known and not exceeded; FLOP/s of all with a peak.
    with_peak = [a for a in attempts if a["peak_flops_per_device"] and a["model_flops_per_step"]]
    above = [a for a in with_peak if _above_peak(a)]
    known = [a for a in with_peak if not _above_peak(a)]
    capacity = sum(a["seconds"]["train"] * a["peak_flops_per_device"] * a["devices"] for a in known)
    train_seconds = sum(a["seconds"]["train"] for a in with_peak)
    flops_per_step, model_flops_per_step = self._resumed_flops
    if self.flops_per_step is not None or self.model_flops_per_step is not None:
      flops_per_step, model_flops_per_step = self.flops_per_step, self.model_flops_per_step
    return {
        "hardware": {"device_kind": hw.device_kind, "platform": hw.platform,
                     "devices": hw.num_devices, "cores": hw.cores, "chips": hw.chips,
                     "unit": hw.unit, "peak_flops_per_device": hw.peak_flops_per_device,
                     "peak_source": hw.peak_source, "peak_precision": hw.peak_precision,
                     "host": hw.host},
        "step": step, "batch_size": self.batch_size, "restarts": len(attempts) - 1,
        "images_seen": images, "seconds": seconds, **figures,
        "flops_per_step": flops_per_step, "model_flops_per_step": model_flops_per_step,
        "model_flops": sum(a["model_flops"] for a in attempts),
        "achieved_flops_per_sec": (sum(a["model_flops"] for a in with_peak) / train_seconds
                                   if train_seconds else None),
        "mfu": (sum(a["model_flops"] for a in known) / capacity) if capacity else None,
        "mfu_note": _above_peak_note(above, len(with_peak)),
        "images_per_sec_per_core": images / train_unit_seconds if train_unit_seconds else None,
        "redone_steps": sum(r["steps"] for r in redone), "goodput": goodput(attempts),
        "resume_seconds": sum(a.get("resume_s") or 0.0 for a in attempts if a.get("resumed")),
        "compile_saved_seconds": sum(a.get("compile_saved_s") or 0.0 for a in attempts),
        "attempts": attempts,
    }


def _sum_known(values) -> Optional[float]:
  """The sum of `values`, None if one is None (0.0 for none)."""
  values = list(values)
  return None if None in values else float(sum(values))


def units(attempt: dict[str, Any]) -> int:
  """The attempt's cores on TPU, else its devices: what the goodput weighs seconds by."""
  return attempt["cores"] or attempt["devices"]


def redone_steps(attempts: list[dict[str, Any]], restored_step: int) -> dict[str, Any]:
  """What a resume from the checkpoint of `restored_step` redoes after `attempts` (oldest
  first): 'steps' after it; their 'seconds' at the rate of 'from_attempt' (1-based: the latest
  attempt that trained) and {device,core,chip}_days (None: unknown; 0 for no steps)."""
  steps = max(0, attempts[-1]["end_step"] - restored_step)
  index = next((i for i in reversed(range(len(attempts))) if attempts[i]["steps"] > 0), None)
  rated = None if index is None else attempts[index]
  if not steps:
    seconds = 0.0
  elif rated is None:
    seconds = None
  else:
    seconds = steps * rated["seconds"]["train"] / rated["steps"]

  def days(count: str) -> Optional[float]:
    if not steps:
      return 0.0
    number = rated and rated[count]
    return None if seconds is None or number is None else seconds * number / SECONDS_PER_DAY

  return {"steps": steps, "seconds": seconds, "from_attempt": None if index is None else index + 1,
          **{f"{unit}_days": days(unit + "s") for unit in ("device", "core", "chip")}}


def goodput(attempts: list[dict[str, Any]]) -> Optional[float]:
  """Productive training / all program time, each second weighed by its attempt's cores (devices
  off TPU): productive = training steps' seconds less those of steps redone later."""
  program = sum(a["seconds"]["program"] * units(a) for a in attempts)
  lost = sum((a["redone"]["seconds"] or 0.0) * units(attempts[a["redone"]["from_attempt"] - 1])
             for a in attempts if a.get("redone") and a["redone"]["from_attempt"])
  train = sum(a["seconds"]["train"] * units(a) for a in attempts)
  return max(0.0, train - lost) / program if program > 0 else None


def _above_peak(attempt: dict[str, Any]) -> bool:
  """Whether an attempt's model FLOP/s per device exceed its peak (which is then wrong)."""
  peak = attempt["peak_flops_per_device"]
  seconds = attempt["seconds"]["train"]
  return bool(peak and seconds and attempt["model_flops"] > peak * seconds * attempt["devices"])


def _above_peak_note(above: list[dict[str, Any]], with_peak: int) -> Optional[str]:
  """Why the MFU leaves out the attempts `above` their peak (of `with_peak` with one)."""
  if not above:
    return None
  last = above[-1]
  achieved = last["model_flops"] / (last["seconds"]["train"] * last["devices"])
  which = ("MFU unknown" if len(above) == with_peak else
           f"MFU of the other attempts ({len(above)} of {with_peak} left out)")
  why = ("peak measured (a busy, shared CPU measures its peak low)" if last["platform"] == "cpu"
         else f"published peak of {last['device_kind']} (a FLOP count or the table is wrong)")
  return (f"{which}: {achieved / 1e9:.3g} GFLOP/s per device achieved, above the "
          f"{last['peak_flops_per_device'] / 1e9:.3g} GFLOP/s {why}")


_NUMBER = (int, float)
_COUNT = int
_MAYBE_NUMBER = (int, float, type(None))
_MAYBE_COUNT = (int, type(None))
#: What the readers of a `report()` use: {key: a type or a tuple of them, {key: ...} of an
#: object, [...] of a list's items}; a key ending in '?' may be missing.
_REDONE = {"steps": _COUNT, "seconds": _MAYBE_NUMBER, "from_attempt": _MAYBE_COUNT,
           **{f"{u}_days": _MAYBE_NUMBER for u in ("device", "core", "chip")}}
_ATTEMPT = {
    "device_kind": str, "platform": str, "devices": _COUNT, "cores": _MAYBE_COUNT,
    "chips": _MAYBE_COUNT, "peak_flops_per_device": _MAYBE_NUMBER, "host?": (str, type(None)),
    "start_step": _COUNT, "end_step": _COUNT, "steps": _COUNT, "images": _COUNT,
    "seconds": {k: _NUMBER for k in (*CATEGORIES, "other", "program")},
    "flops_per_step?": _MAYBE_NUMBER, "model_flops_per_step": _MAYBE_NUMBER,
    "model_flops": _NUMBER, "resumed?": bool, "resume_s?": _MAYBE_NUMBER,
    "redone?": (type(None), _REDONE), "setup_s?": _MAYBE_NUMBER, "compile_saved_s?": _MAYBE_NUMBER,
}
_DAYS = {f"{u}_days": _MAYBE_NUMBER for u in ("device", "core", "chip")}
REPORT_SHAPE = {
    "hardware": {"device_kind": str, "unit": str}, "step": _COUNT, "batch_size": _COUNT,
    "restarts": _COUNT, "seconds": {"program": _NUMBER}, "train": _DAYS, "program": _DAYS,
    "redone?": _DAYS, "productive?": _DAYS, "flops_per_step?": _MAYBE_NUMBER,
    "model_flops_per_step?": _MAYBE_NUMBER, "goodput?": _MAYBE_NUMBER,
    "redone_steps?": _COUNT, "resume_seconds?": _NUMBER, "compile_saved_seconds?": _NUMBER,
    "attempts": [_ATTEMPT],
}


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               type(None): "null"}


def _shape_problem(value: Any, shape: Any, where: str = "") -> Optional[str]:
  """Where `value` differs from `shape` (of `REPORT_SHAPE`'s form), e.g. "attempts[0].steps is
  'x', not an integer", or None."""
  label = where or "it"
  if isinstance(shape, list):
    if not isinstance(value, list):
      return f"{label} is {repr(value)[:40]}, not a list"
    return next(filter(None, (_shape_problem(v, shape[0], f"{where}[{i}]")
                              for i, v in enumerate(value))), None)
  if isinstance(shape, dict):
    if not isinstance(value, dict):
      return f"{label} is {repr(value)[:40]}, not an object"
    for key, inner in shape.items():
      name = key.rstrip("?")
      if name in value:
        inner_where = f"{where}.{name}" if where else name
        problem = _shape_problem(value[name], inner, inner_where)
        if problem:
          return problem
      elif not key.endswith("?"):
        return f"{where}.{name} is missing" if where else f"{name} is missing"
    return None
  shapes = shape if isinstance(shape, tuple) else (shape,)
  types = tuple(s for s in shapes if isinstance(s, type))
  if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
    return None
  objects = [s for s in shapes if isinstance(s, dict)]
  if objects and isinstance(value, dict):
    return _shape_problem(value, objects[0], where)
  names = [_TYPE_NAMES[t] for t in types if not (t is int and float in types)]
  return f"{label} is {repr(value)[:40]}, not {' or '.join(names + ['an object'] * bool(objects))}"


def check_report(report: Any, name: Any, fix: str = "restore it or delete it") -> dict[str, Any]:
  """`report` when it has `REPORT_SHAPE` (its attempts' references to each other in range).
  Raises ValueError naming `name` (the file), the field and `fix`."""
  problem = _shape_problem(report, REPORT_SHAPE)
  if problem is None:
    count = len(report["attempts"])
    problem = next((f"attempts[{i}].redone.from_attempt is {a['redone']['from_attempt']}, not 1 "
                    f"to {count}" for i, a in enumerate(report["attempts"])
                    if a.get("redone") and a["redone"]["from_attempt"] is not None
                    and not 1 <= a["redone"]["from_attempt"] <= count), None)
  if problem is None and report["hardware"]["unit"] not in ("core", "device"):
    problem = f"hardware.unit is {report['hardware']['unit']!r}, not 'core' or 'device'"
  if problem is not None:
    raise ValueError(f"{name} is not a cost account of python -m vit_jax.main ({problem}); {fix}.")
  return report


def latest_report(from_checkpoint: Optional[dict[str, Any]],
                  from_disk: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
  """The account to continue: the checkpoint's, or cost.json's if it holds more program time; one
  of another shape (`check_report`: hand-edited) is left out with a warning."""
  candidates = []
  for name, report in (("The checkpoint's cost item", from_checkpoint), ("cost.json", from_disk)):
    try:
      if report and check_report(report, name, "it is left out of the account")["attempts"]:
        candidates.append(report)
    except ValueError as e:
      logging.warning("%s", e)
  return max(candidates, key=lambda r: r["seconds"]["program"], default=None)


def scalars(report: dict[str, Any]) -> dict[str, float]:
  """TensorBoard scalars of a `report()`: 'cost/<name>' for every figure that is known."""
  out = {f"cost/{part}_{unit}": report[part][unit]
         for part in ("train", "program", "redone", "productive")
         for unit in ("core_days", "chip_days", "device_days") if report[part][unit] is not None}
  out.update({f"cost/seconds_{k}": v for k, v in report["seconds"].items()})
  return out | {f"cost/{key}": float(report[key]) for key in (
      "mfu", "images_per_sec_per_core", "achieved_flops_per_sec", "flops_per_step",
      "model_flops_per_step", "restarts", "images_seen", "goodput", "redone_steps",
      "resume_seconds", "compile_saved_seconds") if report[key] is not None}


def summary(report: dict[str, Any]) -> str:
  """One progress line, e.g. 'cost: 12.0 TPU v3 core-days (11.2 training), MFU 38.1%, ...'."""
  unit = report["hardware"]["unit"]
  kind = report["hardware"]["device_kind"]
  program = report["program"][f"{unit}_days"]
  train = report["train"][f"{unit}_days"]
  note = report.get("mfu_note")
  if report["mfu"] is not None:
    mfu = f"MFU {report['mfu']:.1%}"
  elif note:
    mfu = note
  else:
    mfu = "MFU unavailable"
  rate = report["images_per_sec_per_core"]
  rate = "" if rate is None else f", {rate:,.1f} images/s/{unit}"
  split = ", ".join(f"{k} {report['seconds'][k]:.0f}" for k in (*CATEGORIES, "other"))
  value = report.get("goodput")
  good = "" if value is None else f", goodput {value:.1%}"
  if report.get("redone_steps"):
    good += f" ({report['redone_steps']} step(s) redone)"
  return (f"cost: {program:.4g} {kind} {unit}-days ({train:.4g} in training steps), {mfu}"
          f"{rate}, {report['restarts']} restart(s){good}; seconds: {split}")


def duration(seconds: float) -> str:
  """'1 h 05 min', '5 min 20 s', '12 s'."""
  seconds = int(round(seconds))
  if seconds >= 3600:
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
  return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"
