"""Collectives over the worker (``replica``) axis: the one module that moves data between workers.

The low-communication methods (:mod:`acco_jax.loco`) are pure; :mod:`acco_jax.loco.step` runs them
and its programs (:mod:`acco_jax.loco.programs`) call the aggregators here, each a ``shard_map``
over the ``('replica', 'data')`` mesh. Inputs are per-worker trees whose leaves carry a leading
worker dimension ``M`` sharded over ``replica``; the second dimension is the data axis's ``D``
shards (sharded over ``data`` for a ZeRO-1 inner step, replicated for DDP). Each device exchanges
only its own block with the devices of the same data rank in the other workers, so a ZeRO-1
worker's traffic is spread over its ``D`` devices.

============  ==========================================  ====================================
aggregator    collective over ``replica``                 methods
============  ==========================================  ====================================
``mean``      all-reduce (``pmean``)                      DiLoCo, Streaming DiLoCo
``gather``    all-gather of packed bytes, then a local    SparseLoCo, DeMo
              decode (scatter-mean)
``partner``   collective-permute (``ppermute``) of one    NoLoCo
              of ``K`` static matchings, chosen by
              ``lax.switch``
============  ==========================================  ====================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

PyTree = Any

REPLICA = "replica"


class ReplicaCollectives:
  """Aggregators over the workers of a ``(replica, data)`` mesh.

  Args:
    mesh: the 2-D mesh.
    data_axis: the name of the data axis (``'data'``).
    sharded: whether the per-worker leaves are sharded over the data axis (ZeRO-1) or replicated.
    replica_axis: the worker axis.
  """

  def __init__(self, mesh, data_axis: str, sharded: bool, replica_axis: str = REPLICA):
    self.mesh, self.axis, self.data_axis = mesh, replica_axis, data_axis
    self.spec = P(replica_axis, data_axis) if sharded else P(replica_axis)

  def _specs(self, tree):
    return jax.tree.map(lambda _: self.spec, tree)

  def _smap(self, local, tree):
    specs = self._specs(tree)
    return jax.shard_map(local, mesh=self.mesh, in_specs=(specs,), out_specs=specs)(tree)

  def mean(self, tree: PyTree) -> PyTree:
    """All-reduce mean over the workers (each worker receives the same mean)."""
    return self._smap(lambda t: jax.tree.map(lambda x: lax.pmean(x, self.axis), t), tree)

  def gather(self, encode: Callable, decode: Callable, trees: tuple, scalars: tuple = ()):
    """Encode on each device, all-gather the bytes over the workers, decode on each device.

    Per device, on its own blocks (leading dims ``[1, d]``): ``wire, kept = encode(*trees,
    *scalars)`` with ``wire`` a ``uint8 [1, d, n]`` array; then ``everyone`` = the ``M`` workers'
    wires stacked, ``[M, 1, d, n]`` (one all-gather of ``n`` bytes per device), and ``decode(everyone)``.
    Nothing else crosses workers.

    Args:
      encode: per-device ``(*trees, *scalars) -> (wire, kept)``; ``kept`` has the structure of
        ``trees[-1]`` (the senders' new local state).
      decode: per-device ``everyone -> tree`` shaped like ``trees[0]``.
      trees: per-worker trees (leaves ``[M, D, ...]``).
      scalars: replicated values (a step index).

    Returns:
      ``(kept, decoded)``, both per worker.
    """

    def local(trees, scalars):
      wire, kept = encode(*trees, *scalars)
      everyone = lax.all_gather(wire, self.axis, axis=0, tiled=False)
      return kept, decode(everyone)

    specs = tuple(self._specs(t) for t in trees)
    out = (specs[-1], specs[0])
    in_specs = (specs, tuple(P() for _ in scalars))
    return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=out)(trees, scalars)

  def partner(self, tree: PyTree, matchings: np.ndarray, which: jax.Array) -> PyTree:
    """Each worker receives its peer's ``tree`` under matching ``which`` (one collective-permute).

    Args:
      tree: per-worker tree.
      matchings: ``[K, M]`` int, ``matchings[k, i]`` = worker ``i``'s peer in matching ``k`` (a
        perfect matching: each ``matchings[k]`` is an involution without fixed points). Static: each
        becomes one ``ppermute`` branch of a ``lax.switch``.
      which: replicated int32 in ``[0, K)``, the same on every worker.
    """
    perms = [tuple((int(i), int(j)) for i, j in enumerate(row)) for row in np.asarray(matchings)]

    def local(t, which):
      branches = [
        lambda t, perm=perm: jax.tree.map(lambda x: lax.ppermute(x, self.axis, perm), t)
        for perm in perms
      ]
      return lax.switch(which, branches, t) if len(branches) > 1 else branches[0](t)

    specs = self._specs(tree)
    return jax.shard_map(local, mesh=self.mesh, in_specs=(specs, P()), out_specs=specs)(tree, which)


def mesh_mismatch(saved, mesh) -> str:
  """The one-line error for a checkpoint written on another ``workers x devices`` mesh."""
  m, d = saved.inner.w.shape[0], jax.tree.leaves(saved.inner.params)[0].shape[1]
  return (
    f"the checkpoint was written by {m} workers x {d} devices; this run has "
    f"{mesh.shape[REPLICA]} x {mesh.shape['data']}: resume with loco.workers={m} on {m * d} devices "
    "(workers hold their own parameters, so a LoCo run does not move to another mesh)"
  )
