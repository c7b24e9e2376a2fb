"""The device mesh of ``config.mesh`` (docs/pods.md), the logical-axis rules
(:data:`DEFAULT_RULES`) and the shardings of the state and batch."""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
import ml_collections
import numpy as np

from vit_jax.config.keys import ConfigError
from vit_jax.models import layout

#: The mesh axes, outermost first: the last one gets the fastest interconnect.
MESH_AXES: Tuple[str, ...] = ("data", "fsdp", "tensor")

Rules = Tuple[Tuple[str, Any], ...]

#: logical axis -> mesh axis (or axes). Logical names of the models without a rule stay whole.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("qkv", "tensor"),
    ("conv_out", "tensor"),
)


def axis_sizes(mesh_cfg: ml_collections.ConfigDict, num_devices: int) -> Dict[str, int]:
  """``{'data', 'fsdp', 'tensor'}`` sizes of ``config.mesh`` (-1 resolved; data x ``dcn_data``).
  ValueError: a size 0 or below -1, two -1, or a product other than ``num_devices``."""
  sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
  dcn = _dcn_data(mesh_cfg)
  bad = [a for a, s in sizes.items() if s == 0 or s < -1]
  free = [a for a, s in sizes.items() if s == -1]
  if bad or len(free) > 1:
    raise ValueError(
        f"config.mesh sizes {sizes} must be positive, with at most one -1 ('the rest'); "
        f"e.g. --config.mesh.data=-1 --config.mesh.fsdp=1 --config.mesh.tensor=1.")
  fixed = math.prod(s for s in sizes.values() if s != -1) * dcn
  if free:
    if num_devices % fixed:
      raise ValueError(
          f"config.mesh {_describe(sizes, dcn)} cannot fill {num_devices} devices: the fixed "
          f"axes use {fixed}, which does not divide {num_devices}. Choose sizes whose product "
          f"divides {num_devices}.")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(
        f"config.mesh {_describe(sizes, dcn)} has {fixed} devices but there are {num_devices} "
        f"(jax.device_count()). Make the product of the sizes {num_devices}, or set one axis to "
        "-1 (e.g. --config.mesh.data=-1) to use the rest.")
  sizes["data"] *= dcn
  return sizes


def _dcn_data(mesh_cfg: ml_collections.ConfigDict) -> int:
  dcn = int(mesh_cfg.dcn_data)
  if dcn < 1:
    raise ValueError(f"config.mesh.dcn_data={dcn} must be >= 1 (the number of slices).")
  return dcn


def slice_attribute(devices: Sequence[Any]) -> Optional[str]:
  """What :func:`create_mesh` groups ``devices`` into slices by: 'slice_index' where they carry
  it, else 'process_index' on CPU and GPU (a process is a slice); None for TPU devices without
  it (one slice)."""
  if hasattr(devices[0], "slice_index"):
    return "slice_index"
  return None if devices[0].platform == "tpu" else "process_index"


def slice_indices(devices: Sequence[Any]) -> list[int]:
  """Each device's slice, by :func:`slice_attribute` (0 where there is none)."""
  attribute = slice_attribute(devices)
  return [getattr(d, attribute) if attribute else 0 for d in devices]


def num_slices(devices: Sequence[Any]) -> int:
  """How many slices ``devices`` form (:func:`slice_indices`)."""
  return len(set(slice_indices(devices)))


def check_slices(mesh_cfg: ml_collections.ConfigDict, devices: Sequence[Any]) -> None:
  """ValueError unless ``config.mesh.dcn_data`` is the number of slices ``devices`` form
  (:func:`num_slices`); on CPU and GPU, whose processes share one network, 1 also passes."""
  dcn = _dcn_data(mesh_cfg)
  found = num_slices(devices)
  attribute = slice_attribute(devices)
  if dcn == found or (dcn == 1 and attribute == "process_index"):
    return
  by = {"slice_index": "by their slice_index",
        "process_index": f"one per process: {devices[0].platform.upper()} devices have no "
                         "slice_index",
        None: "TPU devices without a slice_index"}[attribute]
  effect = ("the mesh would lay its axes across the slow network between slices" if dcn == 1
            else f"its data axis cannot span {dcn} slices")
  fix = (f"config.mesh.dcn_data=1 (one network) or {found} (a slice per process)"
         if attribute == "process_index" and found > 1 else f"config.mesh.dcn_data={found}")
  raise ConfigError(
      "mesh.dcn_data", dcn, f"but the {len(devices)} device{'s' * (len(devices) != 1)} "
      f"form{'s' * (len(devices) == 1)} {found} slice{'s' * (found != 1)} ({by}): {effect}",
      f"set {fix}.")


def _describe(sizes: Dict[str, int], dcn: int) -> str:
  text = " x ".join(f"{a}={s}" for a, s in sizes.items())
  return text + (f" x dcn_data={dcn}" if dcn > 1 else "")


def create_mesh(mesh_cfg: ml_collections.ConfigDict,
                devices: Optional[Sequence[Any]] = None) -> jax.sharding.Mesh:
  """The mesh of ``config.mesh`` over :func:`device_grid`. Raises as :func:`device_grid`."""
  return jax.sharding.Mesh(device_grid(mesh_cfg, devices), MESH_AXES)


