"""Loss at equal tokens of AdamW against Muon (``opt.name=muon``), under ACCO and under ZeRO-1.

Issue 39's measurement. Every run is ``train.py``'s trainer on ``configs/gpt2_zero1.py`` or
``configs/gpt2_acco.py`` at the ``cpu`` preset (a 4-layer D=256 GPT, 2k BPE on the embedded corpus,
context 128, 8 simulated devices x 4 microbatches x 2 rows = 8192 tokens per update, cosine LR with
20 warm-up updates, clipping at 1), unchanged except for the optimizer, its learning rates and the
seed (and ``--updates``, the same for every run). Muon runs with the owner layout
(``comm.layout=auto``): Muon on the blocks' weight matrices, AdamW (``opt.lr``) on the rest.

Two phases, each run in its own process (``bench/dp/convergence.py``'s scheduler: resumable, a run
whose ``result.json`` exists is not run again):

1. tune, under zero1 on seed 0: AdamW's ``opt.lr`` over ``--adamw-lrs`` and Muon's ``opt.muon_lr``
   over ``--muon-lrs`` (with ``opt.lr``, AdamW's on the non-matrix leaves, at ``--muon-adamw-lr``,
   the configs' default 2e-3, so that both grids run at once); the lowest final eval loss wins;
2. ``--seeds`` x {adamw, muon} x {zero1, acco} at the chosen values (seed 0's zero1 runs are the
   tuning runs themselves).

``--adamw-lr`` / ``--muon-lr`` fix a value and skip its tuning. The JSON (``bench/results/muon.json``)
holds every run's curves (training loss per update, eval loss), final losses, ``tokens_seen`` (which
must be equal across all runs: checked), mean ± std over seeds and paired per-seed differences.

Usage::

  python -m bench.dp.muon --jobs 2                            # tune, then 3 seeds x 2 x 2
  python -m bench.dp.muon --collect                           # the JSON and table only
  python -m bench.dp.muon --adamw-lr 2e-3 --muon-lr 0.02      # no tuning
  python -m bench.dp.muon --smoke --out /tmp/muon             # CI: tiny model, 2 devices, 2 runs
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
from bench.dp import convergence

SETTINGS = {
  # configs' cpu preset; evaluation only at the end (eval_every=0) to save time
  "cpu": dict(preset="cpu", devices=8, num_updates=100, eval_every=0, eval_batches=8),
  "smoke": dict(preset="tiny", devices=2, num_updates=2, eval_every=1, eval_batches=2),
}
METHODS = ("zero1", "acco")
OPTS = ("adamw", "muon")
ADAMW_LRS = (1e-3, 2e-3, 4e-3)
MUON_LRS = (0.02, 0.04, 0.08)  # 0.01 left out to fit the time (short runs favour larger LRs)
MUON_ADAMW_LR = 2e-3  # the configs' default, not AdamW's tuned value: both grids run at once
SEEDS = (0, 1, 2)
TAIL = 10  # the final training loss is the mean over the last TAIL updates


def make_config(
  setting: str, method: str, opt: str, lr: float, muon_lr: float, seed: int, updates: int
):
  from configs import gpt2_acco, gpt2_zero1

  s = SETTINGS[setting]
  c = {"zero1": gpt2_zero1, "acco": gpt2_acco}[method].get_config(s["preset"])
  c.opt.name, c.opt.lr, c.opt.muon_lr = opt, lr, muon_lr
  if updates != c.train.num_updates:  # a shorter run keeps the preset's warm-up share (20 of 100)
    c.opt.warmup_updates = max(1, round(c.opt.warmup_updates * updates / c.train.num_updates))
  c.train.num_updates, c.train.seed = updates, seed
  c.train.log_every = 1  # every stage; grouped per update of tokens when collected
  c.train.eval_every, c.train.eval_batches = s["eval_every"], s["eval_batches"]
  c.train.sample_tokens, c.train.on_nonfinite = 0, "stop"
  c.ckpt.every, c.ckpt.async_save = 0, False
  c.mesh.num_devices, c.mesh.cpu_devices = s["devices"], 0  # XLA_FLAGS is set by the parent
  return c


def worker(a) -> None:

  config = make_config(a.setting, a.method, a.opt, a.lr, a.muon_lr, a.seed, a.updates)
  start = time.perf_counter()
  result = {"method": a.method, "opt": a.opt, "lr": a.lr, "muon_lr": a.muon_lr, "seed": a.seed}
  common.train_run(config, a.workdir, result, start)


# -- runs: (setting, updates, method, opt, lr, muon_lr, seed) ---------------------------------------


def name(method: str, opt: str, lr: float, muon_lr: float) -> str:
  return f"{method}-{opt}-lr{lr:g}" + (f"-mlr{muon_lr:g}" if opt == "muon" else "")


def run_dir(out, setting, updates, method, opt, lr, muon_lr, seed) -> Path:
  d = out / "runs" / "muon" / f"{setting}-u{updates}"
  return d / name(method, opt, lr, muon_lr) / f"seed{seed}"


def launch(out, setting, updates, method, opt, lr, muon_lr, seed) -> subprocess.Popen:
  d = run_dir(out, setting, updates, method, opt, lr, muon_lr, seed)
  if d.exists():  # a partial run (no result.json): start again
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
    method,
    "--opt",
    opt,
    "--lr",
    repr(lr),
    "--muon-lr",
    repr(muon_lr),
    "--seed",
    str(seed),
    "--updates",
    str(updates),
  ]
  log = open(d / "run.log", "w")
  env = common.cpu_env(SETTINGS[setting]["devices"])
  proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO)
  proc.log = log
  return proc


def read_run(d: Path) -> dict:
  """One run: training loss per update (an update = one zero1 batch of tokens; ACCO's two stages
  of half a batch each are averaged), eval loss per update, tokens_seen and updates at the end."""
  res = json.loads((d / "result.json").read_text())
  rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
  cfg = res["config"]
  n = cfg["mesh"]["num_devices"]
  tpu = n * cfg["batch"]["microbatches"] * cfg["batch"]["microbatch_size"] * cfg["data"]["seq_len"]
  train: dict[int, list[float]] = {}
  evals: dict[int, float] = {}
  last = {}
  for row in rows:
    if "eval_loss" in row:
      evals[int(row["update"])] = row["eval_loss"]
    elif "loss" in row and "tokens_seen" in row:
      train.setdefault(math.ceil(row["tokens_seen"] / tpu), []).append(row["loss"])
      last = row
  ups = sorted(train)
  losses = [statistics.fmean(train[u]) for u in ups]
  tail = [x for x in losses[-TAIL:] if math.isfinite(x)]
  return {
    "status": res["status"],
    "wall_s": res["wall_s"],
    "final_eval_loss": res["final_eval_loss"],
    "final_train_loss": statistics.fmean(tail) if tail else float("nan"),
    "tokens_seen": last.get("tokens_seen"),
    "updates": last.get("update"),
    "stages": last.get("stage"),
    "tokens_per_update": tpu,
    "train": {"update": ups, "loss": losses},
    "eval": {"update": sorted(evals), "loss": [evals[u] for u in sorted(evals)]},
  }


def best(out, setting, updates, runs) -> tuple[float, list[dict]]:
  """The run (of ``runs``, seed 0) with the lowest finite final eval loss, and the sweep's rows."""
  rows = []
  for r in runs:
    d = run_dir(out, setting, updates, *r)
    if (d / "result.json").exists():
      x = read_run(d)
      rows.append(
        {
          "lr": r[2],
          "muon_lr": r[3] if r[1] == "muon" else None,
          "final_eval_loss": x["final_eval_loss"],
          "final_train_loss": x["final_train_loss"],
          "status": x["status"],
        }
      )
  ok = [
    row
    for row in rows
    if row["final_eval_loss"] is not None and math.isfinite(row["final_eval_loss"])
  ]
  if not ok:
    raise SystemExit(f"no finished tuning run among {runs}")
  return min(ok, key=lambda row: row["final_eval_loss"]), rows


