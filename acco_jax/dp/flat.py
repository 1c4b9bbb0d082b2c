"""Flat, shard-major layout of a parameter pytree.

ZeRO-1 wants one reduce-scatter and one all-gather of a single flat buffer per stage, while optax wants
a pytree whose structure matches the model (masks by name, ``inject_hyperparams``, global-norm clipping).
:class:`FlatLayout` gives both views of the same numbers.

Every leaf ``l`` of size ``n_l`` is zero-padded to ``N * s_l`` elements (``s_l = ceil(n_l / N)``) and cut
into ``N`` contiguous chunks. Device ``i``'s shard is the concatenation over leaves of chunk ``i``:

.. code-block:: none

  rows  [N, S]        row i = [leaf0 chunk i | leaf1 chunk i | ...],  S = sum_l s_l
  flat  [N * S]       rows.reshape(-1): what is reduce-scattered / all-gathered (tiled, dim 0)
  shards {l: [N, s_l]} the same numbers as a pytree shaped like the params; row i lives on device i

So ``psum_scatter(flat, tiled=True)`` hands device ``i`` exactly row ``i``, and the optimizer can run on the
``shards`` tree (sharded over its leading axis) with the param names intact. Padding costs at most
``N - 1`` elements per leaf, stays zero under elementwise optimizers and does not change norms.

The same functions work inside ``shard_map`` on a device's local block: pass ``rows``/``shards`` whose
leading dimension is 1.

The layout depends on ``N``. :func:`reshard_chunks` and :func:`reshard_flat` convert host (numpy) arrays
between the layouts of two device counts (:meth:`FlatLayout.resized`) by dropping one padding and
adding the other: the real elements are moved, never changed (elastic restore, :mod:`acco_jax.dp.reshard`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class LeafSpec(NamedTuple):
  shape: tuple[int, ...]
  dtype: Any
  size: int  # number of elements of the leaf
  chunk: int  # s_l = ceil(size / num_shards): elements of this leaf per shard
  offset: int  # start of this leaf's chunk inside a row of length S


def leaves_of(tree: PyTree, treedef) -> list:
  """``tree``'s leaves; a one-line error unless its structure is ``treedef`` (a layout's)."""
  leaves, got = jax.tree.flatten(tree)
  if got != treedef:
    raise ValueError(f"pytree structure does not match the layout: got {got}, expected {treedef}")
  return leaves


def concat_rows(parts: list) -> jax.Array:
  """``[n, s_i]`` pieces end to end along the last axis, in their common dtype."""
  dtypes = {x.dtype for x in parts}
  if len(dtypes) > 1:
    parts = [x.astype(jnp.result_type(*dtypes)) for x in parts]
  return jnp.concatenate(parts, axis=-1)


class FlatLayout:
  """Maps a parameter pytree to a padded, shard-major flat buffer and back.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read).
    num_shards: ``N``, the size of the data axis the buffer is scattered over.

  Attributes:
    num_shards: ``N``.
    shard_size: ``S``, elements per device shard (a row).
    padded_size: ``N * S``, the flat buffer length.
    num_params: the number of real (unpadded) parameters.
  """

  def __init__(self, tree: PyTree, num_shards: int):
    if num_shards < 1:
      raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    leaves, self.treedef = jax.tree.flatten(tree)
    if not leaves:
      raise ValueError("FlatLayout needs a pytree with at least one array leaf")
    self.num_shards = num_shards
    specs, offset = [], 0
    for leaf in leaves:
      shape = tuple(int(d) for d in np.shape(leaf))
      size = math.prod(shape)
      chunk = -(-size // num_shards)
      specs.append(LeafSpec(shape, jnp.dtype(leaf.dtype), size, chunk, offset))
      offset += chunk
    self.specs: tuple[LeafSpec, ...] = tuple(specs)
    self.shard_size = offset
    self.padded_size = offset * num_shards
    self.num_params = sum(s.size for s in specs)

  def __repr__(self):
    return (
      f"FlatLayout(leaves={len(self.specs)}, params={self.num_params}, N={self.num_shards}, "
      f"S={self.shard_size}, padded={self.padded_size})"
    )

  # -- tree (original shapes) <-> rows [n, S] ------------------------------------------------------

  def ravel(self, tree: PyTree, dtype=None) -> jax.Array:
    """Tree of original shapes -> flat buffer ``[N * S]`` (optionally cast to ``dtype``)."""
    return self.shards_to_rows(self.to_shards(tree, dtype)).reshape(-1)

  def unravel(self, flat: jax.Array, dtype=None) -> PyTree:
    """Flat buffer ``[N * S]`` (or rows ``[N, S]``) -> tree of original shapes and dtypes.

    With ``dtype`` given, every leaf comes out in that dtype instead of its own.
    """
    return self.from_shards(
      self.rows_to_shards(flat.reshape(self.num_shards, self.shard_size)), dtype
    )

  # -- tree (original shapes) <-> shards {l: [N, s_l]} ----------------------------------------------

  def to_shards(self, tree: PyTree, dtype=None) -> PyTree:
    """Tree of original shapes -> tree of ``[N, s_l]`` chunks (zero padded)."""
    leaves = self._leaves(tree)
    out = []
    for leaf, spec in zip(leaves, self.specs, strict=True):
      x = jnp.ravel(leaf)
      if dtype is not None:
        x = x.astype(dtype)
      x = jnp.pad(x, (0, spec.chunk * self.num_shards - spec.size))
      out.append(x.reshape(self.num_shards, spec.chunk))
    return self.treedef.unflatten(out)

  def from_shards(self, shards: PyTree, dtype=None) -> PyTree:
    """Tree of ``[N, s_l]`` chunks -> tree of original shapes (padding dropped)."""
    leaves = self._leaves(shards)
    out = []
    for x, spec in zip(leaves, self.specs, strict=True):
      x = x.reshape(-1)[: spec.size].reshape(spec.shape)
      out.append(x.astype(dtype if dtype is not None else spec.dtype))
    return self.treedef.unflatten(out)

  # -- shards {l: [n, s_l]} <-> rows [n, S]; n = N globally or 1 on one device ----------------------

  def shards_to_rows(self, shards: PyTree) -> jax.Array:
    """Tree of ``[n, s_l]`` -> rows ``[n, S]`` (concatenation along the last axis)."""
    return concat_rows(self._leaves(shards))

  def rows_to_shards(self, rows: jax.Array) -> PyTree:
    """Rows ``[n, S]`` -> tree of ``[n, s_l]`` (a split along the last axis)."""
    if rows.shape[-1] != self.shard_size:
      raise ValueError(f"rows have last dim {rows.shape[-1]}, layout expects S={self.shard_size}")
    out = [rows[..., s.offset : s.offset + s.chunk] for s in self.specs]
    return self.treedef.unflatten(out)

  def shard_shapes(self, leading: int | None = None) -> PyTree:
    """``ShapeDtypeStruct`` tree of the shards view (leading dim ``N`` unless given)."""
    n = self.num_shards if leading is None else leading
    return self.treedef.unflatten(
      [jax.ShapeDtypeStruct((n, s.chunk), jnp.float32) for s in self.specs]
    )

  # -- another device count ---------------------------------------------------------------------

  def resized(self, num_shards: int) -> FlatLayout:
    """The same leaves (shapes, dtypes, order) laid out for ``num_shards`` devices."""
    leaves = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in self.specs]
    return FlatLayout(self.treedef.unflatten(leaves), num_shards)

  def _leaves(self, tree: PyTree) -> list:
    return leaves_of(tree, self.treedef)


class TreeLayout(FlatLayout):
  """The flat layout whose optimizer view (``shards``) is the tree of original shapes.

  For a method that does not shard the optimizer (DDP) and an inner optimizer that is not
  elementwise (Muon, Adafactor): on ``[N, s_l]`` chunks it would see other shapes than the
  parameters'. The flat buffer, its rows and its collectives are :class:`FlatLayout`'s.
  """

  def to_shards(self, tree: PyTree, dtype=None) -> PyTree:
    """Tree -> the same tree (optionally cast to ``dtype``)."""
    self._leaves(tree)
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)

  def from_shards(self, shards: PyTree, dtype=None) -> PyTree:
    """The view -> tree of original shapes and dtypes (or ``dtype``)."""
    leaves = self._leaves(shards)
    out = [jnp.asarray(x, dtype or s.dtype) for x, s in zip(leaves, self.specs, strict=True)]
    return self.treedef.unflatten(out)

  def shards_to_rows(self, shards: PyTree) -> jax.Array:
    """The view (a tree of original shapes) -> rows ``[N, S]``."""
    return super().shards_to_rows(super().to_shards(shards))

  def rows_to_shards(self, rows: jax.Array) -> PyTree:
    """Rows ``[N, S]`` -> the view, in the rows' dtype."""
    return super().from_shards(super().rows_to_shards(rows), rows.dtype)

  def resized(self, num_shards: int) -> TreeLayout:
    raise ValueError(
      "a state whose optimizer sees whole parameters (ddp with a non-elementwise "
      "optimizer) cannot move to another device count yet"
    )


