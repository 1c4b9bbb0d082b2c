"""The SPMD arm: one ``jax.distributed`` job of ``M`` processes whose workers are a mesh axis,
with C4's watchdog (``health.hang_timeout_s``) and its restart, one process hit by the fault."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from bench.loco.faults import procs
from bench.loco.faults.plan import run_flags, train_command
from bench.loco.faults.watch import Tail


def spmd_flags(args, port: int, process: int, timeout_s: float, exclude: str) -> dict:
  return {
    **run_flags(args),
    "loco.workers": 0,  # one worker per process's device
    "dist.coordinator_address": f"127.0.0.1:{port}",
    "dist.num_processes": args.workers,
    "dist.process_id": process,
    "dist.timeout_s": 120,
    "health.hang_timeout_s": timeout_s,
    "health.exclude": exclude,
  }


class Job:
  """Launches every process of the job (again, for a restart) into one workdir."""

  def __init__(self, args, scenario: str, launcher: procs.Launcher, workdir: Path):
    self.args, self.launcher, self.workdir = args, launcher, workdir
    self.watchdog_s = args.watchdog_s if scenario.startswith("kill") else args.stall_s + 60

  def launch(self, exclude: str = "off", tag: str = "") -> None:
    port = procs.free_port()
    for i in range(self.args.workers):
      flags = spmd_flags(self.args, port, i, self.watchdog_s, exclude)
      self.launcher.start(f"p{i}{tag}", train_command(self.args.config, self.workdir, flags))


def run_spmd(scenario: str, args, plan: dict, root: Path, env: dict) -> dict:
  """One fault in a ``jax.distributed`` job of ``M`` processes; C4's restart where it applies."""
  tail = Tail()
  workdir = root / "run"
  tail.watch(workdir)
  launcher = procs.Launcher(root, env)
  job = Job(args, scenario, launcher, workdir)
  victim = f"p{plan['victim']}"
  fault: dict = {"victim": victim}
  t0 = time.time()
  try:
    job.launch()
    if scenario != "none":
      procs.wait_for_stage(tail, workdir, plan["stage"], launcher, args.cap)
      fault["t"] = time.time()
      fault["stage"] = tail.stage(workdir)
      if scenario.startswith("kill"):
        spmd_kill(args, scenario, job, fault)
      elif scenario == "stall":
        fault["end"] = procs.stall(launcher, victim, args.stall_s)
      elif scenario == "slow":
        fault["end"] = procs.slow_down(launcher, victim, args.slow_factor, args.slow_s)
    fault["completed"] = launcher.wait_all(max(args.cap - (time.time() - t0), 10))
  finally:
    launcher.stop()
    tail.close()
  fault["wall_s"] = time.time() - t0
  fault["exit_codes"] = launcher.exit_codes()
  return {"fault": fault, "seen": {"job": tail.lines[workdir / "metrics.jsonl"]}}


def spmd_kill(args, scenario: str, job: Job, fault: dict) -> None:
  """SIGKILL and the watchdog's exit; then ``kill``: the restart without the victim
  (``health.exclude=auto``), ``kill-restart``: every process relaunched (a spare for the victim)."""
  launcher, victim = job.launcher, fault["victim"]
  launcher.signal(victim, signal.SIGKILL)
  others = [n for n in launcher.procs if n != victim]
  deadline = time.time() + args.watchdog_s * 6
  while any(launcher.procs[n].poll() is None for n in others) and time.time() < deadline:
    time.sleep(0.05)
  fault["exit_s"] = time.time() - fault["t"]
  fault["survivor_codes"] = {n: launcher.procs[n].poll() for n in others}
  launcher.stop()
  verdict = job.workdir / "health.json"
  fault["verdict"] = json.loads(verdict.read_text()).get("verdict") if verdict.exists() else None
  fault["restarted"] = time.time()
  if scenario == "kill":  # the launch's same commands; the victim's own exits at once
    job.launch(exclude="auto", tag="-excl")
    fault["completed_restart"] = launcher.wait_all(180)
    fault["without_victim"] = restart_answer(launcher, fault["restarted"])
    fault["end"] = time.time()
    return
  if verdict.exists():  # a spare takes the victim's place: nothing to exclude
    verdict.rename(job.workdir / f"health.{int(time.time())}.json")
  job.launch(tag="-spare")
  fault["end"] = None  # the restart's first row


def restart_answer(launcher: procs.Launcher, restarted: float) -> dict:
  """The exit codes and first error lines of the restart without the victim."""
  codes = {n: p.returncode for n, p in launcher.procs.items() if n.endswith("-excl")}
  lines = [
    line
    for n in codes
    for line in launcher.logs[n].read_text().splitlines()
    if line.startswith("error:") or "excluded" in line
  ]
  return {"codes": codes, "lines": lines[:4], "answered_s": time.time() - restarted}
