"""Training metrics: communication accounting, MFU, and writers (JSON lines, TensorBoard, terminal).

Only process 0 writes. JSON lines go to ``<workdir>/metrics.jsonl`` (one object per logged stage,
plus ``{"event": ...}`` records), TensorBoard events to ``<workdir>/tb``.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time

import jax

from acco_jax.run import profile

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


def last_logged(workdir: str) -> dict:
  """What a run's ``metrics.jsonl`` says last: the loss of its last logged stage, its last
  throughput record (the run's rate) and its last evaluation (``{}`` where the file or the rows are missing). A rerun of a finished run reports
  these instead of training again."""
  found = {}
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        row = json.loads(line)
        if "loss" in row:
          found["loss"] = row["loss"]
        if row.get("event") == "throughput":  # the run's rate, first stage to last
          found["tokens_per_s"] = row["tokens_per_s"]
        if "eval_loss" in row:
          found.update(eval_loss=row["eval_loss"], eval_ppl=row.get("eval_ppl"))
          found["eval_step"] = row.get("step")
  except (OSError, json.JSONDecodeError):
    pass
  return found


def _summary_writer_class():
  """tensorboardX's ``SummaryWriter``, or ``None`` without tensorboardX (JSON lines still hold
  everything).

  tensorboardX imports torch when it is installed, only to accept torch tensors: 1.8 s of every
  launch on a 2-core machine, for a writer that is given Python floats. Unless this process has
  imported torch already, tensorboardX is imported as if torch were absent (``None`` in
  ``sys.modules`` makes ``import torch`` raise ImportError, which tensorboardX expects), and torch
  stays importable afterwards.
  """
  hide_torch = "torch" not in sys.modules
  if hide_torch:
    sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    return None
  finally:
    if hide_torch and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter


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
      SummaryWriter = _summary_writer_class()
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


class StageClock:
  """When each stage finished, as the host saw it, and the rates the run reports.

  The trainer keeps one stage in flight and then waits for the one before it (:meth:`done` is
  called when that wait returns): the host is waiting on the device, so the time is the stage's
  completion, not the moment a log line happens to be written. Rates between two completions count
  the device's work and every host stall between them (a checkpoint write, an evaluation). The
  first stage of a process compiles its programs: rates start at its completion.

  Args:
    window: stages the progress line's rate covers (the last ``window`` completed stages).
  """

  def __init__(self, window: int = 10):
    self.window = window
    self.first: tuple[int, float, int] | None = None  # (stage, time, tokens) of the first done
    self._recent: collections.deque = collections.deque(maxlen=window + 1)
    self._row: tuple[int, float, int] | None = None  # the completion of the last row's stage

  def done(self, stage: int, tokens: int, when: float | None = None) -> float:
    """Stage ``stage`` (stages counted from 0, ``tokens`` seen after it) has finished now."""
    if self._recent and self._recent[-1][0] >= stage:
      return self.time_of(stage)
    record = (stage, time.time() if when is None else when, tokens)
    self.first = self.first or record
    self._recent.append(record)
    return record[1]

  def wait(self, stage: int, tokens: int, ready) -> float:
    """The completion time of ``stage``: recorded already, or once ``ready`` (its results) is."""
    if not (self._recent and self._recent[-1][0] >= stage):
      jax.block_until_ready(ready)
      self.done(stage, tokens)
    return self.time_of(stage)

  def time_of(self, stage: int) -> float:
    return next(t for s, t, _ in reversed(self._recent) if s <= stage)

  def row_rate(self, stage: int) -> float | None:
    """Tokens/s over the stages a log row for ``stage`` covers: since the previous row's stage
    (or the first completion); ``None`` for the first stage of the process (its compile)."""
    now = next(r for r in reversed(self._recent) if r[0] <= stage)
    before, self._row = self._row or self.first, now
    if before is None or before[0] >= now[0]:
      return None
    return (now[2] - before[2]) / max(now[1] - before[1], 1e-9)

  def window_rate(self) -> tuple[float, int] | None:
    """``(tokens/s, stages)`` over the last completed stages (at most ``window``)."""
    if len(self._recent) < 2:
      return None
    (s0, t0, n0), (s1, t1, n1) = self._recent[0], self._recent[-1]
    return (n1 - n0) / max(t1 - t0, 1e-9), s1 - s0

  def stage_rate(self) -> float | None:
    """Stages per second since the first completion (the ETA's)."""
    if self.first is None or self._recent[-1][0] <= self.first[0]:
      return None
    (s0, t0, _), (s1, t1, _) = self.first, self._recent[-1]
    return (s1 - s0) / max(t1 - t0, 1e-9)

  def run_rate(self) -> dict | None:
    """The run's throughput, from the end of its first stage to the end of its last: tokens/s,
    and the span it covers. ``None`` when the process ran one stage only."""
    if self.first is None or self._recent[-1][0] <= self.first[0]:
      return None
    (s0, t0, n0), (s1, t1, n1) = self.first, self._recent[-1]
    return {
      "tokens_per_s": (n1 - n0) / max(t1 - t0, 1e-9),
      "from_stage": s0,
      "to_stage": s1,
      "seconds": t1 - t0,
      "tokens": n1 - n0,
    }


class Progress:
  """A one-line progress bar with speed and ETA on a terminal; plain log lines otherwise.

  The figures come from a :class:`StageClock`: ``tok/s`` over the last whole stages the clock
  holds (at most its ``window``; the line says how many), the ETA from the stage rate since the end
  of the process's first stage (which compiles: until another stage has finished a line says the
  stage is not timed rather than print a figure).
  """

  def __init__(self, total: int, start: int = 0, *, enabled: bool = True, every_s: float = 10.0):
    self.total, self.done, self.enabled = total, start, enabled
    self.tty = sys.stderr.isatty()
    self.every_s, self._last = every_s, 0.0

  def update(self, done: int, text: str, clock: StageClock) -> None:
    """Shows stage ``done`` with ``text`` and the clock's figures."""
    if not self.enabled:
      return
    self.done = done
    now = time.time()
    stage_rate, window = clock.stage_rate(), clock.window_rate()
    if stage_rate is None:
      figures = " (first stage: compiling, not timed)"
    else:
      eta_s = time.strftime("%H:%M:%S", time.gmtime((self.total - done) / stage_rate))
      rate, stages = window
      figures = f" {rate:,.0f} tok/s (last {stages} stage{'s' * (stages > 1)}) eta {eta_s}"
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


def readable(step, tree):
  """``tree``, or under LoCo across processes (per-worker values) a copy on every device."""
  if all(x.is_fully_addressable or x.is_fully_replicated for x in jax.tree.leaves(tree)):
    return tree
  return step.replicated(tree)


class Pace:
  """The clock and progress of a run's stage loop: when stages finish (:class:`StageClock`), the
  progress line, the profiler's window, the one call in flight, and where this process started
  and must stop.

  Attributes:
    lead: whether this process prints (process 0).
    start: the stage this process started at; ``stop_at``: ``max_stages`` (stop early), or None.
    clock, progress, profiler: see :class:`StageClock`, :class:`Progress` and
      :class:`acco_jax.run.profile.StageProfiler`.
    in_flight: the last call's loss (device), waited for once the call after it is queued.
    t_start: when the loop started (a row's ``wall_s`` counts from it).
  """

  def __init__(self, total: int, start: int, *, profile_window, workdir: str, max_stages=None):
    self.lead = jax.process_index() == 0
    self.start, self.stop_at = start, max_stages
    self.clock = StageClock()
    self.progress = Progress(total, start, enabled=self.lead)
    self.profiler = profile.StageProfiler(profile_window, workdir)
    self.in_flight = None
    self.t_start = time.time()

  def queued(self, stage: int, tokens_seen: int, loss) -> bool:
    """A call was queued after stage ``stage``: waits for the call before it (one call in flight,
    never more), records its completion, and keeps ``loss`` as the call now in flight. True when
    a call was waited for."""
    waited = self.in_flight is not None
    if waited:
      jax.block_until_ready(self.in_flight)
      self.clock.done(stage, tokens_seen)  # the call before this one has finished
    self.in_flight = loss
    return waited

  def finished(self, stage: int, tokens_seen: int) -> None:
    """Waits for the call in flight, the last one (its completion closes the run's rate)."""
    if self.in_flight is not None:
      self.clock.wait(stage, tokens_seen, self.in_flight)

  def close(self) -> None:
    self.profiler.stop()
    self.progress.close()
