"""The health verdict of a multi-process run, and restarting without the processes it names.

The second half of C4's diagnosis loop (:mod:`acco_jax.run.monitor` is the first: it notices). When
a run ends because a peer died, hung or is too slow, every surviving process writes
``<workdir>/health.json`` (atomically: a temporary file, then a rename) and exits with
:data:`acco_jax.run.monitor.HANG_EXIT_CODE` (75). The file holds

* ``verdict``: ``dead`` (the process is gone: a collective failed with a closed connection, or its
  process is no longer there), ``hung`` (it stopped sending heartbeats but its connections stay
  open: a stopped process, a frozen host; or, with no suspect, every process is alive and a link or
  a collective is stuck) or ``slow`` (slower than ``health.slow_factor`` for ``slow_patience``
  probes, with ``health.on_slow=exclude``);
* ``suspects``: process index, launch index and host of each, with the reason;
* ``exclude`` / ``exclude_hosts``: the launch indices and hosts a restart should leave out (those
  of earlier verdicts included);
* the evidence: every process's last heartbeat (stage, age), its host, pid and, where it runs on
  this host, its state (``running``, ``stopped``, ``gone``); the last speed probe (per-process
  microbatch and communication times and their ratio to the median of the others); the collective
  error, if any; the last checkpoint step; the time of detection.

``health.exclude=auto`` (:func:`exclusion`, called by ``train.py`` before ``jax.distributed``
starts) reads the file: the processes of the launch minus the excluded ones form the job, numbered
in order, and an excluded process leaves at once. The run then resumes from its last checkpoint on
fewer devices (elastic restore). Under SLURM the scheduler does this instead
(``scripts/slurm_requeue.sbatch``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import NamedTuple

import numpy as np

from acco_jax import errors
from acco_jax.run import registry

HEALTH_FILE = "health.json"
_IDENTITY = "acco_jax/identity/"  # this process's host, pid and launch index
# the first verdict of the job, which the others adopt (key_value_dir_get lists a directory, so
# every key read through it lives under one, with a trailing slash)
_FAULTS = "acco_jax/fault/"
_FAULT = _FAULTS + "first"
_DONE = "acco_jax/done/"  # a survivor has written its verdict and leaves
VERDICTS = ("dead", "hung", "slow")


class Launch(NamedTuple):
  """How this run's processes map to the processes it was launched with.

  ``launch_ids[p]`` is the launch index of process ``p``; ``launched`` the launch's process count;
  ``excluded`` the launch indices left out (earlier verdicts).
  """

  launch_ids: tuple[int, ...]
  launched: int
  excluded: tuple[int, ...] = ()


class Excluded(Exception):
  """This process is named by ``health.json``: it takes no part in the restarted run."""


class RestartWithout(Exception):
  """The run checkpointed and ends so that it restarts without the slow processes (exit 75)."""


def host_name() -> str:
  """The name a scheduler knows this host by (SLURM's node name where set)."""
  return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def check_config(config) -> None:
  """One-line errors for the health fields (before anything runs)."""
  h = config.health
  if h.on_slow not in ("auto", "keep", "exclude"):
    raise errors.UserValueError(
      f"health.on_slow={h.on_slow!r}: choose 'keep', 'exclude' or 'auto' (keep for acco with "
      "hetero.adaptive, exclude otherwise)"
    )
  if h.exclude not in ("off", "auto"):
    raise errors.UserValueError(f"health.exclude={h.exclude!r}: choose 'off' or 'auto'")
  if not isinstance(h.slow_patience, int) or h.slow_patience < 1:
    raise errors.UserValueError(f"health.slow_patience={h.slow_patience!r} must be >= 1 (probes)")
  if not h.slow_factor > 1:
    raise errors.UserValueError(f"health.slow_factor={h.slow_factor!r} must be > 1")


def on_slow(config) -> str:
  """``'keep'`` or ``'exclude'``: ``auto`` keeps slow workers where the run absorbs them (its
  family says: ACCO's adaptive budgets, method acco with ``hetero.adaptive``) and excludes them
  otherwise."""
  if config.health.on_slow != "auto":
    return config.health.on_slow
  return "keep" if registry.lookup(config.method).absorbs_slow_workers(config) else "exclude"


# -- reading the verdict: who takes part in the restart ------------------------------------------


def read(workdir: str) -> dict | None:
  path = os.path.join(workdir, HEALTH_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      verdict = json.load(f)
    [int(x) for x in verdict["exclude"]], int(verdict["launched_processes"])  # noqa: B018
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise errors.UserValueError(
      f"health.exclude=auto: {path} is unreadable ({type(e).__name__}: {e}); delete it or set "
      "health.exclude=off"
    ) from None
  return verdict


def exclusion(
  mode: str, workdir: str, *, coordinator_address: str, num_processes: int, process_id: int
) -> tuple[Launch | None, dict]:
  """The launch this process belongs to, and the ``jax.distributed`` arguments of its restart.

  With ``mode='auto'``, an explicit launch (``dist.coordinator_address``, ``num_processes``,
  ``process_id``) and a ``health.json`` in ``workdir``: the launch's processes not excluded form
  the job, renumbered in order; the coordinator moves to the first remaining process's host if
  its own process is excluded. Otherwise (no file, ``mode='off'``, or a scheduler's launch: it
  already left the hosts out) the arguments are returned unchanged and the launch is ``None``
  (every process is its own launch index).

  Raises:
    Excluded: this process is excluded.
    UserValueError: the file is unreadable or from a launch of another size.
  """
  args = dict(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )
  if mode not in ("off", "auto"):
    raise errors.UserValueError(f"health.exclude={mode!r}: choose 'off' or 'auto'")
  verdict = read(workdir) if mode == "auto" else None
  if verdict is None or not coordinator_address or num_processes < 1 or process_id < 0:
    return None, args
  launched, excluded = (
    int(verdict["launched_processes"]),
    sorted({int(x) for x in verdict["exclude"]}),
  )
  path = os.path.join(workdir, HEALTH_FILE)
  if launched != num_processes:
    raise errors.UserValueError(
      f"health.exclude=auto: {path} is from a launch of {launched} processes, this one has "
      f"dist.num_processes={num_processes}: relaunch the command of that run (the excluded "
      "processes leave by themselves), or set health.exclude=off"
    )
  if process_id in excluded:
    raise Excluded(
      f"process {process_id} is excluded by {path} (verdict {verdict.get('verdict')!r}); the "
      f"other {launched - len(excluded)} resume without it"
    )
  remaining = [p for p in range(launched) if p not in excluded]
  args.update(num_processes=len(remaining), process_id=remaining.index(process_id))
  host, _, port = coordinator_address.rpartition(":")
  if 0 in excluded and host not in ("127.0.0.1", "localhost", "[::1]", "::1"):
    hosts = {int(p["launch_id"]): p.get("host") for p in verdict.get("processes", [])}
    if hosts.get(remaining[0]):
      args["coordinator_address"] = f"{hosts[remaining[0]]}:{port}"
  return Launch(tuple(remaining), launched, tuple(excluded)), args


# -- writing the verdict --------------------------------------------------------------------------


def write_atomic(path: str, obj: dict) -> None:
  """``obj`` as JSON at ``path``, never half-written: a temporary file renamed over it."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def last_checkpoint_step(workdir: str) -> int | None:
  """The newest finalized checkpoint step in ``workdir`` (orbax renames a save when complete)."""
  try:
    steps = [int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()]
  except OSError:
    return None
  return max(steps, default=None)


def process_state(pid: int) -> str:
  """``running``, ``stopped`` (SIGSTOP), ``gone`` (exited or killed) of a process on this host."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      state = f.read().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return "gone"
  return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")


def _ratios(x) -> list[float]:
  x = np.asarray(x, np.float64)
  if len(x) < 2:
    return [1.0] * len(x)
  return [float(v / max(np.median(np.delete(x, i)), 1e-12)) for i, v in enumerate(x)]


class Recorder:
  """Collects the evidence while the run is healthy and writes the verdict when it is not.

  Args:
    workdir: where ``health.json`` goes.
    watchdog: the run's :class:`acco_jax.run.monitor.Watchdog` (heartbeats, key-value store).
    launch: the launch this run belongs to (``None``: every process is its own launch index).
    grace_s: how long process 0, which serves the key-value store, waits for the other survivors
      to write their verdict before it leaves.
  """

  def __init__(self, workdir: str, watchdog, launch: Launch | None = None, grace_s: float = 0.0):
    self.workdir, self.dog = workdir, watchdog
    n = watchdog.process_count
    self.launch = launch or Launch(tuple(range(n)), n)
    # the others need up to one heartbeat interval to see the published verdict, and as long as
    # 3.5 to let a dead peer's heartbeat go stale; process 0 leaving earlier takes the key-value
    # store with it, and jax.distributed then aborts them before they write
    self.grace_s = grace_s or 10 * watchdog.interval_s + 2.0
    self.probe: dict | None = None
    self.verdict: dict | None = None
    self._lock = threading.Lock()
    self._set(
      f"{_IDENTITY}{watchdog.process_index}",
      json.dumps(
        {
          "host": host_name(),
          "pid": os.getpid(),
          "launch_id": self.launch.launch_ids[watchdog.process_index],
        }
      ),
    )

  def _set(self, key: str, value: str, overwrite: bool = True) -> bool:
    try:
      self.dog.client.key_value_set(key, value, allow_overwrite=overwrite)
      return True
    except Exception:  # the coordinator is gone, or (overwrite=False) the key exists
      return False

  def _dir(self, prefix: str) -> dict[str, str]:
    try:
      return dict(self.dog.client.key_value_dir_get(prefix))
    except Exception:
      return {}

  def probed(self, stage: int, times) -> None:
    """The last speed probe: ``times[p] = (seconds per microbatch, seconds of communication)``."""
    t = np.asarray(times, np.float64)
    self.probe = {
      "stage": stage,
      "mb_time_s": t[:, 0].tolist(),
      "comm_time_s": t[:, 1].tolist(),
      "mb_vs_median": _ratios(t[:, 0]),
      "comm_vs_median": _ratios(t[:, 1]),
    }

  def peer_fault(self) -> dict | None:
    """The verdict another process published, if any (the watchdog polls it)."""
    value = self._dir(_FAULTS).get(_FAULT)
    return json.loads(value) if value else None

  def conclude(self, *, error: BaseException | None = None, slow: list | None = None) -> dict:
    """Decides, publishes and writes the verdict (once per process); returns it.

    ``error``: the collective failure that ended the loop (``None``: the watchdog fired).
    ``slow``: ``[(process, slowdown)]`` to exclude for slowness.
    """
    with self._lock:
      if self.verdict is None:
        self.verdict = self._decide(error, slow)
        write_atomic(os.path.join(self.workdir, HEALTH_FILE), self.verdict)
        self._leave()
      return self.verdict

  def _decide(self, error, slow) -> dict:
    dog, me = self.dog, self.dog.process_index
    published = None if slow else self.peer_fault()
    settle = time.time() + 3.5 * dog.interval_s  # a peer that died just now must look silent
    while error is not None and published is None and time.time() < settle:
      time.sleep(dog.interval_s / 4)
      published = self.peer_fault()  # or another survivor has decided already
    try:
      beats, reachable = dog.heartbeats(), True
    except Exception:
      beats, reachable = {}, False
    now = time.time()
    procs = self._processes(beats, now)
    if slow:
      kind = "slow"
      suspects = [(p, f"{s:.1f}x the others' microbatch time") for p, s in slow]
    elif published is not None:  # another survivor decided first: one verdict for the job
      kind = published["verdict"]
      suspects = [(s["process"], s["reason"]) for s in published["suspects"]]
      error = error or published.get("error")
    elif not reachable:
      kind, suspects = "dead", [(0, "the coordinator (process 0) is unreachable")]
    else:
      kind, suspects = self._silent_ones(procs, error)
    rows = {r["process"]: r for r in procs}
    named = [
      {
        "process": p,
        "launch_id": self.launch.launch_ids[p],
        "host": rows[p]["host"],
        "reason": reason,
      }
      for p, reason in suspects
    ]
    verdict = self._verdict(kind, named, error, published, now, procs)
    if published is None and kind != "slow":  # the first verdict of the job: the others adopt it
      first = {
        "verdict": kind,
        "suspects": named,
        "error": verdict["error"],
        "detected_by": me,
        "detected_at": now,
      }
      self._set(_FAULT, json.dumps(first), overwrite=False)
      theirs = self.peer_fault()
      if theirs and theirs["suspects"] != named:  # another process decided first
        return self._decide_from(verdict, theirs)
    return verdict

  def _processes(self, beats: dict, now: float) -> list[dict]:
    """A row per process: its identity, its last heartbeat and, on this host, its OS state."""
    dog, me, here = self.dog, self.dog.process_index, host_name()
    ids = {int(k[len(_IDENTITY) :]): json.loads(v) for k, v in self._dir(_IDENTITY).items()}
    done = {int(k[len(_DONE) :]) for k in self._dir(_DONE)}
    procs = []
    for p in range(dog.process_count):
      info = ids.get(p, {})
      stage, at = beats.get(p, (None, None))
      row = {
        "process": p,
        "launch_id": self.launch.launch_ids[p],
        "host": info.get("host"),
        "pid": info.get("pid"),
        "heartbeat_stage": stage,
        "heartbeat_age_s": None if at is None else round(now - at, 2),
      }
      if info.get("host") == here and info.get("pid") and p != me:
        row["state"] = process_state(info["pid"])
      row["silent"] = p not in done and (
        row["heartbeat_age_s"] is None or row["heartbeat_age_s"] > 3 * dog.interval_s
      )
      procs.append(row)
    return procs

  def _silent_ones(self, procs: list[dict], error) -> tuple[str, list]:
    """``(kind, [(process, reason)])`` of the other processes whose heartbeat stopped: dead (gone,
    or silent when a collective failed) or hung."""
    suspects = []
    for row in procs:
      if row["process"] == self.dog.process_index or not row["silent"]:
        continue
      state = row.get("state")
      dead = state == "gone" or (state is None and error is not None)
      if state in ("gone", "stopped"):
        reason = f"process {state}"
      else:
        reason = "collective failed" if error is not None else "no heartbeat"
      since = f"silent since stage {row['heartbeat_stage']}"
      suspects.append((row["process"], f"{'dead' if dead else 'hung'}: {reason}, {since}"))
    kind = "dead" if any(r.startswith("dead") for _, r in suspects) else "hung"
    return kind, suspects

  def _verdict(self, kind, named, error, published, now, procs) -> dict:
    """The verdict written to health.json: who is suspected, why, and what the restart
    excludes."""
    dog, me = self.dog, self.dog.process_index
    if not named:
      cause = (
        "every process still sends heartbeats: a link or a collective is stuck; nothing to "
        "exclude, the restart uses the same processes"
      )
    else:
      cause = "; ".join(f"process {s['process']} ({s['reason']})" for s in named)
    return {
      "verdict": kind,
      "suspects": named,
      "cause": cause,
      "exclude": sorted(set(self.launch.excluded) | {s["launch_id"] for s in named}),
      "exclude_hosts": sorted({s["host"] for s in named if s["host"]}),
      "launched_processes": self.launch.launched,
      "detected_by": me,
      "detected_at": now,
      "detected_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
      "stage": dog.stage,
      "last_checkpoint_step": last_checkpoint_step(self.workdir),
      "hang_timeout_s": dog.timeout_s,
      "heartbeat_interval_s": dog.interval_s,
      "error": None if error is None else " ".join(str(error).split())[:500],
      "first_detected_by": me if published is None else published.get("detected_by"),
      "first_detected_at": now if published is None else published.get("detected_at"),
      "processes": [{k: v for k, v in r.items() if k != "silent"} for r in procs],
      "probe": self.probe,
    }

  def _decide_from(self, verdict: dict, published: dict) -> dict:
    named = published["suspects"]
    verdict.update(
      verdict=published["verdict"],
      suspects=named,
      first_detected_by=published.get("detected_by"),
      first_detected_at=published.get("detected_at"),
      error=verdict["error"] or published.get("error"),
      cause="; ".join(f"process {s['process']} ({s['reason']})" for s in named) or verdict["cause"],
      exclude=sorted(set(self.launch.excluded) | {s["launch_id"] for s in named}),
      exclude_hosts=sorted({s["host"] for s in named if s["host"]}),
    )
    return verdict

  def _leave(self) -> None:
    """Marks this process done; process 0 (the key-value store) waits for the other survivors."""
    dog = self.dog
    self._set(f"{_DONE}{dog.process_index}", "1")
    if dog.process_index != 0:
      return
    out = {s["process"] for s in self.verdict["suspects"]}
    if self.verdict["verdict"] == "slow":
      return  # a clean, collective exit: every process leaves through jax.distributed's shutdown
    waiting = [p for p in range(dog.process_count) if p not in out]
    deadline = time.time() + self.grace_s
    while time.time() < deadline:
      done = {int(k[len(_DONE) :]) for k in self._dir(_DONE)}
      if all(p in done for p in waiting):
        return
      time.sleep(0.1)

  def message(self) -> str:
    v = self.verdict
    named = {"slow": "slow worker(s): "}.get(v["verdict"], "peer(s) stopped: ")
    return f"health.json: verdict {v['verdict']}, {named if v['suspects'] else ''}{v['cause']}"