def device_grid(mesh_cfg: ml_collections.ConfigDict,
                devices: Optional[Sequence[Any]] = None) -> np.ndarray:
  """The devices (default ``jax.devices()``) laid out as ``config.mesh`` (with ``dcn_data``:
  'data' outermost over the slices). Raises as :func:`check_slices` and :func:`axis_sizes`."""
  devices = list(jax.devices() if devices is None else devices)
  check_slices(mesh_cfg, devices)
  sizes = axis_sizes(mesh_cfg, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  dcn = int(mesh_cfg.dcn_data)
  if dcn > 1:
    ici = (shape[0] // dcn,) + shape[1:]
    return mesh_utils.create_hybrid_device_mesh(
        ici, (dcn, 1, 1), devices,
        process_is_granule=slice_attribute(devices) == "process_index")
  if devices[0].platform == "cpu":  # No topology to respect; keep the order (deterministic).
    return np.asarray(devices).reshape(shape)
  return mesh_utils.create_device_mesh(shape, devices)


def parse_rules(text: str, mesh_axes: Sequence[str] = MESH_AXES) -> Rules:
  """:data:`DEFAULT_RULES` with ``config.mesh.rules`` ('embed=,mlp=fsdp,batch=data+fsdp') applied;
  ValueError for a malformed entry or an unknown mesh axis."""
  rules = dict(DEFAULT_RULES)
  for entry in filter(None, (e.strip() for e in (text or "").split(","))):
    match = re.fullmatch(r"([A-Za-z_][\w]*)\s*=\s*([\w+]*)", entry)
    if not match:
      raise ValueError(f"config.mesh.rules entry {entry!r} is not 'logical=mesh_axis' "
                       "(e.g. 'embed=fsdp', 'batch=data+fsdp', 'mlp=' for unsharded).")
    logical, target = match.groups()
    axes = tuple(a for a in target.split("+") if a)
    unknown = [a for a in axes if a not in mesh_axes]
    if unknown:
      raise ValueError(f"config.mesh.rules entry {entry!r} names the mesh axis "
                       f"{unknown[0]!r}, which is not one of {tuple(mesh_axes)}.")
    rules[logical] = axes[0] if len(axes) == 1 else (axes or None)
  return tuple(rules.items())


def batch_axes(rules: Rules) -> Tuple[str, ...]:
  """The mesh axes the batch ('batch') is split over."""
  target = dict(rules).get("batch")
  return (target,) if isinstance(target, str) else tuple(target or ())


def batch_sharding(mesh: jax.sharding.Mesh, rules: Rules) -> jax.sharding.NamedSharding:
  """Sharding of `[B, ...]` input batches: B split over the 'batch' rule's mesh axes."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(batch_axes(rules) or None))


def variable_shardings(abstract_variables: Any, mesh: jax.sharding.Mesh, rules: Rules) -> Any:
  """NamedShardings of a boxed ``jax.eval_shape(model.init)``; unnamed leaves replicated."""
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_variables), mesh, rules)


def like_params(tree: Any, params: Any, param_shardings: Any,
                default: jax.sharding.NamedSharding) -> Any:
  """Shardings of a tree mirroring ``params`` (optimizer state): a leaf gets the parameter's of
  its shape and dict-key path (or the longest tail of it), else ``default``."""
  param_leaves = jax.tree_util.tree_leaves_with_path(params)
  sharding_leaves = jax.tree_util.tree_leaves(param_shardings)
  by_path = {(layout.dict_keys(path), tuple(leaf.shape)): sharding
             for (path, leaf), sharding in zip(param_leaves, sharding_leaves)}

  def find(path, leaf):
    keys = layout.dict_keys(path)
    shape = tuple(np.shape(leaf))
    for i in range(len(keys)):
      if (keys[i:], shape) in by_path:
        return by_path[keys[i:], shape]
    return default

  return jax.tree_util.tree_map_with_path(find, tree)


def state_shardings(shapes: Dict[str, Any], boxed_variables: Any, mesh: jax.sharding.Mesh,
                    rules: Rules) -> Dict[str, Any]:
  """NamedShardings of (a subset of) the train state: variables by their logical axes,
  optimizer moments like their parameters, the rest replicated."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  variables = dict(variable_shardings(boxed_variables, mesh, rules))
  params = variables.pop("params")
  shardings = {}
  for key, tree in shapes.items():
    if key in ("params", "ema_params"):
      shardings[key] = params
    elif key == "model_state":
      shardings[key] = {name: variables.get(name, jax.tree.map(lambda _: replicated, value))
                        for name, value in tree.items()}
    else:
      shardings[key] = like_params(tree, shapes["params"], params, replicated)
  return shardings


def replicated_bytes(abstract_params: Any, shardings: Any) -> Tuple[int, int]:
  """(bytes of parameters every device holds whole, bytes of all parameters)."""
  sizes = [(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize,
            tuple(sharding.shard_shape(tuple(leaf.shape))) == tuple(leaf.shape))
           for leaf, sharding in zip(jax.tree_util.tree_leaves(abstract_params),
                                     jax.tree_util.tree_leaves(shardings))]
  return sum(size for size, whole in sizes if whole), sum(size for size, _ in sizes)


def check_replication(abstract_params: Any, shardings: Any, mesh: jax.sharding.Mesh,
                      max_fraction: float) -> str:
  """A one-line report of the parameter layout; ValueError when ``fsdp > 1`` leaves more than
  ``max_fraction`` of the parameter bytes replicated."""
  replicated, total = replicated_bytes(abstract_params, shardings)
  fraction = replicated / max(total, 1)
  report = (f"Mesh {dict(mesh.shape)}: {total / 2**20:.1f} MiB of parameters, "
            f"{fraction:.1%} replicated on every device.")
  if mesh.shape.get("fsdp", 1) > 1 and fraction > max_fraction:
    raise ValueError(
        f"{report} FSDP was asked for (config.mesh.fsdp={mesh.shape['fsdp']}) but more than "
        f"{max_fraction:.0%} of the parameter bytes stay replicated: the rules do not split the "
        "large kernels over 'fsdp' (check config.mesh.rules, e.g. 'embed=fsdp').")
  return report
