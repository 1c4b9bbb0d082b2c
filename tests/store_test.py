"""acco_jax.loco.store: rounds, leases, the run's record, snapshots and garbage in a store.

Host-only and fast: threads, a fake clock, and (for the race to decide) real spawned processes.
"""

import json
import multiprocessing
import os
import pathlib
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings

import ml_dtypes
import numpy as np
import pytest

from acco_jax import errors
from acco_jax.loco import store as store_lib
from acco_jax.loco.store import RoundGone, RoundStore


class FakeTime:
  """A clock that only moves when slept on; ``on_sleep`` runs after each sleep."""

  def __init__(self, on_sleep=None):
    self.now, self.on_sleep = 1000.0, on_sleep

  def clock(self):
    return self.now

  def sleep(self, s):
    self.now += s
    if self.on_sleep:
      self.on_sleep(self.now)


def blocks(worker, ranks=2):
  return {d: np.full((3,), 10 * worker + d, np.float32) for d in range(ranks)}


def files(path):
  return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def workers(url, n, **kw):
  stores = [RoundStore(str(url), w, **kw) for w in range(n)]
  for s in stores:
    s.acquire()
  return stores


# ---- rounds


def test_every_live_worker_arrived_decides_at_once(tmp_path):
  stores = workers(tmp_path, 3, grace_s=1e6)
  for s in stores:
    assert s.publish(0, blocks(s.worker))
  assert stores[1].members(0, 2, timeout_s=60) == [0, 1, 2]
  assert [s.decided(0) for s in stores] == [[0, 1, 2]] * 3
  record = json.loads((tmp_path / "rounds/00000000/set.json").read_text())
  assert record["decided_by"] == 1 and record["live"] == [0, 1, 2] and record["round"] == 0
  np.testing.assert_array_equal(stores[0].read(0, 2, 1), np.full((3,), 21, np.float32))
  assert stores[0].latest_decided() == 0


def test_a_missing_worker_is_left_out_after_the_grace(tmp_path):
  stores = workers(tmp_path, 3, grace_s=0.2)
  for s in stores[:2]:
    s.publish(0, blocks(s.worker))
  start = time.monotonic()
  assert stores[0].members(0, 2) == [0, 1]
  assert time.monotonic() - start >= 0.2
  before = files(tmp_path)
  assert not stores[2].publish(0, blocks(2))  # late: nothing written
  assert files(tmp_path) == before
  assert stores[2].members(0, 2) == [0, 1]


def test_a_partial_payload_has_not_arrived(tmp_path):
  stores = workers(tmp_path, 2, grace_s=0.05)
  stores[0].publish(0, blocks(0))
  stores[1].publish(0, {0: np.zeros(3)})  # rank 1 missing
  assert stores[0].members(0, 2) == [0]


def test_below_min_workers_keeps_waiting_until_one_more_arrives(tmp_path, capsys):
  late = RoundStore(str(tmp_path), 1)
  published = []

  def on_sleep(now):  # worker 1 arrives 90 s in: worker 0 must still be waiting then
    if now >= 1090.0 and not published:
      assert late.decided(0) is None
      published.append(late.publish(0, blocks(1)))

  fake = FakeTime(on_sleep)
  s = RoundStore(str(tmp_path), 0, grace_s=0.5, min_workers=2, clock=fake.clock, sleep=fake.sleep)
  s.acquire()
  s.publish(0, blocks(0))
  assert s.members(0, 2, timeout_s=1000) == [0, 1]
  assert fake.now >= 1090.0
  said = capsys.readouterr().err.strip().splitlines()
  assert said == [
    f"round 0 of {tmp_path} undecided after 60 s: arrived [0], live [0], missing [], "
    "loco.min_workers=2, grace 0.5 s"
  ]


