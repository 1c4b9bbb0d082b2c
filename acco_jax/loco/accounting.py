"""What a sync of a low-communication method costs, and the log fields of its outer steps.

Host-side arithmetic, no programs. :class:`SyncAccounting` is a base class of
:class:`acco_jax.loco.step.LocoStep`; its methods read the step's ``method``, ``codec``, ``layout``,
``shard_shapes``, ``parts``, ``num_workers``, ``num_devices``, ``inner`` and ``transport``. Bytes are per worker,
summed over its devices, as the collective of the method's aggregator moves them
(:mod:`acco_jax.loco.replica`; through a store, :mod:`acco_jax.loco.transport`): a *payload* is
what one worker hands to it, the *wire* bytes what a ring sends for it (a store: one upload).
"""

from __future__ import annotations

import math

import numpy as np


class SyncAccounting:
  """The accounting methods of :class:`acco_jax.loco.step.LocoStep`."""

  def fragment_sizes(self) -> list[int]:
    """Values per fragment (the padded shard layout, all ``D`` shards of one worker)."""
    sizes = [math.prod(shape) * self.layout.num_shards for shape in self.shard_shapes]
    return [sum(sizes[i] for i in idx) for idx in self.parts]

  def payload_bytes(self, fragment: int) -> float:
    """Bytes of one worker's payload for a sync of ``fragment``, summed over its devices: values
    as quantised with their scales (all-reduce), the packed indices, values, shifts and tables
    (sparse), ``Δ`` and ``φ`` in float32 (pairs)."""
    size = self.fragment_sizes()[fragment]
    if self.method.aggregate == "sparse":
      return float(self.codec.row_bytes * self.layout.num_shards)
    if self.method.aggregate == "pairs":
      return 2 * 4.0 * size
    return float(self.method.compressor.payload_bytes(size))

  def wire_bytes(self, fragment: int) -> float:
    """Bytes one worker sends to sync ``fragment``, summed over its devices: a ring all-reduce
    sends ``2 (M−1)/M`` payloads, a ring all-gather ``M − 1``, a pair exchange one; a worker
    meeting the others through a store uploads its payload once (and downloads the members')."""
    if self.transport is not None:
      return self.payload_bytes(fragment)
    m = self.num_workers
    if m == 1:
      return 0.0
    fan = {"mean": 2 * (m - 1) / m, "sparse": m - 1, "pairs": 1}[self.method.aggregate]
    return fan * self.payload_bytes(fragment)

  def density(self) -> float:
    """Share of the payload's values a sync sends (1 for dense methods)."""
    return self.codec.density if self.codec is not None else 1.0

  def peak_sync_bytes(self) -> float:
    """The largest :meth:`wire_bytes` of one sync (the fragment with the embeddings and head)."""
    return max(self.wire_bytes(p) for p in range(len(self.parts)))

  def describe(self) -> str:
    """One line: workers, the schedule and what a sync costs."""
    m = self.method
    per_step = sum(self.wire_bytes(p) for p in range(len(self.parts))) / m.sync_every
    if m.sparse is not None:
      s = m.sparse
      slots = (
        f"k={s.topk} per {s.chunk}x{s.chunk} ({s.transform}), bits={s.bits}, decay={s.decay}, "
        f"{s.aggregate}, density={self.density():.4f}"
      )
    elif m.pairing is not None:
      slots = f"pairs from {m.pairing.count} matchings (seed {m.pairing.seed})"
    else:
      slots = (
        f"fragments={m.fragments} ({m.layout}), overlap={m.overlap_steps}, alpha={m.alpha}, "
        f"quantize={m.compressor.name}"
      )
    t = self.transport
    who = (
      f"workers={self.num_workers}" if t is None else f"worker {t.worker} of {t.workers} (store)"
    )
    return (
      f"{m.name}: {who} x {self.num_devices} devices, inner="
      f"{self.inner.plan.name}, H={m.sync_every}, {slots}; bytes/worker: peak sync "
      f"{self.peak_sync_bytes():,.0f}, per inner step {per_step:,.0f}"
    )

  def summary(self, sent: float) -> dict:
    """A run's communication figures for its summary (``sent``: the bytes a worker sent)."""
    return dict(
      wire_bytes_per_worker=sent,
      peak_sync_bytes=self.peak_sync_bytes(),
      payload_bytes_per_sync=self.payload_bytes(0),
      sent_density=self.density(),
    )

  def outer_row(self, metrics: dict) -> dict:
    """The outer-step fields of a call's (host) metrics, for a log line: per-worker values as their
    mean over workers, the bytes the sync sent per worker and the share of values it sent."""
    keys = ("outer_fragment", "outer_delta_norm", "outer_step_norm", "outer_pairing")
    keys += ("outer_round", "outer_members", "outer_caught_up")  # a store's round
    row = {k: np.mean(np.asarray(metrics[k])).item() for k in keys if k in metrics}
    if "outer_fragment" in row:
      row["outer_fragment"] = p = int(row["outer_fragment"])
      row.update(sync_bytes_per_worker=self.wire_bytes(p), sent_density=self.density())
    for k in ("outer_pairing", "outer_round", "outer_members", "outer_caught_up"):
      if k in row:
        row[k] = int(row[k])
    return row
