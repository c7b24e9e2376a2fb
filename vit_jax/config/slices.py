"""A recipe's global batch on a Cloud TPU slice: `fit_to_slice(config, 'v3-32')` keeps the batch
and sets bfloat16 compute, FSDP when the replicated state would crowd a device, and the fewest
micro-batches whose estimated memory fits (docs/pods.md, "A recipe on a slice"); the pre-flight
(`python -m vit_jax.preflight`) confirms the estimate by compiling.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import ml_collections

from vit_jax import accounting
from vit_jax import hardware as hardware_lib
from vit_jax import models
from vit_jax.config import keys
from vit_jax.config import resolution

#: What an accelerator looks like in a config's argument ('v3-32', 'v5litepod-16', 'v6e-8'; also
#: 'a100-8', which `fit_to_slice` then refuses as not a TPU, naming what it takes).
SLICE_PATTERN = r"[a-z][a-z0-9]*-[0-9]+"

#: The share of the program's HBM the estimate may fill (its margin).
BUDGET = 0.8
#: A train state above this share of the HBM is sharded (FSDP) over the fewest devices needed.
STATE_SHARE = 0.15

#: Activation bytes kept per image, per element of the token sequences (layers x tokens x width)
#: and byte of the compute dtype, by remat policy: fitted to the TPU compiler (docs/pods.md).
ACTIVATION_FACTOR = {
    "nothing_saveable": 4.0, "qkv_saveable": 8.5, "dots_with_no_batch_dims_saveable": 15.0,
    "dots_and_attention_saveable": 15.0, "dots_saveable": 17.0, "everything_saveable": 24.0,
}
#: Without remat every intermediate of the block is kept.
NO_REMAT_FACTOR = 24.0
#: Copies of one block's attention matrices [heads, N, N] alive at once (float32).
ATTENTION_COPIES = 4
#: [tokens, width] copies alive at once in a forward pass (inference), one block at a time: its
#: input, the normed input, q, k, v, the attention's output, the MLP's hidden (4 x width), the
#: sums; and the position table resampled to the token grid (2 float32 copies).
FORWARD_FACTOR = 14.0


def _sequences(model_name: str, fields: dict[str, Any],
               image_size: int) -> list[tuple[int, int, int, int]]:
  """(blocks, tokens, width, heads) of the token sequences one image flows through (a hybrid's
  ResNet stem not counted, its stride is; T2T-ViT's T2T module: its first two soft splits' grids,
  Performer heads 0)."""
  config = models.model_config(model_name, **dict(fields, attention="xla"))
  if "embed_dim" in config:  # T2T-ViT.
    first, second, last = (h * w for h, w in models.t2t.stage_grids(image_size, image_size))
    t2t_heads = 1 if config["tokens_type"] == "transformer" else 0
    return [(config["depth"], last + 1, config["embed_dim"], config["num_heads"]),
            (1, first, config["token_dim"], t2t_heads),
            (1, second, config["token_dim"], t2t_heads)]
  stem = config.get("resnet_num_layers")
  stride = config["patch_size"][0] * (1 if stem is None else models.resnet.resnet_stride(stem))
  tokens = (image_size // stride) ** 2 + models.vit_fields.prefix_tokens(config)
  return [(config["num_layers"], tokens, config["hidden_size"], config["num_heads"])]


def activation_bytes(model_name: str, fields: dict[str, Any], image_size: int) -> float:
  """Estimated bytes of one image's activations in a training step: `ACTIVATION_FACTOR[policy] x
  dtype bytes x blocks x tokens x width` over the sequences, plus one block's float32 attention
  matrices, `ATTENTION_COPIES x 4 x heads x tokens^2`."""
  dtype_bytes = 2 if str(fields.get("dtype", "float32")) == "bfloat16" else 4
  factor = (ACTIVATION_FACTOR[fields.get("remat_policy", "nothing_saveable")]
            if fields.get("remat", False) else NO_REMAT_FACTOR)
  sequences = _sequences(model_name, fields, image_size)
  kept = sum(factor * dtype_bytes * blocks * tokens * width
             for blocks, tokens, width, _ in sequences)
  attention = max(ATTENTION_COPIES * 4 * heads * tokens**2 for _, tokens, _, heads in sequences)
  return kept + attention


def _cores() -> int:
  """The cores this process may run on: XLA:CPU's intra-op threads."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def forward_bytes(model_name: str, fields: dict[str, Any], image_size: int) -> float:
  """Estimated bytes of one image's forward pass (inference), one block at a time: `FORWARD_FACTOR
  x dtype bytes x tokens x width` of its largest sequence, plus its float32 [tokens, tokens]
  attention matrices by `fields['attention']`: XLA's, `ATTENTION_COPIES` per head; vit_jax's
  fused CPU kernel, one per thread that ran it (its scratch, kept: the pool's, at most the heads,
  and the caller; measured at 600 px); cuDNN's flash attention, none."""
  dtype_bytes = 2 if str(fields.get("dtype", "float32")) == "bfloat16" else 4
  sequences = _sequences(model_name, fields, image_size)
  kept = max(FORWARD_FACTOR * dtype_bytes * tokens * width for _, tokens, width, _ in sequences)
  attention = fields.get("attention", "xla")

  def copies(heads: int) -> int:
    if attention == "cudnn":
      return 0
    if attention == "xla":
      return ATTENTION_COPIES * heads
    return min(heads, _cores()) + 1

  return kept + max(copies(heads) * 4 * tokens**2 for _, tokens, _, heads in sequences)


def parameter_count(model_name: str, fields: dict[str, Any], num_classes: int,
                    image_size: int) -> int:
  """Trainable parameters of the model (abstract `init`: nothing allocated)."""
  fields = {k: v for k, v in fields.items()  # Unset fields (None) take the model's defaults.
            if k not in ("dtype", "param_dtype", "attention") and v is not None}
  model = models.create(model_name, num_classes=num_classes, attention="xla", **fields)
  shapes = models.abstract_variables(model, (image_size, image_size))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


def fit_to_slice(config: ml_collections.ConfigDict, accelerator: str,
                 num_classes: int = 1000) -> dict[str, Any]:
  """Sets an unlocked `config`'s dtype, mesh and accumulation for the Cloud TPU type
  `accelerator` ('v3-8'), in place (`num_classes`: the head's when `config.num_classes` is unset).

  Returns:
    What was set (`{'model.dtype', 'mesh.data', 'mesh.fsdp', 'grad_accum_steps', 'slice'}`) and
    'estimate' (bytes per device 'state', 'activations', 'budget'; 'micro_batch').

  Raises:
    ValueError: a non-TPU accelerator; a batch the devices cannot split; a model that does not
      fit a device even one image at a time (naming what to use).
  """
  hardware = accounting.accelerator(accelerator)
  if hardware.platform != "tpu":
    raise ValueError(f"The <slice> of a config is a Cloud TPU type (v3-8, v3-32, v4-64, ...), "
                     f"got {accelerator!r}.")
  devices = hardware.num_devices
  batch = int(config.batch_size)
  if batch % devices:
    raise keys.ConfigError(
        "batch_size", batch, f"(the global batch) cannot be split over the {devices} devices of "
        f"{accelerator}", "use a slice whose device count divides it, or "
        f"config.batch_size={batch // devices * devices or devices}.")
  hbm = hardware_lib.program_hbm_bytes(hardware.device_kind)
  fields = dict(config.model.to_dict(), dtype="bfloat16")
  if fields.get("remat_policy") == "auto":  # What resolve will pick (the slice's platform).
    fields["remat_policy"] = resolution.remat_choice(fields, [hardware]).implementation
  image_size = int(config.data.image_size)
  classes = int(config.num_classes or num_classes)
  params = parameter_count(config.model_name, fields, classes, image_size)
  per_param = resolution.state_bytes_per_param(config.ema_decay)
  fsdp = 1
  while fsdp < devices and params * per_param / fsdp > STATE_SHARE * hbm:
    fsdp *= 2
  fsdp = min(fsdp, devices)
  state = params * per_param / fsdp
  per_image = activation_bytes(config.model_name, fields, image_size)
  budget = BUDGET * hbm - state
  per_device = batch // devices
  if budget < per_image:
    gib = hardware_lib.GIB
    raise ValueError(f"{config.model_name} does not fit a device of {accelerator} even one "
                     f"image at a time ({state / gib:.1f} GiB of state, about "
                     f"{per_image / gib:.2f} GiB per image): use a larger slice (more devices "
                     "to shard the state over) or one with more HBM per device (v4, v5p).")
  accumulation = next(a for a in range(1, per_device + 1)
                      if per_device % a == 0 and per_device // a * per_image <= budget)
  settings = {"model.dtype": "bfloat16", "mesh.data": -1, "mesh.fsdp": fsdp,
              "grad_accum_steps": accumulation, "slice": accelerator}
  config.update_from_flattened_dict(settings)
  settings["estimate"] = {"state": state, "activations": per_device // accumulation * per_image,
                          "budget": BUDGET * hbm, "micro_batch": per_device // accumulation}
  return settings
