"""Where low-communication workers that are separate jobs meet: rounds in an object store.

Host-side only (NumPy and fsspec; no JAX). Each worker is its own job with its own worker id; at
a sync it publishes its payload blocks for round ``r`` (one per data rank), then waits for the
round's *member set*: the workers whose payloads arrived by the round's deadline. The first process
that sees the deadline met writes the set with an exclusive create, and every worker reads that one
set, so all of them aggregate the same payloads (the set is kept in the store: auditable). A round
is decided as soon as every live worker has arrived (and at least ``min_workers``), or ``grace_s``
after this process first saw an arrival, with at least ``min_workers`` arrived.

The store is any fsspec URL or a plain directory (``/shared/run1``, ``file:///...``,
``s3://bucket/run1``, ``gs://...``, ``memory://...``). Its layout::

  run.json                        the run's record: its id and config (:meth:`RoundStore.check_run`)
  gc.json                         {"rounds_below": n}: rounds below n were collected
  workers/w{id}.p{process}.json   a lease: {host, pid, token, time, from_round}
  rounds/{r:08d}/w{id}.d{rank}.npy   worker id's payload block for data rank ``rank``
  rounds/{r:08d}/set.json         the decision: {round, members, decided_by, time, live}
  snapshots/{r:08d}/d{rank}.npz   the global state before round r (for joiners)
  snapshots/{r:08d}/done          written last: the snapshot is complete

Writes are atomic: on a local (or shared POSIX) filesystem a temporary name in the same folder,
then a rename (exclusive creates: a hard link, which fails if the name exists); on an object store
one put, and an exclusive create is ``open(path, "xb")``: a conditional put on S3 (s3fs >= 2025.7)
and GCS (gcsfs). ``memory://`` creates exclusively too, but only within one process. Times (leases,
deadlines) are this host's ``clock``; the grace deadline is measured from this process's own first
sight of an arrival, so clock skew between hosts only matters for lease staleness (``lease_s``).

A worker is *live* while one of its processes renews its lease within ``lease_s``, unless that
process is on this host (same host name) and gone: a worker killed here is not waited for, and a
restart takes its id back at once (containers sharing a host name must share a PID namespace).

What the caller handles: :class:`RoundGone` (a ``KeyError``) when a round or snapshot it reads was
collected (resynchronize from :meth:`RoundStore.latest_snapshot`); :class:`LeaseLost` when another
process took this worker's id; :class:`Stopped` when the ``stop`` it handed
:meth:`RoundStore.members` said to give up the wait (a preemption); ``errors.UserValueError`` (one
line, nothing written) from :meth:`RoundStore.check_run` and :meth:`RoundStore.acquire`.
"""

import io
import json
import os
import re
import socket
import sys
import time
import uuid

import fsspec
import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 names with NumPy)
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from acco_jax import errors

_BLOCK = re.compile(r"w(\d+)\.d(\d+)\.npy")
_LEASE = re.compile(r"w(\d+)\.p(\d+)\.json")


class RoundGone(KeyError):
  """A round or snapshot was garbage-collected while (or before) it was read: resynchronize."""


class LeaseLost(errors.UserRuntimeError):
  """Another process took this worker's lease (this one was silent longer than ``lease_s``)."""


class Stopped(Exception):
  """The caller's ``stop`` turned true while :meth:`RoundStore.members` waited: the round is left
  undecided, to the others (this worker's payload, if whole, may still be taken)."""


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  return f"{type(e).__name__}: {text[:200]}"


def _show(value) -> str:
  return value if isinstance(value, str) else json.dumps(value)


def _unnamed(dtype: np.dtype) -> bool:
  """A dtype .npy files cannot name (ml_dtypes' bfloat16, float8...): saved as bits + a name."""
  return dtype.kind == "V" and dtype.type is not np.void


def encode_array(x: np.ndarray) -> bytes:
  """``np.save`` bytes; a dtype NumPy cannot name (bfloat16, float8) as an npz of bits + name."""
  x = np.asarray(x)
  buf = io.BytesIO()
  if _unnamed(x.dtype):
    bits = x.view(f"u{x.dtype.itemsize}")
    np.savez(buf, data=bits, dtype=np.array(x.dtype.name))
  else:
    np.save(buf, x, allow_pickle=False)
  return buf.getvalue()


