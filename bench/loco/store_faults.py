r"""Faults among LoCo workers that meet through a store, against the same faults under one SPMD job.

Two arms run the same tiny DiLoCo run (the tiny preset, one CPU device per process, ``M`` workers,
``H = --sync-every``):

* ``store``: ``M`` separate ``train.py`` processes, ``--config.loco.transport=store:<url>``, each with
  its own worker id and workdir. A round closes when every live worker has published, or
  ``loco.grace_s`` after the first arrival with at least ``loco.min_workers``.
* ``spmd``: today's run, one ``jax.distributed`` job of ``M`` processes (gloo), the workers a mesh
  axis, with C4's watchdog (``health.hang_timeout_s``) and its restart (``bench.run.c4``'s loop).

Faults, all on one victim (seeded: a worker in ``1..M-1``, at a stage of worker 0 drawn in 30-45%
of the run):

* ``none``: the reference.
* ``kill``: SIGKILL, not restarted. SPMD: the survivors exit 75 with ``health.json``; their restart
  without the victim (``health.exclude=auto``) is tried and its answer recorded.
* ``kill-restart``: SIGKILL, the same command started again ``--restart-after`` seconds later (it
  resumes from its workdir). SPMD: every process relaunched (a spare replaces the victim), from the
  last checkpoint.
* ``stall``: SIGSTOP for ``--stall-s`` (longer than ``grace_s``), then SIGCONT.
* ``join``: the run starts with ``M - 1`` workers; the victim starts at the fault. No SPMD
  counterpart: a job's processes are fixed when it starts, and a LoCo checkpoint refuses another
  mesh.
* ``slow``: the victim runs ``1/--slow-factor`` of every 300 ms (SIGSTOP/SIGCONT) for ``--slow-s``.

Measured per worker, from its ``metrics.jsonl`` (each row's ``wall_s`` anchored to the clock by the
earliest time this bench saw a row of that launch): updates per minute before the fault, during it
and after it, up to the first survivor's end. During is, for kill, the ``--lease-s`` after it (as
long as a dead worker on another host keeps its lease, every round waiting ``grace_s`` for it; on
one host its pid is seen gone at once); for kill-restart and join, until the new launch's first
row; for stall and slow, while it lasts. Also the final training loss (mean of the last 20 rows,
every worker's own data share) and evaluation loss, the loss of the fault-free run at the same
number of tokens summed over workers, and from the store the rounds closed and how many members
each had (``rounds/<r>/set.json``, read while the run goes: old rounds are collected).

``--s3`` serves the store over HTTP: an S3-compatible server (moto's, ``--moto`` names the
executable: install it apart, ``python -m venv /tmp/moto && /tmp/moto/bin/pip install
'moto[server]'``; the workers need ``s3fs``), a bucket, ``store:s3://<bucket>/<run>``. With
``--shape-mbit`` (root) the server and every worker sit in their own network namespace on a bridge,
every end shaped with ``tc tbf`` as :mod:`bench.net.netns` does.

Usage::

  python -m bench.loco.store_faults                                   # both arms, every fault
  python -m bench.loco.store_faults --arms store --scenarios none kill --s3 --shape-mbit 100
  python -m bench.loco.store_faults --smoke --out /tmp/f.json         # 2 workers, none, 24 steps
  python -m bench.loco.store_faults --render bench/results/store_faults.json   # the table again
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench import common

SCENARIOS = ("none", "kill", "kill-restart", "stall", "join", "slow")
NO_SPMD = {"join": "no counterpart: an SPMD job's processes are fixed at its start"}
BASE = {
  "train.log_every": 1,
  "train.eval_every": 0,
  "train.eval_batches": 2,
  "train.sample_tokens": 0,
  "ckpt.async_save": False,
  "mesh.cpu_devices": 1,
  "loco.outer_momentum": 0.9,
}
DUTY_PERIOD_S = 0.3
SMOOTH = 20  # rows averaged for a loss


# ----------------------------------------------------------------------------------------------
# Processes and their metrics


class Tail:
  """Reads new lines of some ``metrics.jsonl`` files every 0.1 s; keeps (time seen, row)."""

  def __init__(self):
    self.lines: dict[Path, list[tuple[float, dict]]] = collections.defaultdict(list)
    self._pos: dict[Path, int] = collections.defaultdict(int)
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def watch(self, workdir: Path) -> None:
    with self._lock:
      self.lines.setdefault(workdir / "metrics.jsonl", [])

  def _loop(self) -> None:
    while not self._stop.is_set():
      self.poll()
      time.sleep(0.1)

  def poll(self) -> None:
    with self._lock:
      for path in list(self.lines):
        if not path.exists():
          continue
        with open(path) as f:
          f.seek(self._pos[path])
          text = f.read()
        done = text.rfind("\n") + 1  # whole lines only
        self._pos[path] += done
        now = time.time()
        for line in text[:done].splitlines():
          if line.strip():
            self.lines[path].append((now, json.loads(line)))

  def stage(self, workdir: Path) -> int:
    with self._lock:
      rows = self.lines[workdir / "metrics.jsonl"]
      return max((r["stage"] for _, r in rows if "loss" in r), default=0)

  def close(self) -> None:
    self._stop.set()
    self._thread.join()
    self.poll()


def timeline(seen: list[tuple[float, dict]]) -> list[dict]:
  """The training rows with ``t``: ``wall_s`` plus its launch's offset to the clock.

  A launch starts at a ``config`` event or where ``wall_s`` goes back; its offset is the smallest
  (time seen - wall_s) over its rows (a row is seen one stage late at best, much later when its
  process was stopped)."""
  launches, last_wall = [], None
  for at, row in seen:
    new = row.get("event") == "config" or (
      "wall_s" in row and last_wall is not None and row["wall_s"] < last_wall
    )
    if new or not launches:
      launches.append([])
    if "loss" in row and "wall_s" in row:
      launches[-1].append((at, row))
      last_wall = row["wall_s"]
    if row.get("event") == "config":
      last_wall = None
  out = []
  for i, rows in enumerate(launches):
    if rows:
      offset = min(at - r["wall_s"] for at, r in rows)
      out += [{**r, "t": r["wall_s"] + offset, "launch": i} for _, r in rows]
  return out


def summaries(seen: list[tuple[float, dict]]) -> list[dict]:
  return [r for _, r in seen if "eval_loss" in r]


def train_command(config: str, workdir: Path, flags: dict) -> list[str]:
  return [
    sys.executable,
    str(common.REPO / "train.py"),
    "--config",
    config,
    "--workdir",
    str(workdir),
    *(f"--config.{k}={v}" for k, v in flags.items()),
  ]


class Launcher:
  """Starts and signals the processes of one scenario (only those, by their handles)."""

  def __init__(self, root: Path, env: dict, prefix: list[str] | None = None):
    self.root, self.env, self.prefix = root, env, prefix or []
    self.procs: dict[str, subprocess.Popen] = {}
    self.logs: dict[str, Path] = {}
    self.started: dict[str, list[float]] = collections.defaultdict(list)

  def start(self, name: str, cmd: list[str], prefix: list[str] | None = None) -> None:
    log = self.root / f"{name}.{len(self.started[name])}.log"
    self.logs[name] = log
    with open(log, "w") as f:
      self.procs[name] = subprocess.Popen(
        [*(self.prefix if prefix is None else prefix), *cmd],
        cwd=common.REPO,
        env=self.env,
        stdout=f,
        stderr=subprocess.STDOUT,
      )
    self.started[name].append(time.time())

  def signal(self, name: str, sig: int) -> None:
    p = self.procs[name]
    if p.poll() is None:
      p.send_signal(sig)

  def alive(self) -> list[str]:
    return [n for n, p in self.procs.items() if p.poll() is None]

  def wait_all(self, cap_s: float) -> bool:
    """True if every process ended within ``cap_s``; the rest are killed."""
    deadline = time.time() + cap_s
    while self.alive() and time.time() < deadline:
      time.sleep(0.2)
    capped = bool(self.alive())
    self.stop()
    return not capped

  def stop(self) -> None:
    for p in self.procs.values():
      if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.kill()
      p.wait(timeout=30)

  def tail(self, name: str, chars: int = 1500) -> str:
    return f"--- {name}\n" + self.logs[name].read_text()[-chars:]


class Slowdown:
  """Runs a process ``1/factor`` of every ``period`` seconds (SIGCONT / SIGSTOP) until stopped."""

  def __init__(self, proc: subprocess.Popen, factor: float, period: float = DUTY_PERIOD_S):
    self.proc, self.run_s = proc, period / factor
    self.stop_s = period - self.run_s
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    while not self._done.is_set() and self.proc.poll() is None:
      time.sleep(self.run_s)
      self.proc.send_signal(signal.SIGSTOP)
      time.sleep(self.stop_s)
      if self.proc.poll() is None:
        self.proc.send_signal(signal.SIGCONT)

  def stop(self) -> None:
    self._done.set()
    self._thread.join()
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGCONT)


def wait_for_stage(tail: Tail, workdir: Path, stage: int, launcher: Launcher, cap_s: float):
  deadline = time.time() + cap_s
  while tail.stage(workdir) < stage:
    dead = [n for n, p in launcher.procs.items() if p.poll() not in (None, 0)]
    if time.time() > deadline or dead:
      names = dead or list(launcher.procs)
      raise RuntimeError(
        f"stage {stage} not reached (ended: {dead})\n" + "\n".join(launcher.tail(n) for n in names)
      )
    time.sleep(0.05)


# ----------------------------------------------------------------------------------------------
# The two arms


def store_flags(args, url: str, worker: int) -> dict:
  return {
    **BASE,
    **run_flags(args),
    "loco.transport": f"store:{url}",
    "loco.workers": args.workers,
    "loco.worker": worker,
    "loco.grace_s": args.grace_s,
    "loco.min_workers": args.min_workers,
    "loco.lease_s": args.lease_s,
    **({"loco.keep_rounds": args.keep_rounds} if args.keep_rounds else {}),
  }


def run_flags(args) -> dict:
  return {
    "method": "diloco",
    "train.num_updates": args.updates,
    "loco.sync_every": args.sync_every,
    "ckpt.every": args.ckpt_every,
    "data.cache_dir": args.data_cache,
    "train.seed": 0,
  }


def fault_plan(args) -> dict:
  rng = random.Random(args.seed)
  victim = rng.randrange(1, args.workers)
  stage = max(2, int(rng.uniform(0.3, 0.45) * args.updates))
  return {"victim": victim, "stage": stage}


def run_store(scenario: str, args, plan: dict, root: Path, store) -> dict:
  """One fault among ``M`` store workers; returns each worker's timeline and the fault's times."""
  url = store.url(f"{scenario}-{int(time.time())}")
  tail = Tail()
  launcher = Launcher(root, store.env, store.prefix(0))
  victim = f"w{plan['victim']}"
  workdirs = {f"w{i}": root / f"w{i}" for i in range(args.workers)}
  cmds = {
    n: train_command(args.config, workdirs[n], store_flags(args, url, i))
    for i, n in enumerate(workdirs)
  }
  for w in workdirs.values():
    tail.watch(w)
  fault: dict = {"victim": victim}
  t0 = time.time()
  rounds = store.watch(url)
  try:
    for i, n in enumerate(workdirs):
      if not (scenario == "join" and n == victim):
        launcher.start(n, cmds[n], store.prefix(i))
    if scenario != "none":
      wait_for_stage(tail, workdirs["w0"], plan["stage"], launcher, args.cap)
      fault["t"] = time.time()
      apply_store_fault(scenario, args, launcher, victim, cmds[victim], store, plan, fault)
    fault["completed"] = wait_store(launcher, victim, tail, workdirs[victim], t0, args, fault)
  finally:
    launcher.stop()
    tail.close()
    fault["rounds"] = rounds.close()
  fault["wall_s"] = time.time() - t0
  fault["exit_codes"] = {n: p.returncode for n, p in launcher.procs.items()}
  fault["starts"] = dict(launcher.started)
  fault["commands"] = {n: " ".join(c) for n, c in cmds.items()}
  fault["errors"] = {  # the last line of a worker that failed on its own (not our SIGKILL)
    n: launcher.logs[n].read_text().strip().splitlines()[-1][:300]
    for n, p in launcher.procs.items()
    if p.returncode not in (0, -signal.SIGKILL, None) and launcher.logs[n].read_text().strip()
  }
  seen = {n: tail.lines[w / "metrics.jsonl"] for n, w in workdirs.items()}
  return {"fault": fault, "seen": seen, "logs": {n: str(p) for n, p in launcher.logs.items()}}


def wait_store(launcher, victim, tail, workdir, t0, args, fault) -> bool:
  """Until every worker ended (True), the cap, or ``--straggler-s`` after every worker but the
  victim ended: a worker behind the others waits for rounds no one else will publish into."""
  others_done = None
  while launcher.alive() and time.time() - t0 < args.cap:
    if not [n for n in launcher.alive() if n != victim]:
      others_done = others_done or time.time()
      if time.time() - others_done > args.straggler_s:
        fault["straggler"] = {"stage": tail.stage(workdir), "waited_s": args.straggler_s}
        break
    time.sleep(0.2)
  done = not launcher.alive()
  launcher.stop()
  return done


def apply_store_fault(scenario, args, launcher, victim, cmd, store, plan, fault) -> None:
  index = plan["victim"]
  if scenario in ("kill", "kill-restart"):
    launcher.signal(victim, signal.SIGKILL)
    launcher.procs[victim].wait()
    fault["end"] = fault["t"] + args.lease_s  # its lease lapses: rounds stop waiting grace_s
    if scenario == "kill-restart":
      time.sleep(args.restart_after)
      fault["restarted"] = time.time()
      launcher.start(victim, cmd, store.prefix(index))
      fault["end"] = None  # the new launch's first row
  elif scenario == "stall":
    launcher.signal(victim, signal.SIGSTOP)
    time.sleep(args.stall_s)
    launcher.signal(victim, signal.SIGCONT)
    fault["end"] = time.time()
  elif scenario == "join":
    launcher.start(victim, cmd, store.prefix(index))
    fault["end"] = None
  elif scenario == "slow":
    slow = Slowdown(launcher.procs[victim], args.slow_factor)
    time.sleep(args.slow_s)
    slow.stop()
    fault["end"] = time.time()


def spmd_flags(args, port: int, process: int, timeout_s: float, exclude: str) -> dict:
  return {
    **BASE,
    **run_flags(args),
    "loco.workers": 0,  # one worker per process's device
    "dist.coordinator_address": f"127.0.0.1:{port}",
    "dist.num_processes": args.workers,
    "dist.process_id": process,
    "dist.timeout_s": 120,
    "health.hang_timeout_s": timeout_s,
    "health.exclude": exclude,
  }


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_spmd(scenario: str, args, plan: dict, root: Path, env: dict) -> dict:
  """One fault in a ``jax.distributed`` job of ``M`` processes; C4's restart where it applies."""
  tail = Tail()
  workdir = root / "run"
  tail.watch(workdir)
  launcher = Launcher(root, env)
  victim = f"p{plan['victim']}"
  watchdog = args.watchdog_s if scenario.startswith("kill") else args.stall_s + 60

  def launch(procs, exclude="off", tag=""):
    port = free_port()
    for i in procs:
      flags = spmd_flags(args, port, i, watchdog, exclude)
      launcher.start(f"p{i}{tag}", train_command(args.config, workdir, flags))

  fault: dict = {"victim": victim}
  t0 = time.time()
  try:
    launch(range(args.workers))
    if scenario != "none":
      wait_for_stage(tail, workdir, plan["stage"], launcher, args.cap)
      fault["t"] = time.time()
      fault["stage"] = tail.stage(workdir)
      if scenario.startswith("kill"):
        spmd_kill(args, scenario, launcher, victim, launch, fault, workdir)
      elif scenario == "stall":
        launcher.signal(victim, signal.SIGSTOP)
        time.sleep(args.stall_s)
        launcher.signal(victim, signal.SIGCONT)
        fault["end"] = time.time()
      elif scenario == "slow":
        slow = Slowdown(launcher.procs[victim], args.slow_factor)
        time.sleep(args.slow_s)
        slow.stop()
        fault["end"] = time.time()
    fault["completed"] = launcher.wait_all(max(args.cap - (time.time() - t0), 10))
  finally:
    launcher.stop()
    tail.close()
  fault["wall_s"] = time.time() - t0
  fault["exit_codes"] = {n: p.returncode for n, p in launcher.procs.items()}
  return {"fault": fault, "seen": {"job": tail.lines[workdir / "metrics.jsonl"]}}


