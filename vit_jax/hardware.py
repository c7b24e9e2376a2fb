"""Every accelerator kind vit_jax knows, one `Kind` each in `KINDS`: add a new kind there.

A JAX device is one TensorCore on TPU v2/v3 (2 per chip), one chip on v4/v5p (2 cores) and
v5e/v6e (1 core), one GPU. Peaks: published dense matmul FLOP/s of a device. HBM per program: the
TPU compiler's figure (docs/pods.md). CPUs have no peak: `vit_jax.accounting` measures one."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
from typing import Mapping, Optional

GIB = 2**30
#: PCI vendor id of Google's TPU chips (what JAX itself looks for in /sys/bus/pci/devices).
GOOGLE_PCI_VENDOR = "0x1ae0"
#: A Cloud TPU slice whose number ('v3-8', 'v4-8', 'v5litepod-8') is at most this has one host.
SINGLE_HOST_SLICE = 8


@dataclasses.dataclass(frozen=True)
class Kind:
  """One accelerator kind; TPU-only fields are None elsewhere."""
  device_kind: str  # jax's `device.device_kind`, e.g. 'TPU v3', 'NVIDIA A100'.
  pattern: str  # Matched against jax's `device_kind`; the first kind matching wins.
  peak: dict[str, float]  # Dense FLOP/s of one JAX device, by compute dtype.
  runs_as: dict[str, str] = dataclasses.field(default_factory=dict)  # A peak's precision.
  cores_per_device: Optional[int] = None  # TensorCores.
  cores_per_chip: Optional[int] = None
  program_hbm_gib: Optional[float] = None  # HBM the TPU compiler gives a program on a device.
  name: Optional[str] = None  # In accelerator names: 'v3' of 'v3-8', 'a100' of 'a100-8'.
  counts: str = "devices"  # What the number of such a name counts: 'cores', 'chips', 'devices'.
  largest: Optional[int] = None  # The largest Cloud TPU slice, in `counts`.
  topology: Optional[str] = None  # libtpu's topology prefix: 'v5e' of 'v5e:4x4'.
  grid_3d: bool = False  # A 3-D torus: slices of multiples of 8 up to 128, then of 128.

  @property
  def platform(self) -> str:
    return "tpu" if self.cores_per_device else "gpu"


def _tpu(device_kind, pattern, peak, cores_per_device, cores_per_chip, hbm=None, name=None,
         counts="cores", largest=None, topology=None, grid_3d=False):
  return Kind(device_kind, pattern, {"bfloat16": peak, "float32": peak}, {"float32": "bfloat16"},
              cores_per_device, cores_per_chip, hbm, name, counts, largest, topology, grid_3d)


def _gpu(device_kind, pattern, name, float32, half, ampere=True):
  """Ampere and later GPUs also have bfloat16, and run float32 matmuls as TF32."""
  peak = {"float32": float32, "float16": half}
  runs_as = {}
  if ampere:
    peak["bfloat16"] = half
    runs_as["float32"] = "tf32"
  return Kind(device_kind, pattern, peak, runs_as, name=name)


KINDS = (
    _tpu("TPU v2", r"TPU v2", 22.5e12, 1, 2, 7.48, "v2", largest=512, topology="v2"),
    _tpu("TPU v3", r"TPU v3", 61.5e12, 1, 2, 15.48, "v3", largest=2048, topology="v3"),
    _tpu("TPU v4 lite", r"TPU v4 ?lite", 137.5e12, 1, 1),
    _tpu("TPU v4", r"TPU v4", 275e12, 2, 2, 30.75, "v4", largest=4096, topology="v4",
         grid_3d=True),
    _tpu("TPU v5 lite", r"TPU v5 ?lite|TPU v5e", 197e12, 1, 1, 15.75, "v5litepod", "chips", 256,
         "v5e"),
    _tpu("TPU v5p", r"TPU v5p?", 459e12, 2, 2, 95.74, "v5p", largest=12288, topology="v5",
         grid_3d=True),
    _tpu("TPU v6 lite", r"TPU v6 ?lite|TPU v6e", 918e12, 1, 1, 31.25, "v6e", "chips", 256, "v6e"),
    _gpu("Tesla V100", r"V100", "v100", 15.7e12, 125e12, ampere=False),
    _gpu("NVIDIA A100", r"A100", "a100", 156e12, 312e12),
    _gpu("NVIDIA H100", r"H100|GH200", "h100", 494e12, 989e12),
    _gpu("NVIDIA H200", r"H200", "h200", 494e12, 989e12),
    _gpu("NVIDIA L4", r"L4", "l4", 60e12, 121e12),
)


def kind(device_kind: str) -> Optional[Kind]:
  """The first `Kind` whose pattern matches jax's `device_kind`, else None."""
  return next((k for k in KINDS if re.search(k.pattern, device_kind)), None)


