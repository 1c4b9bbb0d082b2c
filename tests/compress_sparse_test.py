"""Sparse compression (SparseLoCo, DeMo) against references written here from loco-family.md §4-§5, §7:
the b-bit quantiser, 12-bit packing, the DCT, chunks per shard, top-k, scatter-mean, error feedback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.fft

from acco_jax.loco import compress
from acco_jax.loco.compress import sparse


def test_two_bit_quantiser_on_a_fixed_vector():
  """v = 1, 3, ..., 15: shift 8, σ = √(168/7) = √24, step 6σ/4 = 7.348; (v − 8)/step + 2 rounds to
  1, 1, 2, 2, 2, 2, 3, 3; the lookup holds each bin's mean deviation: [0 (empty), −6, 0, 6]."""
  v = np.arange(1.0, 16.0, 2.0, dtype=np.float32)
  codes, shift, lut = compress.quantize(v, bits=2)
  np.testing.assert_array_equal(np.asarray(codes), [1, 1, 2, 2, 2, 2, 3, 3])
  assert float(shift) == 8.0
  np.testing.assert_allclose(np.asarray(lut), [0.0, -6.0, 0.0, 6.0], atol=1e-6)
  np.testing.assert_allclose(
    np.asarray(compress.dequantize(codes, shift, lut)), [2, 2, 8, 8, 8, 8, 14, 14], atol=1e-5
  )


@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_quantiser_matches_the_formula(nbits):
  r = np.random.default_rng(nbits)
  v = r.standard_t(4, size=(3, 37)).astype(np.float64)
  codes, shift, lut = compress.quantize(v.astype(np.float32), bits=nbits)
  bins = 2**nbits
  for row in range(3):
    s = v[row].mean()
    sigma = np.sqrt(((v[row] - s) ** 2).sum() / (v.shape[1] - 1))
    raw = (v[row] - s) / (6 * sigma / bins) + bins / 2
    expected = np.clip(np.round(raw), 0, bins - 1)
    # Codes are exact except where float32 rounding of the mean and σ (summed in an order XLA
    # picks per CPU) could tip a value across a rounding boundary: none of these data is that close.
    clear = np.abs(np.abs(raw - np.floor(raw)) - 0.5) > 1e-4
    assert clear.mean() > 0.95
    np.testing.assert_array_equal(np.asarray(codes[row])[clear], expected[clear])
    table = [
      (v[row] - s)[expected == b].mean() if (expected == b).any() else 0 for b in range(bins)
    ]
    np.testing.assert_allclose(np.asarray(lut[row]), table, rtol=1e-5, atol=1e-6)


