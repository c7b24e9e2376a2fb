"""vit_jax.tools.preflight (`python -m vit_jax.preflight`): tiny models compiled by libtpu's TPU
compiler for v3 and v4 slices (multi-host included) and for 2 slices over DCN (the collectives
that cross them), an oversized batch refused with a suggestion that fits once applied, and the
command line's exit codes (missing libtpu: 2).

The compile tests need libtpu (`pip install -e '.[tpu]'`, which .ci/run installs) and are
skipped without it; the others run everywhere."""

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from vit_jax import cli
from vit_jax import config as config_lib
from vit_jax import flops
from vit_jax import step
from vit_jax.tools import cost
from vit_jax.tools.preflight import cli as preflight_cli
from vit_jax.tools.preflight import collectives
from vit_jax.tools.preflight import estimate
from vit_jax.tools.preflight import fit
from vit_jax.tools.preflight import search
from vit_jax.tools.preflight import topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
requires_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason=f"libtpu is not installed ({topology.INSTALL_LINE})")

# A ViT of 2 layers, D=32 on 32x32 images (patch 8: 16 patches and the class token).
TINY_VIT = ("configs/vit.py:ti16,cifar10", {
    "data.image_size": 32, "model.patch_size": (8, 8), "model.hidden_size": 32,
    "model.mlp_dim": 64, "model.num_heads": 2, "model.num_layers": 2, "batch_size": 64,
  "total_steps": 20_000})
# T2T-ViT-7's recipe (EMA, drop path) with a 2-block backbone of width 32 on 32x32 images.
TINY_T2T = ("configs/t2t.py:7,cifar10", {
    "data.image_size": 32, "model.token_dim": 16, "model.embed_dim": 32, "model.depth": 2,
    "model.num_heads": 2, "batch_size": 64, "total_steps": 20_000})


def _config(spec_and_overrides, **more):
  spec, overrides = spec_and_overrides
  return fit.with_overrides(cli.load_config_file(os.path.join(ROOT, spec)),
                            {**overrides, **more})


def _flags(spec_and_overrides, **more):
  spec, overrides = spec_and_overrides
  values = {**overrides, **more}
  text = {k: ",".join(map(str, v)) if isinstance(v, tuple) else v for k, v in values.items()}
  return ["--config", spec, *(f"--config.{k}={v}" for k, v in text.items())]


