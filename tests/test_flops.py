"""Analytic FLOP counts against the quoted figures and XLA's cost analysis; the Table 2 MFUs."""

import jax
import jax.numpy as jnp
import optax
import pytest

from vit_jax import flops
from vit_jax import models
from vit_jax.kernels import cpu_attention

B16 = dict(hidden_size=768, mlp_dim=3072, num_layers=12, patch_size=16)


def test_vit_b16_forward_is_17_6_g_multiply_adds():
  macs = flops.vit_forward_macs(**B16, image_size=224)
  # 196 patches + class token: embedding 115.6M, 12 x 1.454G per layer, head 0.77M.
  assert macs == 196 * 768 * 768 + 12 * (4 * 197 * 768**2 + 2 * 197**2 * 768
                                         + 2 * 197 * 768 * 3072) + 768 * 1000
  assert 17.5e9 < macs < 17.6e9
  assert flops.vit_forward_macs(**B16, image_size=(224, 320)) > macs  # 14 x 20 patches.
  with pytest.raises(ValueError, match="not divisible by the patch size 16"):
    flops.vit_forward_macs(**B16, image_size=200)


def test_map_head_is_counted_and_the_position_table_is_not():
  tiny = dict(hidden_size=16, mlp_dim=24, num_layers=1, patch_size=8, image_size=16,
              num_classes=3)
  gap = flops.vit_forward_macs(**tiny, classifier="gap")
  mapped = flops.vit_forward_macs(**tiny, classifier="map")
  d, n, m = 16, 4, 24  # The probe's q and out, k and v of the 4 tokens, 2 products, the MLP.
  assert mapped - gap == 2 * d * d + 2 * n * d * d + 2 * n * d + 2 * d * m == 3456
  fields = {k: v for k, v in tiny.items() if k not in ("image_size", "num_classes")}
  for posemb in ("learn", "sincos2d"):
    model = models.create("ViT-custom", num_classes=3, num_heads=2, classifier="map",
                          posemb=posemb, gelu_approximate=False, **fields)
    assert flops.model_forward_macs(model, (16, 16, 3)) == mapped
  with pytest.raises(ValueError, match="classifier must be 'token', 'gap' or 'map', got 'cls'"):
    flops.vit_forward_macs(**tiny, classifier="cls")


