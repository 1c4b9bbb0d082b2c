"""SkipPipe at CPU scale: simulated iteration time, convergence, and layer omission.

Four tables (``--part``):

* ``sim``: the iteration time the discrete-event simulator (:mod:`acco_jax.skippipe.simulate`) gives
  for the topology presets single-cluster, multi-cluster and geo, S = 6 and 8 stages, skip ratios
  0 / 0.25 / 0.33 / 0.5, swaps off and on: the full pipeline on fixed lanes (GPipe fill-drain and
  1F1B) against random valid paths (median of 5 draws) and the path scheduler. The cost model is a
  ~1B-parameter decoder (24 layers, d_model 2048, vocabulary 32000), microbatches of 4 x 1024
  tokens, nodes of 100 TFLOP/s effective (scaled by each node's speed), bf16 activations; 16
  microbatches per iteration; nodes 2 per stage and 4 on stage 0 (``topology.default_nodes``).
  Seconds of host time, no device.
* ``sim-allreduce``: the same at skip 0 and 0.5 with swaps, each stage's bf16 gradient all-reduce
  among its nodes added after the pipeline (and to the scheduler's objective), under two stage
  assignments: priced by a microbatch's round trip only, and by the round trip plus the slowest
  stage's all-reduce.
  Both tables give the lower bound on any plan's makespan (``bounds.lower_bound``) beside the
  scheduler's.
* ``timeline``: each node's busy intervals (forward, backward, head, the stage all-reduce; idle in
  grey) for GPipe, 1F1B and the scheduled plan on geo, S = 6, skip 0.25 with swaps, the gradient
  all-reduce priced (needs matplotlib).
* ``convergence``: a small GPT (8 blocks) trained with SkipPipe paths on 8 simulated devices
  (zero1, every worker holds the whole model), scheduled on the geo preset with S = 8, for each
  skip ratio with and without swaps, against normal training; equal iterations, final eval loss of
  the full model, over seeds. One process runs every run, with one compiled step per path length;
  normal training is the identity order through the skip-0 step (equal to ``model.loss_fn`` to
  float tolerance, tests/skippipe_train_test.py).
* ``pipeline-convergence`` (``bench/pipeline/skippipe_pipeline.py``): ``method=pipeline`` on 2 data lanes x
  4 stages, the scheduled plan against random paths and the full pipeline at equal updates, and
  per stage how often it is visited and what it learned (not part of ``all``).
* ``plan``: the scheduled plan ``train.py --config C --config.method=pipeline`` trains on
  ``--devices`` devices (the same function on the same config): its stage assignment, simulated
  time and each microbatch's route over lanes; writes ``skippipe_plan.json``.
* ``omission``: for the models of ``convergence`` (normal, and SkipPipe at skip 0.5), the eval loss
  of the full model, of every other stage (stages 0, 2, 4, 6: half the blocks) and of random
  half-paths (stage 0 and 3 random stages in order), relative to the full model.

Usage::

  python -m bench.pipeline.skippipe --part sim                        # seconds to a minute
  python -m bench.pipeline.skippipe --part sim-allreduce              # about a minute
  python -m bench.pipeline.skippipe --part timeline                   # docs/figures/skippipe_timeline.png
  python -m bench.pipeline.skippipe --part convergence --seeds 0 1 2  # also writes the omission table;
                                                             # rerun: goes on from written runs
  python -m bench.pipeline.skippipe --part pipeline-convergence       # about 10 minutes
  python -m bench.pipeline.skippipe --part plan --config configs/gpt2_skippipe.py:tiny --devices 8
                                        # the plan train.py --config.method=pipeline trains
  python -m bench.pipeline.skippipe --smoke --out /tmp/sp             # CI: a sliver of each part

Writes ``bench/results/skippipe_sim.json``, ``skippipe_sim_allreduce.json`` and
``skippipe_convergence.json`` (with ``skippipe_convergence_runs.json``, the runs so far), and
``skippipe_pipeline_convergence.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from bench import common
from bench.pipeline import skippipe_sim

PARTS = (
  "sim",
  "sim-allreduce",
  "timeline",
  "convergence",
  "collect",
  "pipeline-convergence",
  "plan",
  "all",
)


# -- convergence and omission: one worker process per seed, 8 simulated devices --------------------

CONV = dict(D=64, N=8, H=4, seq_len=64, microbatch_size=1, microbatches=4, num_updates=60, lr=3e-3)
STAGES = 8


def _config(seed: int, skip: float | None, swap: bool, conv: dict):
  from configs import gpt2_skippipe

  c = gpt2_skippipe.get_config("tiny")
  c.model.D, c.model.N, c.model.H = conv["D"], conv["N"], conv["H"]
  c.data.tokenizer, c.data.seq_len = "byte", conv["seq_len"]
  c.batch.microbatch_size, c.batch.microbatches = conv["microbatch_size"], conv["microbatches"]
  c.train.num_updates, c.train.seed = conv["num_updates"], seed
  c.train.eval_batches = 8
  c.opt.lr, c.opt.warmup_updates = conv["lr"], min(5, conv["num_updates"] - 1)
  c.pipeline.stages = 0 if skip is None else STAGES
  c.pipeline.skip, c.pipeline.swap = skip or 0.0, swap
  c.pipeline.seed = seed
  return c


class _Identity:
  """Every microbatch runs every block in order: normal training through the same program."""

  def __init__(self, rows: int, blocks: int):
    self.rows, self.blocks = rows, blocks

  def order_rows(self, step: int) -> np.ndarray:
    return np.tile(np.arange(self.blocks, dtype=np.int32), (self.rows, 1))


def _train(run, config, orders):
  """Trains with the trainer's pieces (the ordered stream, the step) and returns params, losses."""
  import jax

  from acco_jax import model, parallel
  from acco_jax.run import streams
  from acco_jax.skippipe import orders as orders_lib

  train, mesh = run.step, run.mesh
  rows = mesh.size * train.num_microbatches * config.batch.microbatch_size
  stream = streams.batch_stream(run, config, run.tokens.train, rows, seed=config.train.seed)
  stream = orders_lib.OrderedStream(stream, orders)
  state = train.init(model.init_params(run.model_cfg, config.train.seed))
  losses = []
  for _ in range(run.total_stages):
    state, m = train.step(state, parallel.global_batch(next(stream), mesh))
    losses.append(float(jax.device_get(m["loss"])))
  return jax.device_get(train.params(state)), losses


