r"""Per-core memory of the ViT training step beside the official vit_jax model's, on a TPU slice.

The figures of docs/pods.md's "Leaner than the official model" table. For each model and
compute dtype it compiles, with the TPU compiler of libtpu for the slice (`vit_jax.preflight`'s
`fit.check`, nothing allocated, no TPU needed), the trainer's own training step at the same
global batch twice:

  ours      the config's model with its training defaults (scan, remat, `remat_policy`);
  official  `VisionTransformer` of google-research/vision_transformer (`vit_jax/models_vit.py`
            of a checkout given with --official), built with the same sizes (hidden size,
            patches, MLP size, heads, layers, dropout, representation size, classifier); it
            has no compute dtype (it always computes in float32, so it is compiled once per
            model) and no remat.

Everything else is the same step (`vit_jax.step.make_train_step`: AdamW with the config's
settings, the config's loss, gradient-norm metrics), data parallel over the slice's cores, the
parameters and optimizer state in float32 for both. Per core: the train state's shard, the
batch, the compiler's temporaries and the total (what `python -m vit_jax.preflight` prints).

Usage (libtpu installed: pip install -e '.[tpu]'; the official code: git clone
https://github.com/google-research/vision_transformer):
  python docs/memory_vs_official.py --official ~/vision_transformer \
      [--accelerator v3-8] [--batch 512] [--models b16,l16] [--dtypes float32,bfloat16] \
      [--override model.remat_policy=nothing_saveable ...]

One compile takes one to four minutes on 2 CPU cores (ViT-L/16 the longest).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import sys
import types
from unittest import mock

GIB = 2**30


def load_official(checkout: str) -> types.ModuleType:
  """`vit_jax/models_vit.py` of the official checkout, imported as `official_vit_jax.models_vit`.

  The official package is also called `vit_jax`; its `models_vit` imports `models_resnet` from
  it, so the official `models_resnet` stands in for that one import.

  Raises:
    FileNotFoundError: the checkout has no `vit_jax/models_vit.py`.
  """
  package_dir = os.path.join(os.path.expanduser(checkout), "vit_jax")
  if not os.path.isfile(os.path.join(package_dir, "models_vit.py")):
    raise FileNotFoundError(f"{checkout!r} has no vit_jax/models_vit.py: pass a checkout of "
                            "https://github.com/google-research/vision_transformer")
  package = types.ModuleType("official_vit_jax")
  package.__path__ = [package_dir]
  sys.modules["official_vit_jax"] = package
  resnet = importlib.import_module("official_vit_jax.models_resnet")
  import vit_jax  # pylint: disable=import-outside-toplevel
  with mock.patch.object(vit_jax, "models_resnet", resnet, create=True):
    return importlib.import_module("official_vit_jax.models_vit")


def official_model(models_vit: types.ModuleType, config):
  """The official `VisionTransformer` with the sizes of a resolved config's ViT."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  m = config.model
  return models_vit.VisionTransformer(
      num_classes=config.num_classes,
      patches=ml_collections.ConfigDict({"size": tuple(m.patch_size)}),
      transformer=ml_collections.ConfigDict(dict(
          mlp_dim=m.mlp_dim, num_heads=m.num_heads, num_layers=m.num_layers,
          dropout_rate=m.dropout_rate, attention_dropout_rate=m.attention_dropout_rate)),
      hidden_size=m.hidden_size, representation_size=m.representation_size,
      classifier=m.classifier, head_bias_init=m.head_bias_init or 0.0)


def parse_overrides(items: list[str]) -> dict:
  """`KEY=VALUE` strings -> {key: value}, the value a Python literal or else a string."""
  overrides = {}
  for item in items:
    key, _, value = item.partition("=")
    try:
      overrides[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):  # A plain string, e.g. nothing_saveable.
      overrides[key] = value
  return overrides


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--official", required=True,
                      help="a checkout of google-research/vision_transformer")
  parser.add_argument("--accelerator", default="v3-8")
  parser.add_argument("--batch", type=int, default=512, help="global batch")
  parser.add_argument("--models", default="b16,l16", help="configs/vit.py model names")
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for ours, e.g. model.remat_policy=nothing_saveable")
  parser.add_argument("--only", choices=("ours", "official"), help="compile one side only")
  args = parser.parse_args(argv)

  from vit_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from vit_jax import step as step_lib  # pylint: disable=import-outside-toplevel
  from vit_jax.tools.preflight import fit  # pylint: disable=import-outside-toplevel
  from vit_jax.tools.preflight import topology  # pylint: disable=import-outside-toplevel

  models_vit = load_official(args.official)
  tpu = topology.tpu_slice(args.accelerator)
  spec = importlib.util.spec_from_file_location(
      "configs_vit", os.path.join(os.path.dirname(__file__), "..", "configs", "vit.py"))
  configs_vit = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(configs_vit)
  overrides = parse_overrides(args.override)

  print(f"{args.accelerator}, global batch {args.batch} "
        f"({args.batch // len(tpu.devices)} per core), training step, per core:")
  print("| model | compute | ours: state / temporaries / total | official: state / temporaries /"
        " total | ours / official |")
  print("|---|---|---|---|---|")
  official_totals, official_cells = {}, {}  # The official model ignores the dtype: once each.
  for model in args.models.split(","):
    for dtype in args.dtypes.split(","):
      base = fit.with_overrides(configs_vit.get_config(f"{model},imagenet2012"), {
          "model.dtype": dtype, "batch_size": args.batch, "total_steps": 1_000_000})
      totals, cells = {}, {}
      for side in ("ours", "official"):
        if args.only and side != args.only:
          cells[side] = "-"
          continue
        if side == "official" and model in official_cells:
          cells[side] = official_cells[model]
          if model in official_totals:
            totals[side] = official_totals[model]
          continue
        if side == "ours":
          config, patch = fit.with_overrides(base, overrides), None
        else:  # Unscanned, no remat: the official parameter tree, our fields unused.
          config = fit.with_overrides(base, {"model.scan": False, "model.remat": False})
          patch = mock.patch.object(step_lib, "create_model",
                                    lambda c: official_model(models_vit, c))
        with patch or mock.patch.dict({}):
          result = fit.check(config, tpu, eval_step=False)
        step = result.train
        state = sum(step.memory.state.values())
        if step.accepted:
          totals[side] = step.needs
          cells[side] = (f"{state / GIB:.2f} / {step.memory.temporaries / GIB:.2f} / "
                         f"**{step.needs / GIB:.2f} GiB**")
        else:
          cells[side] = f"refused ({step.message})"
        print(f"  {model} {dtype} {side}: {cells[side]} (compiled in {step.seconds:.0f} s)",
              file=sys.stderr, flush=True)
        if side == "official":
          official_cells[model] = cells[side]
          if side in totals:
            official_totals[model] = totals[side]
      ratio = (f"{totals['ours'] / totals['official']:.2f}"
               if len(totals) == 2 else "-")
      print(f"| {model} | {dtype} | {cells['ours']} | {cells['official']} | {ratio} |",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
