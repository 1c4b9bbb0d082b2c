"""The store arm: ``M`` separate ``train.py`` workers meeting through a store, one of them hit by
the scenario's fault; returns each worker's rows as seen, the fault's times and the rounds."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from bench.loco.faults import procs
from bench.loco.faults.plan import run_flags, train_command
from bench.loco.faults.watch import Tail


def store_flags(args, url: str, worker: int) -> dict:
  return {
    **run_flags(args),
    "loco.transport": f"store:{url}",
    "loco.workers": args.workers,
    "loco.worker": worker,
    "loco.grace_s": args.grace_s,
    "loco.min_workers": args.min_workers,
    "loco.lease_s": args.lease_s,
    **({"loco.keep_rounds": args.keep_rounds} if args.keep_rounds else {}),
  }


def run_store(scenario: str, args, plan: dict, root: Path, store) -> dict:
  """One fault among ``M`` store workers; returns each worker's timeline and the fault's times."""
  url = store.url(f"{scenario}-{int(time.time())}")
  tail = Tail()
  launcher = procs.Launcher(root, store.env, store.prefix(0))
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
      procs.wait_for_stage(tail, workdirs["w0"], plan["stage"], launcher, args.cap)
      fault["t"] = time.time()
      apply_store_fault(scenario, args, launcher, cmds[victim], store, plan, fault)
    fault["completed"] = wait_store(launcher, tail, workdirs[victim], t0, args, fault)
  finally:
    launcher.stop()
    tail.close()
    fault["rounds"] = rounds.close()
  fault.update(launch_record(launcher, cmds, t0))
  seen = {n: tail.lines[w / "metrics.jsonl"] for n, w in workdirs.items()}
  return {"fault": fault, "seen": seen, "logs": {n: str(p) for n, p in launcher.logs.items()}}


def launch_record(launcher: procs.Launcher, cmds: dict, t0: float) -> dict:
  """The scenario's wall time, exit codes, start times, commands, and the last line of each
  worker that failed on its own (not by the bench's SIGKILL)."""
  failed = [
    n
    for n, p in launcher.procs.items()
    if p.returncode not in (0, -signal.SIGKILL, None) and launcher.logs[n].read_text().strip()
  ]
  return {
    "wall_s": time.time() - t0,
    "exit_codes": launcher.exit_codes(),
    "starts": dict(launcher.started),
    "commands": {n: " ".join(c) for n, c in cmds.items()},
    "errors": {n: launcher.logs[n].read_text().strip().splitlines()[-1][:300] for n in failed},
  }


def wait_store(launcher, tail, workdir, t0, args, fault) -> bool:
  """Until every worker ended (True), the cap, or ``--straggler-s`` after every worker but the
  victim ended: a worker behind the others waits for rounds no one else will publish into."""
  others_done = None
  while launcher.alive() and time.time() - t0 < args.cap:
    if not [n for n in launcher.alive() if n != fault["victim"]]:
      others_done = others_done or time.time()
      if time.time() - others_done > args.straggler_s:
        fault["straggler"] = {"stage": tail.stage(workdir), "waited_s": args.straggler_s}
        break
    time.sleep(0.2)
  done = not launcher.alive()
  launcher.stop()
  return done


def apply_store_fault(scenario, args, launcher, cmd, store, plan, fault) -> None:
  """The fault on the victim; ``fault["end"]``: when it ended, or None (the victim's new first
  row ends it)."""
  index, victim = plan["victim"], fault["victim"]
  if scenario in ("kill", "kill-restart"):
    launcher.signal(victim, signal.SIGKILL)
    launcher.procs[victim].wait()
    fault["end"] = fault["t"] + args.lease_s  # its lease lapses: rounds stop waiting grace_s
    if scenario == "kill-restart":
      time.sleep(args.restart_after)
      fault["restarted"] = time.time()
      launcher.start(victim, cmd, store.prefix(index))
      fault["end"] = None
  elif scenario == "stall":
    fault["end"] = procs.stall(launcher, victim, args.stall_s)
  elif scenario == "join":
    launcher.start(victim, cmd, store.prefix(index))
    fault["end"] = None
  elif scenario == "slow":
    fault["end"] = procs.slow_down(launcher, victim, args.slow_factor, args.slow_s)
