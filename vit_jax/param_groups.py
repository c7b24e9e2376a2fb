"""Parameter groups of the fine-tuning controls (``vit_jax.config.defaults.FINETUNE_KEYS``;
docs/configs.md "Fine-tuning controls"): each parameter's layer, learning-rate scale,
weight-decay multiplier and whether it trains, and the table the run logs."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import time
from typing import Any, Optional, Sequence

import jax
import ml_collections
import numpy as np
import regex  # The user's patterns: its matching takes a timeout, `re`'s cannot be bounded.

from vit_jax.config import defaults
from vit_jax.config import keys
from vit_jax.config.keys import ConfigError
from vit_jax.models import layout

#: Top-level modules after the encoder: layer L + 1 (timm: the head group).
HEAD_KEYS = ("head", "pre_logits", "MAPHead_0", "fc_norm")
#: The encoder's final norm: layer L, with the last block (timm's ViT: `norm` joins its group).
FINAL_NORMS = (("Transformer", "encoder_norm"), ("norm",))
#: Parameter names are matched whole, as big_vision's `config.schedule`.
PATTERN_HELP = ("patterns match the whole '/'-joined name (re.fullmatch), e.g. 'head/.*', "
                "'Transformer/encoderblock_[0-5]/.*', '(?!head/).*' (all but the head)")
#: The most characters a pattern may have, and its counted repeats (`{m,n}`) may multiply to
#: (`regex` unrolls them when it compiles).
MAX_PATTERN_CHARS = 500
MAX_REPEAT_PRODUCT = 10_000
#: The seconds one pattern may take over all the parameter names (`regex`'s timeout).
PATTERN_SECONDS = 1.0
#: Long names of each family's parameters: every pattern is timed on them before the model exists.
PROBE_NAMES = ("Transformer/encoderblock_47/MultiHeadDotProductAttention_1/query/kernel",
               "Transformer/encoderblock_47/MlpBlock_3/Dense_1/bias",
               "Transformer/posembed_input/pos_embedding", "Transformer/encoder_norm/scale",
               "MAPHead_0/MultiHeadDotProductAttention_0/out/kernel", "embedding/kernel",
               "tokens_to_token/attention2/mlp_2/kernel", "blocks_23/attn/qkv/kernel",
               "conv_root/kernel", "block4/unit3/gn_proj/scale", "head/bias", "cls")


@dataclasses.dataclass(frozen=True)
class FinetuneControls:
  """`config.optim`'s fine-tuning controls, checked and normalised (`finetune_controls`)."""

  layer_decay: Optional[float]
  freeze: tuple[str, ...]
  wd_mults: tuple[tuple[str, float], ...]  # (regex, weight-decay multiplier).
  head_warmup_steps: int
  head_warmup_pattern: str

  @property
  def on(self) -> bool:
    return bool(self.layer_decay is not None or self.freeze or self.wd_mults or
                self.head_warmup_steps)


def _bad(key: str, value: Any, what: str, fix: str) -> ConfigError:
  return ConfigError(f"optim.{key}", value, what, f"set config.optim.{key} {fix}.")


def _pattern(key: str, value: Any, pattern: Any) -> str:
  """`pattern` if a regex within the bounds above that does not start with '/'; else
  ConfigError."""
  if not isinstance(pattern, str) or not pattern:
    raise _bad(key, value, f"holds {pattern!r}, not a regex string", f"as in: {PATTERN_HELP}")
  if len(pattern) > MAX_PATTERN_CHARS:
    raise _bad(key, value, f"holds a pattern of {len(pattern):,} characters, "
               f"more than the {MAX_PATTERN_CHARS} allowed",
               f"to a shorter one ({PATTERN_HELP})")
  counts = [max(int(n or 0) for n in m) for m in re.findall(r"\{(\d*),?(\d*)\}", pattern)]
  if math.prod(c for c in counts if c) > MAX_REPEAT_PRODUCT:
    raise _bad(key, value, f"holds {pattern!r}, whose counted repeats ({{m,n}}) multiply to "
               f"more than {MAX_REPEAT_PRODUCT:,}: too large to compile (parameter names are "
               "short)", f"to one with smaller counts ({PATTERN_HELP})")
  if pattern.startswith("/"):
    raise _bad(key, value, f"holds {pattern!r}: parameter names never start with '/'",
               f"without it ({PATTERN_HELP})")
  try:
    regex.compile(pattern)
  except regex.error as e:
    raise _bad(key, value, f"holds {pattern!r}, not a valid regex ({e})",
               f"to a valid one ({PATTERN_HELP})") from None
  _matching(key, value, pattern, PROBE_NAMES)
  return pattern


