"""The fine-tuning controls of config.optim (vit_jax.param_groups, make_optimizer):
layer-wise lr decay, freezing, weight-decay multipliers, the head-only warm-up; their checks,
the logged table, the train state they make (sharded, checkpointed).

The layer ids are timm 1.0.31's (`param_groups_layer_decay`, by its ViT's `group_matcher`:
`timm.models.group_parameters(m, m.group_matcher(coarse=False), reverse=True)` for
vit_tiny_patch16_224(depth=2) gives cls_token, pos_embed, patch_embed.*, reg_token: 0;
blocks.0.*: 1; blocks.1.* and norm.*: 2; head.*, fc_norm.* (global_pool='avg'), attn_pool.*
(global_pool='map'): 3, scaled by layer_decay^(3 - id))."""

import functools
import os
import re
import time

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tests import data_utils
from vit_jax import checkpoint
from vit_jax import cli
from vit_jax import config as config_lib
from vit_jax import models
from vit_jax import optim
from vit_jax import param_groups
from vit_jax import sharding
from vit_jax import step as step_lib
from vit_jax import train

VIT = dict(hidden_size=8, mlp_dim=16, num_heads=2, num_layers=2, patch_size=4)
T2T = dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0, token_dim=8)
#: Our names -> timm's layer ids (module docstring), L = 2 blocks.
VIT_LAYERS = (("cls", 0), ("embedding/", 0), ("Transformer/posembed_input/", 0),
              ("Transformer/encoderblock_0/", 1), ("Transformer/encoderblock_1/", 2),
              ("Transformer/encoder_norm/", 2), ("head/", 3))
T2T_LAYERS = (("cls_token", 0), ("tokens_to_token/", 0), ("blocks_0/", 1), ("blocks_1/", 2),
              ("norm/", 2), ("head/", 3))
HEAD_SIZE = 8 * 3 + 3  # ViT head kernel [8, 3] and bias [3].


def _abstract(family: str, scan: bool):
  """The parameters of a tiny ViT or T2T-ViT (2 blocks, 3 classes), as ShapeDtypeStructs (a
  fresh tree of the ones traced once)."""
  return jax.tree.map(lambda s: s, _traced_abstract(family, scan))


@functools.lru_cache(maxsize=None)
def _traced_abstract(family: str, scan: bool):
  name, fields, size = (("ViT-custom", VIT, 8) if family == "vit" else
                        ("T2T-ViT-custom", T2T, 32))
  model = models.create(name, num_classes=3, scan=scan, **fields)
  return nn.unbox(jax.eval_shape(lambda: model.init(
      jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)), train=False))["params"])


def _random(abstract, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), jnp.float32),
                      abstract)


def _optim(**changes) -> ml_collections.ConfigDict:
  """The finetune regime's config.optim: SGD, no momentum, clipping or weight decay, + changes."""
  config = config_lib.get_config("ViT-custom", "fashion_mnist_local", **VIT)
  config.regime = "finetune"
  optim_config = config_lib.fill_regime(config).optim
  optim_config.update(momentum=None, grad_clip_norm=0.0, weight_decay=0.0)
  optim_config.update(changes)
  return optim_config


def _per_layer(tree) -> dict[str, np.ndarray]:
  """`{name: array}` with a stacked (scan=True) tensor split into its per-layer names."""
  flat = {}
  for name, value in checkpoint.flatten_params(jax.device_get(tree)).items():
    stacked = re.search(r"(^|/)(encoderblock|blocks)(/|$)", name)
    if stacked:
      for i, piece in enumerate(np.asarray(value)):
        flat[re.sub(r"(^|/)(encoderblock|blocks)(/)", rf"\g<1>\g<2>_{i}\3", name, 1)] = piece
    else:
      flat[name] = np.asarray(value)
  return flat


def _layer(name: str, table) -> int:
  found = [layer for prefix, layer in table if name == prefix or name.startswith(prefix)]
  assert len(found) == 1, (name, found)
  return found[0]


