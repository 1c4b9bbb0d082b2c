"""The rows a run writes to ``metrics.jsonl`` while its stage loop runs (:class:`Rows`).

A logged call's device values are kept (:meth:`Rows.queue`) and read once the next call is queued
(:meth:`Rows.write`), so the host never holds the device up at a log line; it waits only for the
call it reads.
"""

from __future__ import annotations

import jax
import numpy as np

from acco_jax import model
from acco_jax.run import metrics as metrics_lib
from acco_jax.run.metrics import readable


class Rows:
  """The log rows being written, what they count and the run's summary.

  Attributes:
    writer: ``metrics.jsonl`` and TensorBoard (process 0 only).
    tokens_seen: tokens trained so far; ``sent``: bytes one worker sent to the others so far.
    pending: the device values of the last logged call's row (None: written).
    outer: ``(stage, device metrics)`` of the outer syncs since the last row.
    summary: the run's summary, filled as rows and evaluations are written.
    evaluated_at: the stage of the last evaluation (None: none yet).
  """

  def __init__(self, run, workdir: str, origin, pace: metrics_lib.Pace, watch):
    self.step, self.pace, self.watch = run.step, pace, watch
    self.writer = metrics_lib.MetricWriter(workdir, enabled=pace.lead)
    for name, fields in origin.events:
      self.writer.event(name, **fields)
    self.tokens_seen = origin.tokens_seen
    self.sent = float(origin.extra.get("wire_bytes", 0.0))
    self.comm_stage = run.step.comm_bytes_per_stage()
    self.flops_token = model.flops_per_token(run.model_cfg)
    peak = metrics_lib.peak_flops(jax.devices()[0])
    self.peak_mesh = peak and peak * run.mesh.size  # None or 0 where the peak is unknown
    self.pending, self.outer = None, []
    self.summary: dict = {}
    self.evaluated_at = None

  def queue(self, stage: int, update: int, m: dict, lr, budgets) -> None:
    """Keeps the device values of this call's row (and of the syncs since the last row): the
    metrics, the learning rate (its state is donated to the next call) and the non-finite flag
    copied by one program, readable on every process (across processes, one meeting a row)."""
    on_device = lr if isinstance(lr, jax.Array) else None
    metrics, lr_copy, flag = self.step.replicated((m, on_device, self.watch.nonfinite))
    self.pending = {
      "stage": stage,
      "update": update,
      "metrics": metrics,
      "nonfinite": flag,
      "lr": lr if on_device is None else lr_copy,
      "tokens_seen": self.tokens_seen,
      "budgets": None if budgets is None else budgets.tolist(),
      "sent": self.sent,
      "outer": [(at, readable(self.step, o)) for at, o in self.outer],
    }
    self.outer = []

  def write(self) -> None:
    """Writes the pending row (the loss checked first: ``train.on_nonfinite``)."""
    p, self.pending = self.pending, None
    if p is None:
      return
    done_at = self.pace.clock.wait(p["stage"], p["tokens_seen"], p["metrics"])
    m, lr, outer = jax.device_get((p["metrics"], p["lr"], p["outer"]))
    loss = float(np.mean(m["loss"]))  # LoCo: per-worker values; the mean over workers
    self.watch.check_finite(p["nonfinite"], p["stage"], self.step)
    row = {
      "stage": p["stage"],
      "update": p["update"],
      "loss": loss,
      "grad_norm": float(np.mean(m["grad_norm"])),
      "lr": float(np.mean(lr)),
      "microbatches": float(np.sum(m["microbatches"])),
      "committed": bool(np.all(m["committed"])),
      "comm_bytes_per_device": self.comm_stage,
      "skipped_microbatches": float(np.sum(m["skipped"])),
      "tokens_seen": p["tokens_seen"],
      "wall_s": done_at - self.pace.t_start,
    }
    rate = self.pace.clock.row_rate(p["stage"])  # since the last row; none for a compile
    if rate is not None:
      row["tokens_per_s"] = rate
      if self.peak_mesh:
        row["mfu"] = rate * self.flops_token / self.peak_mesh
    if p["budgets"] is not None:  # every device's budget this stage
      row["budgets"] = p["budgets"]
    row.update(self.step.log_fields(m, p["sent"]))  # LoCo: per-worker losses, bytes sent
    for at, o in outer:  # the syncs since the last row
      self.writer.write(at, self.step.sync_row(o))
    self.writer.write(p["stage"], row)
    self.pace.progress.update(p["stage"], f"loss {loss:.3f}", self.pace.clock)
    self.summary["loss"] = loss

  def write_syncs(self) -> None:
    """The rows of the syncs since the last row (at the end of the run)."""
    for at, o in jax.device_get([(at, readable(self.step, o)) for at, o in self.outer]):
      self.writer.write(at, self.step.sync_row(o))
    self.outer = []

  def throughput(self, stage: int) -> None:
    """The run's tokens/s from the end of its first call to the end of its last (``stage``), into
    the summary and ``metrics.jsonl``."""
    self.pace.finished(stage, self.tokens_seen)  # the last call may not have been logged
    rate = self.pace.clock.run_rate()
    if rate is not None:
      self.writer.event("throughput", **rate)
      self.summary["tokens_per_s"] = rate["tokens_per_s"]
