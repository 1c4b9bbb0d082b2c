"""The path scheduler's plan a run trains with, made from its config.

One function makes it for both runtimes: data-parallel workers that run each microbatch's layer
order (:mod:`acco_jax.skippipe.orders`) and the pipeline over a ``('data', 'stage')`` mesh
(:mod:`acco_jax.pipeline.build`), and ``python -m bench.pipeline.skippipe --part plan`` prints the same plan. The
steps:

  1. the topology: ``pipeline.topology``, a preset drawn with ``num_nodes`` nodes (seeded by
     ``pipeline.seed``) or a JSON file of exactly that many nodes;
  2. the costs of one microbatch of the model (:func:`simulate.transformer_costs`, bf16 activations
     and gradients), with each stage's gradient all-reduce priced;
  3. the stage assignment (:func:`assign.assign`), which prices that all-reduce too; on a pipeline
     mesh every stage gets as many nodes as there are lanes;
  4. the plan (:func:`schedule.schedule`) for ``num_mb`` microbatches under ``pipeline.skip``,
     ``pipeline.swap``, ``pipeline.memory``, ``pipeline.balance`` and ``pipeline.search_iters``.

A pipeline run stores :func:`record` in its checkpoints; :func:`check_resume` refuses, in one line,
a resume whose settings would make another plan.
"""

from __future__ import annotations

from typing import NamedTuple

from acco_jax import errors, model
from acco_jax.skippipe import assign, schedule, simulate, topology
from acco_jax.skippipe.assign import Partition

FLOPS_PER_S = 1e14  # a speed-1.0 node's effective compute, for the costs


class Planned(NamedTuple):
  topology: topology.Topology
  costs: simulate.Costs
  partition: Partition
  plan: schedule.Plan
  settings: dict


def settings(pcfg, num_nodes: int, num_mb: int, rows_per_mb: int, equal: bool) -> dict:
  """What decides the plan, besides the model: the keys a resume must keep."""
  return {
    "topology": str(pcfg.topology),
    "stages": int(pcfg.stages),
    "skip": float(pcfg.skip),
    "swap": bool(pcfg.swap),
    "seed": int(pcfg.seed),
    "memory": int(pcfg.memory),
    "balance": int(pcfg.balance),
    "search_iters": int(pcfg.search_iters),
    "nodes": int(num_nodes),
    "microbatches": int(num_mb),
    "rows_per_microbatch": int(rows_per_mb),
    "equal_stages": bool(equal),
  }


def make(
  pcfg, cfg: model.ModelConfig, num_nodes: int, num_mb: int, rows_per_mb: int, equal: bool = False
) -> Planned:
  """The plan of a ``config.pipeline`` group (see the module docstring).

  Args:
    pcfg: ``config.pipeline``.
    cfg: the model (its sizes price compute and transfers).
    num_nodes: the topology's nodes; 0 takes a preset's default (``topology.default_nodes``).
    num_mb: microbatches per iteration.
    rows_per_mb: rows of a microbatch.
    equal: as many nodes on every stage (a pipeline mesh: one node per device).
  """
  S = int(pcfg.stages)
  topo = topology.get(pcfg.topology, S, int(pcfg.seed), num_nodes)
  costs = simulate.transformer_costs(S, cfg.N, cfg.D, cfg.V, cfg.L, rows_per_mb, FLOPS_PER_S, 2)
  part = assign.assign(topo, costs, S, seed=int(pcfg.seed), equal=equal)
  plan = schedule.schedule(
    topo,
    costs,
    part,
    num_mb,
    float(pcfg.skip),
    bool(pcfg.swap),
    seed=int(pcfg.seed),
    iters=int(pcfg.search_iters),
    memory=int(pcfg.memory),
    balance=int(pcfg.balance),
  )
  return Planned(
    topo, costs, part, plan, settings(pcfg, topo.num_nodes, num_mb, rows_per_mb, equal)
  )


def record(planned: Planned) -> dict:
  """What a checkpoint keeps: the settings, the stage assignment and the plan."""
  return {
    "settings": planned.settings,
    "partition": [list(p) for p in planned.partition],
    "plan": planned.plan.to_dict(),
  }


def _name(key: str) -> str:
  return {
    "nodes": "topology nodes (devices)",
    "microbatches": "microbatches per iteration",
    "rows_per_microbatch": "batch.microbatch_size",
    "equal_stages": "the pipeline mesh",
  }.get(key, f"pipeline.{key}")


def plan_of_record(saved: dict) -> schedule.Plan:
  p = saved["plan"]
  return schedule.Plan(
    tuple(int(o) for o in p["origin"]),
    tuple(tuple(int(s) for s in x) for x in p["paths"]),
    tuple(tuple(int(y) for y in n) for n in p["nodes"]),
    tuple(tuple((int(m), int(j)) for m, j in o) for o in p["order"]),
    float(p["makespan"]),
    str(p.get("policy", "fifo")),
  )


def check_resume(saved: dict | None, planned: Planned) -> Planned:
  """The plan a resumed run trains with: the checkpoint's (``record``), after a one-line refusal
  when a setting that decides it differs, naming the first that does. A checkpoint without a plan
  (another schedule) is refused too. With equal settings the saved plan is kept even if this
  version of the scheduler would make another."""
  if saved is None:
    raise errors.UserValueError(
      "the checkpoint was written without a scheduled plan (pipeline.paths=random or another "
      "pipeline.schedule): resume with the settings it was written with, or start in a new workdir"
    )
  now = planned.settings
  for key, was in saved["settings"].items():
    if now.get(key) != was:
      raise errors.UserValueError(
        f"the checkpoint's plan was made with {_name(key)}={was!r}, this run's with "
        f"{_name(key)}={now.get(key)!r}: resume with the setting it was written with, or start in "
        "a new workdir"
      )
  partition = tuple(tuple(int(x) for x in p) for p in saved["partition"])
  return planned._replace(partition=partition, plan=plan_of_record(saved))
