"""vit_jax.analysis.embeddings against known answers: a 2-D sin-cos position table (big_vision's
formula, written here) has the analytic similarity, peaked at each patch and falling off with
distance; PCA of filters built from known orthogonal components recovers them; bad input."""

import numpy as np
import pytest

from vit_jax import analysis


def _sincos2d(height, width, features, temperature=10_000.0):
  """big_vision's posemb_sincos_2d: [sin(x w), cos(x w), sin(y w), cos(y w)], row-major."""
  y, x = np.mgrid[:height, :width]
  omega = 1.0 / temperature ** (np.arange(features // 4) / (features // 4 - 1))
  y = y.reshape(-1, 1) * omega
  x = x.reshape(-1, 1) * omega
  return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)[None]


def test_sincos_table_similarity_is_analytic_and_peaked():
  gh, gw, d = 4, 3, 32
  table = _sincos2d(gh, gw, d)
  with_cls = np.concatenate([np.full((1, 1, d), 7.0), table], axis=1)
  got = analysis.posemb_similarity(with_cls, (gh, gw), 1)
  assert got.shape == (gh, gw, gh, gw) and got.dtype == np.float32
  np.testing.assert_array_equal(got, analysis.posemb_similarity(table[0], (gh, gw), 0))
  # sin a sin b + cos a cos b = cos(a - b): similarity (g(dx) + g(dy)) / 2, g the mean cosine.
  omega = 1.0 / 10_000.0 ** (np.arange(d // 4) / (d // 4 - 1))
  g = lambda delta: np.cos(delta * omega).mean()  # pylint: disable=unnecessary-lambda-assignment
  for r, c, r2, c2 in np.ndindex(gh, gw, gh, gw):
    assert got[r, c, r2, c2] == pytest.approx((g(c2 - c) + g(r2 - r)) / 2, abs=1e-6)
  for r, c in np.ndindex(gh, gw):
    tile = got[r, c]
    assert np.unravel_index(tile.argmax(), tile.shape) == (r, c)
    assert tile[r, c] == pytest.approx(1.0, abs=1e-6)
    assert (np.delete(tile.ravel(), r * gw + c) < 1 - 1e-3).all()
    # Falls off with distance along each axis (offsets up to 3 < pi, the top frequency 1).
    assert (np.diff(tile[r, c:]) < 0).all() and (np.diff(tile[r, :c + 1]) > 0).all()
    assert (np.diff(tile[r:, c]) < 0).all() and (np.diff(tile[:r + 1, c]) > 0).all()


def test_learned_table_cosines():
  rng = np.random.default_rng(1)
  table = rng.normal(size=(1, 5, 8))
  got = analysis.posemb_similarity(table, 2, 1)
  a, b = table[0, 2], table[0, 4]  # Patches (0, 1) and (1, 1).
  assert got[0, 1, 1, 1] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b),
                                          rel=1e-6)


def _orthonormal_columns(rng, rows, cols, centred=False):
  matrix = rng.normal(size=(rows, cols))
  if centred:
    matrix -= matrix.mean(axis=0)
  q, _ = np.linalg.qr(matrix)
  return q


def test_pca_recovers_known_components_in_variance_order():
  rng = np.random.default_rng(0)
  p, c, d = 4, 3, 60
  basis = _orthonormal_columns(rng, p * p * c, 3).T  # 3 orthonormal [P*P*C] directions.
  coefficients = _orthonormal_columns(rng, d, 3, centred=True)  # Zero-mean, orthogonal.
  scales = np.array([2.0, 5.0, 0.5])  # Variance order: component 1, 0, 2.
  mean_filter = rng.normal(size=p * p * c)
  filters = mean_filter + (coefficients * scales) @ basis  # [D, P*P*C]
  kernel = np.stack([f.reshape(p, p, c) for f in filters], axis=-1)  # [P, P, C, D]
  components, ratio = analysis.embedding_filter_components(kernel, n=28)
  assert components.shape == (28, p, p, c) and ratio.shape == (28,)
  np.testing.assert_allclose(ratio[:3], np.array([25.0, 4.0, 0.25]) / 29.25, rtol=1e-9)
  np.testing.assert_allclose(ratio[3:], 0.0, atol=1e-12)
  for got, want in zip(components[:3], basis[[1, 0, 2]]):
    want = want.reshape(p, p, c)
    sign = np.sign(np.sum(got * want))
    np.testing.assert_allclose(got, sign * want, atol=1e-5)
    assert got.ravel()[np.abs(got).argmax()] > 0  # The sign convention.


def test_pca_returns_fewer_components_than_dimensions():
  kernel = np.random.default_rng(2).normal(size=(2, 2, 1, 40))
  components, ratio = analysis.embedding_filter_components(kernel)
  assert components.shape == (4, 2, 2, 1)
  assert ratio.sum() == pytest.approx(1.0)
  assert (np.diff(ratio) <= 0).all()


@pytest.mark.parametrize("call, message", [
    (lambda: analysis.posemb_similarity(np.ones((1, 10, 8)), 3, 0),
     "pos_embedding has 10 tokens but grid 3x3 with num_prefix_tokens=0 needs 9 (10 tokens fit "
     "grid (3, 3) with num_prefix_tokens=1)"),
    (lambda: analysis.posemb_similarity(np.ones((2, 10, 8)), 3, 1),
     "pos_embedding must have shape [1, T, D] or [T, D], got (2, 10, 8)"),
    (lambda: analysis.posemb_similarity(np.zeros((1, 10, 8)), 3, 1),
     "pos_embedding has all-zero rows for patches [0, 1, 2, 3, 4]"),
    (lambda: analysis.embedding_filter_components(np.ones((4, 4, 3))),
     "kernel must be the patch-embedding kernel [Ph, Pw, C, D], got shape (4, 4, 3)"),
    (lambda: analysis.embedding_filter_components(np.ones((2, 2, 3, 4)), n=0),
     "n must be a positive int, got 0"),
])
def test_bad_input(call, message):
  with pytest.raises(ValueError) as error:
    call()
  assert message in str(error.value)
