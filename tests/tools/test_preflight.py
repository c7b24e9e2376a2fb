"""vit_jax.tools.preflight (`python -m vit_jax.preflight`): tiny models compiled by libtpu's TPU
compiler for v3 and v4 slices (multi-host included), an oversized batch refused with a
suggestion that fits once applied, and the command line's exit codes (missing libtpu: 2).

The compile tests need libtpu (`pip install -e '.[tpu]'`, which .ci/run installs) and are
skipped without it; the others run everywhere."""

import functools
import importlib.util
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from vit_jax import cli
from vit_jax import config as config_lib
from vit_jax import flops
from vit_jax import step
from vit_jax.tools import cost
from vit_jax.tools.preflight import cli as preflight_cli
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


def test_not_a_tpu_or_no_such_slice_is_refused():
  with pytest.raises(ValueError, match="not a Cloud TPU type"):
    topology.tpu_slice("a100-8")
  with pytest.raises(ValueError, match="does not exist"):
    topology.tpu_slice("v3-12")


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
  fits = _preflight([*_flags(TINY_VIT), "--accelerator", "v4-8", "--noeval"])
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
