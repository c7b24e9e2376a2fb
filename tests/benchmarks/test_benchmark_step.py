"""The benchmark measures the trainer's very step: for the same config and image shape, the
training step that `python -m benchmarks` compiles is the program `vit_jax.train` compiles
(equal HLO text), for a tiny ViT on a generated image folder."""

import re

import jax
import pytest

from benchmarks import ours
from tests import data_utils
from vit_jax import step
from vit_jax import train

TINY_VIT = ("ViT-custom", dict(hidden_size=16, mlp_dim=32, num_heads=2, num_layers=2,
                               patch_size=8), 16)


# The HLO text's debug information, which names the Python frames that traced each operation
# (train.py or the benchmark): the stack-frame tables and each instruction's metadata.
_FRAME_TABLES = re.compile(r"^FileNames\n.*?^StackFrames\n(?:[^\n]+\n)*", re.M | re.S)
_METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def _program(compiled) -> str:
  """The compiled program's HLO text without its debug information."""
  text = _METADATA.sub("", _FRAME_TABLES.sub("", compiled.as_text()))
  assert "stack_frame_id" not in text and "FileNames" not in text
  return text


def _benchmark_config(model, overrides, resolution):
  """The benchmark's config (batch 4, 3 classes), shortened to one step without warmup so that
  the trainer can run all of it."""
  return ours.benchmark_config(model, batch=4, resolution=resolution, overrides=overrides,
                               num_classes=3, total_steps=1, warmup_steps=0)


def _trainer_compiles(config, folder, workdir, monkeypatch):
  """Runs `train_and_evaluate` on `config` (reading `folder`) for its one step; returns the
  resolved config and the program (`_program`) of the train step that `step.Setup.compile`
  compiled."""
  compiled = []
  original = step.Setup.compile

  def recording(self, jitted, *args):
    result = original(self, jitted, *args)
    if "mask" not in args[1]:  # The train batch; eval batches carry a mask.
      compiled.append((self.config, _program(result)))
    return result

  monkeypatch.setattr(step.Setup, "compile", recording)
  config.data.update(image_folder=folder, augment="none")
  config.async_checkpointing = False
  results = train.train_and_evaluate(config, workdir)
  assert results["step"] == 1
  ((resolved, text),) = compiled
  return resolved, text


@pytest.mark.slow
def test_benchmark_compiles_the_trainers_train_step(tmp_path, monkeypatch):
  """For a tiny ViT (one family suffices: both build their step through the same `step.build`;
  a T2T-ViT doubles this test's time, 34 s, and adds no other path)."""
  model, overrides, resolution = TINY_VIT
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=4,
                                        size=resolution)
  trainer_config, trainer_text = _trainer_compiles(
      _benchmark_config(model, overrides, resolution), folder, str(tmp_path / "workdir"),
      monkeypatch)

  config, choice = ours.resolve(_benchmark_config(model, overrides, resolution), jax.devices())
  # The same resolved config, apart from where the data comes from and how checkpoints are
  # written.
  strip = lambda c: {k: v for k, v in c.to_dict().items()
                     if k not in ("data", "async_checkpointing")}
  assert strip(config) == strip(trainer_config)
  assert config.loss == "sigmoid_xent" and config.model.attention == choice.implementation
  image_shape = (resolution, resolution, 3)
  assert _program(ours.compile_train_step(config, image_shape)) == trainer_text

  # The comparison can fail: another loss is another program.
  other = _benchmark_config(model, overrides, resolution)
  other.loss = "softmax_xent"
  other, _ = ours.resolve(other, jax.devices())
  assert _program(ours.compile_train_step(other, image_shape)) != trainer_text
