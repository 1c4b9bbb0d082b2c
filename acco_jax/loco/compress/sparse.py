r"""Sparse payloads: chunks, top-k per chunk, the DCT, packed bytes and the scatter-mean.

SparseLoCo and DeMo send, per chunk of a tensor, the ``k`` entries of largest magnitude (after an
orthonormal DCT-II for DeMo). Every worker all-gathers everyone's entries and averages them
position by position (``loco-family.md`` §4-§5, §7).

**Chunks follow the shards.** Workers hold their parameters in the flat layout of
:mod:`acco_jax.dp.flat`: leaf ``l`` of shape ``(a, b)`` is raveled and cut into ``D`` shard rows of
``s = ceil(a b / D)`` values, one per device of the worker. Chunks are cut from a device's own row,
never across two rows, so a device compresses and decodes only what it holds (the reference's FSDP
flat shards fed partial tensors to its whole-tensor tiles, ``bloc97/DeMo`` issue 2):

* a 2-D leaf (or ``ndim >= 2``, viewed as ``(a, b)`` with ``b`` the product of the trailing
  dimensions) whose rows split evenly (``a % D == 0``): the row is the ``(a/D, b)`` block, cut into
  tiles of ``c1 x c2`` with ``c1``, ``c2`` the largest divisors of ``a/D`` and ``b`` that are at
  most ``chunk`` (64): the reference's "64 x 64 tiles from the largest divisors", on the block. With
  ``D = 1`` it is exactly the reference's tiling;
* any other leaf (1-D, or rows that do not split evenly): 1-D chunks of the row, of length ``c``
  the largest divisor of ``s`` that is at most ``chunk``; when that is below ``chunk/2`` (a length
  with no good divisor, e.g. a prime) the row is zero-padded to a multiple of ``chunk`` instead
  (the reference keeps the divisor, down to chunks of 1 value).

**k per chunk** (``rule``): ``'scaled'`` (SparseLoCo) keeps ``k`` of a 2-D tile (at most its size)
and ``max(1, round(k c / chunk²))`` of a 1-D chunk of ``c``, the same density; ``'clamped'`` (DeMo)
keeps ``min(k, chunk size)`` of every chunk (1-D chunks at 32/64 = 50%).

**Scatter-mean** over ``S`` sources at a position ``i``: ``Σ_s v_s[i] / n_i`` with ``n_i`` the
number of sources that sent ``i`` (``mean_contributors``, the reference code's rule; 0 where nobody
did) or ``/ S`` (``mean_R``, the paper's). Sources are added one after another in a fixed order
with a scatter whose indices are unique (top-k picks distinct positions), so every worker computes
the same bits from the same bytes: the result is deterministic on any backend.

**Wire format** of one row: per leaf, its ``T k`` indices packed in 12 bits, then the values as
float32 (``bits = 32``) or as ``bits``-bit codes followed by the float32 shift and ``2^bits``-entry
lookup table (:mod:`acco_jax.loco.compress.bits`). The all-gather moves these bytes, so the bytes in
the compiled program are the bytes of the accounting.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from acco_jax.loco.compress import bits as bitlib

AGGREGATES = ("mean_contributors", "mean_R")
TRANSFORMS = ("none", "dct")
RULES = ("scaled", "clamped")


class ChunkPlan(NamedTuple):
  """How one leaf's shard row of ``length`` values is cut (static).

  The row, zero-padded to ``rows x cols``, is a block cut into tiles of ``c1 x c2`` (``rows = c1 =
  1`` for 1-D chunks); ``k`` entries are kept per tile.
  """

  length: int
  rows: int
  cols: int
  c1: int
  c2: int
  k: int

  @property
  def tiles(self) -> int:
    return (self.rows // self.c1) * (self.cols // self.c2)

  @property
  def size(self) -> int:
    return self.c1 * self.c2

  @property
  def kept(self) -> int:
    """Entries sent per row."""
    return self.tiles * self.k


def largest_divisor(n: int, limit: int) -> int:
  """The largest divisor of ``n`` that is at most ``limit`` (1 if none larger)."""
  for d in range(min(n, limit), 0, -1):
    if n % d == 0:
      return d
  return 1


def plan_chunks(
  shape: tuple[int, ...], num_shards: int, *, chunk: int = 64, topk: int = 64, rule: str = "scaled"
) -> ChunkPlan:
  """The :class:`ChunkPlan` of a leaf of ``shape`` laid out over ``num_shards`` devices (see the
  module docstring for the rules)."""
  if rule not in RULES:
    raise ValueError(f"unknown top-k rule {rule!r}: choose one of {RULES}")
  if chunk < 1 or topk < 1:
    raise ValueError(f"chunk={chunk} and topk={topk} must be >= 1")
  n = math.prod(shape)
  s = -(-n // num_shards)
  if len(shape) >= 2 and shape[0] % num_shards == 0:
    rows, cols = shape[0] // num_shards, n // shape[0]
    c1, c2 = largest_divisor(rows, chunk), largest_divisor(cols, chunk)
    tile = True
  else:
    c2 = largest_divisor(s, chunk)
    if c2 < chunk // 2 and s > chunk:
      c2 = chunk
    rows, cols, c1, tile = 1, -(-s // c2) * c2, 1, False
  size = c1 * c2
  if rule == "clamped" or tile:
    k = min(topk, size)
  else:
    k = min(size, max(1, round(topk * size / chunk**2)))
  return ChunkPlan(s, rows, cols, c1, c2, k)


def to_chunks(x: jax.Array, plan: ChunkPlan) -> jax.Array:
  """A row ``[..., length]`` -> its tiles ``[..., T, c1, c2]``."""
  lead = x.shape[:-1]
  pad = plan.rows * plan.cols - plan.length
  if pad:
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)])
  x = x.reshape(*lead, plan.rows // plan.c1, plan.c1, plan.cols // plan.c2, plan.c2)
  return jnp.swapaxes(x, -3, -2).reshape(*lead, plan.tiles, plan.c1, plan.c2)


def from_chunks(t: jax.Array, plan: ChunkPlan) -> jax.Array:
  """The inverse of :func:`to_chunks` (padding dropped)."""
  lead = t.shape[:-3]
  t = t.reshape(*lead, plan.rows // plan.c1, plan.cols // plan.c2, plan.c1, plan.c2)
  return jnp.swapaxes(t, -3, -2).reshape(*lead, plan.rows * plan.cols)[..., : plan.length]


def dct_basis(n: int) -> np.ndarray:
  r"""The orthonormal DCT-II matrix, ``C[k, j] = \sqrt{2/n}\, w_k \cos(\pi (2j + 1) k / 2n)`` with
  ``w_0 = 1/\sqrt 2``, else 1 (``C Cᵀ = I``; the inverse is ``Cᵀ``)."""
  k, j = np.arange(n)[:, None], np.arange(n)[None, :]
  c = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * j + 1) * k / (2 * n))
  c[0] /= np.sqrt(2.0)
  return c.astype(np.float32)


_HI = lax.Precision.HIGHEST


def dct2(x: jax.Array) -> jax.Array:
  """Orthonormal DCT-II along both tile axes of ``[..., c1, c2]`` (``C1 x C2ᵀ``)."""
  c1, c2 = dct_basis(x.shape[-2]), dct_basis(x.shape[-1])
  return jnp.einsum("ij,...jk,lk->...il", c1, x, c2, precision=_HI)


def idct2(y: jax.Array) -> jax.Array:
  """The inverse of :func:`dct2` (``C1ᵀ y C2``)."""
  c1, c2 = dct_basis(y.shape[-2]), dct_basis(y.shape[-1])
  return jnp.einsum("ji,...jk,kl->...il", c1, y, c2, precision=_HI)


def topk(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Positions and signed values of the ``k`` largest ``|x|`` along the last axis (ties: the lower
  position first)."""
  _, idx = lax.top_k(jnp.abs(x), k)
  return idx, jnp.take_along_axis(x, idx, axis=-1)


