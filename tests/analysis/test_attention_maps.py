"""vit_jax.analysis.attention_maps against known answers: the mean attention distance of uniform,
identity and 'opposite patch' heads computed by brute force over patch centres; the rollout of
identity, uniform and random attention; the class token maps; bad input."""

import itertools
import math

import numpy as np
import pytest

from vit_jax import analysis


def _uniform(batch, heads, tokens):
  return np.full((batch, heads, tokens, tokens), 1.0 / tokens, np.float32)


def _brute_force_uniform(g, ph, pw):
  """Mean over query patches of the mean distance (pixels) to all g*g key patches' centres."""
  cells = list(itertools.product(range(g), range(g)))
  total = 0.0
  for qr, qc in cells:
    total += sum(math.hypot((qr - kr) * ph, (qc - kc) * pw) for kr, kc in cells) / len(cells)
  return total / len(cells)


@pytest.mark.parametrize("g", [3, 4])
@pytest.mark.parametrize("prefix", [0, 1])
def test_uniform_attention_gives_the_brute_force_mean_distance(g, prefix):
  # Uniform over all N tokens: with the class token dropped and the keys renormalised over the
  # patches it is uniform over the patches.
  attention = _uniform(2, 3, prefix + g * g)
  got = analysis.mean_attention_distance(attention, (g, g), 16, prefix)
  assert got.shape == (3,)
  np.testing.assert_allclose(got, _brute_force_uniform(g, 16, 16), rtol=1e-12)
  rect = analysis.mean_attention_distance(attention, g, (8, 12), prefix)  # Non-square patches.
  np.testing.assert_allclose(rect, _brute_force_uniform(g, 8, 12), rtol=1e-12)


def test_two_by_two_closed_form():
  # Every query sees distances 0, P, P, P*sqrt(2): mean P (2 + sqrt 2) / 4.
  got = analysis.mean_attention_distance(_uniform(1, 1, 5), 2, 16, 1)
  assert got[0] == pytest.approx(4 * (2 + math.sqrt(2)), rel=1e-12)


def test_heads_are_measured_separately():
  g, patch = 4, 8
  n = g * g
  attention = np.zeros((1, 3, n + 1, n + 1), np.float32)
  attention[0, 0] = 1.0 / (n + 1)  # Uniform.
  attention[0, 1, 1:, 1:] = np.eye(n)  # Each patch on itself: distance 0.
  attention[0, 1, 0, 0] = 1.0
  for r, c in itertools.product(range(g), range(g)):  # The point-mirrored patch.
    attention[0, 2, 1 + r * g + c, 1 + (g - 1 - r) * g + (g - 1 - c)] = 0.5
    attention[0, 2, 1 + r * g + c, 0] = 0.5  # Half on the class token: renormalised away.
  attention[0, 2, 0, 0] = 1.0
  mirrored = np.mean([math.hypot((g - 1 - 2 * r) * patch, (g - 1 - 2 * c) * patch)
                      for r, c in itertools.product(range(g), range(g))])
  got = analysis.mean_attention_distance(attention, g, patch, 1)
  np.testing.assert_allclose(got, [_brute_force_uniform(g, patch, patch), 0.0, mirrored],
                             rtol=1e-12, atol=1e-12)


def test_per_image_and_per_layer():
  g = 3
  local = np.zeros((1, 2, 9, 9), np.float32)
  local[:, :] = np.eye(9)
  attention = np.concatenate([_uniform(1, 2, 9), local])
  per_image = analysis.mean_attention_distance(attention, g, 16, 0, per_image=True)
  uniform = _brute_force_uniform(g, 16, 16)
  np.testing.assert_allclose(per_image, [[uniform, uniform], [0.0, 0.0]], atol=1e-12)
  np.testing.assert_allclose(analysis.mean_attention_distance(attention, g, 16, 0),
                             [uniform / 2, uniform / 2])
  layers = analysis.mean_attention_distances([attention, attention[::-1]], g, 16, 0)
  assert layers.shape == (2, 2)
  np.testing.assert_allclose(layers, uniform / 2)


def test_patch_distances():
  d = analysis.patch_distances((2, 3), (10, 20))
  assert d.shape == (6, 6)
  assert d[0, 5] == pytest.approx(math.hypot(10, 40))  # (0, 0) to (1, 2).
  np.testing.assert_allclose(d, d.T)


def test_identity_attention_rolls_out_to_the_identity():
  n = 10
  attention = np.broadcast_to(np.eye(n, dtype=np.float32), (2, 3, n, n))
  for residual in (True, False):
    got = analysis.rollout([attention] * 4, residual=residual)
    assert got.shape == (2, n, n) and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.broadcast_to(np.eye(n), (2, n, n)))
    assert (got.argmax(axis=-1) == np.arange(n)).all()  # Each token on itself.


def test_uniform_attention_rollout_is_analytic():
  # (0.5 U + 0.5 I)^L = 0.5^L I + (1 - 0.5^L) U, U the uniform (idempotent) matrix.
  n, layers = 5, 3
  stacked = np.stack([_uniform(1, 2, n)] * layers)  # [L, B, H, N, N] also accepted.
  expected = 0.5 ** layers * np.eye(n) + (1 - 0.5 ** layers) / n
  np.testing.assert_allclose(analysis.rollout(stacked)[0], expected, rtol=1e-6)
  np.testing.assert_allclose(analysis.rollout(stacked, residual=False)[0], 1.0 / n, rtol=1e-6)


