"""Fault to training again: what the watchdog and health.exclude=auto save against waiting.

Four ``train.py`` processes (``jax.distributed``, gloo, one CPU device each, the tiny ACCO preset at
D=16) train with a checkpoint every 4 stages. At a random stage (seeded) one of processes 1-3 is
killed (SIGKILL: ``dead``) or frozen (SIGSTOP: ``hung``). With the watchdog
(``health.hang_timeout_s``) the three others write ``health.json`` and exit 75; the bench then
relaunches the same command for them with ``health.exclude=auto`` and they resume on 3 devices
(elastic restore). The time from the fault to the first training stage after the restart is split
into

* detection: fault -> the first survivor's verdict (``health.json``'s ``first_detected_at``);
  without a watchdog, fault -> the first survivor's exit;
* exit: -> the last survivor has exited;
* restart: relaunch -> the restore begins (Python, ``jax.distributed``, data, build);
* restore: reading and resharding the checkpoint (the ``restored`` event's ``restore_s``);
* first step: -> the first stage after the restore is logged (compilation for the new device count,
  one stage, and the metrics flush one stage behind);

and the work lost: stages run since the checkpoint the restart resumed from, in stages and in
seconds at the run's median stage time. Without a watchdog (``health.hang_timeout_s=0``) the
survivors wait for whatever times out first; a frozen peer is then ended by ``jax.distributed``'s
heartbeat timeout (100 s by default in jax 0.10.2), unless the gloo operation's own timeout
(``--xla_cpu_collective_timeout_seconds``, XLA's default 1800 s) is set lower, as one row does.
Nothing names the faulty process, so no restart without it is automatic: those rows stop at the
exit. A run still waiting after ``--cap`` seconds is ended and reported as capped.

Each scenario runs twice, side by side (``--cache``): ``off`` (``compile.cache_dir=''``: every launch
compiles) and ``on`` (a persistent compilation cache, empty when the scenario starts: the first
launch fills it, the restart loads what it can). The restart runs on one device fewer, so its
training step is a new program either way; what the cache saves there is every program that does
not depend on the device count. ``warm`` gives the restart a cache in which that restart's own
programs already are (a second fault of the same kind, or a cache shared with an earlier run).

Usage::

  python -m bench.run.c4                   # all scenarios, seed 0, watchdog timeout 10 s, cache off and on
  python -m bench.run.c4 --scenarios dead hung --cache off on warm --seed 1 --timeout 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

SCENARIOS = {  # name: (signal, watchdog, extra XLA flag)
  "dead": (signal.SIGKILL, True, ""),
  "hung": (signal.SIGSTOP, True, ""),
  "dead-no-watchdog": (signal.SIGKILL, False, ""),
  "hung-no-watchdog": (signal.SIGSTOP, False, ""),
  "hung-no-watchdog-gloo30": (signal.SIGSTOP, False, "--xla_cpu_collective_timeout_seconds=30"),
}
PROCESSES = 4
BASE = {
  "model.D": 16,
  "model.N": 1,
  "model.H": 1,
  "data.seq_len": 8,
  "train.num_updates": 200,
  "train.log_every": 1,
  "train.eval_every": 0,
  "train.eval_batches": 1,
  "train.sample_tokens": 0,
  "ckpt.every": 2,
  "ckpt.async_save": False,
  "mesh.cpu_devices": 1,
  "dist.timeout_s": 120,
}


def env(xla_flag: str) -> dict[str, str]:
  e = common.cpu_env(1)
  e.pop("JAX_COMPILATION_CACHE_DIR", None)  # the cache is the launch's compile.cache_dir
  e["XLA_FLAGS"] = " ".join(
    f for f in [*e["XLA_FLAGS"].split(), xla_flag] if f and "device_count" not in f
  )
  e["PYTHONPATH"] = os.pathsep.join([str(common.REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return e


def launch(
  workdir: Path, pids, port: int, timeout_s: float, xla_flag: str, tag: str, cache: str
) -> dict:
  procs = {}
  for i in pids:
    flags = {
      **BASE,
      "dist.coordinator_address": f"127.0.0.1:{port}",
      "dist.num_processes": PROCESSES,
      "dist.process_id": i,
      "health.hang_timeout_s": timeout_s,
      "health.exclude": "auto",
      "compile.cache_dir": cache,
    }
    cmd = [
      sys.executable,
      str(common.REPO / "train.py"),
      "--config",
      "configs/gpt2_acco.py:tiny",
      "--workdir",
      str(workdir),
      *(f"--config.{k}={v}" for k, v in flags.items()),
    ]
    log = open(workdir.parent / f"{tag}-p{i}.log", "w")
    procs[i] = subprocess.Popen(
      cmd, cwd=common.REPO, env=env(xla_flag), stdout=log, stderr=subprocess.STDOUT
    )
  return procs


def rows(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def last_stage(workdir: Path) -> int:
  return max((r["stage"] for r in rows(workdir) if "loss" in r), default=0)


def free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def stop(procs: dict) -> None:
  for p in procs.values():  # only the processes this bench started, by their handles
    if p.poll() is None:
      p.kill()
    p.wait(timeout=30)


def scenario(
  name: str,
  tmp: Path,
  fault: tuple[int, int, float],
  timeout_s: float,
  cap: float,
  cache: str,
  cache_dir: str,
) -> dict:
  """One ``fault`` (stage, victim, delay within the stage); ``cache``: its label, ``cache_dir``:
  the launches' compile.cache_dir."""
  sig, watchdog, xla_flag = SCENARIOS[name]
  target, victim, delay = fault
  workdir = tmp / f"{name}-{cache}" / "run"
  workdir.mkdir(parents=True)
  procs = launch(
    workdir,
    range(PROCESSES),
    free_port(),
    timeout_s if watchdog else 0,
    xla_flag,
    f"{name}-first",
    cache_dir,
  )
  out = {"scenario": name, "cache": cache, "victim": victim, "signal": signal.Signals(sig).name}
  try:
    deadline = time.time() + 600
    while last_stage(workdir) < target:
      if time.time() > deadline or any(p.poll() is not None for p in procs.values()):
        tails = "\n".join(
          f"--- process {i}\n" + (workdir.parent / f"{name}-first-p{i}.log").read_text()[-1500:]
          for i in procs
        )
        raise RuntimeError(f"{name}: the run did not reach stage {target}\n{tails}")
      time.sleep(0.05)
    time.sleep(delay)  # anywhere within a stage
    t_fault, fault_stage = time.time(), last_stage(workdir)
    os.kill(procs[victim].pid, sig)
    exits, codes = {}, {}
    while len(exits) < PROCESSES - 1 and time.time() - t_fault < cap:
      for i, p in procs.items():
        if i != victim and i not in exits and p.poll() is not None:
          exits[i], codes[i] = time.time(), p.returncode
      time.sleep(0.02)
  finally:
    stop(procs)
  walls = [r["wall_s"] for r in rows(workdir) if "loss" in r]
  stage_s = statistics.median(b - a for a, b in zip(walls[1:], walls[2:], strict=False))
  out.update(
    fault_stage=fault_stage, stage_s=stage_s, exit_codes=codes, capped=len(exits) < PROCESSES - 1
  )
  if out["capped"]:
    out.update(detection_s=None, ended=f"still waiting after the {cap:.0f} s cap")
    return out
  first_exit, last_exit = min(exits.values()), max(exits.values())
  verdict = json.loads((workdir / "health.json").read_text()) if watchdog else None
  if verdict is None:
    out.update(detection_s=first_exit - t_fault, exit_s=last_exit - first_exit)
    text = (workdir.parent / f"{name}-first-p0.log").read_text()
    abort = [x for x in text.splitlines() if "Terminating process" in x or "heartbeat" in x.lower()]
    out["ended"] = (
      f"abort by jax.distributed (exit {codes[0]})"
      if abort
      else "gloo error, exit 75"
      if "Gloo" in text
      else f"exit {codes}"
    )
    out["log"] = (abort or [x for x in text.splitlines() if "Gloo" in x] or [""])[:3]
    return out
  detected = verdict["first_detected_at"]
  out.update(
    detection_s=detected - t_fault,
    exit_s=last_exit - detected,
    verdict=verdict["verdict"],
    named=[s["process"] for s in verdict["suspects"]],
    ended=f"health.json: {verdict['verdict']}, exit 75",
  )

  # the same command for the others: they leave the victim out and resume on 3 devices
  restored_before = sum(r.get("event") == "restored" for r in rows(workdir))
  t_launch = time.time()
  procs = launch(
    workdir,
    [i for i in range(PROCESSES) if i != victim],
    free_port(),
    timeout_s,
    "",
    f"{name}-restart",
    cache_dir,
  )
  try:
    deadline = t_launch + 600
    while True:
      log = rows(workdir)
      at = [i for i, r in enumerate(log) if r.get("event") == "restored"][restored_before:]
      if at and any("loss" in r for r in log[at[0] :]):  # a stage trained after the restore
        t_first, done = time.time(), [log[at[0]]]
        break
      if time.time() > deadline or any(p.poll() is not None for p in procs.values()):
        raise RuntimeError(f"{name}: the restart did not train")
      time.sleep(0.05)
  finally:
    stop(procs)
  restored = done[0]
  out.update(
    restart_s=restored["time"] - restored["restore_s"] - t_launch,
    restore_s=restored["restore_s"],
    first_step_s=t_first - restored["time"],
    total_s=t_first - t_fault,
    restored_stage=restored["stage"],
    lost_stages=fault_stage - restored["stage"],
  )
  out["lost_s"] = out["lost_stages"] * stage_s
  return out


