"""The plans the path scheduler (:mod:`acco_jax.skippipe.schedule`) is measured against: random
valid routes, and the full pipeline on fixed lanes under GPipe or 1F1B."""

from __future__ import annotations

import math

import numpy as np

from acco_jax.skippipe import paths as paths_lib
from acco_jax.skippipe import schedule, simulate
from acco_jax.skippipe.assign import Partition
from acco_jax.skippipe.schedule import Plan
from acco_jax.skippipe.topology import Topology


def random_plan(
  topo: Topology,
  costs: simulate.Costs,
  partition: Partition,
  num_mb: int,
  skip: float,
  swap: bool,
  seed: int = 0,
  memory: int = 0,
  balance: int = 0,
) -> Plan:
  """Random valid routes: uniform paths (``paths.random_paths``) and nodes, redrawn until the
  memory and balance constraints hold; collisions priced by the 'fifo' policy."""
  s_count = len(partition)
  k = paths_lib.path_length(s_count, skip)
  c, m = schedule.limits(partition, num_mb, k, memory, balance)
  rng = np.random.default_rng(seed)
  for _ in range(10_000):
    st = schedule.Loads(partition, num_mb, c, m)
    routes = []
    for p in paths_lib.random_paths(num_mb, s_count, skip, swap, rng):
      o = int(rng.choice([x for x in partition[0] if st.load[x] < m] or [-1]))
      nodes = []
      for s in p:
        opts = [y for y in partition[s] if st.load[y] < m]
        nodes.append(int(rng.choice(opts)) if opts else -1)
      if o < 0 or -1 in nodes:
        break
      st.add(o, p, tuple(nodes))
      routes.append(simulate.Route(o, p, tuple(nodes)))
    if len(routes) == num_mb and max(st.visits[1:] or [0]) <= c:
      return schedule.plan_of(topo, costs, routes, partition=partition)
  raise RuntimeError("no random plan met the memory and balance constraints in 10000 draws")


def full_pipeline(topo, costs, partition, num_mb: int, policy: str) -> Plan:
  """The full pipeline on fixed lanes (``simulate.lanes``) under 'gpipe' or '1f1b'."""
  return schedule.plan_of(
    topo, costs, simulate.lanes(topo, costs, partition, num_mb), policy, partition
  )


def gap(a: float, b: float) -> float:
  """Relative change from ``b`` to ``a``: -0.3 means ``a`` takes 30% less time."""
  return (a - b) / b if b > 0 else math.nan
