r"""Blockwise symmetric integer quantization of what a device sends (pure ``jax.numpy``).

No collectives here: :mod:`acco_jax.dp.stage` quantizes a payload with :func:`encode`, moves the bytes
with an all-to-all or an all-gather, and reads them with :func:`decode`. Every function works along
the last axis, one payload row per destination, so a block never straddles two destinations.

A row of ``n`` values is zero-padded to a multiple of ``block`` and cut into blocks of ``block``
consecutive values. Block ``b`` gets one float32 scale and its values become integers of ``bits``
bits:

.. math::

  s_b = \max_{j \in b} |x_j| \cdot \mathrm{fl}(1/q_{max}), \qquad
  q_j = \mathrm{clip}\big(\mathrm{round}(x_j / s_b),\ -q_{max},\ q_{max}\big), \qquad
  \hat x_j = q_j\, s_b

with :math:`q_{max} = 127` (int8) or :math:`7` (int4; the code :math:`-8` is unused, so the grid is
symmetric), rounding half to even. An all-zero block has :math:`s_b = 0` and sends zeros. The error
is at most half a step, :math:`|x_j - \hat x_j| \le s_b / 2`, and the residual
:math:`x_j - \hat x_j` is exact in float32: :math:`\hat x_j` is zero or within a factor of two of
:math:`x_j` (Sterbenz). That residual is what error feedback keeps for the next send, so that the
values sent plus the residual equal the values to send, bit for bit.

On the wire a row is the integers (int4: two per byte, the even-indexed value in the low nibble),
then the bytes of the scales: :func:`wire_bytes` = :math:`\lceil n/B \rceil (B \cdot bits/8 + 4)`
for :math:`n` values in blocks of :math:`B`: 1.0156 bytes per value for int8 in blocks of 256, 0.5156
for int4 (bf16: 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

MODES = ("none", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
QMAX = {"int8": 127, "int4": 7}
SCALE_BYTES = 4  # one float32 scale per block


def check(quantize: str, block: int, error_feedback: bool = True, node_size: int = 1) -> None:
  """Raises a one-line ``ValueError`` for settings that cannot work."""
  if quantize not in MODES:
    raise ValueError(f"quantize={quantize!r} is unknown: choose one of {', '.join(MODES)}")
  if not isinstance(block, int) or isinstance(block, bool) or block < 1:
    raise ValueError(f"block={block!r} must be a positive integer (values per scale)")
  if quantize == "int4" and block % 2:
    raise ValueError(f"block={block} is odd: int4 packs two values per byte, use an even block")
  if not isinstance(error_feedback, bool):
    raise ValueError(f"error_feedback={error_feedback!r} must be True or False")
  if not isinstance(node_size, int) or isinstance(node_size, bool) or node_size < 1:
    raise ValueError(f"node_size={node_size!r} must be a positive integer (devices per node)")


def check_plan(plan, num_devices: int, shard_size: int, replica_axis=None) -> bool:
  """Whether ``plan`` (a :class:`acco_jax.dp.methods.CommPlan`) quantizes the gradients' reduction.

  One-line ``ValueError`` for settings that this mesh and model cannot take. With a single node
  (``node_size`` = all devices) only the weights are quantized: no gradient leaves a node.
  """
  if plan.quantize == "none":
    return False
  if replica_axis is not None or plan.name not in ("acco", "zero1"):
    raise ValueError(f"quantized communication is built for acco and zero1, not {plan.name!r}")
  if num_devices % plan.node_size:
    raise ValueError(
      f"node_size={plan.node_size} does not divide the {num_devices} devices of the "
      f"{plan.axis_name!r} axis; use the devices per node (a divisor), or 1"
    )
  if plan.block > shard_size:
    raise ValueError(
      f"block={plan.block} is larger than a device's shard of {shard_size} values: use a block "
      f"of at most {shard_size}"
    )
  return num_devices // plan.node_size > 1


def node_groups(num_devices: int, node_size: int) -> tuple[list | None, list | None]:
  """Device groups of the two-level reduction: the nodes (``node_size`` consecutive devices) and
  the rails (the devices of one rank in every node); ``(None, None)`` for ``node_size`` 1."""
  if node_size <= 1:
    return None, None
  nodes = [list(range(a, a + node_size)) for a in range(0, num_devices, node_size)]
  return nodes, [list(range(r, num_devices, node_size)) for r in range(node_size)]


def rank_major(flat, node_size: int, shard_size: int):
  """A flat buffer of chunks ``c = a L + l`` (``L = node_size``) reordered rank-major, ``[(l, a, S)]``:
  a tiled reduce-scatter over a node's ``L`` devices then gives rank ``l`` the chunks ``{a L + l}``."""
  x = flat.reshape(-1, node_size, shard_size)
  return jnp.swapaxes(x, 0, 1).reshape(-1)