def test_compiled_cost_analysis_agrees_with_the_analytic_count():
  """XLA counts the matrix products plus the elementwise work: within 3% above."""
  model = models.create("ViT-B_16", num_classes=1000)  # XLA's attention (the default).
  variables = models.unbox(jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)))
  compiled = jax.jit(lambda v, x: model.apply(v, x, train=False)).lower(
      variables, jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  analytic = 2 * flops.vit_forward_macs(**B16, image_size=224)
  assert 1.0 <= cost["flops"] / analytic < 1.03


def test_the_tpu_compilers_unpriced_concatenations_are_added_back():
  """libtpu counts -1 s for each ConcatBitcast (free); any other figure below zero is none."""

  class Compiled:
    def __init__(self, seconds, text):
      self.seconds, self.text = seconds, text

    def cost_analysis(self):
      return {"flops": 8.0, "bytes accessed": 0.0, "optimal_seconds": self.seconds}

    def as_text(self):
      return self.text

  concat = '%c = f32[2,8]{1,0} custom-call(%a, %b), custom_call_target="ConcatBitcast"\n'
  assert flops.compiled_cost(Compiled(-2 + 3e-4, 2 * concat)) == {
      "flops": 8.0, "optimal_seconds": pytest.approx(3e-4)}
  assert flops.compiled_cost(Compiled(-1 + 3e-4, "")) == {"flops": 8.0}
  assert flops.compiled_cost(Compiled(5e-4, concat)) == {"flops": 8.0, "optimal_seconds": 5e-4}
  assert flops.compiled_flops(Compiled(5e-4, "")) == 8.0


@pytest.mark.parametrize("classifier", ["token", "gap", "map"])
def test_registers_are_tokens_and_the_map_head_pools_the_patches(classifier):
  """4 registers join every block's tokens (T = N + 4, + 1 with the class token); the MAP head
  attends to the N patches only (the model's MAPHead_0 input); LayerScale and fc_norm are
  elementwise: the traced model's count is the formula's, exactly."""
  tiny = dict(hidden_size=16, mlp_dim=24, num_layers=2, patch_size=8)
  d, m, n = 16, 24, 4
  t = n + 4 + (classifier == "token")
  macs = flops.vit_forward_macs(**tiny, image_size=16, num_classes=3, classifier=classifier,
                                num_registers=4)
  pooling = 2 * d * d + 2 * n * d * d + 2 * n * d + 2 * d * m if classifier == "map" else 0
  assert macs == (n * 8 * 8 * 3 * d + 2 * (4 * t * d * d + 2 * t * t * d + 2 * t * d * m)
                  + pooling + d * 3)
  model = models.create("ViT-custom", num_classes=3, num_heads=2, classifier=classifier,
                        num_registers=4, layerscale_init=1e-5, no_embed_class=True,
                        fc_norm=classifier == "gap", **tiny)
  assert flops.model_forward_macs(model, (16, 16, 3)) == macs
  with pytest.raises(ValueError, match="num_registers must be 0 or more"):
    flops.vit_forward_macs(**tiny, image_size=16, num_registers=-1)


def test_compiled_cost_analysis_agrees_with_registers_and_map():
  """XLA's count of a ViT-S/16 with 4 registers and the MAP head: within 3% above the formula."""
  model = models.create("ViT-S_16", num_classes=1000, num_registers=4, classifier="map")
  variables = models.unbox(models.abstract_variables(model, (224, 224)))
  compiled = jax.jit(lambda v, x: model.apply(v, x, train=False)).lower(
      variables, jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  analytic = 2 * flops.vit_forward_macs(hidden_size=384, mlp_dim=1536, num_layers=12,
                                        patch_size=16, image_size=224, classifier="map",
                                        num_registers=4)
  assert 1.0 <= cost["flops"] / analytic < 1.03, cost["flops"] / analytic


@pytest.mark.slow
def test_compiled_training_step_agrees_with_three_forward_passes():
  """A ViT-B/16 AdamW step (forward, backward, update) by XLA: within 3% of 3 x the forward."""
  model = models.create("ViT-B_16", num_classes=1000)  # XLA's attention (the default).
  images = jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)
  labels = jax.ShapeDtypeStruct((2, 1000), jnp.float32)
  params = models.unbox(jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)))["params"]
  tx = optax.adamw(1e-3)

  def step(params, opt_state, x, y):
    def loss(p):
      logits = model.apply({"params": p}, x, train=True, rngs={"dropout": jax.random.key(0)})
      return optax.softmax_cross_entropy(logits, y).mean()
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  compiled = jax.jit(step).lower(params, jax.eval_shape(tx.init, params), images,
                                 labels).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  analytic = flops.training_flops(flops.model_forward_macs(model, (224, 224, 3)), 2)
  assert 1.0 <= cost["flops"] / analytic < 1.03


def test_table2_implied_utilisation():
  """ViT paper Table 2 core-days imply 38%, 22% and 32% of the TPU v3 bf16 peak."""
  mfus = {(run.model, run.dataset): run.mfu for run in flops.TABLE2}
  assert mfus[("ViT-L/16", "ImageNet-21k")] == pytest.approx(0.38, abs=0.005)
  assert mfus[("ViT-L/16", "JFT-300M")] == pytest.approx(0.22, abs=0.005)
  assert mfus[("ViT-H/14", "JFT-300M")] == pytest.approx(0.32, abs=0.005)
  run = flops.TABLE2[0]  # 90 epochs of 14M images at 123 GFLOPs per forward pass.
  assert run.flops == pytest.approx(3 * 2 * run.forward_macs * 90 * 14e6)
  assert flops.core_days(run.flops, run.mfu) == pytest.approx(230)
  assert "| ViT-H/14 | JFT-300M | 14 | 334.6 |" in flops.table2_markdown()


def test_the_count_is_the_same_whichever_attention_runs():
  """The fused CPU kernel's products (inside an ffi_call) are counted like XLA's dot_generals."""
  model = models.create("ViT-Ti_16", num_classes=10)
  xla = flops.model_forward_macs(model, (64, 64, 3))
  if cpu_attention.library()[0] is not None:
    kernel = models.create("ViT-Ti_16", num_classes=10, attention="cpu_kernel")
    assert flops.model_forward_macs(kernel, (64, 64, 3)) == xla
  assert xla == flops.vit_forward_macs(
      hidden_size=192, mlp_dim=768, num_layers=12, patch_size=16, image_size=64, num_classes=10)
  qkv = jax.ShapeDtypeStruct((2, 17, 3, 3, 64), jnp.float32)
  forward = jax.make_jaxpr(lambda a: cpu_attention.attention(a, logits_scale=1.0))(qkv)
  if cpu_attention.library()[0] is not None:  # 2 products of 17 x 17 x 64 per image and head.
    assert flops.jaxpr_macs(forward.jaxpr) == 2 * 2 * 3 * 17 * 17 * 64
