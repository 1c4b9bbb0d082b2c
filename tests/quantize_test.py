"""The blockwise quantizer against a NumPy reference written here, and error feedback's identity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax.dp import quantize as Q

QMAX = {"int8": 127, "int4": 7}


def ref_quantize(x, mode, block):
  """acco_jax/dp/quantize.py's formula in NumPy float32: per block s = max|x| * fl(1/qmax),
  q = rint(x / s) clipped to [-qmax, qmax]."""
  x = np.asarray(x, np.float32)
  n = x.shape[-1]
  padded = -(-n // block) * block
  xp = np.zeros(x.shape[:-1] + (padded,), np.float32)
  xp[..., :n] = x
  xb = xp.reshape(*x.shape[:-1], padded // block, block)
  s = np.abs(xb).max(-1) * np.float32(1 / QMAX[mode])
  safe = np.where(s > 0, s, np.float32(1))[..., None]
  q = np.clip(np.rint(xb / safe), -QMAX[mode], QMAX[mode]).astype(np.int8)
  deq = (q.astype(np.float32) * s[..., None]).reshape(xp.shape)[..., :n]
  return q.reshape(xp.shape), s, deq


def ref_wire(q, s, mode):
  """Bytes on the wire: the codes (int4: low nibble first), then the scales' float32 bytes."""
  if mode == "int4":
    u = (q.astype(np.int16) & 0xF).astype(np.uint8)
    q = (u[..., 0::2] | (u[..., 1::2] << 4)).view(np.int8)
  return np.concatenate([q, np.ascontiguousarray(s).view(np.int8)], axis=-1)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("n,block", [(64, 16), (70, 16), (5, 8)])  # 70, 5: padded rows
def test_encode_matches_the_numpy_reference(mode, n, block):
  r = np.random.default_rng(n)
  x = (r.normal(size=(3, n)) * np.exp(r.normal(size=(3, 1)) * 3)).astype(np.float32)
  x[1, :block] = 0.0  # an all-zero block: scale 0, codes 0
  wire, sent = jax.jit(Q.encode, static_argnums=(1, 2))(x, mode, block)
  q, s, deq = ref_quantize(x, mode, block)
  # exact: elementwise IEEE operations and a max per block, no sum whose order a CPU could change
  np.testing.assert_array_equal(np.asarray(wire), ref_wire(q, s, mode))
  np.testing.assert_array_equal(np.asarray(sent), deq)
  assert (
    wire.shape[-1]
    == Q.wire_bytes(n, mode, block)
    == -(-n // block) * (block * {"int8": 8, "int4": 4}[mode] // 8 + 4)
  )
  back = jax.jit(Q.decode, static_argnums=(1, 2, 3))(wire, mode, block, n)
  np.testing.assert_array_equal(np.asarray(back), deq)  # the receiver sees what the sender kept
  step = np.repeat(s, block, axis=-1)[..., :n]
  assert np.all(np.abs(x - deq) <= step / 2 * (1 + 1e-6))  # at most half a step
  assert not np.any(deq[1, :block]) and np.all(np.isfinite(deq))


def test_int4_packing_round_trips_every_code():
  codes = jnp.asarray(np.tile(np.arange(-7, 8), 4)[:32].reshape(2, 16), jnp.int8)
  packed = Q.pack(codes, "int4")
  assert packed.shape == (2, 8) and packed.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(Q.unpack(packed, "int4")), np.asarray(codes))
  b = np.asarray(Q.pack(jnp.asarray([[-1, 3]], jnp.int8), "int4")).view(np.uint8)
  assert b.tolist() == [[0x3F]]  # -1 in the low nibble, 3 in the high one


def test_residual_is_exact_and_error_feedback_loses_nothing():
  """Per send, sent + residual == what was to send, bit for bit; over many sends the residual
  carries exactly what is missing: Σ sent + residual == Σ gradients (float64 comparison)."""
  r = np.random.default_rng(1)
  block, mode = 8, "int4"
  encode = jax.jit(Q.encode, static_argnums=(1, 2))
  residual = np.zeros(40, np.float32)
  total_sent, total_plain, total_grad = (np.zeros(40, np.float64) for _ in range(3))
  for _ in range(200):
    g = (r.normal(size=40) * 1e-2).astype(np.float32)
    total_grad += g
    x = g + residual  # what this send owes
    sent = np.asarray(encode(x, mode, block)[1])
    residual = x - sent
    assert np.array_equal(sent + residual, x)  # exact, every element
    total_sent += sent
    total_plain += np.asarray(encode(g, mode, block)[1])  # the same sends without feedback
  drift = np.abs(total_sent + residual - total_grad).max()
  plain = np.abs(total_plain - total_grad).max()
  # what is left is the float32 rounding of `g + residual`; without feedback the errors add up
  assert drift < 1e-6 and plain > 1e-3, (drift, plain)


@pytest.mark.parametrize(
  "args,match",
  [
    (("int2", 256), "quantize='int2' is unknown: choose one of none, int8, int4"),
    (("int8", 0), "block=0 must be a positive integer"),
    (("int8", 2.5), "block=2.5 must be a positive integer"),
    (("int4", 255), "block=255 is odd: int4 packs two values per byte"),
    (("int8", 256, "yes"), "error_feedback='yes' must be True or False"),
    (("int8", 256, True, 0), "node_size=0 must be a positive integer"),
  ],
)
def test_bad_settings_are_one_line_errors(args, match):
  with pytest.raises(ValueError, match=match) as info:
    Q.check(*args)
  assert "\n" not in str(info.value)


def test_node_groups_and_rank_layout():
  assert Q.node_groups(8, 1) == (None, None)
  nodes, rails = Q.node_groups(8, 4)
  assert nodes == [[0, 1, 2, 3], [4, 5, 6, 7]] and rails == [[0, 4], [1, 5], [2, 6], [3, 7]]
  flat = np.arange(8 * 3)  # chunk c = values [3c, 3c + 3)
  major = np.asarray(Q.rank_major(jnp.asarray(flat), 4, 3)).reshape(4, 2, 3)
  for rank in range(4):  # rank l's block holds chunks l and 4 + l
    np.testing.assert_array_equal(major[rank], flat.reshape(8, 3)[[rank, 4 + rank]])
  col = np.asarray(Q.rank_column(jnp.ones((2, 3)), 1, 4)).reshape(8, 3)
  assert col[[1, 5]].all() and not np.delete(col, [1, 5], axis=0).any()