def worker(out: str, seeds: list[int], conv: dict, omission_skip: float) -> None:
  """Every run of the table in one process: one compiled step per path length, shared by the
  seeds, the swap settings and (for skip 0) normal training."""
  from acco_jax.run import build, report
  from acco_jax.skippipe import orders as orders_lib
  from acco_jax.skippipe import paths

  per_stage = conv["N"] // STAGES
  half_every_other = np.arange(conv["N"]).reshape(STAGES, per_stage)[::2].reshape(-1)
  evals: dict = {}

  def evaluate(run, config, params, order=None):
    key = None if order is None else tuple(int(i) for i in order)
    if key not in evals:
      evals[key] = report.eval_function(run.model_cfg, order)
    return report.evaluate(run, config, params, evals[key])["eval_loss"]

  results, runs = _done_runs(out, conv), {}
  done = {(r["seed"], r["skip"], r["swap"]) for r in results}
  for seed in seeds:  # seed-major: a cut-off benchmark still has whole seeds
    rng = np.random.default_rng(100 + seed)
    half_random = [
      paths.layer_order(p, conv["N"], STAGES)
      for p in paths.random_paths(5, STAGES, 0.5, False, rng)
    ]
    for skip in skippipe_sim.SKIPS:
      if skip not in runs:
        runs[skip] = build.build(_config(seeds[0], skip, False, conv))
      run = runs[skip]
      num_mb = run.mesh.size * run.step.num_microbatches
      for swap in ([None] if skip == 0.0 else []) + [False, True]:
        if (seed, None if swap is None else skip, bool(swap)) in done:
          continue  # written by an earlier, cut-off invocation with the same setting
        config = _config(seed, None if swap is None else skip, bool(swap), conv)
        t0 = time.perf_counter()
        if swap is None:
          orders = _Identity(num_mb * conv["microbatch_size"], conv["N"])
        else:
          orders = orders_lib.LayerOrders(
            config.pipeline, run.model_cfg, num_mb, conv["microbatch_size"]
          )
        params, losses = _train(run, config, orders)
        full = evaluate(run, config, params)
        row = dict(
          seed=seed,
          skip=None if swap is None else skip,
          swap=bool(swap),
          eval_loss=full,
          train_loss_last=losses[-1],
          wall_s=round(time.perf_counter() - t0, 1),
        )
        if swap is None or (skip == omission_skip and not swap):
          row["half_every_other"] = evaluate(run, config, params, half_every_other)
          row["half_random"] = [evaluate(run, config, params, o) for o in half_random]
        common.log(
          f"  seed {seed} skip={row['skip']} swap={swap}: eval {full:.4f} ({row['wall_s']} s)"
        )
        results.append(row)
        common.write_json(out, {"setting": conv, "rows": results})