def _array_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ------------------------------------------------------------------------------------------------
# Layer-wise learning-rate decay.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,scan", [("vit", False), ("vit", True), ("t2t", False),
                                         ("t2t", True)])
def test_layer_decay_scales_each_layers_sgd_update_exactly(family, scan):
  """SGD without momentum: layer i's update is -lr * decay^(L + 1 - i) * grad, bit for bit (the
  factors are powers of two), per slice of the stacked blocks with scan=True."""
  abstract = _abstract(family, scan)
  params, grads = _random(abstract, 0), _random(abstract, 1)
  config = _optim(layer_decay=0.5)
  tx = optim.make_optimizer(config, lambda count: 0.5, abstract)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)  # One program, not op by op.
  table = VIT_LAYERS if family == "vit" else T2T_LAYERS
  flat_updates, flat_grads = _per_layer(updates), _per_layer(grads)
  assert len(flat_updates) == (40 if family == "vit" else 53)
  for name, update in flat_updates.items():
    factor = np.float32(-0.5 * 0.5 ** (3 - _layer(name, table)))
    np.testing.assert_array_equal(update, flat_grads[name] * factor, err_msg=name)


def test_layer_ids_of_the_stem_registers_hybrid_and_heads():
  """Registers, a hybrid's ResNet stem: layer 0; MAP head, pre_logits, fc_norm, head: L + 1."""
  leaf = jax.ShapeDtypeStruct((2,), jnp.float32)
  params = {"conv_root": {"kernel": leaf}, "gn_root": {"scale": leaf},
            "block1": {"unit1": {"conv1": {"kernel": leaf}}}, "registers": leaf,
            "embedding": {"kernel": leaf}, "Transformer": {
                "posembed_input": {"pos_embedding": leaf},
                "encoderblock": {"MlpBlock_0": {"Dense_0": {"kernel": leaf}}},  # L = 2, stacked
                "encoder_norm": {"scale": leaf}},
            "MAPHead_0": {"probe": leaf}, "fc_norm": {"scale": leaf},
            "pre_logits": {"kernel": leaf}, "head": {"kernel": leaf}}
  groups = param_groups.param_groups(_optim(layer_decay=0.5), params)
  assert groups.num_layers == 2
  scales = {name: list(groups.lr_scale[name]) for name in groups.lr_scale}
  assert scales == {
      "conv_root/kernel": [0.125], "gn_root/scale": [0.125],
      "block1/unit1/conv1/kernel": [0.125], "registers": [0.125], "embedding/kernel": [0.125],
      "Transformer/posembed_input/pos_embedding": [0.125],
      "Transformer/encoderblock/MlpBlock_0/Dense_0/kernel": [0.25, 0.5],
      "Transformer/encoder_norm/scale": [0.5], "MAPHead_0/probe": [1.0],
      "fc_norm/scale": [1.0], "pre_logits/kernel": [1.0], "head/kernel": [1.0]}


@pytest.mark.parametrize("optimizer,changes", [
    ("adamw", dict(weight_decay=0.1, grad_clip_norm=1.0)),
    ("sgd", dict(weight_decay=0.01, grad_clip_norm=1.0, momentum=0.9))])
def test_neutral_controls_give_the_plain_optimizers_updates_bit_for_bit(optimizer, changes):
  """layer_decay=1 takes the controls' path; its updates are the default optimizer's."""
  abstract = _abstract("vit", True)
  params = _random(abstract, 0)
  schedule = optim.lr_schedule(0.1, 10, 2, "cosine")
  plain = optim.make_optimizer(_optim(optimizer=optimizer, **changes), schedule)
  neutral = optim.make_optimizer(_optim(optimizer=optimizer, layer_decay=1.0, **changes),
                                 schedule, abstract)
  states = [plain.init(params), neutral.init(params)]
  updates = [jax.jit(plain.update), jax.jit(neutral.update)]
  for seed in range(3):
    grads = _random(abstract, seed + 1, scale=3.0)  # Norm > 1: clipped.
    (a, states[0]), (b, states[1]) = (updates[0](grads, states[0], params),
                                      updates[1](grads, states[1], params))
    chex.assert_trees_all_equal(a, b)
    params = optax.apply_updates(params, a)


