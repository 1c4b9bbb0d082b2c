"""Collectives over the worker (``replica``) axis: the one module that moves data between workers.

The low-communication methods (:mod:`acco_jax.loco`) are pure; :mod:`acco_jax.loco_step` runs them
and calls the aggregators here, each a ``shard_map`` over the ``('replica', 'data')`` mesh. Inputs
are per-worker trees whose leaves carry a leading worker dimension ``M`` sharded over ``replica``;
the second dimension is the data axis's ``D`` shards (sharded over ``data`` for a ZeRO-1 inner step,
replicated for DDP). Each device exchanges only its own block with the devices of the same data rank
in the other workers, so a ZeRO-1 worker's traffic is spread over its ``D`` devices.
"""

from __future__ import annotations

from typing import Any

import jax
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

  def _smap(self, local, tree):
    specs = jax.tree.map(lambda _: self.spec, tree)
    return jax.shard_map(local, mesh=self.mesh, in_specs=(specs,), out_specs=specs)(tree)

  def mean(self, tree: PyTree) -> PyTree:
    """All-reduce mean over the workers (each worker receives the same mean)."""
    return self._smap(lambda t: jax.tree.map(lambda x: lax.pmean(x, self.axis), t), tree)
