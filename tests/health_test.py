"""Slow and hung workers: the detectors alone, then a real two-process run whose peer stops or dies.

The end-to-end test runs ``train.py`` as two ``jax.distributed`` processes (gloo, one CPU device
each); worker 1 sleeps after each forward pass (``hetero.slowdown``). It checks that the probe names
process 1 as slow, that killing process 1 (SIGKILL: the collective fails) and freezing it (SIGSTOP:
the collective never returns) each end process 0 within the timeout with a message naming process
1, and that rerunning the same command resumes from the last checkpoint and finishes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from acco_jax.run import monitor
from tests.multiprocess_test import free_port, worker_env

REPO = Path(__file__).resolve().parent.parent

# -- detectors ------------------------------------------------------------------------------------


def test_slow_workers_are_named_against_the_others():
  assert monitor.slow_workers([1.0, 1.1, 0.9, 4.0], 2.0) == [(3, pytest.approx(4.0))]
  assert monitor.slow_workers([0.004, 0.204], 2.0) == [(1, pytest.approx(51.0))]
  assert monitor.slow_workers([1.0, 1.3, 0.8, 1.5], 2.0) == []
  message = monitor.slow_message([1.0, 1.0, 3.0], 2.0, stage=7)
  assert message.startswith("stage 7: slow worker(s): process 2 (3.0x the others")


def test_collective_failures_are_told_apart_from_other_errors():
  assert monitor.is_collective_failure(
    ValueError("UNKNOWN: Gloo AllGather failed: Connection closed by peer [127.0.0.1]:40127")
  )
  assert not monitor.is_collective_failure(ValueError("opt.lr must be > 0, got 0.0"))
  assert not monitor.is_collective_failure(FloatingPointError("non-finite loss before stage 3"))


class FakeStore:
  """The two key-value calls of the jax.distributed client."""

  def __init__(self):
    self.kv = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    self.kv[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_watchdog_names_the_silent_peer_only_after_progress_stops():
  store, hangs = FakeStore(), []
  store.key_value_set("acco_jax/heartbeat/1", f"12 {time.time() - 60:.3f}")  # process 1: silent
  dog = monitor.Watchdog(
    0.4, process_index=0, process_count=3, interval_s=0.05, on_hang=hangs.append, client=store
  ).start()
  try:
    time.sleep(0.6)
    assert not hangs  # not armed before the first completed stage (compilation)
    for stage in range(1, 8):
      dog.progress(stage)
      time.sleep(0.1)
    assert not hangs  # progressing
    time.sleep(0.8)
  finally:
    dog.stop()
  assert len(hangs) == 1, hangs
  assert "no progress for" in hangs[0] and "after stage 7" in hangs[0]
  assert re.search(r"process 1 \(silent for 6\d s, last at stage 12\)", hangs[0]), hangs[0]
  assert "process 2 (no heartbeat)" in hangs[0]
  assert "process 0" not in hangs[0].split("peer(s) stopped:")[1]  # its own heartbeat is fresh


class StoppedClock:
  """A CompileClock that says what the test sets."""

  def __init__(self):
    self.compiling_since = None

  def since(self):
    return self.compiling_since

  def close(self):
    pass


def test_a_peer_that_compiles_is_waited_for_and_then_named():
  store, hangs, clock = FakeStore(), [], StoppedClock()
  dog = monitor.Watchdog(
    0.4,
    process_index=0,
    process_count=2,
    interval_s=0.05,
    on_hang=hangs.append,
    client=store,
    compile_clock=clock,
  )
  beat = lambda since=None: store.key_value_set(  # process 1's heartbeat thread
    "acco_jax/heartbeat/1", f"3 {time.time():.3f}" + (f" {since:.3f}" if since else "")
  )
  beat(time.time())
  dog.start()
  try:
    dog.progress(3)
    for _ in range(12):  # 1.2 s idle here, three times the timeout: process 1 compiles
      beat(time.time() - 1)
      time.sleep(0.1)
    assert not hangs
    clock.compiling_since = time.time()  # then this process compiles
    for _ in range(8):
      beat()
      time.sleep(0.1)
    assert not hangs
    clock.compiling_since = None  # nobody compiles: the timeout runs from here
    for _ in range(14):
      beat()
      time.sleep(0.1)
  finally:
    dog.stop()
  assert len(hangs) == 1 and "no progress for" in hangs[0], hangs
  assert dog.heartbeats(compiling=True)[1][2] is None  # the last beat: not compiling


def test_compile_clock_follows_jax_compilations():
  import jax
  import jax.numpy as jnp

  clock = monitor.CompileClock(cap_s=60)
  try:
    assert clock.since() is None
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25)
    f.lower(jnp.ones(7)).as_text()  # lowered, never compiled: counts until a compilation ends
    assert clock.since() is not None and time.time() - clock.since() < 30
    f(jnp.ones(5))  # a compilation ends
    assert clock.since() is None
    stale = monitor.CompileClock(cap_s=0.0)
    jax.jit(lambda x: x - 0.5).lower(jnp.ones(3))
    assert stale.since() is None  # beyond the cap a lowering alone no longer counts
    stale.close()
  finally:
    clock.close()


# -- two real processes ---------------------------------------------------------------------------

TIMEOUT_S = 6


def launch(workdir: Path, tag: str, **health) -> list[subprocess.Popen]:
  """Two processes of the tiny ACCO run, process 1 slowed; ``health``: health.* fields to change
  (the defaults: the watchdog at TIMEOUT_S, slow workers kept)."""
  health = {"hang_timeout_s": TIMEOUT_S, "on_slow": "keep", **health}
  port, procs = free_port(), []
  for i in range(2):
    cmd = [
      sys.executable,
      str(REPO / "train.py"),
      "--config",
      "configs/gpt2_acco.py:tiny",
      "--workdir",
      str(workdir),
      f"--config.dist.coordinator_address=127.0.0.1:{port}",
      "--config.dist.num_processes=2",
      f"--config.dist.process_id={i}",
      "--config.mesh.cpu_devices=1",
      "--config.train.num_updates=16",
      "--config.train.log_every=1",
      "--config.train.eval_every=0",
      "--config.train.sample_tokens=0",
      "--config.ckpt.every=2",
      "--config.ckpt.async_save=False",
      "--config.health.probe_every=4",
      "--config.hetero.slowdown=1:0.02",
      *(f"--config.health.{k}={v}" for k, v in health.items()),
      f"--config.data.cache_dir={REPO / '.pytest_cache' / 'acco_data'}",
    ]
    log = open(workdir.parent / f"{tag}-p{i}.log", "w")
    procs.append(subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stdout=log, stderr=log))
  return procs


def logged_stages(workdir: Path) -> list[int]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
  return [r["stage"] for r in rows if "loss" in r]


def wait_for(condition, timeout, procs):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if condition():
      return
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.2)
  raise AssertionError(f"condition not met; exit codes {[p.poll() for p in procs]}")


def stop_all(procs):
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait(timeout=30)


@pytest.mark.slow
def test_dead_or_frozen_peer_ends_the_run_naming_it_and_the_run_resumes(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  results = {}
  for tag, sig in (("killed", signal.SIGKILL), ("frozen", signal.SIGSTOP)):
    procs = launch(workdir, tag)
    try:
      before = max(logged_stages(workdir), default=0)
      wait_for(lambda b=before: max(logged_stages(workdir), default=0) >= b + 8, 120, procs)
      os.kill(procs[1].pid, sig)
      start = time.time()
      code = procs[0].wait(timeout=TIMEOUT_S + 40)
      results[tag] = (code, time.time() - start)
    finally:
      stop_all(procs)
    log = (tmp_path / f"{tag}-p0.log").read_text()
    assert code == monitor.HANG_EXIT_CODE, log[-3000:]
    assert "process 1 (" in log and "peer(s) stopped" in log, log[-3000:]
  assert results["frozen"][1] < TIMEOUT_S + 15, results  # the watchdog, not a transport error
  first_log = (tmp_path / "killed-p0.log").read_text()
  assert "slow worker(s): process 1" in first_log
  events = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any(e.get("event") == "probe" and len(e["mb_time_s"]) == 2 for e in events)
  restored_before = sum(e.get("event") == "restored" for e in events)

  procs = launch(workdir, "resumed")
  try:
    codes = [p.wait(timeout=240) for p in procs]
  finally:
    stop_all(procs)
  assert codes == [0, 0], (tmp_path / "resumed-p0.log").read_text()[-3000:]
  events = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert sum(e.get("event") == "restored" for e in events) == restored_before + 1
  assert max(logged_stages(workdir)) == 32
  print(
    f"peer SIGKILL: exit after {results['killed'][1]:.1f} s; "
    f"SIGSTOP: exit after {results['frozen'][1]:.1f} s (timeout {TIMEOUT_S} s)"
  )