# ------------------------------------------------------------------------------------------------
# Freezing.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", [False, True])
def test_linear_probe_freezes_all_but_the_head_with_no_optimizer_state(scan):
  abstract = _abstract("vit", scan)
  params = _random(abstract, 0)
  config = _optim(optimizer="adamw", weight_decay=0.1, freeze=("(?!head/).*",))
  tx = optim.make_optimizer(config, lambda count: 0.1, abstract)
  state = tx.init(params)
  # Adam's mu and nu of the head only (2 x 27 float32), its and the schedule's int32 counts.
  assert _array_bytes(state) == 2 * 4 * HEAD_SIZE + 2 * 4
  plain = optim.make_optimizer(_optim(optimizer="adamw", weight_decay=0.1), lambda count: 0.1)
  assert _array_bytes(plain.init(params)) == 2 * 4 * 1683 + 2 * 4  # Adam's and the schedule's
  update_fn = jax.jit(tx.update)  # One program, not op by op.
  for seed in (1, 2):
    updates, state = update_fn(_random(abstract, seed), state, params)
    for name, update in checkpoint.flatten_params(updates).items():
      if name.startswith("head/"):
        assert np.all(np.asarray(update) != 0), name
      else:
        assert not np.asarray(update).any(), name


def test_frozen_gradients_are_left_out_of_the_clipping_norm():
  """Huge gradients of frozen parameters: the head's (norm 0.5 < clip 1) are not clipped."""
  abstract = _abstract("vit", False)
  params = _random(abstract, 0)
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 1e3, jnp.float32), abstract)
  grads["head"] = {"kernel": jnp.full((8, 3), 0.05), "bias": jnp.full((3,), 0.05)}
  assert float(optax.tree.norm(grads["head"])) < 1.0
  config = _optim(grad_clip_norm=1.0, freeze=("(?!head/).*",))
  tx = optim.make_optimizer(config, lambda count: 0.5, abstract)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)  # One program, not op by op.
  np.testing.assert_array_equal(updates["head"]["kernel"], np.full((8, 3), -0.025, np.float32))


def test_freezing_some_layers_of_a_stacked_encoder_zeroes_their_slices():
  """scan=True: 'encoderblock_0' freezes slice 0 of the stacked tensors (their state stays
  allocated); scan=False: the block's tensors, with no state."""
  config = _optim(optimizer="adamw", weight_decay=0.1,
                  freeze=("Transformer/encoderblock_0/.*",))
  for scan, state_params in ((True, 1683), (False, 1683 - 600)):
    abstract = _abstract("vit", scan)
    params = _random(abstract, 0)
    tx = optim.make_optimizer(config, lambda count: 0.1, abstract)
    state = tx.init(params)
    assert _array_bytes(state) == 2 * 4 * state_params + 2 * 4, scan
    updates, _ = jax.jit(tx.update)(_random(abstract, 1), state, params)  # Not op by op.
    for name, update in _per_layer(updates).items():
      assert np.any(update != 0) != name.startswith("Transformer/encoderblock_0/"), name


# ------------------------------------------------------------------------------------------------
# Weight-decay multipliers.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_wd_mults_scale_each_groups_decay_term(optimizer):
  """Zero gradients: the update is the decay term -lr * wd * mult * p (AdamW's moments give 0);
  unmatched parameters keep the default (1 on kernels, 0 elsewhere); with scan=True a per-layer
  pattern decays only its slice."""
  abstract = _abstract("vit", True)
  params = _random(abstract, 0)
  zeros = jax.tree.map(jnp.zeros_like, params)
  config = _optim(optimizer=optimizer, weight_decay=0.25, wd_mults=(
      ("head/.*", 0.0), ("Transformer/encoderblock_1/.*", 3.0), (".*/bias", 2.0)))
  tx = optim.make_optimizer(config, lambda count: 0.5, abstract)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)  # One program, not op by op.
  flat_params = _per_layer(params)
  for name, update in _per_layer(updates).items():
    mult = (0.0 if name.startswith("head/") else 3.0 if "encoderblock_1/" in name else
            2.0 if name.endswith("/bias") else 1.0 if name.endswith("/kernel") else 0.0)
    expected = (np.float32(0.25 * mult) * flat_params[name]) * np.float32(-0.5)
    np.testing.assert_allclose(update, expected, rtol=1e-7, err_msg=name)
    assert np.any(update != 0) == bool(mult), name


