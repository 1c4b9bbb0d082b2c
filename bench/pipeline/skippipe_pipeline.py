"""SkipPipe on the pipeline mesh: the scheduled plan against random paths and the full pipeline.

``python -m bench.pipeline.skippipe --part pipeline-convergence`` runs :func:`run` (or this file directly,
same flags). A small GPT (4 blocks, one per stage) trains with ``method=pipeline`` on 8 simulated
devices, 2 data lanes x 4 stages, three ways, each for the same number of updates on the same data
(the seed picks initialisation, data order, and the plan or the random paths):

* ``scheduled``: ``pipeline.schedule=skippipe``, ``pipeline.paths=scheduled``: the path scheduler's
  plan for the geo preset (seeded by ``pipeline.seed``), microbatches crossing lanes;
* ``random``: ``pipeline.paths=random``: one random path per microbatch, run in every lane under
  1F1B, drawn once per run (``pipeline.seed``);
* ``full``: ``pipeline.schedule=1f1b``: every microbatch through every stage.

Both SkipPipe runs leave a quarter of the stages out (skip 0.25: 2 of stages 1-3 per microbatch)
with swaps allowed. Per run it records the final eval loss of the full model, how many of the
step's microbatches visit each stage, and for each stage ``s`` >= 1 two measures of what that
stage learned:

* ``left_out``: the eval loss of the trained model run without stage ``s``'s blocks, minus the full
  model's. The larger, the more the model relies on that stage: a stage that learned little can be
  left out at little cost (SkipPipe trains the model to tolerate this, so every stage's number is
  small; what counts is how it varies with the visits);
* ``moved``: the norm of the stage's parameter change from initialisation, relative to the
  initial norm (AdamW's steps are normalised, so fewer visits show less as a smaller gradient than
  as noisier, less consistent steps, which move the parameters less); the table also divides it by
  the full pipeline's for the same seed and stage, since how far a stage moves depends on its depth
  too.

With S = 4 and skip 0.25 every microbatch runs stage 0 and 2 of the 3 others: no training
microbatch runs all four stages, so the full model at evaluation is a path the SkipPipe runs never
trained, and a model with one stage left out is one they did (in order, where paths were swapped).

One process (8 simulated devices) runs every run; a cut-off invocation goes on from the runs it
wrote (``skippipe_pipeline_convergence_runs.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import common

SETTING = dict(
  D=64,
  N=4,
  H=4,
  seq_len=64,
  microbatch_size=2,
  microbatches=4,
  num_updates=200,
  lr=3e-3,
  skip=0.25,
  swap=True,
  stages=4,
  search_iters=200,
)
VARIANTS = ("scheduled", "random", "full")


def config(variant: str, seed: int, setting: dict):
  """The trainer config of one run (``configs/gpt2_skippipe.py:tiny`` with ``method=pipeline``)."""
  from configs import gpt2_skippipe

  c = gpt2_skippipe.get_config("tiny")
  c.method = "pipeline"
  c.model.D, c.model.N, c.model.H = setting["D"], setting["N"], setting["H"]
  c.data.seq_len = setting["seq_len"]
  c.batch.microbatch_size = setting["microbatch_size"]
  c.batch.microbatches = setting["microbatches"]
  c.train.num_updates, c.train.seed, c.train.eval_batches = setting["num_updates"], seed, 8
  c.opt.lr, c.opt.warmup_updates = setting["lr"], min(10, setting["num_updates"] - 1)
  p = c.pipeline
  p.stages, p.skip, p.swap, p.seed = setting["stages"], setting["skip"], setting["swap"], seed
  p.search_iters = setting["search_iters"]
  p.schedule = "1f1b" if variant == "full" else "skippipe"
  p.paths = "random" if variant == "random" else "scheduled"
  return c


def stage_visits(run, stages: int) -> list[int]:
  """Microbatches of one step that visit each stage (stage 0: all of them)."""
  sched = run.step.schedule
  lanes = 1 if sched.mesh_wide else run.step.lanes  # per-lane tables run in every lane
  visits = [0] * stages
  for path in sched.paths:
    for s in (0, *path):
      visits[s] += lanes
  return visits


def _stage_norms(params, stages: int) -> np.ndarray:
  """Per stage, the norm of its blocks' parameters (a stage holds N / S consecutive blocks)."""
  import jax

  blocks = params["blocks"]
  per_block = [
    np.sqrt(sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(blocks[str(i)])))
    for i in range(len(blocks))
  ]
  return np.sqrt(np.square(per_block).reshape(stages, -1).sum(1))


