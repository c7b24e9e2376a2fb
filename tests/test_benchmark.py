"""vit_jax.benchmark: the measurements of a tiny ViT, the command line and its JSON, the
orchestration (fresh processes, alternating frameworks, medians, ratios), bad input, and the
timm comparison (only where torch and timm are installed: the optional 'bench' extra)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from vit_jax import benchmark
from vit_jax import flops
from vit_jax import models
from vit_jax.models import fused_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 layers of width 128 on 8x8 patches of 64 px images (65 tokens): the matrix products
# dominate, so XLA's FLOPs stay within a few % of the analytic count.
TINY = dict(hidden_size=128, mlp_dim=512, num_heads=2, num_layers=2, patch_size=8)
TINY_FLAGS = [arg for key, value in TINY.items() for arg in ("--override", f"{key}={value}")]
HAVE_TIMM = all(importlib.util.find_spec(m) is not None for m in ("torch", "timm"))


def _macs(overrides, resolution):
  return flops.model_forward_macs(models.create("ViT-custom", num_classes=1000, **overrides),
                                  (resolution, resolution, 3))


def _cli(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "vit_jax.benchmark", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def train_result():
  # Unrolled and without remat, and with XLA's attention rather than the fused CPU kernel (a
  # custom call, opaque to XLA's cost analysis): XLA's count then sees every product.
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv(fused_attention.SWITCH, "0")
    return benchmark.measure_ours("ViT-custom", overrides=dict(TINY, scan=False, remat=False),
                                  batch=2, resolution=64, mode="train", warmup=0, steps=2)


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
  assert not r["scan"] and not r["remat"] and r["attention_core"] == "XLA"


def test_inference_measurement():
  r = benchmark.measure_ours("ViT-custom", overrides=TINY, batch=2, resolution=64,
                             mode="inference", warmup=1, steps=1, peak_flops=1e12)
  assert r["images_per_sec"] > 0 and r["compile_seconds"] > 0 and r["peak_rss_mib"] > 0
  assert r["flops_per_step_analytic"] == 2 * _macs(TINY, 64) * 2
  # Without overrides the model runs as vit_jax.main trains it: scanned, rematerialised.
  assert r["scan"] and r["remat"] and r["remat_policy"] == "dots_and_attention_saveable"
  built = fused_attention.library()[0] is not None
  assert r["attention_core"] == ("fused CPU kernel" if built else "XLA")
  # XLA counts the scanned body of the 2 layers once: a little over half the analytic count,
  # less the attention products where the fused kernel (opaque to it) runs them.
  assert (0.45 if built else 0.5) < r["xla_to_analytic"] < 0.6
  assert r["peak_flops_per_device"] == 1e12 and r["peak_source"] == "given"


def test_bfloat16_inference():
  r = benchmark.measure_ours("ViT-custom", overrides=TINY, batch=2, resolution=64,
                             mode="inference", dtype="bfloat16", warmup=0, steps=1,
                             peak_flops=1e12)
  assert r["dtype"] == "bfloat16" and r["images_per_sec"] > 0 and r["flops_per_step_xla"] > 0


def test_compile_only_of_a_scanned_model_counts_the_layer_body_once():
  overrides = dict(TINY, num_layers=4, scan=True)
  r = benchmark.measure_ours("ViT-custom", overrides=overrides, batch=2, resolution=64,
                             mode="train", compile_only=True, peak_flops=1e12)
  assert r["compile_seconds"] > 0 and r["scan"] and r["compile_only"]
  assert r["images_per_sec"] is None and r["step_seconds_all"] == []
  assert r["first_step_seconds"] is None and r["timed_steps"] == 0
  assert r["flops_per_step_analytic"] == 3 * 2 * _macs(overrides, 64) * 2
  assert r["xla_to_analytic"] < 0.6  # One of four layers counted.


def test_cli_writes_json_with_the_expected_keys(tmp_path):
  out = tmp_path / "bench.json"
  proc = _cli("ViT-custom", *TINY_FLAGS, "--batch", "2", "--resolution", "64", "--warmup", "0",
              "--steps", "1", "--threads", "1", "--json", str(out))
  assert proc.returncode == 0, proc.stderr
  for unit in ("images/s", "MiB", "GFLOPs", "% of peak", "compile s"):
    assert unit in proc.stdout
  report = json.loads(out.read_text())
  assert set(report) >= {"args", "environment", "results", "comparisons", "notes", "units"}
  env = report["environment"]
  assert env["versions"]["jax"] and env["versions"]["jaxlib"] and "torch" in env["versions"]
  assert env["cpu_count"] >= 1 and env["threads"] == 1 and "XLA_FLAGS" in env
  assert env["cpu_model"]
  assert [(r["framework"], r["mode"]) for r in report["results"]] == [
      ("ours", "train"), ("ours", "inference")]
  for r in report["results"]:
    for key in ("images_per_sec", "step_seconds", "lower_seconds", "compile_seconds",
                "first_step_seconds", "peak_rss_mib", "flops_per_step_xla",
                "flops_per_step_analytic", "achieved_flops_per_sec", "fraction_of_peak",
                "peak_flops_per_device", "rounds"):
      assert r[key] is not None, key
    assert r["images_per_sec"] > 0 and r["peak_rss_mib"] > 0
    # One thread: the measuring process was pinned to one core, XLA's pool sized by NPROC.
    assert len(r["threads"]["cpu_affinity"]) == 1 or os.cpu_count() == 1
    assert r["threads"]["NPROC"] == "1"
  assert report["comparisons"] == []


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
  monkeypatch.setattr(benchmark, "run_in_subprocess", fake)
  monkeypatch.setattr(benchmark, "_missing_bench_packages", lambda: [])
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  report = benchmark.run(["ViT-Ti_16", "T2T-ViT-14"], batch=2, resolution=32, modes=("train",),
                         warmup=0, steps=1, compare="timm", rounds=3)
  assert ("malloc: huge pages for large allocations (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, "
          "timm's processes too).") in report["notes"]
  # Ti: ours first (it measures the CPU peak, then given to the rest), the order flips every
  # round; T2T-ViT has no timm model, so only ours.
  assert fake.calls == [("ours", "train", None), ("timm", "train", 1e11),
                        ("timm", "train", 1e11), ("ours", "train", 1e11),
                        ("ours", "train", 1e11), ("timm", "train", 1e11),
                        ("ours", "train", 1e11), ("ours", "train", 1e11),
                        ("ours", "train", 1e11)]
  assert any("timm has no T2T-ViT model" in n for n in report["notes"])
  assert [(r["model"], r["framework"]) for r in report["results"]] == [
      ("ViT-Ti_16", "ours"), ("ViT-Ti_16", "timm"), ("T2T-ViT-14", "ours")]
  ours, theirs = report["results"][:2]
  assert ours["images_per_sec"] == 10.04 and len(ours["rounds"]) == 3  # Median of 3 rounds.
  (comparison,) = report["comparisons"]
  assert comparison["images_per_sec_ratio"] == pytest.approx(10.04 / 8.03)
  assert comparison["peak_rss_ratio"] == pytest.approx(1.25)
  text = benchmark.format_report(report)
  assert "Ours / timm" in text and "vit_tiny_patch16_224" in text and "1.25" in text


def test_report_says_when_malloc_has_no_huge_pages(monkeypatch):
  monkeypatch.setattr(benchmark, "run_in_subprocess", _FakeWorkers())
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  report = benchmark.run(["ViT-Ti_16"], batch=2, resolution=32, modes=("inference",), warmup=0,
                         steps=1)
  assert ("malloc: no huge pages (GLIBC_TUNABLES=unset): VIT_JAX_HUGE_PAGES=0, a "
          "glibc.malloc.hugetlb of your own, or not supported here.") in report["notes"]


def test_timm_equivalents():
  assert benchmark.timm_equivalent("ViT-B_16") == ("vit_base_patch16_224", {}, False)
  assert benchmark.timm_equivalent("ViT-Ti/16")[0] == "vit_tiny_patch16_224"
  assert benchmark.timm_equivalent("ViT-S_16")[0] == "vit_small_patch16_224"
  assert benchmark.timm_equivalent("ViT-H_14")[0] == "vit_huge_patch14_224"
  # L has the official dropout 0.1, which timm's named model does not.
  assert benchmark.timm_equivalent("ViT-L_16") == (
      "vit_large_patch16_224", {"pos_drop_rate": 0.1, "proj_drop_rate": 0.1}, False)
  name, kwargs, checkpointing = benchmark.timm_equivalent("ViT-B_16",
                                                         {"num_layers": 4, "remat": True})
  assert name == "vit_base_patch16_224" and checkpointing
  assert kwargs == dict(embed_dim=768, depth=4, num_heads=12, mlp_ratio=4.0, patch_size=16)
  name, kwargs, _ = benchmark.timm_equivalent("ViT-custom", dict(TINY, classifier="gap"))
  assert kwargs == dict(embed_dim=128, depth=2, num_heads=2, mlp_ratio=4.0, patch_size=8,
                        class_token=False, global_pool="avg")
  for model in ("T2T-ViT-14", "R50+ViT-B_16"):
    with pytest.raises(benchmark.NoTimmModel, match="timm has no"):
      benchmark.timm_equivalent(model)


def test_overrides_are_python_literals():
  assert benchmark.parse_override("scan=True") == ("scan", True)
  assert benchmark.parse_override("num_layers=4") == ("num_layers", 4)
  assert benchmark.parse_override("patch_size=(8, 4)") == ("patch_size", (8, 4))
  assert benchmark.parse_override("classifier=gap") == ("classifier", "gap")


@pytest.mark.parametrize("args, message", [
    (["ViT-Q_16"], "Unknown model name 'ViT-Q_16'"),
    (["ViT-Ti_16", "--batch", "0"], "argument --batch: 0 must be >= 1"),
    (["ViT-Ti_16", "--batch", "-4"], "argument --batch: -4 must be >= 1"),
    (["ViT-Ti_16", "--resolution", "30"], "not divisible by the patch size 16"),
    (["ViT-Ti_16", "--dtype", "float16"], "argument --dtype: invalid choice"),
    (["ViT-Ti_16", "--override", "depth=3"], "Unknown override(s) ['depth']"),
    (["ViT-Ti_16", "--override", "scan"], "is not KEY=VALUE"),
    (["ViT-Ti_16", "--override", "dtype=bfloat16"], "with --dtype"),
    (["ViT-Ti_16", "--compare", "timm", "--compile-only"], "drop --compare timm"),
    ([], "Name at least one model"),
])
def test_bad_input_is_one_message_and_exit_2(args, message, capsys):
  assert benchmark.main(args) == 2
  captured = capsys.readouterr()
  assert message in captured.err and captured.err.count("\n") == 1 and not captured.out


def test_compare_timm_without_timm_says_how_to_install(monkeypatch, capsys):
  monkeypatch.setattr(benchmark, "_missing_bench_packages", lambda: ["timm"])
  assert benchmark.main(["ViT-B_16", "--compare", "timm"]) == 2
  assert "needs timm, which is not installed: pip install -e '.[bench]'" in capsys.readouterr().err


def test_bad_input_from_the_command_line_has_no_traceback():
  proc = _cli("ViT-B_16", "--resolution", "200")
  assert proc.returncode == 2 and not proc.stdout
  assert proc.stderr.startswith("vit_jax.benchmark: error: ViT-B_16 at 200x200 px: Image height "
                                "200 is not divisible by the patch size 16")
  assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.skipif(not HAVE_TIMM, reason="needs torch and timm (pip install -e '.[bench]')")
def test_compare_with_timm(tmp_path):
  out = tmp_path / "bench.json"
  proc = _cli("ViT-custom", *TINY_FLAGS, "--batch", "2", "--resolution", "32", "--warmup", "0",
              "--steps", "1", "--compare", "timm", "--rounds", "1", "--json", str(out))
  assert proc.returncode == 0, proc.stderr
  assert "Ours / timm" in proc.stdout
  report = json.loads(out.read_text())
  assert [(r["framework"], r["mode"]) for r in report["results"]] == [
      ("ours", "train"), ("timm", "train"), ("ours", "inference"), ("timm", "inference")]
  timm_train = report["results"][1]
  assert timm_train["timm_model"] == "vit_base_patch16_224"
  assert timm_train["timm_kwargs"]["depth"] == 2 and timm_train["images_per_sec"] > 0
  assert timm_train["num_params"] == report["results"][0]["num_params"]  # Same architecture.
  assert timm_train["threads"]["torch_num_threads"] == report["args"]["threads"]
  for c in report["comparisons"]:
    assert c["images_per_sec_ratio"] > 0 and c["peak_rss_ratio"] > 0
  assert report["environment"]["versions"]["timm"]


def test_input_pipeline_measurement_on_generated_jpegs(monkeypatch):
  monkeypatch.setattr(benchmark, "JPEG_COUNT", 8)
  r = benchmark.measure_input("jpeg", batch=4, resolution=32, warmup=1, steps=3)
  assert r["framework"] == "input" and r["augment"] == "inception_crop"
  assert r["image_shape"] == [32, 32, 3] and r["timed_steps"] == 3
  assert r["images_per_sec"] == pytest.approx(4 * 3 / r["seconds"]) and r["images_per_sec"] > 0
  with pytest.raises(benchmark.BenchmarkError, match="input must be one of"):
    benchmark.measure_input("imagenet", batch=4, resolution=32)


def test_input_pipeline_table():
  report = {"args": {"batch": 8, "resolution": 224, "dtype": "float32", "compile_only": False,
                     "steps": 5, "warmup": 2, "rounds": 1},
            "environment": {"threads": 2, "available_cores": 2, "cpu_model": "x"},
            "results": [{"framework": "ours", "model": "ViT-B_16", "mode": "train",
                         "images_per_sec": 2.0}],
            "comparisons": [], "notes": [],
            "inputs": [{"input": "jpeg", "augment": "inception_crop", "images_per_sec": 300.0,
                        "peak_rss_mib": 600.0}]}
  text = benchmark.format_report(report)
  assert "JPEG folder (500x375 JPEG)  inception_crop  300" in text
  assert text.rstrip().endswith("150.0")  # 300 images/s against a 2 images/s training step.


def test_gpu_script_refuses_a_machine_without_gpu(tmp_path):
  proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu_benchmark.sh"),
                         str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
  assert proc.returncode == 2 and not proc.stdout
  assert "error: JAX sees no GPU (backend: cpu)" in proc.stderr
  assert "pip install 'jax[cuda13]'" in proc.stderr
  assert not (tmp_path / "out").exists()  # Nothing created on a machine it refuses.
