"""Where a stage's inputs go: the batch over the data axis and the per-device microbatch counts
(mixed into :class:`acco_jax.dp.step.TrainStep`)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P


class Placement:
  """Mixed into :class:`acco_jax.dp.step.TrainStep` (which sets ``num_devices``, ``plan``,
  ``_sharding`` and the ``_compiled`` cache)."""

  def _put_batch(self, batch, per_device: int):
    n = self.num_devices
    for x in jax.tree.leaves(batch):
      if x.ndim < 1 or x.shape[0] % (n * per_device):
        raise ValueError(
          f"batch leading dim {x.shape[0] if x.ndim else 'scalar'} is not divisible by devices x "
          f"microbatches = {n} x {per_device}; use a global batch of {n}*{per_device}*B rows"
        )
    sharding = self._sharding(P(self.plan.axis_name))
    return jax.tree.map(
      lambda x: x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding),
      batch,
    )

  def _put_counts(self, counts, k: int):
    if isinstance(counts, jax.Array):
      return counts
    counts = np.full((self.num_devices,), k, np.int32) if counts is None else np.asarray(counts)
    if counts.shape != (self.num_devices,) or counts.min() < 1 or counts.max() > k:
      raise ValueError(
        f"counts must be {self.num_devices} ints in [1, {k}] (microbatches per device), got {counts}"
      )
    # placed once per distinct value: re-placing host data every stage is a cross-process check
    key = ("counts", k, tuple(int(c) for c in counts))
    if key not in self._compiled:
      counts = counts.astype(np.int32)
      self._compiled[key] = jax.device_put(counts, self._sharding(P(self.plan.axis_name)))
    return self._compiled[key]
