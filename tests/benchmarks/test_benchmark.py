"""benchmarks/ (`python -m benchmarks`): the measurements of a tiny ViT, the
command line and its JSON, the orchestration (fresh processes, alternating frameworks, medians,
ratios), bad input, the attention report, and the timm comparison (only where torch and timm are
installed: the optional 'bench' extra)."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import jax
import pytest

from benchmarks import cli
from benchmarks import common
from benchmarks import inputs
from benchmarks import ours
from benchmarks import report
from benchmarks import runner
from benchmarks import timm as timm_lib
from vit_jax import flops
from vit_jax import models
from vit_jax.kernels import cpu_attention
from vit_jax.tools import common as tools_common

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 2 layers of width 128 on 8x8 patches of 64 px images (65 tokens): the matrix products
# dominate, so XLA's FLOPs stay within a few % of the analytic count.
TINY = dict(hidden_size=128, mlp_dim=512, num_heads=2, num_layers=2, patch_size=8)
TINY_FLAGS = [arg for key, value in TINY.items() for arg in ("--set", f"{key}={value}")]
HAVE_TIMM = all(importlib.util.find_spec(m) is not None for m in ("torch", "timm"))


def _macs(overrides, resolution):
  return flops.model_forward_macs(models.create("ViT-custom", num_classes=1000, **overrides),
                                  (resolution, resolution, 3))


def _cli(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def train_result():
  # Unrolled and without remat, and with XLA's attention rather than the fused CPU kernel (a
  # custom call, opaque to XLA's cost analysis): XLA's count then sees every product.
  return ours.measure_ours("ViT-custom",
                           overrides=dict(TINY, scan=False, remat=False, attention="xla"),
                           batch=2, resolution=64, mode="train", warmup=0, steps=2)


@pytest.mark.slow
def test_training_step_measurement(train_result):
  r = train_result
  assert r["images_per_sec"] > 0 and len(r["step_seconds_all"]) == 2
  assert r["images_per_sec"] == pytest.approx(2 / r["step_seconds"])
  assert r["lower_seconds"] > 0 and r["compile_seconds"] > 0 and r["first_step_seconds"] > 0
  assert r["peak_rss_mib"] > 0 and r["device_peak_mib"] is None  # CPU.
  assert r["flops_per_step_analytic"] == 3 * 2 * _macs(TINY, 64) * 2
  # XLA adds the elementwise work and AdamW to the matrix products: a few % here.
  assert 1.0 <= r["xla_to_analytic"] < 1.06
  assert r["peak_source"].startswith("measured") and r["peak_flops_per_device"] > 0
  assert 0 < r["fraction_of_peak"] == pytest.approx(
      r["flops_per_step_analytic"] / r["step_seconds"] / r["peak_flops_per_device"])
  assert r["framework"] == "ours" and r["mode"] == "train" and r["num_params"] > 0
  assert not r["scan"] and not r["remat"]
  # The trainer's step in the pretraining regime, with the attention the override forced.
  assert r["loss"] == "sigmoid_xent" and r["config"]["optim"]["optimizer"] == "adamw"
  assert r["config"]["batch_size"] == 2 and r["config"]["data"]["image_size"] == 64
  assert (r["attention"], r["attention_requested"], r["attention_reason"]) == (
      "xla", "xla", "requested")
  assert r["attention_cpu_kernel_called"] is False


def test_inference_measurement():
  r = ours.measure_ours("ViT-custom", overrides=TINY, batch=2, resolution=64,
                       mode="inference", warmup=1, steps=1, peak_flops=1e12)
  assert r["images_per_sec"] > 0 and r["compile_seconds"] > 0 and r["peak_rss_mib"] > 0
  assert r["flops_per_step_analytic"] == 2 * _macs(TINY, 64) * 2
  # Without overrides the model runs as vit_jax.main trains it: scanned, rematerialised.
  assert r["scan"] and r["remat"] and r["remat_policy"] == "dots_and_attention_saveable"
  # 'auto': the kernel only where it is built and measured faster than XLA's on this CPU.
  kernel = cpu_attention.faster_than_xla()[0]
  assert r["attention_requested"] == "auto"
  assert r["attention"] == ("cpu_kernel" if kernel else "xla")
  assert r["attention_cpu_kernel_called"] is kernel
  assert r["attention_reason"] and r["attention_reason"] != "requested"
  # XLA counts the scanned body of the 2 layers once: a little over half the analytic count,
  # less the attention products where the fused kernel (opaque to it) runs them.
  assert (0.45 if kernel else 0.5) < r["xla_to_analytic"] < 0.6
  assert r["peak_flops_per_device"] == 1e12 and r["peak_source"] == "given"


def test_bfloat16_inference():
  r = ours.measure_ours("ViT-custom", overrides=TINY, batch=2, resolution=64,
                       mode="inference", dtype="bfloat16", warmup=0, steps=1, peak_flops=1e12)
  assert r["dtype"] == "bfloat16" and r["images_per_sec"] > 0 and r["flops_per_step_xla"] > 0


@pytest.mark.slow
def test_compile_only_of_a_scanned_model_counts_the_layer_body_once():
  overrides = dict(TINY, num_layers=4, scan=True)
  r = ours.measure_ours("ViT-custom", overrides=overrides, batch=2, resolution=64,
                       mode="train", compile_only=True, peak_flops=1e12)
  assert r["compile_seconds"] > 0 and r["scan"] and r["compile_only"]
  assert r["images_per_sec"] is None and r["step_seconds_all"] == []
  assert r["first_step_seconds"] is None and r["timed_steps"] == 0
  assert r["flops_per_step_analytic"] == 3 * 2 * _macs(overrides, 64) * 2
  assert r["xla_to_analytic"] < 0.6  # One of four layers counted.


@pytest.mark.slow
def test_cli_writes_json_with_the_expected_keys(tmp_path):
  out = tmp_path / "bench.json"
  proc = _cli("ViT-custom", *TINY_FLAGS, "--batch", "2", "--resolution", "64", "--warmup", "0",
              "--steps", "1", "--threads", "1", "--json", str(out))
  assert proc.returncode == 0, proc.stderr
  for unit in ("images/s", "MiB", "GFLOPs", "% of peak", "compile s"):
    assert unit in proc.stdout
  saved = json.loads(out.read_text())
  assert set(saved) >= {"args", "environment", "results", "comparisons", "notes", "units"}
  env = saved["environment"]
  assert env["versions"]["jax"] and env["versions"]["jaxlib"] and "torch" in env["versions"]
  assert env["cpu_count"] >= 1 and env["threads"] == 1 and "XLA_FLAGS" in env
  assert env["cpu_model"]
  assert [(r["framework"], r["mode"]) for r in saved["results"]] == [
      ("ours", "train"), ("ours", "inference")]
  for r in saved["results"]:
    for key in ("images_per_sec", "step_seconds", "lower_seconds", "compile_seconds",
                "first_step_seconds", "peak_rss_mib", "flops_per_step_xla",
                "flops_per_step_analytic", "achieved_flops_per_sec", "fraction_of_peak",
                "peak_flops_per_device", "rounds"):
      assert r[key] is not None, key
    assert r["images_per_sec"] > 0 and r["peak_rss_mib"] > 0
    # One thread: the measuring process was pinned to one core, XLA's pool sized by NPROC.
    assert len(r["threads"]["cpu_affinity"]) == 1 or os.cpu_count() == 1
    assert r["threads"]["NPROC"] == "1"
  assert saved["comparisons"] == []
  # Which attention ran and why, in the JSON and the printed notes.
  for r in saved["results"]:
    assert r["attention_requested"] == "auto" and r["attention"] in ("xla", "cpu_kernel")
    assert r["attention_reason"] and isinstance(r["attention_cpu_kernel_called"], bool)
  (note,) = [n for n in saved["notes"] if n.startswith("attention (ours: ")]
  first = saved["results"][0]
  assert note.startswith("attention (ours: ViT-custom train, ViT-custom inference): "
                         f"{first['attention']} ({first['attention_reason']})")
  assert f"Note: {note}" in proc.stdout


def test_an_attention_override_forces_the_path_or_says_why_it_cannot():
  config, choice = ours.resolve(ours.benchmark_config(
      "ViT-custom", batch=2, resolution=64, overrides=dict(TINY, attention="xla")),
      [jax.devices("cpu")[0]])
  assert (config.model.attention, choice.reason) == ("xla", "requested")
  with pytest.raises(common.BenchmarkError,
                     match="ViT-custom: config.model.attention='cudnn' cannot run: the devices "
                           "are not GPUs"):
    ours.measure_ours("ViT-custom", overrides=dict(TINY, attention="cudnn"), batch=2,
                      resolution=64, mode="inference", warmup=0, steps=1)


def test_attention_notes_group_the_runs_with_the_same_answer():
  runs = [dict(framework="ours", model=m, mode=mode, attention=a, attention_reason=why,
               attention_cpu_kernel_called=a == "cpu_kernel", platform="cpu")
          for m, mode, a, why in (
              ("ViT-Ti_16", "train", "cpu_kernel", "vit_jax's fused CPU kernel"),
              ("ViT-Ti_16", "inference", "cpu_kernel", "vit_jax's fused CPU kernel"),
              ("ViT-S_16", "train", "xla", "requested"))]
  assert report.attention_notes(runs + [dict(framework="timm", model="ViT-S_16")]) == [
      "attention (ours: ViT-Ti_16 train, ViT-Ti_16 inference): cpu_kernel (vit_jax's fused CPU "
      "kernel); the compiled step calls vit_jax's fused CPU kernel (vit_jax.kernels), "
      "whose products are in the analytic count, not in 'GFLOPs XLA' (XLA "
      "cannot see into a custom call); --set attention=xla measures XLA's attention "
      "instead.",
      "attention (ours: ViT-S_16 train): xla (requested); the compiled step does not call "
      "vit_jax's fused CPU kernel."]


class _FakeWorkers:
  """Stands in for the measuring subprocesses: records the order, returns fixed figures."""

  def __init__(self):
    self.calls = []

  def __call__(self, spec, timeout=None):
    self.calls.append((spec["framework"], spec["mode"], spec["peak_flops"]))
    ours = spec["framework"] == "ours"
    rate = (10.0 if ours else 8.0) + len(self.calls) * 0.01
    result = {"framework": spec["framework"], "model": spec["model"], "mode": spec["mode"],
              "images_per_sec": rate, "step_seconds": spec["batch"] / rate,
              "step_seconds_all": [spec["batch"] / rate], "peak_rss_mib": 500.0 if ours else 400.0,
              "device_peak_mib": None, "platform": "cpu", "device_kind": "cpu",
              "peak_flops_per_device": 1e11, "flops_per_step_analytic": spec["analytic_flops"],
              "threads": {"NPROC": str(spec["threads"])}}
    if not ours:
      result.update(timm_model="vit_tiny_patch16_224", timm_kwargs={})
    return result


def test_frameworks_alternate_in_fresh_processes_and_ratios_are_reported(monkeypatch):
  fake = _FakeWorkers()
  monkeypatch.setattr(runner, "run_in_subprocess", fake)
  monkeypatch.setattr(timm_lib, "missing_bench_packages", lambda: [])
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  result = runner.run(["ViT-Ti_16", "T2T-ViT-14"], batch=2, resolution=32, modes=("train",),
                      warmup=0, steps=1, compare="timm", rounds=3)
  assert ("malloc: huge pages for large allocations (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, "
          "timm's processes too).") in result["notes"]
  # Ti: ours first (it measures the CPU peak, then given to the rest), the order flips every
  # round; T2T-ViT has no timm model, so only ours.
  assert fake.calls == [("ours", "train", None), ("timm", "train", 1e11),
                        ("timm", "train", 1e11), ("ours", "train", 1e11),
                        ("ours", "train", 1e11), ("timm", "train", 1e11),
                        ("ours", "train", 1e11), ("ours", "train", 1e11),
                        ("ours", "train", 1e11)]
  assert any("timm has no T2T-ViT model" in n for n in result["notes"])
  assert [(r["model"], r["framework"]) for r in result["results"]] == [
      ("ViT-Ti_16", "ours"), ("ViT-Ti_16", "timm"), ("T2T-ViT-14", "ours")]
  our_result, theirs = result["results"][:2]
  # The median of 3 rounds.
  assert our_result["images_per_sec"] == 10.04 and len(our_result["rounds"]) == 3
  (comparison,) = result["comparisons"]
  assert comparison["images_per_sec_ratio"] == pytest.approx(10.04 / 8.03)
  assert comparison["peak_rss_ratio"] == pytest.approx(1.25)
  text = report.format_report(result)
  assert "Ours / timm" in text and "vit_tiny_patch16_224" in text and "1.25" in text


def test_report_says_when_malloc_has_no_huge_pages(monkeypatch):
  monkeypatch.setattr(runner, "run_in_subprocess", _FakeWorkers())
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  result = runner.run(["ViT-Ti_16"], batch=2, resolution=32, modes=("inference",), warmup=0,
                      steps=1)
  assert ("malloc: no huge pages (GLIBC_TUNABLES=unset): VIT_JAX_HUGE_PAGES=0, a "
          "glibc.malloc.hugetlb of your own, or not supported here.") in result["notes"]


def test_timm_equivalents():
  assert timm_lib.timm_equivalent("ViT-B_16") == ("vit_base_patch16_224", {}, False)
  assert timm_lib.timm_equivalent("ViT-Ti/16")[0] == "vit_tiny_patch16_224"
  assert timm_lib.timm_equivalent("ViT-S_16")[0] == "vit_small_patch16_224"
  assert timm_lib.timm_equivalent("ViT-H_14")[0] == "vit_huge_patch14_224"
  # L has the official dropout 0.1, which timm's named model does not.
  assert timm_lib.timm_equivalent("ViT-L_16") == (
      "vit_large_patch16_224", {"pos_drop_rate": 0.1, "proj_drop_rate": 0.1}, False)
  name, kwargs, checkpointing = timm_lib.timm_equivalent("ViT-B_16",
                                                         {"num_layers": 4, "remat": True})
  assert name == "vit_base_patch16_224" and checkpointing
  assert kwargs == dict(embed_dim=768, depth=4, num_heads=12, mlp_ratio=4.0, patch_size=16)
  name, kwargs, _ = timm_lib.timm_equivalent("ViT-custom", dict(TINY, classifier="gap"))
  assert kwargs == dict(embed_dim=128, depth=2, num_heads=2, mlp_ratio=4.0, patch_size=8,
                        class_token=False, global_pool="avg")
  _, kwargs, _ = timm_lib.timm_equivalent("ViT-custom", dict(TINY, classifier="map"))
  assert kwargs["class_token"] is False and kwargs["global_pool"] == "map"
  for model in ("T2T-ViT-14", "R50+ViT-B_16"):
    with pytest.raises(common.NoTimmModel, match="timm has no"):
      timm_lib.timm_equivalent(model)


@pytest.mark.parametrize("name", ["ViT-Ti_16", "T2T-ViT-7"])
def test_execution_fields_of_set_are_checked_as_the_models_check_them(name):
  # The benchmark's --set goes through the models' check (it once measured 'maybe' as True;
  # the models' own: tests/models/test_attention.py).
  with pytest.raises(common.BenchmarkError, match="scan must be True or False"):
    ours.benchmark_config(name, batch=1, resolution=224,
                          overrides=dict([tools_common.parse_setting("scan=maybe")]))


def test_overrides_are_python_literals():
  assert tools_common.parse_setting("scan=True") == ("scan", True)
  assert tools_common.parse_setting("num_layers=4") == ("num_layers", 4)
  assert tools_common.parse_setting("patch_size=(8, 4)") == ("patch_size", (8, 4))
  assert tools_common.parse_setting("classifier=gap") == ("classifier", "gap")
  assert tools_common.parse_setting(" scan = false") == ("scan", False)  # --override's forms.


@pytest.mark.parametrize("args, message", [
    (["ViT-Q_16"], "Unknown model name 'ViT-Q_16'"),
    (["ViT-Ti_16", "--batch", "0"], "argument --batch: 0 must be >= 1"),
    (["ViT-Ti_16", "--batch", "-4"], "argument --batch: -4 must be >= 1"),
    (["ViT-Ti_16", "--resolution", "30"], "not divisible by the patch size 16"),
    (["ViT-Ti_16", "--dtype", "float16"], "argument --dtype: invalid choice"),
    (["ViT-Ti_16", "--override", "depth=3"], "Unknown override(s) ['depth']"),
    (["ViT-Ti_16", "--set", "depth=3"], "Unknown override(s) ['depth']"),
    (["ViT-Ti_16", "--override", "scan"], "is not KEY=VALUE"),
    (["ViT-Ti_16", "--set", "scan"], "is not KEY=VALUE"),
    (["ViT-Ti_16", "--override", "dtype=bfloat16"], "with --dtype"),
    (["ViT-Ti_16", "--set", "dtype=bfloat16"], "with --dtype"),
    (["ViT-Ti_16", "--compare", "timm", "--compile-only"], "drop --compare timm"),
    ([], "Name at least one model"),
])
def test_bad_input_is_one_message_and_exit_2(args, message, capsys):
  try:
    status = cli.main(args)
  except SystemExit as e:  # A flag argparse refuses: the parser's FATAL line, as every tool.
    status = e.code
  assert status == 2
  captured = capsys.readouterr()
  assert message in captured.err and captured.err.count("\n") == 1 and not captured.out


def test_compare_timm_without_timm_says_how_to_install(monkeypatch, capsys):
  monkeypatch.setattr(timm_lib, "missing_bench_packages", lambda: ["timm"])
  assert cli.main(["ViT-B_16", "--compare", "timm"]) == 2
  assert "needs timm, which is not installed: pip install -e '.[bench]'" in capsys.readouterr().err


def test_bad_input_from_the_command_line_has_no_traceback():
  proc = _cli("ViT-B_16", "--resolution", "200")
  assert proc.returncode == 2 and not proc.stdout
  assert proc.stderr.startswith("FATAL: ViT-B_16 at 200x200 px: Image height "
                                "200 is not divisible by the patch size 16")
  assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.skipif(not HAVE_TIMM, reason="needs torch and timm (pip install -e '.[bench]')")
def test_compare_with_timm(tmp_path):
  out = tmp_path / "bench.json"
  proc = _cli("ViT-custom", *TINY_FLAGS, "--batch", "2", "--resolution", "32", "--warmup", "0",
              "--steps", "1", "--compare", "timm", "--rounds", "1", "--json", str(out))
  assert proc.returncode == 0, proc.stderr
  assert "Ours / timm" in proc.stdout
  saved = json.loads(out.read_text())
  assert [(r["framework"], r["mode"]) for r in saved["results"]] == [
      ("ours", "train"), ("timm", "train"), ("ours", "inference"), ("timm", "inference")]
  timm_train = saved["results"][1]
  assert timm_train["timm_model"] == "vit_base_patch16_224"
  assert timm_train["timm_kwargs"]["depth"] == 2 and timm_train["images_per_sec"] > 0
  assert timm_train["num_params"] == saved["results"][0]["num_params"]  # Same architecture.
  assert timm_train["threads"]["torch_num_threads"] == saved["args"]["threads"]
  for c in saved["comparisons"]:
    assert c["images_per_sec_ratio"] > 0 and c["peak_rss_ratio"] > 0
  assert saved["environment"]["versions"]["timm"]


def test_input_pipeline_measurement_on_generated_jpegs(monkeypatch):
  monkeypatch.setattr(inputs, "JPEG_COUNT", 8)
  r = inputs.measure_input("jpeg", batch=4, resolution=32, warmup=1, steps=3)
  assert r["framework"] == "input" and r["augment"] == "inception_crop"
  assert r["image_shape"] == [32, 32, 3] and r["timed_steps"] == 3
  assert r["images_per_sec"] == pytest.approx(4 * 3 / r["seconds"]) and r["images_per_sec"] > 0
  with pytest.raises(common.BenchmarkError, match="input must be one of"):
    inputs.measure_input("imagenet", batch=4, resolution=32)


def test_t2t_recipe_is_configs_t2t():
  spec = importlib.util.spec_from_file_location("t2t_config", os.path.join(ROOT, "configs",
                                                                          "t2t.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  data = module.get_config("14").data
  assert {k: data[k] for k in inputs.T2T_DATA} == inputs.T2T_DATA
  cfg = inputs.recipe_config("t2t", 64)
  assert cfg.image_size == 64 and cfg.randaugment_num_layers == 2 and cfg.mixup_alpha == 0.8
  vit = inputs.recipe_config("vit", 64)
  assert (vit.augment, vit.randaugment_num_layers, vit.random_erasing) == ("inception_crop", 0, 0)
  with pytest.raises(common.BenchmarkError, match="recipe must be one of"):
    inputs.recipe_config("deit", 64)
  assert inputs.recipe_steps(8) == 80 and inputs.recipe_steps(1000) == 1


@pytest.mark.slow
def test_t2t_recipe_measurement_counts_cpu_seconds(monkeypatch):
  monkeypatch.setattr(inputs, "JPEG_COUNT", 8)
  r = inputs.measure_input("jpeg", batch=4, resolution=32, warmup=1, steps=3, recipe="t2t")
  assert r["recipe"] == "t2t" and r["image_shape"] == [32, 32, 3]
  assert r["cpu_seconds"] > 0 and r["cores_busy"] == pytest.approx(r["cpu_seconds"] / r["seconds"])
  assert r["images_per_cpu_second"] == pytest.approx(12 / r["cpu_seconds"])


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TIMM, reason="needs torch and timm (pip install -e '.[bench]')")
def test_timm_dataloader_measurement(monkeypatch):
  monkeypatch.setattr(inputs, "JPEG_COUNT", 8)
  r = inputs.measure_timm_input(recipe="t2t", batch=4, resolution=32, warmup=1, steps=3,
                                threads=1)
  assert r["framework"] == "timm_input" and r["image_shape"] == [3, 32, 32]
  assert r["num_workers"] == 1
  # The worker process does the work: its CPU seconds are counted.
  assert r["cpu_seconds"] > 0.5 * r["seconds"] and r["images_per_cpu_second"] > 0


def test_cpu_seconds_count_live_children():
  before = inputs.cpu_seconds()
  # A child that burns 0.3 s of CPU, then waits: its seconds count while it lives.
  child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                            "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
  try:
    deadline = time.monotonic() + 10
    while inputs.cpu_seconds() - before < 0.3 and time.monotonic() < deadline:
      time.sleep(0.05)
    assert inputs.cpu_seconds() - before >= 0.3
  finally:
    child.kill()
    child.wait()


def _recipe_result(framework, recipe, cores, per_cpu_second):
  return {"framework": framework, "recipe": recipe, "images_per_sec": 2 * per_cpu_second,
          "images_per_cpu_second": per_cpu_second, "cores_busy": 2.0, "seconds": 1.0,
          "cpu_seconds": 2.0, "peak_rss_mib": 100.0,
          "threads": {"cpu_affinity": list(range(cores))}}


def test_recipes_alternate_with_timm_on_1_and_all_cores(monkeypatch):
  calls = []

  def fake(spec, timeout=None):
    calls.append((spec["framework"], spec["recipe"], spec["threads"], spec["cores"]))
    rate = 300.0 + len(calls) if spec["framework"] == "input" else 200.0
    return _recipe_result(spec["framework"], spec["recipe"], spec["threads"], rate)

  monkeypatch.setattr(runner, "run_in_subprocess", fake)
  monkeypatch.setattr(runner, "available_cores", lambda: [0, 1])
  monkeypatch.setattr(timm_lib, "missing_bench_packages", lambda: [])
  rows = runner._recipe_rounds(batch=8, resolution=32, threads=2, rounds=2, with_timm=True,
                               timeout=None, progress=None)
  assert calls[:4] == [("input", "vit", 1, [0]), ("timm_input", "vit", 1, [0]),
                       ("timm_input", "vit", 1, [0]), ("input", "vit", 1, [0])]
  assert [c[1:3] for c in calls[4::4]] == [("vit", 2), ("t2t", 1), ("t2t", 2)]
  assert calls[4][3] is None  # All the cores: not pinned.
  assert rows[0]["images_per_cpu_second"] == 302.5 and len(rows[0]["rounds"]) == 2
  text = report.format_report({
      "args": {"batch": 8, "resolution": 32, "dtype": "float32", "compile_only": False,
               "steps": 5, "warmup": 2, "rounds": 2},
      "environment": {"threads": 2, "available_cores": 2, "cpu_model": "x"},
      "results": [], "comparisons": [], "notes": [], "inputs": [], "input_recipes": rows})
  assert "ours images/CPU-s" in text
  assert "T2T-ViT  + RandAugment, erasing, Mixup/CutMix  2" in text
  last = report.recipe_rows(rows)[-1]
  assert (last["recipe"], last["cores"]) == ("t2t", 2)
  assert last["per_cpu_second_ratio"] == pytest.approx(314.5 / 200)
  assert text.rstrip().endswith("1.57")


def test_input_pipeline_table():
  result = {"args": {"batch": 8, "resolution": 224, "dtype": "float32", "compile_only": False,
                     "steps": 5, "warmup": 2, "rounds": 1},
            "environment": {"threads": 2, "available_cores": 2, "cpu_model": "x"},
            "results": [{"framework": "ours", "model": "ViT-B_16", "mode": "train",
                         "images_per_sec": 2.0}],
            "comparisons": [], "notes": [],
            "inputs": [{"input": "jpeg", "augment": "inception_crop", "images_per_sec": 300.0,
                        "peak_rss_mib": 600.0}]}
  text = report.format_report(result)
  assert "JPEG folder (500x375 JPEG)  inception_crop  300" in text
  assert text.rstrip().endswith("150.0")  # 300 images/s against a 2 images/s training step.


def test_gpu_script_refuses_a_machine_without_gpu(tmp_path):
  proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu_benchmark.sh"),
                         str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, check=False, env=dict(
                            os.environ, JAX_PLATFORMS="cpu",
                            # The script's `python` is this interpreter, venv activated or not.
                            PATH=os.pathsep.join([os.path.dirname(sys.executable),
                                                  os.environ.get("PATH", "")])))
  assert proc.returncode == 2 and not proc.stdout
  assert "error: JAX sees no GPU (backend: cpu)" in proc.stderr
  assert "pip install 'jax[cuda13]'" in proc.stderr
  assert not (tmp_path / "out").exists()  # Nothing created on a machine it refuses.
