"""The accelerator catalogue (vit_jax.hardware): published figures, HBM, names and slices."""

import pathlib
import re

import pytest

from vit_jax import hardware


def test_v3_is_123_tflops_per_chip_of_2_cores_with_15_48_gib_per_core():
  v3 = hardware.kind("TPU v3")
  assert v3.peak["bfloat16"] * v3.cores_per_chip == 123e12
  assert (v3.cores_per_device, v3.cores_per_chip, v3.program_hbm_gib) == (1, 2, 15.48)
  assert hardware.program_hbm_bytes("TPU v3") == int(15.48 * 2**30)


@pytest.mark.parametrize("device_kind, expected", [
    ("TPU v4", "TPU v4"), ("TPU v4 lite", "TPU v4 lite"), ("TPU v5 lite", "TPU v5 lite"),
    ("TPU v5e", "TPU v5 lite"), ("TPU v5", "TPU v5p"), ("TPU v6e", "TPU v6 lite"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100"), ("NVIDIA GH200 480GB", "NVIDIA H100"),
    ("NVIDIA H200", "NVIDIA H200"), ("Tesla V100-SXM2-16GB", "Tesla V100"),
])
def test_jax_device_kinds_find_their_row(device_kind, expected):
  assert hardware.kind(device_kind).device_kind == expected


def test_every_cloud_tpu_has_its_hbm_topology_and_largest_slice():
  tpus = [k for k in hardware.KINDS if k.name and k.platform == "tpu"]
  assert [k.name for k in tpus] == ["v2", "v3", "v4", "v5litepod", "v5p", "v6e"]
  assert all(k.program_hbm_gib and k.topology and k.largest for k in tpus)
  assert {k.name for k in tpus if k.cores_per_device == 2} == {"v4", "v5p"}  # Megacore.
  assert hardware.kind("TPU v5p").program_hbm_gib == 95.74
  assert hardware.kind("cpu") is None
  with pytest.raises(ValueError, match="No HBM size is known for 'NVIDIA A100'"):
    hardware.program_hbm_bytes("NVIDIA A100")


def test_float32_peaks_are_of_the_precision_it_runs_as():
  a100, v100 = hardware.kind("NVIDIA A100"), hardware.kind("Tesla V100")
  assert (a100.peak["float32"], a100.runs_as) == (156e12, {"float32": "tf32"})
  assert (v100.peak["float32"], v100.runs_as, "bfloat16" in v100.peak) == (15.7e12, {}, False)
  assert hardware.kind("TPU v6e").runs_as == {"float32": "bfloat16"}


@pytest.mark.parametrize("name, device_kind, devices", [
    ("v3-8", "TPU v3", 8), ("v4-32", "TPU v4", 16), ("v5litepod-1", "TPU v5 lite", 1),
    ("v6e-256", "TPU v6 lite", 256), ("l4-2", "NVIDIA L4", 2),
])
def test_accelerator_names(name, device_kind, devices):
  kind, count = hardware.accelerator(name)
  assert (kind.device_kind, count) == (device_kind, devices)


def test_the_launch_scripts_slice_table_agrees_with_the_catalogue():
  """launch/common.sh (sourced by launch/tpu.sh) validates --type with its own table of the
  largest slice per generation, and counts chips for v5litepod and v6e: the catalogue's figures."""
  text = (pathlib.Path(__file__).resolve().parents[1] / "launch" / "common.sh").read_text()
  table = re.search(r"declare -A MAX_TYPE_SIZE=\(([^)]*)\)", text).group(1)
  largest = {gen: int(size) for gen, size in re.findall(r"\[([a-z0-9]+)\]=(\d+)", table)}
  tpus = [k for k in hardware.KINDS if k.name and k.platform == "tpu"]
  assert largest == {k.name: k.largest for k in tpus}
  generations = re.search(r"\^\((v2\|[a-z0-9|]+)\)-", text).group(1).split("|")
  assert sorted(generations) == sorted(k.name for k in tpus)
  chips = re.search(r"\n\s+([a-z0-9 |]+)\) if \(\(size <= 8\)\)", text).group(1)
  assert {g.strip() for g in chips.split("|")} == {k.name for k in tpus if k.counts == "chips"}
  grid_3d = re.search(r"\n\s+([a-z0-9 |]+)\)\n\s+# 3D slices", text).group(1)
  assert {g.strip() for g in grid_3d.split("|")} == {k.name for k in tpus if k.grid_3d}


@pytest.mark.parametrize("accelerator,multi", [
    ("v2-8", False), ("v3-8", False), ("v3-32", True), ("v4-8", False), ("v4-16", True),
    ("v5p-8", False), ("v5p-16", True), ("v5litepod-4", False), ("v5litepod-8", False),
    ("v5litepod-16", True), ("v6e-8", False), ("v6e-16", True), (" V3-32 ", True), ("", False),
    ("a100-8", False), ("cpu", False)])
def test_slices_numbered_past_8_have_several_hosts(accelerator, multi):
  """Cloud TPU's numbers count cores (v2-v5p) or chips (v5e, v6e); a host holds up to 8 of them."""
  assert hardware.is_multi_host_slice(accelerator) is multi
