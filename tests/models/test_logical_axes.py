"""Logical axis names of the parameters and activations (sharding, model side).

Big models are checked with ``jax.eval_shape`` only; values with tiny models.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.models import layout

P = jax.sharding.PartitionSpec

#: The rules of the mesh side (vit_jax.sharding), repeated here so that these tests stand alone.
RULES = (
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('qkv', 'tensor'),
    ('conv_out', 'tensor'),
)

BIG = {
    'ViT-B_16': ('ViT-B_16', {}),
    'ViT-B_16-scan': ('ViT-B_16', {'scan': True, 'remat': True}),
    'R50+ViT-B_16': ('R50+ViT-B_16', {}),
    'T2T-ViT-14': ('T2T-ViT-14', {}),
    'T2T-ViT_t-14': ('T2T-ViT_t-14', {}),
}

#: Tiny models: (name, overrides, image side).
TINY = {
    'vit': ('ViT-custom', dict(hidden_size=16, mlp_dim=24, num_heads=2, num_layers=2,
                               patch_size=8, representation_size=12, head_bias_init=-1.0), 16),
    'vit_scan': ('ViT-custom', dict(hidden_size=16, mlp_dim=24, num_heads=2, num_layers=2,
                                    patch_size=8, classifier='gap', scan=True), 16),
    'hybrid': ('R+ViT-custom', dict(hidden_size=16, mlp_dim=24, num_heads=2, num_layers=1,
                                    patch_size=1, resnet_num_layers=(1, 1),
                                    resnet_width_factor=0.5), 32),
    't2t_performer': ('T2T-ViT-custom', dict(embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0,
                                             token_dim=4), 32),
    't2t_transformer': ('T2T-ViT-custom', dict(embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0,
                                               token_dim=4, tokens_type='transformer'), 32),
}

#: Fresh initialisation (jitted, jax.random.key(0), all collections) of the TINY models, measured
#: with the code before the logical annotations (plain arrays): (number of arrays, number of
#: values, sum of |v|, sum of v * cos(i) over the arrays concatenated in sorted-path order).
INIT_CHECKSUMS = {
    'vit': (42, 7379, 1034.7688398643863, -6.015940734984666),
    'vit_scan': (23, 7155, 1001.6383520708733, 6.574671482689345),
    'hybrid': (51, 125771, 9251.336327631776, 18.31093093799475),
    't2t_performer': (45, 5685, 364.4866018947764, 8.09491173038898),
    't2t_transformer': (41, 5645, 353.87372404175994, -6.4953825164682675),
}


def _is_spec(x):
  return isinstance(x, P)


@functools.lru_cache(maxsize=None)
def _big(key):
  name, overrides = BIG[key]
  model = models.create(name, num_classes=1000, **overrides)
  abstract = models.abstract_variables(model, (224, 224))
  return model, abstract, nn.get_partition_spec(abstract)


def _flat_specs(specs):
  return checkpoint.flatten_params(specs)


def _tiny(key):
  name, overrides, size = TINY[key]
  return models.create(name, num_classes=3, **overrides), size


def _mesh():
  devices = np.asarray(jax.devices()[:1]).reshape(1, 1, 1)
  return jax.sharding.Mesh(devices, ('data', 'fsdp', 'tensor'))


# ------------------------------------------------------------------------------------------------
# Every parameter of the big models has a full logical PartitionSpec (eval_shape only).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('key', list(BIG))
def test_every_parameter_has_a_logical_spec(key):
  model, abstract, specs = _big(key)
  shapes = checkpoint.flatten_params(abstract)  # Unboxed ShapeDtypeStructs.
  flat = _flat_specs(specs)
  assert set(flat) == set(shapes)
  boxed = jax.tree.leaves(abstract['params'], is_leaf=lambda x: isinstance(x, nn.Partitioned))
  # Standard boxes only (no private subclass left from the DenseGeneral initialisers).
  assert boxed and all(type(x) is nn.LogicallyPartitioned for x in boxed)  # pylint: disable=C0123
  allowed = set(models.LOGICAL_AXIS_NAMES) | {None}
  for path, spec in flat.items():
    assert isinstance(spec, P), path
    if path.startswith('constants/'):
      assert spec == P(), path  # The fixed T2T tables: replicated.
      continue
    assert path.startswith('params/'), path
    assert len(spec) == len(shapes[path].shape), (path, spec, shapes[path].shape)
    assert set(spec) <= allowed, (path, spec)
    named = [n for n in spec if n is not None]
    assert len(named) == len(set(named)), (path, spec)  # A name at most once per array.
    if getattr(model, 'scan', False) and '/encoderblock/' in path:
      assert spec[0] == 'layers', (path, spec)
    else:
      assert 'layers' not in spec, (path, spec)
  # Logical specs map onto a mesh with the rules (what the training side does).
  mesh_specs = nn.logical_to_mesh(specs, RULES)
  assert all(isinstance(s, P) for s in jax.tree.leaves(mesh_specs, is_leaf=_is_spec))


def test_vit_b16_names_and_parameter_count():
  _, abstract, specs = _big('ViT-B_16')
  flat = _flat_specs(specs)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(models.unbox(abstract))) == 86_567_656
  block = 'params/Transformer/encoderblock_3/'
  attn = block + 'MultiHeadDotProductAttention_0/'
  expected = {
      'params/embedding/kernel': P(None, None, None, 'embed'),
      'params/embedding/bias': P('embed'),
      'params/cls': P(None, None, 'embed'),
      'params/Transformer/posembed_input/pos_embedding': P(None, 'length', 'embed'),
      block + 'LayerNorm_0/scale': P('norm'),
      block + 'LayerNorm_1/bias': P('norm'),
      attn + 'query/kernel': P('embed', 'heads', 'kv'),
      attn + 'key/kernel': P('embed', 'heads', 'kv'),
      attn + 'value/kernel': P('embed', 'heads', 'kv'),
      attn + 'value/bias': P('heads', 'kv'),
      attn + 'out/kernel': P('heads', 'kv', 'embed'),
      attn + 'out/bias': P('embed'),
      block + 'MlpBlock_0/Dense_0/kernel': P('embed', 'mlp'),
      block + 'MlpBlock_0/Dense_0/bias': P('mlp'),
      block + 'MlpBlock_0/Dense_1/kernel': P('mlp', 'embed'),
      block + 'MlpBlock_0/Dense_1/bias': P('embed'),
      'params/Transformer/encoder_norm/scale': P('norm'),
      'params/head/kernel': P('embed', 'classes'),
      'params/head/bias': P('classes'),
  }
  for path, spec in expected.items():
    assert flat[path] == spec, path


def test_pre_logits_names():
  model = models.create('ViT-Ti_16', num_classes=10, representation_size=32, num_layers=1)
  flat = _flat_specs(models.logical_axes(model, (32, 32)))
  assert flat['params/pre_logits/kernel'] == P('embed', None)
  assert flat['params/pre_logits/bias'] == P(None)


def test_map_head_names_and_no_position_parameter_with_sincos2d():
  model = models.create('ViT-custom', num_classes=3, classifier='map', posemb='sincos2d',
                        hidden_size=16, mlp_dim=24, num_heads=2, num_layers=1, patch_size=8)
  flat = _flat_specs(models.logical_axes(model, (16, 16)))
  head, attn = 'params/MAPHead_0/', 'params/MAPHead_0/MultiHeadDotProductAttention_0/'
  assert {k: v for k, v in flat.items() if k.startswith(head)} == {
      head + 'probe': P(None, None, 'embed'),
      attn + 'query/kernel': P('embed', 'heads', 'kv'), attn + 'query/bias': P('heads', 'kv'),
      attn + 'key/kernel': P('embed', 'heads', 'kv'), attn + 'key/bias': P('heads', 'kv'),
      attn + 'value/kernel': P('embed', 'heads', 'kv'), attn + 'value/bias': P('heads', 'kv'),
      attn + 'out/kernel': P('heads', 'kv', 'embed'), attn + 'out/bias': P('embed'),
      head + 'LayerNorm_0/scale': P('norm'), head + 'LayerNorm_0/bias': P('norm'),
      head + 'MlpBlock_0/Dense_0/kernel': P('embed', 'mlp'),
      head + 'MlpBlock_0/Dense_0/bias': P('mlp'),
      head + 'MlpBlock_0/Dense_1/kernel': P('mlp', 'embed'),
      head + 'MlpBlock_0/Dense_1/bias': P('embed')}
  assert not any('posembed_input' in k or k == 'params/cls' for k in flat)


def test_scanned_names_start_with_layers():
  _, abstract, specs = _big('ViT-B_16-scan')
  flat = _flat_specs(specs)
  attn = 'params/Transformer/encoderblock/MultiHeadDotProductAttention_0/'
  assert flat[attn + 'query/kernel'] == P('layers', 'embed', 'heads', 'kv')
  assert flat[attn + 'out/kernel'] == P('layers', 'heads', 'kv', 'embed')
  assert flat['params/Transformer/encoderblock/MlpBlock_0/Dense_0/kernel'] == P(
      'layers', 'embed', 'mlp')
  assert flat['params/Transformer/encoderblock/LayerNorm_0/scale'] == P('layers', 'norm')
  assert flat['params/Transformer/encoder_norm/scale'] == P('norm')
  shapes = checkpoint.flatten_params(abstract)
  assert shapes[attn + 'query/kernel'].shape == (12, 768, 12, 64)


def test_resnet_stem_names():
  _, _, specs = _big('R50+ViT-B_16')
  flat = _flat_specs(specs)
  assert flat['params/conv_root/kernel'] == P(None, None, 'conv_in', 'conv_out')
  assert flat['params/gn_root/scale'] == P('norm')
  assert flat['params/block3/unit9/conv2/kernel'] == P(None, None, 'conv_in', 'conv_out')
  assert flat['params/block1/unit1/gn_proj/bias'] == P('norm')
  assert flat['params/embedding/kernel'] == P(None, None, None, 'embed')


@pytest.mark.parametrize('key', ['T2T-ViT-14', 'T2T-ViT_t-14'])
def test_t2t_names(key):
  _, _, specs = _big(key)
  flat = _flat_specs(specs)
  expected = {
      'params/cls_token': P(None, None, 'embed'),
      'params/tokens_to_token/project/kernel': P(None, 'embed'),
      'params/tokens_to_token/project/bias': P('embed'),
      'params/blocks_5/norm1/scale': P('norm'),
      'params/blocks_5/attn/qkv/kernel': P('embed', 'qkv'),
      'params/blocks_5/attn/proj/kernel': P('qkv', 'embed'),
      'params/blocks_5/attn/proj/bias': P('embed'),
      'params/blocks_5/mlp/fc1/kernel': P('embed', 'mlp'),
      'params/blocks_5/mlp/fc1/bias': P('mlp'),
      'params/blocks_5/mlp/fc2/kernel': P('mlp', 'embed'),
      'params/blocks_5/mlp/fc2/bias': P('embed'),
      'params/norm/bias': P('norm'),
      'params/head/kernel': P('embed', 'classes'),
      'params/head/bias': P('classes'),
      'constants/pos_embed': P(),
  }
  t2t = 'params/tokens_to_token/attention2/'
  if key == 'T2T-ViT-14':  # Performer.
    expected.update({
        t2t + 'kqv/kernel': P(None, 'qkv'), t2t + 'kqv/bias': P('qkv'),
        t2t + 'proj/kernel': P(None, 'tokens'), t2t + 'mlp_0/kernel': P(None, 'tokens'),
        t2t + 'mlp_2/bias': P('tokens'), t2t + 'norm1/scale': P('norm'),
        'constants/tokens_to_token/attention1/w': P(),
    })
  else:
    expected.update({
        t2t + 'attn/qkv/kernel': P(None, 'qkv'), t2t + 'attn/proj/kernel': P(None, 'tokens'),
        t2t + 'mlp/fc1/kernel': P(None, 'tokens'), t2t + 'mlp/fc2/bias': P('tokens'),
        t2t + 'norm2/bias': P('norm'),
    })
  for path, spec in expected.items():
    assert flat[path] == spec, path


# ------------------------------------------------------------------------------------------------
# Values: unchanged by the annotations; apply takes boxed and plain variables alike.
# ------------------------------------------------------------------------------------------------


def _init(model, size):
  return jax.jit(lambda k: model.init(k, jnp.zeros((1, size, size, 3)), train=False))(
      jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _tiny_init(key):
  """``_tiny(key)`` and its boxed variables (``_init``, without a mesh), initialised once for
  the tests that read them (~1 s of compiling each)."""
  model, size = _tiny(key)
  return model, size, _init(model, size)


@pytest.mark.parametrize('key', list(TINY))
def test_init_values_are_those_of_the_plain_model(key):
  _, _, boxed = _tiny_init(key)
  assert any(isinstance(x, nn.LogicallyPartitioned) for x in jax.tree.leaves(
      boxed['params'], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)))
  plain = models.unbox(boxed)
  assert not any(isinstance(x, nn.LogicallyPartitioned) for x in jax.tree.leaves(
      plain, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)))
  flat = checkpoint.flatten_params(plain)
  vec = np.concatenate([np.ravel(np.asarray(flat[k], np.float64)) for k in sorted(flat)])
  count, size_, abs_sum, weighted = INIT_CHECKSUMS[key]
  assert (len(flat), vec.size) == (count, size_)
  np.testing.assert_allclose(np.abs(vec).sum(), abs_sum, rtol=1e-6)
  np.testing.assert_allclose((vec * np.cos(np.arange(vec.size))).sum(), weighted, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize('key', list(TINY))
def test_apply_boxed_and_plain_variables_alike(key):
  model, size, boxed = _tiny_init(key)
  plain = models.unbox(boxed)
  images = jax.random.uniform(jax.random.key(1), (2, size, size, 3), minval=-1, maxval=1)
  with_grads = key in ('vit_scan', 't2t_performer')
  loss = lambda p, v, x: model.apply({**v, 'params': p}, x, train=False).sum()

  @jax.jit
  def apply(v, x):  # And the gradients, in the same program (one compile per kind of tree).
    outputs = model.apply(v, x, train=False, capture_intermediates=True)
    return outputs, (jax.grad(loss)(v['params'], v, x) if with_grads else None)

  ((logits_boxed, state_boxed), grads_boxed), ((logits_plain, state_plain), grads_plain) = (
      apply(boxed, images), apply(plain, images))
  np.testing.assert_array_equal(logits_boxed, logits_plain)
  for a, b in zip(jax.tree.leaves(state_boxed), jax.tree.leaves(state_plain)):
    np.testing.assert_array_equal(a, b)
  if not with_grads:
    return
  # Gradients w.r.t. boxed parameters come back boxed, with the same values.
  for a, b in zip(jax.tree.leaves(models.unbox(grads_boxed)), jax.tree.leaves(grads_plain)):
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------------
# Activation constraints: no-ops without rules; real constraints under a mesh and rules.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('key', ['vit_scan', 'hybrid', 't2t_performer'])
def test_activation_constraints(key):
  model, size, boxed = _tiny_init(key)
  variables = models.unbox(boxed)
  images = jnp.zeros((2, size, size, 3))
  trace = lambda: str(jax.make_jaxpr(lambda v, x: model.apply(v, x, train=False))(
      variables, images))
  assert 'sharding_constraint' not in trace()  # No rules, no mesh.
  with nn.logical_axis_rules(RULES):
    assert 'sharding_constraint' not in trace()  # Rules without a mesh.
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    assert 'sharding_constraint' in trace()


@pytest.mark.slow
@pytest.mark.parametrize('key', ['vit', 'vit_scan', 'hybrid', 't2t_performer'])
def test_init_and_apply_under_a_mesh(key):
  """Also the attention kernels, which nn.DenseGeneral initialises flat (flax issue #3676)."""
  model, size, reference = _tiny_init(key)
  images = jax.random.uniform(jax.random.key(1), (2, size, size, 3), minval=-1, maxval=1)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    boxed = _init(model, size)
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(boxed, images)
  assert jax.tree.structure(boxed) == jax.tree.structure(reference)
  leaves = jax.tree.leaves(boxed['params'], is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert all(type(x) is nn.LogicallyPartitioned for x in leaves)  # pylint: disable=C0123
  for a, b in zip(jax.tree.leaves(boxed), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(a, b)
  expected = jax.jit(lambda v, x: model.apply(v, x, train=False))(reference, images)
  np.testing.assert_array_equal(logits, expected)


# ------------------------------------------------------------------------------------------------
# Helpers and the code that reads model.init output.
# ------------------------------------------------------------------------------------------------


def test_unbox_keeps_structure_and_order():
  _, _, boxed = _tiny_init('vit')
  plain = models.unbox(boxed)
  assert list(plain['params']) == list(boxed['params'])  # Key order kept.
  assert jax.tree.structure(plain) == jax.tree.structure(jax.tree.map(lambda x: x, plain))
  assert models.unbox(plain) is plain  # Nothing to strip: returned as it is.
  assert models.unbox is layout.unbox
  box = boxed['params']['head']['kernel']
  assert models.unbox(box) is box.value
  flat_boxed, flat_plain = checkpoint.flatten_params(boxed), checkpoint.flatten_params(plain)
  assert list(flat_boxed) == list(flat_plain)
  assert all(flat_boxed[k] is flat_plain[k] for k in flat_plain)


def test_checkpoint_helpers_accept_boxed_trees(tmp_path):
  model, size, boxed = _tiny_init('vit')
  plain = jax.device_get(models.unbox(boxed))
  checkpoint.check_fits(plain, boxed)
  checkpoint.check_fits(plain, models.abstract_variables(model, (size, size)))
  out = checkpoint.init_for_finetuning(plain, jax.device_get(boxed))
  assert jax.tree.structure(out) == jax.tree.structure(plain)
  path = tmp_path / 'p.npz'
  checkpoint.save_npz(path, boxed)
  loaded = checkpoint.load(path)
  for a, b in zip(jax.tree.leaves(loaded['params']), jax.tree.leaves(plain['params'])):
    np.testing.assert_array_equal(a, b)
  # Layout conversion of a boxed tree gives plain arrays.
  scanned, expected = layout.scan_params(boxed['params']), layout.scan_params(plain['params'])
  assert jax.tree.structure(scanned) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)


def test_logical_axes_image_shape():
  model = models.create('T2T-ViT-custom', num_classes=3, embed_dim=16, depth=1, num_heads=2,
                        mlp_ratio=2.0, token_dim=4)
  with_channels = models.logical_axes(model, (32, 32, 3))
  assert jax.tree.leaves(with_channels, is_leaf=_is_spec) == jax.tree.leaves(
      models.logical_axes(model, (32, 32)), is_leaf=_is_spec)
  assert models.abstract_variables(model, (32, 48))['constants']['pos_embed'].shape == (
      1, 2 * 3 + 1, 16)
  with pytest.raises(ValueError, match='image_shape'):
    models.logical_axes(model, (32,))