def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
  """This host's CPU, e.g. 'Intel(R) Xeon(R) Processor, 2 cores': the model (`cpuinfo`'s first
  'model name', else the machine's architecture) and the cores this process may use."""
  model = ""
  try:
    with open(cpuinfo, encoding="utf-8", errors="replace") as f:
      model = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name") and ":" in line), "")
  except OSError:
    pass
  model = model or f"{os.uname().machine} CPU"
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return f"{model}, {cores} cores"


def tpu_on_host(root: str = "/") -> bool:
  """Whether this host shows a TPU: a PCI device of Google's vendor id, or a TPU device file
  /dev/accel0, 1, ... (TPU v2 to v4; not Linux's /dev/accel/ directory of other accelerators),
  under `root`."""
  for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return bool(glob.glob(os.path.join(root, "dev/accel[0-9]*")))


def tpu_absent(environ: Optional[Mapping[str, str]] = None, root: str = "/") -> bool:
  """Whether JAX would start its TPU backend in vain (with libtpu installed, a page of errors;
  without, one line): `tpu_on_host` is false, no other accelerator's JAX plugin is installed,
  and `environ` (default: this process's) sets neither JAX_PLATFORMS nor JAX_FORCE_TPU_INIT."""
  environ = os.environ if environ is None else environ
  if environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in environ:
    return False
  if tpu_on_host(root):
    return False
  from importlib import metadata  # pylint: disable=g-import-not-at-top  (0.1 s; needed here only)
  plugins = metadata.entry_points(group="jax_plugins")
  return not plugins and importlib.util.find_spec("jax_plugins") is None


def is_multi_host_slice(accelerator_type: str) -> bool:
  """Whether a Cloud TPU type ('v3-32', 'v5litepod-16') names a slice of several hosts."""
  match = re.fullmatch(r"v\d+[a-z]*-(\d+)", accelerator_type.strip().lower())
  return bool(match) and int(match.group(1)) > SINGLE_HOST_SLICE


def program_hbm_bytes(device_kind: str) -> int:
  """HBM bytes one program gets on a device of `device_kind`; ValueError when not known."""
  found = kind(device_kind)
  if found is None or found.program_hbm_gib is None:
    known = ", ".join(k.device_kind for k in KINDS if k.program_hbm_gib)
    raise ValueError(f"No HBM size is known for {device_kind!r}; the known TPUs are {known}.")
  return int(found.program_hbm_gib * GIB)


def accelerator(name: str) -> tuple[Kind, int]:
  """The kind and JAX device count of a Cloud TPU type ('v3-8', 'v5litepod-16') or GPU count
  ('a100-8'); ValueError for an unknown name or a slice that does not exist."""
  match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
  family, count = (match.group(1), int(match.group(2))) if match else (None, 0)
  if family == "v5e":
    raise ValueError(f"Accelerator {name!r}: Cloud TPU calls it v5litepod-{count}.")
  found = next((k for k in KINDS if k.name and k.name == family), None)
  if found and found.platform == "gpu" and count > 0:
    return found, count
  if found and found.platform == "tpu":
    if found.grid_3d:
      valid = count >= 8 and count % (8 if count <= 128 else 128) == 0
      unit = "TensorCores (8, 16, 24, ..., 128, 256, 384, ...)"
    else:
      chips = found.counts == "chips"
      valid = count > 0 and count & (count - 1) == 0 and (count >= 8 or chips and count in (1, 4))
      unit = "chips (1, 4, 8, 16, ...)" if chips else "TensorCores (8, 16, 32, ...)"
    if not valid or count > found.largest:
      raise ValueError(f"Accelerator {name!r} does not exist: the number after '{family}-' "
                       f"counts {unit}, at most {found.largest}; e.g. {family}-8.")
    return found, count // found.cores_per_device if found.counts == "cores" else count
  gpus = ", ".join(f"{k.name}-8" for k in KINDS if k.name and k.platform == "gpu")
  raise ValueError(
      f"Unknown accelerator {name!r}: give a Cloud TPU type such as v3-8, v3-256, v4-32, v5p-8 "
      f"(TensorCores), v5litepod-16 or v6e-8 (chips), or a GPU count: {gpus}.")
