"""The training config: defaults, the shipped configs, `resolve` (regime, lengths, ranges,
attention) and the parser of the configs' arguments (vit_jax.config)."""

import dataclasses
import json
import pathlib
import re
import shutil

import jax
import ml_collections
import pytest

from tests import data_utils
from vit_jax import cli
from vit_jax import config as config_lib
from vit_jax import models as models_lib
from vit_jax import param_groups
from vit_jax import train

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.py"))
# Every shipped config file with the arguments it is run with in the consumed-keys test.
SHIPPED = [("configs/fashion_mnist.py", None),
           ("configs/fashion_mnist.py", "t2t"),
           ("configs/t2t.py", "14"),
           ("configs/vit.py", "ti16,cifar10"),
           ("configs/vit.py", "b16,imagenet21k"),
           ("configs/vit.py", "b16,imagenet2012,finetune")]
CPU = jax.devices()[:1]


def _tiny_config(regime="pretrain"):
  config = config_lib.get_config("ViT-custom", "fashion_mnist_local", hidden_size=8, mlp_dim=16,
                                 num_heads=2, num_layers=1, patch_size=4)
  config.regime = regime
  return config


def _resolve(config, examples=1000, classes=10, devices=CPU):
  return config_lib.resolve(config, num_train_examples=examples, num_classes=classes,
                            devices=devices)


# ----------------------------------------------------------------------------- regimes


def test_regime_defaults_follow_the_paper():
  pre = config_lib.fill_regime(_tiny_config("pretrain"))
  assert (pre.optim.optimizer, pre.optim.schedule, pre.loss) == ("adamw", "linear", "sigmoid_xent")
  assert (pre.optim.lr, pre.optim.b1, pre.optim.b2, pre.optim.weight_decay) == (1e-3, 0.9, 0.999, 0.1)
  assert pre.model.head_bias_init == -10.0
  fine = config_lib.fill_regime(_tiny_config("finetune"))
  assert (fine.optim.optimizer, fine.optim.schedule, fine.loss) == ("sgd", "cosine", "softmax_xent")
  assert (fine.optim.momentum, fine.optim.grad_clip_norm, fine.optim.weight_decay) == (0.9, 1.0, 0.0)
  assert (fine.optim.warmup_steps, fine.model.head_bias_init) == (500, 0.0)


def test_vit_pretraining_presets_are_the_papers_table_3():
  """configs/vit.py pretrains with the ViT paper's Table 3 (App. B.1) per dataset."""
  for dataset, expected in [("imagenet2012", (300.0, 3e-3, "cosine", 0.3, 0.1)),
                            ("imagenet21k", (90.0, 1e-3, "linear", 0.03, 0.1))]:
    config = config_lib.fill_regime(_load_config("configs/vit.py", f"b16,{dataset}"))
    assert (config.num_epochs, config.optim.lr, config.optim.schedule, config.optim.weight_decay,
            config.model.dropout_rate) == expected, dataset
    assert (config.batch_size, config.optim.warmup_steps, config.optim.grad_clip_norm,
            config.model.representation_size) == (4096, 10_000, 1.0, 768)
  other = config_lib.fill_regime(_load_config("configs/vit.py", "b16,cifar10"))
  assert (other.optim.lr, other.optim.schedule, other.model.dropout_rate) == (1e-3, "linear", 0.0)


def test_regime_keeps_explicit_values_and_rejects_unknown_regime():
  config = _tiny_config("finetune")
  config.optim.lr = 0.01
  config.loss = "sigmoid_xent"
  resolved = config_lib.fill_regime(config)
  assert (resolved.optim.lr, resolved.loss) == (0.01, "sigmoid_xent")
  assert config.optim.optimizer is None  # The caller's config is not modified.
  config.regime = "pretraining"
  with pytest.raises(ValueError, match=r"config.regime='pretraining' must be one of "
                     r"\('pretrain', 'finetune'\)"):
    config_lib.fill_regime(config)