def spmd_kill(args, scenario, launcher, victim, launch, fault, workdir) -> None:
  """SIGKILL and the watchdog's exit; then ``kill``: the restart without the victim
  (``health.exclude=auto``), ``kill-restart``: every process relaunched (a spare for the victim)."""
  launcher.signal(victim, signal.SIGKILL)
  others = [n for n in launcher.procs if n != victim]
  deadline = time.time() + args.watchdog_s * 6
  while any(launcher.procs[n].poll() is None for n in others) and time.time() < deadline:
    time.sleep(0.05)
  fault["exit_s"] = time.time() - fault["t"]
  fault["survivor_codes"] = {n: launcher.procs[n].poll() for n in others}
  launcher.stop()
  verdict = workdir / "health.json"
  fault["verdict"] = json.loads(verdict.read_text()).get("verdict") if verdict.exists() else None
  fault["restarted"] = time.time()
  if scenario == "kill":  # the launch's same commands; the victim's own exits at once
    launch(range(args.workers), exclude="auto", tag="-excl")
    fault["completed_restart"] = launcher.wait_all(180)
    codes = {n: p.returncode for n, p in launcher.procs.items() if n.endswith("-excl")}
    fault["without_victim"] = {
      "codes": codes,
      "lines": [
        line
        for n in codes
        for line in launcher.logs[n].read_text().splitlines()
        if line.startswith("error:") or "excluded" in line
      ][:4],
      "answered_s": time.time() - fault["restarted"],
    }
    fault["end"] = time.time()
    return
  if verdict.exists():  # a spare takes the victim's place: nothing to exclude
    verdict.rename(workdir / f"health.{int(time.time())}.json")
  launch(range(args.workers), tag="-spare")
  fault["end"] = None  # the restart's first row


