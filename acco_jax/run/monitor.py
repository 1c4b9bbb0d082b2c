"""Health of a multi-process run: slow workers from timings, hung collectives from a watchdog.

In the spirit of C4 (collective timings expose slow or dead ranks), with what a JAX job has:

* **Slow workers.** :meth:`acco_jax.dp.step.TrainStep.probe` times each process's microbatch (no
  collective) and the stage's collectives; the trainer gathers them every ``health.probe_every``
  stages and :func:`slow_workers` names the processes much slower than the median.
* **Hung collectives.** A collective whose peer died never returns (or returns an error much later,
  when the coordination service notices). :class:`Watchdog` is a daemon thread: it publishes this
  process's heartbeat (stage, time) in the ``jax.distributed`` key-value store every few seconds,
  and when the training loop has made no progress for ``timeout_s`` it reads every process's
  heartbeat, names the processes that went silent, and ends this process with
  :data:`HANG_EXIT_CODE` (the main thread is stuck inside the collective, so nothing can be saved;
  rerunning resumes from the last checkpoint).
* **Preemption.** :class:`Preemption` turns SIGTERM/SIGINT into a request the loop reads at the next
  stage boundary, where it checkpoints and stops. Across processes, SIGTERM goes through JAX's
  preemption sync point, so that every process stops at the same stage (the checkpoint is
  collective), even when the signal reaches one process only or each at another stage.
* **Compiling is not hanging.** A process that waits in a collective for a peer that is still
  compiling makes no progress either. Each heartbeat says whether its process is compiling (from
  JAX's own monitoring events, :class:`CompileClock`), and no process is declared hung while
  it or a live peer compiles. This matters most with the persistent compilation cache: a process
  that loads its programs from the cache reaches the first collective long before a peer that
  compiles them (on CPU, JAX writes only process 0's entries, so the others compile on every start).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from acco_jax.run import health
from acco_jax.run.metrics import readable

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: the run can be retried (it resumes from its last checkpoint)
_PREFIX = "acco_jax/heartbeat/"


def slow_workers(mb_time_s, factor: float) -> list[tuple[int, float]]:
  """``(process, slowdown)`` for each process whose microbatch takes more than ``factor`` times
  the median of the *other* processes (so that one slow process of two is found too)."""
  t = np.asarray(mb_time_s, np.float64)
  out = []
  for i, x in enumerate(t):
    others = float(np.median(np.delete(t, i))) if len(t) > 1 else x
    if others > 0 and x > factor * others:
      out.append((i, float(x / others)))
  return out


def slow_message(mb_time_s, factor: float, stage: int) -> str | None:
  """A one-line warning naming the slow processes, or ``None``."""
  slow = slow_workers(mb_time_s, factor)
  if not slow:
    return None
  names = ", ".join(
    f"process {i} ({s:.1f}x the others: {mb_time_s[i] * 1e3:.0f} ms per microbatch)"
    for i, s in slow
  )
  return (
    f"stage {stage}: slow worker(s): {names}; the others wait for them at every collective "
    "(method=acco with hetero.adaptive=balance lets the fast ones take more)"
  )


def probe(step, state, batch, stage: int, slow_factor: float, writer) -> np.ndarray:
  """``[processes, 2]`` seconds per microbatch and per stage communication of every process
  (:meth:`TrainStep.probe`, gathered); logged, and slow processes named in a warning."""
  mb_s, comm_s = step.probe(state, batch)
  times = np.asarray(multihost_utils.process_allgather(np.array([mb_s, comm_s]))).reshape(-1, 2)
  writer.event(
    "probe", stage=stage, mb_time_s=times[:, 0].tolist(), comm_time_s=times[:, 1].tolist()
  )
  warning = slow_message(times[:, 0], slow_factor, stage)
  if warning:
    writer.event("slow_workers", stage=stage, message=warning)
    if jax.process_index() == 0:
      print(warning, flush=True)
  return times


class SlowStreak:
  """Processes slower than ``factor`` times the others in ``patience`` consecutive probes.

  A single slow probe (a page fault, a checkpoint write) names nobody; a process slow ``patience``
  times in a row is what ``health.on_slow=exclude`` acts on.
  """

  def __init__(self, factor: float, patience: int):
    self.factor, self.patience = factor, patience
    self.streak: dict[int, int] = {}

  def observe(self, mb_time_s) -> list[tuple[int, float]]:
    """Counts this probe; returns ``(process, slowdown)`` of those slow ``patience`` times in a row."""
    slow = dict(slow_workers(mb_time_s, self.factor))
    self.streak = {p: self.streak.get(p, 0) + 1 for p in slow}
    return [(p, s) for p, s in slow.items() if self.streak[p] >= self.patience]


_TRANSPORT_ERRORS = (
  "Gloo",
  "NCCL",
  "onnection",
  "coordination service",
  "UNAVAILABLE",
  "DEADLINE_EXCEEDED",
)


class Preemption:
  """SIGTERM/SIGINT ask the training loop to checkpoint at the next stage boundary and stop
  (``requested``: the signal's name); ``restore`` puts the previous handlers back.

  With ``synced`` (a multi-process run whose ``jax.distributed`` started JAX's preemption service,
  the default), SIGTERM is left to JAX's own handler: the process that receives it tells the others
  through the coordination service, and :meth:`at_boundary` stops every process at the same stage
  (``multihost_utils.reached_preemption_sync_point``). A Python handler would replace JAX's, and a
  process that stops alone waits in the collective checkpoint for peers that went on to the next
  stage. SIGINT (Ctrl-C) keeps the per-process flag.
  """

  def __init__(self, synced: bool = False):
    self.requested, self._passed = None, 0
    self.synced = synced and jax_preemption_service()
    self._old = {}
    for sig in (signal.SIGINT,) if self.synced else (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass

  def _handle(self, signum, frame):
    self.requested = signal.Signals(signum).name

  def begin(self, stage: int) -> None:
    """The loop starts at ``stage`` (a resumed run's), every process alike: the stages up to it
    are passed to JAX's sync point too, so that a notice that came while the run was starting
    (JAX then agreed on a stage before this one) stops it at the first boundary."""
    self._passed = 0
    self.at_boundary(stage)

  def at_boundary(self, stage: int) -> str | None:
    """The reason to stop at this stage boundary (the loop is at ``stage``), or None.

    Every process calls it at every boundary. Synced, it passes each stage since the last call to
    JAX's sync point: when the notice arrives, JAX freezes each process's last stage passed and
    agrees on the stage after the furthest one; a call may span several stages, and every process
    stops at the boundary of the call that holds the agreed stage."""
    if self.synced:
      for s in range(self._passed + 1, stage + 1):
        if multihost_utils.reached_preemption_sync_point(s):
          self.requested = "SIGTERM"
      self._passed = stage
    return self.requested

  def restore(self):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def jax_preemption_service() -> bool:
  """Whether ``jax.distributed`` started JAX's preemption sync manager (its SIGTERM notifier)."""
  try:
    from jax._src import distributed
  except ImportError:  # pragma: no cover - moved in a future JAX
    return False
  return distributed.global_state.preemption_sync_manager is not None


def is_collective_failure(error: BaseException) -> bool:
  """Whether ``error`` looks like a failed collective or a lost peer (not a bug or bad input).

  JAX raises these as ``JaxRuntimeError``, or as ``ValueError`` when the transfer fails inside
  ``multihost_utils``; the transports name themselves in the message.
  """
  import jax

  return isinstance(error, jax.errors.JaxRuntimeError) or any(
    word in str(error) for word in _TRANSPORT_ERRORS
  )


def _client():
  """The ``jax.distributed`` client, or ``None`` in a single-process run."""
  try:
    from jax._src import distributed
  except ImportError:  # pragma: no cover - moved in a future JAX
    return None
  return distributed.global_state.client


class CompileClock:
  """When this process began the compilation it is in now, from JAX's monitoring events: a
  program's lowering ends just before its compilation (or cache lookup) starts, whose end JAX
  records too. ``cap_s`` bounds how long a lowering not followed by a compilation (``.lower()``
  alone) can count as compiling."""

  LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
  COMPILED = "/jax/core/compile/backend_compile_duration"

  def __init__(self, cap_s: float = 600.0):
    self.cap_s = cap_s
    self._lowered, self._compiled = 0.0, 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    if event == self.LOWERED:
      self._lowered = time.time()
    elif event == self.COMPILED:
      self._compiled = time.time()

  def since(self) -> float | None:
    """Unix time at which the compilation in progress began, or None."""
    if self._lowered > self._compiled and time.time() - self._lowered < self.cap_s:
      return self._lowered
    return None

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)


class Watchdog:
  """Ends the process, naming the silent peers, when training stops progressing.

  Args:
    timeout_s: seconds without :meth:`progress` before the run is declared hung.
    process_index: this process.
    process_count: processes in the job.
    interval_s: heartbeat period (default: a tenth of the timeout, at most 5 s).
    on_hang: called with the message instead of printing it and exiting (tests).
    client: the key-value store (default: the ``jax.distributed`` client).
    compile_clock: tells whether this process compiles (default: a :class:`CompileClock`).
  """

  def __init__(
    self,
    timeout_s: float,
    *,
    process_index: int,
    process_count: int,
    interval_s: float | None = None,
    on_hang: Callable[[str], None] | None = None,
    client=None,
    compile_clock: CompileClock | None = None,
  ):
    self.timeout_s = float(timeout_s)
    self.process_index, self.process_count = process_index, process_count
    self.interval_s = interval_s or min(self.timeout_s / 10, 5.0)
    self.client = client if client is not None else _client()
    self.on_hang = on_hang or self._exit
    self._stage, self._last = 0, time.time()
    self._armed = False
    self.compile_clock = compile_clock or CompileClock(cap_s=max(600.0, 10 * self.timeout_s))
    self.recorder = None  # an acco_jax.run.health.Recorder: writes the verdict before the exit
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="acco-watchdog", daemon=True)

  def start(self) -> Watchdog:
    self._beat()
    self._thread.start()
    return self

  def progress(self, stage: int) -> None:
    """The loop completed ``stage`` (its results are on the host); arms the watchdog."""
    self._stage, self._last, self._armed = stage, time.time(), True

  def stop(self) -> None:
    self._stop.set()
    self.compile_clock.close()

  @property
  def stage(self) -> int:
    """The last stage the loop completed."""
    return self._stage

  def heartbeats(self, *, compiling: bool = False) -> dict[int, tuple]:
    """``{process: (stage, unix time)}`` of the last heartbeat of each process that sent one;
    ``compiling``: ``(stage, unix time, compiling since or None)``.

    Raises when there is no key-value store or the coordinator is unreachable.
    """
    if self.client is None:
      raise RuntimeError("no jax.distributed key-value store")
    out = {}
    for key, value in self.client.key_value_dir_get(_PREFIX):
      stage, at, *since = value.split()
      beat = (int(stage), float(at))
      out[int(key[len(_PREFIX) :])] = (
        beat + (float(since[0]) if since else None,) if compiling else beat
      )
    return out

  def _beat(self) -> None:
    if self.client is not None:
      try:
        key = f"{_PREFIX}{self.process_index}"
        since = self.compile_clock.since()
        value = f"{self._stage} {time.time():.3f}" + ("" if since is None else f" {since:.3f}")
        self.client.key_value_set(key, value, allow_overwrite=True)
      except Exception:  # the coordinator is gone; diagnose() says so
        pass

  def _compiling(self) -> bool:
    """This process or a live peer (a fresh heartbeat) is compiling."""
    if self.compile_clock.since() is not None:
      return True
    try:
      beats = self.heartbeats(compiling=True)
    except Exception:
      return False
    now = time.time()
    return any(
      since is not None and now - at <= 3 * self.interval_s for _, at, since in beats.values()
    )

  def diagnose(self, settle: bool = False) -> str:
    """Which processes went silent, from their heartbeats.

    ``settle``: first wait long enough for a peer that died just now to look silent (after a
    collective failed at once, e.g. a connection reset).
    """
    if settle:
      time.sleep(3.5 * self.interval_s)
    if self.client is None:
      return "no jax.distributed key-value store to ask which peer stopped"
    try:
      beats = self.heartbeats()
    except Exception as e:
      return f"the coordinator (process 0) is unreachable ({type(e).__name__})"
    now, silent = time.time(), []
    for p in range(self.process_count):
      if p not in beats:
        silent.append(f"process {p} (no heartbeat)")
        continue
      stage, at = beats[p]
      if now - at > 3 * self.interval_s:
        silent.append(f"process {p} (silent for {now - at:.0f} s, last at stage {stage})")
    if not silent:
      return "every process still sends heartbeats: a collective or the network is stuck"
    return "peer(s) stopped: " + ", ".join(silent)

  def message(self, peer_fault: dict | None = None) -> str:
    idle = time.time() - self._last
    if peer_fault is not None:
      what = f"another process found a {peer_fault['verdict']} peer"
    else:
      what = f"no progress for {idle:.1f} s after stage {self._stage}"
    verdict = self.recorder is not None and self.recorder.verdict is not None
    found = (
      f"{self.recorder.message()}; health.exclude=auto leaves the suspects out"
      if verdict
      else self.diagnose()
    )
    return (
      f"process {self.process_index}: {what} (health.hang_timeout_s={self.timeout_s:g}); {found}. "
      "Ending the run; restart all processes with the same command to resume from the last "
      "checkpoint"
    )

  def _run(self) -> None:
    while not self._stop.wait(self.interval_s):
      self._beat()
      fault = self.recorder.peer_fault() if self.recorder is not None else None
      idle = self._armed and time.time() - self._last > self.timeout_s
      if idle and fault is None and self._compiling():
        self._last = time.time()  # waiting for a compilation, here or at a peer: not a hang
        continue
      if fault is not None or idle:
        self._armed = False
        if self.recorder is not None:
          self.recorder.conclude()
        self.on_hang(self.message(fault))
        return

  @staticmethod
  def _exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(HANG_EXIT_CODE)


