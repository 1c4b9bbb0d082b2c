"""Convergence per token of ACCO against ZeRO-1 (= DDP numerically), DPU and WP, at CPU scale.

The paper's TinyStories ablation (Figs. 5, 6, 10) compares, for the same model, data, tokens and
learning-rate schedule, DDP, DPU with 0 / 40 / 500 synchronous warm-up updates, weight prediction
(WP) and ACCO, and finds ACCO on top of DDP while DPU and WP trail it. This benchmark repeats that
comparison with the trainer (:func:`acco_jax.run.trainer.train_and_evaluate`) on the embedded corpus, in
two settings:

* ``d8``: 8 simulated devices, the TinyStories recipe of ``configs/tinystories_acco.py:cpu`` (see
  :data:`SETTINGS` for the shrink); zero1, acco, dpu with 0 and scaled 40 / 500 warm-up updates, wp.
* ``d32``: 32 simulated devices, a smaller model (the paper's ACCO fell slightly behind DDP at 32
  workers, Table 2); zero1, acco, dpu.

Every run uses the same constant learning rate (no warm-up, no clipping, as the paper's TinyStories
setting) and the same batch per update (ACCO splits it into two stages). Each run is its own Python
process (the simulated device count is fixed when the backend starts) and writes its metrics to
``<out>/runs/<setting>/<method>/seed<k>/``; a run whose ``result.json`` exists is skipped, so an
interrupted benchmark resumes where it stopped. At the end the runs are collected into
``<out>/convergence.json`` (curves, final losses, mean ± std over seeds, gaps to zero1).

Usage::

  python -m bench.dp.convergence --jobs 2                 # the full benchmark (< 1 h on 2 cores)
  python -m bench.dp.convergence --settings d8 --seeds 0  # a subset
  python -m bench.dp.convergence --collect                # only rebuild convergence.json
  python -m bench.dp.convergence --settings d8-lr5e-4 --seeds 0 --jobs 2 \
    --json convergence_diagnostics.json                # d8 at the paper's LR, one seed
  python -m bench.dp.convergence --settings d8 --seeds 0 1 2 3 4 5 --methods zero1 acco --jobs 2 \
    --json convergence_d8_6seeds.json                  # 3 more seeds of the headline pair
  python -m bench.dp.convergence --smoke --out /tmp/conv  # CI: tiny model, 2 devices, 2 methods
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import common
from bench.dp.convergence_settings import (
  FRACTIONS,
  LR,
  PAPER_UPDATES,
  PAPER_WARMUPS,
  SEEDS,
  SETTINGS,
  make_config,
  tokens_per_update,
  warmup_updates,
)

# -- one run (child process) ------------------------------------------------------------------------


def worker(args) -> None:
  import jax

  config = make_config(args.setting, args.method, args.seed)
  assert jax.device_count() >= SETTINGS[args.setting]["devices"], jax.devices()
  start = time.perf_counter()
  result = {"setting": args.setting, "method": args.method, "seed": args.seed}
  common.train_run(config, args.workdir, result, start)


# -- the driver -------------------------------------------------------------------------------------


def run_dir(out: Path, setting: str, label: str, seed: int) -> Path:
  return out / "runs" / setting / label / f"seed{seed}"


def launch(out: Path, setting: str, label: str, seed: int) -> subprocess.Popen:
  d = run_dir(out, setting, label, seed)
  if d.exists():  # a partial run (no result.json): start it again from scratch
    shutil.rmtree(d)
  d.mkdir(parents=True)
  cmd = [
    *common.module_command(__spec__.name),
    "--worker",
    "--workdir",
    str(d),
    "--setting",
    setting,
    "--method",
    label,
    "--seed",
    str(seed),
  ]
  log = open(d / "run.log", "w")
  env = common.cpu_env(SETTINGS[setting]["devices"])
  proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO)
  proc.log = log
  return proc


def run_all(
  out: Path, plan: list[tuple], jobs: int, timeout_s: float, *, launch=launch, run_dir=run_dir
) -> list[str]:
  """Runs the missing runs of ``plan``, ``jobs`` at a time; returns the runs that failed.

  ``launch(out, *run)`` starts a run's process and ``run_dir(out, *run)`` is where it writes its
  ``result.json`` (this script's by default; ``bench/loco/loco_compare.py`` passes its own)."""
  todo = [r for r in plan if not (run_dir(out, *r) / "result.json").exists()]
  common.log(f"{len(plan) - len(todo)} of {len(plan)} runs already done; {len(todo)} to run")
  running, failed, t0 = {}, [], time.time()
  while todo or running:
    while todo and len(running) < jobs:
      r = todo.pop(0)
      running[r] = (launch(out, *r), time.time())
      common.log(f"[{time.time() - t0:6.0f} s] start {'/'.join(map(str, r))}")
    time.sleep(1.0)
    for r, (proc, started) in list(running.items()):
      code = proc.poll()
      if code is None and time.time() - started > timeout_s:
        proc.kill()
        code = proc.wait()
      if code is None:
        continue
      proc.log.close()
      del running[r]
      name = "/".join(map(str, r))
      if code != 0 or not (run_dir(out, *r) / "result.json").exists():
        failed.append(name)
        tail = (run_dir(out, *r) / "run.log").read_text()[-1500:]
        common.log(f"[{time.time() - t0:6.0f} s] FAILED {name} (exit {code}):\n{tail}")
      else:
        res = json.loads((run_dir(out, *r) / "result.json").read_text())
        common.log(
          f"[{time.time() - t0:6.0f} s] done {name}: {res['status']} "
          f"eval_loss={res['final_eval_loss']:.4f} in {res['wall_s']:.0f} s"
        )
  return failed


# -- collecting -------------------------------------------------------------------------------------


def read_run(d: Path, s: dict) -> dict:
  """Curves of one run from its metrics.jsonl: training loss per update and eval loss per update."""
  res = json.loads((d / "result.json").read_text())
  tpu = tokens_per_update(s)
  by_update: dict[int, list[float]] = {}
  evals: dict[int, float] = {}
  with open(d / "metrics.jsonl") as f:
    for line in f:
      row = json.loads(line)
      if "eval_loss" in row:
        evals[int(row["update"])] = row["eval_loss"]
      elif "loss" in row and "stage" in row:
        # ACCO logs two stages per update (estimate, then commit): both belong to the update
        # that the commit completes, i.e. ceil(stage / 2).
        u = math.ceil(row["stage"] / 2) if res["method"] == "acco" else int(row["update"])
        u = max(u, 1)
        by_update.setdefault(u, []).append(row["loss"])
  updates = sorted(by_update)
  ev = sorted(evals)
  return {
    "status": res["status"],
    "wall_s": res["wall_s"],
    "final_eval_loss": res["final_eval_loss"],
    "train": {
      "update": updates,
      "tokens": [u * tpu for u in updates],
      "loss": [statistics.fmean(by_update[u]) for u in updates],
    },
    "eval": {"update": ev, "tokens": [u * tpu for u in ev], "loss": [evals[u] for u in ev]},
  }


def _mean_std(xs: list[float]) -> dict:
  xs = [x for x in xs if x is not None]
  finite = [x for x in xs if math.isfinite(x)]
  return {
    "mean": statistics.fmean(finite) if finite else float("nan"),
    "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
    "n": len(finite),
    "nonfinite": len(xs) - len(finite),
    "values": xs,
  }


def eval_at(run: dict, update: int) -> float:
  """The eval loss at ``update`` (NaN if the run did not reach it)."""
  ev = dict(zip(run["eval"]["update"], run["eval"]["loss"], strict=True))
  return ev.get(update, float("nan"))


def summarize(setting: str, runs: dict[str, dict[int, dict]], base_runs=None) -> dict:
  """Final eval loss per method (mean ± std over seeds) and gaps to the baseline (zero1, or
  ``base_runs``) at 25 / 50 / 100 %."""
  s = SETTINGS[setting]
  total = s["num_updates"]
  points = {f"{int(f * 100)}%": round(f * total) for f in FRACTIONS}
  out = {"methods": {}}
  base = runs.get("zero1", {})
  if base_runs is not None:
    base = base_runs
  for label, seeds in runs.items():
    m = {"final_eval_loss": _mean_std([r["final_eval_loss"] for r in seeds.values()])}
    m["wall_s"] = _mean_std([r["wall_s"] for r in seeds.values()])
    m["eval_loss_at"], m["gap_to_zero1"] = {}, {}
    for name, u in points.items():
      m["eval_loss_at"][name] = _mean_std([eval_at(r, u) for r in seeds.values()])
      if label != "zero1" and base:
        # Paired by seed: the same seed gives both methods the same init, data order and eval set.
        diffs = [eval_at(r, u) - eval_at(base[k], u) for k, r in seeds.items() if k in base]
        rel = [
          100 * (eval_at(r, u) / eval_at(base[k], u) - 1) for k, r in seeds.items() if k in base
        ]
        m["gap_to_zero1"][name] = {"abs": _mean_std(diffs), "rel_pct": _mean_std(rel)}
    out["methods"][label] = m
  out["points"] = points
  return out


def collect(
  out: Path, settings: list[str], seeds: list[int], wall_s: float | None, methods=None
) -> dict:
  results = {"machine": common.machine(), "settings": {}}
  for setting in settings:
    s = SETTINGS[setting]
    runs: dict[str, dict[int, dict]] = {}
    for label in s["methods"]:
      if methods and label not in methods:
        continue
      for seed in seeds:
        d = run_dir(out, setting, label, seed)
        if (d / "result.json").exists():
          runs.setdefault(label, {})[seed] = read_run(d, s)
    if not runs:
      continue
    info = {k: v for k, v in s.items() if k != "methods"}
    info.update(
      tokens_per_update=tokens_per_update(s),
      lr=s.get("lr", LR),
      schedule="constant",
      dpu_warmups={m: warmup_updates(m, s["num_updates"]) for m in s["methods"] if "dpu" in m},
    )
    base_runs = None
    if s.get("baseline"):  # another setting's baseline run (e.g. the same DDP run)
      base_runs = {}
      for seed in seeds:
        d = run_dir(out, s["baseline"], "ddp", seed)
        if (d / "result.json").exists():
          base_runs[seed] = read_run(d, SETTINGS[s["baseline"]])
    elif "ddp" in runs:
      base_runs = runs["ddp"]
    results["settings"][setting] = {
      "config": info,
      "summary": summarize(setting, runs, base_runs),
      "runs": {label: {str(k): v for k, v in seeds_.items()} for label, seeds_ in runs.items()},
    }
  results["assumptions"] = {
    "paper_updates": PAPER_UPDATES,
    "paper_warmups": list(PAPER_WARMUPS),
    "note": "DPU warm-ups scaled as paper_warmup * num_updates / paper_updates",
  }
  if wall_s is not None:
    results["wall_s"] = wall_s
  return results


def print_tables(results: dict) -> None:
  for setting, r in results["settings"].items():
    rows = []
    for label, m in r["summary"]["methods"].items():
      f = m["final_eval_loss"]
      row = {"method": label, "final": f"{f['mean']:.4f} ± {f['std']:.4f} (n={f['n']})"}
      for name, g in m["gap_to_zero1"].items():
        row[name] = f"{g['rel_pct']['mean']:+.2f}%"
      rows.append(row)
    cols = [("method", "method"), ("final", "final eval loss")]
    cols += [(p, f"gap@{p}") for p in r["summary"]["points"]]
    common.log(f"\n{setting}:\n" + common.format_table(rows, cols))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=Path, default=common.RESULTS, help="results folder")
  p.add_argument("--settings", nargs="+", default=["d8", "d32"], choices=list(SETTINGS))
  p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
  p.add_argument("--methods", nargs="+", help="only these method labels (default: the setting's)")
  p.add_argument("--jobs", type=int, default=1, help="runs at a time")
  p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
  p.add_argument("--collect", action="store_true", help="only collect existing runs")
  p.add_argument("--json", default="convergence.json", help="results file name, in --out")
  p.add_argument("--smoke", action="store_true", help="tiny model, 2 methods, 1 seed (CI)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--workdir", help=argparse.SUPPRESS)
  p.add_argument("--setting", help=argparse.SUPPRESS)
  p.add_argument("--method", help=argparse.SUPPRESS)
  p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  if args.smoke:
    args.settings, args.seeds, args.jobs = ["smoke"], [0], max(args.jobs, 2)
  # Seed-major order: an interrupted benchmark has whole seeds of every method.
  plan = [(s, m, k) for s in args.settings for k in args.seeds for m in SETTINGS[s]["methods"]]
  plan = [r for r in plan if not args.methods or r[1] in args.methods]
  t0 = time.time()
  failed = [] if args.collect else run_all(args.out, plan, args.jobs, args.timeout)
  wall = None if args.collect else time.time() - t0
  results = collect(args.out, args.settings, args.seeds, wall, args.methods)
  name = "convergence_smoke.json" if args.smoke else args.json
  path = common.write_json(args.out / name, results)
  print_tables(results)
  common.log(f"wrote {path}" + (f" in {wall:.0f} s" if wall is not None else ""))
  if failed:
    common.log(f"{len(failed)} runs failed: {', '.join(failed)}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
