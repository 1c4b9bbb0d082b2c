"""A checkpoint's leaves packed into a few arrays: orbax writes one array per group, not per leaf.

Orbax's cost grows with the number of arrays it writes (a TensorStore array each, a write per
shard, a few milliseconds of host time per leaf), not with their bytes: a train state of a few
hundred small leaves over 8 devices took 0.8 s of host time to save, the same bytes as one array
0.08 s. So leaves are packed before orbax sees them.

A leaf whose ``D`` device blocks (over the mesh axes ``A``, replicated over the others; ``D = 1``
for a replicated leaf or a scalar) are the rows of ``x.reshape(D, -1)`` in order (:func:`row_axes`)
is viewed so: row ``d`` is device block ``d`` flattened, and laying such views side by side along
the second dimension moves nothing between devices. The leaves of one dtype, mesh and ``A``
form a group, stored as one ``(D, width)`` array sharded over ``A`` (a new group starts where a row
would pass :data:`MAX_ROW_BYTES`, which bounds the device memory a save borrows). Each packed leaf
records its group's key and its columns; a leaf partitioned on another dimension (or not over a
named mesh) is stored alone, as before packing, and so is a leaf that would be its group's only
member (a row of its own, or one larger than the cap: packing it would only copy it).

Unpacking is the inverse. When the target is partitioned as the leaves were saved, the group is
read onto the devices as saved and each device's leaf blocks are cut from its own row on the host
and put back on that device (nothing to compile: :func:`unpack`); else the whole group is read into
host memory, cut there and placed with the target's shardings.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# per device: the most a save copies to pack a group (a larger leaf is alone)
MAX_ROW_BYTES = 256 << 20


class Group(NamedTuple):
  """Leaves stored as one ``(rows, width)`` array: ``members[i] = (leaf index, column, columns)``."""

  key: str
  rows: int
  width: int
  dtype: Any
  sharding: NamedSharding  # where the packed array lives: over A, like its leaves' rows
  members: tuple[tuple[int, int, int], ...]


def row_axes(x) -> tuple[Any, tuple[str, ...], int] | None:
  """``(mesh, A, D)`` when the device blocks of ``x`` are the ``D`` rows of ``x.reshape(D, -1)`` in
  order (over the mesh axes ``A``, replicated over the others), else ``None`` (such a leaf is stored
  alone). So it is when ``x`` is partitioned on its leading dimensions only, every one but the last
  of them one element per block: ``P('data')`` on ``(N k, ...)``, ``P('replica', 'data')`` on
  ``(M, D, ...)``, a replicated leaf or a scalar (``D = 1``)."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding) or isinstance(
    sharding.mesh, jax.sharding.AbstractMesh
  ):
    return None
  spec = [
    () if s is None else (s,) if isinstance(s, str) else tuple(s)
    for s in (*sharding.spec, *(None,) * (len(x.shape) - len(sharding.spec)))
  ]
  last = max((i for i, s in enumerate(spec) if s), default=-1)
  blocks = [int(np.prod([sharding.mesh.shape[a] for a in s], dtype=np.int64)) for s in spec]
  if any(x.shape[i] != blocks[i] for i in range(last)) or (
    last >= 0 and x.shape[last] % blocks[last]
  ):
    return None
  axes = tuple(a for s in spec[: last + 1] for a in s)
  return sharding.mesh, axes, int(np.prod(blocks[: last + 1], dtype=np.int64))


def plan(leaves: list) -> tuple[list[Group], list[int]]:
  """The groups ``leaves`` pack into, and the indices of the leaves stored alone."""
  filling: dict[tuple, list] = {}  # (dtype, mesh, A, D) -> members of the group being filled
  full, alone = [], []
  for i, x in enumerate(leaves):
    where = row_axes(x)
    if where is None:
      alone.append(i)
      continue
    sig = (jnp.dtype(x.dtype), *where)
    columns = int(np.prod(x.shape, dtype=np.int64)) // where[2]
    members = filling.setdefault(sig, [])
    width = sum(n for _, _, n in members)
    if members and (width + columns) * sig[0].itemsize > MAX_ROW_BYTES:
      full.append((sig, members))
      filling[sig] = members = []
      width = 0
    members.append((i, width, columns))
  groups = []
  for (dtype, mesh, axes, rows), members in [*full, *filling.items()]:
    if len(members) == 1:  # packing one leaf would only copy it (a large one whole)
      alone.append(members[0][0])
      continue
    n = len(groups)
    sharding = NamedSharding(mesh, PartitionSpec(axes or None))
    width = sum(c for _, _, c in members)
    groups.append(Group(f"pack{n:03d}_{dtype.name}", rows, width, dtype, sharding, tuple(members)))
  return groups, sorted(alone)