def test_members_can_give_up_after_a_timeout(tmp_path):
  fake = FakeTime()
  s = RoundStore(str(tmp_path), 0, min_workers=2, clock=fake.clock, sleep=fake.sleep)
  s.acquire()
  s.publish(0, blocks(0))
  with pytest.raises(
    errors.UserTimeoutError, match=r"^round 0 of .* undecided after 5 s: arrived \[0\]"
  ):
    s.members(0, 2, timeout_s=5.0)
  assert 5.0 <= fake.now - 1000.0 < 6.0 and s.decided(0) is None


def test_members_gives_up_at_once_when_its_stop_turns_true(tmp_path):
  """A preemption while a worker waits: a thread sets the stop 0.2 s in; the wait (which would
  last the 60 s grace for worker 1) raises Stopped at once (within a poll) and leaves the round
  undecided, worker 0's payload in it; a round that can be decided is decided all the same."""
  stores = workers(tmp_path, 2, grace_s=60.0, poll_s=0.01)
  stores[0].publish(0, blocks(0))
  requested = threading.Event()
  start = time.monotonic()  # before the timer starts: it cannot fire sooner than 0.2 s after this
  threading.Timer(0.2, requested.set).start()
  with pytest.raises(store_lib.Stopped, match="round 0"):
    stores[0].members(0, 2, stop=requested.is_set)
  assert 0.2 <= time.monotonic() - start < 5.0  # the grace is 60 s: a slow CI machine, not a wait
  assert stores[0].decided(0) is None and stores[0].arrived(0, 2) == [0]
  stores[1].publish(0, blocks(1))
  assert stores[0].members(0, 2, stop=requested.is_set) == [0, 1]


def test_a_joiner_is_not_waited_for_before_its_first_round(tmp_path):
  stores = workers(tmp_path, 2, grace_s=1e6)
  joiner = RoundStore(str(tmp_path), 2)
  joiner.acquire(from_round=1)
  assert stores[0].live_workers() == [0, 1, 2]
  for s in stores:
    s.publish(0, blocks(s.worker))
  assert stores[0].members(0, 2, timeout_s=60) == [
    0,
    1,
  ]  # would wait forever for worker 2 otherwise


def test_blocks_keep_their_dtype(tmp_path):
  (s,) = workers(tmp_path, 1)
  payload = {
    0: np.arange(6, dtype=np.uint8).reshape(2, 3),
    1: np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
  }
  s.publish(0, payload)
  assert s.members(0, 2) == [0]
  for rank, x in payload.items():
    got = s.read(0, 0, rank)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(got.astype(np.float32), x.astype(np.float32))


def _race(url, worker, n_rounds, barrier, out):
  """A spawned worker: publish, meet the others at a barrier, then all decide at once.

  Each process pauses 50 ms between seeing a round ready and creating its set.json, so that
  several try to create it together; reports its views and its (round, created) attempts.
  """
  s = RoundStore(url, worker, grace_s=0.3, poll_s=0.01)
  s.acquire()
  ready, create, attempts = s._ready, s._create, []

  def ready_then_pause(*args):
    if ready(*args):
      time.sleep(0.05)
      return True
    return False

  def counting(path, data):
    won = create(path, data)
    if path.endswith("set.json"):
      attempts.append((path, won))
    return won

  s._ready, s._create = ready_then_pause, counting
  views, late = [], []
  for r in range(n_rounds):
    if worker == 2 and r % 5 == 4:
      time.sleep(0.6)  # a straggler: past the others' grace
    published = s.publish(r, blocks(worker, ranks=2))
    if r % 5 != 4:
      barrier.wait(timeout=60)
    views.append(s.members(r, 2, timeout_s=60))
    late.append(not published)
  s.release()
  out.put((worker, views, late, attempts))


def run_racers(url, n, n_rounds):
  ctx = multiprocessing.get_context("spawn")
  barrier, out = ctx.Barrier(n), ctx.Queue()
  procs = [ctx.Process(target=_race, args=(url, w, n_rounds, barrier, out)) for w in range(n)]
  for p in procs:
    p.start()
  results, deadline = [], time.monotonic() + 120
  try:
    while len(results) < n:
      try:
        results.append(out.get(timeout=0.5))
      except queue.Empty:
        crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        assert not crashed and time.monotonic() < deadline, f"racers failed: {crashed}"
  finally:
    for p in procs:
      p.join(timeout=10)
      if p.is_alive():
        p.kill()
  return sorted(results)