def test_batch_size_and_schedule_length_checks():
  config_lib.check_batch_size(512, 2, 8)
  with pytest.raises(config_lib.ConfigError,
                     match=r"multiple of 16; use config.batch_size=496 or 512\.") as refused:
    config_lib.check_batch_size(500, 2, 8)
  assert (refused.value.key, refused.value.value) == ("batch_size", 500)
  assert cli.error_text(refused.value).endswith("; use --config.batch_size=496 or 512.")
  config = _tiny_config()
  with pytest.raises(ValueError, match="leave the schedule's length unset; set "
                     "config.total_steps=N or config.num_epochs=E"):
    config_lib.num_train_steps(config, 1000)
  config.batch_size = 64
  config.num_epochs = 2.5
  assert config_lib.num_train_steps(config, 1000) == 40  # ceil(2500 / 64)
  config.total_steps = 7  # Takes precedence over epochs.
  assert config_lib.num_train_steps(config, 1000) == 7
  config.total_steps = 0
  with pytest.raises(ValueError, match="0 training steps"):
    config_lib.num_train_steps(config, 1000)


@pytest.mark.parametrize("changes,message", [
    # Issue 37: an OverflowError 35 s into the run, after the workdir was written.
    ({"num_epochs": 1e30}, r"config.num_epochs=1e\+30 is 4.69e\+32 steps of batch 128 over "
     r"60,000 examples, more than the 2,147,483,647 a run can count \(its step is an int32\); "
     r"set config.num_epochs to at most 4.581e\+06\."),
    ({"num_epochs": 1e308}, r"config.num_epochs=1e\+308 is inf steps"),
    ({"num_epochs": 1.0, "optim.warmup_epochs": 1e300},
     r"config.optim.warmup_epochs=1e\+300 is .* set config.optim.warmup_epochs to at most"),
    ({"total_steps": 2**31}, r"config.total_steps=2147483648 must be a positive int <= "
     r"2,147,483,647 \(the int32 step counter\)"),
])
def test_step_counts_past_the_int32_step_are_refused_naming_the_value(changes, message):
  config = _tiny_config()
  config.batch_size = 128
  with config.unlocked():
    data_utils.override(config, changes)
  with pytest.raises(ValueError, match=message):
    _resolve(config, examples=60_000)


def test_a_batch_larger_than_an_epoch_or_the_memory_is_refused_with_one_that_fits():
  config = _tiny_config()
  config.update(batch_size=1_000_000_000, num_classes=10)
  config.data.image_size = 28
  with pytest.raises(ValueError, match=r"config.batch_size=1000000000 is more than the 60,000 "
                     r"training examples of an epoch \(config.data.train_split\): .*; set "
                     r"config.batch_size=60000 or less\."):
    config_lib.check_host_limits(config, num_train_examples=60_000, available_bytes=2**40)
  with pytest.raises(ValueError,
                     match=r"train_split; 30,000 per process of 2\): .*batch_size=59997 "):
    config_lib.check_host_limits(config, num_train_examples=60_001, process_count=2,
                                 available_bytes=2**40, unit=7)
  # 2 prefetched + 3 in flight float32 batches of 28 x 28 x 3 images and 10 targets: 47,240 B
  # per image; half of 1 GiB holds 11,365 of them.
  config.batch_size = 40_000
  with pytest.raises(ValueError, match=r"config.batch_size=40000 needs ~1.8 GiB of host memory "
                     r"per process for its 5 float32 batches of 28x28 images in flight "
                     r"\(config.data.prefetch=2 \+ 3\), more than 50% of the 1.0 GiB available"
                     r": .*; set config.batch_size=11360 or less"):
    config_lib.check_host_limits(config, num_train_examples=60_000, available_bytes=2**30,
                                 unit=16)
  config.batch_size = 11_360
  config_lib.check_host_limits(config, num_train_examples=60_000, available_bytes=2**30)
  # A run on this host (resolve's devices None) is checked before its schedule, which the batch
  # sets (issue 37: --config.batch_size=1000000000 grew to 22 GB until the OOM killer ended it).
  config = _tiny_config()
  config.update(batch_size=1_000_000_000, num_epochs=10.0)
  with pytest.raises(ValueError, match="is more than the 60,000 training examples of an epoch"):
    config_lib.resolve(config, num_train_examples=60_000, num_classes=10)
  config.batch_size = len(jax.devices()) * 10**7  # 30 TB of 224 x 224 images in flight.
  with pytest.raises(ValueError, match=rf"config.batch_size={config.batch_size} needs ~.* GiB"):
    config_lib.resolve(config, num_train_examples=10**12, num_classes=10)