def rank_column(rows, rank, node_size: int):
  """Rows ``[A, S]`` of the chunks ``{a L + rank}`` -> a flat buffer ``[A L S]`` holding them at
  those chunks and zeros elsewhere."""
  if node_size == 1:
    return rows.reshape(-1)
  here = jnp.arange(node_size)[None, :, None] == rank
  return jnp.where(here, rows[:, None, :], 0.0).reshape(-1)


def describe(plan, num_devices: int, shard_size: int) -> str:
  """One line on a plan's quantized communication: blocks, padding, what is quantized."""
  if plan.quantize == "none":
    return ""
  pad = padded_size(shard_size, plan.block) / shard_size - 1
  nodes = num_devices // plan.node_size
  grads = (
    "gradients stay in the node (one node)"
    if nodes == 1
    else f"gradients: all-to-all over {nodes} nodes of {plan.node_size}"
  )
  return (
    f"comm={plan.quantize} blocks of {plan.block} (shards padded by {pad:.1%}), {grads}, "
    f"weights: quantized updates, error feedback {'on' if plan.error_feedback else 'off'}"
  )


def padded_size(n: int, block: int) -> int:
  """``n`` rounded up to a multiple of ``block``: the values a row of ``n`` occupies on the wire."""
  return -(-n // block) * block


def wire_bytes(n: int, mode: str, block: int) -> int:
  """Bytes of one encoded row of ``n`` values: the integers and one float32 scale per block."""
  blocks = -(-n // block)
  return blocks * (block * BITS[mode] // 8 + SCALE_BYTES)


def quantize(x: jax.Array, mode: str, block: int) -> tuple[jax.Array, jax.Array]:
  """``x[..., n]`` (``n`` a multiple of ``block``) -> int8 codes ``[..., n]`` and scales ``[..., n/block]``.

  int4 codes are int8 values in ``[-7, 7]``; :func:`pack` puts two in a byte.
  """
  x = jnp.asarray(x, jnp.float32)
  qmax = QMAX[mode]
  xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
  scale = jnp.max(jnp.abs(xb), axis=-1) * jnp.float32(1 / qmax)  # XLA turns "/ qmax" into this
  safe = jnp.where(scale > 0, scale, 1.0)[..., None]
  q = jnp.clip(jnp.round(xb / safe), -qmax, qmax).astype(jnp.int8)
  return q.reshape(x.shape), scale


def dequantize(q: jax.Array, scale: jax.Array, block: int) -> jax.Array:
  """Codes ``[..., n]`` and scales ``[..., n/block]`` -> float32 values ``q * s``."""
  qb = q.reshape(*q.shape[:-1], q.shape[-1] // block, block).astype(jnp.float32)
  return (qb * scale[..., None]).reshape(q.shape)


def pack(q: jax.Array, mode: str) -> jax.Array:
  """Codes -> wire bytes: int8 as is, int4 two per byte (even index in the low nibble)."""
  if mode == "int8":
    return q
  pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
  return (pairs[..., 0] & jnp.int8(0x0F)) | (pairs[..., 1] << 4)


def unpack(b: jax.Array, mode: str) -> jax.Array:
  """Wire bytes -> codes (int4: sign-extended nibbles, low nibble first)."""
  if mode == "int8":
    return b
  low = (b << 4) >> 4  # arithmetic shifts of int8 extend the sign
  return jnp.stack([low, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def encode(x: jax.Array, mode: str, block: int) -> tuple[jax.Array, jax.Array]:
  """Rows ``x[..., n]`` -> (int8 wire rows ``[..., wire_bytes(n)]``, the values they carry ``[..., n]``).

  The second result is what a receiver's :func:`decode` returns, so ``x - sent`` is the residual of
  this send (exact in float32).
  """
  x = jnp.asarray(x, jnp.float32)
  n = x.shape[-1]
  pad = padded_size(n, block) - n
  xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  q, scale = quantize(xp, mode, block)
  scale_bytes = lax.bitcast_convert_type(scale, jnp.int8).reshape(*scale.shape[:-1], -1)
  wire = jnp.concatenate([pack(q, mode), scale_bytes], axis=-1)
  return wire, dequantize(q, scale, block)[..., :n]


def decode(wire: jax.Array, mode: str, block: int, n: int) -> jax.Array:
  """Wire rows from :func:`encode` -> float32 values ``[..., n]``."""
  padded = padded_size(n, block)
  payload = padded * BITS[mode] // 8
  scale_bytes = wire[..., payload:].reshape(*wire.shape[:-1], padded // block, SCALE_BYTES)
  scale = lax.bitcast_convert_type(scale_bytes, jnp.float32)
  return dequantize(unpack(wire[..., :payload], mode), scale, block)[..., :n]