# ------------------------------------------------------------------------------------------------
# The head-only warm-up.
# ------------------------------------------------------------------------------------------------


def test_head_warmup_trains_the_head_alone_then_everything_with_fresh_momentum():
  """SGD momentum 0.9, clip 1, K=2, lr = 0.1 * (count + 1): steps 0 and 1 move the head only
  (clipped by its own norm: not at all); step 2 moves the trunk by its fresh momentum, the
  clipped gradient, at the run's rate of step 2."""
  abstract = _abstract("vit", True)
  params = _random(abstract, 0)
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.1, jnp.float32), abstract)
  grads["head"] = {"kernel": jnp.full((8, 3), 0.05), "bias": jnp.full((3,), 0.05)}
  config = _optim(momentum=0.9, grad_clip_norm=1.0, head_warmup_steps=2)
  tx = optim.make_optimizer(config, lambda count: 0.1 * (count + 1), abstract)
  state = tx.init(params)
  update_fn = jax.jit(tx.update)  # One program, not op by op.
  for step in range(3):
    updates, state = update_fn(grads, state, params)
    trunk = {k: v for k, v in checkpoint.flatten_params(updates).items()
             if not k.startswith("head/")}
    if step < 2:
      assert not any(np.asarray(v).any() for v in trunk.values()), step
    if step == 0:
      np.testing.assert_allclose(updates["head"]["bias"], [-0.005] * 3, rtol=1e-6)
  clip = 1.0 / float(optax.tree.norm(grads))
  for name, update in trunk.items():
    np.testing.assert_allclose(update, np.full(update.shape, -0.3 * 0.1 * clip), rtol=1e-5,
                               err_msg=name)


def _setup(**changes) -> step_lib.Setup:
  """A tiny ViT (2 blocks; scan and remat, the training defaults) fine-tuned with SGD."""
  return data_utils.tiny_step_setup(VIT, changes)


@pytest.mark.slow
def test_head_warmup_in_the_train_step():
  """K=2: the jitted train step moves only the head for 2 steps, then every tensor."""
  setup = _setup(**{"optim.head_warmup_steps": 2, "optim.lr": 0.3})
  state = jax.jit(setup.init_state)(setup.init_rng)
  train_step = jax.jit(setup.train_step_fn())
  batch = {"image": jax.random.normal(jax.random.key(0), (4, 8, 8, 3)),
           "labels": jax.nn.one_hot(jnp.arange(4) % 3, 3)}
  start = previous = _per_layer(state["params"])
  for _ in range(2):
    state, _ = train_step(state, batch)
    now = _per_layer(state["params"])
    for name in start:
      assert np.any(now[name] != previous[name]) == name.startswith("head/"), name
    previous = now
  state, _ = train_step(state, batch)
  now = _per_layer(state["params"])
  assert [name for name in start if np.all(now[name] == previous[name])] == []


# ------------------------------------------------------------------------------------------------
# The train state: shardings and checkpoints.
# ------------------------------------------------------------------------------------------------