def test_processes_racing_to_decide_agree_on_one_set(tmp_path):
  n_rounds = 12
  results = run_racers(str(tmp_path), 3, n_rounds)
  views = [v for _, v, _, _ in results]
  assert views[0] == views[1] == views[2]
  attempts = [a for _, _, _, tries in results for a in tries]
  wins = [path for path, won in attempts if won]
  assert len(wins) == len(set(wins)) == n_rounds  # one decider per round
  assert len(attempts) >= n_rounds + 4  # the creates did collide
  for r in range(n_rounds):
    if r % 5 != 4:
      assert views[0][r] == [0, 1, 2]
    if results[2][2][r]:  # the straggler's publish was refused: not a member, nothing left behind
      assert 2 not in views[0][r]
      assert not list((tmp_path / f"rounds/{r:08d}").glob("w2.*"))


# ---- leases


def test_a_second_live_holder_is_refused_in_one_line(tmp_path):
  RoundStore(str(tmp_path), 2).acquire()
  with pytest.raises(errors.UserValueError) as e:
    RoundStore(str(tmp_path), 2).acquire()
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith("worker 2 is already running (host ")
  assert f"pid {os.getpid()}" in message and "give each worker its own loco.worker" in message


def dead_pid() -> int:
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  return dead.pid


def test_a_worker_killed_on_this_host_is_not_waited_for(tmp_path):
  stores = workers(tmp_path, 2, grace_s=1e6)
  path = tmp_path / "workers/w0.p0.json"
  path.write_text(json.dumps(dict(json.loads(path.read_text()), pid=dead_pid())))
  assert stores[1].live_workers() == [1]
  stores[1].publish(0, blocks(1))
  assert stores[1].members(0, 2, timeout_s=60) == [1]  # at once, not after the grace


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path):
  first = RoundStore(str(tmp_path), 0)
  first.acquire()
  path = tmp_path / "workers/w0.p0.json"
  lease = json.loads(path.read_text())
  path.write_text(json.dumps(dict(lease, pid=dead_pid())))
  second = RoundStore(str(tmp_path), 0)
  second.acquire()
  assert json.loads(path.read_text())["token"] == second._token
  # the same on another host is not provably dead: refused until stale
  path.write_text(json.dumps(dict(lease, pid=dead_pid(), host="elsewhere")))
  with pytest.raises(errors.UserValueError, match="host elsewhere"):
    RoundStore(str(tmp_path), 0).acquire()


def test_a_stale_lease_is_taken_over_and_its_holder_told(tmp_path):
  fake = FakeTime()
  old = RoundStore(str(tmp_path), 1, lease_s=10.0, clock=fake.clock)
  old.acquire()
  fake.now += 11.0
  assert old.live_workers() == []
  new = RoundStore(str(tmp_path), 1, lease_s=10.0, clock=fake.clock)
  new.acquire()
  assert new.live_workers() == [1]
  with pytest.raises(store_lib.LeaseLost, match="worker 1's lease .* was taken by host"):
    old.heartbeat(force=True)
  with pytest.raises(store_lib.LeaseLost):  # again: a heartbeat thread that swallowed it
    old.heartbeat()
  with pytest.raises(store_lib.LeaseLost):
    old.publish(0, blocks(1))
  assert not (tmp_path / "rounds").exists()
  new.heartbeat(force=True)
  new.release()
  assert new.live_workers() == [] and not (tmp_path / "workers/w1.p1.json").exists()


def test_processes_of_one_worker_hold_separate_leases(tmp_path):
  a = RoundStore(str(tmp_path), 3, process=0)
  b = RoundStore(str(tmp_path), 3, process=1)
  a.acquire()
  b.acquire()
  assert a.live_workers() == [3]
  with pytest.raises(errors.UserValueError, match=r"^worker 3 \(process 1\) is already running"):
    RoundStore(str(tmp_path), 3, process=1).acquire()