def test_a_position_table_larger_than_the_memory_is_refused_before_the_workdir(tmp_path,
                                                                              monkeypatch):
  """Issue 50: --config.model.posemb_grid='(100000,100000)' wrote the workdir, then waited
  forever initialising a 10^10-row table."""
  config = _tiny_config()
  config.update(batch_size=4, num_classes=10)
  config.model.posemb_grid = (100000, 100000)
  # 10^10 + 1 (class token) rows x 8 x 16 B (parameter, gradient, 2 moments) = 1,192.1 GiB; in
  # 1 GiB: 2^30 // 128 - 1 = 8,388,607 grid rows, 2896^2.
  check = lambda: config_lib.check_host_limits(config, num_train_examples=100,
                                               available_bytes=2**30)
  with pytest.raises(ValueError) as raised:
    check()
  assert str(raised.value) == (
      "config.model.posemb_grid=(100000, 100000) makes a learned position table of "
      "10,000,000,001 x 8 parameters whose training state (16 B each: the float32 parameter, its "
      "gradient, the optimizer's moments) needs ~1,192.1 GiB, more than the 1.0 GiB of memory "
      "available on this host; set config.model.posemb_grid to the token grid of the table to "
      "load (at most (2896, 2896) here; e.g. (14, 14) for 224 px at patch 16), or leave it out "
      "(the images' grid).")
  config.model.posemb_grid = (2896, 2896)
  check()
  config.update(ema_decay=0.9999)  # The EMA: 20 B per parameter.
  with pytest.raises(ValueError, match=r"\(20 B each: .*moments and the EMA\) .*\(at most "
                     r"\(2590, 2590\) here"):
    check()
  # Through the trainer: one ValueError (a FATAL line), nothing written.
  data_utils.skip_cpu_peak_measurement(monkeypatch)
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=2,
                                        size=8)
  config = _tiny_config()
  config.data.update(image_folder=folder, image_size=8, shuffle_buffer=16)
  config.update(batch_size=4, total_steps=2)
  config.model.posemb_grid = (100000, 100000)
  workdir = tmp_path / "never_created"
  with pytest.raises(train.ConfigError, match=r"config.model.posemb_grid=\(100000, 100000\) "
                     r"makes a learned position table of 10,000,000,001 x 8 parameters"):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


# ----------------------------------------------------------------------------- resolve


def test_resolve_fills_lengths_classes_and_attention_and_locks():
  config = config_lib.get_config("T2T-ViT-7", "imagenet2012")
  config.batch_size = 100
  config.num_epochs = 3.0
  config.optim.update(warmup_epochs=1.0, cooldown_epochs=0.5, warmup_steps=99)
  resolved = _resolve(config, examples=1000, classes=7)
  assert resolved.is_locked and not config.optim.warmup_epochs is None  # The input is unchanged.
  assert (resolved.total_steps, resolved.optim.warmup_steps, resolved.optim.cooldown_steps) == (
      30, 10, 5)
  assert resolved.optim.warmup_epochs is None and resolved.optim.cooldown_epochs is None
  assert resolved.num_classes == 7 and resolved.loss == "sigmoid_xent"
  assert resolved.model.attention in models_lib.ATTENTION_IMPLEMENTATIONS
  # Resolving a resolved config changes nothing: what config.json holds reproduces the run.
  again = _resolve(config_lib.from_json(config_lib.to_json(resolved)), examples=1000, classes=7)
  assert json.loads(config_lib.to_json(again)) == json.loads(config_lib.to_json(resolved))
  # A config.json nested too deep or of another shape: a ValueError naming the field.
  for text, problem in (("[" * 300_000, "The config is nested more than 64 levels deep"),
                        ('{"model_name": 3}', "A config's model_name is a string, got 3."),
                        ('{"model_name": "ViT-B_16", "model": [1]}',
                         "A config's model is a JSON object, got [1].")):
    with pytest.raises(ValueError, match=re.escape(problem)):
      config_lib.from_json(text)