def test_optimizer_state_under_a_group_key_gets_its_parameters_sharding():
  """optax.multi_transform keeps the moments under the group's key ('train'): they are
  sharded like their parameters, not replicated."""
  params = {"head": {"kernel": jnp.zeros((2, 3))}, "body": {"kernel": jnp.zeros((3, 3))}}
  param_shardings = {"head": {"kernel": "H"}, "body": {"kernel": "B"}}
  labels = {"head": {"kernel": "train"}, "body": {"kernel": "frozen"}}
  tx = optax.multi_transform({"train": optax.adam(0.1), "frozen": optax.set_to_zero()}, labels)
  shardings = sharding.like_params(tx.init(params), params, param_shardings, "replicated")
  assert jax.tree.leaves(shardings) == ["replicated", "H", "H"]  # count, mu, nu


def test_a_train_state_with_frozen_groups_is_sharded_saved_and_restored(tmp_path):
  setup = _setup(**{"optim.freeze": ("embedding/.*", "cls", "Transformer/posembed_input/.*",
                                     "Transformer/encoderblock_0/.*"),
                    "optim.head_warmup_steps": 2, "optim.layer_decay": 0.75,
                    "optim.wd_mults": (("head/.*", 0.0),), "optim.weight_decay": 0.01})
  state = jax.jit(setup.init_state, out_shardings=setup.state_shardings)(setup.init_rng)
  # Momentum for everything but the stem's 4 tensors (440 parameters); 3 int32 counts (the
  # warm-up's gradient selection and gate, the schedule).
  assert _array_bytes(state["opt_state"]) == 4 * (1683 - 440) + 3 * 4
  # The moments are sharded like their parameters (e.g. 'fsdp' on 'embed'), not replicated.
  param_specs = {k: v.spec for k, v in checkpoint.flatten_params(
      setup.state_shardings["params"]).items()}
  moment_specs = {"/".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)): s.spec
                  for path, s in jax.tree_util.tree_leaves_with_path(
                      setup.state_shardings["opt_state"])}
  moments = {k.partition("/")[2]: spec for k, spec in moment_specs.items() if "/" in k}
  assert sorted(moments) == sorted(k for k in param_specs if not k.startswith(
      ("embedding/", "cls", "Transformer/posembed_input/")))
  assert all(spec == param_specs[name] for name, spec in moments.items())
  assert moments["head/kernel"] == jax.sharding.PartitionSpec("fsdp", None)
  state = dict(state, step=jnp.asarray(5, jnp.int32))
  saved = checkpoint.Workdir(str(tmp_path)).checkpoints(keep=None, asynchronous=False)
  saved.save(5, state, cost={})
  saved.close()
  checkpoint.Workdir(str(tmp_path)).check_state_fits(setup.abstract_state)
  again = checkpoint.Workdir(str(tmp_path)).checkpoints(keep=None, asynchronous=False)
  restored, _ = again.restore(5, setup.abstract_state)
  again.close()
  assert (jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state))
  chex.assert_trees_all_equal(jax.device_get(restored), jax.device_get(state))


