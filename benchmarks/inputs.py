"""The training input pipeline alone: the images/s and images per CPU-second `vit_jax.data`
delivers for a recipe's preprocessing, and timm's DataLoader doing the same (TensorFlow, torch
and timm imported where used: timm's processes do not load TensorFlow)."""

from __future__ import annotations

import math
import os
import tempfile
import time
from typing import Any, Optional

from benchmarks.common import available_cores
from benchmarks.common import BenchmarkError
from benchmarks.common import check_sizes
from benchmarks.common import peak_rss_mib
from benchmarks.common import thread_facts

INPUTS = ("fashion_mnist", "jpeg")
INPUT_LABELS = {"fashion_mnist": "Fashion-MNIST (28x28 PNG)",
                "jpeg": "JPEG folder (500x375 JPEG)"}
JPEG_SIZE = (375, 500)  # height, width
JPEG_COUNT = 256
#: The recipes whose training preprocessing is measured: 'vit' (the config defaults: Inception
#: crop of 5-100% of the area, flip, [-1, 1]) and 't2t' (configs/t2t.py: `T2T_DATA`).
RECIPES = ("vit", "t2t")
RECIPE_LABELS = {"vit": ("ViT", "Inception crop, flip"),
                 "t2t": ("T2T-ViT", "+ RandAugment, erasing, Mixup/CutMix")}
#: configs/t2t.py's `config.data` augmentation fields (tests/tools/test_benchmark.py compares).
T2T_DATA = {"augment": "inception_crop", "inception_crop_min_area": 0.08,
            "normalization": "imagenet", "randaugment_num_layers": 2,
            "randaugment_magnitude": 9.0, "randaugment_magnitude_std": 0.5,
            "random_erasing": 0.25, "mixup_alpha": 0.8, "cutmix_alpha": 1.0,
            "mix_switch_prob": 0.5, "mix_prob": 1.0}
#: Images timed per recipe measurement, and as many before (at least; whole batches).
RECIPE_IMAGES = 640


def write_jpeg_folder(root: str, count: Optional[int] = None, pil: bool = False) -> None:
  """`count` (default `JPEG_COUNT`) random JPEGs of `JPEG_SIZE` in root/train/class<i % 4>/,
  the same with TensorFlow or (`pil`, for timm's processes) Pillow: quality 90, 4:2:0."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  height, width = JPEG_SIZE
  cells = np.stack(np.meshgrid(np.linspace(0, height // 25 - 1, height),
                               np.linspace(0, width // 25 - 1, width), indexing="ij"))
  for i in range(JPEG_COUNT if count is None else count):
    folder = os.path.join(root, "train", f"class{i % 4}")
    os.makedirs(folder, exist_ok=True)
    coarse = rng.uniform(0, 255, (height // 25, width // 25, 3)).astype(np.float32)
    # Smooth colour fields (bilinear between 25-pixel cells) and some texture, as photographs.
    y, x = cells
    y0, x0 = np.floor(y).astype(int), np.floor(x).astype(int)
    y1, x1 = np.minimum(y0 + 1, coarse.shape[0] - 1), np.minimum(x0 + 1, coarse.shape[1] - 1)
    fy, fx = (y - y0)[..., None], (x - x0)[..., None]
    image = ((coarse[y0, x0] * (1 - fx) + coarse[y0, x1] * fx) * (1 - fy)
             + (coarse[y1, x0] * (1 - fx) + coarse[y1, x1] * fx) * fy)
    image += rng.normal(0, 8, (height, width, 3))
    image = np.clip(image, 0, 255).astype(np.uint8)
    path = os.path.join(folder, f"{i:04d}.jpg")
    if pil:
      from PIL import Image  # pylint: disable=g-import-not-at-top
      Image.fromarray(image).save(path, quality=90, subsampling=2)
    else:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      tf.io.write_file(path, tf.io.encode_jpeg(image, quality=90, chroma_downsampling=True))


def recipe_steps(batch: int) -> int:
  """Timed (and warm-up) batches of a recipe measurement: `RECIPE_IMAGES` images or more."""
  return max(1, math.ceil(RECIPE_IMAGES / batch))


def recipe_config(recipe: str, resolution: int):
  """`config.data` of a recipe (`RECIPES`) at `resolution`. Raises BenchmarkError: unknown."""
  if recipe not in RECIPES:
    raise BenchmarkError(f"recipe must be one of {RECIPES}, got {recipe!r}.")
  from vit_jax.config import defaults  # pylint: disable=g-import-not-at-top
  cfg = defaults.data_config()
  cfg.update(image_size=resolution, shuffle_buffer=1024)
  if recipe == "t2t":
    cfg.update(T2T_DATA)
  return cfg


def cpu_seconds() -> float:
  """User + system CPU seconds of this process (all its threads) and its live children."""
  total = sum(os.times()[:2])
  ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
  me = str(os.getpid())
  for pid in (os.listdir("/proc") if os.path.isdir("/proc") else []):
    if not pid.isdigit() or pid == me:
      continue
    try:
      with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue
    if fields[1] == me:  # ppid; then utime, stime at 12, 13.
      total += (int(fields[11]) + int(fields[12])) / ticks
  return total


def _timed_batches(next_batch, batch: int, warmup: int, steps: int) -> dict[str, Any]:
  """The wall and CPU seconds of `steps` calls of `next_batch` (-> images) after `warmup` + 1
  untimed ones, their rates, and the last batch's 'image_shape'."""
  for _ in range(warmup + 1):
    next_batch()
  start = time.perf_counter()
  cpu_start = cpu_seconds()
  for _ in range(steps):
    images = next_batch()
  seconds = time.perf_counter() - start
  cpu = cpu_seconds() - cpu_start
  return {"image_shape": list(images.shape[1:]), "timed_steps": steps, "seconds": seconds,
          "cpu_seconds": cpu, "images_per_sec": batch * steps / seconds,
          "images_per_cpu_second": batch * steps / cpu if cpu > 0 else None,
          "cores_busy": cpu / seconds}