# ---- the run's record


RECORD = {"run": "tiny-seed0", "loco.method": "diloco", "loco.sync_every": 20}


def test_check_run_records_then_accepts_the_same_run(tmp_path):
  RoundStore(str(tmp_path), 0).check_run(RECORD)
  RoundStore(str(tmp_path), 1).check_run(dict(RECORD))
  assert json.loads((tmp_path / "run.json").read_text()) == RECORD
  assert files(tmp_path) == ["run.json"]  # the probe is gone


def test_check_run_refuses_another_run(tmp_path):
  RoundStore(str(tmp_path), 0).check_run(RECORD)
  with pytest.raises(errors.UserValueError) as e:
    RoundStore(str(tmp_path), 1).check_run(dict(RECORD, run="other"))
  assert str(e.value) == (
    f"the store {tmp_path} holds another run (tiny-seed0), not other: "
    "use an empty location or the run's own store"
  )
  assert files(tmp_path) == ["run.json"]


def test_check_run_names_the_first_differing_key(tmp_path):
  RoundStore(str(tmp_path), 0).check_run(RECORD)
  with pytest.raises(errors.UserValueError) as e:
    RoundStore(str(tmp_path), 3).check_run(dict(RECORD, **{"loco.sync_every": 10}))
  assert str(e.value) == (
    f"worker 3's loco.sync_every=10 differs from the run's 20 recorded in {tmp_path}/run.json: "
    "launch every worker with the run's config"
  )
  with pytest.raises(
    errors.UserValueError, match=r"^worker 3's extra=1 differs from the run's \(absent\)"
  ):
    RoundStore(str(tmp_path), 3).check_run(dict(RECORD, extra=1))
  assert files(tmp_path) == ["run.json"]


def check_as_nobody(url: str) -> str:
  """check_run's refusal in a forked child that dropped root for the user 'nobody'."""
  read, write = os.pipe()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # JAX's warning about forking a multithreaded process
    pid = os.fork()
  if pid == 0:  # the child: never returns into pytest
    said = "no refusal"
    try:
      os.setgid(65534)
      os.setuid(65534)
      RoundStore(url, 0).check_run({"run": "a"})
    except errors.UserValueError as e:
      said = str(e)
    except BaseException as e:  # noqa: BLE001
      said = f"{type(e).__name__}: {e}"
    finally:
      os.write(write, said.encode())
      os._exit(0)
  os.close(write)
  with os.fdopen(read, "rb") as f:
    said = f.read().decode()
  os.waitpid(pid, 0)
  return said


def test_check_run_refuses_a_read_only_store(tmp_path):
  outer = tmp_path
  if os.geteuid() == 0:  # root writes anywhere: check as 'nobody', in a folder it can reach
    outer = pathlib.Path(tempfile.mkdtemp(prefix="store-test-"))
    outer.chmod(0o755)
  store = outer / "ro"
  store.mkdir(mode=0o555)
  try:
    if os.geteuid() == 0:
      said = check_as_nobody(str(store))
    else:
      with pytest.raises(errors.UserValueError) as e:
        RoundStore(str(store), 0).check_run({"run": "a"})
      said = str(e.value)
    assert "\n" not in said
    assert said.startswith(f"the store {store} is read-only for this worker (PermissionError"), said
    assert list(store.iterdir()) == []
  finally:
    if outer != tmp_path:
      shutil.rmtree(outer)


def test_check_run_refuses_an_unreachable_store(tmp_path):
  (tmp_path / "a_file").write_text("x")
  url = str(tmp_path / "a_file" / "run")
  with pytest.raises(errors.UserValueError) as e:
    RoundStore(url, 0).check_run(RECORD)
  assert "\n" not in str(e.value)
  assert str(e.value).startswith(f"the store {url} cannot be reached (")
  assert files(tmp_path) == ["a_file"]
  with pytest.raises(
    errors.UserValueError, match=r"^the store nope://x/run has no known filesystem"
  ):
    RoundStore("nope://x/run", 0)


