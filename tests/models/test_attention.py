"""The ViT attention layer (vit_jax.models.attention) and the training execution defaults."""

import contextlib
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import config as config_lib
from vit_jax import models
from vit_jax.kernels import cpu_attention
from vit_jax.models import attention
from vit_jax.models import execution

X = jax.random.normal(jax.random.key(0), (2, 5, 32))


def _ours_and_flax_params():
  ours = attention.MultiHeadDotProductAttention(num_heads=4)
  params = ours.init(jax.random.key(1), X, deterministic=True)
  return ours, models.unbox(params)


def test_same_parameters_and_outputs_as_flax_attention():
  ours, params = _ours_and_flax_params()
  shapes = jax.tree.map(jnp.shape, params["params"])
  assert shapes == {"query": {"kernel": (32, 4, 8), "bias": (4, 8)},
                    "key": {"kernel": (32, 4, 8), "bias": (4, 8)},
                    "value": {"kernel": (32, 4, 8), "bias": (4, 8)},
                    "out": {"kernel": (4, 8, 32), "bias": (32,)}}
  # Non-zero biases so that every term is compared.
  params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape),
                        params)
  reference = nn.MultiHeadDotProductAttention(num_heads=4, deterministic=True)
  expected = reference.apply(params, X, X)
  got = ours.apply(params, X, deterministic=True)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_initialisers_match_dense_general():
  _, params = _ours_and_flax_params()
  limit = np.sqrt(6 / (32 + 32))  # xavier_uniform over the (32, 4 * 8) projection.
  for name in ("query", "key", "value", "out"):
    kernel = np.abs(np.asarray(params["params"][name]["kernel"]))
    assert 0.9 * limit < kernel.max() <= limit
    np.testing.assert_array_equal(params["params"][name]["bias"], 0.0)


def test_cudnn_path_computes_the_same(monkeypatch):
  """attention='cudnn' (GPU) on this CPU: the same call with XLA's implementation of
  jax.nn.dot_product_attention, which checks its [B, N, heads, Dh] layout and scaling."""
  ours, params = _ours_and_flax_params()
  expected = ours.apply(params, X, deterministic=True)
  original = jax.nn.dot_product_attention
  calls = []

  def on_xla(*args, implementation=None, **kwargs):
    calls.append(implementation)
    return original(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", on_xla)
  cudnn = attention.MultiHeadDotProductAttention(num_heads=4, attention="cudnn")
  got = jax.jit(lambda p, x: cudnn.apply(p, x, deterministic=True))(params, X)
  assert calls == ["cudnn"]
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_qk_norm_is_flax_normalize_qk_with_timm_bias_on_every_path(monkeypatch):
  """qk_norm: flax's normalize_qk LayerNorms (``query_ln``, ``key_ln``, same names) plus timm's
  bias; 'cudnn' (XLA's implementation here) and the fused CPU kernel (where built) normalise
  the same q and k (head size 16, which the kernel needs)."""
  x = jax.random.normal(jax.random.key(0), (2, 5, 64))
  ours = attention.MultiHeadDotProductAttention(num_heads=4, qk_norm=True)
  params = models.unbox(ours.init(jax.random.key(1), x, deterministic=True))
  assert jax.tree.map(jnp.shape, params["params"]["query_ln"]) == {"scale": (16,), "bias": (16,)}
  keys = iter(jax.random.split(jax.random.key(2), 32))
  params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape), params)
  reference = nn.MultiHeadDotProductAttention(num_heads=4, normalize_qk=True, deterministic=True)
  without_bias = jax.tree.map(lambda p: p, params)
  for name in ("query_ln", "key_ln"):
    without_bias["params"][name] = {"scale": params["params"][name]["scale"]}
  zero_bias = jax.tree.map(lambda p: p, params)
  for name in ("query_ln", "key_ln"):
    zero_bias["params"][name] = dict(params["params"][name],
                                     bias=jnp.zeros((16,), jnp.float32))
  np.testing.assert_allclose(ours.apply(zero_bias, x, deterministic=True),
                             reference.apply(without_bias, x, x), rtol=1e-5, atol=1e-5)
  expected = ours.apply(params, x, deterministic=True)
  assert np.abs(expected - ours.apply(zero_bias, x, deterministic=True)).max() > 1e-3
  original = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, implementation=None, **k:
                      original(*a, implementation="xla", **k))
  paths = ["cudnn"] + (["cpu_kernel"] if cpu_attention.library()[0] is not None else [])
  for path in paths:
    other = attention.MultiHeadDotProductAttention(num_heads=4, qk_norm=True, attention=path)
    got = jax.jit(lambda p, v: other.apply(p, v, deterministic=True))(params, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=path)