def scatter(idx: jax.Array, vals: jax.Array, size: int) -> jax.Array:
  """Dense ``[..., size]`` zeros with ``vals`` at ``idx`` (distinct positions per row)."""
  lead, k = idx.shape[:-1], idx.shape[-1]
  rows = math.prod(lead)
  flat = (jnp.arange(rows, dtype=jnp.int32)[:, None] * size + idx.reshape(rows, k)).reshape(-1)
  out = jnp.zeros(rows * size, vals.dtype).at[flat].set(vals.reshape(-1), unique_indices=True)
  return out.reshape(*lead, size)


def scatter_mean(idx: jax.Array, vals: jax.Array, size: int, aggregate: str) -> jax.Array:
  """Position-wise mean of ``S`` sparse rows: ``idx``, ``vals`` are ``[S, ..., k]`` -> ``[..., size]``.

  Sources are added one at a time in order ``0 .. S-1`` (deterministic); ``aggregate`` divides by
  the number of contributors to each position (``mean_contributors``) or by ``S`` (``mean_R``).
  """
  if aggregate not in AGGREGATES:
    raise ValueError(f"unknown aggregate {aggregate!r}: choose one of {AGGREGATES}")
  sources = idx.shape[0]

  def add(s, carry):
    total, count = carry
    i = lax.dynamic_index_in_dim(idx, s, keepdims=False)
    v = lax.dynamic_index_in_dim(vals, s, keepdims=False)
    v = v.astype(jnp.float32)
    return total + scatter(i, v, size), count + scatter(i, jnp.ones_like(v), size)

  first = scatter(idx[0], vals[0].astype(jnp.float32), size)  # (typed like the inputs)
  first_count = scatter(idx[0], jnp.ones_like(vals[0], jnp.float32), size)
  total, count = lax.fori_loop(1, sources, add, (first, first_count))
  if aggregate == "mean_R":
    return total / sources
  return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