# ----------------------------------------------------------------------------------------------
# Stores: a local directory, or S3 over HTTP (moto), optionally behind shaped links


class DirStore:
  """A directory; with ``own_hosts`` every worker runs under its own host name (a UTS namespace:
  ``unshare --uts``, root), so that the workers see each other's leases as another host's and
  cannot tell a dead process from a live one by its pid."""

  def __init__(self, root: Path, env: dict, own_hosts: bool = False):
    self.root, self.env, self.own_hosts = root, env, own_hosts

  def url(self, run: str) -> str:
    return str(self.root / run)

  def prefix(self, worker: int) -> list[str]:
    if not self.own_hosts:
      return []
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"worker{worker}"]

  def watch(self, url: str) -> RoundsWatcher:
    from fsspec.implementations.local import LocalFileSystem

    return RoundsWatcher(LocalFileSystem(), url, 0.5)

  def close(self) -> None:
    pass


class S3Store:
  """A moto S3 server on a port, a bucket; optionally namespaces with shaped links."""

  BUCKET = "acco-faults"

  def __init__(self, args, env: dict, tmp: Path):
    from bench.net import netns

    self.netns, self.shaped = netns, None
    self.port, self.proc = free_port(), None
    host = "127.0.0.1"
    server_prefix: list[str] = []
    if args.shape_mbit:
      why = netns.netns_ok()
      if why:
        raise SystemExit(f"--shape-mbit: {why}")
      netns.cleanup()
      self.shaped = netns.setup(args.workers + 1)  # host 0: the server; 1..M: the workers
      netns.shape(self.shaped, args.shape_mbit)
      host = f"{netns.SUBNET}.1"
      self.bench_link(netns)
      server_prefix = ["ip", "netns", "exec", f"{netns.PREFIX}h0"]
    self.endpoint = f"http://{host}:{self.port}"
    self.env = {
      **env,
      "AWS_ACCESS_KEY_ID": "testing",
      "AWS_SECRET_ACCESS_KEY": "testing",
      "AWS_DEFAULT_REGION": "us-east-1",
      "AWS_ENDPOINT_URL": self.endpoint,
      "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
    }
    self.log = open(tmp / "moto.log", "w")
    self.proc = subprocess.Popen(
      [*server_prefix, args.moto, "-H", "0.0.0.0", "-p", str(self.port)],
      stdout=self.log,
      stderr=subprocess.STDOUT,
    )
    self.local_endpoint = self.endpoint
    deadline = time.time() + 60
    while True:
      try:  # S3's CreateBucket: a PUT of /<bucket> (moto checks no signature)
        urllib.request.urlopen(
          urllib.request.Request(f"{self.endpoint}/{self.BUCKET}", method="PUT"), timeout=5
        ).close()
        break
      except OSError as e:  # the server is still starting
        if time.time() > deadline or self.proc.poll() is not None:
          self.close()  # the server and the namespaces this started
          raise RuntimeError(f"moto server at {self.endpoint} did not start: {e}") from e
        time.sleep(0.5)

  @staticmethod
  def bench_link(netns) -> None:
    """An unshaped link from this (the root) namespace to the bridge, for the bench's own reads
    of the store; named like the others so that :func:`bench.net.netns.cleanup` removes it."""
    here, there = f"{netns.PREFIX}rt", f"{netns.PREFIX}rtp"
    netns.sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
    netns.sh("ip", "link", "set", there, "netns", f"{netns.PREFIX}sw")
    netns.sh("ip", "-n", f"{netns.PREFIX}sw", "link", "set", there, "master", f"{netns.PREFIX}br")
    netns.sh("ip", "-n", f"{netns.PREFIX}sw", "link", "set", there, "up")
    netns.sh("ip", "addr", "add", f"{netns.SUBNET}.250/24", "dev", here)
    netns.sh("ip", "link", "set", here, "up")

  def fs(self):
    import s3fs

    return s3fs.S3FileSystem(
      key="testing",
      secret="testing",
      client_kwargs={"endpoint_url": self.local_endpoint, "region_name": "us-east-1"},
      skip_instance_cache=True,
    )

  def url(self, run: str) -> str:
    return f"s3://{self.BUCKET}/{run}"

  def prefix(self, worker: int) -> list[str]:
    if not self.shaped:
      return []
    return ["ip", "netns", "exec", f"{self.netns.PREFIX}h{worker + 1}"]

  def watch(self, url: str) -> RoundsWatcher:
    return RoundsWatcher(self.fs(), url[len("s3://") :], 1.0)

  def close(self) -> None:
    if self.proc and self.proc.poll() is None:
      self.proc.terminate()
      self.proc.wait(timeout=30)
    self.log.close()
    if self.shaped:
      self.netns.cleanup()