needs_kernel = pytest.mark.skipif(cpu_attention.library()[0] is None,
                                  reason="the fused CPU attention kernel was not built")


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("name,fields", [
    ("ViT-custom", dict(hidden_size=32, mlp_dim=32, num_heads=2, num_layers=2, patch_size=4)),
    ("T2T-ViT-custom", dict(embed_dim=32, depth=2, num_heads=2, mlp_ratio=1.0, token_dim=8,
                            drop_path_rate=0.0)),
])
def test_both_families_give_the_same_logits_and_gradients_with_the_cpu_kernel(name, fields):
  """One dispatch for ViT and T2T-ViT: 'cpu_kernel' equals 'xla' (head size 16)."""
  images = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
  xla = models.create(name, num_classes=3, **fields)
  variables = models.unbox(jax.jit(lambda x: xla.init(jax.random.key(1), x, train=False))(images))
  kernel = models.create(name, num_classes=3, attention="cpu_kernel", **fields)

  def loss_and_grads(model):
    loss = lambda p: jnp.sum(model.apply(dict(variables, params=p), images, train=False) ** 2)
    return jax.jit(jax.value_and_grad(loss))(variables["params"])

  (loss_x, grads_x), (loss_k, grads_k) = loss_and_grads(xla), loss_and_grads(kernel)
  np.testing.assert_allclose(loss_k, loss_x, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads_k, grads_x)


def test_unknown_implementation_is_refused_by_both_families():
  for name in ("ViT-Ti_16", "T2T-ViT-7"):
    with pytest.raises(ValueError, match=r"attention must be one of \('xla', 'cudnn', "
                       r"'cpu_kernel'\), got 'auto'"):
      models.create(name, num_classes=3, attention="auto")


def test_attention_dropout_zeroes_weights_and_rescales():
  q = k = jnp.zeros((1, 2, 64, 2))  # Uniform weights 1/64 over 64 keys.
  v = jnp.ones((1, 2, 64, 2))
  np.testing.assert_allclose(attention.dot_product_attention(q, k, v), 1.0, rtol=1e-6)
  y = np.asarray(attention.dot_product_attention(q, k, v, dropout_rate=0.5,
                                                 dropout_rng=jax.random.key(0)))
  # Each output is (kept weights) * 2 / 64: a multiple of 1/32, 1 in expectation.
  kept = y[..., 0] * 32
  np.testing.assert_allclose(kept, np.round(kept), atol=1e-4)
  assert (kept != 32).any() and 0.8 < y.mean() < 1.2  # Dropped, rescaled, not broadcast:
  assert len(np.unique(np.round(kept))) > 10  # each query row keeps its own weights.
  np.testing.assert_array_equal(y[..., 0], y[..., 1])  # One weight per key, for every dim.


def test_width_not_divisible_by_heads():
  with pytest.raises(ValueError, match="not divisible by num_heads=5"):
    attention.MultiHeadDotProductAttention(num_heads=5).init(jax.random.key(0), X,
                                                             deterministic=True)


def test_remat_policy_is_validated():
  with pytest.raises(ValueError, match="remat_policy must be one of"):
    models.create("ViT-Ti_16", num_classes=10, remat=True, remat_policy="dots")


