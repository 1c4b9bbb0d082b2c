"""The simulator's side of ``bench/net/skippipe_netns.py`` (that script's docstring describes it):
the model and batch it runs (:data:`MODEL`), each stage's operations timed on this machine
(:func:`measure_costs`) and the iteration time the simulator predicts from them
(:func:`predict`)."""

from __future__ import annotations

import statistics
import time

from acco_jax.pipeline import build as pipe_build
from acco_jax.pipeline import ticks
from acco_jax.skippipe import simulate

# The model and batch: 4 one-block stages of width 256, 4 microbatches of 4 x 128 tokens.
MODEL = {
  "model.D": 256,
  "model.N": 4,
  "model.H": 4,
  "data.seq_len": 128,
  "batch.microbatch_size": 4,
  "batch.microbatches": 4,
  "pipeline.stages": 4,
  "pipeline.skip": 0.25,
  "pipeline.swap": True,
  "pipeline.seed": 0,
}


# -- per-stage costs ------------------------------------------------------------------------------


def measure_costs(overrides: dict, reps: int) -> dict:
  """Seconds of each operation of one stage, as ``pipeline/step.py`` runs it (see
  ``bench/net/skippipe_netns.py``'s docstring)."""
  import jax
  import jax.numpy as jnp

  from acco_jax import layers, model
  from acco_jax.run import build as build_lib
  from configs import gpt2_pipeline

  config = config_for(overrides)
  del gpt2_pipeline
  cfg = build_lib.model_config(config, 257)  # the byte tokenizer's vocabulary
  S = int(config.pipeline.stages)
  params = model.init_params(cfg, 0)
  blocks = jax.tree.map(lambda x: x[: cfg.N // S], layers.stack_blocks(params["blocks"]))
  shared = {k: v for k, v in params.items() if k != "blocks"}
  B, L = int(config.batch.microbatch_size), int(config.data.seq_len)
  tokens = jnp.zeros((B, L), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens}
  x = jnp.zeros((B, L, cfg.D), jnp.dtype(cfg.dtype))
  order = jnp.arange(cfg.N // S)
  run = lambda bl, x: layers.run_blocks(bl, cfg, x, order)
  first = lambda bl, sh: run(bl, layers.embed(sh, cfg, batch["inputs"]))

  def head(sh, x):
    loss, pull, _ = jax.vjp(lambda s, y: layers.head_loss(s, cfg, y, batch), sh, x, has_aux=True)
    return pull(jnp.ones_like(loss))

  def back(bl, x):
    out, pull = jax.vjp(run, bl, x)
    return pull(jnp.ones_like(out))

  def back0(bl, sh):
    out, pull = jax.vjp(first, bl, sh)
    return pull(jnp.ones_like(out))

  ops = {
    "F0": (first, (blocks, shared)),
    "F": (run, (blocks, x)),
    "H": (head, (shared, x)),
    "B": (back, (blocks, x)),
    "B0": (back0, (blocks, shared)),
  }
  out = {}
  for name, (fn, args) in ops.items():
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      times.append(time.perf_counter() - t0)
    out[name] = statistics.median(times)
  shared_values = sum(int(v.size) for v in jax.tree.leaves(shared))
  return {
    "op_s": out,
    "stages": S,
    "act_bytes": 2.0 * B * L * cfg.D,
    "shared_grad_bytes": 4.0 * shared_values,
  }


def costs_of(measured: dict) -> simulate.Costs:
  """The simulator's costs from :func:`measure_costs`' operation times."""
  import numpy as np

  op = measured["op_s"]
  backward = op["B"] / op["F"]
  fwd = np.array([op["F0"]] + [op["F"]] * (measured["stages"] - 1))
  return simulate.Costs(fwd, op["H"] / (1 + backward), measured["act_bytes"], backward)


# -- predictions ----------------------------------------------------------------------------------


def config_for(overrides: dict):
  """``configs/gpt2_pipeline.py:tiny`` with :data:`MODEL` and ``overrides`` applied."""
  from configs import gpt2_pipeline

  config = gpt2_pipeline.get_config("tiny")
  for key, value in {**MODEL, **overrides}.items():
    group, name = key.split(".")
    config[group][name] = value
  return config


def runtime_order(schedule: ticks.Schedule) -> list[list[tuple[int, int]]]:
  """Per stage, the ``(microbatch, step)`` pairs its tick table runs, in tick order (the steps
  numbered as in :mod:`acco_jax.skippipe.simulate`, which match ``ticks.chain``'s operations)."""
  done = [0] * schedule.num_microbatches
  order = [[] for _ in range(schedule.num_stages)]
  for t in range(schedule.num_ticks):
    for s in range(schedule.num_stages):
      if schedule.kind[t, s] != ticks.IDLE:
        m = int(schedule.mb[t, s])
        order[s].append((m, done[m]))
    for s in range(schedule.num_stages):  # a microbatch runs at most one op per tick
      if schedule.kind[t, s] != ticks.IDLE:
        done[int(schedule.mb[t, s])] += 1
  return order


def predict(topo, measured: dict, overrides: dict) -> dict:
  """The simulator's iteration time for one schedule entry (see ``bench/net/skippipe_netns.py``'s
  docstring)."""
  config = config_for(overrides)
  p = config.pipeline
  S, M = int(p.stages), int(config.batch.microbatches)
  costs = costs_of(measured)
  sync = simulate.ring_allreduce_s(topo, list(range(S)), measured["shared_grad_bytes"])
  if p.schedule == "skippipe" and p.paths == "scheduled":
    r = predict_plan(topo, costs, config)
    return {**r, "sim_s": r["sim_s"] + sync, "replay_s": r["replay_s"] + sync, "sync_s": sync}
  paths, policy = pipe_build.schedule_paths(
    p.schedule, S, M, float(p.skip), bool(p.swap), int(p.seed)
  )
  schedule = ticks.build(paths, S, policy)
  routes = [simulate.Route(0, tuple(path), tuple(path)) for path in paths]  # node s holds stage s
  sim = simulate.simulate(topo, costs, routes, policy).makespan
  replay = simulate.replay(topo, costs, routes, runtime_order(schedule)).makespan
  return {
    "policy": policy,
    "ticks": schedule.num_ticks,
    "sim_s": sim + sync,
    "replay_s": replay + sync,
    "sync_s": sync,
  }


def predict_plan(topo, costs: simulate.Costs, config) -> dict:
  """The scheduler's plan as the run makes it (``pipeline/build.scheduled_plan``), priced with the
  measured costs. The runtime puts node ``i`` on device ``i`` (namespace ``i``, shaped as topology
  node ``i``), so the plan's routes and per-node order run on the links it was made for."""
  from acco_jax.pipeline import build as pipe_build
  from acco_jax.run import build as build_lib

  S = int(config.pipeline.stages)
  cfg = build_lib.model_config(config, 257)
  planned = pipe_build.scheduled_plan(config, cfg, S)
  plan = planned.plan
  sim = simulate.simulate(topo, costs, plan.routes(), "fifo").makespan
  replay = simulate.replay(topo, costs, plan.routes(), plan.order).makespan
  return {
    "policy": "plan",
    "partition": [list(x) for x in planned.partition],
    "paths": [list(r.path) for r in plan.routes()],
    "sim_s": sim,
    "replay_s": replay,
  }