def _moved(init, final, stages: int) -> list[float]:
  import jax

  diff = jax.tree.map(lambda a, b: np.asarray(b) - np.asarray(a), init, final)
  return (_stage_norms(diff, stages) / _stage_norms(init, stages)).round(4).tolist()


def train_one(run, cfg) -> tuple[dict, list[float]]:
  """Trains ``run``'s step from the seed's initialisation; returns (final params, losses)."""
  import jax

  from acco_jax import model, parallel
  from acco_jax.run import streams

  train = run.step
  rows = train.microbatches_per_stage * cfg.batch.microbatch_size
  stream = streams.batch_stream(run, cfg, run.tokens.train, rows, seed=cfg.train.seed)
  state = train.init(model.init_params(run.model_cfg, cfg.train.seed))
  losses = []
  for _ in range(cfg.train.num_updates):
    state, m = train.step(
      state, parallel.global_batch(next(stream), run.mesh, run.batch_axis, run.batch_whole)
    )
    losses.append(float(jax.device_get(m["loss"])))
  return jax.device_get(train.params(state)), losses


def worker(out: str, seeds: list[int], setting: dict) -> None:
  """Every run in this process; the full pipeline's step is built once and shared by the seeds."""
  import jax

  from acco_jax import model
  from acco_jax.run import build, report

  S, N = setting["stages"], setting["N"]
  evals: dict = {}

  def evaluate(run, cfg, params, order=None):
    key = None if order is None else tuple(order)
    if key not in evals:
      evals[key] = report.eval_function(run.model_cfg, None if order is None else np.array(order))
    return float(report.evaluate(run, cfg, params, evals[key])["eval_loss"])

  rows = _done_runs(out, setting)
  done = {(r["variant"], r["seed"]) for r in rows}
  full_run = None
  for seed in seeds:  # seed-major: a cut-off benchmark still has whole seeds
    for variant in VARIANTS:
      if (variant, seed) in done:
        continue
      cfg = config(variant, seed, setting)
      t0 = time.perf_counter()
      if variant == "full":  # no seed in its tables: one program for every seed
        full_run = full_run or build.build(cfg)
        run = full_run
      else:
        run = build.build(cfg)
      init = jax.device_get(model.init_params(run.model_cfg, seed))
      params, losses = train_one(run, cfg)
      full = evaluate(run, cfg, params)
      per_stage = N // S
      left_out = [None] + [
        round(evaluate(run, cfg, params, [b for b in range(N) if b // per_stage != s]) - full, 4)
        for s in range(1, S)
      ]
      row = dict(
        variant=variant,
        seed=seed,
        eval_loss=round(full, 4),
        train_loss_last=round(losses[-1], 4),
        visits=stage_visits(run, S),
        left_out=left_out,
        moved=_moved(init, params, S),
        ticks=run.step.schedule.num_ticks,
        wall_s=round(time.perf_counter() - t0, 1),
      )
      common.log(
        f"  {variant} seed {seed}: eval {full:.4f}, visits {row['visits']}, "
        f"left out {left_out[1:]}, moved {row['moved']} ({row['wall_s']} s)"
      )
      rows.append(row)
      common.write_json(out, {"setting": setting, "rows": rows})


def _done_runs(out: str, setting: dict) -> list[dict]:
  """The runs an earlier invocation wrote with this setting; the benchmark goes on from them."""
  path = Path(out)
  if not path.exists():
    return []
  data = json.loads(path.read_text())
  if data.get("setting") != setting:
    sys.exit(
      f"error: {path} holds runs of another setting ({data.get('setting')}); pass --out "
      "to another folder, or move it away to start over"
    )
  return data["rows"]


def _mean_sd(vals) -> str:
  return f"{statistics.mean(vals):.4f} ± {statistics.pstdev(vals):.4f}"


def summarise(rows: list[dict], stages: int) -> tuple[list[dict], list[dict]]:
  """(the loss table, the per-stage table): means over seeds; ± is the population std."""
  loss, per_stage = [], []
  full = {r["seed"]: r["eval_loss"] for r in rows if r["variant"] == "full"}
  full_moved = {r["seed"]: r["moved"] for r in rows if r["variant"] == "full"}
  for variant in VARIANTS:
    sel = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
    if not sel:
      continue
    vals = [r["eval_loss"] for r in sel]
    vs = [r["eval_loss"] - full[r["seed"]] for r in sel if r["seed"] in full]
    loss.append(
      dict(
        run=variant,
        eval_loss=_mean_sd(vals),
        vs_full=f"{statistics.mean(vs):+.4f}" if vs and variant != "full" else "",
        per_seed=" ".join(f"{x:.4f}" for x in vals),
        seeds=len(sel),
        ticks=" ".join(str(t) for t in sorted({r["ticks"] for r in sel})),
      )
    )
    for s in range(1, stages):
      per_stage.append(
        dict(
          run=variant,
          stage=s,
          visits=" ".join(str(r["visits"][s]) for r in sel),
          left_out=_mean_sd([r["left_out"][s] for r in sel]),
          moved=_mean_sd([r["moved"][s] for r in sel]),
          moved_vs_full=_mean_sd(
            [r["moved"][s] / full_moved[r["seed"]][s] for r in sel if r["seed"] in full_moved]
          )
          if variant != "full"
          else "",
        )
      )
  return loss, per_stage


def visit_correlation(rows: list[dict], stages: int) -> dict:
  """Per SkipPipe variant, over every (seed, stage >= 1): the Pearson correlation of a stage's
  visits with its left-out loss, its parameter change, and its parameter change over the full
  pipeline's for the same seed and stage (which takes out how much a stage moves at its depth)."""
  out = {}
  full_moved = {r["seed"]: r["moved"] for r in rows if r["variant"] == "full"}
  for variant in VARIANTS[:2]:
    sel = [r for r in rows if r["variant"] == variant and r["seed"] in full_moved]
    v = [r["visits"][s] for r in sel for s in range(1, stages)]
    if len(set(v)) < 2:
      continue
    ys = {
      "left_out": [r["left_out"][s] for r in sel for s in range(1, stages)],
      "moved": [r["moved"][s] for r in sel for s in range(1, stages)],
      "moved_vs_full": [
        r["moved"][s] / full_moved[r["seed"]][s] for r in sel for s in range(1, stages)
      ],
    }
    for key, y in ys.items():
      out[f"{variant}: visits vs {key}"] = round(float(np.corrcoef(v, y)[0, 1]), 2)
  return out


LOSS_COLUMNS = [
  ("run", "run"),
  ("eval_loss", "eval loss (full model)"),
  ("vs_full", "vs full"),
  ("per_seed", "per seed"),
  ("seeds", "seeds"),
  ("ticks", "ticks per step"),
]
STAGE_COLUMNS = [
  ("run", "run"),
  ("stage", "stage"),
  ("visits", "visits per step, by seed"),
  ("left_out", "loss increase, stage left out"),
  ("moved", "|θ - θ0| / |θ0|"),
  ("moved_vs_full", "that / full's"),
]


def run(out_dir: Path, seeds: list[int], updates: int | None = None, smoke: bool = False) -> dict:
  """Runs (or goes on with) every run in a child process with 8 simulated devices, then tabulates.
  ``updates``: None takes the setting's."""
  setting = dict(SETTING, num_updates=updates or SETTING["num_updates"])
  if smoke:
    setting.update(num_updates=2, D=32, seq_len=32, search_iters=20)
    seeds = seeds[:1]
  out_dir.mkdir(parents=True, exist_ok=True)
  runs_json = out_dir / "skippipe_pipeline_convergence_runs.json"
  t0 = time.perf_counter()
  cmd = common.module_command(
    __spec__.name,
    "--worker",
    str(runs_json),
    "--worker-args",
    json.dumps({"seeds": seeds, "setting": setting}),
  )
  subprocess.run(cmd, env=common.cpu_env(8), check=True)
  rows = [r for r in json.loads(runs_json.read_text())["rows"] if r["seed"] in seeds]
  loss, per_stage = summarise(rows, setting["stages"])
  corr = visit_correlation(rows, setting["stages"])
  print("\n## Pipeline convergence at equal updates (eval loss of the full model)\n")
  print(common.format_table(loss, LOSS_COLUMNS))
  print("\n## Per stage: visits and what the stage learned\n")
  print(common.format_table(per_stage, STAGE_COLUMNS))
  print("\ncorrelation over (seed, stage):", corr)
  result = {
    "benchmark": "skippipe_pipeline_convergence",
    "machine": common.machine(),
    "setting": setting,
    "seeds": seeds,
    "wall_s": round(time.perf_counter() - t0, 1),
    "runs_wall_s": round(sum(r["wall_s"] for r in rows), 1),  # this and earlier invocations
    "runs": rows,
    "loss": loss,
    "per_stage": per_stage,
    "correlation": corr,
  }
  common.write_json(out_dir / "skippipe_pipeline_convergence.json", result)
  return result


def plan_report(spec: str, devices: int = 8, out: Path | None = None) -> dict:
  """The scheduled plan ``train.py --config SPEC --config.method=pipeline`` trains on ``devices``
  devices: the same function (``pipeline/build.scheduled_plan``) on the same config. Prints it and
  returns it as a dict (``plans.record`` plus the simulated time)."""
  import importlib

  from acco_jax.pipeline import build as pipe_build
  from acco_jax.run import build as build_lib
  from acco_jax.skippipe import plans

  path, _, arg = spec.partition(":")
  name = Path(path).stem
  config = importlib.import_module(f"configs.{name}").get_config(arg or None)
  config.method = "pipeline"
  tokens = build_lib.prepare_tokens(config)
  model_cfg = build_lib.model_config(config, tokens.tokenizer.vocab_size)
  planned = pipe_build.scheduled_plan(config, model_cfg, devices)
  if planned is None:
    raise SystemExit(f"{spec} runs no scheduled plan (pipeline.schedule=skippipe, paths=scheduled)")
  record = plans.record(planned)
  S = len(planned.partition)
  print(
    f"plan for {spec} on {devices} devices, topology {planned.topology.name}: "
    f"{planned.plan.makespan:.4g} s simulated ({planned.plan.policy} order)"
  )
  print("stage assignment (node = device):", record["partition"])
  where = {x: (s, lane) for s, p in enumerate(planned.partition) for lane, x in enumerate(p)}
  for b, r in enumerate(planned.plan.routes()):
    hops = " -> ".join(f"s{where[x][0]}/lane{where[x][1]}" for x in (r.origin, *r.nodes))
    print(f"  microbatch {b}: path {r.path}: {hops} -> back to lane {where[r.origin][1]}")
  assert len(where) == devices and all(len(p) == devices // S for p in planned.partition)
  if out is not None:
    common.write_json(
      out, {"benchmark": "skippipe_plan", "config": spec, "devices": devices, **record}
    )
  return record


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--updates", type=int, default=SETTING["num_updates"])
  ap.add_argument("--out", default=str(common.RESULTS))
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--worker-args", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    w = json.loads(args.worker_args)
    worker(args.worker, w["seeds"], w["setting"])
    return
  run(Path(args.out), args.seeds, args.updates, args.smoke)


if __name__ == "__main__":
  sys.exit(main())