def collect(out, setting, updates, seeds, lr, muon_lr, mlr_adamw, tuning) -> dict:
  runs: dict = {}
  for method in METHODS:
    for opt in OPTS:
      for seed in seeds:
        d = run_dir(
          out, setting, updates, method, opt, lr if opt == "adamw" else mlr_adamw, muon_lr, seed
        )
        if (d / "result.json").exists():
          runs.setdefault(f"{method}/{opt}", {})[seed] = read_run(d)
  ms = convergence._mean_std
  summary = {
    key: {
      "final_eval_loss": ms([r["final_eval_loss"] for r in by_seed.values()]),
      "final_train_loss": ms([r["final_train_loss"] for r in by_seed.values()]),
      "wall_s": ms([r["wall_s"] for r in by_seed.values()]),
    }
    for key, by_seed in runs.items()
  }

  def paired(a: str, b: str) -> dict:  # 100 (a / b - 1) per seed, final eval loss
    ra, rb = runs.get(a, {}), runs.get(b, {})
    pct = [
      100 * (ra[k]["final_eval_loss"] / rb[k]["final_eval_loss"] - 1) for k in sorted(ra) if k in rb
    ]
    return {"per_seed_pct": pct, **{k: v for k, v in ms(pct).items() if k != "values"}}

  comparisons = {f"{m}: muon vs adamw": paired(f"{m}/muon", f"{m}/adamw") for m in METHODS}
  comparisons |= {f"{o}: acco vs zero1": paired(f"acco/{o}", f"zero1/{o}") for o in OPTS}
  tokens = {f"{k}/seed{s}": r["tokens_seen"] for k, by in runs.items() for s, r in by.items()}
  return {
    "setting": {**SETTINGS[setting], "name": setting, "num_updates": updates},
    "chosen": {"adamw_lr": lr, "muon_lr": muon_lr, "muon_adamw_lr": mlr_adamw},
    "tuning": tuning,
    "summary": summary,
    "comparisons": comparisons,
    "tokens_seen": tokens,
    "tokens_equal": len(set(tokens.values())) == 1,
    "runs": {k: {str(s): r for s, r in by.items()} for k, by in runs.items()},
  }