class RoundsWatcher:
  """Reads every new ``rounds/<r>/set.json`` of a store while the run goes (the workers collect
  old rounds), every ``every`` seconds and once more at the end."""

  def __init__(self, fs, path: str, every: float):
    self.fs, self.path, self.every = fs, path.rstrip("/"), every
    self.found: dict[int, dict] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    while not self._stop.wait(self.every):
      self.poll()

  def poll(self) -> None:
    self.fs.invalidate_cache()  # s3fs caches listings
    try:
      names = self.fs.ls(f"{self.path}/rounds", detail=False)
    except (FileNotFoundError, OSError):
      return
    for name in names:
      r = name.rstrip("/").split("/")[-1]
      if not r.isdigit() or int(r) in self.found:
        continue
      try:
        self.found[int(r)] = json.loads(self.fs.cat_file(f"{self.path}/rounds/{r}/set.json"))
      except (FileNotFoundError, OSError, ValueError):
        continue  # not decided yet, or collected meanwhile

  def close(self) -> list[dict]:
    self._stop.set()
    self._thread.join()
    self.poll()
    return [{"round": r, **self.found[r]} for r in sorted(self.found)]


# ----------------------------------------------------------------------------------------------
# Analysis


def rate(rows: list[dict], lo: float, hi: float) -> float | None:
  """Stages completed per minute within [lo, hi)."""
  if hi is None or lo is None or hi - lo < 1:
    return None
  n = sum(lo <= r["t"] < hi for r in rows)
  return 60 * n / (hi - lo)