# ------------------------------------------------------------------------------------------------
# Checks, config, table.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes,message", [
    (dict(freeze=("heads/.*",)), "config.optim.freeze[0]='heads/.*' matches no parameter of "
     "this model (names such as 'Transformer/encoder_norm/bias'"),
    (dict(freeze=("head",)), "config.optim.freeze[0]='head' matches no parameter"),
    (dict(freeze=("(?!head/).*", "head/.*")), "freezes every parameter: nothing would train"),
    (dict(freeze=("[",)), "config.optim.freeze=('[',) holds '[', not a valid regex"),
    (dict(freeze=("/head/.*",)), "holds '/head/.*': parameter names never start with '/'"),
    (dict(wd_mults=(("head/.*",),)), "config.optim.wd_mults=(('head/.*',),) must be a tuple of "
     "(regex, multiplier >= 0) pairs ((pattern, multiplier) of the weight decay, regexes of the "
     "whole '/'-joined parameter name, the first match deciding; unmatched: 1 on kernels, 0 "
     "elsewhere); set config.optim.wd_mults to such a value, e.g. "
     "config.optim.wd_mults=\"(('head/.*', 0.0),)\"."),
    (dict(wd_mults=(("head/.*", -1.0),)), "must be a tuple of (regex, multiplier >= 0) pairs"),
    (dict(wd_mults=(("bias", 0.0),)), "config.optim.wd_mults[0]='bias' matches no parameter"),
    (dict(layer_decay=1.5), "config.optim.layer_decay=1.5 must be in (0, 1]"),
    (dict(layer_decay=0.0), "config.optim.layer_decay=0.0 must be in (0, 1]"),
    (dict(head_warmup_steps=3, head_warmup_pattern="classifier/.*"),
     "config.optim.head_warmup_pattern='classifier/.*' matches no parameter"),
    (dict(head_warmup_steps=3, head_warmup_pattern=".*"), "matches every trainable parameter"),
    (dict(head_warmup_steps=3, head_warmup_pattern="(head|Transformer/encoderblock_1)/.*"),
     "matches only some layers of the stacked (scan=True) Transformer/encoderblock/"),
    (dict(head_warmup_steps=3, freeze=("head/.*",)), "matches no trainable parameter"),
])
def test_bad_controls_are_refused_naming_the_key(changes, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    optim.make_optimizer(_optim(**changes), lambda count: 0.1, _abstract("vit", True))


def test_resolve_checks_and_normalises_the_controls():
  config = config_lib.get_config("ViT-custom", "fashion_mnist_local", attention="xla", **VIT)
  config.update(batch_size=4, total_steps=10, regime="finetune")
  config.optim.update(warmup_steps=0, layer_decay=0.75, freeze=["cls"], wd_mults=(["head/.*", 0],),
                      head_warmup_steps=2)
  resolve = lambda c: config_lib.resolve(c, num_train_examples=16, num_classes=3,
                                         devices=jax.devices()[:1])
  resolved = resolve(config)
  assert (resolved.optim.layer_decay, resolved.optim.freeze, resolved.optim.wd_mults,
          resolved.optim.head_warmup_steps) == (0.75, ("cls",), (("head/.*", 0.0),), 2)
  text = config_lib.to_json(resolved)  # WORKDIR/config.json
  assert '"layer_decay": 0.75' in text and '"head_warmup_pattern": "head/.*"' in text
  controls = param_groups.finetune_controls
  assert controls(config_lib.from_json(text).optim) == controls(resolved.optim)
  for changes, message in (
      ({"layer_decay": 2.0}, "config.optim.layer_decay=2.0 must be in (0, 1] or None "
       "(layer-wise lr decay (BEiT, timm): layer i of 0 (embeddings) .. L + 1 (head) gets lr * "
       "layer_decay^(L + 1 - i); None turns it off; BEiT and timm fine-tune with 0.65 to 0.75); "
       "set config.optim.layer_decay to such a value."),
      ({"head_warmup_steps": 10}, "config.optim.head_warmup_steps=10 must be smaller than the "
       "run's 10 steps")):
    bad = config_lib.get_config("ViT-custom", "fashion_mnist_local", attention="xla", **VIT)
    bad.update(batch_size=4, total_steps=10, regime="finetune")
    bad.optim.update(warmup_steps=0, **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
      resolve(bad)


def test_command_line_values():
  config = cli.load_config(["--config=configs/fashion_mnist.py", "--config.optim.layer_decay=0.75",
                            "--config.optim.freeze=(?!head/).*",
                            "--config.optim.wd_mults=(('head/.*', 0.0), ('.*/bias', 1.0))",
                            "--config.optim.head_warmup_steps=100"])
  controls = param_groups.finetune_controls(config.optim)
  assert controls == param_groups.FinetuneControls(0.75, ("(?!head/).*",),
                                            (("head/.*", 0.0), (".*/bias", 1.0)), 100, "head/.*")
  defaults = param_groups.finetune_controls(
      cli.load_config(["--config=configs/fashion_mnist.py"]).optim)
  assert defaults == param_groups.FinetuneControls(None, (), (), 0, "head/.*") and not defaults.on
  # A config.optim without the controls (a config.json from before them): each key's default.
  assert param_groups.finetune_controls(ml_collections.ConfigDict({"lr": 0.1})) == defaults


def test_the_table_of_parameter_groups_is_the_same_for_both_layouts():
  config = _optim(layer_decay=0.5, freeze=("Transformer/encoderblock_0/.*",),
                  wd_mults=(("head/.*", 0.0),), head_warmup_steps=3)
  tables = [param_groups.param_groups_table(
      param_groups.param_groups(config, _abstract("vit", scan))) for scan in (False, True)]
  assert tables[0] == tables[1]
  assert tables[0].split("\n") == [
      "Parameter groups of config.optim (layer_decay=0.5, freeze=('Transformer/encoderblock_0/.*',"
      "), wd_mults=(('head/.*', 0.0),), head_warmup_steps=3, head_warmup_pattern='head/.*'): "
      "1,083 of 1,683 parameters trained; L=2 blocks.",
      "group                                                     layer  tensors  params  lr scale"
      "  wd mult  frozen  trains from  rule",
      "Transformer/posembed_input/*, cls, embedding/*                0        4     440     0.125"
      "  kernels      no       step 3  after the head warm-up",
      "Transformer/encoderblock_0/*                                  1       16     600         -"
      "        -     yes            -  freeze[0]='Transformer/encoderblock_0/.*'",
      "Transformer/encoder_norm/*, Transformer/encoderblock_1/*      2       18     616       0.5"
      "  kernels      no       step 3  after the head warm-up",
      "head/*                                                        3        2      27         1"
      "        0      no       step 0  wd_mults[0]='head/.*', head warm-up"]


def test_a_typo_in_a_pattern_stops_the_run_before_the_workdir_is_touched(tmp_path, monkeypatch):
  data_utils.skip_cpu_peak_measurement(monkeypatch)
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=2,
                                        size=8)
  config = _tiny_folder_config(folder, **{"optim.freeze": ("Transformer/encoderblock0/.*",)})
  workdir = tmp_path / "never_created"
  with pytest.raises(train.ConfigError, match=re.escape(
      "config.optim.freeze[0]='Transformer/encoderblock0/.*' matches no parameter")):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


_HELP = param_groups.PATTERN_HELP


@pytest.mark.parametrize("key,value,shown", [
    ("freeze", ("(.|.)*e",), "('(.|.)*e',)"),
    ("wd_mults", (("(.|.)*e", 0.0),), "(('(.|.)*e', 0.0),)"),
    ("head_warmup_pattern", "(.|.)*e", "'(.|.)*e'")])
def test_a_backtracking_pattern_is_refused_within_its_time_bound(key, value, shown):
  """Issue 50: `re.fullmatch('(.|.)*x', name)` never ended (100% CPU, no line)."""
  optim_config = _optim(**{key: value, "head_warmup_steps": 3})
  start = time.monotonic()
  with pytest.raises(ValueError) as raised:
    param_groups.finetune_controls(optim_config)
  assert time.monotonic() - start < 10 * param_groups.PATTERN_SECONDS
  assert str(raised.value) == (
      f"config.optim.{key}={shown} holds '(.|.)*e', which takes more than 1 s to match 12 "
      "parameter names: it backtracks without end (nested or overlapping repeats, such as "
      f"'(.|.)*' or '(a+)+'); set config.optim.{key} to a simpler pattern, without nested "
      f"repeats ({_HELP}).")


def test_a_pattern_slow_only_on_the_models_names_is_refused_there(monkeypatch):
  monkeypatch.setattr(param_groups, "PROBE_NAMES", ("cls",))  # No 'e' to backtrack for.
  abstract = _abstract("vit", False)
  with pytest.raises(ValueError, match=re.escape(
      "config.optim.freeze=('(.|.)*e',) holds '(.|.)*e', which takes more than 1 s to match 40 "
      "parameter names")):
    param_groups.param_groups(_optim(freeze=("(.|.)*e",)), abstract)
  groups = param_groups.param_groups(_optim(freeze=("(?!head/).*",)), abstract)  # The docs' probe.
  assert [n for n, f in groups.frozen.items() if not f.all()] == ["head/bias", "head/kernel"]


def test_patterns_too_large_to_compile_are_refused_before_compiling():
  """`regex` unrolls counted repeats: `(?:a{65535}){65535}` took all the memory."""
  for pattern, message in (
      ("(?:a{65535}){65535}", "config.optim.freeze=('(?:a{65535}){65535}',) holds "
       "'(?:a{65535}){65535}', whose counted repeats ({m,n}) multiply to more than 10,000: too "
       "large to compile (parameter names are short); set config.optim.freeze to one with "
       f"smaller counts ({_HELP})."),
      ("(?:a{2,}){5001}", "whose counted repeats ({m,n}) multiply to more than 10,000"),
      # The value shown shortened: its first 80 and last 10 characters.
      ("head/" + "x" * 500, "config.optim.freeze=('head/" + "x" * 73 + "..." + "x" * 7 + "',) "
       "holds a pattern of 505 characters, more than the 500 allowed; set config.optim.freeze "
       f"to a shorter one ({_HELP}).")):
    with pytest.raises(ValueError, match=re.escape(message)):
      param_groups.finetune_controls(_optim(freeze=(pattern,)))
  assert param_groups.finetune_controls(  # Small counts are fine: 2 * 5000.
      _optim(freeze=("Transformer/encoderblock_[0-9]{2}/.*", "(?:a{2}){5000}"))).freeze


def test_a_backtracking_pattern_stops_the_run_before_the_workdir_is_touched(tmp_path,
                                                                            monkeypatch):
  data_utils.skip_cpu_peak_measurement(monkeypatch)
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=2,
                                        size=8)
  config = _tiny_folder_config(folder, **{"optim.freeze": ("(.|.)*e",)})
  workdir = tmp_path / "never_created"
  start = time.monotonic()
  with pytest.raises(train.ConfigError, match=re.escape(
      "config.optim.freeze=('(.|.)*e',) holds '(.|.)*e', which takes more than 1 s")):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists() and time.monotonic() - start < 60