@functools.cache
def _packer(rows: int, sharding: NamedSharding):
  """One jitted packing per group signature (a save's groups repeat at every save)."""
  return jax.jit(
    lambda xs: jnp.concatenate([x.reshape(rows, -1) for x in xs], axis=1), out_shardings=sharding
  )


def pack(group: Group, leaves: list) -> jax.Array:
  """``group``'s ``(rows, width)`` array: its leaves side by side, each as ``reshape(rows, -1)``."""
  return _packer(group.rows, group.sharding)([leaves[i] for i, _, _ in group.members])


def unpack(packed: jax.Array, slots: list[tuple[int, int, tuple]], shardings: list) -> list:
  """The leaves of a packed array, placed with ``shardings`` (partitioned as the leaves were
  saved: :func:`target_sharding`): ``slots[i] = (column, columns, shape)``. Each device's leaf
  blocks are cut from its own row on the host, as slicing on the devices would compile a program
  with an output per leaf (seconds for a few hundred) at every restore of a new state."""
  row = {s.device: np.asarray(s.data).reshape(-1) for s in packed.addressable_shards}
  out = []
  for (a, n, shape), sharding in zip(slots, shardings, strict=True):
    block = sharding.shard_shape(tuple(shape))
    devices = list(sharding.addressable_devices)
    pieces = jax.device_put([row[d][a : a + n].reshape(block) for d in devices], devices)
    out.append(jax.make_array_from_single_device_arrays(tuple(shape), sharding, pieces))
  return out


def unpack_host(packed: np.ndarray, slots: list[tuple[int, int, tuple]]) -> list[np.ndarray]:
  """:func:`unpack` of a packed array read whole into host memory."""
  return [np.asarray(packed[:, a : a + n]).reshape(shape) for a, n, shape in slots]


def target_sharding(targets: list, rows: int):
  """Where a group saved with ``rows`` rows is read to unpack on the devices into ``targets``
  (their shardings), or ``None`` when they are not all partitioned like one such group (the
  group is then read to the host and unpacked there)."""
  found = {row_axes(x) for x in targets}
  if len(found) != 1 or None in found:
    return None
  ((mesh, axes, d),) = found
  return NamedSharding(mesh, PartitionSpec(axes or None)) if d == rows else None


def _host(shape, dtype) -> np.ndarray:
  """A restore placeholder asking orbax for a host (numpy) array."""
  return np.broadcast_to(np.zeros((), dtype), tuple(shape))


def _by_group(entries: list[dict]) -> dict[str, list[int]]:
  groups: dict[str, list[int]] = {}
  for i, e in enumerate(entries):
    if "pack" in e:
      groups.setdefault(e["pack"][0], []).append(i)
  return groups


def items_to_read(entries: list[dict], targets: list | None = None) -> dict:
  """Orbax's restore placeholders for the leaves of ``entries`` (a checkpoint's metadata: ``key``,
  ``shape``, ``dtype`` and, for a packed leaf, ``pack = [group key, column, columns, rows,
  width]``): the leaves stored alone and the groups holding the others. With
  ``targets`` (arrays or sharded structs, one per entry) device arrays where a group can be unpacked
  on the devices; without, host arrays."""
  items = {}
  for e, x in zip(entries, targets or [None] * len(entries), strict=True):
    if "pack" not in e:
      items[e["key"]] = (
        _host(e["shape"], e["dtype"])
        if x is None
        else jax.ShapeDtypeStruct(e["shape"], e["dtype"], sharding=x.sharding)
      )
  for key, members in _by_group(entries).items():
    first = entries[members[0]]
    shape, dtype = tuple(first["pack"][3:5]), first["dtype"]
    where = None if targets is None else target_sharding([targets[i] for i in members], shape[0])
    items[key] = (
      _host(shape, dtype) if where is None else jax.ShapeDtypeStruct(shape, dtype, sharding=where)
    )
  return items


def assemble(arrays: dict, entries: list[dict], targets: list | None = None) -> list:
  """The leaves of ``entries`` from orbax's restore of :func:`items_to_read`'s placeholders: numpy
  arrays without ``targets``, else arrays placed with the targets' shardings."""
  out = [None if "pack" in e else arrays[e["key"]] for e in entries]
  for key, members in _by_group(entries).items():
    slots = [(entries[i]["pack"][1], entries[i]["pack"][2], entries[i]["shape"]) for i in members]
    packed = arrays[key]
    if isinstance(packed, jax.Array):
      got = unpack(packed, slots, [targets[i].sharding for i in members])
    else:
      got = unpack_host(np.asarray(packed), slots)
      if targets is not None:
        got = [place(a, targets[i].sharding) for a, i in zip(got, members, strict=True)]
    for i, a in zip(members, got, strict=True):
      out[i] = a
  return out


def place(a: np.ndarray, sharding) -> jax.Array:
  """A host array placed on the devices with ``sharding``."""
  return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])