def test_resolve_takes_pretrained_dir_and_refuses_a_missing_checkpoint(tmp_path):
  config = _tiny_config()
  config.total_steps = 10
  config.optim.warmup_steps = 1
  config.pretrained_dir = str(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"ViT-custom.npz' \(config.pretrained_dir"):
    _resolve(config)
  shutil.copy(ROOT / "tests" / "fixtures" / "vit_tiny" / "params.npz", tmp_path / "ViT-custom.npz")
  with pytest.raises(config_lib.ConfigError,
                     match=r"field mismatches \(3\): model.hidden_size: weights 32"):
    _resolve(config)  # Another architecture than the weights': the mismatch report (issue 52).
  config.model.update(hidden_size=32, num_layers=2, mlp_dim=64)  # The fixture's.
  assert _resolve(config).init_from == f"{tmp_path}/ViT-custom.npz"


@pytest.mark.parametrize("key,value,message", [
    ("optim.lr", -1.0, r"config.optim.lr=-1.0 must be > 0 \(the peak learning rate;"),
    ("optim.lr", float("inf"), r"config.optim.lr=inf must be finite and > 0 \(the peak"),
    ("workdir_lock_timeout", 0, r"config.workdir_lock_timeout=0 must be > 0 \(seconds without "),
    ("batch_size", 0, r"config.batch_size=0 must be a positive int"),
    ("optim.b2", 1.0, r"config.optim.b2=1.0 must be in \[0, 1\)"),
    ("label_smoothing", 1.5, r"config.label_smoothing=1.5 must be in \[0, 1\)"),
    ("keep_checkpoints", 0, r"config.keep_checkpoints=0 must be a positive int"),
    ("input_wait_warning", 1.0, r"config.input_wait_warning=1.0 must be in \[0, 1\) \(warn when "
     r".* this share of their time .*; 0 turns the warning off\)"),
    ("optim.max_skipped_updates", -2, r"max_skipped_updates=-2 must be an int >= 0"),
    ("data.prefetch", -1, r"config.data.prefetch=-1 must be an int >= 0"),
    ("data.eval_crop_pct", 1.5, r"eval_crop_pct=1.5 must be in \(0, 1\] or None"),
    ("data.augment", "crop", r"config.data.augment='crop' must be one of"),
    ("loss", "hinge", r"config.loss='hinge' must be one of \('softmax_xent', 'sigmoid_xent'\)"),
    ("mesh.max_replicated_fraction", 2.0, r"must be in \[0, 1\] \(a probability\)"),
    ("model.attention", "flash", r"config.model.attention='flash' is not one of"),
    ("model.remat_policy", "some", r"config.model.remat_policy='some' is not one of"),
])
def test_resolve_refuses_values_out_of_range_naming_the_flag(key, value, message):
  config = _tiny_config()
  config.total_steps = 10
  config.optim.warmup_steps = 1
  with config.unlocked():
    data_utils.override(config, {key: value})
  with pytest.raises(ValueError, match=message) as refused:
    _resolve(config)
  if not key.startswith("model."):  # The model's fields: vit_jax.models' own checks.
    assert (refused.value.key, refused.value.value) == (key, value)
    assert cli.error_text(refused.value).endswith(f"; set --config.{key} to such a value.")


def test_resolve_refuses_a_mesh_or_batch_the_devices_cannot_take():
  config = _tiny_config()
  config.total_steps, config.optim.warmup_steps, config.batch_size = 10, 1, 6
  config.grad_accum_steps = 4
  with pytest.raises(ValueError, match="cannot be split into 4 micro-batch"):
    _resolve(config)
  config.grad_accum_steps, config.mesh.data = 1, 2
  with pytest.raises(ValueError, match="has 2 devices but there are 1"):
    _resolve(config)


# ----------------------------------------------------------------------------- configs/*.py


