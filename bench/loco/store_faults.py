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

This module is the command line; the parts are in :mod:`bench.loco.faults` (``plan``, ``watch``,
``procs``, ``stores``, ``store_arm``, ``spmd_arm``, ``analysis``, ``report``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.loco.faults import analysis, report
from bench.loco.faults.plan import NO_SPMD, SCENARIOS, fault_plan
from bench.loco.faults.spmd_arm import run_spmd
from bench.loco.faults.store_arm import run_store
from bench.loco.faults.stores import DirStore, S3Store

# (flag, type, default, help) of the numeric options
NUMBERS = [
  ("--workers", int, 3, "M, worker processes"),
  ("--updates", int, 300, "inner steps of every worker"),
  ("--sync-every", int, 10, "H"),
  ("--ckpt-every", int, 10, None),
  ("--grace-s", float, 5.0, None),
  ("--min-workers", int, 2, None),
  ("--lease-s", float, 30.0, "loco.lease_s (the config's default: 120)"),
  ("--keep-rounds", int, 0, "loco.keep_rounds (0: the config's)"),
  ("--stall-s", float, 15.0, "SIGSTOP length (> grace_s)"),
  ("--slow-s", float, 30.0, "how long the victim runs slowed"),
  ("--slow-factor", float, 3.0, None),
  ("--straggler-s", float, 30.0, "a victim left alone is ended after this"),
  ("--restart-after", float, 5.0, "kill-restart's downtime"),
  ("--watchdog-s", float, 10.0, "SPMD health.hang_timeout_s"),
  ("--cap", float, 420.0, "seconds a scenario may take"),
  ("--seed", int, 0, "the victim and the fault's stage"),
]


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--arms", nargs="+", default=["store", "spmd"], choices=["store", "spmd"])
  ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
  for flag, kind, default, text in NUMBERS:
    ap.add_argument(flag, type=kind, default=default, help=text)
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
  return ap


def parse(argv):
  """The arguments, ``--smoke``'s settings and the default ``--out`` filled in; one line and exit
  2 for a combination that cannot run."""
  ap = parser()
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


def render(args) -> None:
  """The table of each ``--render`` file, then of all of them with each arm's fault-free
  reference filled in; ``--figure``: their traces."""
  for path in args.render:
    data = json.loads(Path(path).read_text())
    print(f"{path}: {data['command']}; {data['machine']}\n")
    print(report.table(data["results"]) + "\n")
  merged = [r for p in args.render for r in json.loads(Path(p).read_text())["results"]]
  analysis.fill_equal_tokens(merged, args)
  print("all files, the fault-free reference of each arm filled in:\n")
  print(report.table(merged) + "\n")
  if args.figure:
    common.log(f"wrote {report.figure(merged, Path(args.figure))}")


def run_arm(arm: str, args, plan: dict, tmp: Path, store, env: dict) -> list[dict]:
  """Every scenario of one arm, the fault-free one (when asked for first) the reference."""
  results, reference = [], None
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
      reference = analysis.reference_of(res, args)
    r = analysis.analyse(arm, scenario, res, args, reference if scenario != "none" else None)
    r["note"] = report.spmd_note(r) if arm == "spmd" else report.store_note(r)
    results.append(r)
    log_result(r, args)
  return results


def log_result(r: dict, args) -> None:
  common.log(json.dumps({k: r[k] for k in ("arm", "scenario", "survivors")}))
  if r["fault"].get("straggler"):
    common.log(f"{r['arm']} {r['scenario']}: {report.store_note(r)}")
  elif not r["fault"].get("completed", True):
    common.log(f"{r['arm']} {r['scenario']}: capped after {args.cap:.0f} s")


def measure(args, plan: dict) -> list[dict]:
  """Both arms' scenarios in a temporary directory, the store made and closed around them."""
  env = common.cpu_env(1)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  results = []
  with tempfile.TemporaryDirectory(prefix="store_faults_") as tmp:
    tmp = Path(tmp)
    store = S3Store(args, env, tmp) if args.s3 else DirStore(tmp / "store", env, args.own_hosts)
    try:
      for arm in args.arms:
        results += run_arm(arm, args, plan, tmp, store, env)
    finally:
      store.close()
  return results


def main(argv=None) -> int:
  args = parse(argv)
  if args.render:
    render(args)
    return 0
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks end the workers
  plan = fault_plan(args)
  common.log(f"victim worker {plan['victim']}, fault at worker 0's stage {plan['stage']}")
  t_start = time.time()
  results = measure(args, plan)
  print(report.table([r for r in results if "survivors" in r or "note" in r]))
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