def table(results: dict) -> str:
  seeds = sorted({int(s) for by in results["runs"].values() for s in by})
  head = " | ".join(f"seed {s}" for s in seeds)
  lines = [
    f"| method | optimizer | final eval loss | final train loss | {head} | s/run |",
    "|---|---|---|---|" + "---|" * len(seeds) + "---|",
  ]
  for key, m in results["summary"].items():
    method, opt = key.split("/")
    e, t, w = m["final_eval_loss"], m["final_train_loss"], m["wall_s"]
    each = [results["runs"][key].get(str(s), {}).get("final_eval_loss") for s in seeds]
    cells = [f"{x:.4f}" if x is not None else "" for x in each]
    lines.append(
      f"| {method} | {opt} | {e['mean']:.4f} ± {e['std']:.4f} | "
      f"{t['mean']:.4f} ± {t['std']:.4f} | " + " | ".join(cells) + f" | {w['mean']:.0f} |"
    )
  lines.append("")
  for name_, c in results["comparisons"].items():
    if not c["per_seed_pct"]:
      continue
    each = ", ".join(f"{x:+.2f}" for x in c["per_seed_pct"])
    lines.append(f"- {name_}: {c['mean']:+.2f} ± {c['std']:.2f}% (per seed: {each})")
  lines.append(
    f"- tokens_seen equal across runs: {results['tokens_equal']} "
    f"({sorted(set(results['tokens_seen'].values()))})"
  )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=Path, default=common.RESULTS)
  p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
  p.add_argument("--adamw-lrs", nargs="+", type=float, default=list(ADAMW_LRS))
  p.add_argument("--muon-lrs", nargs="+", type=float, default=list(MUON_LRS))
  p.add_argument("--adamw-lr", type=float, help="fix AdamW's opt.lr (no AdamW tuning)")
  p.add_argument("--muon-lr", type=float, help="fix opt.muon_lr (no Muon tuning)")
  p.add_argument(
    "--muon-adamw-lr",
    type=float,
    default=MUON_ADAMW_LR,
    help="opt.lr of Muon runs: AdamW's on the non-matrix leaves",
  )
  p.add_argument("--updates", type=int, help="train.num_updates of every run")
  p.add_argument("--jobs", type=int, help="runs at a time (default 1; --smoke: 2)")
  p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
  p.add_argument("--collect", action="store_true", help="only collect existing runs")
  p.add_argument("--smoke", action="store_true", help="tiny model, 2 devices, muon x 2 methods")
  p.add_argument("--json", default="muon.json")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  for flag in ("--workdir", "--setting", "--method", "--opt"):
    p.add_argument(flag, help=argparse.SUPPRESS)
  p.add_argument("--lr", type=float, help=argparse.SUPPRESS)
  p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker:
    worker(a)
    return 0
  setting = "smoke" if a.smoke else "cpu"
  if a.smoke:  # no tuning, one seed: zero1 and acco with Muon at the defaults
    a.seeds, a.adamw_lr, a.muon_lr, a.jobs = [0], 2e-3, 0.02, a.jobs or 2
  a.jobs = a.jobs or 1
  updates = a.updates or SETTINGS[setting]["num_updates"]
  t0, failed, tuning = time.time(), [], {}

  def go(runs):
    plan = [(setting, updates, *r) for r in runs]
    if not a.collect:
      failed.extend(
        convergence.run_all(a.out, plan, a.jobs, a.timeout, launch=launch, run_dir=run_dir)
      )

  lr, muon_lr, mlr_adamw = a.adamw_lr, a.muon_lr, a.muon_adamw_lr
  # One tuning phase (both grids at once, so that two runs at a time keep both slots busy)
  sweep = [] if lr is not None else [("zero1", "adamw", x, MUON_LRS[1], 0) for x in a.adamw_lrs]
  if muon_lr is None:
    sweep += [("zero1", "muon", mlr_adamw, x, 0) for x in a.muon_lrs]
  go(sweep)
  if lr is None:
    won, tuning["adamw"] = best(a.out, setting, updates, [r for r in sweep if r[1] == "adamw"])
    lr = won["lr"]
    common.log(f"AdamW: opt.lr={lr:g} (final eval loss {won['final_eval_loss']:.4f})")
  if muon_lr is None:
    won, tuning["muon"] = best(a.out, setting, updates, [r for r in sweep if r[1] == "muon"])
    muon_lr = won["muon_lr"]
    common.log(f"Muon: opt.muon_lr={muon_lr:g} (final eval loss {won['final_eval_loss']:.4f})")
  opts = ("muon",) if a.smoke else OPTS
  final = [
    (m, o, lr if o == "adamw" else mlr_adamw, muon_lr, k)
    for k in a.seeds
    for o in opts
    for m in METHODS
  ]
  go(final)  # seed-major: an interrupted benchmark has whole seeds
  results = collect(a.out, setting, updates, a.seeds, lr, muon_lr, mlr_adamw, tuning)
  results.update(machine=common.machine(), wall_s=None if a.collect else time.time() - t0)
  stem = "muon_smoke" if a.smoke else Path(a.json).stem
  status = common.write_report(a.out, stem, results, table(results), failed)
  return 1 if status or not results["tokens_equal"] else 0


if __name__ == "__main__":
  sys.exit(main())
