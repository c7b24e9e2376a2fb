"""A Cloud TPU slice as compile-only devices (its topology, hosts and HBM) without a TPU: libtpu
(the `tpu` extra) describes any topology (`jax.experimental.topologies.get_topology_desc`), and
the real TPU compiler compiles for it. Accelerator names and sizes: `vit_jax.hardware`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp

from vit_jax import accounting
from vit_jax import hardware as hardware_lib

INSTALL_LINE = "pip install -e '.[tpu]'  (in the checkout)"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

# Keeps libtpu from looking for a TPU host of its own and from taking the per-host TPU lock, so
# that several pre-flights (or one beside a run on a TPU VM) compile at once; set where unset.
_QUIET_LIBTPU = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v3-8",
                 "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


class MissingLibtpuError(RuntimeError):
  """libtpu is not installed: no TPU compiler on this host."""

  def __init__(self):
    super().__init__(f"libtpu is not installed, so there is no TPU compiler here. Install it "
                     f"with: {INSTALL_LINE}")


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice ('v3-8', topology 'v3:2x2'), or `num_slices` of them joined by DCN: the
  compile-only devices of all, and the HBM (bytes) the compiler gives a program on one."""
  accelerator: str  # One slice's type.
  topology: str  # One slice's.
  hardware: accounting.Hardware
  devices: tuple[Any, ...]
  num_hosts: int  # Of all slices.
  hbm_bytes: int
  num_slices: int = 1

  def describe(self) -> str:
    """E.g. 'v3-8 (topology v3:2x2): 8 devices of TPU v3 on 1 host, 15.48 GiB of HBM each ...'."""
    hosts = f"{self.num_hosts} host{'s' if self.num_hosts > 1 else ''}"
    if self.num_slices == 1:
      what, all_of = f"{self.accelerator} (topology {self.topology})", ""
    else:
      what = (f"{self.num_slices} slices of {self.accelerator} (topology {self.topology} each, "
              "joined by DCN)")
      all_of = " in all"
    return (f"{what}: {len(self.devices)} devices of {self.hardware.device_kind} on {hosts}"
            f"{all_of}, {self.hbm_bytes / hardware_lib.GIB:.2f} GiB of HBM each for a program")


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * _UNITS[unit.upper()])


def parse_refusal(message: str) -> tuple[Optional[int], Optional[int]]:
  """(required, available) bytes in the TPU compiler's out-of-memory message ("... required for
  HLO temporaries (20.42G) exceeds available HBM (15.48G)" or "Used 17.43G of 15.48G hbm"; G is
  GiB), each None where absent."""
  number = r"([\d.]+)\s*([KMGT]?)i?B?"
  required = (re.search(rf"required for [\w ]+\({number}\)", message) or
              re.search(rf"Used {number} of", message))
  available = (re.search(rf"available HBM \({number}\)", message) or
               re.search(rf"Used [\d.]+\s*[KMGT]?i?B? of {number} hbm", message))
  return (_bytes(*required.groups()) if required else None,
          _bytes(*available.groups()) if available else None)


def is_out_of_memory(error: Exception) -> bool:
  """Whether a compile failed because the program's temporaries exceed the HBM."""
  return "RESOURCE_EXHAUSTED" in str(error) or "Ran out of memory" in str(error)


def available_hbm(device: Any) -> int:
  """The HBM of `device` the TPU compiler gives one program, bytes: read from its refusal of a
  2 TiB sort ("... exceeds available HBM (15.48G)"). RuntimeError when it says no figure."""

  def huge(x):
    rows = jax.lax.broadcasted_iota(jnp.float32, (2**16, 2**22), 1) * x
    return jnp.sort(rows, axis=-1)[:, 0].sum()

  spec = jax.ShapeDtypeStruct((), jnp.float32,
                              sharding=jax.sharding.SingleDeviceSharding(device))
  try:
    jax.jit(huge).lower(spec).compile()
  except Exception as e:  # pylint: disable=broad-except
    available = parse_refusal(str(e))[1]
    if available:
      return available
    raise RuntimeError(f"The TPU compiler gave no HBM figure: {str(e)[:300]}") from e
  raise RuntimeError("The TPU compiler accepted a 2 TiB program; cannot read its HBM.")


def chip_grid(chips: int, three_d: bool) -> tuple[int, ...]:
  """The chip grid of a slice: 2-D, the squarest power-of-two grid (32 -> 4x8); 3-D, from 2x2x1
  each doubling doubles the last axis smaller than the next, else z (32 -> 2x4x4); other sizes
  2x2xN up to 64 chips, then 4x4xN."""
  if not three_d:
    x = 2 ** (int(math.log2(chips)) // 2) if chips & (chips - 1) == 0 else 1
    return (x, chips // x)
  if chips & (chips - 1) == 0:
    grid = [2, 2, 1] if chips >= 4 else [1, 1, chips]
    while math.prod(grid) < chips:
      smaller = [i for i in (1, 0) if grid[i] < grid[i + 1]]
      grid[smaller[0] if smaller else 2] *= 2
    return tuple(grid)
  side = 2 if chips <= 64 else 4
  return (side, side, chips // (side * side))


def tpu_slice(accelerator: str, num_slices: int = 1) -> Slice:
  """The compile-only devices of a Cloud TPU slice, e.g. `tpu_slice('v3-32')`, or of
  `num_slices` such slices (multi-slice over DCN: each device's `slice_index` says which).
  Raises ValueError (not a TPU slice that exists, `num_slices` < 1) or MissingLibtpuError."""
  if not isinstance(num_slices, int) or num_slices < 1:
    raise ValueError(f"{num_slices!r} slices: give a positive number of slices "
                     "(--config.mesh.dcn_data).")
  hardware = accounting.accelerator(accelerator, "bfloat16")  # Raises for a bad name.
  kind = hardware_lib.kind(hardware.device_kind)
  if kind.topology is None:
    raise ValueError(f"Pre-flight compiles for TPUs; {accelerator!r} is not a Cloud TPU type "
                     "(e.g. v3-8, v4-32, v5p-8, v5litepod-16, v6e-8).")
  if importlib.util.find_spec("libtpu") is None:
    raise MissingLibtpuError()
  grid = chip_grid(hardware.chips, kind.grid_3d)
  name = f"{kind.topology}:{'x'.join(str(n) for n in grid)}"
  options: dict[str, Any] = {}
  if kind.cores_per_device > 1:
    options["chip_config_name"] = "megacore"
  if kind.counts == "chips" and not hardware_lib.is_multi_host_slice(accelerator):
    options["chips_per_host_bounds"] = (*grid, 1)  # One host holds the whole slice.
  for key, value in _QUIET_LIBTPU.items():
    os.environ.setdefault(key, value)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top  (after the env)
  if num_slices > 1:
    options["num_slices"] = num_slices
  devices = tuple(topologies.get_topology_desc(name, "tpu", **options).devices)
  if len(devices) != hardware.num_devices * num_slices:
    raise AssertionError(f"{accelerator}: libtpu's topology {name} x {num_slices} has "
                         f"{len(devices)} devices, expected {hardware.num_devices * num_slices}.")
  num_hosts = len({d.process_index for d in devices})  # Distinct across slices too.
  return Slice(accelerator, name, hardware, devices, num_hosts, available_hbm(devices[0]),
               num_slices)
