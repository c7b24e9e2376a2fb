"""Weights with NaN or Inf values are refused wherever they are read: resuming a run, predict and
evaluate on a workdir, fine-tuning from them; each error names the arrays and a finite step."""

import math
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from vit_jax import checkpoint
from vit_jax import config as config_lib
from vit_jax import inference
from vit_jax import train
from vit_jax.tools import evaluate
from vit_jax.tools import predict


def test_non_finite_names_the_arrays_with_nan_or_inf_in_tree_order():
  tree = {"params": {"a": np.ones(3), "b": np.array([1.0, np.inf]), "c": np.arange(3)},
          "opt_state": (jnp.array([np.nan]), jnp.zeros(2, jnp.bfloat16))}
  assert checkpoint.non_finite(tree) == ["opt_state/0", "params/b"]
  assert checkpoint.non_finite({"params": {"a": jnp.ones(2)}}) == []
  message = checkpoint.non_finite_message("X", [f"p/{i}" for i in range(6)])
  assert message == "X holds NaN or Inf values in p/0, p/1, p/2, p/3 and 2 more (6 arrays)"


def _state(value: float):
  return {"step": jnp.int32(0), "params": {"w": jnp.full((2, 2), value)},
          "opt_state": {"mu": jnp.zeros((2, 2))}, "model_state": {}}


def _abstract():
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                      _state(0.0))


def test_restoring_a_non_finite_step_names_the_newest_finite_one(tmp_path):
  checkpoints = checkpoint.Checkpoints(tmp_path / "checkpoints", keep=None, asynchronous=False)
  for step, value in ((1, 1.0), (2, 2.0), (3, math.inf), (4, math.nan)):
    checkpoints.save(step, _state(value), cost={"step": step})
  np.testing.assert_array_equal(checkpoints.restore(2, _abstract())[0]["params"]["w"], 2.0)
  with pytest.raises(ValueError) as error:
    checkpoints.restore(4, _abstract())
  directory = tmp_path / "checkpoints"
  assert str(error.value) == (
      f"The checkpoint of step 4 in {directory} holds NaN or Inf values in params/w (1 array): "
      f"it cannot be trained from. Move it away (mv {directory}/4 {directory}/4.non_finite) to "
      "resume from step 2 (the newest step whose values are finite), then rerun the same "
      "command.")
  checkpoints.close()


@pytest.fixture
def poisoned(tiny_workdir, tmp_path):
  """A copy of the shared tiny run (checkpoints 6 and 12) whose step 12 has a NaN in
  params/head/kernel, written with Orbax as the run wrote it."""
  workdir = tmp_path / "workdir"
  shutil.copytree(tiny_workdir[0], workdir)
  item = workdir / "checkpoints" / "12" / "state"
  checkpointer = ocp.StandardCheckpointer()
  state = checkpointer.restore(item)  # Nested dicts: Orbax restores the tuples by their keys.
  kernel = np.array(state["params"]["head"]["kernel"])
  kernel[0, 0] = np.nan
  state["params"]["head"]["kernel"] = kernel
  shutil.rmtree(item)
  checkpointer.save(item, state)
  checkpointer.wait_until_finished()
  return workdir, pathlib.Path(tiny_workdir[1])


def test_a_poisoned_latest_step_is_refused_by_resume_predict_and_evaluate(poisoned, capsys):
  workdir, folder = poisoned
  config = config_lib.from_json((workdir / "config.json").read_text())
  config.total_steps = 14
  config.resume_with_changes = True
  with pytest.raises(train.ConfigError) as error:
    train.train_and_evaluate(config, str(workdir))
  assert "step 12" in str(error.value) and "params/head/kernel (1 array)" in str(error.value)
  assert "to resume from step 6 (the newest step whose values are finite)" in str(error.value)

  with pytest.raises(ValueError, match=r"\(step 12\) holds NaN or Inf values in "
                     r"params/head/kernel \(1 array\).*Give --step 6, the newest step"):
    inference.load(str(workdir))
  assert inference.load(str(workdir), step=6).step == 6

  image = next(p for p in sorted((folder / "test").rglob("*")) if p.is_file())
  for program, argv in ((predict, [str(workdir), str(image)]),
                        (evaluate, [str(workdir), "--image-folder", str(folder)])):
    assert program.main(argv) == 2
    err = capsys.readouterr().err
    fatal = [l for l in err.splitlines() if l.startswith("FATAL:")]
    assert len(fatal) == 1 and "params/head/kernel" in fatal[0] and "--step 6" in fatal[0], err


def test_fine_tuning_from_non_finite_weights_is_refused(tmp_path):
  variables = {"params": {"w": np.array([np.nan, 1.0], np.float32)}}
  checkpoint.save_orbax(tmp_path / "weights", variables)
  with pytest.raises(ValueError, match=r"The fine-tuning checkpoint .*weights holds NaN or Inf "
                     r"values in params/w \(1 array\): fine-tune from other weights"):
    checkpoint.load_for_finetuning(str(tmp_path / "weights"), None,
                                   {"params": {"w": np.zeros(2, np.float32)}})
