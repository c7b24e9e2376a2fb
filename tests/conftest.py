"""Shared test set-up.

* Every test runs on the CPU (`JAX_PLATFORMS=cpu` unless set), so the suite gives the same
  results on a machine with an accelerator.
* Tests marked `golden` (outputs compared with the reference implementations' fixtures in
  tests/fixtures/) run under `jax.default_matmul_precision('highest')`: float32 products stay
  float32 on every backend, so the same tolerances hold on TPU and GPU (whose default precision
  rounds matmul inputs to bfloat16 or TF32).
* Tests marked `slow` are the end-to-end runs; `python -m pytest -m "not slow"` is the fast tier.
* Compiling dominates the suite's time, so the tests (and the programs they start, which inherit
  the environment) compile with LLVM's optimisations off (`--xla_backend_optimization_level=0`:
  the same HLO programs, less optimised machine code) and share one JAX compilation cache for
  the run, so a program compiled by one test or worker is not compiled again by another.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # The first process (xdist's controller).
  _CACHE = tempfile.mkdtemp(prefix="vit_jax_tests_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE  # Inherited by the workers and subprocesses.
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(autouse=True)
def _golden_precision(request):
  """`jax.default_matmul_precision('highest')` around tests marked `golden`."""
  if request.node.get_closest_marker("golden") is None:
    yield
    return
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="session")
def tiny_workdir(tmp_path_factory):
  """A finished training run of a tiny ViT (hidden size 8, one layer, 4x4 patches, 8 px) on a
  3-class image folder (`tests/data_utils.make_image_folder`, 5 images per class and split):
  12 steps of batch 5 at lr 0.1 (no EMA), checkpoints at steps 6 and 12. Returns
  `(workdir, image_folder, results)`, `results` what `train_and_evaluate` returned (the final
  'test/accuracy'). Shared by the tests that use a trained model (predict, evaluate, few-shot);
  read-only for them."""
  from tests import data_utils  # pylint: disable=g-import-not-at-top
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from vit_jax import train  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("tiny_run")
  folder = data_utils.make_image_folder(str(root / "images"), num_classes=3, per_class=5, size=8)
  config = config_lib.get_config("ViT-custom", "unused", hidden_size=8, mlp_dim=16, num_heads=2,
                                 num_layers=1, patch_size=4)
  data_utils.override(config, {
      "regime": "finetune", "data.image_folder": folder, "data.image_size": 8,
      "data.augment": "none", "data.shuffle_buffer": 16, "batch_size": 5, "total_steps": 12,
      "optim.warmup_steps": 0, "optim.lr": 0.1, "log_every_steps": 6, "eval_every_steps": 12,
      "checkpoint_every_steps": 6, "async_checkpointing": False})
  workdir = str(root / "workdir")
  results = train.train_and_evaluate(config, workdir)
  return workdir, folder, results
