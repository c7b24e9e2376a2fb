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
  the same HLO programs, less optimised machine code; on jaxlib 0.10 also without its CPU fusion
  emitters, which the later versions no longer let one turn off: a tiny ViT's training step
  compiles in 1.4 s instead of 2.4 s) and share one JAX compilation cache for
  the run (`$JAX_COMPILATION_CACHE_DIR`, which training runs use too unless a test sets
  `config.compilation_cache_dir`), so a program compiled by one test, worker or `vit_jax.main`
  process is not compiled again by another.
* `shared_dir` builds a directory once per run for all of pytest-xdist's workers (a trained run,
  a prepared dataset): the tests that read it do not each build their own.
"""

import atexit
import fcntl
from importlib import metadata
import os
import pathlib
import shutil
import tempfile
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FAST_COMPILE = ["--xla_backend_optimization_level=0"]
if metadata.version("jaxlib").startswith("0.10."):  # Its CPU fusion emitters compile 1.7x slower.
  _FAST_COMPILE.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FAST_COMPILE:
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # The first process (xdist's controller).
  _CACHE = tempfile.mkdtemp(prefix="vit_jax_tests_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE  # Inherited by the workers and subprocesses.
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# TensorFlow's gs:// stat cache off, before TensorFlow loads (it reads the variable then): the
# emulator keeps no directory markers (tests/gcs_emulator.py says why that matters).
os.environ.setdefault("GCS_STAT_CACHE_MAX_AGE", "0")

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
def shared_dir(tmp_path_factory) -> Callable[[str, Callable[[pathlib.Path], None]], pathlib.Path]:
  """`shared_dir(name, build)`: the directory `name`, filled by `build(path)` once per test run
  and shared by every pytest-xdist worker (and by every test of a run without xdist).

  The first caller builds it while holding a file lock beside it; a caller on another worker
  waits for that build and then gets the same path (no second build). A build that raises leaves
  nothing behind, so the next caller builds again (and reports the same error). Readers must not
  change the directory."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # The run's base directory; each worker's basetemp is a folder in it.

  def get(name: str, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    path, done = root / f"shared_{name}", root / f"shared_{name}.done"
    with open(root / f"shared_{name}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
      if not done.exists():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        try:
          build(path)
        except BaseException:
          shutil.rmtree(path, ignore_errors=True)
          raise
        done.touch()
    return path

  return get


@pytest.fixture(scope="session")
def fashion_mnist_dir(shared_dir) -> str:
  """A tfds data_dir where `vit_jax.data.get_info` prepared `fashion_mnist_local` from the IDX
  files of the Debian package `dataset-fashion-mnist` (60,000 train and 10,000 test images; about
  10 s), once per run; read-only for the tests that use it. Without the files the preparation's
  own error fails the test (a test that may skip instead says so itself)."""
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from vit_jax import data  # pylint: disable=g-import-not-at-top

  def prepare(path: pathlib.Path) -> None:
    cfg = config_lib.defaults.data_config()
    cfg.name, cfg.data_dir = "fashion_mnist_local", str(path)
    data.get_info(cfg)  # Prepares it (a local builder: nothing is downloaded).

  return str(shared_dir("fashion_mnist", prepare))


@pytest.fixture(scope="session")
def tiny_workdir(shared_dir):
  """A finished training run of a tiny ViT (hidden size 8, one layer, 4x4 patches, 8 px) on a
  3-class image folder (`tests/data_utils.make_image_folder`, 5 images per class and split):
  12 steps of batch 5 at lr 0.1 (no EMA), checkpoints at steps 6 and 12. Returns
  `(workdir, image_folder, results)`, `results` what `train_and_evaluate` returned (the final
  'test/accuracy' and the others as floats, and the 'step'). Trained once per run (`shared_dir`)
  for the tests that use a trained model (predict, inference); read-only for them."""
  import json  # pylint: disable=g-import-not-at-top

  def build(root: pathlib.Path) -> None:
    from tests import data_utils  # pylint: disable=g-import-not-at-top
    from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
    from vit_jax import train  # pylint: disable=g-import-not-at-top
    folder = data_utils.make_image_folder(str(root / "images"), num_classes=3, per_class=5,
                                          size=8)
    config = config_lib.get_config("ViT-custom", "unused", hidden_size=8, mlp_dim=16,
                                   num_heads=2, num_layers=1, patch_size=4)
    data_utils.override(config, {
        "regime": "finetune", "data.image_folder": folder, "data.image_size": 8,
        "data.augment": "none", "data.shuffle_buffer": 16, "batch_size": 5, "total_steps": 12,
        "optim.warmup_steps": 0, "optim.lr": 0.1, "log_every_steps": 6, "eval_every_steps": 12,
        "checkpoint_every_steps": 6, "async_checkpointing": False})
    results = train.train_and_evaluate(config, str(root / "workdir"))
    (root / "results.json").write_text(json.dumps(
        {k: int(v) if k == "step" else float(v) for k, v in results.items()}))

  root = shared_dir("tiny_run", build)
  return (str(root / "workdir"), str(root / "images"),
          json.loads((root / "results.json").read_text()))


#: Set by .ci/run where a second stack runs tests/test_pod_faults.py beside this suite: the pod
#: faults then run once in CI, on the newest jax (process start-ups, 2 CPUs: ~2 minutes saved).
POD_FAULTS_ELSEWHERE = "VIT_JAX_TESTS_POD_FAULTS_ELSEWHERE"


def pytest_collection_modifyitems(config, items):
  if os.environ.get(POD_FAULTS_ELSEWHERE) != "1":
    return
  elsewhere = [item for item in items if item.path.name == "test_pod_faults.py"]
  if elsewhere:
    config.hook.pytest_deselected(items=elsewhere)
    items[:] = [item for item in items if item.path.name != "test_pod_faults.py"]
