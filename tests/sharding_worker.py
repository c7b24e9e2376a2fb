"""Runs tiny trainings / restores on a simulated multi-device CPU (a subprocess of test_sharding).

  python tests/sharding_worker.py train   --devices 8 --family vit --folder F --out DIR \
      --meshes 'data=8;data=2,fsdp=4'
  python tests/sharding_worker.py restore --devices 4 --family vit --folder F --out DIR \
      --workdir W --meshes 'data=2,fsdp=2'

`--family`, `--out` and `--meshes` may be repeated (as many of each): the runs of several
families in one process (one start-up: jax, TensorFlow and the trainer imported once).

The device count must be fixed before jax is imported, hence a separate process. For each mesh
it writes DIR/<mesh>.npz (the parameters, flattened) and DIR/<mesh>.json (the train loss of
every step, and the shard shape of a large kernel as it lives on the mesh).
"""

import argparse
import json
import os
import sys


def tiny_config(family: str, folder: str, mesh: str = ""):
  """A 3-step run on the 16 px image folder; the same for every mesh."""
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  if family == "vit":
    config = config_lib.get_config("ViT-custom", "unused", hidden_size=32, mlp_dim=64, num_heads=4,
                                 num_layers=2, patch_size=4)
  else:
    config = config_lib.get_config("T2T-ViT-custom", "unused", embed_dim=32, depth=2, num_heads=4,
                                   mlp_ratio=2.0, token_dim=16, tokens_type="transformer",
                                   drop_path_rate=0.0)
  config.regime = "finetune"
  config.optim.warmup_steps = 0
  config.data.image_folder = folder
  config.data.image_size = 16
  config.data.augment = "none"
  config.data.normalization = "imagenet"
  config.batch_size = 8
  config.total_steps = 3
  config.log_every_steps = 1
  config.eval_every_steps = config.checkpoint_every_steps = 3
  config.async_checkpointing = False
  if mesh:  # e.g. 'data=2,fsdp=4': the axes not named are 1. (Default: data=-1, all devices.)
    config.mesh.update(data=1, fsdp=1, tensor=1)
    for entry in mesh.split(","):
      axis, size = entry.split("=")
      config.mesh[axis] = int(size)
  return config


def get_config(arg: str = ""):
  """As a config file for `python -m vit_jax.main` (the image folder comes as an override)."""
  return tiny_config(arg or "vit", "set --config.data.image_folder")


def train_losses(workdir: str):
  """{step: train/loss} from the TensorBoard events of a run."""
  import glob  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  losses = {}
  for path in glob.glob(os.path.join(workdir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == "train/loss":
          losses[event.step] = float(tf.make_ndarray(value.tensor))
  return losses


def restore_on_mesh(workdir: str, config):
  """The checkpoint of `workdir` restored onto `config.mesh`'s shardings (orbax resharding)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from vit_jax import checkpoint, models, sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.create_mesh(config.mesh)
  rules = sharding.parse_rules(config.mesh.rules, mesh.axis_names)
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  fields = dict(config_lib.fill_regime(config).model.to_dict(), attention="xla",
                remat_policy="dots_and_attention_saveable")  # What resolve picks on a CPU.
  model = models.create(config.model_name, num_classes=3, **fields)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)),
                                            train=False))
  item = checkpoint.saved_run.find_state_item(workdir)
  metadata = ocp.PyTreeCheckpointer().metadata(item)
  tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", None) or metadata.tree
  shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), dict(tree))
  shapes = {k: _to_dict(v) for k, v in shapes.items()}
  shardings = sharding.state_shardings(shapes, boxed, mesh, rules)
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)
  return ocp.StandardCheckpointer().restore(item, target)


def _to_dict(tree):
  if hasattr(tree, "items"):
    return {k: _to_dict(v) for k, v in tree.items()}
  return tree


def dump(state, out_dir: str, name: str, extra: dict):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top
  flat = checkpoint.flatten_params(state["params"])
  np.savez(os.path.join(out_dir, f"{name}.npz"), **{k: np.asarray(v) for k, v in flat.items()})
  kernel = next(k for k in flat if k.endswith(("MlpBlock_0/Dense_0/kernel", "mlp/fc1/kernel")))
  array = flat[kernel]
  extra.update(kernel=kernel, shape=list(array.shape),
               shard_shape=list(array.sharding.shard_shape(array.shape)))
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(extra, f)


def main(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=("train", "restore"))
  parser.add_argument("--devices", type=int, required=True)
  parser.add_argument("--family", required=True, action="append")
  parser.add_argument("--folder", required=True)
  parser.add_argument("--out", required=True, action="append")
  parser.add_argument("--meshes", required=True, action="append")
  parser.add_argument("--workdir")
  args = parser.parse_args(argv)
  if not len(args.family) == len(args.out) == len(args.meshes):
    parser.error("--family, --out and --meshes: as many of each")
  # Appended: the flags inherited from tests/conftest.py (fast compilation) stay in force.
  os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                             f"--xla_force_host_platform_device_count={args.devices}").strip()
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == args.devices, jax.devices()
  if args.mode == "train":  # Restoring needs neither the trainer nor its data (TensorFlow).
    from vit_jax import accounting  # pylint: disable=g-import-not-at-top
    from vit_jax import train  # pylint: disable=g-import-not-at-top
    # The MFU's CPU peak is not what these runs check: not measured (as
    # tests/data_utils.skip_cpu_peak_measurement does in the test processes).
    accounting.measure_cpu_peak = lambda *args, **kwargs: 1e11
  for family, out, meshes in zip(args.family, args.out, args.meshes):
    for mesh in meshes.split(";"):
      config = tiny_config(family, args.folder, mesh)
      name = mesh.replace(",", "_").replace("=", "")
      if args.mode == "train":
        workdir = os.path.join(out, f"run_{name}")
        train.train_and_evaluate(config, workdir)
        dump(restore_on_mesh(workdir, config), out, name, {"losses": train_losses(workdir)})
      else:
        dump(restore_on_mesh(args.workdir, config), out, name, {})


if __name__ == "__main__":
  main(sys.argv[1:])