def _load_config(path, arg):
  return cli.load_config_file(f"{path}:{arg}" if arg else path)


def test_shipped_configs_are_covered():
  """Every configs/*.py is exercised by the consumed-keys test below."""
  assert sorted({p for p, _ in SHIPPED}) == CONFIGS


@pytest.mark.parametrize("path,arg", SHIPPED)
def test_shipped_configs_build_and_resolve(path, arg):
  config = _load_config(path, arg)
  assert config.is_locked
  resolved = _resolve(config, examples=1_281_167, classes=1000)
  fields = dict(resolved.model.to_dict())
  assert fields.pop("attention") in models_lib.ATTENTION_IMPLEMENTATIONS
  models_lib.model_config(resolved.model_name, **fields)


def test_config_arguments_are_parsed_one_way():
  spec = config_lib.args.Spec("configs/x.py", ("model", "dataset", "regime"),
                              choices={"regime": ("pretrain", "finetune")},
                              defaults={"regime": "pretrain"})
  assert spec.parse("b16,cifar10") == {"model": "b16", "dataset": "cifar10", "regime": "pretrain"}
  assert spec.parse("b16,regime=finetune,dataset=c") == {
      "model": "b16", "dataset": "c", "regime": "finetune"}
  assert spec.usage() == "configs/x.py:<model>,<dataset>[,<regime>]"
  for arg, message in [("b16", r"needs <dataset>: use configs/x.py:<model>,<dataset>\[,<regime>\]"),
                       ("a,b,c,d", "takes at most 3 values"),
                       ("a,b,regime=tune", "<regime> must be one of pretrain, finetune"),
                       ("a,b,size=3", "unknown field 'size'"),
                       ("model=a,b", "follows a 'name=value' item"),
                       ("a,model=b,dataset=c", "'model' is given twice")]:
    with pytest.raises(ValueError, match=message):
      spec.parse(arg)
  with pytest.raises(ValueError, match=r"configs/vit.py: <regime> must be one of pretrain, "
                     "finetune, got 'tune'"):
    _load_config("configs/vit.py", "b16,cifar10,tune")
  with pytest.raises(ValueError, match="configs/fashion_mnist.py: <model> must be one of vit, t2t"):
    _load_config("configs/fashion_mnist.py", "resnet")


def test_a_patterned_field_takes_its_value_from_an_earlier_optional_place():
  spec = config_lib.args.Spec("configs/x.py", ("model", "dataset", "regime", "slice"),
                              choices={"regime": ("pretrain", "finetune")},
                              defaults={"regime": "pretrain", "slice": None},
                              patterns={"slice": config_lib.slices.SLICE_PATTERN})
  expect = {"model": "b16", "dataset": "i21k", "regime": "pretrain", "slice": "v3-32"}
  assert spec.parse("b16,i21k,v3-32") == expect
  assert spec.parse("b16,i21k,pretrain,v3-32") == expect
  assert spec.parse("b16,i21k,slice=v3-32") == expect
  assert spec.parse("b16,i21k,finetune")["slice"] is None
  # A required field is never skipped: 'v3-32' is the dataset here, and the regime stays checked.
  assert spec.parse("b16,v3-32")["dataset"] == "v3-32"
  with pytest.raises(ValueError, match="<regime> must be one of pretrain, finetune, got 'v3'"):
    spec.parse("b16,i21k,v3")


# ----------------------------------------------------------------------------- slices

GIB = 2**30