def _matching(key: str, value: Any, pattern: str, names: Sequence[str]) -> list[bool]:
  """Whether `pattern` matches each of `names` whole (`regex.fullmatch`), within PATTERN_SECONDS
  in all; else ConfigError of `config.optim.<key>` (holding `value`)."""
  compiled = regex.compile(pattern)
  deadline = time.monotonic() + PATTERN_SECONDS
  try:
    return [compiled.fullmatch(n, timeout=max(deadline - time.monotonic(), 0.0)) is not None
            for n in names]
  except TimeoutError:
    raise _bad(key, value, f"holds {pattern!r}, which takes more than {PATTERN_SECONDS:g} s "
               f"to match {len(names)} parameter names: it backtracks without end (nested or "
               "overlapping repeats, such as '(.|.)*' or '(a+)+')",
               f"to a simpler pattern, without nested repeats ({PATTERN_HELP})") from None


def finetune_controls(optim: ml_collections.ConfigDict) -> FinetuneControls:
  """The fine-tuning controls of `config.optim`, checked (a key absent, None or an empty
  pattern: its default). ConfigError naming the key and the fix."""
  values = {}
  for key in defaults.FINETUNE_KEYS:
    value = optim.get(key.name)
    empty = key.type in (tuple, str) and not value
    values[key.name] = key.default if value is None or empty else value
  keys.check(values, defaults.FINETUNE_KEYS, "optim.")
  freeze = values["freeze"]
  wd_mults = values["wd_mults"]
  freeze = (freeze,) if isinstance(freeze, str) else tuple(freeze)
  freeze = tuple(_pattern("freeze", freeze, p) for p in freeze)
  wd_mults = tuple((_pattern("wd_mults", wd_mults, p), float(m)) for p, m in wd_mults)
  head = values["head_warmup_pattern"]
  _pattern("head_warmup_pattern", head, head)
  decay = values["layer_decay"]
  layer_decay = None if decay is None else float(decay)
  return FinetuneControls(layer_decay, freeze, wd_mults, values["head_warmup_steps"], head)


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One parameter as the controls see it: a stacked (scanned) one as its L per-layer slices."""

  name: str  # The stored name, '/'-joined dict keys.
  names: tuple[str, ...]  # (name,), or the slices' per-layer names ('.../encoderblock_3/...').
  layers: tuple[int, ...]  # The layer id of each: 0 (stem) .. L + 1 (head).
  size: int  # Elements of each.


def name_of(path) -> str:
  """A tree path's '/'-joined dict keys: the name the patterns match."""
  return "/".join(layout.dict_keys(path))


