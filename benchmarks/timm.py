"""timm's side of the benchmark: the timm model equivalent to one of ours, measured in PyTorch
(the optional 'bench' extra: torch and timm, imported where used; `import timm` is the library)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Any, Optional

from benchmarks.common import check_sizes
from benchmarks.common import fill_rates
from benchmarks.common import NoTimmModel
from benchmarks.common import peak_rss_mib
from benchmarks.common import rss_now_mib
from benchmarks.common import thread_facts
from benchmarks.common import timed

TIMM_SIZES = {"Ti": "tiny", "S": "small", "B": "base", "L": "large", "H": "huge"}
#: (size, patch) pairs timm registers under their own name; others go through keyword arguments.
TIMM_NAMED = {("Ti", 16), ("S", 16), ("S", 32), ("B", 8), ("B", 16), ("B", 32), ("L", 16),
              ("L", 32), ("H", 14)}
#: Fields passed as timm's keyword arguments where they differ from the named model's.
_ARCH_KEYS = ("hidden_size", "mlp_dim", "num_heads", "num_layers", "patch_size", "classifier")


def timm_equivalent(model: str, overrides: Optional[dict[str, Any]] = None
                    ) -> tuple[str, dict[str, Any], bool]:
  """`(timm name, create_model kwargs, grad checkpointing)` of the timm model matching ours:
  official sizes by name (ViT-B_16 -> 'vit_base_patch16_224'), other architectures, dropout and
  the fields' ``timm`` keywords as kwargs; what changes no compute is not passed. Raises
  NoTimmModel for T2T-ViT, hybrids, ViT-g/G and a representation layer."""
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  overrides = dict(overrides or {})
  family, match = models.resolve(model)
  if family.name not in ("ViT", "ViT-custom"):
    raise NoTimmModel(f"{model}: timm has no {family.name} model; only ours is measured "
                      "(the timm comparison covers plain ViTs).")
  config = models.model_config(model, **overrides)
  if config.get("representation_size"):
    raise NoTimmModel(f"{model}: timm's ViT has no representation (pre_logits) layer; only "
                      "ours is measured.")
  kwargs: dict[str, Any] = {}
  if family.name == "ViT":
    size = match.group("size")
    size = size if size in ("g", "G") else {k.lower(): k for k in TIMM_SIZES}[size.lower()]
    if size not in TIMM_SIZES:
      raise NoTimmModel(f"{model}: ViT-{size} has no timm equivalent; only ours is measured.")
    patch = int(match.group("patch"))
    base = models.model_config(model)
    name = (f"vit_{TIMM_SIZES[size]}_patch{patch}_224" if (size, patch) in TIMM_NAMED else
            f"vit_{TIMM_SIZES[size]}_patch16_224")
    changed = (size, patch) not in TIMM_NAMED or any(config[k] != base[k] for k in _ARCH_KEYS)
  else:
    name, changed = "vit_base_patch16_224", True
  if changed:
    ph, pw = config["patch_size"]
    kwargs.update(embed_dim=config["hidden_size"], depth=config["num_layers"],
                  num_heads=config["num_heads"],
                  mlp_ratio=config["mlp_dim"] / config["hidden_size"],
                  patch_size=ph if ph == pw else (ph, pw))
    if config["classifier"] == "gap":
      kwargs.update(class_token=False, global_pool="avg")
    elif config["classifier"] == "map":  # timm's AttentionPoolLatent: big_vision's MAPHead.
      kwargs.update(class_token=False, global_pool="map")
  # The fields timm takes as they are (its keyword in the declaration), where not the default:
  # timm's variants (LayerScale, registers, QK normalisation, ...), the attention's dropout.
  for field in models.vit_fields.VIT_FIELDS:
    if (field.timm and field.default is not models.fields.REQUIRED
        and config.get(field.name, field.default) != field.default):
      kwargs[field.timm] = config[field.name]
  if config.get("dropout_rate"):
    kwargs.update(pos_drop_rate=config["dropout_rate"], proj_drop_rate=config["dropout_rate"])
  return name, kwargs, bool(config.get("remat"))


def missing_bench_packages() -> list[str]:
  """The packages of the 'bench' extra that are missing."""
  return [name for name in ("torch", "timm") if importlib.util.find_spec(name) is None]


def _training_step(net, images, labels, autocast, sync):
  """timm's training step: cross-entropy, gradient clipping at 1, AdamW (decay 0.1 on matrices)."""
  import torch  # pylint: disable=g-import-not-at-top
  net.train()
  skip = set(net.no_weight_decay()) if hasattr(net, "no_weight_decay") else set()
  decay, no_decay = [], []
  for pname, param in net.named_parameters():
    (decay if param.ndim >= 2 and pname not in skip else no_decay).append(param)
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=1e-3, betas=(0.9, 0.999))
  loss_fn = torch.nn.CrossEntropyLoss()

  def run():
    opt.zero_grad(set_to_none=True)
    with autocast:
      logits = net(images)
    loss = loss_fn(logits.float(), labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    loss.item()
    sync()

  return run


def measure_timm(model: str, *, batch: int, resolution: int, dtype: str = "float32",
                 mode: str = "train", warmup: int = 2, steps: int = 5,
                 overrides: Optional[dict[str, Any]] = None, num_classes: int = 1000,
                 threads: Optional[int] = None, peak_flops: Optional[float] = None,
                 analytic_flops: Optional[float] = None, device: str = "cpu"
                 ) -> dict[str, Any]:
  """Measures timm's equivalent of `model` in this process, as `ours.measure_ours` (bfloat16:
  `torch.autocast`); `analytic_flops` and `peak_flops` are ours. Raises NoTimmModel,
  BenchmarkError (bad sizes), ImportError without torch."""
  check_sizes(batch, resolution, warmup, steps, mode, dtype)
  name, kwargs, checkpointing = timm_equivalent(model, overrides)
  timm, torchvision_ops = import_timm()
  import torch  # pylint: disable=g-import-not-at-top
  rss_after_imports = rss_now_mib()
  if threads:
    torch.set_num_threads(threads)
  torch.manual_seed(0)
  dev = torch.device("cuda" if device == "gpu" and torch.cuda.is_available() else "cpu")
  net = timm.create_model(name, pretrained=False, num_classes=num_classes, img_size=resolution,
                          **kwargs).to(dev)
  if checkpointing:
    net.set_grad_checkpointing(True)
  num_params = sum(p.numel() for p in net.parameters())
  images = torch.randn(batch, 3, resolution, resolution, device=dev)
  labels = torch.randint(0, num_classes, (batch,), device=dev)
  autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if dtype == "bfloat16"
              else contextlib.nullcontext())
  sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
  if mode == "train":
    run = _training_step(net, images, labels, autocast, sync)
  else:
    net.eval()

    def run():
      with torch.inference_mode(), autocast:
        net(images)
      sync()

  first, times = timed(run, warmup, steps)
  result: dict[str, Any] = {
      "framework": "timm", "model": model, "timm_model": name, "timm_kwargs": kwargs,
      "grad_checkpointing": checkpointing, "overrides": dict(overrides or {}), "mode": mode,
      "batch": batch, "resolution": resolution, "dtype": dtype, "num_classes": num_classes,
      "num_params": int(num_params), "warmup_steps": warmup, "timed_steps": steps,
      "lower_seconds": None, "compile_seconds": None, "first_step_seconds": first,
      "flops_per_step_xla": None, "flops_per_step_analytic": analytic_flops,
      "peak_rss_mib": peak_rss_mib(), "rss_after_imports_mib": rss_after_imports,
      "device_peak_mib": (torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda"
                          else None),
      "platform": "gpu" if dev.type == "cuda" else "cpu", "device_kind": str(dev),
      "torchvision_ops": torchvision_ops,
      "peak_flops_per_device": peak_flops, "peak_source": "ours (same device)",
      "threads": dict(thread_facts(), torch_num_threads=torch.get_num_threads(),
                      torch_num_interop_threads=torch.get_num_interop_threads()),
  }
  fill_rates(result, batch, times)
  return result


def import_timm():
  """`(timm, whether torchvision's ops loaded)`. torchvision 0.28 fails on import when its C++
  ops do not load (e.g. a CUDA wheel beside a CPU torch); timm's ViT uses none of them, so their
  two schemas are declared and the import retried."""
  import torch  # pylint: disable=g-import-not-at-top
  try:
    import timm  # pylint: disable=g-import-not-at-top
    return timm, True
  except RuntimeError as e:
    if "torchvision::" not in str(e):
      raise
  for name in [m for m in sys.modules if m.split(".")[0] in ("torchvision", "timm")]:
    del sys.modules[name]
  library = torch.library.Library("torchvision", "FRAGMENT")
  for op in ("nms", "qnms"):
    library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
  import_timm.library = library  # Registrations last as long as the library object.
  import timm  # pylint: disable=g-import-not-at-top,redefined-outer-name
  return timm, False
