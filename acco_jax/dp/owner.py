"""Owners of whole weight matrices: the assignment behind ``comm.layout=owner`` (issue 39).

The elementwise layout (:mod:`acco_jax.dp.flat`) cuts every leaf into ``N`` chunks, so an optimizer
whose update needs a whole matrix (Muon's Newton–Schulz iterations, Adafactor's factored moments)
cannot run on a device's shard. The owner layout gives each such matrix, and its optimizer state, to
one device of the data axis; the other leaves (vectors, embeddings, anything the caller keeps
elementwise) stay in the flat layout. A leaf of ``ndim > 2`` stacks ``prod(shape[:-2])`` matrices
of shape ``shape[-2:]`` (the blocks of a scanned model), each owned on its own.

This module is the pure part: which device owns which matrix, and where the matrix sits in its
owner's *slot*. It imports no sharding and issues no collective.

Assignment (greedy by bytes, the longest-processing-time rule): matrices in decreasing size (ties in
tree order), each to the device owning the fewest bytes so far (ties to the lowest index). When a
matrix is placed its device holds the least, so after every placement

.. math::

  \\max_i \\mathrm{load}_i - \\min_i \\mathrm{load}_i \\le \\max_m \\mathrm{bytes}_m

owners are balanced within one largest matrix.

Slots and wire cost. A device's owned matrices, flattened in tree order, fill its slot; every slot is
padded to ``slot = max_i load_i`` elements, so that the owners' gradients are one ``[N, slot]``
stacking: its ``psum_scatter(tiled)`` over the data axis is the reduction to owners and its
``all_gather`` the broadcast from owners, the same two collectives (and the same overlap) as the
elementwise layout's. A device's row on the wire is ``slot + S_e`` elements (``S_e``: the flat
layout's row over the elementwise leaves) against ``S`` for all leaves elementwise; the difference,
:attr:`OwnerAssignment.padding`, is ``N * slot - Σ_m size_m`` elements, less than ``N`` times the
largest matrix. It is paid on both collectives, so a leaf far larger than the rest (a GPT-2 token
embedding) belongs in the elementwise part.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

PyTree = Any


class Place(NamedTuple):
  """Where one matrix lives: its ``owner`` device and its first element in that device's slot."""

  owner: int
  offset: int


class OwnerAssignment(NamedTuple):
  """Which device owns each whole matrix (see the module docstring).

  Attributes:
    num_devices: ``N``, the size of the data axis.
    places: per leaf in tree order, a :class:`Place` per matrix (``prod(shape[:-2])`` of them,
      row-major over the stacking dims), or ``None`` for a leaf kept elementwise.
    matrix_sizes: per leaf, elements of one matrix (``prod(shape[-2:])``), or 0 if elementwise.
    loads: bytes of the matrices each device owns.
    slot: elements per device of the padded stacking, ``max_i`` (elements device ``i`` owns).
    elementwise_row: ``S_e``, elements per device of the flat layout of the elementwise leaves.
  """

  num_devices: int
  places: tuple[tuple[Place, ...] | None, ...]
  matrix_sizes: tuple[int, ...]
  loads: tuple[int, ...]
  slot: int
  elementwise_row: int

  @property
  def owned_elements(self) -> int:
    """Elements of all owned matrices (unpadded)."""
    return sum(len(p) * m for p, m in zip(self.places, self.matrix_sizes, strict=True) if p)

  @property
  def row(self) -> int:
    """Elements per device on the wire: the owners' slot plus the elementwise row."""
    return self.slot + self.elementwise_row

  @property
  def padding(self) -> int:
    """Elements of the padded stacking that are no matrix's: ``N * slot - owned_elements``."""
    return self.num_devices * self.slot - self.owned_elements


def _default_whole(leaf) -> bool:
  return np.ndim(leaf) >= 2


def assign_owners(tree: PyTree, num_devices: int, whole=None) -> OwnerAssignment:
  """Assigns each whole matrix of ``tree`` to one of ``num_devices`` devices, greedy by bytes.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read).
    num_devices: ``N``, the size of the data axis.
    whole: a pytree of bools shaped like ``tree`` (or a prefix of it), or a function of a leaf:
      which leaves need whole matrices. Default: every leaf with ``ndim >= 2``. A leaf marked whole
      must have ``ndim >= 2``.

  Returns:
    The :class:`OwnerAssignment`.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  leaves, treedef = jax.tree.flatten(tree)
  if whole is None or callable(whole):
    flags = [(whole or _default_whole)(x) for x in leaves]
  else:
    flags = treedef.flatten_up_to(jax.tree.broadcast(whole, tree))
  items, sizes, elementwise_row = [], [], 0
  for i, (leaf, flag) in enumerate(zip(leaves, flags, strict=True)):
    shape = tuple(int(d) for d in np.shape(leaf))
    if not flag:
      sizes.append(0)
      elementwise_row += -(-math.prod(shape) // num_devices)
      continue
    if len(shape) < 2:
      raise ValueError(f"leaf {i} of shape {shape} is marked whole but is not a matrix")
    size, nbytes = math.prod(shape[-2:]), math.prod(shape[-2:]) * np.dtype(leaf.dtype).itemsize
    sizes.append(size)
    items += [(nbytes, i, j) for j in range(math.prod(shape[:-2]))]
  loads, owner = [0] * num_devices, {}
  for nbytes, i, j in sorted(items, key=lambda t: (-t[0], t[1], t[2])):
    device = min(range(num_devices), key=lambda d: (loads[d], d))
    owner[i, j] = device
    loads[device] += nbytes
  fill, places = [0] * num_devices, []
  for i, size in enumerate(sizes):
    if not size:
      places.append(None)
      continue
    leaf_places = []
    for j in range(math.prod(np.shape(leaves[i])[:-2])):
      device = owner[i, j]
      leaf_places.append(Place(device, fill[device]))
      fill[device] += size
    places.append(tuple(leaf_places))
  return OwnerAssignment(
    num_devices, tuple(places), tuple(sizes), tuple(loads), max(fill), elementwise_row
  )