@pytest.mark.parametrize("arg, fsdp, accumulation", [
    ("b16,imagenet21k,v3-8", 1, 4),   # 512 images per core, 128 per micro-batch.
    ("b16,imagenet21k,v3-32", 1, 1),  # 128 per core fit at once.
    ("l16,imagenet21k,v3-8", 4, 4),   # 4.9 GiB of replicated state: sharded over 4 cores.
    ("l16,imagenet21k,v3-32", 4, 1),
    ("h14,imagenet2012,v3-32", 8, 4),
    ("b16,imagenet2012,finetune,v3-8", 1, 2),  # 384 px: 577 tokens.
    ("b16,imagenet21k,v4-32", 1, 1),  # 16 chips of 32 GiB.
])
def test_a_slice_fits_the_papers_batch_with_bfloat16_fsdp_and_accumulation(arg, fsdp,
                                                                          accumulation):
  config = _load_config("configs/vit.py", arg)
  fitted = _load_config("configs/vit.py", arg.rsplit(",", 1)[0])  # The same without a slice.
  assert (fitted.model.dtype, fitted.grad_accum_steps, fitted.slice) == ("float32", 1, None)
  assert config.batch_size == fitted.batch_size  # The recipe's batch is kept...
  assert (config.model.dtype, config.mesh.data, config.mesh.fsdp, config.grad_accum_steps,
          config.slice) == ("bfloat16", -1, fsdp, accumulation, arg.rsplit(",", 1)[1])
  resolved = _resolve(config, examples=1_281_167, devices=[FakeTPU()] * (
      config_lib.slices.accounting.accelerator(config.slice).num_devices))
  # bfloat16 on a TPU: ViT-L and wider keep only q, k and v.
  wide = config.model.hidden_size >= 1024
  assert resolved.model.remat_policy == (
      "qkv_saveable" if wide else "dots_and_attention_saveable")


@dataclasses.dataclass(frozen=True)
class FakeTPU:
  platform: str = "tpu"
  device_kind: str = "TPU v3"
  id: int = 0


def test_the_slice_estimate_is_the_compilers_figure_within_its_margin():
  """ViT-B/16 at 224 px, 64 images per v3 core: the TPU compiler's temporaries (docs/pods.md)
  are 4.00 GiB in bfloat16 with the projections kept and 2.27 GiB in float32 keeping only
  each block's input; the estimate covers them within 25%."""
  fields = config_lib.get_config("ViT-B_16", "imagenet2012").model.to_dict()
  slices = config_lib.slices
  bf16 = 64 * slices.activation_bytes(
      "ViT-B_16", dict(fields, dtype="bfloat16", remat_policy="dots_and_attention_saveable"), 224)
  f32 = 64 * slices.activation_bytes(
      "ViT-B_16", dict(fields, dtype="float32", remat_policy="nothing_saveable"), 224)
  assert 4.00 * GIB < bf16 + 0.32 * GIB < 1.25 * 4.00 * GIB  # + the float32 gradient.
  assert 2.27 * GIB < f32 + 0.32 * GIB < 1.25 * 2.27 * GIB


def test_the_estimates_count_the_tokens_the_models_run():
  """Register tokens join the class token; T2T-ViT's sequences are its soft splits' grids
  (230 px: 57^2, 29^2, 15^2 tokens, where S/4, S/8, S/16 rounded up would say 58, 29, 15)."""
  sequences = config_lib.slices._sequences  # pylint: disable=protected-access
  vit = config_lib.get_config("ViT-custom", "imagenet2012", hidden_size=8, mlp_dim=16,
                              num_heads=2, num_layers=3, patch_size=4, num_registers=4)
  fields = dict(vit.model.to_dict(), remat_policy="nothing_saveable")
  assert sequences("ViT-custom", fields, 32) == [(3, 64 + 1 + 4, 8, 2)]
  t2t = config_lib.get_config("T2T-ViT-7", "imagenet2012").model.to_dict()
  t2t["remat_policy"] = "nothing_saveable"
  assert sequences("T2T-ViT-7", t2t, 230) == [(7, 15**2 + 1, 256, 4), (1, 57**2, 64, 0),
                                               (1, 29**2, 64, 0)]