def test_twelve_bit_pack_round_trip():
  np.testing.assert_array_equal(
    np.asarray(compress.pack12(np.array([0xABC, 0x123]))), [0xBC, 0x3A, 0x12]
  )
  r = np.random.default_rng(0)
  for n in (1, 2, 7, 64):
    idx = r.integers(0, 4096, size=(2, n))
    packed = compress.pack12(idx)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 3 * -(-n // 2))
    np.testing.assert_array_equal(np.asarray(compress.unpack12(packed, n)), idx)


@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_code_pack_round_trip(nbits):
  codes = np.random.default_rng(1).integers(0, 2**nbits, size=(3, 11)).astype(np.uint8)
  packed = compress.pack_codes(codes, nbits)
  assert packed.shape == (3, -(-11 * nbits // 8))
  np.testing.assert_array_equal(np.asarray(compress.unpack_codes(packed, 11, nbits)), codes)


def test_dct_is_scipys_orthonormal_dct_ii_and_round_trips():
  x = np.random.default_rng(2).normal(size=(3, 8, 6)).astype(np.float32)
  y = sparse.dct2(jnp.asarray(x))
  np.testing.assert_allclose(
    np.asarray(y), scipy.fft.dctn(x, type=2, norm="ortho", axes=(-2, -1)), atol=1e-5
  )
  np.testing.assert_allclose(np.asarray(sparse.idct2(y)), x, atol=1e-5)
  c = compress.dct_basis(64)
  np.testing.assert_allclose(c @ c.T, np.eye(64), atol=1e-5)


def tiles_reference(block, c1, c2):
  """Tiles of a 2-D block in row-major tile order, each flattened row-major."""
  a, b = block.shape
  return np.stack(
    [block[i : i + c1, j : j + c2].reshape(-1) for i in range(0, a, c1) for j in range(0, b, c2)]
  )


def test_chunk_plans_follow_the_shards():
  plan = compress.plan_chunks((768, 3072), 1)  # the reference's 64 x 64 tiles
  assert (plan.c1, plan.c2, plan.tiles, plan.k) == (64, 64, 12 * 48, 64)
  plan = compress.plan_chunks((768, 3072), 4)  # 192 rows per device: still 64 x 64
  assert (plan.rows, plan.cols, plan.c1, plan.c2, plan.tiles) == (192, 3072, 64, 64, 3 * 48)
  plan = compress.plan_chunks((96, 50), 2)  # largest divisors <= 64: 48 and 50 -> 48 x 50 tiles
  assert (plan.c1, plan.c2, plan.k) == (48, 50, 64)
  plan = compress.plan_chunks((768,), 1)  # 1-D: chunks of 64, k = 64 * 64 / 4096 = 1
  assert (plan.c1, plan.c2, plan.tiles, plan.k) == (1, 64, 12, 1)
  plan = compress.plan_chunks((50257, 8), 8)  # rows do not split evenly: 1-D chunks of a shard
  assert plan.rows == 1 and plan.length == 50257 and plan.c2 == 64 and plan.cols == 50304
  assert compress.plan_chunks((768,), 1, topk=32, rule="clamped").k == 32  # DeMo: 32 of 64
  # a device's block of a 2-D leaf is its own rows: tiles never straddle two devices' shards
  leaf = np.arange(12 * 10, dtype=np.float32).reshape(12, 10)
  plan = compress.plan_chunks(leaf.shape, 2, chunk=4)
  rows = leaf.reshape(2, -1)  # the flat layout's two shard rows
  tiles = np.asarray(compress.to_chunks(jnp.asarray(rows), plan))
  for d in range(2):
    block = leaf[6 * d : 6 * (d + 1)]
    np.testing.assert_array_equal(tiles[d].reshape(plan.tiles, -1), tiles_reference(block, 3, 2))
  np.testing.assert_array_equal(np.asarray(compress.from_chunks(jnp.asarray(tiles), plan)), rows)


def test_topk_and_scatter_mean_against_numpy():
  r = np.random.default_rng(3)
  sources, rows, size, k = 3, 4, 16, 5
  x = r.normal(size=(sources, rows, size)).astype(np.float32)
  idx, vals = compress.topk(jnp.asarray(x), k)
  total, count = np.zeros((rows, size)), np.zeros((rows, size))
  for s in range(sources):
    for i in range(rows):
      top = np.argsort(-np.abs(x[s, i]), kind="stable")[:k]
      # exact: a selection, no arithmetic (random normals: no near-ties)
      np.testing.assert_array_equal(np.sort(np.asarray(idx[s, i])), np.sort(top))
      total[i, top] += x[s, i, top]
      count[i, top] += 1
  got = compress.scatter_mean(idx, vals, size, "mean_contributors")
  np.testing.assert_allclose(
    np.asarray(got), np.where(count > 0, total / np.maximum(count, 1), 0), atol=1e-6
  )
  got = compress.scatter_mean(idx, vals, size, "mean_R")
  np.testing.assert_allclose(np.asarray(got), total / sources, atol=1e-6)


@pytest.mark.parametrize("transform,nbits", [("none", 2), ("none", 32), ("dct", 32)])
def test_error_feedback_keeps_what_is_not_sent(transform, nbits):
  """e_before = e_after + transmitted; the wire decodes (one sender) to exactly what the sender
  subtracted; at most k entries per chunk are sent; the wire is as long as the accounting says."""
  shapes = [(12, 10), (7,), (30,)]
  plans = tuple(compress.plan_chunks(s, 2, chunk=4, topk=3) for s in shapes)
  codec = compress.SparseCodec(plans, transform, nbits)
  r = np.random.default_rng(4)
  rows = [jnp.asarray(r.normal(size=(2, p.length)), jnp.float32) for p in plans]
  buffers = [jnp.asarray(r.normal(size=(2, p.length)), jnp.float32) for p in plans]
  # compiled as the training step compiles them (op by op, the 2-bit codec took seconds to dispatch)
  feedback = jax.jit(lambda x, b: sparse.feedback_compress(codec, x, b, decay=0.9, scale=0.5))
  wire, new = feedback(rows, buffers)
  assert wire.dtype == jnp.uint8 and wire.shape == (2, codec.row_bytes)
  _, sent = jax.jit(codec.compress)([0.9 * b + 0.5 * x for x, b in zip(rows, buffers, strict=True)])
  decoded = jax.jit(codec.mean)(wire[None])
  for b, x, e, s, d, p in zip(buffers, rows, new, sent, decoded, plans, strict=True):
    np.testing.assert_allclose(np.asarray(e + s), np.asarray(0.9 * b + 0.5 * x), atol=1e-6)
    # exact: the sender keeps what the receivers decode from the same bytes (a product promise)
    np.testing.assert_array_equal(np.asarray(d), np.asarray(s))
    coeffs = compress.to_chunks(s, p)
    if transform == "dct":
      coeffs = sparse.dct2(coeffs)
    nonzero = np.sum(np.abs(np.asarray(coeffs)).reshape(2, p.tiles, -1) > 1e-5, axis=-1)
    assert nonzero.max() <= p.k


def test_codec_compress_runs_under_jit_and_per_row():
  plans = (compress.plan_chunks((8, 8), 1, chunk=4, topk=2),)
  codec = compress.SparseCodec(plans, "dct", 32)
  x = jnp.asarray(np.random.default_rng(5).normal(size=(3, 64)), jnp.float32)
  wire, sent = jax.jit(codec.compress)([x])
  mean = jax.jit(codec.mean)  # eagerly, each op of the decoder compiles on its own (30 s)
  decoded = mean(wire[None])[0]
  assert wire.shape == (3, codec.row_bytes)
  one_row = jax.jit(codec.compress)  # one compilation for the three rows' shape
  for i in range(3):  # each row on its own sends the same coefficients
    one, one_sent = one_row([x[i : i + 1]])
    # Not the same bytes: the batched DCT is another GEMM shape, and XLA:CPU may sum it in another
    # order (one float32 coefficient differed in its last bit on a CPU without AVX-512). What must
    # hold is that both decode to the same values, to float32 rounding.
    np.testing.assert_allclose(decoded[i : i + 1], mean(one[None])[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sent[0][i : i + 1], one_sent[0], rtol=1e-5, atol=1e-6)
