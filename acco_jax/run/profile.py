"""``train.profile_stages=a:b``: a ``jax.profiler`` trace of stages ``a`` to ``b`` of a run.

The trace starts before stage ``a`` is dispatched and stops once stage ``b`` has finished on the
device, into ``<workdir>/profile`` (``profile/process_<i>`` for each process of a multi-process
run): TensorBoard's ``plugins/profile/<time>/`` folder with the Perfetto trace
(``perfetto_trace.json.gz``, for ui.perfetto.dev and ``python -m bench.gpu.profile_table``). Stages count from
1, as the log lines do; a stage of a LoCo call that runs several is traced with the whole call.
Each stage's dispatch is annotated (``jax.profiler.StepTraceAnnotation('stage', step_num=s)``), so
the table can tell the stages apart.
"""

from __future__ import annotations

import contextlib
import glob
import os

import jax

from acco_jax import errors


def parse(spec: str, total: int) -> tuple[int, int] | None:
  """``'a:b'`` -> ``(a, b)`` with ``1 <= a <= b <= total``; ``''`` -> ``None`` (one-line errors)."""
  if not spec:
    return None
  try:
    a, b = (int(x) for x in spec.split(":"))
  except ValueError:
    a = b = None
  if a is None or not 1 <= a <= b:
    raise errors.UserValueError(
      f"train.profile_stages={spec!r} must be 'a:b', the first and last stage to trace "
      "(1 <= a <= b, stages counted from 1), e.g. '10:14'"
    )
  if b > total:
    raise errors.UserValueError(
      f"train.profile_stages={spec!r} ends after the run's {total} stages: choose b <= {total}"
    )
  return a, b


class StageProfiler:
  """Starts and stops the trace around the chosen stages (a no-op without ``profile_stages``).

  Args:
    window: ``(a, b)`` from :func:`parse`, or ``None``.
    workdir: the run's directory; the trace goes to its ``profile`` folder.
  """

  def __init__(self, window: tuple[int, int] | None, workdir: str):
    self.window, self.active, self.path = window, False, None
    self.dir = os.path.join(workdir, "profile")
    if jax.process_count() > 1:
      self.dir = os.path.join(self.dir, f"process_{jax.process_index()}")

  def stage(self, done: int, stages: int):
    """A context for the dispatch of the call that runs stages ``done+1 .. done+stages``: the trace
    starts at stage ``a`` and the dispatch is annotated while tracing."""
    if self.window is None:
      return contextlib.nullcontext()
    a, b = self.window
    if not self.active and done < b and done + stages >= a:
      os.makedirs(self.dir, exist_ok=True)
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.active = True
    if self.active:
      return jax.profiler.StepTraceAnnotation("stage", step_num=done + 1)
    return contextlib.nullcontext()

  def finished(self, done: int, ready) -> str | None:
    """After the call that brought the run to ``done`` stages: once ``ready`` (its results) is, the
    trace stops if stage ``b`` is done. Returns the Perfetto file it wrote, or ``None``."""
    if not self.active or done < self.window[1]:
      return None
    jax.block_until_ready(ready)
    return self.stop()

  def stop(self) -> str | None:
    """Stops a running trace (the run ended or stopped inside the window); the Perfetto file."""
    if not self.active:
      return None
    jax.profiler.stop_trace()
    self.active = False
    for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz"):  # the Perfetto file, else any
      found = sorted(glob.glob(os.path.join(self.dir, "**", pattern), recursive=True))
      if found:
        self.path = found[-1]
        break
    return self.path
