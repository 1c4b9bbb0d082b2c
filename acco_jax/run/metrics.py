"""Training metrics: communication accounting, MFU, and writers (JSON lines, TensorBoard, terminal).

Only process 0 writes. JSON lines go to ``<workdir>/metrics.jsonl`` (one object per logged stage,
plus ``{"event": ...}`` records), TensorBoard events to ``<workdir>/tb``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax

# Dense bf16 peak FLOP/s per device, for the MFU estimate (vendor datasheets, no sparsity).
PEAK_FLOPS = {
  "H100": 989e12,
  "H200": 989e12,
  "A100": 312e12,
  "L4": 121e12,
  "A10": 125e12,
  "V100": 125e12,
}


def peak_flops(device: jax.Device) -> float | None:
  """Peak bf16 FLOP/s of a device, or None when unknown (CPUs)."""
  kind = getattr(device, "device_kind", "")
  for name, flops in PEAK_FLOPS.items():
    if name in kind:
      return flops
  return None


def comm_bytes_per_stage(plan, padded_size: int, num_devices: int) -> int:
  """Bytes one device sends per stage with ring collectives.

  ZeRO-1 style (reduce-scatter + all-gather of ``P`` values): ``2 (N−1)/N · P · b``; DDP's all-reduce
  moves the same ``2 (N−1)/N · P · b``. ACCO runs one such pair every stage, i.e. twice per update.
  """
  n = num_devices
  itemsize = jax.numpy.dtype(plan.comm_dtype).itemsize
  if n <= 1:
    return 0
  if getattr(plan, "quantize", "none") != "none":
    return quantized_bytes_per_stage(plan, padded_size, n)
  return int(2 * (n - 1) * padded_size * itemsize / n)


def quantized_bytes_per_stage(plan, padded_size: int, num_devices: int) -> int:
  r"""Bytes one device sends per stage with quantized communication (:mod:`acco_jax.dp.quantize`).

  With ``W(m)`` the encoded bytes of ``m`` values (integers and a float32 scale per block), ``S =
  P/N`` the shard size, ``L`` the node size and ``A = N/L`` nodes: the node's reduce-scatter in
  ``comm_dtype`` (``L > 1``) :math:`\frac{L-1}{L} P b`, the all-to-all of the node sums
  :math:`(A-1)\,W(S)` (nothing with one node) and the ring all-gather of the encoded weight updates
  :math:`(N-1)\,W(S)`.
  """
  n, size = num_devices, plan.node_size
  shard, nodes = padded_size // n, n // size
  wire = plan.wire_bytes(shard)
  itemsize = jax.numpy.dtype(plan.comm_dtype).itemsize
  intra = (size - 1) * padded_size * itemsize // size if nodes > 1 else 0
  if nodes == 1:  # the gradients never leave the node: an unquantized reduce-scatter
    intra = (n - 1) * padded_size * itemsize // n
  return int(intra + (nodes - 1) * wire + (n - 1) * wire)


def last_logged(workdir: str) -> dict:
  """What a run's ``metrics.jsonl`` says last: the loss and rate of its last logged stage and its
  last evaluation (``{}`` where the file or the rows are missing). A rerun of a finished run reports
  these instead of training again."""
  found = {}
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        row = json.loads(line)
        if "loss" in row:
          found.update(loss=row["loss"], tokens_per_s=row.get("tokens_per_s"))
        if "eval_loss" in row:
          found.update(eval_loss=row["eval_loss"], eval_ppl=row.get("eval_ppl"))
          found["eval_step"] = row.get("step")
  except (OSError, json.JSONDecodeError):
    pass
  return found


class MetricWriter:
  """Writes scalars to JSON lines and TensorBoard (process 0 only)."""

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self._tb = None
    self._jsonl = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:  # optional: JSON lines still hold everything
        SummaryWriter = None
      if SummaryWriter is not None:
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    clean = {k: _jsonable(v) for k, v in scalars.items()}
    self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
    if self._tb is not None:
      for k, v in clean.items():
        if isinstance(v, int | float) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)

  def event(self, name: str, **fields) -> None:
    if self.enabled:
      self._jsonl.write(
        json.dumps({"event": name, **{k: _jsonable(v) for k, v in fields.items()}}) + "\n"
      )

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def _jsonable(v):
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, bool | int | str | dict | list) or v is None:
    return v
  return float(v)


class Progress:
  """A one-line progress bar with speed and ETA on a terminal; plain log lines otherwise.

  The speed and the ETA are timed from :meth:`mark`, which the trainer calls once the first stage
  of this process has run: that stage compiles, and on a resumed run it can be most of the time so
  far. Until then a line says the stage is not timed rather than print a figure. ``tok/s`` is the
  rate since the previous update (or since the mark); the ETA is the stage rate since the mark.
  """

  def __init__(self, total: int, start: int = 0, *, enabled: bool = True, every_s: float = 10.0):
    self.total, self.done, self.enabled = total, start, enabled
    self.tty = sys.stderr.isatty()
    self.every_s, self._last = every_s, 0.0
    self._origin: tuple[float, int] | None = None  # (time, stage) of the mark
    self._prev: tuple[float, int] | None = None  # (time, tokens) of the mark or the last update

  def mark(self, done: int, tokens: int) -> None:
    """Starts the clock at stage ``done`` with ``tokens`` seen; calls after the first are no-ops."""
    if self._origin is None:
      now = time.time()
      self._origin, self._prev = (now, done), (now, tokens)

  def update(self, done: int, text: str, tokens: int | None = None) -> None:
    """Shows stage ``done`` with ``text`` and, once timed, ``tokens`` seen as a rate and the ETA."""
    if not self.enabled:
      return
    self.done = done
    now = time.time()
    timed = self._origin is not None and done > self._origin[1]
    if timed:
      rate = (done - self._origin[1]) / max(now - self._origin[0], 1e-9)
      eta_s = time.strftime("%H:%M:%S", time.gmtime((self.total - done) / rate))
      speed = ""
      if tokens is not None:
        speed = f" {(tokens - self._prev[1]) / max(now - self._prev[0], 1e-9):,.0f} tok/s"
        self._prev = (now, tokens)
      figures = f"{speed} eta {eta_s}"
    else:
      figures = " (first stage: compiling, not timed)"
    if self.tty:
      width = 24
      filled = int(width * done / max(self.total, 1))
      bar = "#" * filled + "." * (width - filled)
      sys.stderr.write(f"\r[{bar}] {done}/{self.total} {text}{figures}  ")
      sys.stderr.flush()
    elif now - self._last >= self.every_s or done == self.total:
      self._last = now
      print(f"stage {done}/{self.total} {text}{figures}", flush=True)

  def close(self) -> None:
    if self.enabled and self.tty:
      sys.stderr.write("\n")