# ---- snapshots and garbage


def test_snapshot_roundtrip_and_completeness(tmp_path):
  s = RoundStore(str(tmp_path), 0)
  assert s.latest_snapshot() is None
  arrays = {
    "params/w": np.arange(6, dtype=np.float32).reshape(2, 3),
    "outer/mu": np.array([0.5, 1.0], dtype=ml_dtypes.bfloat16),
    "step": np.array(7, dtype=np.int64),
  }
  for rank in range(2):
    s.write_snapshot(5, rank, arrays)
  assert s.latest_snapshot() is None  # not finished
  s.finish_snapshot(5)
  assert s.latest_snapshot() == 5
  got = s.read_snapshot(5, 1)
  assert sorted(got) == sorted(arrays)
  for k, x in arrays.items():
    assert got[k].dtype == x.dtype and got[k].shape == x.shape
    np.testing.assert_array_equal(got[k].astype(np.float64), x.astype(np.float64))
  with pytest.raises(RoundGone):
    s.read_snapshot(4, 0)


def test_collect_removes_old_rounds_and_all_but_two_snapshots(tmp_path):
  (s,) = workers(tmp_path, 1, keep_rounds=4)
  for r in range(10):
    s.publish(r, blocks(0, ranks=1))
    assert s.members(r, 1) == [0]
  for r in (0, 3, 6, 9):
    s.write_snapshot(r, 0, {"x": np.full(2, r)})
    s.finish_snapshot(r)
  s.write_snapshot(10, 0, {"x": np.zeros(2)})  # being written: kept
  s.write_snapshot(2, 0, {"x": np.zeros(2)})  # abandoned: collected
  s.collect(10)
  assert sorted(p.name for p in (tmp_path / "rounds").iterdir()) == [
    f"{r:08d}" for r in range(6, 10)
  ]
  assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [
    f"{r:08d}" for r in (6, 9, 10)
  ]
  assert s.latest_snapshot() == 9
  np.testing.assert_array_equal(s.read(6, 0, 0), blocks(0, 1)[0])
  with pytest.raises(RoundGone):
    s.read(5, 0, 0)
  with pytest.raises(KeyError):  # RoundGone is a KeyError
    s.members(2, 1)
  with pytest.raises(FileNotFoundError):  # a round never collected and never published
    s.read(8, 1, 0)
  assert not s.publish(4, blocks(0, ranks=1))  # into a collected round: refused, nothing written
  assert not (tmp_path / "rounds/00000004").exists()
  s.collect(3)  # an older collect never lowers the floor
  with pytest.raises(RoundGone):
    s.read(5, 0, 0)


# ---- another filesystem


def test_memory_filesystem(tmp_path):
  url = f"memory://store-test-{uuid.uuid4().hex}"
  stores = workers(url, 2, grace_s=0.05)
  stores[0].check_run(RECORD)
  with pytest.raises(errors.UserValueError, match="loco.sync_every=1 differs"):
    stores[1].check_run(dict(RECORD, **{"loco.sync_every": 1}))
  with pytest.raises(errors.UserValueError, match="worker 1 is already running"):
    RoundStore(url, 1).acquire()
  for r in range(6):
    for s in stores[: 1 if r == 3 else 2]:
      assert s.publish(r, blocks(s.worker))
    assert stores[1].members(r, 2) == ([0] if r == 3 else [0, 1])
    assert stores[0].members(r, 2) == stores[1].members(r, 2)
  assert not stores[1].publish(3, blocks(1))
  np.testing.assert_array_equal(stores[1].read(5, 0, 1), blocks(0)[1])
  stores[0].write_snapshot(5, 0, {"a": np.ones(2)})
  stores[0].finish_snapshot(5)
  stores[0].collect(6)
  assert stores[0].latest_decided() == 5 and stores[0].latest_snapshot() == 5
  with pytest.raises(RoundGone):
    stores[0].read(1, 0, 0)
  stores[0].fs.rm(stores[0].root, recursive=True)


