"""FP4 (E3M0) quantiser of the outer pseudo-gradients, against a brute-force NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax.loco import compress


def reference_fp4(x, block):
  """Nearest of {0, ±2^-6 s, ..., ±2^0 s} per block (ties to the smaller magnitude), with the block
  scale s = 2^ceil(log2 max|x|) (1 for an all-zero block)."""
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  levels = np.array([0.0] + [2.0**-e for e in range(6, -1, -1)])
  for start in range(0, x.shape[-1], block):
    blk = x[..., start : start + block]
    peak = np.max(np.abs(blk), axis=-1, keepdims=True)
    scale = np.where(peak > 0, 2.0 ** np.ceil(np.log2(np.where(peak > 0, peak, 1.0))), 1.0)
    a = np.abs(blk) / scale
    best = np.argmin(np.abs(a[..., None] - levels), axis=-1)  # first (smaller) level on a tie
    out[..., start : start + block] = np.sign(blk) * levels[best] * scale
  return out


@pytest.mark.parametrize("block", [4, 7, 2048])
def test_matches_reference_on_random_values(block):
  r = np.random.default_rng(0)
  x = (r.standard_t(3, size=(3, 50)) * 10.0 ** r.integers(-3, 3, size=(3, 1))).astype(np.float32)
  got, finite = compress.fp4_roundtrip(x, block)
  # exact: power-of-two scales and a nearest-level choice, no sum whose order a CPU could change
  np.testing.assert_array_equal(np.asarray(got), reference_fp4(x, block).astype(np.float32))
  assert bool(finite)


def test_powers_of_two_are_exact_and_signs_kept():
  x = np.array([1.0, -0.5, 0.25, -(2.0**-6), 2.0**-3, -1.0, 0.0, 2.0**-5], np.float32) * 8.0
  got, _ = compress.fp4_roundtrip(x, block=64)  # scale 8: every power down to 8 * 2^-6 is a level
  np.testing.assert_array_equal(np.asarray(got), x)


def test_zero_block_and_the_smallest_level():
  got, _ = compress.fp4_roundtrip(np.zeros(10, np.float32), block=4)
  np.testing.assert_array_equal(np.asarray(got), 0.0)
  # scale 1: 2^-7 is halfway between 0 and 2^-6 (ties to 0); a little above it rounds up
  x = np.array([1.0, 2.0**-7, 2.0**-7 * 1.01, -(2.0**-9)], np.float32)
  got, _ = compress.fp4_roundtrip(x, block=8)
  np.testing.assert_array_equal(np.asarray(got), [1.0, 0.0, 2.0**-6, 0.0])


def test_saturation_with_an_explicit_scale():
  x = jnp.array([3.0, -5.0, 1.0, 0.6])
  got = compress.e3m0(x, jnp.float32(1.0))
  np.testing.assert_array_equal(np.asarray(got), [1.0, -1.0, 1.0, 0.5])


def test_non_finite_input_is_a_clear_error():
  for bad in (np.nan, np.inf, -np.inf):
    with pytest.raises(ValueError, match="FP4 quantiser got NaN or infinite values"):
      compress.fp4_roundtrip(np.array([1.0, bad], np.float32))
  _, finite = jax.jit(compress.fp4_roundtrip, static_argnums=1)(jnp.array([1.0, jnp.nan]), 4)
  assert not bool(finite)  # under jit: a flag, which the trainer turns into the error


def test_payload_bytes():
  fp4 = compress.get_compressor("fp4", block=2048)
  assert fp4.payload_bytes(4096) == (4 * 4096 + 2 * 8) / 8
  assert compress.get_compressor("none").payload_bytes(10) == 40
  with pytest.raises(ValueError, match="unknown quantiser 'fp8'"):
    compress.get_compressor("fp8")
