"""The quantized collectives of a stage (``comm.quantize``), called per device inside a shard_map.

:mod:`acco_jax.dp.quantize` holds the pure number formats; this module moves them: the gradients'
quantized reduce-scatter (an all-to-all of encoded rows, summed in float32 by the receiver) and the
all-gather of the encoded updates of the compute weights. :class:`acco_jax.dp.stage.StageProgram` decides
where they run (ACCO: in flight across loop A and loop B, exactly where the bf16 collectives run).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from acco_jax.dp import quantize as quantize_lib


def all_gather_invariant(x, axis_name):
  """Tiled all-gather along axis 0 whose result is the same on every device."""
  return lax.all_gather(x, axis_name, axis=0, tiled=True, to="invarying")


class QuantizedComm:
  """A plan's quantized collectives for a mesh axis of ``num_devices`` and shards of ``shard_size``.

  Attributes:
    quantized: whether anything is quantized (``plan.quantize`` is not ``none``).
    reduce: whether the gradients' reduction is quantized (more than one node).
  """

  def __init__(self, plan, num_devices: int, shard_size: int, replica_axis=None):
    self.plan, self.num_devices, self.shard_size = plan, num_devices, shard_size
    self.quantized = plan.quantize != "none"
    self.reduce = quantize_lib.check_plan(plan, num_devices, shard_size, replica_axis)
    self._nodes, self._rails = quantize_lib.node_groups(num_devices, plan.node_size)

  def exchange(self, flat_P):
    """The quantized reduce-scatter of a device's flat buffer ``[N*S]``: the encoded rows of its
    shard it received and, with error feedback, what its send did not deliver ``[N*S]`` (float32,
    exact), else ``None``.

    Chunk ``c`` of the flat buffer belongs to device ``c``. The ``L = node_size`` devices of a node
    first reduce-scatter in the buffer's dtype so that rank ``l`` holds the node's sums of the
    chunks ``{a L + l}``; these rows are quantized and exchanged by one all-to-all among the
    rank-``l`` devices of all nodes (all devices when ``L = 1``).
    """
    plan, axis, s = self.plan, self.plan.axis_name, self.shard_size
    x, size = flat_P, plan.node_size
    if size > 1:
      x = lax.psum_scatter(
        quantize_lib.rank_major(x, size, s), axis, tiled=True, axis_index_groups=self._nodes
      )
    x = x.reshape(-1, s).astype(jnp.float32)
    wire, sent = quantize_lib.encode(x, plan.quantize, plan.block)
    got = lax.all_to_all(wire, axis, 0, 0, tiled=True, axis_index_groups=self._rails)
    if not plan.error_feedback:
      return got, None
    rank = lax.axis_index(axis) % size  # the rest of the buffer was delivered within the node
    return got, quantize_lib.rank_column(x - sent, rank, size)

  def mean_of(self, got, total):
    """The mean gradient ``[S]`` from the encoded rows received: dequantized, summed in float32."""
    plan = self.plan
    return quantize_lib.decode(got, plan.quantize, plan.block, self.shard_size).sum(0) / total

  def gather(self, w_P, rows_S, old_S=None):
    """New compute weights ``[N*S]`` (invariant, in ``w_P``'s dtype) from a device's new shard:
    :meth:`encode_update`, then :meth:`apply_update`."""
    return self.apply_update(w_P, self.encode_update(w_P, rows_S, old_S))

  def encode_update(self, w_P, rows_S, old_S=None):
    """The wire row of a device's weight update. Each device sends its shard's update ``θ' - w``
    (with error feedback: against the weights every device holds, so the error of each send is
    part of the next); without error feedback (``old_S`` given) the update is ``θ' - θ``."""
    plan, s = self.plan, self.shard_size
    if old_S is None:
      old_S = lax.dynamic_slice_in_dim(w_P, lax.axis_index(plan.axis_name) * s, s)
    return quantize_lib.encode(rows_S - old_S.astype(jnp.float32), plan.quantize, plan.block)[0]

  def apply_update(self, w_P, wire):
    """All-gathers the devices' wire rows and adds the dequantized updates to ``w_P``."""
    plan, s = self.plan, self.shard_size
    got = all_gather_invariant(wire, plan.axis_name).reshape(self.num_devices, -1)
    update = quantize_lib.decode(got, plan.quantize, plan.block, s).reshape(-1)
    return (w_P.astype(jnp.float32) + update).astype(w_P.dtype)