def test_rollout_multiplies_bottom_to_top_and_fuses_heads():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 1, 2, 6, 6))
  first, second = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  got = analysis.rollout([first, second], residual=False)
  a1, a2 = first.mean(1), second.mean(1)
  np.testing.assert_allclose(got[0], a2[0] @ a1[0], rtol=1e-5)
  np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
  fused = np.maximum(first[:, 0], first[:, 1])[0]
  fused = 0.5 * fused + 0.5 * np.eye(6)
  np.testing.assert_allclose(analysis.rollout([first], head_fusion="max")[0],
                             fused / fused.sum(-1, keepdims=True), rtol=1e-5)


def test_class_token_map():
  g, n = (2, 3), 7
  matrix = np.zeros((1, n, n), np.float32)
  matrix[0, 0] = [5, 1, 2, 3, 4, 6, 8]  # Class token row: column 0 (itself) dropped.
  got = analysis.class_token_map(matrix, g)
  np.testing.assert_allclose(got[0], [[1 / 8, 2 / 8, 3 / 8], [4 / 8, 6 / 8, 1.0]])
  rows = np.arange(36, dtype=np.float32).reshape(1, 6, 6)  # No class token: mean of the rows.
  mean_row = rows[0].mean(0)
  np.testing.assert_allclose(analysis.class_token_map(rows, g, num_prefix_tokens=0)[0],
                             (mean_row / mean_row.max()).reshape(2, 3), rtol=1e-6)


def test_registers_are_never_the_map():
  """Prefix = [class token,] registers: the class token's row when there is one (prefix =
  registers + 1), else the mean of the patch rows, the register rows and columns left out."""
  g, registers = (1, 2), 2
  matrix = np.zeros((1, 5, 5), np.float32)
  matrix[0, 0] = [9, 9, 9, 1, 2]  # Register 0 (no class token) or the class token.
  matrix[0, 2] = [9, 9, 9, 4, 8]  # Register 1 / register 0.
  matrix[0, 3:] = [[9, 9, 9, 3, 1], [9, 9, 11, 1, 1]]  # The two patch rows: mean [2, 1].
  cls_map = analysis.class_token_map(matrix, g, num_prefix_tokens=3, num_registers=registers)
  np.testing.assert_allclose(cls_map[0], [[0.5, 1.0]])
  no_cls = np.delete(np.delete(matrix, 1, axis=1), 1, axis=2)  # Two registers, no class token.
  np.testing.assert_allclose(analysis.class_token_map(no_cls, g, num_prefix_tokens=2,
                                                      num_registers=registers)[0], [[1.0, 0.5]])
  attention = no_cls[:, None] / no_cls.sum(-1, keepdims=True)[:, None]
  np.testing.assert_allclose(analysis.layer_class_token_maps(
      [attention], g, num_prefix_tokens=2, num_registers=registers)[0, 0], [[1.0, 0.5]],
      rtol=1e-6)
  with pytest.raises(ValueError, match=r"num_prefix_tokens=1 with num_registers=2: the prefix is "
                     r"the class token \(if any\) and the registers, so num_prefix_tokens must "
                     r"be 2 or 3"):
    analysis.class_token_map(np.eye(3)[None], g, num_prefix_tokens=1, num_registers=2)


def test_layer_class_token_maps():
  attention = np.zeros((1, 2, 5, 5), np.float32)
  attention[0, 0, 0] = [0, 1, 0, 0, 0]
  attention[0, 1, 0] = [0, 0, 0, 0, 1]
  maps = analysis.layer_class_token_maps([attention, attention], 2)
  assert maps.shape == (2, 1, 2, 2)
  np.testing.assert_allclose(maps[1, 0], [[1, 0], [0, 1]])


def test_upsample_keeps_values_and_size():
  maps = np.array([[[0.0, 1.0], [1.0, 0.0]]])
  big = analysis.upsample(maps, (8, 6))
  assert big.shape == (1, 8, 6)
  assert big[0, 0, 0] == 0.0 and big[0, 0, -1] == 1.0 and big[0, -1, 0] == 1.0
  np.testing.assert_allclose(analysis.upsample(np.full((3, 3), 0.25), 12), 0.25)


@pytest.mark.parametrize("call, message", [
    (lambda: analysis.mean_attention_distance(_uniform(1, 1, 10), 3, 16, 0),
     "attention has 10 tokens but grid 3x3 with num_prefix_tokens=0 needs 9 (10 tokens fit "
     "grid (3, 3) with num_prefix_tokens=1). Pass the token grid"),
    (lambda: analysis.mean_attention_distance(_uniform(1, 1, 9)[0], 3, 16, 0),
     "attention must have shape [batch, heads, N, N]"),
    (lambda: analysis.mean_attention_distance(-_uniform(1, 1, 9), 3, 16, 0),
     "pass the softmax attention probabilities, not the logits"),
    (lambda: analysis.mean_attention_distance(_uniform(1, 1, 9), 3, 0, 0),
     "patch_size must be a positive int"),
    (lambda: analysis.mean_attention_distance(_uniform(1, 1, 9), 3, 16, -1),
     "num_prefix_tokens must be a non-negative int"),
    (lambda: analysis.rollout([]), "attentions is empty"),
    (lambda: analysis.rollout([_uniform(1, 1, 4), _uniform(1, 1, 5)]),
     "attentions[1] has shape (1, 1, 5, 5) but attentions[0] has (1, 1, 4, 4)"),
    (lambda: analysis.rollout([_uniform(1, 1, 4)], head_fusion="sum"), "head_fusion must be"),
    (lambda: analysis.rollout([np.full((1, 1, 4, 4), np.nan)]), "contains NaN"),
    (lambda: analysis.class_token_map(np.eye(5)[None], 3),
     "rollout_matrix has 5 tokens but grid 3x3 with num_prefix_tokens=1 needs 10 (5 tokens fit "
     "grid (2, 2) with num_prefix_tokens=1)"),
])
def test_bad_input(call, message):
  with pytest.raises(ValueError) as error:
    call()
  assert message in str(error.value)
