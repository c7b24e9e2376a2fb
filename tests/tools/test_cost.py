"""vit_jax.tools.cost (`python -m vit_jax.cost`): the estimate of a configured schedule, known
datasets' sizes, the command line (Table 2, an estimate, bad input), and that the estimator needs
no trainer."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import PIL.Image
import pytest

from vit_jax import config as config_lib
from vit_jax import flops
from vit_jax.tools import cost

DAY = 86_400.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _b16_config():
  config = config_lib.get_config("ViT-B_16", "unused")
  config.regime = "finetune"
  config.batch_size = 512
  config.total_steps = 1000
  config.optim.warmup_steps = 0
  return config


def test_the_mfu_of_a_preflight_report_prices_the_run(tmp_path, capsys):
  """--preflight FILE: the train step's MFU that a pre-flight estimated (its --json report) for
  the config's model, TPU kind and compute dtype; refused for another one, without an estimate,
  and beside --mfu."""
  config = _b16_config()
  report = {"accelerator": "v4-8", "device_kind": "TPU v4", "model": config.model_name,
            "dtype": str(config.model.dtype), "batch_per_device": 128, "mfu": 0.5,
            "steps": {"train": {"estimate_note": ""}}}
  path = tmp_path / "b16.json"
  path.write_text(json.dumps(report))
  mfu, source = cost.preflight_mfu(str(path), config, "v4-16")  # 512 images on 8 chips.
  assert mfu == 0.5 and source == ("the TPU compiler's estimate of the train step on v4-8 at 128 "
                                   f"images per device, from {path}; this run has 64 per device")
  est = cost.estimate(config, "v4-16", mfu, num_train_examples=1_000_000, num_classes=1000,
                      mfu_source=source)
  assert est["days"] == pytest.approx(est["training_flops"] / (0.5 * 8 * 275e12) / DAY)
  assert f"\nMFU            50.0% ({source})\n" in cost.format_estimate(est, "v4-16")
  assert "\nassumed MFU    50%\n" in cost.format_estimate(cost.estimate(
      config, "v4-16", 0.5, num_train_examples=1_000_000, num_classes=1000), "v4-16")
  for changed, message in (
      ({"device_kind": "TPU v3"}, "estimates device_kind 'TPU v3', but this run's TPU kind "
       "(v4-16) is 'TPU v4': its MFU does not carry over."),
      ({"model": "ViT-L_16"}, f"estimates model 'ViT-L_16', but this run's model is "
       f"'{config.model_name}'"),
      ({"dtype": "float16"}, "estimates dtype 'float16', but this run's compute dtype is"),
      ({"mfu": None, "steps": {"train": {"estimate_note": "the TPU compiler gave no estimate "
                                         "of the step's time"}}},
       "has no estimated MFU of the train step (the TPU compiler gave no estimate of the step's "
       "time)."),
      ({"steps": None}, "is not a pre-flight report; give the file that python -m "
       "vit_jax.preflight --json wrote.")):
    path.write_text(json.dumps({**report, **changed}))
    with pytest.raises(ValueError, match=re.escape(f"{path} {message}")):
      cost.preflight_mfu(str(path), config, "v4-16")
  with pytest.raises(ValueError, match="no such file; write it with python -m vit_jax.preflight"):
    cost.preflight_mfu(str(tmp_path / "none.json"), config, "v4-16")
  assert cost.main(["--config", os.path.join(ROOT, "configs/fashion_mnist.py"), "--mfu", "0.3",
                    "--preflight", str(path)]) == 2
  assert "FATAL: Give --mfu (assumed) or --preflight FILE (estimated), not both." in \
      capsys.readouterr().err


def test_estimator_counts_the_configured_schedule():
  config = _b16_config()
  est = cost.estimate(config, "v3-256", 0.5, num_train_examples=1_000_000, num_classes=1000)
  macs = flops.vit_forward_macs(hidden_size=768, mlp_dim=3072, num_layers=12, patch_size=16,
                                image_size=224)
  assert est["training_flops"] == 6 * macs * 512 * 1000
  assert est["days"] == pytest.approx(est["training_flops"] / (0.5 * 256 * 61.5e12) / DAY)
  assert est["core_days"] == pytest.approx(est["days"] * 256)
  assert est["chip_days"] == pytest.approx(est["days"] * 128)
  assert est["parameters"] == 86_567_656
  assert est["steps"] == 1000 and est["epochs"] == pytest.approx(512 * 1000 / 1_000_000)
  # The caller's config is unchanged (the regime is filled in a copy).
  assert config.loss is None and config.num_classes is None and config.model.attention == "auto"


def test_estimator_counts_epochs_of_a_known_dataset():
  config = _b16_config()
  config.total_steps = None
  config.num_epochs = 2.0
  config.data.name = "imagenet2012"
  est = cost.estimate(config, "v3-8", 0.5)
  assert est["steps"] == -(-2 * 1_281_167 // 512) and est["train_examples"] == 1_281_167
  assert est["dataset"] == "imagenet2012's published size"


def test_estimator_sizes_known_datasets_without_data():
  assert cost.split_size("train[:99%]", {"train": 1_281_167}) == 1_268_355
  assert cost.split_size("train+validation", {"train": 10, "validation": 5}) == 15
  with pytest.raises(ValueError, match="does not fit the splits"):
    cost.split_size("test", {"train": 10})


@pytest.mark.slow
def test_estimator_does_not_import_the_trainer():
  code = ("import sys; from vit_jax import config; from vit_jax.tools import cost; "
          "c = config.get_config('ViT-Ti_16', 'cifar10'); c.total_steps = 10; "
          "cost.estimate(c, 'v3-8', 0.5); "
          "print(sorted(m for m in sys.modules if m in ('vit_jax.train', 'vit_jax.checkpoint')))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "[]"


def test_estimator_cli_refuses_an_unknown_config_key_as_main_does(capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  assert cost.main(["--config", "configs/fashion_mnist.py", "--config.batch_siz=1"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("FATAL: Unknown config key 'batch_siz' in '--config.batch_siz=1'")
  assert "Did you mean 'batch_size'?" in err and err.count("\n") == 1


def _run_cost(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "vit_jax.cost", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_estimator_cli_prints_table2_and_an_estimate(capsys, monkeypatch):
  """The command's answers: --table2 and a refusal (exit status 2) as its processes; the estimate
  and the other refusals as `cost.main(argv)` here (the same code after the process's start-up,
  2.5 s of CPU each)."""
  proc = _run_cost("--table2")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "| ViT-L/16 | ImageNet-21k | 90 | 123.2 | 4.66e+20 | 0.23k | 38% |" in proc.stdout
  assert "| ViT-H/14 | JFT-300M | 14 | 334.6 | 4.26e+21 | 2.5k | 32% |" in proc.stdout
  assert "Assumptions:" in proc.stdout
  proc = _run_cost("--config", "configs/vit.py:b16,cifar10", "--accelerator", "v9-8")
  assert proc.returncode == 2 and "FATAL: Unknown accelerator 'v9-8'" in proc.stderr
  assert "Traceback" not in proc.stderr
  monkeypatch.chdir(ROOT)
  assert cost.main(["--config", "configs/vit.py:l16,imagenet21k", "--accelerator", "v3-256",
                    "--mfu", "0.38"]) == 0, capsys.readouterr().err[-2000:]
  stdout = capsys.readouterr().out
  # The paper's 90 epochs of 14M images at the 38% that Table 2 implies: about 0.23k.
  line = next(l for l in stdout.splitlines() if l.startswith("TPU-core-days"))
  assert 225 < float(line.split()[1].replace(",", "")) < 240, stdout
  for args, message in [(("--config", "configs/nope.py"), "The config file 'configs/nope.py'"),
                        ((), "Give --config="),
                        (("--config", "configs/fashion_mnist.py", "--num_train_examples=0"),
                         "--num_train_examples=0 must be positive"),
                        (("--config", "configs/fashion_mnist.py", "--mfu=2"), "--mfu=2.0 must be")]:
    status, stderr = cost.main(list(args)), capsys.readouterr().err
    assert status == 2 and f"FATAL: {message}" in stderr, (args, stderr[-800:])
    assert "Traceback" not in stderr


# ----------------------------------------------------------------------------- a run's ledger


def _workdir_with_cost(tmp_path):
  """A workdir whose cost.json is the hand-built preempted-and-resumed account of
  tests/test_accounting.py (400 steps on a v3-8, 100 redone)."""
  from tests.test_accounting import _preempted_and_resumed  # pylint: disable=g-import-not-at-top
  report = _preempted_and_resumed()[1]
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "cost.json").write_text(json.dumps(report))
  return workdir, report


def test_a_workdir_prints_its_ledger_and_draws_it(tmp_path, capsys):
  from vit_jax import ledger as ledger_lib  # pylint: disable=g-import-not-at-top
  workdir, report = _workdir_with_cost(tmp_path)
  two_hours_ago = time.time() - 7200
  os.utime(workdir / "cost.json", (two_hours_ago, two_hours_ago))
  assert cost.main([str(workdir)]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == (f"{workdir}: the account at step 400 ({workdir}/cost.json, written 2 h 00 min "
                    "ago); no run holds the workdir (finished, stopped or refused).")
  assert out[1:-1] == ledger_lib.format_ledger(report).splitlines()
  assert out[1].startswith("attempt  steps    on       program s  training  redone  compile")
  assert out[-1] == f"Figure: {workdir}/cost.png"
  with PIL.Image.open(workdir / "cost.png") as image:  # 6.3 x 4.5 inches at 100 dpi.
    assert (image.format, image.size) == ("PNG", (630, 450))
  # A lock.json of a process that is gone: a killed run; --figure elsewhere.
  (workdir / "lock.json").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1}))
  assert cost.main([str(workdir), "--figure", str(tmp_path / "f.png")]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith(f"; lock.json names pid {2**22 + 1} of this host, which is gone: the run "
                         "was killed.")
  assert out[-1] == f"Figure: {tmp_path}/f.png" and (tmp_path / "f.png").stat().st_size > 1000
  # Without cost.json: the latest checkpoint's account (Orbax's JSON of its 'cost' item).
  (workdir / "cost.json").unlink()
  saved = workdir / "checkpoints" / "300" / "cost"
  saved.mkdir(parents=True)
  (saved / "metadata").write_text(json.dumps(dict(report, step=300)))
  assert cost.main([str(workdir)]) == 0
  assert capsys.readouterr().out.startswith(
      f"{workdir}: the account at step 300 (checkpoint 300); lock.json names pid ")


def test_a_directory_without_a_cost_account_is_refused_with_the_fix(tmp_path, capsys):
  assert cost.main([str(tmp_path)]) == 2
  assert capsys.readouterr().err == (
      f"FATAL: {tmp_path} has no cost account: expected {tmp_path}/cost.json, which python -m "
      "vit_jax.main writes at every config.log_every_steps and at the end (a run that has not "
      "logged its first steps has none yet). Give the --workdir of a training run, or "
      "--config=FILE to predict a run's cost.\n")
  assert cost.main([str(tmp_path / "nope")]) == 2
  assert capsys.readouterr().err == (f"FATAL: WORKDIR {tmp_path}/nope is not a directory; give "
                                     "the --workdir of a run of python -m vit_jax.main.\n")
  assert cost.main([str(tmp_path), "--table2"]) == 2
  assert "FATAL: Give a WORKDIR (a run's ledger) or --config" in capsys.readouterr().err
  assert cost.main(["--figure", "x.png", "--table2"]) == 2
  assert "FATAL: --figure draws a run's ledger: give its WORKDIR." in capsys.readouterr().err
  assert not list(tmp_path.iterdir())


def test_a_cost_json_that_is_no_account_is_one_fatal_line_naming_it(tmp_path, capsys):
  """Too deep, of another shape, a directory: exit 2 and one FATAL line naming the file, the
  problem and the fix (was: a RecursionError or KeyError traceback)."""
  workdir, _ = _workdir_with_cost(tmp_path)
  cost_json = workdir / "cost.json"
  fix = "restore it, or delete it to see the latest checkpoint's account.\n"
  for text, problem in (
      ("[" * 300_000, "is nested more than 64 levels deep, deeper than any JSON file read here "
       "(a damaged or foreign file)"),
      ('{"attempts": [{"x": 1}], "seconds": {"program": 5e9}}',
       "is not a cost account of python -m vit_jax.main (hardware is missing)"),
      ("[1, 2]", "is not a JSON object")):
    cost_json.write_text(text)
    assert cost.main([str(workdir)]) == 2
    assert capsys.readouterr().err == f"FATAL: {cost_json} {problem}; {fix}"
  cost_json.unlink()
  cost_json.mkdir()
  assert cost.main([str(workdir)]) == 2
  assert capsys.readouterr().err == (f"FATAL: {cost_json} is a directory, not a JSON file: remove "
                                     "it (a run writes a file there).\n")


@pytest.mark.slow
def test_the_command_on_a_cost_json_nested_300000_deep_is_one_fatal_line(tmp_path):
  workdir, _ = _workdir_with_cost(tmp_path)
  (workdir / "cost.json").write_text("[" * 300_000)
  proc = _run_cost(str(workdir))
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.splitlines() == [
      f"FATAL: {workdir}/cost.json is nested more than 64 levels deep, deeper than any JSON file "
      "read here (a damaged or foreign file); restore it, or delete it to see the latest "
      "checkpoint's account."]