def _done_runs(out: str, conv: dict) -> list[dict]:
  """The runs an earlier invocation wrote with this same setting; the benchmark goes on from them."""
  from pathlib import Path

  path = Path(out)
  if not path.exists():
    return []
  data = json.loads(path.read_text())
  if data.get("setting") != conv:
    sys.exit(
      f"error: {path} holds runs of another setting ({data.get('setting')}); "
      f"pass --out to another folder, or move it away to start over"
    )
  return data["rows"]


def summarise(rows: list[dict]) -> tuple[list[dict], list[dict]]:
  conv, omit = [], []
  keys = sorted({(r["skip"] is not None, r["skip"] or 0.0, r["swap"]) for r in rows})
  base = [r["eval_loss"] for r in rows if r["skip"] is None]
  normal = {r["seed"]: r["eval_loss"] for r in rows if r["skip"] is None}
  for has, skip, swap in keys:
    sel = [
      r
      for r in rows
      if (r["skip"] is not None) == has and (r["skip"] or 0.0) == skip and r["swap"] == swap
    ]
    vals = [r["eval_loss"] for r in sel]
    ratios = [r["eval_loss"] / normal[r["seed"]] - 1 for r in sorted(sel, key=lambda r: r["seed"])]
    conv.append(
      dict(
        run="normal" if not has else f"skip {skip}",
        swap=swap if has else "",
        eval_loss=f"{statistics.mean(vals):.4f} ± {statistics.pstdev(vals):.4f}",
        vs_normal=f"{statistics.mean(vals) / statistics.mean(base) - 1:+.1%}",
        per_seed=" ".join(f"{100 * x:+.1f}" for x in ratios) if has else "",
        median=f"{statistics.median(ratios):+.1%}" if has else "",
        seeds=len(vals),
      )
    )
    if any("half_every_other" in r for r in sel):
      full = [r["eval_loss"] for r in sel]
      half = [r["half_every_other"] for r in sel]
      rnd = [statistics.mean(r["half_random"]) for r in sel]
      omit.append(
        dict(
          trained="normal" if not has else f"SkipPipe skip {skip}",
          full=f"{statistics.mean(full):.4f}",
          half_every_other=f"{statistics.mean(half):.4f}",
          half_rel=f"{statistics.mean(h / f for h, f in zip(half, full, strict=True)) - 1:+.1%}",
          ppl_rel=f"{statistics.mean(np.exp(h - f) for h, f in zip(half, full, strict=True)) - 1:+.0%}",
          half_random=f"{statistics.mean(rnd):.4f}",
          random_ppl_rel=f"{statistics.mean(np.exp(h - f) for h, f in zip(rnd, full, strict=True)) - 1:+.0%}",
        )
      )
  return conv, omit