# -- converting host arrays between layouts of different N (elastic restore) ----------------------


def _check_same_leaves(src: FlatLayout, dst: FlatLayout) -> None:
  if src.treedef != dst.treedef or [s.shape for s in src.specs] != [s.shape for s in dst.specs]:
    raise ValueError(f"layouts of different parameters: {src} and {dst}")


def reshard_chunks(x, src: FlatLayout, dst: FlatLayout, index: int) -> np.ndarray:
  """Leaf ``index``'s chunks ``[src.N, s_l]`` -> ``[dst.N, s'_l]``, as numpy on the host.

  The unpadded values (the first ``size`` elements of the row-major chunks) are kept bit for bit; the
  padding of ``src`` is dropped and ``dst``'s is zero. The dtype is ``x``'s.
  """
  _check_same_leaves(src, dst)
  a, b = src.specs[index], dst.specs[index]
  x = np.asarray(x)
  if x.shape != (src.num_shards, a.chunk):
    raise ValueError(f"leaf {index} chunks are {x.shape}, expected {(src.num_shards, a.chunk)}")
  out = np.zeros(dst.num_shards * b.chunk, x.dtype)
  out[: a.size] = x.reshape(-1)[: a.size]
  return out.reshape(dst.num_shards, b.chunk)


def reshard_flat(x, src: FlatLayout, dst: FlatLayout) -> np.ndarray:
  """A flat buffer ``[src.N * src.S]`` -> ``[dst.N * dst.S]``, leaf by leaf (see :func:`reshard_chunks`)."""
  _check_same_leaves(src, dst)
  x = np.asarray(x)
  if x.shape != (src.padded_size,):
    raise ValueError(f"flat buffer is {x.shape}, expected {(src.padded_size,)}")
  rows = x.reshape(src.num_shards, src.shard_size)
  out = np.zeros((dst.num_shards, dst.shard_size), x.dtype)
  for i, (a, b) in enumerate(zip(src.specs, dst.specs, strict=True)):
    out[:, b.offset : b.offset + b.chunk] = reshard_chunks(
      rows[:, a.offset : a.offset + a.chunk], src, dst, i
    )
  return out.reshape(-1)
