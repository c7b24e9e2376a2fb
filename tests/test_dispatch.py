"""How the blocks run, chosen from the target devices (vit_jax.dispatch): the attention
implementation and the remat policy."""

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


def test_auto_remat_policy_keeps_less_of_float32_and_wide_models_on_accelerators():
  """'auto' keeps all the projections' outputs in 16-bit below ViT-L's width (or where the
  memory is the host's), only q, k, v at twice those bytes, only block inputs at four times."""
  choose = lambda devices, dtype, width=768: dispatch.choose_remat_policy(
      "auto", devices=devices, dtype=dtype, width=width).implementation
  assert choose(TPU8, "bfloat16") == choose(GPU, "float16") == "dots_and_attention_saveable"
  assert choose(TPU8, "float32") == choose(GPU, "float32") == "qkv_saveable"
  assert choose(TPU8, "bfloat16", 1024) == choose(GPU, "float16", 1280) == "qkv_saveable"
  assert choose(TPU8, "float32", 1024) == choose(GPU, "float32", 1664) == "nothing_saveable"
  assert choose(CPU, "float32", 1024) == choose(CPU, "bfloat16") == "dots_and_attention_saveable"
  requested = dispatch.choose_remat_policy("dots_saveable", devices=TPU8, dtype="float32")
  assert (requested.implementation, requested.reason) == ("dots_saveable", "requested")
  with pytest.raises(ValueError, match=r"remat_policy='most' is not one of \('auto', "):
    dispatch.choose_remat_policy("most", devices=TPU8)
