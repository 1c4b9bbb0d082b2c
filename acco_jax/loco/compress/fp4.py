"""Compressors of outer pseudo-gradients (pure ``jax.numpy``; no collectives).

A compressor is emulated: :meth:`Compressor.roundtrip` quantises and dequantises a payload, the
values are then reduced in float32, and :meth:`Compressor.payload_bytes` says how many bytes the
quantised payload takes on the wire. Every function works on the last axis of its input, which in
the trainer is a device's own shard row: blocks never straddle two devices' shards.

FP4 E3M0 (Streaming DiLoCo's outer gradients). A value is a sign and a 3-bit exponent, no mantissa:
one of the eight exponent codes is zero and the other seven are the powers ``2^0 .. 2^-6`` of the
block scale. Each block of ``block`` consecutive values shares one power-of-two scale (an 8-bit
exponent, as the E8M0 scales of the OCP microscaling formats):

.. math::

  s = 2^{\\lceil \\log_2 \\max_j |x_j| \\rceil} ,\\qquad
  q(x) = \\mathrm{sign}(x)\\, s \\cdot \\mathrm{nearest}\\big(|x|/s,\\ \\{0, 2^{-6}, \\dots, 2^{0}\\}\\big)

so that ``max|x|/s`` lies in ``(1/2, 1]``, and ``nearest`` rounds
to the nearest level in the linear domain (ties to the smaller). Magnitudes above ``s`` saturate to
``s`` (they occur only with an explicit scale), magnitudes below ``2^-7 s`` flush to zero. Powers of
two within the block's range come back exactly. A block of ``n`` values costs ``4 n + 8`` bits: with
the default block of 2048, 4.0039 bits per value.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

E3M0_LEVELS = 7  # nonzero magnitudes 2^0 .. 2^-6 (the eighth exponent code is zero)
SCALE_BITS = 8  # one power-of-two (E8M0) scale per block


class Compressor(NamedTuple):
  """How a payload is quantised (emulated) and what it costs on the wire.

  Attributes:
    name: ``none`` or ``fp4``.
    roundtrip: ``x[..., n] -> (dequantised x, all finite)``: quantise then dequantise along the
      last axis; the flag is False if ``x`` held a NaN or an infinity.
    payload_bytes: ``n -> bytes`` of one row of ``n`` values as sent (values plus scales).
  """

  name: str
  roundtrip: callable
  payload_bytes: callable


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _check_finite(x) -> jax.Array:
  finite = jnp.all(jnp.isfinite(x))
  if not _is_traced(finite) and not bool(finite):
    raise ValueError(
      "the FP4 quantiser got NaN or infinite values: the pseudo-gradient diverged; lower the inner "
      "or outer learning rate"
    )
  return finite


def e3m0(x: jax.Array, scale: jax.Array) -> jax.Array:
  """Rounds ``x`` to the nearest FP4 E3M0 value of the power-of-two ``scale`` (broadcastable).

  Returns the dequantised float32 values: ``sign(x) * scale * 2^e`` with ``e`` in ``[-6, 0]``, or 0.
  ``|x| > scale`` saturates to ``scale``; ``|x| < 2^-7 scale`` gives 0.
  """
  x = jnp.asarray(x, jnp.float32)
  a = jnp.minimum(jnp.abs(x) / scale, 1.0)  # exact: the scale is a power of two
  mant, ex = jnp.frexp(a)  # a = mant * 2^ex, mant in [1/2, 1)
  low = jnp.ldexp(jnp.ones_like(a), ex - 1)  # the power of two just below (or at) a
  level = jnp.where(mant > 0.75, 2 * low, low)  # nearest of low, 2 low (a/low = 2 mant)
  smallest = 2.0 ** -(E3M0_LEVELS - 1)
  level = jnp.where(a < smallest, jnp.where(a > smallest / 2, smallest, 0.0), level)
  return jnp.sign(x) * level * scale


def block_scales(x: jax.Array, block: int) -> tuple[jax.Array, int]:
  """Per-block power-of-two scales of ``x[..., n]`` (blocks of ``block`` along the last axis).

  Returns ``(scales[..., ceil(n/block)], padded n)``: ``scale = 2^ceil(log2 max|x|)``, so
  ``max|x| / scale`` lies in ``(1/2, 1]`` (an all-zero block gets scale 1).
  """
  n = x.shape[-1]
  blocks = -(-n // block)
  pad = blocks * block - n
  xb = jnp.pad(jnp.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  peak = jnp.max(xb.reshape(*x.shape[:-1], blocks, block), axis=-1)
  mant, ex = jnp.frexp(peak)  # peak = mant 2^ex, mant in [1/2, 1): the scale is 2^ceil(log2 peak)
  return jnp.ldexp(jnp.ones_like(peak), jnp.where(mant == 0.5, ex - 1, ex)), blocks * block


def fp4_roundtrip(x: jax.Array, block: int = 2048) -> tuple[jax.Array, jax.Array]:
  """FP4 E3M0 with one power-of-two scale per block: quantise, then dequantise.

  Args:
    x: float values ``[..., n]``; blocks run along the last axis.
    block: values per scale.

  Returns:
    ``(dequantised float32 values of x's shape, whether x was all finite)``. Called outside
    ``jit``, non-finite input raises ``ValueError`` instead.
  """
  x = jnp.asarray(x, jnp.float32)
  finite = _check_finite(x)
  n = x.shape[-1]
  scales, padded = block_scales(x, block)
  xb = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - n)])
  xb = xb.reshape(*x.shape[:-1], scales.shape[-1], -1)
  q = e3m0(xb, scales[..., None]).reshape(*x.shape[:-1], padded)[..., :n]
  return q, finite


def fp4_payload_bytes(n: int, block: int = 2048) -> float:
  """Bytes of ``n`` FP4 values and their per-block scales."""
  return (4 * n + SCALE_BITS * -(-n // block)) / 8


def _identity(x):
  x = jnp.asarray(x, jnp.float32)
  return x, jnp.all(jnp.isfinite(x))


def get_compressor(name: str, *, block: int = 2048) -> Compressor:
  """``none`` (float32, 4 bytes a value) or ``fp4`` (E3M0 with a scale per ``block`` values)."""
  if name in ("none", "", None):
    return Compressor("none", _identity, lambda n: 4.0 * n)
  if name == "fp4":
    if block < 1:
      raise ValueError(f"the FP4 block must be >= 1 value, got {block}")
    return Compressor(
      "fp4", lambda x: fp4_roundtrip(x, block), lambda n: fp4_payload_bytes(n, block)
    )
  raise ValueError(f"unknown quantiser {name!r}: choose 'none' or 'fp4'")


def levels() -> np.ndarray:
  """The nonnegative E3M0 magnitudes relative to the scale: ``[0, 2^-6, ..., 2^0]``."""
  return np.array([0.0] + [2.0**-e for e in range(E3M0_LEVELS - 1, -1, -1)], np.float32)
