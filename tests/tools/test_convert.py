"""`python -m vit_jax.convert SRC DIR` (vit_jax.tools.convert) to an Orbax directory: it keeps
what the arrays do not say (class names, preprocessing) for predict and evaluate. The
converter's other tests are in tests/checkpoint/test_finetune.py and test_ecosystem.py."""

import json
import os
import signal
import socket
import subprocess
import sys
import types

import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import inference
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import lock as lock_lib
from vit_jax.checkpoint import orbax
from vit_jax.tools import convert

NPZ = os.path.join(os.path.dirname(__file__), "..", "fixtures", "vit_tiny", "params.npz")


def test_an_orbax_conversion_keeps_the_class_names_and_preprocessing(tmp_path, capsys):
  """A transformers ViT with class names and ImageNet normalization, converted to Orbax: its
  model names its classes and normalizes its input as the source does (they were dropped)."""
  trained = inference.load(NPZ)
  names = [f"kind_{i}" for i in range(trained.num_classes)]
  fields = dict(trained.config.model.to_dict(), num_classes=trained.num_classes)
  ecosystem.write(str(tmp_path / "hf"), trained.variables["params"], fields, to="hf",
                  image_size=trained.image_size, label_names=names, normalization="imagenet")
  source = inference.load(str(tmp_path / "hf"))
  assert list(source.label_names) == names and source.config.data.normalization == "imagenet"

  assert convert.main([str(tmp_path / "hf"), str(tmp_path / "orbax")]) == 0
  assert capsys.readouterr().out.splitlines()[-1] == (
      "  kept in vit_jax_export.json: 10 class names (kind_0, kind_1, kind_2, ...), "
      "normalization imagenet, image_size 32, 17 model fields (gelu_approximate=True, "
      "layer_norm_epsilon=1e-06, posemb_resize='linear_corners')")
  kept = json.loads((tmp_path / "orbax" / orbax.EXPORT_JSON).read_text())
  assert kept.pop("model") == {
      "patch_size": 4, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "mlp_dim": 64,
      "representation_size": None, "classifier": "token", "posemb": "learn",
      "layerscale_init": None, "num_registers": 0, "no_embed_class": False, "fc_norm": False,
      "qk_norm": False, "gelu_approximate": True, "layer_norm_epsilon": 1e-6,
      "posemb_resize": "linear_corners", "posemb_grid": None}
  assert kept == {"label_names": names, "image_size": 32, "normalization": "imagenet"}
  converted = inference.load(str(tmp_path / "orbax"))
  assert list(converted.label_names) == names
  assert converted.config.data.normalization == "imagenet"
  # Converted again (Orbax to Orbax), the facts travel on; to .npz in a JSON file beside it.
  assert convert.main([str(tmp_path / "orbax"), str(tmp_path / "again")]) == 0
  assert list(inference.load(str(tmp_path / "again")).label_names) == names
  capsys.readouterr()
  assert convert.main([str(tmp_path / "orbax"), str(tmp_path / "back.npz")]) == 0
  out, err = capsys.readouterr()
  assert out.splitlines()[-1].startswith(
      f"  kept in {tmp_path / 'back.vit_jax.json'}: 10 class names") and not err
  back = inference.load(str(tmp_path / "back.npz"))
  assert list(back.label_names) == names and back.config.data.normalization == "imagenet"


@pytest.mark.slow
def test_step_picks_a_step_of_a_workdir_and_is_refused_for_a_file(tiny_workdir, tmp_path,
                                                                   capsys):
  """`--step N` converts that step of a run (default its latest); a single file has no steps."""
  workdir = str(tiny_workdir[0])
  assert convert.main([workdir, str(tmp_path / "six.npz"), "--step", "6"]) == 0
  assert convert.main([workdir, str(tmp_path / "latest.npz")]) == 0
  six, latest = (np.load(tmp_path / f"{n}.npz") for n in ("six", "latest"))
  assert not np.array_equal(six["head/kernel"], latest["head/kernel"])
  np.testing.assert_array_equal(
      six["head/kernel"],
      inference.load(workdir, step=6).variables["params"]["head"]["kernel"])
  capsys.readouterr()
  assert convert.main([NPZ, str(tmp_path / "x.npz"), "--step", "6"]) == 2
  assert "--step applies to training workdirs" in capsys.readouterr().err


def test_a_destination_that_is_holds_or_is_in_the_source_is_refused(tmp_path, capsys):
  source = tmp_path / "orbax"
  source.mkdir()
  for dst in (source, source / "inside.npz", tmp_path):
    assert convert.main([str(source), str(dst)]) == 2
    assert capsys.readouterr().err == (f"FATAL: {dst} is (or contains, or is inside) the source "
                                       f"{source}: write to a new path, the source is never "
                                       "replaced.\n")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["orbax"] and not any(source.iterdir())