def _tensors(params: Any) -> tuple[list[_Tensor], int]:
  """The parameters in tree order and L, the number of encoder blocks (0: none found)."""
  leaves = [(layout.dict_keys(path), tuple(np.shape(leaf)))
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
  block = re.compile(rf"({'|'.join(layout.BLOCK_PREFIXES)})_(\d+)")
  num_layers = 0
  for keys, shape in leaves:
    for key in keys:
      match = block.fullmatch(key)
      if match:
        num_layers = max(num_layers, int(match.group(2)) + 1)
      elif key in layout.BLOCK_PREFIXES and shape:
        num_layers = max(num_layers, shape[0])
  tensors = []
  for keys, shape in leaves:
    name = "/".join(keys)
    stacked = [j for j, key in enumerate(keys) if key in layout.BLOCK_PREFIXES and shape]
    if stacked:
      j = stacked[0]
      names = tuple("/".join(keys[:j] + (f"{keys[j]}_{i}",) + keys[j + 1:])
                    for i in range(shape[0]))
      tensors.append(_Tensor(name, names, tuple(range(1, shape[0] + 1)),
                             math.prod(shape[1:])))
      continue
    matches = [block.fullmatch(key) for key in keys]
    index = next((int(m.group(2)) for m in matches if m), None)
    if index is not None:
      layer = index + 1
    elif keys[0] in HEAD_KEYS:
      layer = num_layers + 1
    elif any(keys[:len(n)] == n for n in FINAL_NORMS):
      layer = num_layers
    else:
      layer = 0
    tensors.append(_Tensor(name, (name,), (layer,), math.prod(shape)))
  return tensors, num_layers


def _first_match(patterns: Sequence[str], name: str, hits: dict[str, dict[str, bool]]) -> int:
  """The index of the first of `patterns` that matches all of `name` (`hits`), -1: none."""
  return next((i for i, p in enumerate(patterns) if hits[p][name]), -1)


@dataclasses.dataclass(frozen=True)
class ParamGroups:
  """Per tensor name, per slice ([n], n = L for a stacked tensor, else 1): `frozen` (bool),
  `lr_scale` and `wd_mult` (float64), `freeze_rule` / `wd_rule` (the index of the pattern that
  decided, -1: none); `head`: the tensor trains during the head warm-up."""

  controls: FinetuneControls
  num_layers: int
  tensors: tuple[_Tensor, ...]
  frozen: dict[str, np.ndarray]
  lr_scale: dict[str, np.ndarray]
  wd_mult: dict[str, np.ndarray]
  freeze_rule: dict[str, np.ndarray]
  wd_rule: dict[str, np.ndarray]
  head: dict[str, bool]

  def label(self, name: str) -> str:
    """'frozen' (every slice), else 'head' / 'trunk' with a head warm-up, else 'train'."""
    if self.frozen[name].all():
      return "frozen"
    if self.controls.head_warmup_steps:
      return "head" if self.head[name] else "trunk"
    return "train"

  def update_scale(self, name: str) -> np.ndarray:
    """What the update of each slice is multiplied by: its lr scale, 0 where frozen."""
    return np.where(self.frozen[name], 0.0, self.lr_scale[name])


def param_groups(optim: ml_collections.ConfigDict, params: Any) -> ParamGroups:
  """`config.optim`'s fine-tuning controls applied to `params` (arrays or ShapeDtypeStructs;
  the names as stored, a stacked block seen as its per-layer names), layer ids as timm's
  `param_groups_layer_decay` (docs/configs.md, "Fine-tuning controls"). ConfigError, naming the
  key and the fix, for controls this model cannot follow (a pattern that matches nothing,
  everything frozen)."""
  controls = finetune_controls(optim)
  tensors, num_layers = _tensors(params)
  names = [n for t in tensors for n in t.names]
  examples = ", ".join(repr(n) for n in names[:2] + names[-2:])
  hits: dict[str, dict[str, bool]] = {}  # Pattern -> name -> whether it matches the whole.
  warmup = controls.head_warmup_pattern
  for key, value, patterns in (("freeze", controls.freeze, controls.freeze),
                               ("wd_mults", controls.wd_mults, [p for p, _ in controls.wd_mults]),
                               ("head_warmup_pattern", warmup, [warmup])):
    for i, pattern in enumerate(patterns):
      where = f"[{i}]" if key != "head_warmup_pattern" else ""
      if pattern not in hits:
        hits[pattern] = dict(zip(names, _matching(key, value, pattern, names)))
      if not any(hits[pattern].values()) and (key != "head_warmup_pattern" or
                                              controls.head_warmup_steps):
        raise ConfigError(
            f"optim.{key}{where}", pattern, f"matches no parameter of this model (names such as "
            f"{examples}); {PATTERN_HELP}", f"correct it in config.optim.{key}.")
  if controls.layer_decay is not None and not num_layers:
    blocks = " or ".join(k + "_<i>" for k in layout.BLOCK_PREFIXES)
    raise ConfigError("optim.layer_decay", controls.layer_decay,
                      f"needs encoder blocks ({blocks}); this model has none",
                      "set config.optim.layer_decay=None.")
  decay = 1.0 if controls.layer_decay is None else controls.layer_decay
  mults = [m for _, m in controls.wd_mults]
  wd_patterns = [p for p, _ in controls.wd_mults]
  frozen = {}
  lr_scale = {}
  wd_mult = {}
  freeze_rule = {}
  wd_rule = {}
  head = {}
  for t in tensors:
    freeze_rule[t.name] = np.array([_first_match(controls.freeze, n, hits) for n in t.names])
    frozen[t.name] = freeze_rule[t.name] >= 0
    wd_rule[t.name] = np.array([_first_match(wd_patterns, n, hits) for n in t.names])
    kernel = float(t.name.split("/")[-1] == "kernel")  # `_decay_mask`'s default.
    wd_mult[t.name] = np.array([kernel if r < 0 else mults[r] for r in wd_rule[t.name]])
    lr_scale[t.name] = np.array([decay ** (num_layers + 1 - layer) for layer in t.layers])
    in_head = [hits[warmup][n] for n in t.names]
    if controls.head_warmup_steps and any(in_head) and not all(in_head):
      raise ConfigError(
          "optim.head_warmup_pattern", controls.head_warmup_pattern,
          f"matches only some layers of the stacked (scan=True) {t.name}",
          "match whole tensors, or set config.model.scan=False.")
    head[t.name] = all(in_head)
  if all(f.all() for f in frozen.values()):
    raise ConfigError("optim.freeze", controls.freeze,
                      "freezes every parameter: nothing would train",
                      "leave some out (e.g. the head: '(?!head/).*').")
  if controls.head_warmup_steps:
    trainable = [t.name for t in tensors if not frozen[t.name].all()]
    if not any(head[n] for n in trainable) or all(head[n] for n in trainable):
      what = "no trainable" if not any(head[n] for n in trainable) else "every trainable"
      default = keys.find(defaults.FINETUNE_KEYS, "head_warmup_pattern").default
      trains = "nothing" if what[0] == "n" else "all"
      raise ConfigError(
          "optim.head_warmup_pattern", controls.head_warmup_pattern,
          f"matches {what} parameter: the head warm-up of config.optim.head_warmup_steps="
          f"{controls.head_warmup_steps} would train {trains}",
          f"match the head only (default {default!r}), or set config.optim.head_warmup_steps=0.")
  return ParamGroups(controls, num_layers, tuple(tensors), frozen, lr_scale, wd_mult,
                     freeze_rule, wd_rule, head)


def param_groups_table(groups: ParamGroups) -> str:
  """The groups as a table, a row per (layer when layer_decay is set, frozen, first step, the
  deciding patterns), names summarised by the shortest prefixes only the row holds."""
  c = groups.controls
  rows: dict[tuple, list[tuple[str, int]]] = {}
  for t in groups.tensors:
    for i, (name, layer) in enumerate(zip(t.names, t.layers)):
      frozen = bool(groups.frozen[t.name][i])
      start = 0 if frozen or not c.head_warmup_steps or groups.head[t.name] else (
          c.head_warmup_steps)
      key = (layer if c.layer_decay is not None else -1, frozen, start,
             int(groups.freeze_rule[t.name][i]), int(groups.wd_rule[t.name][i]),
             float(groups.lr_scale[t.name][i]))
      rows.setdefault(key, []).append((name, t.size))
  all_names = [n for t in groups.tensors for n in t.names]
  header = ("group", "layer", "tensors", "params", "lr scale", "wd mult", "frozen",
            "trains from", "rule")
  lines = []
  for key in sorted(rows, key=lambda k: k[:3]):  # Stable: otherwise in the order of the tree.
    members = rows[key]
    layer, frozen, start, freeze_rule, wd_rule, scale = key
    rule = []
    if freeze_rule >= 0:
      rule.append(f"freeze[{freeze_rule}]={c.freeze[freeze_rule]!r}")
    if wd_rule >= 0 and not frozen:
      rule.append(f"wd_mults[{wd_rule}]={c.wd_mults[wd_rule][0]!r}")
    if c.head_warmup_steps and not frozen:
      rule.append("head warm-up" if start == 0 else "after the head warm-up")
    if frozen:
      mult = "-"
    elif wd_rule < 0:
      mult = "kernels"
    else:
      mult = f"{c.wd_mults[wd_rule][1]:g}"
    lines.append((_summary([n for n, _ in members], all_names),
                  "-" if layer < 0 else str(layer), str(len(members)),
                  f"{sum(s for _, s in members):,}", "-" if frozen else f"{scale:.4g}", mult,
                  "yes" if frozen else "no", "-" if frozen else f"step {start}",
                  ", ".join(rule) or "-"))
  widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
  total = sum(t.size * len(t.names) for t in groups.tensors)
  trained = sum(t.size * int((~groups.frozen[t.name]).sum()) for t in groups.tensors)
  warmup = (f", head_warmup_steps={c.head_warmup_steps}, head_warmup_pattern="
            f"{c.head_warmup_pattern!r}" if c.head_warmup_steps else "")
  blocks = f"; L={groups.num_layers} blocks" if c.layer_decay is not None else ""
  title = (f"Parameter groups of config.optim (layer_decay={c.layer_decay}, freeze={c.freeze}, "
           f"wd_mults={c.wd_mults}{warmup}): {trained:,} of {total:,} parameters trained"
           f"{blocks}.")
  fmt = lambda r: "  ".join(v.ljust(w) if i in (0, 8) else v.rjust(w)
                            for i, (v, w) in enumerate(zip(r, widths))).rstrip()
  return "\n".join([title, fmt(header), *map(fmt, lines)])


def _summary(names: Sequence[str], all_names: Sequence[str], most: int = 4) -> str:
  """`names` as the shortest '/'-prefixes (`prefix/*`) that no other name shares, `most` shown."""
  def prefixes(name):
    parts = name.split("/")
    return ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]

  everywhere = collections.Counter(p for n in all_names for p in prefixes(n))
  here = collections.Counter(p for n in names for p in prefixes(n))
  out = []
  for name in names:
    prefix = next(p for p in prefixes(name) if here[p] == everywhere[p])
    item = prefix if prefix == name else prefix + "/*"
    if item not in out:
      out.append(item)
  return ", ".join(out[:most]) + (f", ... (+{len(out) - most})" if len(out) > most else "")
