"""The simulated parts of ``bench/pipeline/skippipe.py`` (that script's docstring describes them):
the iteration-time tables of ``--part sim`` and ``sim-allreduce`` (:func:`sim_table` and their
columns) and the ``--part timeline`` figure (:func:`timeline`)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from bench import common

TOPOLOGIES = ("single-cluster", "multi-cluster", "geo")
SKIPS = (0.0, 0.25, 0.33, 0.5)


def sim_table(
  stages=(6, 8),
  skips=SKIPS,
  topologies=TOPOLOGIES,
  num_mb=16,
  draws=5,
  iters=400,
  swaps=(False, True),
  grad_bytes=0,
  assign_allreduce=True,
):
  """The iteration-time table; ``grad_bytes`` > 0 adds each stage's gradient all-reduce (bytes per
  gradient value) to every makespan and the scheduler's objective, and, with
  ``assign_allreduce``, to the stage assignment's cost."""
  from acco_jax.skippipe import assign, baselines, bounds, paths, schedule, simulate, topology

  rows = []
  for name in topologies:
    for s in stages:
      topo = topology.preset(name, topology.default_nodes(s), seed=0)
      costs = simulate.transformer_costs(s, 24, 2048, 32000, 1024, 4, 1e14, grad_bytes)
      t0 = time.perf_counter()
      priced = costs if assign_allreduce else dataclasses.replace(costs, grad_bytes_S=None)
      part = assign.assign(topo, priced, s, seed=0)
      rnd_part = [
        assign.cost(
          topo, costs, assign.random_partition(topo.num_nodes, s, np.random.default_rng(i))
        )
        for i in range(20)
      ]
      gpipe = baselines.full_pipeline(topo, costs, part, num_mb, "gpipe").makespan
      f1b1 = baselines.full_pipeline(topo, costs, part, num_mb, "1f1b").makespan
      for skip in skips:
        for swap in swaps:
          rnd = statistics.median(
            baselines.random_plan(topo, costs, part, num_mb, skip, swap, seed=i).makespan
            for i in range(draws)
          )
          sched = schedule.schedule(topo, costs, part, num_mb, skip, swap, seed=0, iters=iters)
          best_full = min(gpipe, f1b1)
          bound = bounds.lower_bound(topo, costs, part, num_mb, skip)
          rows.append(
            dict(
              topology=name,
              stages=s,
              skip=skip,
              k=paths.path_length(s, skip),
              swap=swap,
              gpipe_s=round(gpipe, 3),
              f1b1_s=round(f1b1, 3),
              random_s=round(rnd, 3),
              scheduler_s=round(sched.makespan, 3),
              bound_s=round(bound, 3),
              sched_vs_bound=round(sched.makespan / bound, 2),
              sched_order=sched.policy,
              vs_full=f"{baselines.gap(sched.makespan, best_full):+.0%}",
              vs_random=f"{baselines.gap(sched.makespan, rnd):+.0%}",
              assign_cost_s=round(assign.cost(topo, costs, part), 3),
              random_assign_cost_s=round(statistics.median(rnd_part), 3),
            )
          )
          if grad_bytes:
            pipe = simulate.simulate(topo, costs, sched.routes(), partition=part).pipeline_s
            rows[-1].update(
              assignment="round trip + all-reduce" if assign_allreduce else "round trip",
              scheduler_pipeline_s=round(pipe, 3),
              allreduce_share=f"{(sched.makespan - pipe) / sched.makespan:.0%}",
              stage_allreduce_s=[
                round(simulate.ring_allreduce_s(topo, nodes, costs.grad_bytes_S[i]), 3)
                for i, nodes in enumerate(part)
              ],
            )
      common.log(f"  {name} S={s}: {time.perf_counter() - t0:.1f} s")
  return rows


SIM_ALLREDUCE_COLUMNS = [
  ("topology", "topology"),
  ("stages", "S"),
  ("assignment", "assignment priced by"),
  ("skip", "skip"),
  ("gpipe_s", "GPipe s"),
  ("f1b1_s", "1F1B s"),
  ("random_s", "random s"),
  ("scheduler_s", "scheduler s"),
  ("scheduler_pipeline_s", "of which pipeline s"),
  ("allreduce_share", "all-reduce tail"),
  ("vs_full", "vs best full"),
  ("vs_random", "vs random"),
  ("bound_s", "bound s"),
  ("sched_vs_bound", "sched/bound"),
]

SIM_COLUMNS = [
  ("topology", "topology"),
  ("stages", "S"),
  ("skip", "skip"),
  ("k", "stages visited"),
  ("swap", "swap"),
  ("gpipe_s", "GPipe s"),
  ("f1b1_s", "1F1B s"),
  ("random_s", "random s"),
  ("scheduler_s", "scheduler s"),
  ("vs_full", "vs best full"),
  ("vs_random", "vs random"),
  ("bound_s", "bound s"),
  ("sched_vs_bound", "sched/bound"),
]


def timeline(path, stages=6, skip=0.25, num_mb=16, iters=400, topology_name="geo") -> dict:
  """Draws each node's timeline for GPipe, 1F1B and the scheduled plan (swaps on) of one setting,
  the gradient all-reduce priced (in the stage assignment too); returns the makespans."""
  from acco_jax.analysis import timeline as timeline_lib
  from acco_jax.skippipe import assign, baselines, bounds, schedule, simulate, topology

  topo = topology.preset(topology_name, topology.default_nodes(stages), seed=0)
  costs = simulate.transformer_costs(stages, 24, 2048, 32000, 1024, 4, 1e14, grad_bytes=2)
  part = assign.assign(topo, costs, stages, seed=0)
  plans = [
    ("GPipe, full pipeline", baselines.full_pipeline(topo, costs, part, num_mb, "gpipe")),
    ("1F1B, full pipeline", baselines.full_pipeline(topo, costs, part, num_mb, "1f1b")),
    (
      f"scheduled, skip {skip} with swaps",
      schedule.schedule(topo, costs, part, num_mb, skip, True, seed=0, iters=iters),
    ),
  ]
  panels = []
  for name, plan in plans:
    res = simulate.replay(topo, costs, plan.routes(), plan.order, part)
    ivs = timeline_lib.node_intervals(topo, costs, plan.routes(), res, part)
    panels.append((f"{name} (order: {plan.policy})", ivs, plan.makespan))
  bound = bounds.lower_bound(topo, costs, part, num_mb, skip)
  title = (
    f"{topology_name}, S = {stages}, {num_mb} microbatches, bf16 gradient all-reduce per "
    f"stage; lower bound at skip {skip}: {bound:.2f} s"
  )
  timeline_lib.plot_timelines(panels, part, str(path), title)
  return {name: round(plan.makespan, 3) for name, plan in plans} | {"bound": round(bound, 3)}