CONV_COLUMNS = [
  ("run", "run"),
  ("swap", "swap"),
  ("eval_loss", "eval loss (full model)"),
  ("vs_normal", "vs normal"),
  ("per_seed", "per seed, % (by seed)"),
  ("median", "median"),
  ("seeds", "seeds"),
]
OMIT_COLUMNS = [
  ("trained", "trained"),
  ("full", "full"),
  ("half_every_other", "half (every other stage)"),
  ("ppl_rel", "ppl vs full"),
  ("half_random", "random half-paths (mean of 5)"),
  ("random_ppl_rel", "ppl vs full"),
]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument(
    "--part",
    choices=PARTS,
    default="all",
  )
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--updates", type=int, default=CONV["num_updates"])
  ap.add_argument("--out", default=str(common.RESULTS))
  ap.add_argument("--smoke", action="store_true", help="a sliver of each part (CI)")
  ap.add_argument("--config", default="configs/gpt2_skippipe.py:tiny", help="--part plan: a config")
  ap.add_argument("--devices", type=int, default=8, help="--part plan: the run's devices")
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--worker-args", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    w = json.loads(args.worker_args)
    worker(args.worker, w["seeds"], w["conv"], w["omission_skip"])
    return
  from pathlib import Path

  out = Path(args.out)
  if args.part in ("sim", "all"):
    t0 = time.perf_counter()
    if args.smoke:
      rows = skippipe_sim.sim_table(
        stages=(4,), skips=(0.0, 0.5), topologies=("geo",), num_mb=8, iters=50
      )
    else:
      rows = skippipe_sim.sim_table()
    wall = time.perf_counter() - t0
    print("\n## Iteration time (simulated)\n")
    print(common.format_table(rows, skippipe_sim.SIM_COLUMNS))
    common.write_json(
      out / "skippipe_sim.json",
      {"benchmark": "skippipe_sim", "machine": common.machine(), "wall_s": wall, "rows": rows},
    )
  if args.part in ("sim-allreduce", "all"):
    t0 = time.perf_counter()
    kw = dict(skips=(0.0, 0.5), swaps=(True,), grad_bytes=2)
    if args.smoke:
      kw.update(stages=(4,), topologies=("geo",), num_mb=8, iters=50)
    rows = [
      r for aware in (False, True) for r in skippipe_sim.sim_table(**kw, assign_allreduce=aware)
    ]
    rows.sort(
      key=lambda r: (skippipe_sim.TOPOLOGIES.index(r["topology"]), r["stages"], r["assignment"])
    )
    wall = time.perf_counter() - t0
    print("\n## Iteration time with each stage's gradient all-reduce (simulated)\n")
    print(common.format_table(rows, skippipe_sim.SIM_ALLREDUCE_COLUMNS))
    common.write_json(
      out / "skippipe_sim_allreduce.json",
      {
        "benchmark": "skippipe_sim_allreduce",
        "machine": common.machine(),
        "wall_s": wall,
        "grad_bytes_per_value": 2,
        "rows": rows,
      },
    )
  if args.part in ("timeline", "all"):
    if args.smoke:
      fig = out / "skippipe_timeline.png"
      out.mkdir(parents=True, exist_ok=True)
      spans = skippipe_sim.timeline(fig, stages=4, num_mb=4, iters=10)
    else:
      fig = common.REPO / "docs" / "figures" / "skippipe_timeline.png"
      spans = skippipe_sim.timeline(fig)
    print(f"\nwrote {fig}: " + ", ".join(f"{k} {v} s" for k, v in spans.items()))
  if (
    args.part == "plan"
  ):  # the plan train.py trains for --config (bench/pipeline/skippipe_pipeline.py)
    from bench.pipeline import skippipe_pipeline

    skippipe_pipeline.plan_report(args.config, args.devices, out / "skippipe_plan.json")
    return
  if args.part == "pipeline-convergence":  # bench/pipeline/skippipe_pipeline.py; not part of 'all'
    from bench.pipeline import skippipe_pipeline

    updates = args.updates if args.updates != CONV["num_updates"] else None
    skippipe_pipeline.run(out, args.seeds, updates, args.smoke)
    return
  if args.part in ("convergence", "collect", "all"):
    conv = dict(CONV, num_updates=args.updates)
    seeds = args.seeds
    if args.smoke:
      conv.update(num_updates=2, D=32)
      seeds = seeds[:1]
  if args.part == "collect":  # the table of the seeds whose runs are all written so far
    data = json.loads((out / "skippipe_convergence_runs.json").read_text())
    rows, conv = data["rows"], data["setting"]
    per_seed = {s: sum(r["seed"] == s for r in rows) for s in {r["seed"] for r in rows}}
    whole = {s for s, n in per_seed.items() if n == 2 * len(skippipe_sim.SKIPS) + 1}
    common.log(
      f"seeds with every run: {sorted(whole)}; left out (incomplete): "
      f"{sorted(set(per_seed) - whole)}"
    )
    rows = [r for r in rows if r["seed"] in whole]
  if args.part in ("convergence", "all"):
    out.mkdir(parents=True, exist_ok=True)
    wargs = json.dumps({"seeds": seeds, "conv": conv, "omission_skip": 0.5})
    # grows run by run: a cut-off benchmark keeps its whole seeds (--part collect tabulates them)
    runs_json = out / "skippipe_convergence_runs.json"
    cmd = common.module_command(__spec__.name, "--worker", str(runs_json), "--worker-args", wargs)
    subprocess.run(cmd, env=common.cpu_env(8), check=True)
    rows = json.loads(runs_json.read_text())["rows"]
    rows = [r for r in rows if r["seed"] in seeds]
  if args.part in ("convergence", "collect", "all"):
    conv_rows, omit_rows = summarise(rows)
    print("\n## Convergence (eval loss of the full model)\n")
    print(common.format_table(conv_rows, CONV_COLUMNS))
    print("\n## Layer omission (half the model at evaluation)\n")
    print(common.format_table(omit_rows, OMIT_COLUMNS))
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(
      out / "skippipe_convergence.json",
      {
        "benchmark": "skippipe_convergence",
        "machine": common.machine(),
        "setting": conv,
        "stages": STAGES,
        "runs": rows,
        "convergence": conv_rows,
        "omission": omit_rows,
      },
    )


if __name__ == "__main__":
  sys.exit(main())