def test_s3_through_an_s3_compatible_server(tmp_path):
  """The protocol on S3 semantics (exclusive create = a conditional put): moto's server, local.
  Skipped without s3fs and moto, except where ``ACCO_STORE_S3=1`` (.ci/run's extras step, which
  installs them) makes their absence a failure."""
  if os.environ.get("ACCO_STORE_S3") == "1":
    import moto.server as server_lib
    import s3fs  # noqa: F401
  else:
    pytest.importorskip("s3fs")
    server_lib = pytest.importorskip("moto.server")
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  server = server_lib.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
  server.start()
  try:
    options = dict(
      endpoint_url=f"http://127.0.0.1:{port}", key="test", secret="test", client_kwargs={}
    )
    stores = [
      RoundStore("s3://bucket/run", w, grace_s=0.1, storage_options=options) for w in range(2)
    ]
    stores[0].fs.mkdir("bucket")
    with pytest.raises(errors.UserValueError, match=r"^the store s3://nobucket/run cannot be"):
      RoundStore("s3://nobucket/run", 0, storage_options=options).check_run(RECORD)
    stores[0].check_run(RECORD)
    with pytest.raises(errors.UserValueError, match="holds another run"):
      stores[1].check_run(dict(RECORD, run="other"))
    for s in stores:
      s.acquire()
    with pytest.raises(errors.UserValueError, match="worker 1 is already running"):
      RoundStore("s3://bucket/run", 1, storage_options=options).acquire()
    for r in range(3):
      for s in stores[: 1 if r == 1 else 2]:
        assert s.publish(r, blocks(s.worker))
      assert stores[0].members(r, 2) == stores[1].members(r, 2) == ([0] if r == 1 else [0, 1])
    assert not stores[1].publish(1, blocks(1))
    assert stores[1].fs.ls("bucket/run/rounds/00000001", detail=False) == [
      "bucket/run/rounds/00000001/set.json",
      "bucket/run/rounds/00000001/w0.d0.npy",
      "bucket/run/rounds/00000001/w0.d1.npy",
    ]
    np.testing.assert_array_equal(stores[1].read(2, 0, 1), blocks(0)[1])
    stores[0].write_snapshot(2, 0, {"a": np.ones(2, ml_dtypes.bfloat16)})
    stores[0].finish_snapshot(2)
    assert stores[1].latest_snapshot() == 2
    assert stores[1].read_snapshot(2, 0)["a"].dtype == ml_dtypes.bfloat16
    RoundStore("s3://bucket/run", 0, keep_rounds=1, storage_options=options).collect(3)
    with pytest.raises(RoundGone):
      stores[1].read(1, 0, 0)
    assert stores[1].latest_decided() == 2
  finally:
    server.stop()


def test_a_worker_that_finished_the_run_lowers_the_quorum_a_dead_one_does_not(tmp_path):
  """min_workers=2: worker 1 finished the run, so worker 0's round closes alone; a worker that
  is away without finishing still holds the quorum up."""
  fake = FakeTime()
  done = RoundStore(str(tmp_path), 1)
  done.acquire()
  done.finish(4)
  assert done.finished_workers() == {1} and done.live_workers() == []
  s = RoundStore(str(tmp_path), 0, grace_s=0.5, min_workers=2, clock=fake.clock, sleep=fake.sleep)
  s.acquire()
  s.publish(5, blocks(0))
  assert s.members(5, 2, timeout_s=100) == [0]
  away = RoundStore(str(tmp_path / "other"), 0, grace_s=0.5, min_workers=2, clock=fake.clock)
  away.sleep = fake.sleep
  away.acquire()
  away.publish(0, blocks(0))
  with pytest.raises(errors.UserTimeoutError, match=r"arrived \[0\]"):
    away.members(0, 2, timeout_s=100)
  done.acquire()  # worker 1 back to train more: waited for again
  assert done.finished_workers() == set()