def test_a_slice_that_cannot_take_the_batch_or_the_model_is_refused():
  with pytest.raises(ValueError, match=r"config.batch_size=4096 \(the global batch\) cannot be "
                     r"split over the 24 devices of v4-48.*config.batch_size=4080"):
    _load_config("configs/vit.py", "b16,imagenet21k,v4-48")
  for arg in ("b16,imagenet21k,slice=a100-8", "b16,imagenet21k,a100-8"):
    with pytest.raises(ValueError, match="a Cloud TPU type .* got 'a100-8'"):
      _load_config("configs/vit.py", arg)
  with pytest.raises(ValueError, match="Accelerator 'v3-12' does not exist"):
    _load_config("configs/vit.py", "b16,imagenet21k,v3-12")
  with pytest.raises(ValueError, match=r"does not fit a device of v5litepod-1 even one image at "
                     r"a time \(28.0 GiB of state.*use a larger slice"):
    _load_config("configs/vit.py", "G14,imagenet21k,v5litepod-1")
  # Settings fitted to 32 devices are not run on 8 (nor on this CPU).
  config = _load_config("configs/vit.py", "ti16,imagenet21k,v3-32")
  with pytest.raises(ValueError, match=r"config.slice='v3-32' fitted .* to its 32 devices, but "
                     r"the step runs on 8; .* or config.slice= to run"):
    _resolve(config, devices=[FakeTPU()] * 8)
  # Two such slices (dcn_data=2): 2 x 32 devices, not 32.
  config.mesh.dcn_data = 2
  with pytest.raises(ValueError, match=r"fitted .* to its 32 devices x 2 slices = 64, but the "
                     r"step runs on 32;"):
    _resolve(config, devices=[FakeTPU()] * 32)


def _record_consumed_keys(monkeypatch):
  """Patches ConfigDict to record (keys of the section, key) for every read of a key."""
  seen = set()
  original = ml_collections.ConfigDict.__getitem__

  def getitem(self, key):
    seen.add((tuple(sorted(self._fields)), key))
    return original(self, key)

  monkeypatch.setattr(ml_collections.ConfigDict, "__getitem__", getitem)
  return seen


def _leaf_keys(config):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaf_keys(value)
    else:
      yield tuple(sorted(config.keys())), key


@pytest.mark.slow
def test_every_config_key_is_consumed(tmp_path, monkeypatch):
  """Runs shipped configs for two steps on tiny data; every key must be read by the code."""
  folder = data_utils.make_image_folder(str(tmp_path / "images"),
                                        num_classes=data_utils.MULTILABEL_NUM_CLASSES,
                                        per_class=2, size=8)
  multi_label = data_utils.make_multilabel_dataset(str(tmp_path / "tfds"))
  seen = _record_consumed_keys(monkeypatch)
  unread = None
  # One config per model family and regime (T2T-ViT's recipe pretrains, the ViT one fine-tunes),
  # the ViT one with an extra eval set: fewer runs can only leave more keys unread (the other
  # shipped configs have the same keys, and each of them is resolved in
  # test_shipped_configs_build_and_resolve).
  for i, (path, arg) in enumerate([("configs/t2t.py", "14"),
                                   ("configs/vit.py", "b16,imagenet2012,finetune")]):
    config = _load_config(path, arg)
    all_keys = set(_leaf_keys(config))
    with config.unlocked():
      # Same keys, tiny values: a 2-step run on an 8x8 image folder.
      config.data.image_folder = folder
      config.data.train_split, config.data.eval_split = "train", "test"
      if config.extra_eval.name:  # ImageNet ReaL in the ImageNet config: a tiny stand-in.
        config.extra_eval.name, config.extra_eval.split = multi_label, "test"
      config.data.image_size = 8
      config.data.shuffle_buffer = 16
      if "embed_dim" in config.model:  # T2T-ViT
        config.model.update(embed_dim=16, depth=1, num_heads=2, token_dim=8)
      else:
        config.model.update(hidden_size=8, mlp_dim=16, num_heads=2, num_layers=1,
                            patch_size=(4, 4))
      if config.model.get("representation_size") is not None:
        config.model.representation_size = 8
      config.batch_size = 4
      config.total_steps = 2
      config.optim.warmup_steps = 1
      if config.optim.warmup_epochs is not None:  # The T2T recipe: 2 of 16 images per epoch.
        config.optim.warmup_epochs = config.optim.cooldown_epochs = 0.125
      config.log_every_steps = 1
      config.eval_every_steps = config.checkpoint_every_steps = 2  # Once, at the end.
    results = train.train_and_evaluate(config, str(tmp_path / f"run{i}"))
    assert results["step"] == 2 and 0.0 <= results["test/accuracy"] <= 1.0
    if config.extra_eval.name:
      assert 0.0 <= results["1_0_0_test/accuracy"] <= 1.0  # '<dir basename>_<split>' 
    unread = (all_keys - seen) if unread is None else (unread & (all_keys - seen))
  assert not unread, f"Config keys no code reads: {sorted(k for _, k in unread)}"