@jax.jit
def _flag_nonfinite(flag, loss, finite):
  """``flag`` (``None`` before the first call) or'ed with where ``loss`` or ``finite`` is not."""
  bad = ~(jnp.isfinite(loss) & finite)
  return bad if flag is None else flag | bad


class Watch:
  """The health watch of a run's stage loop: preemption signals; across processes the watchdog of
  hangs, the verdict it leaves (``health.json``) and the streaks of slow workers that
  ``health.on_slow=exclude`` acts on; and the device-side flag of a non-finite loss.

  Attributes:
    preempt: SIGTERM/SIGINT, read at each stage boundary (:class:`Preemption`; SIGTERM synced
      across processes).
    watchdog: the watchdog of hung collectives (:class:`Watchdog`), or None (one process, or
      ``health.hang_timeout_s=0``).
    recorder: its verdict's writer (:class:`acco_jax.run.health.Recorder`), or None (one process).
    slow: the slow workers' streaks (:class:`SlowStreak`), or None (not ``on_slow=exclude``).
    nonfinite: where a loss was not finite, or'ed over calls on the devices (elementwise, per
      worker under LoCo: a reduction would be a collective after every call), read only at log
      and checkpoint time; None before the first call.
  """

  def __init__(self, config, workdir: str, launch=None):
    self.preempt = Preemption(synced=jax.process_count() > 1)
    self.watchdog, self.recorder, self.slow, self.nonfinite = None, None, None, None
    self.on_nonfinite = config.train.on_nonfinite
    if jax.process_count() == 1:
      return
    dog = Watchdog(
      config.health.hang_timeout_s or float("inf"),
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
    self.recorder = dog.recorder = health.Recorder(workdir, dog, launch)
    if health.on_slow(config) == "exclude":
      self.slow = SlowStreak(config.health.slow_factor, config.health.slow_patience)
    if config.health.hang_timeout_s > 0:
      self.watchdog = dog.start()

  def progress(self, stage: int) -> None:
    """The loop reached ``stage`` (the watchdog's heartbeat)."""
    if self.watchdog is not None:
      self.watchdog.progress(stage)

  def flag(self, loss, finite) -> None:
    """Or's where this call's ``loss`` (or a sync's ``finite``) is not finite into the flag. The
    first call runs both programs (no flag yet, a flag): none compiles after it."""
    if self.nonfinite is None:
      self.nonfinite = _flag_nonfinite(None, loss, finite)
    self.nonfinite = _flag_nonfinite(self.nonfinite, loss, finite)

  def check_finite(self, flag, at_stage: int, step) -> None:
    """Stops the run (``train.on_nonfinite=stop``) on a non-finite loss in ``flag``."""
    if self.on_nonfinite != "stop" or flag is None:
      return
    flag = readable(step, flag)  # per-worker flags across processes: one copy everywhere
    if bool(np.any(np.asarray(flag))):
      raise FloatingPointError(
        f"non-finite loss before stage {at_stage}; the last good checkpoint is kept. Lower "
        "opt.lr, or set train.on_nonfinite=skip to drop non-finite microbatches"
      )

  def failed(self, error: BaseException) -> None:
    """Names the peer that is gone when ``error`` is a failed collective (health.json, once the
    dead peer's heartbeat is stale)."""
    if self.watchdog is not None and is_collective_failure(error):
      self.recorder.conclude(error=error)
      error.add_note(f"process {jax.process_index()}: {self.recorder.message()}")

  def close(self) -> None:
    self.preempt.restore()
    if self.watchdog is not None:
      self.watchdog.stop()