def decode_array(data: bytes) -> np.ndarray:
  loaded = np.load(io.BytesIO(data), allow_pickle=False)
  if isinstance(loaded, np.ndarray):
    return loaded
  with loaded:
    return loaded["data"].view(np.dtype(str(loaded["dtype"])))


def encode_arrays(arrays: dict[str, np.ndarray]) -> bytes:
  """An npz of named arrays; those of a dtype NumPy cannot name are kept as bits + a name table."""
  plain, names = {}, {}
  for key, x in arrays.items():
    x = np.asarray(x)
    if _unnamed(x.dtype):
      names[key] = x.dtype.name
      x = x.view(f"u{x.dtype.itemsize}")
    plain[key] = x
  buf = io.BytesIO()
  np.savez(buf, __dtypes__=np.array(json.dumps(names)), **plain)
  return buf.getvalue()


def decode_arrays(data: bytes) -> dict[str, np.ndarray]:
  with np.load(io.BytesIO(data), allow_pickle=False) as loaded:
    names = json.loads(str(loaded["__dtypes__"]))
    return {
      k: loaded[k].view(np.dtype(names[k])) if k in names else loaded[k]
      for k in loaded.files
      if k != "__dtypes__"
    }


class RoundStore:
  """One worker process's view of the store at ``url`` (see the module docstring).

  ``worker`` is the worker id (``loco.worker``), ``process`` this process's index inside the
  worker's own job. ``clock`` and ``sleep`` are injectable for tests. ``storage_options`` go to
  the filesystem (e.g. ``endpoint_url`` of an S3-compatible server; fsspec also reads them from
  environment variables such as ``FSSPEC_S3_ENDPOINT_URL``).
  """

  def __init__(
    self,
    url: str,
    worker: int,
    *,
    process: int = 0,
    grace_s: float = 30.0,
    min_workers: int = 1,
    lease_s: float = 120.0,
    keep_rounds: int = 4,
    poll_s: float = 0.05,
    clock=time.time,
    sleep=time.sleep,
    storage_options: dict | None = None,
  ):
    self.url, self.worker, self.process = url, int(worker), int(process)
    self.grace_s, self.min_workers, self.lease_s = grace_s, max(1, int(min_workers)), lease_s
    self.keep_rounds, self.poll_s, self.clock, self.sleep = keep_rounds, poll_s, clock, sleep
    self.fs, self.root = _open_fs(url, storage_options or {})
    self.root = self.root.rstrip("/")
    self.local = isinstance(self.fs, LocalFileSystem)
    self.host, self.pid = socket.gethostname(), os.getpid()
    self._token = None  # set while this process holds its lease
    self._lost = None  # the LeaseLost once another process took the lease
    self._from_round = 0
    self._beat_at = -float("inf")

  # ---- paths
  def _path(self, *parts) -> str:
    return "/".join((self.root,) + tuple(str(p) for p in parts))

  def _round(self, r: int, *name: str) -> str:
    return self._path("rounds", f"{r:08d}", *name)

  def _snap(self, r: int, *name: str) -> str:
    return self._path("snapshots", f"{r:08d}", *name)

  def _lease_path(self) -> str:
    return self._path("workers", f"w{self.worker}.p{self.process}.json")

  # ---- atomic writes and tolerant reads
  def _tmp(self, path: str) -> str:
    parent, _, name = path.rpartition("/")
    self.fs.makedirs(parent, exist_ok=True)
    return f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"

  def _put(self, path: str, data: bytes) -> None:
    """Write ``path`` whole: a reader sees the old object, the new one, or none; never a part."""
    if not self.local:
      self.fs.pipe_file(path, data)
      return
    tmp = self._tmp(path)
    self.fs.pipe_file(tmp, data)
    self.fs.mv(tmp, path)

  def _create(self, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; True if this call created it."""
    if self.local:
      tmp = self._tmp(path)
      self.fs.pipe_file(tmp, data)
      try:
        os.link(tmp, path)  # atomic and exclusive: never a partly written file under ``path``
        return True
      except FileExistsError:
        return False
      except OSError:  # a filesystem without hard links: exclusive open, readers retry a part
        pass
      finally:
        self.fs.rm_file(tmp)
    try:
      with self.fs.open(path, "xb") as f:
        f.write(data)
      return True
    except FileExistsError:
      return False

  def _read_json(self, path: str) -> dict:
    """The JSON object at ``path`` (FileNotFoundError if none); retries a write seen half done."""
    for attempt in range(100):
      data = self._cat(path)
      try:
        return json.loads(data)
      except json.JSONDecodeError:
        if attempt == 99:
          raise
        time.sleep(0.02)
    raise AssertionError("unreachable")

  def _cat(self, path: str) -> bytes:
    """The object at ``path``, read fresh (s3fs sizes a read from its listing cache)."""
    self.fs.invalidate_cache(path)
    return self.fs.cat_file(path)

  def _has(self, path: str) -> bool:
    self.fs.invalidate_cache(path)
    return self.fs.exists(path)

  def _rm(self, path: str) -> None:
    """Delete ``path`` (a folder with what is in it); already gone is fine (two collectors)."""
    try:
      self.fs.rm(path, recursive=True)
    except FileNotFoundError:
      pass

  def _ls(self, path: str) -> list[str]:
    """Base names under ``path`` (none if it does not exist), listing cache dropped first."""
    self.fs.invalidate_cache(path)
    try:
      entries = self.fs.ls(path, detail=False)
    except FileNotFoundError:
      return []
    return [e.rstrip("/").rpartition("/")[2] for e in entries]

  # ---- the run's record
  def _probe(self) -> None:
    """Write then delete a probe object; one line naming the URL and the fix if that fails."""
    probe = self._path(f".probe-{uuid.uuid4().hex}")
    try:
      if self.local:
        self.fs.makedirs(self.root, exist_ok=True)
      self._put(probe, b"probe")
      self.fs.rm_file(probe)
    except PermissionError as e:
      raise errors.UserValueError(
        f"the store {self.url} is read-only for this worker ({_one_line(e)}): give it write "
        "access or choose another location in loco.transport=store:<url>"
      ) from None
    except Exception as e:  # noqa: BLE001  (any backend's failure to reach or write the store)
      raise errors.UserValueError(
        f"the store {self.url} cannot be reached ({_one_line(e)}): check the URL, the network "
        "and the credentials, or choose another location in loco.transport=store:<url>"
      ) from None

  def check_run(self, record: dict) -> None:
    """Record ``record`` as the run's (run.json), or check it equals the one recorded there.

    ``record["run"]`` names the run; every other key is config every worker must share. Raises
    :class:`errors.UserValueError` (one line; nothing written) for an unwritable store, another
    run's store, or a differing key.
    """
    self._probe()
    body = json.dumps(record, indent=1).encode()
    ours = json.loads(body)
    path = self._path("run.json")
    if self._create(path, body):
      return
    theirs = self._read_json(path)
    if theirs.get("run") != ours.get("run"):
      raise errors.UserValueError(
        f"the store {self.url} holds another run ({_show(theirs.get('run'))}), not "
        f"{_show(ours.get('run'))}: use an empty location or the run's own store"
      )
    missing = "(absent)"
    for key in list(ours) + [k for k in theirs if k not in ours]:
      if ours.get(key, missing) != theirs.get(key, missing):
        raise errors.UserValueError(
          f"worker {self.worker}'s {key}={_show(ours.get(key, missing))} differs from the run's "
          f"{_show(theirs.get(key, missing))} recorded in {self.url.rstrip('/')}/run.json: "
          "launch every worker with the run's config"
        )

  # ---- leases
  def _lease_body(self) -> bytes:
    lease = dict(worker=self.worker, process=self.process, host=self.host, pid=self.pid)
    lease.update(token=self._token, time=self.clock(), from_round=self._from_round)
    return json.dumps(lease).encode()

  def _holder_alive(self, lease: dict) -> bool:
    if self.clock() - lease.get("time", 0.0) >= self.lease_s:
      return False
    if lease.get("host") == self.host:
      try:
        os.kill(int(lease["pid"]), 0)
      except ProcessLookupError:
        return False  # killed on this host: its id is free at once
      except PermissionError:
        return True  # another user's live process
    return True

  def _who(self) -> str:
    return f"worker {self.worker}" + (f" (process {self.process})" if self.process else "")

  def acquire(self, *, from_round: int = 0) -> None:
    """Hold this (worker, process)'s lease; refuses in one line if a live holder has it.

    A lease that is stale (not renewed for ``lease_s``) or whose holder is a dead process on
    this host is taken over. ``from_round``: the first round this worker publishes (a joiner's),
    so that the rounds before it do not wait for it.
    """
    self._token, self._from_round, self._lost = uuid.uuid4().hex, int(from_round), None
    done = self._path("workers", f"w{self.worker}.finished.json")
    if self.process == 0 and self._has(done):  # back to train more: waited for again
      self.fs.rm_file(done)
    path = self._lease_path()
    for _ in range(10):
      if self._create(path, self._lease_body()):
        self._beat_at = self.clock()
        return
      try:
        held = self._read_json(path)
      except FileNotFoundError:
        continue  # released meanwhile
      if self._holder_alive(held):
        self._token = None
        age = self.clock() - held.get("time", 0.0)
        raise errors.UserValueError(
          f"{self._who()} is already running (host {held.get('host')}, pid {held.get('pid')}, "
          f"seen {age:.0f} s ago): give each worker its own loco.worker"
        )
      self._put(path, self._lease_body())
      self._beat_at = self.clock()
      self._check_token()
      return
    raise errors.UserRuntimeError(f"{self._who()} could not take its lease in {self.url}")

  def _check_token(self) -> dict:
    try:
      held = self._read_json(self._lease_path())
    except FileNotFoundError:
      return {}
    if held.get("token") != self._token:
      self._token = None
      self._lost = LeaseLost(
        f"{self._who()}'s lease in {self.url} was taken by host {held.get('host')}, pid "
        f"{held.get('pid')} (this process was silent longer than lease_s={self.lease_s:g} s): "
        "give each worker its own loco.worker, or a longer lease"
      )
      raise self._lost
    return held

  def heartbeat(self, *, force: bool = False) -> None:
    """Renew the lease (at most every ``lease_s / 8`` unless ``force``).

    Raises LeaseLost if another process took it, and again at every later call (and at
    :meth:`publish`), so that a heartbeat thread swallowing it does not hide it.
    """
    if self._lost is not None:
      raise self._lost
    if self._token is None:
      return
    if not force and self.clock() - self._beat_at < self.lease_s / 8:
      return
    self._check_token()
    self._put(self._lease_path(), self._lease_body())
    self._beat_at = self.clock()

  def finish(self, r: int) -> None:
    """This worker finished the run after round ``r``: recorded (the others' rounds stop counting
    it toward ``min_workers``), then its lease given up."""
    if self.process == 0:
      self._put(
        self._path("workers", f"w{self.worker}.finished.json"), json.dumps({"round": r}).encode()
      )
    self.release()

  def finished_workers(self) -> set[int]:
    """Ids of the workers that finished the run."""
    names = self._ls(self._path("workers"))
    return {int(n[1:].split(".")[0]) for n in names if n.endswith(".finished.json")}

  def release(self) -> None:
    """Give the lease up (this worker leaves; the next rounds do not wait for it)."""
    if self._token is None:
      return
    try:
      if self._read_json(self._lease_path()).get("token") == self._token:
        self.fs.rm_file(self._lease_path())
    except FileNotFoundError:
      pass
    self._token = None

  def _leases(self) -> list[dict]:
    folder = self._path("workers")
    paths = [f"{folder}/{n}" for n in self._ls(folder) if _LEASE.fullmatch(n)]
    out = []
    for data in self.fs.cat(paths, on_error="omit").values() if paths else ():
      try:
        out.append(json.loads(data))
      except json.JSONDecodeError:
        continue  # a lease being written: counted at the next look
    return [x for x in out if self._holder_alive(x)]

  def live_workers(self) -> list[int]:
    """Worker ids holding a lease renewed within ``lease_s`` (by any of their processes),
    less those whose holder is a process of this host that is gone."""
    return sorted({int(x["worker"]) for x in self._leases()})

  def _expected(self, r: int) -> set[int]:
    """Live workers that publish into round ``r`` (not joiners whose first round is later)."""
    return {int(x["worker"]) for x in self._leases() if x.get("from_round", 0) <= r}

  # ---- rounds
  def _block(self, r: int, worker: int, rank: int) -> str:
    return self._round(r, f"w{worker}.d{rank}.npy")

  def publish(self, r: int, blocks: dict[int, np.ndarray]) -> bool:
    """Write this worker's payload blocks of round ``r`` (data rank -> array).

    False, leaving nothing written, if round ``r`` was decided (or collected) before the payload
    was whole: the worker is late and resynchronizes instead. True means the payload was whole
    before this process saw a decision; only :meth:`members` says whether it made the round.
    """
    if self._lost is not None:
      raise self._lost
    if self.decided(r) is not None or self.collected(r):
      return False
    for rank, x in sorted(blocks.items()):
      self._put(self._block(r, self.worker, int(rank)), encode_array(x))
    members = self.decided(r)
    if members is not None and self.worker not in members:  # decided while we wrote
      for rank in blocks:
        self.fs.rm(self._block(r, self.worker, int(rank)))
      return False
    return True

  def arrived(self, r: int, ranks: int) -> list[int]:
    """Workers with all ``ranks`` blocks of round ``r`` in the store now (no waiting)."""
    seen: dict[int, set[int]] = {}
    for name in self._ls(self._round(r)):
      m = _BLOCK.fullmatch(name)
      if m:
        seen.setdefault(int(m[1]), set()).add(int(m[2]))
    return sorted(w for w, got in seen.items() if got >= set(range(ranks)))

  def decided(self, r: int) -> list[int] | None:
    """Round ``r``'s members if it is decided, else None (does not wait)."""
    try:
      return list(self._read_json(self._round(r, "set.json"))["members"])
    except FileNotFoundError:
      return None

  def decision(self, r: int) -> dict | None:
    """Round ``r``'s whole set.json record (members, decided_by, time, live), or None."""
    try:
      return self._read_json(self._round(r, "set.json"))
    except FileNotFoundError:
      return None

  def latest_decided(self) -> int:
    """The highest decided round, -1 if none."""
    folder = self._path("rounds")
    for name in sorted((n for n in self._ls(folder) if n.isdigit()), reverse=True):
      if self._has(f"{folder}/{name}/set.json"):
        return int(name)
    return -1

  def _decide(self, r: int, arrived: list[int], live: set[int]) -> list[int]:
    record = dict(round=r, members=sorted(arrived), decided_by=self.worker, process=self.process)
    record.update(time=self.clock(), live=sorted(live))
    if self._create(self._round(r, "set.json"), json.dumps(record).encode()):
      return record["members"]
    return self.decided(r)

  def _ready(self, arrived, live: set[int], first: float | None, done=frozenset()) -> bool:
    # a worker that finished the run is not waited for: it lowers the quorum (a dead one does not)
    if len(arrived) < max(1, self.min_workers - len(set(done) - set(arrived))):
      return False
    return live <= set(arrived) or self.clock() - first >= self.grace_s

  def members(self, r: int, ranks: int, *, timeout_s: float | None = None, stop=None) -> list[int]:
    """Block until round ``r`` is decided; its sorted member ids.

    A worker has arrived when all ``ranks`` of its blocks are in the store. This process decides
    (if no one else did first) once every live worker has arrived, or ``grace_s`` after it first
    saw an arrival; either way only with at least ``min_workers`` arrived. Short of those it
    waits (a line on stderr each minute), renewing its lease. Raises :class:`RoundGone` if the
    round was collected, ``errors.UserTimeoutError`` after ``timeout_s`` (None: never), and
    :class:`Stopped` once ``stop()`` (a callable, looked at every poll; None: never) is true
    while the round cannot be decided yet.
    """
    start = self.clock()
    first, live, done, live_at = None, set(), set(), -float("inf")
    said_at, poll = start, self.poll_s
    while True:
      got = self.decided(r)
      if got is not None:
        return got
      if self.clock() - live_at >= 1.0:
        if self.collected(r):
          raise RoundGone(f"round {r} of {self.url} was collected")
        live, done, live_at = self._expected(r), self.finished_workers(), self.clock()
      arrived = self.arrived(r, ranks)
      if arrived and first is None:
        first = self.clock()
      if self._ready(arrived, live, first, done):
        return self._decide(r, arrived, live)
      self.heartbeat()
      if stop is not None and stop():
        raise Stopped(f"stopped waiting for round {r} of {self.url}")
      waited = self.clock() - start
      if timeout_s is not None and waited >= timeout_s:
        raise errors.UserTimeoutError(self._waiting(r, arrived, live, waited))
      if self.clock() - said_at >= 60.0:
        said_at = self.clock()
        print(self._waiting(r, arrived, live, waited), file=sys.stderr, flush=True)
      self.sleep(poll)
      if waited > 2.0:
        poll = min(max(self.poll_s, 0.5), poll * 1.1)

  def _waiting(self, r: int, arrived: list[int], live: set[int], waited: float) -> str:
    return (
      f"round {r} of {self.url} undecided after {waited:.0f} s: arrived {arrived}, live "
      f"{sorted(live)}, missing {sorted(live - set(arrived))}, loco.min_workers="
      f"{self.min_workers}, grace {self.grace_s:g} s"
    )

  def read(self, r: int, worker: int, rank: int) -> np.ndarray:
    """Worker ``worker``'s block of data rank ``rank`` in round ``r`` (RoundGone if collected)."""
    try:
      data = self._cat(self._block(r, worker, rank))
    except FileNotFoundError:
      if self.collected(r):
        raise RoundGone(f"round {r} of {self.url} was collected") from None
      raise
    return decode_array(data)

  def collected(self, r: int) -> bool:
    """Whether round ``r`` was collected (a reader of it resynchronizes from a snapshot)."""
    try:
      return r < self._read_json(self._path("gc.json"))["rounds_below"]
    except FileNotFoundError:
      return False

  # ---- snapshots (the global state before a round, for joiners and resyncs)
  def write_snapshot(self, r: int, rank: int, arrays: dict[str, np.ndarray]) -> None:
    """Data rank ``rank``'s part of the global state before round ``r`` (complete once every
    rank is written and :meth:`finish_snapshot` is called)."""
    self._put(self._snap(r, f"d{rank}.npz"), encode_arrays(arrays))

  def finish_snapshot(self, r: int) -> None:
    """Mark round ``r``'s snapshot complete: call after every rank's :meth:`write_snapshot`."""
    self._put(self._snap(r, "done"), json.dumps(dict(round=r, time=self.clock())).encode())

  def read_snapshot(self, r: int, rank: int) -> dict[str, np.ndarray]:
    """Data rank ``rank``'s arrays of snapshot ``r`` (RoundGone if it was collected)."""
    try:
      return decode_arrays(self._cat(self._snap(r, f"d{rank}.npz")))
    except FileNotFoundError:
      raise RoundGone(f"snapshot {r} of {self.url} is gone: read latest_snapshot()") from None

  def _snapshots(self) -> tuple[list[int], list[int]]:
    """(all snapshot rounds, the complete ones), ascending."""
    folder = self._path("snapshots")
    rounds = sorted(int(n) for n in self._ls(folder) if n.isdigit())
    return rounds, [r for r in rounds if self._has(self._snap(r, "done"))]

  def latest_snapshot(self) -> int | None:
    """The round of the newest complete snapshot, None if there is none."""
    complete = self._snapshots()[1]
    return complete[-1] if complete else None

  # ---- garbage
  def collect(self, r: int) -> None:
    """Delete rounds below ``r - keep_rounds`` and every snapshot but the two newest complete
    ones (and those newer: being written). A reader of what is deleted gets RoundGone."""
    below = r - self.keep_rounds
    if below > 0:
      gc = self._path("gc.json")
      try:
        below = max(below, self._read_json(gc)["rounds_below"])
      except FileNotFoundError:
        pass
      self._put(gc, json.dumps(dict(rounds_below=below)).encode())  # before deleting: readers
      folder = self._path("rounds")
      for name in self._ls(folder):
        if name.isdigit() and int(name) < below:
          self._rm(f"{folder}/{name}")
    rounds, complete = self._snapshots()
    if complete:
      keep = set(complete[-2:]) | {s for s in rounds if s > complete[-1]}
      for s in rounds:
        if s not in keep:
          self._rm(self._snap(s))


def _open_fs(url: str, storage_options: dict):
  """(filesystem, path) of a store URL; one line for an unknown protocol or a missing backend."""
  try:
    return fsspec.core.url_to_fs(url, **storage_options)
  except ImportError as e:
    raise errors.UserRuntimeError(
      f"the store {url} needs a filesystem package this environment lacks ({_one_line(e)}): "
      "install it (e.g. pip install s3fs or gcsfs)"
    ) from None
  except ValueError as e:
    raise errors.UserValueError(
      f"the store {url} has no known filesystem ({_one_line(e)}): use a directory or an "
      "fsspec URL such as s3://bucket/run, gs://bucket/run or file:///shared/run"
    ) from None