def _preflight(args, env=None):
  return subprocess.run([sys.executable, "-m", "vit_jax.preflight", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300, env=env, check=False)


# ---------------------------------------------------------------- without libtpu


@pytest.mark.parametrize("chips, three_d, grid", [
    (4, False, (2, 2)), (8, False, (2, 4)), (16, False, (4, 4)), (128, False, (8, 16)),
    (4, True, (2, 2, 1)), (8, True, (2, 2, 2)), (32, True, (2, 4, 4)), (64, True, (4, 4, 4)),
    (128, True, (4, 4, 8)), (256, True, (4, 8, 8)), (12, True, (2, 2, 3)),
    (192, True, (4, 4, 12)),
])
def test_chip_grids_are_cloud_tpu_slice_shapes(chips, three_d, grid):
  assert topology.chip_grid(chips, three_d) == grid


def test_the_compilers_refusal_is_read_in_both_forms():
  gib = 2**30
  assert fit.parse_refusal(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
      "temporaries (20.42G) exceeds available HBM (15.48G).") == (int(20.42 * gib),
                                                                    int(15.48 * gib))
  assert fit.parse_refusal("XLA:TPU compile permanent error. Ran out of memory in memory space "
                           "hbm. Used 17.5G of 15.48G hbm.") == (int(17.5 * gib),
                                                                 int(15.48 * gib))
  assert fit.parse_refusal("something else") == (None, None)


def test_candidates_come_in_order_and_keep_earlier_levers():
  resolved = ml_collections.ConfigDict({
      "batch_size": 64, "grad_accum_steps": 1,
      "model": {"dtype": "float32", "remat": True, "remat_policy": "dots_saveable"},
      "mesh": {"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 1}})
  found = list(search.candidates(resolved, num_devices=8, batch_shards=8))
  bf16 = {"model.dtype": "bfloat16"}
  fsdp = {**bf16, "mesh.data": 1, "mesh.fsdp": -1}
  lean = {**fsdp, "model.remat": True, "model.remat_policy": "nothing_saveable"}
  assert found == [
      bf16, {**bf16, "grad_accum_steps": 2}, {**bf16, "grad_accum_steps": 4},
      {**bf16, "grad_accum_steps": 8},
      fsdp, *({**fsdp, "grad_accum_steps": n} for n in (2, 4, 8)),
      lean, *({**lean, "grad_accum_steps": n} for n in (2, 4, 8)),
      {**lean, "batch_size": 32}, {**lean, "batch_size": 16}, {**lean, "batch_size": 8}]


def test_a_step_fits_only_with_its_inputs_in_the_hbm():
  """The compiler checks the temporaries alone; the state and batch are in HBM too."""
  gib = 2**30
  memory = fit.Memory(state={"params": gib, "opt_state": 2 * gib}, batch=gib // 4,
                      temporaries=12 * gib, code=gib // 64, outputs=0)
  accepted = fit.StepCheck("train", True, memory, hbm=int(15.48 * gib))
  assert accepted.needs == memory.total == int((15.25 + 1 / 64) * gib)
  assert accepted.fits and accepted.verdict == ""
  tight = fit.StepCheck("train", True, memory, hbm=15 * gib)
  assert not tight.fits
  assert "accepted its temporaries (12.00 GiB), but with the train state and the batch it " \
         "needs 15.27 GiB of the 15.00 GiB" in tight.verdict
  refused = fit.StepCheck("train", False, fit.Memory(state=memory.state, batch=memory.batch),
                          hbm=15 * gib, required=20 * gib, message="RESOURCE_EXHAUSTED: ...")
  assert not refused.fits and refused.needs == int(23.25 * gib)
  assert refused.verdict == "the train step: RESOURCE_EXHAUSTED: ..."


def test_candidates_keep_dcn_data_and_use_fsdp_within_each_slice():
  resolved = ml_collections.ConfigDict({
      "batch_size": 16, "grad_accum_steps": 1, "model": {"dtype": "bfloat16"},
      "mesh": {"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 2}})
  found = list(search.candidates(resolved, num_devices=8, batch_shards=8))
  fsdp = {"mesh.data": 1, "mesh.fsdp": -1}  # fsdp=4 in each of the 2 slices: 8 batch shards.
  assert found == [{"grad_accum_steps": 2}, fsdp, {**fsdp, "grad_accum_steps": 2},
                   {**fsdp, "batch_size": 8}]


# One slice's program as libtpu compiles it for 2 slices (num_partitions=4): a data-parallel
# all-reduce split into a reduce-scatter in the slice, a megascale transfer of the shard (send
# and recv; 2 x 128 floats), an all-gather; and the same transfer in a loop of 6 - 1 = 5 trips.
_MULTI_SLICE_HLO = """HloModule jit_step, num_partitions=4

%cond (p: (s32[], f32[2,128])) -> pred[] {
  %p = (s32[], f32[2,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[2,128])) -> (s32[], f32[2,128]) {
  %send.2 = (f32[2,128]{1,0:T(2,128)}, u32[], token[]) send(%x, %t), channel_id=3, \
is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
}

ENTRY %main (a: f32[8,128]) -> f32[8,128] {
  %a = f32[8,128]{1,0} parameter(0)
  %rs = f32[2,128]{1,0} reduce-scatter(%a), channel_id=1, replica_groups={{0,1,2,3}}, \
dimensions={0}
  %send = (f32[2,128]{1,0:T(2,128)}, u32[], token[]) send(%rs, %t), channel_id=2, \
is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv = (f32[2,128]{1,0}, u32[], token[]) recv(%t), channel_id=1, is_host_transfer=true, \
frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %ag = f32[8,128]{1,0} all-gather(%rs), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}
  %one = s32[] constant(1)
  %start = s32[] copy(%one)
  %init = (s32[], f32[2,128]) tuple(%start, /*index=1*/%rs)
  %loop = (s32[], f32[2,128]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,128]{1,0} add(%ag, %ag)
}
"""  # A backslash at a line's end continues it.


def test_cross_slice_collectives_are_read_from_the_hlo_text():
  found = collectives.cross_slice(_MULTI_SLICE_HLO, [0, 0, 0, 0, 1, 1, 1, 1])
  assert found == collectives.CrossSlice(count=1 + 5, bytes=6 * 2 * 128 * 4,
                                         kinds={"all-reduce": 6}, exact=True)
  # A program of every slice's devices (num_partitions=8): groups holding devices of both
  # slices cross, explicit ({0,4}: 4 floats) or iota ([4,2]<=[2,4]T(1,0): {0,4},{1,5},...;
  # a reduce-scatter's input is its output x 2), and those within a slice do not.
  whole = "\n".join([
      "HloModule jit_step, num_partitions=8", "ENTRY %main (a: f32[4]) -> f32[4] {",
      "  %x = f32[4]{0} all-reduce(%a), replica_groups={{0,4},{1,5},{2,6},{3,7}}",
      "  %y = f32[2]{0} reduce-scatter(%a), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}",
      "  %z = f32[4]{0} all-reduce(%a), replica_groups=[2,4]<=[8]",
      "  ROOT %w = f32[8]{0} all-gather(%a), replica_groups={{0,1,2,3},{4,5,6,7}}", "}"])
  assert collectives.cross_slice(whole, [0, 0, 0, 0, 1, 1, 1, 1]) == collectives.CrossSlice(
      count=2, bytes=16 + 16, kinds={"all-reduce": 1, "reduce-scatter": 1})
  assert collectives.cross_slice(whole, [0] * 8).count == 0  # One slice: nothing crosses.


def test_not_a_tpu_or_no_such_slice_is_refused():
  with pytest.raises(ValueError, match="not a Cloud TPU type"):
    topology.tpu_slice("a100-8")
  with pytest.raises(ValueError, match="does not exist"):
    topology.tpu_slice("v3-12")
  with pytest.raises(ValueError, match=r"0 slices: give a positive number of slices "
                     r"\(--config\.mesh\.dcn_data\)"):
    topology.tpu_slice("v3-8", num_slices=0)


def test_missing_libtpu_exits_2_with_the_install_line():
  hide = ("import importlib.util as u, runpy, sys; f = u.find_spec; "
          "u.find_spec = lambda n, *a: None if n == 'libtpu' else f(n, *a); "
          "sys.argv = ['vit_jax.preflight'] + sys.argv[1:]; "
          "runpy.run_module('vit_jax.preflight', run_name='__main__')")
  proc = subprocess.run([sys.executable, "-c", hide, *_flags(TINY_VIT), "--accelerator",
                         "v3-8"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 2, proc.stderr
  assert "FATAL: libtpu is not installed" in proc.stderr
  assert "pip install -e '.[tpu]'" in proc.stderr


def test_the_command_line_takes_switches_and_config_overrides():
  """argparse's flags (absl's spellings kept: --noeval, --nosuggest) and main's --config."""
  args, config = cost.parse(preflight_cli._parser(), [  # pylint: disable=protected-access
      "--config", os.path.join(ROOT, TINY_VIT[0]), "--config.model.patch_size=8,8",
      "--accelerator=v3-8", "--nosuggest", "--noeval", "--largest_batch"])
  assert (args.accelerator, args.suggest, args.eval, args.largest_batch) == (
      "v3-8", False, False, True)
  assert config.model.patch_size == (8, 8) and config.is_locked
  args, _ = cost.parse(preflight_cli._parser(), [])  # pylint: disable=protected-access
  assert (args.suggest, args.eval, args.largest_batch) == (True, True, False)
  text = " ".join(preflight_cli._parser().format_help().split())  # pylint: disable=protected-access
  assert "--config.mesh.dcn_data=N the steps are compiled for N such slices" in text
  assert "collectives that cross slices" in text


def _accumulated_layers(w, xs):
  """4 micro-batches (a scan) of a 3-layer scan's gradient; a 1-trip scan; a 5-trip scan."""
  def loss(w, x):
    x, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)
    return x.sum()
  grads, _ = jax.lax.scan(lambda g, x: (g + jax.grad(loss)(w, x), None), jnp.zeros_like(w), xs)
  once, _ = jax.lax.scan(lambda x, _: (x @ w[0], None), xs[0], None, length=1)
  five, _ = jax.lax.scan(lambda x, _: (x @ w[1], None), xs[0], None, length=5)
  return grads, once, five


def _dots(jaxpr, as_xla: bool) -> int:
  """The jaxpr's `dot_general`s as they run (`as_xla=False`) or as XLA's cost analysis counts
  them: a loop's body once, jax's `unroll` putting that many trips in it and running the rest
  after it (2 trips with unroll 2: no loop)."""
  total = 0
  for eqn in jaxpr.eqns:
    runs = 1
    if eqn.primitive.name == "scan":
      length, unroll = eqn.params["length"], int(eqn.params["unroll"])
      trips, rest = divmod(length, unroll)
      if unroll != 1 and trips == 1 and rest == 0:
        trips, rest = 0, length
      runs = (unroll if trips else 0) + rest if as_xla else length
    total += eqn.primitive.name == "dot_general"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "jaxpr") or hasattr(sub, "eqns"):
          total += runs * _dots(getattr(sub, "jaxpr", sub), as_xla)
  return total


class _Counted:
  """A compiled program as a compiler that counts a loop's body once would cost it."""

  def __init__(self, jaxpr, seconds_per_dot=1e-3):
    self.dots = _dots(jaxpr, as_xla=True)
    self.seconds = seconds_per_dot * self.dots

  def cost_analysis(self):
    return {"flops": 10.0 * self.dots, "optimal_seconds": self.seconds}


def test_each_loop_level_is_measured_once_and_counted_as_it_runs():
  """Nested scans (4 micro-batches around a 3-layer scan and its transpose), a 1-trip scan (runs
  as counted) and a 5-trip one (odd: jax runs the last trip after the loop): from a compiler
  that counts a loop's body once, the totals count every body as it runs."""
  traced = jax.make_jaxpr(_accumulated_layers)(jnp.zeros((3, 8, 8)), jnp.zeros((4, 2, 8)))
  assert estimate.scan_levels(traced.jaxpr) == {(4,): 1, (4, 3): 2, (5,): 1}
  variants = []

  def compile_fn(variant):
    variants.append(variant)
    return _Counted(variant.jaxpr)

  cost = estimate.step_cost(_Counted(traced.jaxpr), traced, compile_fn)
  runs, once = _dots(traced.jaxpr, as_xla=False), _dots(traced.jaxpr, as_xla=True)
  assert (runs, once) == (4 * 3 * 3 + 1 + 5, 3 + 1 + 1)  # A layer's forward, 2 in its transpose.
  assert cost.once == {"flops": 10.0 * once, "optimal_seconds": pytest.approx(1e-3 * once)}
  assert cost.total == {"flops": pytest.approx(10.0 * runs),
                        "optimal_seconds": pytest.approx(1e-3 * runs)}
  assert cost.seconds == pytest.approx(1e-3 * runs) and cost.missing == ""
  assert len(variants) == 3 and [loop.level for loop in cost.loops] == [(4,), (4, 3), (5,)]
  assert [loop.runs for loop in cost.loops] == [4, 12, 5]
  assert cost.loops[1].body == {"flops": 30.0, "optimal_seconds": pytest.approx(3e-3)}
  assert cost.describe_loops() == "2 scans x 3 inside x 4; 1 scan x 4; 1 scan x 5"
  # The variants: the innermost level's scans unrolled (3 of 3, behind barriers), a level
  # around others 2 trips per body (a loop of 2 left: not the whole model copied 4 times).
  levels = estimate.scan_levels(traced.jaxpr)
  assert [estimate.per_body(level, levels) for level in sorted(levels)] == [2, 3, 5]
  assert [estimate.per_body((n,), {(n,): 1, (n, 3): 2}) for n in (4, 9, 5, 2, 12)] == [
      2, 3, 5, 2, 2]
  scans = lambda j: sorted((e.params["length"], e.params["unroll"]) for e in j.eqns
                           if e.primitive.name == "scan")
  assert scans(traced.jaxpr) == [(1, 1), (4, 1), (5, 1)]
  assert scans(estimate.unrolled(traced.jaxpr, (4,), 2)) == [(1, 1), (4, 2), (5, 1)]
  fenced = estimate.unrolled(traced.jaxpr, (5,), 5)
  assert scans(fenced) == [(1, 1), (4, 1), (5, 5)]
  body = next(e for e in fenced.eqns if e.params.get("length") == 5).params["jaxpr"]
  assert getattr(body, "jaxpr", body).eqns[0].primitive.name == "optimization_barrier"
  assert estimate.unrolled(traced.jaxpr, (7,), 7) is traced.jaxpr


def test_a_step_without_an_estimate_says_why():
  traced = jax.make_jaxpr(_accumulated_layers)(jnp.zeros((3, 8, 8)), jnp.zeros((4, 2, 8)))

  class NoSeconds(_Counted):
    def cost_analysis(self):  # libtpu's figure for an instruction it cannot price.
      return {"flops": 10.0 * self.dots, "optimal_seconds": -1.0 + self.seconds}

    def as_text(self):
      return 'custom-call(%a), custom_call_target="SomethingElse"'

  cost = estimate.step_cost(_Counted(traced.jaxpr), traced, NoSeconds)
  assert cost.seconds is None and cost.total["flops"] == pytest.approx(10.0 * 42)
  assert cost.missing == ("the TPU compiler gave no estimate of a variant's time (more trips "
                          "per body)")
  assert estimate.step_cost(NoSeconds(traced.jaxpr), traced, _Counted).missing == (
      "the TPU compiler gave no estimate of the step's time")

  def fails(message):
    def compile_fn(variant):
      raise RuntimeError(message)
    return compile_fn

  cost = estimate.step_cost(_Counted(traced.jaxpr), traced, fails(
      "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm."))
  assert cost.total == {} and cost.seconds is None
  assert cost.missing == ("the step with the scans x 4 running 2 trips per body, compiled to "
                          "measure one, does not fit the HBM")
  with pytest.raises(RuntimeError, match="INTERNAL: something else"):
    estimate.step_cost(_Counted(traced.jaxpr), traced, fails("INTERNAL: something else"))


# ---------------------------------------------------------------- with libtpu


# The ViT on a v3-8 is the fast tier's one TPU compile (about 5 s); the rest are slow (T2T-ViT's
# train step takes the TPU compiler 10 to 17 s even this small).
@requires_libtpu
@pytest.mark.parametrize("model, accelerator, devices, hosts", [
    (TINY_VIT, "v3-8", 8, 1),
    pytest.param(TINY_VIT, "v4-16", 8, 2, marks=pytest.mark.slow),
    pytest.param(TINY_T2T, "v3-32", 32, 4, marks=pytest.mark.slow),
    pytest.param(TINY_T2T, "v4-8", 4, 1, marks=pytest.mark.slow)])
def test_tiny_models_compile_for_v3_and_v4_slices_and_fit(model, accelerator, devices, hosts):
  tpu = topology.tpu_slice(accelerator)
  assert (len(tpu.devices), tpu.num_hosts) == (devices, hosts)
  # The compiler's own figure: a little less than a v3 core's 16 GiB, a v4 chip's 32 GiB.
  published = 16 if accelerator.startswith("v3") else 32
  assert published - 1.5 < tpu.hbm_bytes / 2**30 < published
  vit = model is TINY_VIT
  result = fit.check(_config(model), tpu, eval_step=vit)  # T2T-ViT: the train step alone.
  assert result.fits and result.train.fits and (result.eval.fits if vit else not result.eval)
  assert result.config.model.attention == "xla"  # Chosen for the TPU, not this CPU.
  # Data parallelism: parameters and Adam's two moments replicated, the batch split.
  params = result.parameter_bytes
  train = result.train.memory
  assert result.replicated_fraction == 1.0
  assert train.state["params"] == params and train.state["opt_state"] >= 2 * params
  assert result.batch_per_host == 64 // hosts and result.batch_per_device == 64 // devices
  assert train.batch == 64 // devices * (32 * 32 * 3 + result.config.num_classes) * 4
  assert 0 < train.temporaries and train.total < tpu.hbm_bytes
  if vit:
    assert result.eval.memory.temporaries < train.temporaries  # No backward pass.
  else:
    assert train.state["ema_params"] == params  # The recipe's EMA is part of the state.
  macs = flops.model_forward_macs(step.create_model(result.config), (32, 32, 3))
  assert result.train_flops == 6 * macs * 64
  report = preflight_cli.format_result(result)  # What the command line prints.
  for row in ("parameters", "optimizer state", "batch", "temporaries", "total", "compile time"):
    assert f"\n{row} " in report
  assert f"{64 // hosts} per host x {hosts} = {64 // devices} per device" in report


# A ViT wide enough for its layers to be most of the step (D=128, 65 tokens, 16 images a chip).
LAYERED = {"data.image_size": 64, "model.hidden_size": 128, "model.mlp_dim": 512,
           "model.num_heads": 4}


@functools.lru_cache(maxsize=None)
def _layers_on_v4_8(layers: int, scan: bool) -> fit.Result:
  """LAYERED's train step estimated on a v4-8 (4 chips), compiled once per test session."""
  return fit.check(_config(TINY_VIT, **LAYERED, **{"model.num_layers": layers,
                                                   "model.scan": scan}),
                   topology.tpu_slice("v4-8"), eval_step=False, estimate=True)


@pytest.mark.slow  # Four TPU compiles: 28-42 core-s.
@requires_libtpu
def test_the_estimate_of_4_scanned_layers_is_twice_2_layers():
  """The scanned layers' body (forward and backward) measured by a second compile (the layers
  unrolled) and counted as many times as it runs; the compiler's own figure of the scanned
  step, which counts the body once, is not twice."""
  two, four = (_layers_on_v4_8(n, True) for n in (2, 4))
  cost = four.train.cost
  assert 1.6 <= cost.seconds / two.train.cost.seconds <= 2.4
  assert cost.once["optimal_seconds"] / two.train.cost.once["optimal_seconds"] < 1.4
  assert [(l.level, l.scans) for l in cost.loops] == [((4,), 2)]  # Forward, backward.
  assert cost.describe_loops() == "2 scans x 4" and cost.compile_seconds > 0
  assert cost.total["flops"] > 3 * cost.once["flops"]
  speed = four.speed(four.train)
  # A lower bound of the time, at least the analytic FLOPs at the slice's peak.
  assert four.peak_flops == 4 * 275e12
  assert speed.seconds >= four.train_flops / four.peak_flops and 0 < speed.mfu <= 1
  assert speed.mfu == pytest.approx(four.train_flops / (speed.seconds * 4 * 275e12))
  assert speed.images_per_second == pytest.approx(64 / speed.seconds)
  assert (speed.per_chip, speed.per_core) == pytest.approx((64 / speed.seconds / 4,
                                                            64 / speed.seconds / 8))
  report = preflight_cli.format_result(four)
  assert "each loop's body counted as many times as it runs (train step 2 scans x 4;" in report
  for row, value in (("est. step time", f"{speed.seconds * 1e3:.3g} ms"),
                     ("  per core", f"{speed.per_core:,.0f}"), ("est. MFU", f"{speed.mfu:.1%}")):
    assert re.search(rf"\n{re.escape(row)} +{re.escape(value)}\n", report + "\n"), row


@requires_libtpu
@pytest.mark.slow
def test_the_estimate_of_4_unrolled_layers_is_twice_2_layers_and_the_scanned_estimate():
  """Unrolled layers are counted by the compiler as they run: no loops, no second compile;
  4 layers 1.6-2.4 times 2, and within a few percent of the scanned step's estimate."""
  two, four = (_layers_on_v4_8(n, False).train.cost for n in (2, 4))
  assert 1.6 <= four.seconds / two.seconds <= 2.4
  assert four.describe_loops() == "no loops" and four.total == four.once and not four.loops
  scanned = _layers_on_v4_8(4, True).train.cost
  assert scanned.total["flops"] == pytest.approx(four.total["flops"], rel=0.02)
  assert scanned.seconds == pytest.approx(four.seconds, rel=0.15)


@requires_libtpu
@pytest.mark.slow
def test_accumulation_around_the_layers_is_counted_as_it_runs():
  """Two micro-batches of 32 (a scan around the 4 layers' scans) do the work of one batch of 64
  (the 4 scanned layers' step of the tests above, compiled once per session): about its
  estimated time, where the compiler's own figure counts one micro-batch."""
  whole = _layers_on_v4_8(4, True).train.cost
  split = fit.check(_config(TINY_VIT, **LAYERED, **{"model.num_layers": 4},
                            grad_accum_steps=2),
                    topology.tpu_slice("v4-8"), eval_step=False, estimate=True).train.cost
  assert [(l.level, l.scans) for l in split.loops] == [((2,), 1), ((2, 4), 2)]
  assert split.describe_loops() == "2 scans x 4 inside x 2; 1 scan x 2"
  assert 0.8 < split.seconds / whole.seconds < 1.5
  assert split.total["flops"] == pytest.approx(whole.total["flops"], rel=0.1)
  assert split.once["flops"] < 0.7 * whole.total["flops"]


@requires_libtpu
@pytest.mark.slow
def test_the_json_report_gives_the_estimate_that_the_cost_tool_takes(tmp_path, capsys):
  """The pre-flight's main in this process (its exit codes as a program: the test below)."""
  path = tmp_path / "out.json"
  flags = _flags(TINY_VIT, **LAYERED)
  flags = ["--config", os.path.join(ROOT, TINY_VIT[0]), *flags[2:]]
  code = preflight_cli.main([*flags, "--accelerator", "v4-8", "--json", str(path)])
  stdout = capsys.readouterr().out
  assert code == 0, stdout
  assert f"\nWrote {path}\n" in stdout
  report = json.loads(path.read_text())
  assert (report["accelerator"], report["devices"], report["chips"], report["cores"]) == (
      "v4-8", 4, 4, 8)
  assert (report["batch_size"], report["batch_per_device"], report["fits"]) == (64, 16, True)
  train, evaluation = report["steps"]["train"], report["steps"]["eval"]
  seconds = report["estimated_step_seconds"]
  assert seconds == train["estimated_step_seconds"] and evaluation["estimated_step_seconds"] > 0
  flops_per_step = report["flops_per_step"]
  assert seconds >= flops_per_step["analytic"] / report["peak_flops"]
  assert report["mfu"] == pytest.approx(flops_per_step["analytic"] / (seconds * 4 * 275e12))
  assert 0.9 < flops_per_step["compiler"] / flops_per_step["analytic"] < 1.5
  assert train["images_per_second_per_chip"] == pytest.approx(64 / seconds / 4)
  memory = report["memory_per_device"]
  assert memory == train["memory_per_device"]
  assert memory["params"] == report["parameter_bytes"] and memory["total"] < memory["hbm"]
  assert [loop["trips"] for loop in train["loops"]] == [[2]]
  # Remat on (the default): the step without it is compiled too, and where it is estimated
  # faster, its overrides are printed and reported.
  faster = report["faster"]
  assert report["remat_policy"] == "qkv_saveable" and faster["remat_policy"] is None
  assert faster["overrides"]["model.remat"] is False
  assert faster["scan"] == ("model.scan" not in faster["overrides"])
  assert faster["fits"] and faster["estimated_step_seconds"] < seconds
  assert f"\n  {faster['flags']}\nWrote {path}" in stdout
  assert "\nFaster: without remat the train step fits" in stdout
  # The cost of a planned run on a v4-32 at that MFU; another TPU kind's report is refused.
  assert cost.main([*flags, "--accelerator", "v4-32", "--preflight", str(path)]) == 0
  out = capsys.readouterr().out
  assert (f"MFU            {report['mfu']:.1%} (the TPU compiler's estimate of the train step on "
          f"v4-8 at 16 images per device, from {path}; this run has 4 per device)") in out
  assert cost.main([*flags, "--accelerator", "v3-32", "--preflight", str(path)]) == 2
  assert "estimates device_kind 'TPU v4', but this run's TPU kind (v3-32) is 'TPU v3'" in \
      capsys.readouterr().err


@requires_libtpu
def test_two_slices_compile_with_collectives_across_them_and_one_slice_without():
  """The tiny ViT data parallel over 2 v5litepod-4 slices (the trainer's hybrid mesh over
  libtpu's 2-slice topology): the gradient crosses the DCN; on one slice nothing does."""
  tpu = topology.tpu_slice("v5litepod-4", num_slices=2)
  assert (len(tpu.devices), tpu.num_hosts, tpu.num_slices) == (8, 2, 2)
  assert sorted(d.slice_index for d in tpu.devices) == [0] * 4 + [1] * 4
  assert tpu.describe().startswith("2 slices of v5litepod-4 (topology v5e:2x2 each, joined by "
                                   "DCN): 8 devices of TPU v5 lite on 2 hosts in all, 15.75 GiB")
  # Width 128: libtpu 0.0.50's compiler refuses the scanned width-32 model's reduce-scatter over
  # slices ("AllReduceScatterFusion not implemented for 2nd-minor compaction"); 0.0.42's takes it.
  # One layer on 16 px (4 patches): the same collectives per layer, a third less compile time.
  small = {"model.num_layers": 1, "data.image_size": 16}
  wide = {"mesh.dcn_data": 2, "model.hidden_size": 128, "model.mlp_dim": 256, **small}
  result = fit.check(_config(TINY_VIT, **wide), tpu)
  assert result.fits and result.batch_per_device == 64 // 8
  train = result.train.cross_slice
  # Each device hands the DCN its shard of the float32 gradient, reduced in its slice first
  # (more here: the compiler pads these tiny tensors).
  assert train.kinds == {"all-reduce": train.count} and train.count > 0 and train.exact
  assert result.parameter_bytes / 4 <= train.bytes < 4 * result.parameter_bytes
  assert 0 < result.eval.cross_slice.count < train.count  # The metrics' sums.
  report = preflight_cli.format_result(result)
  assert "\nslices       2 x v5litepod-4 joined by DCN; the mesh's data axis is 2 slices x 4" \
      in report
  assert (f"\nacross DCN   train step {train.count} collectives (all-reduce x {train.count}), "
          f"{train.bytes / 2**10:.1f} KiB; eval step ") in report
  assert re.search(r"\ntotal +\d+\.\d MiB of 15\.75 GiB", report)  # Per device, as for one.
  # On one slice (the eval step: quicker) the metrics' sums cross nothing; no slice lines.
  one = topology.tpu_slice("v5litepod-4")
  single = fit.check(_config(TINY_VIT, **small), one, train_step=False)
  assert single.fits and single.eval.cross_slice == collectives.CrossSlice()
  assert "across DCN" not in preflight_cli.format_result(single)
  # dcn_data against the slices found: refused (as the trainer does) before compiling.
  with pytest.raises(ValueError, match=r"dcn_data=1 but the 8 devices form 2 slices \(by their "
                     r"slice_index\).*; set config\.mesh\.dcn_data=2\."):
    fit.check(_config(TINY_VIT), tpu)
  with pytest.raises(ValueError, match=r"dcn_data=2 but the 4 devices form 1 slice .*; set "
                     r"config\.mesh\.dcn_data=1\."):
    fit.check(_config(TINY_VIT, **{"mesh.dcn_data": 2}), one)
  # A batch or mesh that 2 slices cannot split: the existing errors, with the slices counted.
  with pytest.raises(ValueError, match=r"batch_size=60 cannot be split into 1 micro-batch\(es\) "
                     r"over 8 batch shard\(s\).*; use config\.batch_size=56 or 64"):
    fit.check(_config(TINY_VIT, batch_size=60, **{"mesh.dcn_data": 2}), tpu)
  with pytest.raises(ValueError, match=r"config\.mesh data=-1 x fsdp=1 x tensor=3 x dcn_data=2 "
                     r"cannot fill 8 devices: the fixed axes use 6"):
    fit.check(_config(TINY_VIT, **{"mesh.dcn_data": 2, "mesh.tensor": 3}), tpu)


# 401 tokens of D=32 per image in 16 heads (4 px patches at 80 px): the attention matrices are
# most of the memory, and 16 heads over 401 tokens compile 2.5x faster than 2 heads over 1,025
# for about as much. 2,048 images per core fit a v3 core's 15.5 GiB only in bfloat16 with two
# micro-batches.
OVERSIZED = {"data.image_size": 80, "model.patch_size": (4, 4), "model.num_heads": 16,
             "batch_size": 16384, "eval_batch_size": 64}


@requires_libtpu
@pytest.mark.slow
def test_oversized_batch_gets_a_suggestion_that_fits_when_applied():
  """OVERSIZED with one layer (a second adds nothing here but doubles the time of the compile
  that fits): 52 GiB in float32, 26 GiB in bfloat16, 13.3 GiB with two micro-batches."""
  tpu = topology.tpu_slice("v3-8")
  config = _config(TINY_VIT, **OVERSIZED, **{"model.num_layers": 1})
  first = fit.check(config, tpu)
  assert not first.fits and first.refused is first.train and first.eval.fits
  assert first.train.required > tpu.hbm_bytes and not first.train.accepted
  seen = []
  found = search.suggest(config, first, functools.partial(fit.check, tpu=tpu),
                         report=seen.append)
  bf16 = {"model.dtype": "bfloat16"}
  assert [a.overrides for a in seen] == [bf16, {**bf16, "grad_accum_steps": 2},
                                         {**bf16, "grad_accum_steps": 2}]
  assert [a.result.fits for a in seen] == [False, True, True]
  assert seen[0].result.train.required < first.train.required  # bfloat16 halves it, not enough.
  # The suggestion is the config with the overrides applied, both steps compiled and fitting.
  assert found.overrides == {**bf16, "grad_accum_steps": 2} and found.result.fits
  applied = found.result.config
  assert (applied.model.dtype, applied.grad_accum_steps, applied.batch_size) == (
      "bfloat16", 2, 16384)
  assert found.result.micro_batch_per_device == 1024
  assert found.result.train.memory.total < tpu.hbm_bytes


# The papers' global batches with tiny models: ViT (1 layer, D=32 in 16 heads, 401 tokens of 4 px
# patches at 80 px: the 16 attention matrices take ~41 MB per image in float32, so 512 images
# per core need micro-batches) and T2T-ViT-7's recipe (2 blocks of width 32 at 64 px).
SLICED = [("configs/vit.py:ti16,imagenet2012", "v3-8", {
    "data.image_size": 80, "model.patch_size": (4, 4), "model.hidden_size": 32,
    "model.mlp_dim": 64, "model.num_heads": 16, "model.num_layers": 1}, 2),
          ("configs/t2t.py:7", "v3-32", {
    "data.image_size": 64, "model.token_dim": 16, "model.embed_dim": 32, "model.depth": 2,
    "model.num_heads": 2}, 1)]


@requires_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("spec, accelerator, overrides, accumulation", SLICED)
def test_a_config_fitted_to_a_slice_compiles_and_fits_there(spec, accelerator, overrides,
                                                            accumulation):
  """The settings `vit_jax.config.slices` picks for the recipe's batch (as the configs'
  <slice> argument does) are the ones the pre-flight's compile accepts."""
  config = fit.with_overrides(cli.load_config_file(os.path.join(ROOT, spec)),
                              {**overrides, "eval_batch_size": 64})
  batch = config.batch_size
  with config.unlocked():
    settings = config_lib.slices.fit_to_slice(config, accelerator)
  assert settings["grad_accum_steps"] == accumulation and settings["model.dtype"] == "bfloat16"
  tpu = topology.tpu_slice(accelerator)
  result = fit.check(config, tpu, eval_step=False, num_train_examples=1_281_167,
                     num_classes=1000)
  assert result.fits and result.config.batch_size == batch  # The paper's batch, unchanged.
  assert result.micro_batch_per_device == batch // len(tpu.devices) // accumulation
  assert result.config.model.remat_policy == "dots_and_attention_saveable"
  if spec.startswith("configs/vit.py"):  # Activations dominate: the estimate bounds the
    # compiler's figure from above (conservative: it counts 4 copies of the 16 heads' 401 x 401
    # attention matrices) and is within 2.5 times it (about 2 times).
    estimate = settings["estimate"]["state"] + settings["estimate"]["activations"]
    assert 0.4 * estimate < result.train.memory.total < estimate


@requires_libtpu
@pytest.mark.slow
def test_command_line_exit_codes():
  fits = _preflight([*_flags(TINY_VIT), "--accelerator", "v4-8", "--noeval", "--noestimate",
                     "--nofaster"])  # One compile: the train step's (no variant to estimate).
  assert fits.returncode == 0, fits.stdout + fits.stderr
  assert "FITS: peak" in fits.stdout and "4 devices of TPU v4 on 1 host" in fits.stdout
  too_big = _preflight([*_flags(TINY_VIT, **OVERSIZED, **{"model.num_layers": 1}),
                        "--accelerator", "v3-8", "--nosuggest", "--noeval"])
  assert too_big.returncode == 1, too_big.stderr
  assert "DOES NOT FIT: the train step: RESOURCE_EXHAUSTED" in too_big.stdout
  # Temporaries (the compiler's figure, ~52 GiB in float32 with one layer), state and batch.
  needs = re.search(r"needs (\d+\.\d\d) GiB\+ > 15\.48 GiB", too_big.stdout)
  assert needs and 40 < float(needs.group(1)) < 65, too_big.stdout
  bad = _preflight([*_flags(TINY_VIT, batch_size=60), "--accelerator", "v3-8"])
  assert bad.returncode == 2 and "must be a multiple of 8" in bad.stderr
  assert "Traceback" not in bad.stderr
  stray = _preflight([*_flags(TINY_VIT), "--accelerator", "v3-8", "--largest_batch", "true"])
  assert stray.returncode == 2 and "FATAL: Unexpected arguments: true" in stray.stderr
