"""Reading a ``jax.profiler`` trace: where the GPU's time goes and where it waits for the host.

A trace (Chrome/Perfetto trace-event JSON, as ``train.profile_stages`` writes it) holds one process
per device and one for the host. GPU kernels are the complete (``ph == 'X'``) events of a process
named ``/device:GPU:<i>``; the host's stage dispatches are the ``stage`` events the trainer's
``jax.profiler.StepTraceAnnotation`` leaves (``args.step_num``). Times are microseconds.

* :func:`kernel_table`: kernel time by kind (GEMM, attention, XLA fusion, collective,
  memcpy/memset, other) and by kernel name;
* :func:`busy`: the fraction of a span in which at least one kernel runs, and the idle gaps;
* :func:`stage_rows`: per stage, the host's dispatch time, and in the window from its dispatch to
  the next one the GPU's busy fraction, largest idle gap and device-to-host copies.

:func:`load` is the only function here that reads a file.
"""

from __future__ import annotations

import collections
import gzip
import json
from typing import NamedTuple

KINDS = ("GEMM", "attention", "XLA fusion", "collective", "memcpy/memset", "other")


class Kernel(NamedTuple):
  name: str
  start: float  # us
  dur: float  # us


class Stage(NamedTuple):
  step: int  # the stage's number (counted from 1)
  start: float  # host dispatch start, us
  dispatch_us: float  # how long the host's dispatch call took


def load(path: str) -> list[dict]:
  """The trace events of a ``.json`` or ``.json.gz`` trace file."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def _process_names(events: list[dict]) -> dict:
  return {
    e["pid"]: e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }


def gpu_kernels(events: list[dict]) -> list[Kernel]:
  """The GPU's kernels (every ``/device:GPU:*`` process), by start time."""
  gpus = {p for p, n in _process_names(events).items() if n.startswith("/device:GPU")}
  out = [
    Kernel(e["name"], float(e["ts"]), float(e.get("dur", 0.0)))
    for e in events
    if e.get("ph") == "X" and e.get("pid") in gpus
  ]
  return sorted(out, key=lambda k: k.start)


def stages(events: list[dict]) -> list[Stage]:
  """The host's stage dispatches: the ``stage`` annotations by stage number; in a trace without
  them, the calls of the most frequent jitted function (``PjitFunction(...)`` events, numbered
  from 1; a call nested in another one's time is the same call)."""
  out = [
    Stage(int(e["args"]["step_num"]), float(e["ts"]), float(e.get("dur", 0.0)))
    for e in events
    if e.get("ph") == "X" and e.get("name") == "stage" and "step_num" in e.get("args", {})
  ]
  if out:
    return sorted(out)
  calls = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("PjitFunction")]
  if not calls:
    return []
  name = collections.Counter(e["name"] for e in calls).most_common(1)[0][0]
  end = float("-inf")
  for e in sorted((e for e in calls if e["name"] == name), key=lambda e: float(e["ts"])):
    if float(e["ts"]) >= end:
      out.append(Stage(len(out) + 1, float(e["ts"]), float(e.get("dur", 0.0))))
      end = float(e["ts"]) + float(e.get("dur", 0.0))
  return out


def kind_of(name: str) -> str:
  """The kind of a GPU kernel, from its name."""
  n = name.lower()
  if any(t in n for t in ("nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter")):
    return "collective"
  if any(t in n for t in ("cudnn", "flash", "fmha", "sdpa")):
    return "attention"
  if any(t in n for t in ("gemm", "nvjet", "cutlass", "cublas", "matmul", "sm90_xmma", "dot")):
    return "GEMM"
  if "memcpy" in n or "memset" in n:
    return "memcpy/memset"
  if "fusion" in n or n.startswith(("loop_", "input_", "wrapped_")):
    return "XLA fusion"
  return "other"


def kernel_table(kernels: list[Kernel]) -> tuple[dict, list[tuple[str, float, int]]]:
  """``({kind: us}, [(name, us, count), ...] by time)``."""
  by_kind: dict = collections.defaultdict(float)
  by_name: dict = collections.defaultdict(lambda: [0.0, 0])
  for k in kernels:
    by_kind[kind_of(k.name)] += k.dur
    by_name[k.name][0] += k.dur
    by_name[k.name][1] += 1
  names = sorted(((n, t, c) for n, (t, c) in by_name.items()), key=lambda x: -x[1])
  return {kind: by_kind[kind] for kind in KINDS if kind in by_kind}, names


def busy(
  kernels: list[Kernel], start: float, end: float
) -> tuple[float, list[tuple[float, float]]]:
  """The fraction of ``[start, end)`` covered by kernels (overlapping kernels count once) and the
  idle gaps ``(at, us)`` in it, largest first."""
  if end <= start:
    return 0.0, []
  covered, gaps, cursor = 0.0, [], start
  for k in kernels:
    a, b = max(k.start, start), min(k.start + k.dur, end)
    if b <= cursor:
      continue
    if a > cursor:
      gaps.append((cursor, a - cursor))
    covered += b - max(a, cursor)
    cursor = b
  if cursor < end:
    gaps.append((cursor, end - cursor))
  return covered / (end - start), sorted(gaps, key=lambda g: -g[1])


def stage_rows(events: list[dict]) -> list[dict]:
  """Per stage: ``stage``, ``dispatch_ms`` (the host's call), and over the window from its
  dispatch to the next stage's (the last: to its last kernel) ``window_ms``, ``gpu_busy``,
  ``largest_gap_ms`` and ``d2h_copies`` (device-to-host copies: a loop steered from the host makes
  one per iteration). The GPU fields are ``None`` in a trace without GPU kernels."""
  kernels, found = gpu_kernels(events), stages(events)
  rows = []
  for i, s in enumerate(found):
    end = found[i + 1].start if i + 1 < len(found) else None
    if end is None:
      end = max((k.start + k.dur for k in kernels), default=s.start + s.dispatch_us)
    row = {"stage": s.step, "dispatch_ms": s.dispatch_us / 1e3, "window_ms": (end - s.start) / 1e3}
    if kernels:
      frac, gaps = busy(kernels, s.start, end)
      copies = sum(1 for k in kernels if s.start <= k.start < end and "memcpyd2h" in k.name.lower())
      row.update(gpu_busy=frac, largest_gap_ms=gaps[0][1] / 1e3 if gaps else 0.0, d2h_copies=copies)
    else:
      row.update(gpu_busy=None, largest_gap_ms=None, d2h_copies=None)
    rows.append(row)
  return rows
