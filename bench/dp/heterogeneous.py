"""One slow worker: wall-clock to a target loss for zero1 (everyone waits) and ACCO (budgets).

Part 1 runs real separate processes: ``--workers`` processes of ``train.py`` joined by
``jax.distributed`` (gloo on localhost, one CPU device each). Worker ``--slow`` sleeps after every
forward pass (a host callback, ``hetero.slowdown``) so that its microbatch takes ``--factor`` times
as long as the others'; the sleep is calibrated from a first short run that measures the workers'
microbatch time with the adaptive policy's own probe. Runs, side by side:

* ``zero1-slow``: ZeRO-1, the same budget on every worker, so each update waits for the slow one;
* ``acco-slow``: ACCO with ``hetero.adaptive=balance``: the same microbatches per update, split by
  measured speed (the fast workers take more);
* ``acco-homog``: ACCO with no slow worker, the per-token reference.

The target loss is the highest final smoothed training loss of the slowed runs, so every run reaches
it; time counts from the first logged stage (after compilation).

Part 2 is the step-time model for larger clusters (8 to 64 workers, one to a quarter of them slow):
zero1's update lasts ``k t_slow + X``, ACCO's ``2 max(M, X)`` with ``M`` the balanced stage's
slowest worker, ``X`` the bf16 reduce-scatter + all-gather of GPT-2 124M, 8 GPUs per node on NVLink,
nodes on 100 or 10 Gbit/s.

  python -m bench.dp.heterogeneous                  # ~8 min on a 2-core machine
  python -m bench.dp.heterogeneous --updates 20     # smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import REPO, RESULTS, format_table, log, machine, write_json

RUNS_DIR = REPO / "bench" / "results" / "runs" / "heterogeneous"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def overrides(args, method: str, updates: int, **extra) -> list[str]:
  base = {
    "model.D": 128,
    "model.N": 2,
    "model.H": 4,
    "data.seq_len": 64,
    "batch.microbatch_size": 4,
    "batch.microbatches": args.microbatches,
    "train.num_updates": updates,
    "train.log_every": 2,
    "train.eval_every": 0,
    "train.eval_batches": 4,
    "train.sample_tokens": 0,
    "opt.warmup_updates": 5,
    "ckpt.every": 0,
    "ckpt.async_save": False,
    "mesh.cpu_devices": 1,
    "method": method,
    **extra,
  }
  return [f"--config.{k}={v}" for k, v in base.items()]


def launch(args, name: str, method: str, updates: int, **extra) -> Path:
  """Runs one ``train.py`` job as ``args.workers`` processes; returns its workdir."""
  workdir = RUNS_DIR / name
  if args.reuse and (workdir / "metrics.jsonl").exists():
    return workdir
  if workdir.exists():
    subprocess.run(["rm", "-rf", str(workdir)], check=True)
  workdir.mkdir(parents=True)
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  procs = []
  for i in range(args.workers):
    cmd = [
      sys.executable,
      str(REPO / "train.py"),
      f"--config={REPO}/configs/gpt2_{method}.py:cpu",
      f"--workdir={workdir}",
      f"--config.dist.coordinator_address=127.0.0.1:{port}",
      f"--config.dist.num_processes={args.workers}",
      f"--config.dist.process_id={i}",
      *overrides(args, method, updates, **extra),
    ]
    out = open(workdir / f"process{i}.log", "w")
    procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO))
  t0 = time.time()
  codes = [p.wait(timeout=args.timeout) for p in procs]
  if any(codes):
    tail = (workdir / "process0.log").read_text()[-2000:]
    raise RuntimeError(f"{name}: exit codes {codes}\n{tail}")
  log(f"{name}: {time.time() - t0:.0f} s")
  return workdir


def read_rows(workdir: Path) -> tuple[list[dict], list[dict]]:
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [r for r in rows if "loss" in r], [r for r in rows if r.get("event") == "probe"]


def read_eval(workdir: Path) -> float:
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


def smooth(x, tokens, per_update: float, a=0.8):
  """Exponential moving average with weight ``a`` per update's worth of tokens (not per logged
  row: zero1 logs every second update, ACCO every update, at ``train.log_every=2`` stages)."""
  out, s, last = [], x[0], tokens[0]
  for v, t in zip(x, tokens, strict=True):
    w = a ** ((t - last) / per_update)
    s, last = w * s + (1 - w) * v, t
    out.append(s)
  return np.array(out)


def summarise(name: str, workdir: Path, per_update: float, target: float | None = None) -> dict:
  rows, probes = read_rows(workdir)
  wall = np.array([r["wall_s"] for r in rows])
  loss = smooth([r["loss"] for r in rows], [r["tokens_seen"] for r in rows], per_update)
  out = {
    "name": name,
    "wall_s": (wall - wall[0]).tolist(),
    "smoothed_loss": loss.tolist(),
    "tokens_seen": [r["tokens_seen"] for r in rows],
    "final_loss": float(loss[-1]),
    "eval_loss": read_eval(workdir),
    "train_s": float(wall[-1] - wall[0]),
    "updates": rows[-1]["update"],
    "s_per_update": float((wall[-1] - wall[0]) / max(rows[-1]["update"] - rows[0]["update"], 1)),
  }
  out["microbatches_per_stage"] = sorted({r["microbatches"] for r in rows})
  budgets = [tuple(r["budgets"]) for r in rows if "budgets" in r]
  if budgets:
    out["budgets"] = list(budgets[-1])
    out["budget_plans"] = len(set(budgets))
    spread = np.array(budgets)
    out["budget_min_max"] = [int(spread.min()), int(spread.max())]
  if probes:
    out["measured_mb_s"] = probes[-1]["mb_time_s"]
  if target is not None:
    hit = np.nonzero(loss <= target)[0]
    out["time_to_target_s"] = float(wall[hit[0]] - wall[0]) if len(hit) else None
  return out


def plot(runs: dict, target: float, path: Path) -> bool:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    log("matplotlib is not installed: no figure (pip install matplotlib)")
    return False
  fig, (ax_t, ax_n) = plt.subplots(1, 2, figsize=(10, 3.6))
  for name, r in runs.items():
    ax_t.plot(r["wall_s"], r["smoothed_loss"], label=name)
    ax_n.plot(np.array(r["tokens_seen"]) / 1e6, r["smoothed_loss"], label=name)
  ax_t.axhline(target, color="grey", lw=0.8, ls="--")
  ax_t.set(
    xlabel="wall-clock after compilation (s)",
    ylabel="training loss (smoothed)",
    title="4 processes, worker 3 is 4x slower",
  )
  ax_n.set(xlabel="tokens trained (M)", title="per token")
  for ax in (ax_t, ax_n):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  return True


def model_part(args) -> list[dict]:
  """Step-time model: zero1 waits for the slowest; ACCO balances budgets (same total)."""
  from acco_jax.analysis import perfmodel as pm
  from acco_jax.dp import hetero

  psi, k, t = 124e6, 8, 0.1  # GPT-2 124M, 8 microbatches per update, 100 ms per microbatch
  rows = []
  for gbit, n in itertools.product((100, 10), (8, 16, 32, 64)):
    nodes = max(n // 8, 1)
    inter = pm.Link(gbit * pm.GBIT * 0.8, 5e-6)
    nvlink = pm.Link(300 * pm.GBYTE * 0.8, 2e-6)
    cluster = pm.Cluster(nodes, n // nodes, nvlink, inter if nodes > 1 else None)
    x = 2 * pm.collective_time("reduce_scatter", cluster, psi * 2)
    for slow in sorted({1, n // 8, n // 4}):
      times = np.full(n, t)
      times[:slow] = args.factor * t
      zero1 = k * times.max() + x
      budgets = hetero.plan_budgets(times, x, base=k // 2, k_max=4 * k, policy="balance")
      acco = 2 * max(hetero.makespan(budgets, times), x)
      homog = 2 * max(k // 2 * t, x)
      rows.append(
        {
          "gbit": gbit,
          "workers": n,
          "slow": slow,
          "comm_s": x,
          "zero1_s": zero1,
          "acco_s": acco,
          "acco_homog_s": homog,
          "ratio": acco / zero1,
          "slow_budget": int(budgets[:slow].min()),
          "fast_budget": int(budgets[slow:].max()),
        }
      )
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workers", type=int, default=4)
  ap.add_argument("--slow", type=int, default=3, help="index of the slow worker")
  ap.add_argument("--factor", type=float, default=4.0, help="slow worker's microbatch time ratio")
  ap.add_argument("--updates", type=int, default=120)
  ap.add_argument("--microbatches", type=int, default=8, help="per worker per update")
  ap.add_argument("--timeout", type=float, default=900)
  ap.add_argument("--reuse", action="store_true", help="summarise existing runs, launch none")
  ap.add_argument("--out", default=str(RESULTS / "heterogeneous.json"))
  ap.add_argument("--figure", default=str(REPO / "docs" / "figures" / "heterogeneous.png"))
  args = ap.parse_args(argv)

  log("calibrating the microbatch time with the adaptive policy's probe")
  cal = launch(
    args, "calibrate", "acco", 6, **{"hetero.adaptive": "balance", "hetero.adapt_every": 4}
  )
  t_mb = float(np.median(read_rows(cal)[1][-1]["mb_time_s"]))  # the processes' median
  sleep = (args.factor - 1) * t_mb
  log(
    f"fast microbatch {t_mb * 1e3:.1f} ms; slow worker sleeps {sleep * 1e3:.1f} ms per microbatch"
  )
  slow = {"hetero.slowdown": f"{args.slow}:{sleep:.4f}"}
  adaptive = {"hetero.adaptive": "balance", "hetero.adapt_every": 10}
  dirs = {
    "zero1-slow": launch(args, "zero1-slow", "zero1", args.updates, **slow),
    "acco-slow": launch(args, "acco-slow", "acco", args.updates, **slow, **adaptive),
    "acco-homog": launch(args, "acco-homog", "acco", args.updates, **adaptive),
  }
  per_update = args.workers * args.microbatches * 4 * 64  # tokens (microbatch 4 x 64)
  first = {k: summarise(k, v, per_update) for k, v in dirs.items()}
  target = max(first["zero1-slow"]["final_loss"], first["acco-slow"]["final_loss"])
  runs = {k: summarise(k, v, per_update, target) for k, v in dirs.items()}
  z, a = runs["zero1-slow"], runs["acco-slow"]
  ratio = (
    a["time_to_target_s"] / z["time_to_target_s"]
    if a["time_to_target_s"] and z["time_to_target_s"]
    else None
  )
  per_token = runs["acco-slow"]["eval_loss"] / runs["acco-homog"]["eval_loss"] - 1

  def cell(v, f):
    return "-" if v is None else f.format(v)

  table = [
    {
      "run": k,
      "s/update": cell(r["s_per_update"], "{:.3f}"),
      "loss": cell(r["final_loss"], "{:.3f}"),
      "eval": cell(r["eval_loss"], "{:.3f}"),
      "mb": str(r["microbatches_per_stage"]),
      "t": cell(r.get("time_to_target_s"), "{:.1f}"),
      "budgets": str(r.get("budgets", "equal")),
    }
    for k, r in runs.items()
  ]
  print(
    format_table(
      table,
      [
        ("run", "run"),
        ("s/update", "s per update"),
        ("loss", "final train loss"),
        ("eval", "final eval loss"),
        ("mb", "microbatches per stage"),
        ("t", "s to target"),
        ("budgets", "last budgets"),
      ],
    )
  )
  print(f"target loss {target:.4f}; acco/zero1 time to target: {cell(ratio, '{:.3f}')}")
  print(f"per token: acco-slow final eval loss vs acco-homog: {100 * per_token:+.2f}%")
  model = model_part(args)
  shown = [
    {
      "gbit": r["gbit"],
      "workers": r["workers"],
      "slow": r["slow"],
      "comm": f"{r['comm_s']:.3f}",
      "zero1": f"{r['zero1_s']:.2f}",
      "acco": f"{r['acco_s']:.2f}",
      "homog": f"{r['acco_homog_s']:.2f}",
      "ratio": f"{r['ratio']:.2f}",
      "budgets": f"{r['fast_budget']} / {r['slow_budget']}",
    }
    for r in model
  ]
  print(
    format_table(
      shown,
      [
        ("gbit", "Gbit/s"),
        ("workers", "workers"),
        ("slow", "slow"),
        ("comm", "comm s"),
        ("zero1", "zero1 s/update"),
        ("acco", "acco s/update"),
        ("homog", "acco, none slow"),
        ("ratio", "acco/zero1"),
        ("budgets", "budget fast / slow"),
      ],
    )
  )
  plot(runs, target, Path(args.figure))
  write_json(
    Path(args.out),
    {
      "machine": machine(),
      "args": vars(args),
      "fast_microbatch_s": t_mb,
      "sleep_s": sleep,
      "target_loss": target,
      "acco_over_zero1_time_to_target": ratio,
      "per_token_loss_change": per_token,
      "runs": runs,
      "model": model,
    },
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
