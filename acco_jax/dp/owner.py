r"""Owner layout (``layout='owner'``, issue 39): each weight matrix whole on one device.

The elementwise layout (:mod:`acco_jax.dp.flat`) cuts every leaf into ``N`` chunks, so an optimizer
whose update needs a whole matrix (Muon's Newton–Schulz iterations, Adafactor's factored moments)
cannot run on a device's shard. Here every *item*, with its optimizer state, belongs to one device:
a leaf of ``ndim > 2`` is ``prod(shape[:-2])`` matrices of shape ``shape[-2:]`` (the blocks of a
scanned model, each owned on its own), any other leaf is one item (a matrix, a vector). Leaves the
caller marks elementwise (a large embedding under an elementwise part of the optimizer) stay in a
:class:`FlatLayout`.

Every device runs the same program, so every device holds the same *slots*: items are grouped by
shape, and group ``g`` (``m_g`` items of ``e_g`` elements) gives each device ``c_g = ceil(m_g / N)``
slots, zero where no item is (a zero matrix stays zero under Muon, Adam, Adafactor and weight
decay). Assignment, greedy by bytes: groups in decreasing item size; in each, every device takes
``floor(m_g / N)`` items and the ``m_g mod N`` devices owning the fewest bytes one more. Each extra
item goes to a device that held no more than those passed over, so after every group

.. math::

  \max_i \mathrm{load}_i - \min_i \mathrm{load}_i \le \max_g e_g \cdot \mathrm{bytes}

owners are balanced within one largest item.

Views (the same numbers, as :class:`FlatLayout` gives them; ``n = N`` globally or 1 on one device):

.. code-block:: none

  rows   [n, R]   row i = [device i's slots, group by group | elementwise chunk i],  R = slot + S_e
  flat   [N * R]  rows.reshape(-1): what is reduce-scattered / all-gathered (tiled, dim 0)
  shards {"owned": [[n, *item shape] per slot], "elementwise": [[n, s_l] per elementwise leaf]}

So ``psum_scatter(flat, tiled=True)`` is the reduction to owners and ``all_gather`` the broadcast
from them: the elementwise layout's two collectives, with a row of ``R`` elements against its ``S``.
The difference is the empty slots, :attr:`OwnerLayout.padding` (at most ``N - 1`` items per group),
paid on both collectives and in optimizer state. The optimizer runs on ``shards`` vmapped over the
leading dimension (:class:`acco_jax.dp.stage.StageProgram`): a transform sees each slot as the item
(a 2-D matrix, a vector) and each elementwise chunk as a vector. So the result is plain optax's on
the whole tree when the transform is *per leaf* and treats a stacked leaf's leading axes as batch
(Muon with ``MuonDimensionNumbers``; Adafactor factors a 3-D leaf over its two largest axes and is
per leaf only on leaves of ``ndim <= 2``), and per-leaf reductions see elementwise leaves chunk by
chunk. A transform coupling leaves (``optax.clip_by_global_norm``) sees one device's slots only;
:func:`acco_jax.optim.clip_by_global_norm` takes the norm of the whole reduced gradient from the
step (``update(..., global_norm=)``), so it stays global.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax.dp import flat as flat_lib
from acco_jax.dp.flat import FlatLayout

PyTree = Any


class Place(NamedTuple):
  """Where one item lives: its ``owner`` device, its shape ``group`` and its slot in the group."""

  owner: int
  group: int
  slot: int


def _items(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
  """(how many, the shape of each) of a leaf's items: its matrices if ``ndim > 2``, else itself."""
  return (math.prod(shape[:-2]), shape[-2:]) if len(shape) > 2 else (1, shape)


