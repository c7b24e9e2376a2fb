"""The choice of the attention implementation from the target devices (vit_jax.dispatch)."""

import dataclasses

import pytest

from vit_jax import dispatch
from vit_jax.kernels import cpu_attention


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  platform: str


TPU8 = [FakeDevice("tpu")] * 8
GPU = [FakeDevice("gpu")]
CPU = [FakeDevice("cpu")]


def _choose(requested="auto", devices=CPU, dtype="float32", head_dim=64, dropout=False):
  return dispatch.choose_attention(requested, devices=devices, dtype=dtype, head_dim=head_dim,
                                   dropout=dropout)


def test_auto_follows_the_target_devices_not_the_host():
  # This host is a CPU, yet a TPU mesh gets XLA's attention, never the CPU kernel.
  assert _choose(devices=TPU8).implementation == "xla"
  assert _choose(devices=GPU, dtype="bfloat16").implementation == "cudnn"
  assert _choose(devices=GPU, dtype="float32").implementation == "xla"
  assert _choose(devices=GPU, dtype="bfloat16", dropout=True).implementation == "xla"
  several = _choose(devices=CPU * 2)
  assert several.implementation == "xla" and "SPMD partitioner" in several.reason


@pytest.mark.parametrize("changes,why", [
    (dict(dtype="bfloat16"), "float32 only"),
    (dict(head_dim=24), "head size 24 is not a multiple of 16"),
    (dict(dropout=True), "attention dropout"),
])
def test_auto_on_one_cpu_keeps_xla_where_the_kernel_cannot_run(changes, why):
  choice = _choose(**changes)
  assert choice.implementation == "xla" and why in choice.reason


def test_auto_on_one_cpu_takes_the_kernel_only_where_it_is_faster():
  built = cpu_attention.library()[0] is not None
  faster, why = cpu_attention.faster_than_xla() if built else (False, "")
  choice = _choose()
  assert choice.implementation == ("cpu_kernel" if built and faster else "xla")
  if built:
    assert why in choice.reason


def test_a_requested_implementation_that_cannot_run_is_refused():
  with pytest.raises(ValueError, match="'cpu_kernel' cannot run: the devices are TPUs"):
    _choose("cpu_kernel", devices=TPU8)
  with pytest.raises(ValueError, match="'cudnn' cannot run: the devices are not GPUs"):
    _choose("cudnn", devices=CPU)
  with pytest.raises(ValueError, match="needs bfloat16 or float16"):
    _choose("cudnn", devices=GPU)
  with pytest.raises(ValueError, match="is not one of"):
    _choose("flash")
  assert _choose("xla", devices=GPU).implementation == "xla"
