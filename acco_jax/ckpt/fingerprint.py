"""Fingerprints of arrays: a position-sensitive 32-bit hash of each leaf's bits.

:func:`fingerprints` hashes device arrays on their devices (a global reduction, so every process of a
multi-host job gets the same number); :func:`hash_host` computes the same hash of a host array with
numpy, in blocks. :mod:`acco_jax.ckpt.checkpoint` stores one per leaf at save time and compares after a
restore, since a flipped byte in a compressed chunk can decode without error into wrong numbers.
Dtypes whose bits do not fill whole bytes (int4, ...) and complex dtypes have no fingerprint
(``None``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def hash_leaf(x: jax.Array) -> jax.Array:
  """Position-sensitive uint32 hash of the bits of ``x`` (wrapping sum of mixed words)."""
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  words = words.reshape(-1)
  position = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1)
  h = (words ^ position) * jnp.uint32(0x85EBCA77)
  return jnp.sum(h ^ (h >> 13), dtype=jnp.uint32)


def hash_host(x: np.ndarray) -> int | None:
  """:func:`hash_leaf` of a host array, computed with numpy in blocks (``None`` if not hashable)."""
  x = np.ascontiguousarray(x).reshape(-1)
  if not hashable(x.dtype):
    return None
  if x.dtype == np.bool_:
    words = x.astype(np.uint32)
  else:
    words = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize])
  total, block = 0, 1 << 22
  for start in range(0, words.size, block):
    w = words[start : start + block].astype(np.uint32)
    position = np.arange(start, start + w.size, dtype=np.uint64).astype(np.uint32)
    h = (w ^ (position * np.uint32(0x9E3779B1))) * np.uint32(0x85EBCA77)
    total += int(np.sum(h ^ (h >> np.uint32(13)), dtype=np.uint32))
  return total % (1 << 32)


def hashable(dtype) -> bool:
  """Whether the bits of ``dtype`` fill whole bytes (not int4, complex, ...): bool, ints, floats."""
  dtype = jnp.dtype(dtype)
  for info in (jnp.finfo, jnp.iinfo):
    try:
      return info(dtype).bits == 8 * dtype.itemsize and dtype.kind != "c"
    except ValueError:
      pass
  return dtype == jnp.bool_


@jax.jit
def _hash_leaves(leaves):
  return [hash_leaf(x) if hashable(x.dtype) else None for x in leaves]


def fingerprints(leaves: list[jax.Array]) -> list[int | None]:
  """Per-leaf hashes as Python ints (``None`` for dtypes without a plain bit pattern, e.g. int4)."""
  groups: dict[frozenset, list[int]] = {}  # one jitted call per set of devices
  for i, x in enumerate(leaves):
    groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
  out: list[int | None] = [None] * len(leaves)
  for idx in groups.values():
    for i, v in zip(idx, jax.device_get(_hash_leaves([leaves[i] for i in idx])), strict=True):
      out[i] = None if v is None else int(v)
  return out