class OwnerLayout:
  """Maps a parameter pytree to owners' slots plus an elementwise remainder, and back.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read).
    num_shards: ``N``, the size of the data axis.
    whole: a pytree of bools shaped like ``tree`` (or a prefix of it), or a function of a leaf:
      which leaves are owned (the others are elementwise). Default: every leaf.

  Attributes:
    num_shards: ``N``.
    groups: the item shapes, largest first.
    slots: ``c_g``, slots per device of each group.
    places: per leaf in tree order, a :class:`Place` per item, or ``None`` if elementwise.
    loads: bytes of the items each device owns.
    slot_size: elements per device of all slots; ``shard_size``: ``R``; ``padded_size``: ``N * R``.
    num_params: the number of real parameters.
  """

  def __init__(self, tree: PyTree, num_shards: int, whole=None):
    if num_shards < 1:
      raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    leaves, self.treedef = jax.tree.flatten(tree)
    if whole is None or callable(whole):
      flags = [bool((whole or (lambda _: True))(x)) for x in leaves]
    else:
      full = jax.tree.map(lambda f, sub: jax.tree.map(lambda _: f, sub), whole, tree)
      flags = [bool(f) for f in self.treedef.flatten_up_to(full)]
    self.num_shards = n = num_shards
    self.shapes = [tuple(int(d) for d in np.shape(x)) for x in leaves]
    self.dtypes = [jnp.dtype(x.dtype) for x in leaves]
    self.num_params = sum(math.prod(s) for s in self.shapes)
    self.whole = flags
    self.elem = [i for i, f in enumerate(flags) if not f]
    self.flat = (
      FlatLayout([jax.ShapeDtypeStruct(self.shapes[i], self.dtypes[i]) for i in self.elem], n)
      if self.elem
      else None
    )
    members: dict[tuple[int, ...], list] = {}  # item shape -> [(leaf, index)], tree order
    for i, shape in enumerate(self.shapes):
      if flags[i]:
        count, item = _items(shape)
        members.setdefault(item, []).extend((i, j) for j in range(count))
    itemsize = {s: max(self.dtypes[i].itemsize for i, _ in m) for s, m in members.items()}
    self.groups = sorted(members, key=lambda s: -math.prod(s) * itemsize[s])
    self.slots, self.loads, where = [], [0] * n, {}
    for g, shape in enumerate(self.groups):
      mats, nbytes = members[shape], math.prod(shape) * itemsize[shape]
      base, extra = divmod(len(mats), n)
      takers = sorted(range(n), key=lambda d: (self.loads[d], d))[:extra]
      owners = [d for d in range(n) for _ in range(base + (d in takers))]
      fill = [0] * n
      for (i, j), d in zip(mats, owners, strict=True):
        where[i, j] = Place(d, g, fill[d])
        fill[d] += 1
        self.loads[d] += nbytes
      self.slots.append(base + (extra > 0))
    self.places = [
      tuple(where[i, j] for j in range(_items(s)[0])) if flags[i] else None
      for i, s in enumerate(self.shapes)
    ]
    self.slot_size = sum(c * math.prod(s) for c, s in zip(self.slots, self.groups, strict=True))
    self.shard_size = self.slot_size + (self.flat.shard_size if self.flat else 0)
    self.padded_size = n * self.shard_size

  def __repr__(self):
    return (
      f"OwnerLayout(leaves={len(self.shapes)}, groups={len(self.groups)}, N={self.num_shards}, "
      f"slot={self.slot_size}, R={self.shard_size}, padding={self.padding})"
    )

  @property
  def owned_elements(self) -> int:
    """Elements of all owned items (unpadded)."""
    return sum(math.prod(s) for s, f in zip(self.shapes, self.whole, strict=True) if f)

  @property
  def padding(self) -> int:
    """Elements of the slots that hold no item: ``N * slot_size - owned_elements``."""
    return self.num_shards * self.slot_size - self.owned_elements

  def holders(self) -> list[set[int]]:
    """Per shards leaf (slot or elementwise chunk, in the view's leaf order): the parameter
    leaves it holds items of."""
    held = [set() for _ in range(sum(self.slots))]
    first = np.cumsum([0, *self.slots])
    for i, places in enumerate(self.places):
      for p in places or ():
        held[int(first[p.group]) + p.slot].add(i)
    view = {"owned": held, "elementwise": [{i} for i in self.elem]}  # as shard_shapes() flattens
    return jax.tree.leaves(view, is_leaf=lambda x: isinstance(x, set))

  def view(self, tree: PyTree) -> dict:
    """Per-leaf values (a tree like the params, e.g. a mask) -> the same values in the structure
    the optimizer sees on each device: ``{"owned": [one per slot], "elementwise": [one per
    elementwise leaf]}``, for masks and labels of a transform run on :meth:`to_shards`' view.

    Raises ``ValueError`` when one slot holds items whose values differ (its devices would need
    different transforms).
    """
    leaves = self._leaves(tree)
    first, owned = np.cumsum([0, *self.slots]), {}
    for i, places in enumerate(self.places):
      for p in places or ():
        k = int(first[p.group]) + p.slot
        if owned.setdefault(k, leaves[i]) != leaves[i]:
          raise ValueError(
            f"slot {p.slot} of the {self.groups[p.group]} items holds leaves whose values differ "
            f"({owned[k]!r}, {leaves[i]!r}): own only leaves that share them"
          )
    return {
      "owned": [owned[k] for k in range(int(first[-1]))],
      "elementwise": [leaves[i] for i in self.elem],
    }

  def shard_shapes(self, leading: int | None = None) -> dict:
    """``ShapeDtypeStruct`` tree of the shards view (leading dim ``N`` unless given)."""
    n = self.num_shards if leading is None else leading
    owned = [
      jax.ShapeDtypeStruct((n, *shape), jnp.float32)
      for shape, c in zip(self.groups, self.slots, strict=True)
      for _ in range(c)
    ]
    elem = jax.tree.leaves(self.flat.shard_shapes(n)) if self.flat else []
    return {"owned": owned, "elementwise": elem}

  # -- tree (original shapes) <-> shards -----------------------------------------------------------

  def to_shards(self, tree: PyTree, dtype=None) -> dict:
    """Tree of original shapes -> ``{"owned": [[N, a, b]...], "elementwise": [[N, s_l]...]}``."""
    leaves = self._leaves(tree)
    cast = (lambda x: x.astype(dtype)) if dtype is not None else (lambda x: x)
    table = {}  # (group, slot, device) -> matrix
    for i, places in enumerate(self.places):
      if places is not None:
        mats = cast(jnp.reshape(leaves[i], (-1, *_items(self.shapes[i])[1])))
        for j, p in enumerate(places):
          table[p.group, p.slot, p.owner] = mats[j]
    owned = []
    for g, (shape, c) in enumerate(zip(self.groups, self.slots, strict=True)):
      like = next(v for (h, _, _), v in table.items() if h == g)
      for k in range(c):
        rows = [table.get((g, k, d), jnp.zeros(shape, like.dtype)) for d in range(self.num_shards)]
        owned.append(jnp.stack(rows))
    elem = self.flat.to_shards([leaves[i] for i in self.elem], dtype) if self.flat else []
    return {"owned": owned, "elementwise": elem}

  def from_shards(self, shards: dict, dtype=None) -> PyTree:
    """Shards -> tree of original shapes (empty slots and padding dropped)."""
    out = [None] * len(self.shapes)
    if self.flat:
      for i, x in zip(self.elem, self.flat.from_shards(shards["elementwise"], dtype), strict=True):
        out[i] = x
    first = np.cumsum([0, *self.slots])
    for i, places in enumerate(self.places):
      if places is not None:
        mats = [shards["owned"][first[p.group] + p.slot][p.owner] for p in places]
        x = jnp.stack(mats).reshape(self.shapes[i])
        out[i] = x.astype(dtype if dtype is not None else self.dtypes[i])
    return self.treedef.unflatten(out)

  # -- shards <-> rows [n, R]; n = N globally or 1 on one device -----------------------------------

  def shards_to_rows(self, shards: dict) -> jax.Array:
    """Shards with leading ``n`` (and any dims before it) -> rows ``[..., n, R]``: the slots, then
    the elementwise chunks."""
    shapes = [shape for shape, c in zip(self.groups, self.slots, strict=True) for _ in range(c)]
    parts = [
      x.reshape(*x.shape[: x.ndim - len(shape)], -1)
      for x, shape in zip(shards["owned"], shapes, strict=True)
    ]
    if self.flat:
      parts.append(self.flat.shards_to_rows(shards["elementwise"]))
    return flat_lib.concat_rows(parts)

  def rows_to_shards(self, rows: jax.Array) -> dict:
    """Rows ``[n, R]`` -> shards with leading ``n``."""
    if rows.shape[-1] != self.shard_size:
      raise ValueError(f"rows have last dim {rows.shape[-1]}, layout expects R={self.shard_size}")
    owned, start = [], 0
    for shape, c in zip(self.groups, self.slots, strict=True):
      size = math.prod(shape)
      for _ in range(c):
        owned.append(rows[..., start : start + size].reshape(*rows.shape[:-1], *shape))
        start += size
    elem = self.flat.rows_to_shards(rows[..., start:]) if self.flat else []
    return {"owned": owned, "elementwise": elem}

  def ravel(self, tree: PyTree, dtype=None) -> jax.Array:
    """Tree of original shapes -> flat buffer ``[N * R]`` (optionally cast to ``dtype``)."""
    return self.shards_to_rows(self.to_shards(tree, dtype)).reshape(-1)

  def unravel(self, flat: jax.Array, dtype=None) -> PyTree:
    """Flat buffer ``[N * R]`` (or rows ``[N, R]``) -> tree of original shapes."""
    rows = flat.reshape(self.num_shards, self.shard_size)
    return self.from_shards(self.rows_to_shards(rows), dtype)

  def _leaves(self, tree: PyTree) -> list:
    return flat_lib.leaves_of(tree, self.treedef)