def _tiny_folder_config(folder, **overrides):
  config = config_lib.get_config("ViT-custom", "fashion_mnist_local", **dict(VIT, num_layers=1))
  config.regime = "finetune"
  config.data.update(image_folder=folder, image_size=8, augment="none", shuffle_buffer=16)
  config.update(batch_size=4, total_steps=2, log_every_steps=1, eval_every_steps=2,
                checkpoint_every_steps=1, async_checkpointing=False)
  config.optim.warmup_steps = 0
  return data_utils.override(config, overrides)


@pytest.mark.slow
def test_a_linear_probe_run_logs_its_groups_and_keeps_the_trunk(tmp_path, monkeypatch, caplog):
  data_utils.skip_cpu_peak_measurement(monkeypatch)
  folder = data_utils.make_image_folder(str(tmp_path / "images"), num_classes=3, per_class=2,
                                        size=8)
  config = _tiny_folder_config(folder, **{"optim.freeze": ("(?!head/).*",),
                                          "optim.schedule": "constant"})
  workdir = str(tmp_path / "run")
  with caplog.at_level("INFO"):
    train.train_and_evaluate(config, workdir)
  assert ("Parameter groups of config.optim (layer_decay=None, freeze=('(?!head/).*',), "
          "wd_mults=()): 27 of 1,083 parameters trained.") in caplog.text
  assert re.search(r"Transformer/\*, cls, embedding/\* +- +22 +1,056 +- +- +yes +- +"
                   r"freeze\[0\]='\(\?!head/\)\.\*'", caplog.text)
  first, last = (checkpoint.load(os.path.join(workdir, "checkpoints", step))["params"]
                 for step in ("1", "2"))
  for name, value in checkpoint.flatten_params(first).items():
    moved = np.any(checkpoint.flatten_params(last)[name] != value)
    assert moved == name.startswith("head/"), name
