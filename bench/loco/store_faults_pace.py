r"""Step times of the fault benchmark's arms with no fault: where the SPMD job's time goes.

Runs the tiny DiLoCo run of :mod:`bench.loco.store_faults` (its training flags: one CPU device a
process, a log row every step, a checkpoint every 10 steps, H = 10) once, as one of:

* ``store``: ``--workers`` ``train.py`` workers meeting through a store directory;
* ``spmd``: one ``jax.distributed`` job of ``--workers`` processes (gloo), the workers a mesh axis,
  with the fault benchmark's watchdog (``health.hang_timeout_s=75``);
* ``mesh``: one process with ``--workers`` CPU devices, the workers a mesh axis.

``--set key=value`` overrides a training flag (``train.log_every=10``, ``ckpt.every=0``,
``health.hang_timeout_s=0``). Prints one JSON line: the wall time and each process's CPU seconds
(``wait4``) and threads (sampled once, 25 s in), and from each workdir's ``metrics.jsonl``: the
median and mean time between rows from stage 20 on, the stages a minute from stage 20 to the end,
the mean time of the rows after each stage mod 10 (a sync and a checkpoint end every 10th stage),
and the largest gaps (stage, seconds), where a compile shows.

Usage::

  python -m bench.loco.store_faults_pace --arm spmd
  python -m bench.loco.store_faults_pace --arm spmd --set train.log_every=10 ckpt.every=0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.loco.faults.plan import run_flags, train_command
from bench.loco.faults.procs import free_port

STEADY = 20  # rows from this stage on are timed (the compile of the first call is before)


def processes(args, tmp: Path) -> list[tuple[Path, dict]]:
  """Each process's workdir and flags."""
  flags = {**run_flags(args), **dict(kv.split("=", 1) for kv in args.set)}
  m = args.workers
  if args.arm == "mesh":
    return [(tmp / "run", {**flags, "loco.workers": 0, "mesh.cpu_devices": m})]
  if args.arm == "store":
    store = {"loco.transport": f"store:{tmp / 'store'}", "loco.workers": m, "loco.grace_s": 5.0}
    store.update({"loco.min_workers": 2, "loco.lease_s": 30.0})
    return [(tmp / f"w{i}", {**flags, **store, "loco.worker": i}) for i in range(m)]
  job = {"loco.workers": 0, "dist.coordinator_address": f"127.0.0.1:{free_port()}"}
  job.update({"dist.num_processes": m, "dist.timeout_s": 120, "health.hang_timeout_s": 75.0})
  return [(tmp / "run", {**flags, **job, "dist.process_id": i}) for i in range(m)]


def run(args, tmp: Path) -> dict:
  """Starts the processes, samples their threads, reaps them with their CPU time."""
  env = common.cpu_env(args.workers if args.arm == "mesh" else 1)  # XLA_FLAGS win over the config
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  procs, t0 = [], time.time()
  for i, (workdir, flags) in enumerate(processes(args, tmp)):
    with open(tmp / f"p{i}.log", "w") as log:
      cmd = train_command(args.config, workdir, flags)
      procs.append(subprocess.Popen(cmd, cwd=common.REPO, env=env, stdout=log, stderr=log))
  threads, cpu, codes = {}, {}, {}
  while len(cpu) < len(procs):
    time.sleep(0.5)
    if not threads and time.time() - t0 > 25:
      threads = {p.pid: thread_count(p.pid) for p in procs}
    for p in procs:
      if p.pid not in cpu:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
          codes[p.pid] = os.waitstatus_to_exitcode(status)
          cpu[p.pid] = round(usage.ru_utime + usage.ru_stime, 1)
  pids = [p.pid for p in procs]
  return {
    "wall_s": round(time.time() - t0, 1),
    "exit_codes": [codes[p] for p in pids],
    "cpu_s": [cpu[p] for p in pids],
    "threads": [threads.get(p) for p in pids],
  }


def thread_count(pid: int) -> int | None:
  try:
    return int(Path(f"/proc/{pid}/status").read_text().split("Threads:")[1].split()[0])
  except (OSError, IndexError):
    return None


def pace(rows: list[dict]) -> dict:
  """Times between rows (seconds; ``rows``: training rows with ``wall_s``)."""
  gaps = [(b["stage"], b["wall_s"] - a["wall_s"]) for a, b in zip(rows, rows[1:], strict=False)]
  steady = [dt for stage, dt in gaps if stage > STEADY]
  first = next(r for r in rows if r["stage"] >= STEADY)
  by_mod = [[dt for stage, dt in gaps if stage > STEADY and stage % 10 == k] for k in range(10)]
  return {
    "workers_in_a_row": len(rows[-1].get("worker_loss", [None])),
    "first_row_s": round(rows[0]["wall_s"], 2),
    "last_row_s": round(rows[-1]["wall_s"], 2),
    "median_ms": round(1000 * statistics.median(steady), 1) if steady else None,
    "mean_ms": round(1000 * statistics.fmean(steady), 1) if steady else None,
    "stages_per_min": round(
      60 * (rows[-1]["stage"] - first["stage"]) / (rows[-1]["wall_s"] - first["wall_s"])
    ),
    "mean_ms_by_stage_mod_10": [
      round(1000 * statistics.fmean(x), 1) if x else None for x in by_mod
    ],
    "largest_gaps": [[s, round(dt, 2)] for s, dt in sorted(gaps, key=lambda g: -g[1])[:6]],
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--arm", choices=["store", "spmd", "mesh"], required=True)
  ap.add_argument("--workers", type=int, default=3)
  ap.add_argument("--updates", type=int, default=300)
  ap.add_argument("--set", nargs="*", default=[], help="training flags, key=value")
  ap.add_argument("--config", default="configs/gpt2_diloco.py:tiny")
  args = ap.parse_args(argv)
  bad = [kv for kv in args.set if "=" not in kv]
  if bad or args.workers < 2:
    ap.error(f"--set takes key=value (got {bad}); --workers must be >= 2")
  args.sync_every, args.ckpt_every = 10, 10
  args.data_cache = str(common.REPO / ".pytest_cache" / "acco_data")
  with tempfile.TemporaryDirectory(prefix="store_faults_pace_") as tmp:
    tmp = Path(tmp)
    out = {"arm": args.arm, "workers": args.workers, "set": args.set, **run(args, tmp)}
    out["load_1min"] = round(os.getloadavg()[0], 1)
    for workdir in sorted({w for w, _ in processes(args, tmp)}):
      path = workdir / "metrics.jsonl"
      lines = path.read_text().splitlines() if path.exists() else []
      rows = [r for r in map(json.loads, lines) if "loss" in r and "wall_s" in r]
      out[workdir.name] = pace(rows) if rows else (tmp / "p0.log").read_text()[-2000:]
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