def _saved(policy, implementation="xla"):
  """What the backward pass of a 1-layer ViT keeps from its forward (jax's own listing)."""
  model = models.create("ViT-custom", num_classes=3, hidden_size=32, mlp_dim=128, num_heads=2,
                        num_layers=1, patch_size=4, remat=True, remat_policy=policy,
                        attention=implementation)
  images = jnp.zeros((2, 8, 8, 3))
  params = models.unbox(model.init(jax.random.key(0), images, train=False))["params"]
  listing = io.StringIO()
  with contextlib.redirect_stdout(listing):
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: model.apply({"params": p}, images, train=False).sum(), params)
  return [line.split(" from ")[0] for line in listing.getvalue().splitlines()
          if "vit_jax/models/attention.py" in line or "flax/linen/linear.py" in line]


def test_qkv_policy_keeps_only_the_query_key_and_value():
  """2 images of 4 patches + class token, D=32 in 2 heads of 16; the MLP's 128-wide first
  layer is what 'dots_and_attention_saveable' keeps besides, and 'qkv_saveable' recomputes."""
  qkv = [f"f32[2,2,5,16] named '{name}'" for name in ("query", "key", "value")]
  assert _saved("qkv_saveable") == qkv
  assert _saved("dots_and_attention_saveable") == [  # (XLA's own layout of the same q, k, v.)
      "f32[2,16,2,5] output of dot_general"] * 3 + [
      "f32[2,5,32] output of dot_general", "f32[2,5,128] output of dot_general"]
  assert _saved("nothing_saveable") == []


@pytest.mark.slow
@pytest.mark.parametrize("policy", execution.REMAT_POLICIES)
def test_every_remat_policy_gives_the_same_gradients(policy):
  fields = dict(hidden_size=16, mlp_dim=32, num_heads=2, num_layers=2, patch_size=4)
  images = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  plain = models.create("ViT-custom", num_classes=3, **fields)
  variables = models.unbox(plain.init(jax.random.key(1), images, train=False))
  remat = models.create("ViT-custom", num_classes=3, scan=True, remat=True,
                        remat_policy=policy, **fields)

  def grads(model, params):
    loss = lambda p: jnp.sum(model.apply({"params": p}, images, train=False) ** 2 +
                             model.apply({"params": p}, images, train=False))
    return jax.grad(loss)(params)

  expected = models.scan_params(grads(plain, variables["params"]), num_layers=2)
  got = grads(remat, models.scan_params(variables["params"], num_layers=2))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               got, expected)


def test_training_config_scans_and_rematerialises_unless_overridden():
  config = config_lib.get_config("ViT-Ti_16", "cifar10")
  assert (config.model.scan, config.model.remat, config.model.remat_policy) == (
      True, True, "auto")  # Resolved from the devices (vit_jax.dispatch).
  config = config_lib.get_config("ViT-Ti_16", "cifar10", scan=False, remat=False)
  assert not config.model.scan and not config.model.remat
  # The model itself defaults to the unrolled encoder with the official per-layer names.
  assert models.model_config("ViT-Ti_16")["scan"] is False
  # T2T-ViT trains with its backbone scanned and rematerialised the same way.
  config = config_lib.get_config("T2T-ViT-14", "cifar10")
  assert (config.model.scan, config.model.remat, config.model.remat_policy) == (
      True, True, "auto")
  assert models.model_config("T2T-ViT-14")["scan"] is False


@pytest.mark.parametrize("name", ["ViT-Ti_16", "T2T-ViT-7"])
def test_execution_fields_must_be_booleans_and_known_policies(name):
  # A string such as 'maybe' would read as True: both families refuse it by name.
  for field, value in (("scan", "maybe"), ("remat", 1)):
    with pytest.raises(ValueError, match=f"{field} must be True or False, got {value!r}"):
      models.create(name, num_classes=3, **{field: value})
  with pytest.raises(ValueError, match="remat_policy must be one of .*got 'dots'"):
    models.create(name, num_classes=3, remat_policy="dots")
  # The benchmark's --set goes through the same check: tests/benchmarks/test_benchmark.py.
  model = models.create(name, num_classes=3, scan=True, remat=True,
                        remat_policy="dots_saveable")
  assert (model.scan, model.remat, model.remat_policy) == (True, True, "dots_saveable")
