"""The training input pipeline alone: the images/s `vit_jax.data` delivers (TensorFlow is imported
where used: the benchmark's parent and timm's processes do not load it)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Optional

from vit_jax.tools.benchmark.common import BenchmarkError
from vit_jax.tools.benchmark.common import check_sizes
from vit_jax.tools.benchmark.common import peak_rss_mib
from vit_jax.tools.benchmark.common import thread_facts

INPUTS = ("fashion_mnist", "jpeg")
INPUT_LABELS = {"fashion_mnist": "Fashion-MNIST (28x28 PNG)",
                "jpeg": "JPEG folder (500x375 JPEG)"}
JPEG_SIZE = (375, 500)  # height, width
JPEG_COUNT = 256


def write_jpeg_folder(root: str, count: Optional[int] = None) -> None:
  """`count` (default `JPEG_COUNT`) random JPEGs of `JPEG_SIZE` in root/train/class<i % 4>/."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  height, width = JPEG_SIZE
  for i in range(JPEG_COUNT if count is None else count):
    folder = os.path.join(root, "train", f"class{i % 4}")
    os.makedirs(folder, exist_ok=True)
    coarse = rng.uniform(0, 255, (height // 25, width // 25, 3)).astype(np.float32)
    image = tf.image.resize(coarse, (height, width), method="bicubic")
    image += rng.normal(0, 8, (height, width, 3))  # Some texture, as in photographs.
    image = tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8)
    tf.io.write_file(os.path.join(folder, f"{i:04d}.jpg"), tf.io.encode_jpeg(image, quality=90))


def measure_input(source: str, *, batch: int, resolution: int, warmup: int = 2,
                  steps: int = 20, data_dir: Optional[str] = None) -> dict[str, Any]:
  """Images/s of `vit_jax.data.create_train_iterator` alone, with the training data defaults
  (Inception crop, flip, resize to `resolution`), on 'fashion_mnist' (the offline builder) or
  'jpeg' (a generated folder of `JPEG_COUNT` JPEGs): batch * steps / seconds after `warmup`.

  Raises BenchmarkError: an unknown source or sizes; data that cannot be found or prepared.
  """
  if source not in INPUTS:
    raise BenchmarkError(f"input must be one of {INPUTS}, got {source!r}.")
  check_sizes(batch, resolution, warmup, steps)
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  from vit_jax.config import defaults  # pylint: disable=g-import-not-at-top
  cfg = defaults.data_config()
  cfg.image_size = resolution
  cfg.shuffle_buffer = 1024
  if data_dir:
    cfg.data_dir = data_dir
  with tempfile.TemporaryDirectory(prefix="vit_jax_input_") as tmp:
    if source == "jpeg":
      write_jpeg_folder(tmp)
      cfg.image_folder = tmp
      cfg.train_split = "train"
      cfg.eval_split = "train"
    try:
      iterator = data.create_train_iterator(cfg, batch, seed=0, process_index=0,
                                            process_count=1)
    except (ValueError, FileNotFoundError) as e:
      raise BenchmarkError(f"input {source}: {e}") from e
    for _ in range(warmup + 1):
      next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
      images = next(iterator)["image"]
    seconds = time.perf_counter() - start
  return {"framework": "input", "input": source, "batch": batch, "resolution": resolution,
          "image_shape": list(images.shape[1:]), "augment": cfg.augment,
          "timed_steps": steps, "seconds": seconds, "images_per_sec": batch * steps / seconds,
          "peak_rss_mib": peak_rss_mib(), "threads": thread_facts()}
