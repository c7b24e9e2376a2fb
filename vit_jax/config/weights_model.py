"""`config.model_name='auto'`: the ViT the weights of `config.init_from` record, and the check
that a named model agrees with them, before any work (issue 52; docs/checkpoints.md "The
architecture from the weights"). Called by `vit_jax.config.resolution.resolve`."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from absl import logging
import ml_collections

from vit_jax.config import defaults
from vit_jax.config.keys import ConfigError
from vit_jax.models import fields as fields_lib
from vit_jax.models import vit_fields


#: `config.model_name` that takes the ViT the weights of `config.init_from` record.
AUTO = "auto"
#: `checkpoint.model_fields` that are not the architecture: the head is replaced for the data's
#: classes, the position table resized to the images' grid, a pre-logits layer dropped, the
#: patch embedding resized to another patch size (FlexiViT; `checkpoint.finetune` says what
#: cannot be).
_NOT_COMPARED = ("num_classes", "image_size", "representation_size", "patch_size")


def model_from_weights(config: ml_collections.ConfigDict, path: str) -> None:
  """`config.model_name='auto'`: `config.model`'s fields recorded in the weights
  (`Field.in_weights`, `checkpoint.model_fields`) set from them, the rest the ViT defaults;
  heads a file does not record from `config.model.num_heads` (a warning), else a ConfigError
  asking for them. Any other name: ConfigError (the mismatch report) where the config's recorded
  fields disagree with the weights', before any work. T2T-ViT and PyTorch files: unchecked."""
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top  (a cycle at import)
  from vit_jax.checkpoint import ecosystem  # pylint: disable=g-import-not-at-top
  if "model" not in config:  # A partial config (tests): nothing to set or compare.
    return
  auto = config.get("model_name") == AUTO
  heads = config.model.get("num_heads")
  if auto:
    config.model_name = "ViT-custom"
    if "gelu_approximate" not in config.model:  # A T2T-ViT config: its heads are not a ViT's.
      heads = None
      config.model = defaults.model_config("ViT-custom", **AUTO_PLACEHOLDERS)
      config.model.num_heads = None
  if "gelu_approximate" not in config.model or _is_torch_file(path):
    return
  try:
    found = checkpoint.model_fields(path)
  except ValueError as e:  # A timm file at a non-standard width does not record its heads.
    if "heads" not in str(e):
      raise
    found = checkpoint.model_fields(path, num_heads=1)
    del found["num_heads"]  # Not recorded.
    width = found["hidden_size"]
    fits = bool(heads) and width % heads == 0
    if auto and not fits:
      raise ConfigError("model.num_heads", heads, f"is needed: {path} does not record its "
                        f"attention heads (width {width} is not a standard ViT's)",
                        f"set --config.model.num_heads=N (N divides {width}: the heads the "
                        "weights were trained with).") from None
    if fits:  # Else another width than the config's: the mismatch report below.
      found = checkpoint.model_fields(path, num_heads=heads)
    if auto:
      logging.warning("init_from %s does not record its attention heads: model.num_heads=%d "
                      "from the config.", path, heads)
  recorded = {f.name: f.default for f in vit_fields.VIT_FIELDS
              if f.in_weights and (f.default is not fields_lib.REQUIRED or f.name in found)}
  recorded.update({k: v for k, v in found.items() if k in recorded})
  if isinstance(recorded["patch_size"], int):  # The config's spelling: (height, width).
    recorded["patch_size"] = (recorded["patch_size"],) * 2
  if auto:
    config.model.update(recorded)
    logging.info("model_name=auto: the ViT of %s: %s.", path,
                 ", ".join(f"{k}={v!r}" for k, v in recorded.items()))
    _fit_image_size(config, recorded["patch_size"], found.get("image_size"))
    return
  mismatched = [f"model.{k}: weights {v!r}, config {_spelled(config.model[k])!r}"
                for k, v in recorded.items()
                if k not in _NOT_COMPARED + ecosystem.NUMERICS and k in config.model
                and _spelled(config.model[k]) != v]  # The numerics: set from the weights below.
  if mismatched:
    raise ConfigError("init_from", path, checkpoint.mismatch_report(
        f"records another architecture than config.model_name={config.model_name!r}:",
        [], [], mismatched, mismatched_kind="field mismatches"), "fine-tune with "
        "--config.model_name=auto (the weights' architecture), or set each field above to the "
        "weights' value.")


def _is_torch_file(path: str) -> bool:
  """Whether `path` is a PyTorch file (its variant is not recorded: nothing to read)."""
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top  (a cycle at import)
  try:
    return checkpoint.is_torch_checkpoint(path)
  except OSError:  # A directory (transformers, Orbax, a workdir).
    return False


def _fit_image_size(config: ml_collections.ConfigDict, patch: Tuple[int, int],
                    weights_size: Optional[int]) -> None:
  """model_name=auto: a `config.data.image_size` that the weights' patch does not divide set to
  the weights' own size (else the next multiple of the patch), with a warning: the config's
  size was chosen for another model."""
  size = config.data.image_size
  if not size or all(size % p == 0 for p in patch):
    return
  fitted = weights_size if weights_size and weights_size % patch[0] == 0 else (
      -(-size // patch[0]) * patch[0])
  logging.warning("model_name=auto: config.data.image_size=%d is not a multiple of the weights' "
                  "patch %s; images resized to %d instead (set --config.data.image_size to "
                  "choose).", size, patch, fitted)
  config.data.image_size = fitted


def _spelled(value: Any) -> Any:
  """A config value as `checkpoint.model_fields` spells it (a list or int patch: a tuple)."""
  return tuple(value) if isinstance(value, list) else value


#: ViT-custom's required fields for a config of model_name=auto (configs/vit.py:auto, a T2T-ViT
#: config): the weights' replace them; `num_heads` is None there (read or asked for).
AUTO_PLACEHOLDERS = dict(patch_size=16, hidden_size=768, num_layers=12, num_heads=12,
                         mlp_dim=3072)