def fmt(x, digits=1) -> str:
  return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
  ap.add_argument("--timeout", type=float, default=10.0, help="health.hang_timeout_s (watchdog)")
  ap.add_argument("--cap", type=float, default=240.0, help="seconds to wait without a watchdog")
  ap.add_argument("--cache", nargs="+", default=["off", "on"], choices=["off", "on", "warm"])
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=str(common.RESULTS / "c4.json"))
  args = ap.parse_args()
  rng = random.Random(args.seed)
  results = []
  with tempfile.TemporaryDirectory(prefix="c4_bench_") as tmp:
    warm = str(Path(tmp) / "xla-warm")
    if "warm" in args.cache:  # the restart's programs: one untimed fault and restart on 3 devices
      common.log("warming the cache with one restart ...")
      scenario("dead", Path(tmp) / "warm-up", (8, 1, 0.0), args.timeout, args.cap, "warm", warm)
    for name in args.scenarios:
      fault = (rng.randrange(8, 20), rng.randrange(1, PROCESSES), rng.uniform(0, 0.5))
      for cache in args.cache:  # the same fault with each cache
        common.log(f"{name}, cache {cache} ...")
        cache_dir = {"off": "", "on": str(Path(tmp) / f"xla-{name}"), "warm": warm}[cache]
        results.append(scenario(name, Path(tmp), fault, args.timeout, args.cap, cache, cache_dir))
        common.log(json.dumps(results[-1]))
  table = [
    {
      "scenario": r["scenario"],
      "cache": r["cache"],
      "ended": r["ended"],
      "detection": fmt(r.get("detection_s")),
      "exit": fmt(r.get("exit_s")),
      "restart": fmt(r.get("restart_s")),
      "restore": fmt(r.get("restore_s"), 2),
      "first": fmt(r.get("first_step_s")),
      "total": fmt(r.get("total_s")),
      "lost": "-" if "lost_stages" not in r else f"{r['lost_stages']} ({r['lost_s']:.1f} s)",
    }
    for r in results
  ]
  print(
    common.format_table(
      table,
      [
        ("scenario", "fault"),
        ("cache", "cache"),
        ("ended", "how the survivors ended"),
        ("detection", "detection s"),
        ("exit", "exit s"),
        ("restart", "restart s"),
        ("restore", "restore s"),
        ("first", "first step s"),
        ("total", "fault -> training s"),
        ("lost", "stages lost (s)"),
      ],
    )
  )
  path = common.write_json(
    Path(args.out),
    {
      "machine": common.machine(),
      "timeout_s": args.timeout,
      "cap_s": args.cap,
      "seed": args.seed,
      "cache": args.cache,
      "command": "python -m bench.run.c4 " + " ".join(sys.argv[1:]),
      "results": results,
    },
  )
  common.log(f"wrote {path}")


if __name__ == "__main__":
  main()