def test_t2t_qk_scale_is_a_float_override():
  """The released T2T-ViT weights need qk_scale = D**-0.5 (a float) from the command line."""
  config = config_lib.get_config("T2T-ViT-14", "imagenet2012")
  assert config.model.qk_scale is None  # head_dim**-0.5, the from-scratch default.
  config.model.qk_scale = 384 ** -0.5
  fields = dict(config.model.to_dict(), attention="xla",
                remat_policy="nothing_saveable")  # What resolve picks for the devices.
  model = models_lib.create(config.model_name, num_classes=10, **fields)
  assert model.qk_scale == pytest.approx(0.0510310363)


def test_model_fields_without_a_default_take_their_type_from_the_command_line():
  """A None-default field's placeholder has the field's type: `layerscale_init` a float (was:
  `=1e-5` refused as no int), `posemb_grid` a tuple."""
  config = cli.load_config(["--config=configs/fashion_mnist.py",
                            "--config.model.layerscale_init=1e-5",
                            "--config.model.posemb_grid=(4,6)"])
  assert config.model.layerscale_init == 1e-5 and config.model.posemb_grid == (4, 6)


def test_every_key_is_declared_once_and_its_default_passes_its_check():
  """The config is built from the declaration (vit_jax.config.defaults): each key of
  get_config() outside config.model is one Key, none twice in a section, each default (or None,
  its placeholder) accepted by its own check; the fine-tuning controls are read from it."""
  config = config_lib.get_config("ViT-B_16", "imagenet2012")
  declared = {"": config_lib.defaults.RUN_KEYS, **{
      name: keys for name, (keys, _) in config_lib.defaults.SECTIONS.items() if name != "model"}}
  for name, keys in declared.items():
    section = config[name] if name else config
    names = [k.name for k in keys]
    assert len(set(names)) == len(names), name
    leaves = {k for k, v in section.items() if not isinstance(v, ml_collections.ConfigDict)}
    assert leaves == set(names), name
    for key in keys:
      assert section[key.name] == key.default or name == "data" and key.name == "name"
      assert key.refuse(key.default, name) is None or key.filled, (name, key.name)
  assert len(set().union(*[{(n, k.name) for k in keys} for n, keys in declared.items()])) == 96
  controls = config_lib.defaults.FINETUNE_KEYS
  assert [k.name for k in controls] == [f.name for f in dataclasses.fields(
      param_groups.FinetuneControls)]
  assert set(controls) <= set(config_lib.defaults.OPTIM_KEYS)


def test_resume_changes_name_each_changed_key_and_whether_it_changes_what_is_trained():
  """A resumed run's config against its config.json: model fields, sections and top-level keys
  are compared in JSON terms; how a run executes, logs or evaluates is not what it trains."""
  recorded = json.loads(config_lib.to_json(_tiny_config()))
  assert config_lib.resume_changes(recorded, _tiny_config()) == []  # Tuples equal their lists.
  config = _tiny_config()
  config.total_steps = 30
  config.model.mlp_dim = 32
  config.model.remat = False
  config.optim.lr = 0.5
  config.mesh.fsdp = 2
  config.eval_every_steps = 10
  config.fewshot.shots = (2,)
  del recorded["data"]["cache"]  # A key an older version did not record.
  recorded["gone"] = 1  # A key this version no longer has.
  assert sorted(config_lib.resume_changes(recorded, config)) == [
      ("eval_every_steps", 1000, 10, False), ("fewshot.shots", [1, 5, 10, 25], [2], False),
      ("mesh.fsdp", 1, 2, False), ("model.mlp_dim", 16, 32, True),
      ("model.remat", True, False, False), ("optim.lr", None, 0.5, True),
      ("total_steps", None, 30, True)]