class SparseCodec(NamedTuple):
  """Top-k per chunk (optionally in the DCT domain, optionally quantised) of a list of leaf rows.

  Attributes:
    plans: one :class:`ChunkPlan` per leaf, in the order of the rows passed in.
    transform: ``none`` or ``dct`` (an orthonormal DCT-II of each tile before the top-k).
    bits: 2, 4 or 8 (values quantised with a per-tensor shift and lookup) or 32 (float32 values).
    aggregate: ``mean_contributors`` or ``mean_R`` (see :func:`scatter_mean`).
  """

  plans: tuple[ChunkPlan, ...]
  transform: str = "none"
  bits: int = 32
  aggregate: str = "mean_contributors"

  def leaf_bytes(self, plan: ChunkPlan) -> int:
    n = plan.kept
    if self.bits == 32:
      return bitlib.pack12_bytes(n) + 4 * n
    return bitlib.pack12_bytes(n) + bitlib.code_bytes(n, self.bits) + 4 * (1 + (1 << self.bits))

  @property
  def row_bytes(self) -> int:
    """Bytes of one row of every leaf on the wire (indices, values, shifts and tables)."""
    return sum(self.leaf_bytes(p) for p in self.plans)

  @property
  def density(self) -> float:
    """Entries sent over the entries of the chunks (one row of every leaf; a padded 1-D row's
    padding counts as held)."""
    return sum(p.kept for p in self.plans) / sum(p.tiles * p.size for p in self.plans)

  def compress(self, rows: list[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
    """Rows ``[..., length_l]`` -> (``uint8 [..., row_bytes]`` on the wire, the dense rows that
    the wire decodes to: what the receivers get from this sender, for error feedback)."""
    wire, sent = [], []
    for x, p in zip(rows, self.plans, strict=True):
      tiles = to_chunks(jnp.asarray(x, jnp.float32), p)
      if self.transform == "dct":
        tiles = dct2(tiles)
      idx, vals = topk(tiles.reshape(*tiles.shape[:-2], p.size), p.k)
      lead = idx.shape[:-2]
      wire.append(bitlib.pack12(idx.reshape(*lead, -1)))
      if self.bits == 32:
        wire.append(bitlib.float_bytes(vals.reshape(*lead, -1)))
      else:
        codes, shift, lut = bitlib.quantize(vals.reshape(*lead, -1), self.bits)
        vals = bitlib.dequantize(codes, shift, lut).reshape(idx.shape)
        meta = jnp.concatenate([shift[..., None], lut], axis=-1)
        wire += [bitlib.pack_codes(codes, self.bits), bitlib.float_bytes(meta)]
      dense = scatter(idx, vals, p.size).reshape(tiles.shape)
      if self.transform == "dct":
        dense = idct2(dense)
      sent.append(from_chunks(dense, p))
    return jnp.concatenate(wire, axis=-1), sent

  def mean(self, wires: jax.Array) -> list[jax.Array]:
    """The scatter-mean of ``S`` senders' wires ``uint8 [S, ..., row_bytes]``: rows ``[..., length_l]``."""
    out, at = [], 0

    def take(nbytes):
      nonlocal at
      at += nbytes
      return wires[..., at - nbytes : at]

    for p in self.plans:
      n, lead = p.kept, wires.shape[:-1]
      idx = bitlib.unpack12(take(bitlib.pack12_bytes(n)), n)
      if self.bits == 32:
        vals = bitlib.bytes_float(take(4 * n))
      else:
        codes = bitlib.unpack_codes(take(bitlib.code_bytes(n, self.bits)), n, self.bits)
        meta = bitlib.bytes_float(take(4 * (1 + (1 << self.bits))))
        vals = bitlib.dequantize(codes, meta[..., 0], meta[..., 1:])
      dense = scatter_mean(
        idx.reshape(*lead, p.tiles, p.k), vals.reshape(*lead, p.tiles, p.k), p.size, self.aggregate
      )
      dense = dense.reshape(*lead[1:], p.tiles, p.c1, p.c2)
      if self.transform == "dct":
        dense = idct2(dense)
      out.append(from_chunks(dense, p))
    return out


def accumulate(rows: list, buffers: list, decay: float, scale=1.0) -> list:
  """The error feedback with the payload added, before anything is sent: ``β e + c x`` (float32)."""
  return [
    decay * b + scale * jnp.asarray(x, jnp.float32) for x, b in zip(rows, buffers, strict=True)
  ]


def feedback_compress(
  codec: SparseCodec, rows: list, buffers: list, decay: float, scale=1.0
) -> tuple[jax.Array, list]:
  """Error feedback around :meth:`SparseCodec.compress`: ``e ← β e + c x``, send the top-k of
  ``e``, keep the rest: ``e ← e − sent``. Returns ``(wire, new buffers)``; ``e_before = e_after +
  sent`` up to rounding."""
  e = accumulate(rows, buffers, decay, scale)
  wire, sent = codec.compress(e)
  return wire, [a - s for a, s in zip(e, sent, strict=True)]
