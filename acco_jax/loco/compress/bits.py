r"""Bits on the wire: the b-bit quantiser with a per-tensor shift and lookup table, and packing.

Every function works on the last axis; leading axes are a batch (a device's rows).

**Quantiser** (SparseLoCo's 2-bit values, ``loco-family.md`` §4). For the values ``v`` of one tensor
(``n`` of them), with ``B = 2^bits`` bins and a spread of ``r`` standard deviations:

.. math::

  s = \bar v, \qquad \sigma = \sqrt{\tfrac{1}{n-1} \textstyle\sum_j (v_j - s)^2}, \qquad
  \Delta = r \sigma / B, \qquad
  c_j = \mathrm{clip}\big(\mathrm{round}((v_j - s)/\Delta + B/2),\ 0,\ B - 1\big)

and the lookup table holds, per bin, the mean of ``v − s`` over the values coded into it (0 for an
empty bin): ``deq(c_j) = lut[c_j] + s``. Sent: ``n`` codes of ``bits`` bits, the shift and the
``B``-entry table (float32). ``round`` is half to even. With ``B = 4`` and ``r = 6`` the bins'
centres are at ``−3σ, −1.5σ, 0, 1.5σ`` around the shift (the reference's ``+B/2`` offset is not
symmetric); the table, not the centres, is what comes back.

**Packing.** Indices below 4096 (a chunk of at most 64 x 64) take 12 bits: two indices in three
bytes. Codes of ``bits`` bits go ``8 / bits`` to a byte. Floats travel as their four bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BITS = (2, 4, 8)  # quantiser widths; 32 means float32 values (no quantiser)


def quantize(v: jax.Array, bits: int = 2, spread: float = 6.0):
  """Codes, shift and lookup table of ``v[..., n]`` (one tensor per leading index).

  Returns:
    ``(codes uint8 [..., n], shift float32 [...], lut float32 [..., 2^bits])``.
  """
  if bits not in BITS:
    raise ValueError(f"quantiser bits={bits}: choose one of {BITS}")
  v = jnp.asarray(v, jnp.float32)
  n, bins = v.shape[-1], 1 << bits
  shift = jnp.mean(v, axis=-1, keepdims=True)
  c = v - shift
  if n > 1:
    sigma = jnp.sqrt(jnp.sum(c * c, axis=-1, keepdims=True) / (n - 1))
  else:
    sigma = jnp.zeros_like(shift)
  step = spread * sigma / bins
  step = jnp.where(step > 0, step, 1.0)
  codes = jnp.clip(jnp.round(c / step + bins / 2), 0, bins - 1).astype(jnp.uint8)
  if bits <= 4:  # one-hot sums: a fixed reduction order, the same bits on every backend
    hot = codes[..., None] == jnp.arange(bins, dtype=jnp.uint8)
    sums = jnp.sum(jnp.where(hot, c[..., None], 0.0), axis=-2)
    counts = jnp.sum(hot, axis=-2)
  else:
    lead = v.shape[:-1]
    rows = jnp.arange(int(jnp.size(shift)), dtype=jnp.int32).reshape(*lead, 1) * bins
    flat = (rows + codes.astype(jnp.int32)).reshape(-1)
    sums = jnp.zeros(shift.size * bins, jnp.float32).at[flat].add(c.reshape(-1))
    counts = jnp.zeros(shift.size * bins, jnp.int32).at[flat].add(1)
    sums, counts = sums.reshape(*lead, bins), counts.reshape(*lead, bins)
  lut = jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0.0)
  return codes, shift[..., 0], lut


def dequantize(codes: jax.Array, shift: jax.Array, lut: jax.Array) -> jax.Array:
  """``lut[codes] + shift`` (float32, ``codes``' shape)."""
  return jnp.take_along_axis(lut, codes.astype(jnp.int32), axis=-1) + shift[..., None]


def pack12(idx: jax.Array) -> jax.Array:
  """Indices in ``[0, 4096)`` ``[..., n]`` -> ``uint8 [..., 3 ceil(n/2)]`` (two indices, three bytes)."""
  idx = jnp.asarray(idx, jnp.int32)
  if idx.shape[-1] % 2:
    idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, 1)])
  a, b = idx[..., 0::2], idx[..., 1::2]
  out = jnp.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], axis=-1)
  return out.reshape(*idx.shape[:-1], -1).astype(jnp.uint8)


def unpack12(packed: jax.Array, n: int) -> jax.Array:
  """The inverse of :func:`pack12`: ``int32 [..., n]``."""
  x = jnp.asarray(packed).astype(jnp.int32).reshape(*packed.shape[:-1], -1, 3)
  a = x[..., 0] | ((x[..., 1] & 0xF) << 8)
  b = (x[..., 1] >> 4) | (x[..., 2] << 4)
  return jnp.stack([a, b], axis=-1).reshape(*packed.shape[:-1], -1)[..., :n]


def pack12_bytes(n: int) -> int:
  """Bytes of ``n`` packed 12-bit indices."""
  return 3 * (-(-n // 2))


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
  """``bits``-bit codes ``[..., n]`` -> ``uint8 [..., ceil(n bits / 8)]``, low bits first."""
  per = 8 // bits
  codes = jnp.asarray(codes, jnp.uint8)
  pad = -codes.shape[-1] % per
  if pad:
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
  grouped = codes.reshape(*codes.shape[:-1], -1, per).astype(jnp.uint32)
  shifts = jnp.arange(per, dtype=jnp.uint32) * bits
  return jnp.sum(grouped << shifts, axis=-1).astype(jnp.uint8)


def unpack_codes(packed: jax.Array, n: int, bits: int) -> jax.Array:
  """The inverse of :func:`pack_codes`: ``uint8 [..., n]``."""
  per = 8 // bits
  shifts = jnp.arange(per, dtype=jnp.uint32) * bits
  x = (jnp.asarray(packed).astype(jnp.uint32)[..., None] >> shifts) & ((1 << bits) - 1)
  return x.reshape(*packed.shape[:-1], -1)[..., :n].astype(jnp.uint8)


def code_bytes(n: int, bits: int) -> int:
  """Bytes of ``n`` packed codes of ``bits`` bits."""
  return -(-n * bits // 8)


def float_bytes(x: jax.Array) -> jax.Array:
  """float32 ``[..., n]`` -> its bytes, ``uint8 [..., 4 n]``."""
  x = jnp.asarray(x, jnp.float32)
  return lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:-1], -1)


def bytes_float(b: jax.Array) -> jax.Array:
  """The inverse of :func:`float_bytes`."""
  return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 4), jnp.float32)