def thin(points: list, at_most: int = 400) -> list:
  """Every k-th point (and the last) so that at most about ``at_most`` remain."""
  k = max(1, -(-len(points) // at_most))
  return points[::k] + ([points[-1]] if points and (len(points) - 1) % k else [])


def smoothed(rows: list[dict], upto: int | None = None) -> float | None:
  """Mean loss over the last SMOOTH rows (at or before stage ``upto``)."""
  picked = [r["loss"] for r in rows if upto is None or r["stage"] <= upto]
  return statistics.fmean(picked[-SMOOTH:]) if picked else None


def analyse(arm: str, scenario: str, res: dict, args, reference: dict | None) -> dict:
  fault, seen = res["fault"], res["seen"]
  lines = {n: timeline(s) for n, s in seen.items()}
  t_fault = fault.get("t")
  end = fault.get("end")
  if end is None and t_fault is not None:  # until the victim's (or the restart's) new first row
    target = fault["victim"] if arm == "store" else "job"
    since = fault.get("restarted", t_fault)
    later = [r for r in lines.get(target, []) if r["t"] > since]
    end = later[0]["t"] if later else None
    if arm == "spmd" and later:
      before = [r["stage"] for r in lines["job"] if r["t"] <= since]
      fault["lost_stages"] = max(before) - (later[0]["stage"] - 1)
  started = (t_fault or float("inf")) - 1
  starts = [rows[1]["t"] for rows in lines.values() if len(rows) > 1 and rows[0]["t"] < started]
  t_begin = max(starts) if starts else None  # every first launch past its compile
  victim = fault["victim"] if arm == "store" else None
  finish = [rows[-1]["t"] for n, rows in lines.items() if rows and n != victim]
  t_finish = min(finish) if finish else None
  t0 = min((rows[0]["t"] for rows in lines.values() if rows), default=0.0)
  workers = {}
  for n, rows in lines.items():
    w = {
      "before": rate(rows, t_begin, t_fault) if t_fault else rate(rows, t_begin, t_finish),
      "during": rate(rows, t_fault, end) if t_fault else None,
      "after": rate(rows, end, t_finish) if t_fault and end else None,
      "final_loss": smoothed(rows),
      "stages": rows[-1]["stage"] if rows else 0,
      "tokens": rows[-1]["tokens_seen"] if rows else 0,
      "eval_loss": [s["eval_loss"] for s in summaries(seen[n])][-1:] or [None],
      "trace": thin([[round(r["t"] - t0, 2), r["stage"], round(r["loss"], 4)] for r in rows]),
    }
    w["eval_loss"] = w["eval_loss"][0]
    workers[n] = w
  survivors = [n for n in workers if n != victim]
  out = {
    "arm": arm,
    "scenario": scenario,
    "victim": fault["victim"],
    "fault": {k: v for k, v in fault.items() if k != "rounds"},
    "window": {"begin": t_begin, "fault": t_fault, "end": end, "finish": t_finish, "t0": t0},
    "workers": workers,
  }
  mean = lambda key: mean_of([workers[n][key] for n in survivors])
  keys = ("before", "during", "after", "final_loss", "eval_loss", "stages")
  out["survivors"] = {k: mean(k) for k in keys}
  if arm == "store":
    out["tokens_all"] = sum(w["tokens"] for w in workers.values())
    rounds = fault.get("rounds", [])
    sizes = collections.Counter(len(r["members"]) for r in rounds if r.get("members") is not None)
    out["rounds"] = {"closed": len(rounds), "members": dict(sorted(sizes.items()))}
    out["rounds_detail"] = rounds
  else:
    out["tokens_all"] = workers["job"]["tokens"] * args.workers if workers else 0
    out["fault"].pop("rounds", None)
  if reference is not None:
    out["equal_tokens"] = equal_tokens(out, reference)
  return out


def mean_of(values):
  values = [v for v in values if v is not None]
  return statistics.fmean(values) if values else None


def equal_tokens(out: dict, reference: dict) -> dict:
  """This run's final loss against the fault-free run's at the same tokens summed over workers."""
  ref_lines = reference["lines"]
  per_stage = reference["tokens_per_stage_all"]
  stage = int(out["tokens_all"] / per_stage) if per_stage else None
  ref = mean_of([smoothed(rows, stage) for rows in ref_lines.values()])
  return {"reference_stage": stage, "reference_loss": ref, "loss": out["survivors"]["final_loss"]}


def fill_equal_tokens(results: list[dict], args) -> None:
  """``equal_tokens`` of results rendered from files whose run had no fault-free reference, from
  the traces of another file's ``none`` of the same arm."""
  for arm in ("store", "spmd"):
    ref = [r for r in results if r["arm"] == arm and r["scenario"] == "none" and "workers" in r]
    if not ref or not all(w.get("trace") for w in ref[0]["workers"].values()):
      continue
    lines = {
      n: [{"stage": s, "loss": loss} for _, s, loss in w["trace"]]
      for n, w in ref[0]["workers"].items()
    }
    tokens = sum(w["tokens"] for w in ref[0]["workers"].values())
    if arm == "spmd":
      tokens *= args.workers
    stages = max(w["stages"] for w in ref[0]["workers"].values())
    reference = {"lines": lines, "tokens_per_stage_all": tokens / stages}
    for r in results:
      if (
        r["arm"] == arm and r["scenario"] != "none" and "workers" in r and not r.get("equal_tokens")
      ):
        r["equal_tokens"] = equal_tokens(r, reference)


def reference_of(res: dict, args) -> dict:
  lines = {n: timeline(s) for n, s in res["seen"].items()}
  tokens = sum(rows[-1]["tokens_seen"] for rows in lines.values() if rows)
  if "job" in lines:
    tokens *= args.workers
  stages = max((rows[-1]["stage"] for rows in lines.values() if rows), default=1)
  return {"lines": lines, "tokens_per_stage_all": tokens / stages}


# ----------------------------------------------------------------------------------------------
# Table


def fmt(x, digits=0) -> str:
  return "-" if x is None else f"{x:.{digits}f}"


def table(results: list[dict]) -> str:
  rows = []
  for r in results:
    if "survivors" not in r:
      rows.append({"arm": r["arm"], "scenario": r["scenario"], "note": r.get("note", "")})
      continue
    s, v = r["survivors"], r["workers"].get(r["victim"], {})
    eq = r.get("equal_tokens") or {}
    note = r.get("note", "")
    rounds = r.get("rounds")
    rows.append(
      {
        "arm": r["arm"],
        "scenario": r["scenario"],
        "before": fmt(s["before"]),
        "during": fmt(s["during"]),
        "after": fmt(s["after"]),
        "victim": "/".join(fmt(v.get(k)) for k in ("before", "during", "after")) if v else "-",
        "stages": fmt(s.get("stages")),
        "loss": fmt(s["final_loss"], 3),
        "ref": fmt(eq.get("reference_loss"), 3),
        "eval": fmt(s["eval_loss"], 3),
        "rounds": "-"
        if not rounds
        else f"{rounds['closed']} ({', '.join(f'{k}:{n}' for k, n in rounds['members'].items())})",
        "wall": fmt(r["fault"].get("wall_s")),
        "note": note,
      }
    )
  return common.format_table(
    rows,
    [
      ("arm", "arm"),
      ("scenario", "fault"),
      ("before", "upd/min before"),
      ("during", "during"),
      ("after", "after"),
      ("victim", "victim b/d/a"),
      ("stages", "last stage"),
      ("loss", "final loss"),
      ("ref", "fault-free at equal tokens"),
      ("eval", "eval loss"),
      ("rounds", "rounds (members:count)"),
      ("wall", "wall s"),
      ("note", "note"),
    ],
  )


def figure(results: list[dict], path: Path) -> Path:
  """The share of its run each worker (store) and the SPMD job has done against time, one panel
  per fault (the last result of each arm and fault), the store fault's window shaded, the SPMD
  fault dotted."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  last = {(r["arm"], r["scenario"]): r for r in results if "workers" in r}
  scenarios = [s for s in SCENARIOS if any(k[1] == s for k in last)]
  fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharey=True, squeeze=False)
  colors = {"w0": "tab:blue", "w1": "tab:orange", "w2": "tab:red", "w3": "tab:green"}
  for ax, scenario in zip(axes.flat, scenarios, strict=False):
    for arm in ("store", "spmd"):
      r = last.get((arm, scenario))
      if r is None:
        continue
      w, t0 = r["window"], r["window"]["t0"]
      total = max(x["stages"] for x in r["workers"].values()) or 1
      for name, worker in sorted(r["workers"].items()):
        trace = worker.get("trace") or []
        t, done = [x[0] for x in trace], [x[1] / total for x in trace]
        if arm == "spmd":
          ax.plot(t, done, "k--", lw=1.2, label=f"SPMD job, {total} steps")
        else:
          victim = " (victim)" if name == r["victim"] else ""
          ax.plot(t, done, color=colors.get(name), lw=1.2, label=f"store {name}{victim}, {total}")
      if w["fault"] and arm == "store":
        hi = w["end"] or w["finish"] or w["fault"]
        ax.axvspan(w["fault"] - t0, hi - t0, color="0.88", zorder=0)
      elif w["fault"]:
        ax.axvline(w["fault"] - t0, color="k", ls=":", lw=1)
    ax.set_title(scenario)
    ax.set_xlabel("seconds since the first logged step")
    ax.grid(alpha=0.3)
  for ax in axes[:, 0]:
    ax.set_ylabel("share of the run's steps done")
  for ax in axes.flat[len(scenarios) :]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  return path


def store_note(r: dict) -> str:
  f = r["fault"]
  notes = [f"{n} failed: {line}" for n, line in (f.get("errors") or {}).items()]
  if f.get("straggler"):
    notes.append(
      f"the victim, at stage {f['straggler']['stage']} when the others ended, still waited for a"
      f" round {f['straggler']['waited_s']:.0f} s later: ended"
    )
  return "; ".join(notes)


def spmd_note(r: dict) -> str:
  f, w = r["fault"], r["window"]
  if r["scenario"] == "kill":
    lines = [x for x in f.get("without_victim", {}).get("lines", []) if x.startswith("error:")]
    said = lines[0][:90] + "..." if lines else str(f.get("without_victim"))
    return (
      f"watchdog: {f.get('verdict')}, exit 75 after {f['exit_s']:.1f} s; the restart without it"
      f" is refused ({f['without_victim']['answered_s']:.0f} s): {said}; the run is over"
    )
  if r["scenario"] == "kill-restart":
    back = w["end"] - w["fault"] if w["end"] else None
    return (
      f"watchdog: {f.get('verdict')}, exit 75 after {f['exit_s']:.1f} s; every process"
      f" relaunched (a spare for the victim): training again {fmt(back, 1)} s after the fault,"
      f" {f.get('lost_stages')} stages redone"
    )
  return ""


# ----------------------------------------------------------------------------------------------


def parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--arms", nargs="+", default=["store", "spmd"], choices=["store", "spmd"])
  ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
  ap.add_argument("--workers", type=int, default=3, help="M, worker processes")
  ap.add_argument("--updates", type=int, default=300, help="inner steps of every worker")
  ap.add_argument("--sync-every", type=int, default=10, help="H")
  ap.add_argument("--ckpt-every", type=int, default=10)
  ap.add_argument("--grace-s", type=float, default=5.0)
  ap.add_argument("--min-workers", type=int, default=2)
  ap.add_argument(
    "--lease-s", type=float, default=30.0, help="loco.lease_s (the config's default: 120)"
  )
  ap.add_argument("--keep-rounds", type=int, default=0, help="loco.keep_rounds (0: the config's)")
  ap.add_argument("--stall-s", type=float, default=15.0, help="SIGSTOP length (> grace_s)")
  ap.add_argument("--slow-s", type=float, default=30.0, help="how long the victim runs slowed")
  ap.add_argument("--slow-factor", type=float, default=3.0)
  ap.add_argument(
    "--straggler-s", type=float, default=30.0, help="a victim left alone is ended after this"
  )
  ap.add_argument("--restart-after", type=float, default=5.0, help="kill-restart's downtime")
  ap.add_argument("--watchdog-s", type=float, default=10.0, help="SPMD health.hang_timeout_s")
  ap.add_argument("--cap", type=float, default=420.0, help="seconds a scenario may take")
  ap.add_argument("--seed", type=int, default=0, help="the victim and the fault's stage")
  ap.add_argument("--config", default="configs/gpt2_diloco.py:tiny")
  ap.add_argument(
    "--data-cache", default=str(common.REPO / ".pytest_cache" / "acco_data"), help="data.cache_dir"
  )
  ap.add_argument("--s3", action="store_true", help="the store on a moto S3 server over HTTP")
  ap.add_argument("--moto", default=shutil.which("moto_server") or "moto_server")
  ap.add_argument(
    "--own-hosts", action="store_true", help="each store worker under its own host name (root)"
  )
  ap.add_argument("--shape-mbit", type=float, default=0, help="with --s3: tbf on every link")
  ap.add_argument("--smoke", action="store_true", help="2 workers, store arm, none, 24 steps")
  ap.add_argument("--out", default=None)
  ap.add_argument("--render", nargs="+", help="print the table of earlier --out JSON files only")
  ap.add_argument("--figure", help="with --render: also draw their traces to this PNG")
  args = ap.parse_args(argv)
  if args.smoke:
    args.workers, args.updates, args.sync_every, args.ckpt_every = 2, 24, 4, 8
    args.arms, args.scenarios, args.min_workers = ["store"], ["none"], 2
  if args.out is None:
    name = "store_faults_s3" if args.s3 else "store_faults"
    args.out = str(common.RESULTS / f"{name}.json")
  if args.workers < 2 or not 1 <= args.min_workers <= args.workers:
    ap.error(f"--workers={args.workers} must be >= 2 and --min-workers in [1, workers]")
  if args.s3 and not shutil.which(args.moto):
    ap.error(
      f"--moto={args.moto} is not an executable: python -m venv /tmp/moto && "
      "/tmp/moto/bin/pip install 'moto[server]', then --moto /tmp/moto/bin/moto_server"
    )
  if args.own_hosts and (args.s3 or os.geteuid() != 0):
    ap.error("--own-hosts needs root (unshare --uts) and the directory store (not --s3)")
  if args.shape_mbit and not args.s3:
    ap.error("--shape-mbit shapes the links to the S3 server: add --s3")
  return args


def main(argv=None) -> int:
  args = parse(argv)
  if args.render:
    for path in args.render:
      data = json.loads(Path(path).read_text())
      print(f"{path}: {data['command']}; {data['machine']}\n")
      print(table(data["results"]) + "\n")
    merged = [r for p in args.render for r in json.loads(Path(p).read_text())["results"]]
    fill_equal_tokens(merged, args)
    print("all files, the fault-free reference of each arm filled in:\n")
    print(table(merged) + "\n")
    if args.figure:
      common.log(f"wrote {figure(merged, Path(args.figure))}")
    return 0
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks end the workers
  plan = fault_plan(args)
  common.log(f"victim worker {plan['victim']}, fault at worker 0's stage {plan['stage']}")
  env = common.cpu_env(1)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  results = []
  t_start = time.time()
  with tempfile.TemporaryDirectory(prefix="store_faults_") as tmp:
    tmp = Path(tmp)
    store = S3Store(args, env, tmp) if args.s3 else DirStore(tmp / "store", env, args.own_hosts)
    try:
      for arm in args.arms:
        reference = None
        for scenario in args.scenarios:
          if arm == "spmd" and scenario in NO_SPMD:
            results.append({"arm": arm, "scenario": scenario, "note": NO_SPMD[scenario]})
            continue
          root = tmp / f"{arm}-{scenario}"
          root.mkdir()
          common.log(f"{arm} {scenario} ...")
          if arm == "store":
            res = run_store(scenario, args, plan, root, store)
          else:
            res = run_spmd(scenario, args, plan, root, env)
          if scenario == "none":
            reference = reference_of(res, args)
          r = analyse(arm, scenario, res, args, reference if scenario != "none" else None)
          r["note"] = spmd_note(r) if arm == "spmd" else store_note(r)
          results.append(r)
          common.log(json.dumps({k: r[k] for k in ("arm", "scenario", "survivors")}))
          if r["fault"].get("straggler"):
            common.log(f"{arm} {scenario}: {store_note(r)}")
          elif not r["fault"].get("completed", True):
            common.log(f"{arm} {scenario}: capped after {args.cap:.0f} s")
    finally:
      store.close()
  print(table([r for r in results if "survivors" in r or "note" in r]))
  path = common.write_json(
    Path(args.out),
    {
      "benchmark": "store_faults",
      "machine": common.machine(),
      "args": vars(args),
      "plan": plan,
      "command": "python -m bench.loco.store_faults "
      + " ".join(sys.argv[1:] if argv is None else argv),
      "elapsed_s": time.time() - t_start,
      "results": results,
    },
  )
  common.log(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