def test_the_workdir_of_a_running_run_is_never_written(tmp_path, capsys, monkeypatch):
  """Issue 50: `convert SRC WORKDIR --overwrite` deleted a running run's checkpoints, config
  and lock.json (Orbax's forced save) and the run wrote on into the export. While a live run
  holds the lock, the workdir and what is in it are refused, naming the run; a killed run's
  lock holds nothing (the trainer's stale-lock rule)."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "6").mkdir(parents=True)
  (workdir / "checkpoints" / "6" / "state").write_bytes(b"step 6")
  (workdir / "config.json").write_text("{}")
  monkeypatch.setattr(sys, "argv", ["/src/vit_jax/main.py", "--config", "c.py"])
  monkeypatch.setattr(sys.modules["__main__"], "__spec__", types.SimpleNamespace(
      name="vit_jax.main"), raising=False)

  def files():
    return {str(p.relative_to(workdir)): p.read_bytes() for p in workdir.rglob("*")
            if p.is_file()}

  with checkpoint.WorkdirLock(str(workdir)):
    record = json.loads((workdir / "lock.json").read_text())
    monkeypatch.setattr(lock_lib, "time", types.SimpleNamespace(
        time=lambda: record["started_unix"] + 5))  # Five seconds into the run.
    before = files()
    holder = (f"host {socket.gethostname()}, pid {os.getpid()}, started {record['started']}, "
              "5 s ago: python -m vit_jax.main --config c.py")
    for dst, extra in ((workdir, []), (workdir / "checkpoints", []),
                       (workdir / "export.npz", []), (workdir / "timm.safetensors",
                                                      ["--to", "timm"])):
      assert convert.main([NPZ, str(dst), "--overwrite", *extra]) == 2
      where = "is the workdir" if dst == workdir else f"is inside the workdir {workdir}"
      assert capsys.readouterr().err == (
          f"FATAL: {dst} {where} of a running training run ({holder}), which only that run "
          "writes (a replaced workdir loses its checkpoints while the run goes on): wait for "
          "the run to end or stop it, or choose a destination outside its workdir.\n")
    assert files() == before
  # A run killed while holding it leaves lock.json, which no process holds: taken as free.
  (workdir / "lock.json").write_text(json.dumps(dict(record, pid=2 ** 22 + 1)))
  assert convert.main([NPZ, str(workdir / "export.npz")]) == 0
  np.testing.assert_array_equal(np.load(workdir / "export.npz")["head/kernel"],
                                np.load(NPZ)["head/kernel"])


# Runs `convert.main(argv[2:])` with every file opened for writing under argv[1] stalling after
# its first 4096 bytes (written and flushed), once 'writing' is printed: a kill lands mid-write.
_STALLED_WRITE = """
import builtins, os, sys, time
from vit_jax.tools import convert
real_open = builtins.open

class Stalled:
  def __init__(self, f):
    self._f, self._n = f, 0
  def __getattr__(self, name):
    return getattr(self._f, name)
  def __enter__(self):
    return self
  def __exit__(self, *exc):
    return self._f.__exit__(*exc)
  def write(self, data):
    if self._n + len(data) > 4096:
      self._f.write(data[:max(0, 4096 - self._n)])
      self._f.flush()
      print('writing', flush=True)
      time.sleep(600)
    self._n += len(data)
    return self._f.write(data)

def stalled_open(file, mode='r', *args, **kwargs):
  f = real_open(file, mode, *args, **kwargs)
  return Stalled(f) if 'w' in mode and str(file).startswith(sys.argv[1]) else f

builtins.open = stalled_open
sys.exit(convert.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_kill_while_writing_leaves_the_old_file_or_none_then_a_rerun_the_new(tmp_path):
  """Issue 50: .npz and timm .safetensors outputs were written in place: SIGTERM mid-write left
  a partial file under the final name and the previous good file was gone. Killed mid-write,
  DST is the old file (or absent); the next run replaces the partial one and DST."""
  out = tmp_path / "out"
  out.mkdir()
  old = (out / "weights.npz")
  old.write_bytes(open(NPZ, "rb").read())  # A previous good file.
  for dst, extra, signum in ((old, [], signal.SIGTERM),
                             (out / "weights.safetensors", ["--to", "timm"], signal.SIGKILL)):
    before = dst.read_bytes() if dst.exists() else None
    argv = [NPZ, str(dst), "--overwrite", *extra]
    writer = subprocess.Popen([sys.executable, "-c", _STALLED_WRITE, str(out), *argv],
                              stdout=subprocess.PIPE, text=True)
    try:
      assert writer.stdout.readline() == "writing\n"  # Mid-write.
      writer.send_signal(signum)
      assert writer.wait(60) == -signum
    finally:
      writer.kill()
      writer.wait()
    assert (dst.read_bytes() if dst.exists() else None) == before, dst
    beside = sorted(set(os.listdir(out)) - {"weights.vit_jax.json"})
    assert beside == ["weights.npz", f"{dst.name}.partial"]  # Written beside.
    assert convert.main(argv) == 0
  # The .npz's fields beside it (its .vit_jax.json, written after the .npz).
  assert sorted(os.listdir(out)) == ["weights.npz", "weights.safetensors", "weights.vit_jax.json"]
  want = inference.load(NPZ).variables["params"]["head"]["kernel"]
  for name in ("weights.npz", "weights.safetensors"):
    np.testing.assert_allclose(
        inference.load(str(out / name)).variables["params"]["head"]["kernel"], want,
        rtol=1e-6)