def measure_input(source: str, *, batch: int, resolution: int, warmup: int = 2,
                  steps: int = 20, data_dir: Optional[str] = None,
                  recipe: str = "vit") -> dict[str, Any]:
  """Images/s and images per CPU-second of `vit_jax.data.create_train_iterator` alone, with
  `recipe`'s preprocessing at `resolution`, on 'fashion_mnist' or 'jpeg' (a generated folder).
  Raises BenchmarkError: an unknown source, recipe or sizes; data not found or prepared."""
  if source not in INPUTS:
    raise BenchmarkError(f"input must be one of {INPUTS}, got {source!r}.")
  check_sizes(batch, resolution, warmup, steps)
  cfg = recipe_config(recipe, resolution)
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  if data_dir:
    cfg.data_dir = data_dir
  with tempfile.TemporaryDirectory(prefix="vit_jax_input_") as tmp:
    if source == "jpeg":
      write_jpeg_folder(tmp)
      cfg.update(image_folder=tmp, train_split="train", eval_split="train")
    try:
      iterator = data.create_train_iterator(cfg, batch, seed=0, process_index=0,
                                            process_count=1)
    except (ValueError, FileNotFoundError) as e:
      raise BenchmarkError(f"input {source}: {e}") from e
    timing = _timed_batches(lambda: next(iterator)["image"], batch, warmup, steps)
  return {"framework": "input", "input": source, "recipe": recipe, "batch": batch,
          "resolution": resolution, "augment": cfg.augment, **timing,
          "peak_rss_mib": peak_rss_mib(), "threads": thread_facts()}


def timm_transform(recipe: str, resolution: int):
  """timm's training transform doing what `recipe_config(recipe)` does: RandomResizedCrop (the
  recipe's area range, bilinear as ours), flip, for 't2t' RandAugment 'rand-m9-mstd0.5-inc1' and
  RandomErasing(0.25, 'pixel'), ToTensor, the recipe's normalization."""
  from benchmarks import timm as timm_lib  # pylint: disable=g-import-not-at-top
  timm = timm_lib.import_timm()[0]
  cfg = recipe_config(recipe, resolution)
  mean, std = (((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if cfg.normalization == "imagenet"
               else ((0.5,) * 3, (0.5,) * 3))
  t2t = recipe == "t2t"
  return timm.data.create_transform(
      resolution, is_training=True, scale=(cfg.inception_crop_min_area, 1.0),
      ratio=(3 / 4, 4 / 3), hflip=0.5, vflip=0.0, color_jitter=None,
      auto_augment="rand-m9-mstd0.5-inc1" if t2t else None, interpolation="bilinear",
      mean=mean, std=std, re_prob=cfg.random_erasing, re_mode="pixel", re_count=1)


def _posterize_zero_bits() -> None:
  """Pillow >= 9 refuses ``ImageOps.posterize(image, 0)``, which timm's PosterizeIncreasing asks
  for at magnitude 10 (2% of 'mstd0.5' draws): 0 bits give black, as Pillow < 9 and ours."""
  from PIL import ImageOps  # pylint: disable=g-import-not-at-top
  posterize = ImageOps.posterize
  if getattr(posterize, "zero_bits", False):
    return

  def patched(image, bits):
    return image.point(lambda _: 0) if bits == 0 else posterize(image, bits)

  patched.zero_bits = True
  ImageOps.posterize = patched


def measure_timm_input(*, recipe: str, batch: int, resolution: int, warmup: int = 2,
                       steps: int = 20, threads: Optional[int] = None) -> dict[str, Any]:
  """timm's DataLoader doing `recipe`'s preprocessing on the generated JPEGs, as `measure_input`:
  `timm_transform`, `threads` workers (default: the cores this process may use), for 't2t'
  timm's Mixup(mode='batch') here. Raises BenchmarkError (bad recipe or sizes), ImportError."""
  check_sizes(batch, resolution, warmup, steps)
  _posterize_zero_bits()
  transform = timm_transform(recipe, resolution)  # (torchvision and timm imported.)
  import torch  # pylint: disable=g-import-not-at-top
  from torchvision import datasets  # pylint: disable=g-import-not-at-top
  from timm.data import Mixup  # pylint: disable=g-import-not-at-top
  cfg = recipe_config(recipe, resolution)
  workers = threads or len(available_cores())
  torch.manual_seed(0)
  mixup = (Mixup(mixup_alpha=cfg.mixup_alpha, cutmix_alpha=cfg.cutmix_alpha,
                 prob=cfg.mix_prob, switch_prob=cfg.mix_switch_prob, mode="batch",
                 label_smoothing=0.0, num_classes=1000)
           if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0 else None)
  with tempfile.TemporaryDirectory(prefix="vit_jax_input_") as tmp:
    write_jpeg_folder(tmp, pil=True)
    dataset = datasets.ImageFolder(os.path.join(tmp, "train"), transform=transform)
    sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                             num_samples=batch * (warmup + 1 + steps))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler,
                                         num_workers=workers, drop_last=True)
    batches = iter(loader)

    def step():
      images, labels = next(batches)
      if mixup is not None:
        images, labels = mixup(images, labels)
      return images

    timing = _timed_batches(step, batch, warmup, steps)
    del batches
  return {"framework": "timm_input", "input": "jpeg", "recipe": recipe, "batch": batch,
          "resolution": resolution, **timing, "num_workers": workers,
          "peak_rss_mib": peak_rss_mib(), "threads": thread_facts()}
