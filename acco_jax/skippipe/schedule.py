"""The path scheduler: a route per microbatch that shortens the iteration, under SkipPipe's
constraints.

Given a topology, a stage assignment (:mod:`acco_jax.skippipe.assign`), ``n`` microbatches, a skip
ratio and whether swaps are allowed, every microbatch ``b`` gets a stage-0 node ``o_b``, a path of
``K = paths.path_length(S, skip)`` distinct stages (in increasing order unless swaps are allowed)
and a node of each visited stage's partition. The constraints:

  memory     every node hosts at most ``m`` microbatches per iteration (each holds activations);
  balance    every stage s >= 1 is visited by at most ``c`` microbatches; by default
             ``c = ceil(n K / (S - 1))``, an equal share;
  collisions a node computes one step at a time; waiting is priced by the simulator's 'fifo'
             policy (:mod:`acco_jax.skippipe.simulate`).

The objective is the simulated makespan (with each stage's gradient all-reduce when the costs give
gradient sizes: a stage whose all-reduce is slow should finish its last backward early).
:func:`schedule` starts from the best of a few plans: greedy ones, in order and (with swaps)
swapped, where each microbatch in turn takes the least-loaded origin, the least-visited stages and
at each hop the nearest node with room, weighed by the work queued on it; and the full pipeline's
lanes with stages left out in rotation. It then improves the plan by local search: a random move
(another node for one hop, two hops of one path swapped, a visited stage exchanged for an unvisited
one, another origin, a path's hops moved to their nearest nodes) is kept when the simulated makespan
does not grow. The result is the best of the search's plan and two kinds of candidates, so that two
properties hold: with swaps, the in-order search's result (same seed) is a start and a candidate,
so allowing swaps is never worse; and the full pipeline's lanes with stages left out, in every
rotation, simulated under each policy or run in GPipe's or 1F1B's recorded order with the left-out
steps deleted (:mod:`acco_jax.skippipe.left_out`), so skipping is never slower than the full
pipeline when the transfer times satisfy the triangle inequality. Seeded and deterministic.

The result is a :class:`Plan`: plain data a pipeline runtime builds its tick tables from.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from acco_jax import errors
from acco_jax.skippipe import bounds, left_out, simulate
from acco_jax.skippipe import paths as paths_lib
from acco_jax.skippipe.assign import Partition
from acco_jax.skippipe.topology import Topology


@dataclasses.dataclass(frozen=True)
class Plan:
  """One iteration's schedule, as plain data.

  Attributes:
    origin: per microbatch, its stage-0 node (it runs the embedding, stage 0, the head and the loss).
    paths: per microbatch, the stages it visits after stage 0, in order (``paths.Path``).
    nodes: per microbatch, the node of each stage of its path (``len(nodes[b]) == len(paths[b])``).
    order: per node, the ``(microbatch, step)`` pairs it runs, in the order the simulator assumed;
      steps are numbered as in :mod:`acco_jax.skippipe.simulate` (0 = stage 0 forward on the
      origin, 1..K the path forward, K+1 head, K+2..2K+1 the path backward, 2K+2 stage 0 backward).
    makespan: the simulated iteration time [s] of this order (all-reduces included when the costs
      give gradient sizes); ``simulate.replay`` of ``order`` gives the same.
    policy: how ``order`` was made: a simulator policy ('fifo', 'gpipe', '1f1b'), or 'replay' (a
      full pipeline's recorded order with the left-out steps removed, run as a static order).
  """

  origin: tuple[int, ...]
  paths: tuple[paths_lib.Path, ...]
  nodes: tuple[tuple[int, ...], ...]
  order: tuple[tuple[tuple[int, int], ...], ...]
  makespan: float
  policy: str = "fifo"

  def routes(self) -> list[simulate.Route]:
    return [
      simulate.Route(o, p, n) for o, p, n in zip(self.origin, self.paths, self.nodes, strict=True)
    ]

  def to_dict(self) -> dict:
    return {
      "origin": list(self.origin),
      "paths": [list(p) for p in self.paths],
      "nodes": [list(n) for n in self.nodes],
      "order": [[list(s) for s in o] for o in self.order],
      "makespan": self.makespan,
      "policy": self.policy,
    }


def plan_of(topo, costs, routes, policy: str = "fifo", partition=None) -> Plan:
  """Simulates ``routes`` under ``policy`` and packs them with the order it assumed."""
  res = simulate.simulate(topo, costs, routes, policy, partition)
  return Plan(
    tuple(r.origin for r in routes),
    tuple(r.path for r in routes),
    tuple(r.nodes for r in routes),
    res.order,
    res.makespan,
    policy,
  )


def limits(partition: Partition, num_mb: int, k: int, memory: int = 0, balance: int = 0):
  """The balance ``c`` and memory ``m`` bounds, defaults filled in; one-line errors when infeasible.

  Default ``m``: the least that fits the equal share, plus one microbatch of slack.
  """
  s_count = len(partition)
  c = balance or bounds.default_balance(num_mb, k, s_count)
  need = max([-(-num_mb // len(partition[0]))] + [-(-c // len(p)) for p in partition[1:]])
  m = memory or need + 1
  if m < 1:
    raise errors.UserValueError(f"pipeline.memory={memory} must be at least 1 microbatch per node")
  if s_count > 1 and c * (s_count - 1) < num_mb * k:
    raise errors.UserValueError(
      f"pipeline.balance={c} is too low: {num_mb} microbatches visiting {k} stages each need "
      f"{num_mb * k} visits over {s_count - 1} stages; raise it to {-(-num_mb * k // (s_count - 1))}"
    )
  if m < need:
    raise errors.UserValueError(
      f"pipeline.memory={m} microbatches per node cannot hold {num_mb} microbatches on these "
      f"{sum(len(p) for p in partition)} nodes: raise it to at least {need}"
    )
  return c, m


class Loads:
  """Loads of a candidate plan, for constraint checks during construction and search."""

  def __init__(self, partition, num_mb, c, m):
    self.stage_of = {x: s for s, p in enumerate(partition) for x in p}
    self.load = dict.fromkeys(self.stage_of, 0)
    self.visits = [0] * len(partition)
    self.c, self.m, self.partition = c, m, partition

  def add(self, origin, path, nodes, sign=1):
    self.load[origin] += sign
    for s, y in zip(path, nodes, strict=True):
      self.load[y] += sign
      self.visits[s] += sign


def _greedy(topo, costs, partition, num_mb, k, swap, c, m, rng):
  xfer = topo.transfer_MxM(costs.act_bytes)
  st = Loads(partition, num_mb, c, m)
  work = dict.fromkeys(st.stage_of, 0.0)  # seconds of compute queued on each node
  s_count = len(partition)
  routes = []
  for _ in range(num_mb):
    o = min(partition[0], key=lambda x: (st.load[x], work[x], x))
    # the k least-visited stages; among equals, the ones with a node close to the origin
    near = {s: min(xfer[o, y] for y in partition[s]) for s in range(1, s_count)}
    chosen = sorted(range(1, s_count), key=lambda s: (st.visits[s], near[s], rng.random()))[:k]
    cur, path, nodes, todo = o, [], [], set(chosen)
    while todo:
      options = [s for s in todo if swap or s == min(todo)]
      best = None
      for s in options:
        for y in partition[s]:
          if st.load[y] >= m:
            continue
          score = xfer[cur, y] + work[y] / len(partition[s])
          if best is None or score < best[0]:
            best = (score, s, y)
      if best is None:
        raise errors.UserValueError(f"pipeline.memory={m} leaves no node with room on a stage")
      _, s, y = best
      path.append(s)
      nodes.append(y)
      todo.discard(s)
      st.load[y] += 1
      work[y] += (1 + costs.backward) * costs.fwd_S[s] / topo.speed_M[y]
      cur = y
    st.load[o] += 1
    for s in path:
      st.visits[s] += 1
    work[o] += (1 + costs.backward) * (costs.fwd_S[0] + costs.head) / topo.speed_M[o]
    routes.append(simulate.Route(o, tuple(path), tuple(nodes)))
  return routes


def _fits(partition, num_mb, c, m, routes) -> bool:
  """Whether ``routes`` meet the memory bound ``m`` and the balance bound ``c``."""
  st = Loads(partition, num_mb, c, m)
  for r in routes:
    st.add(r.origin, r.path, r.nodes)
  return max(st.load.values()) <= m and max(st.visits[1:] or [0]) <= c


def left_out_fits(topo, costs, partition, num_mb: int, skip: float, memory=0, balance=0) -> bool:
  """Whether some rotation of the full pipeline's lanes with stages left out meets the memory and
  balance bounds: the condition, besides the triangle inequality, under which :func:`schedule` is
  no slower than the full pipeline."""
  s_count = len(partition)
  k = paths_lib.path_length(s_count, skip)
  c, m = limits(partition, num_mb, k, memory, balance)
  full = simulate.lanes(topo, costs, partition, num_mb)
  return any(
    _fits(partition, num_mb, c, m, left_out.lane_routes(full, gone))
    for gone in _rotations(s_count, num_mb, k)
  )


def _rotations(s_count, num_mb, k):
  """Per rotation, each microbatch's left-out stages."""
  for rotation in range(s_count - 1 if s_count - 1 > k else 1):
    yield left_out.left_out_stages(s_count, num_mb, k, rotation)


def _left_out_plans(topo, costs, partition, num_mb, k, c, m) -> list[Plan]:
  """The full pipeline's lanes with ``S - 1 - k`` stages left out, each rotation that meets the
  bounds: simulated under every policy, and the GPipe and 1F1B orders replayed with the left-out
  steps deleted (:mod:`acco_jax.skippipe.left_out`)."""
  s_count = len(partition)
  full = simulate.lanes(topo, costs, partition, num_mb)
  orders = {p: simulate.simulate(topo, costs, full, p, partition).order for p in ("gpipe", "1f1b")}
  plans = []
  for gone in _rotations(s_count, num_mb, k):
    routes = left_out.lane_routes(full, gone)
    if not _fits(partition, num_mb, c, m, routes):
      continue
    for policy in simulate.POLICIES:
      try:
        plans.append(plan_of(topo, costs, routes, policy, partition))
      except RuntimeError:  # a policy that deadlocks on these routes is no candidate
        pass
    for order in orders.values():
      order = left_out.order_without(full, order, gone)
      res = simulate.replay(topo, costs, routes, order, partition)
      plans.append(plan_of_order(routes, order, res.makespan))
  return plans


def plan_of_order(routes, order, makespan: float) -> Plan:
  """Packs ``routes`` with a static ``order`` and the makespan its replay gives ('replay')."""
  return Plan(
    tuple(r.origin for r in routes),
    tuple(r.path for r in routes),
    tuple(r.nodes for r in routes),
    order,
    makespan,
    "replay",
  )


def _reroute(topo, costs, partition, st, route):
  """The same stages in the same order, each hop on the nearest node with room."""
  xfer = topo.transfer_MxM(costs.act_bytes)
  cur, nodes = route.origin, []
  for s, y0 in zip(route.path, route.nodes, strict=True):
    opts = [y for y in partition[s] if y == y0 or st.load[y] < st.m]
    y = min(opts, key=lambda y: (xfer[cur, y], y))
    nodes.append(y)
    cur = y
  return simulate.Route(route.origin, route.path, tuple(nodes))


def _move(topo, costs, routes, partition, st, swap, rng):
  """A random constraint-respecting change of one route; None when the draw finds none."""
  b = int(rng.integers(len(routes)))
  r = routes[b]
  kind = int(rng.integers(5))
  if kind == 4:
    return b, _reroute(topo, costs, partition, st, r)
  path, nodes, origin = list(r.path), list(r.nodes), r.origin
  k = len(path)
  if kind == 0 and k:
    j = int(rng.integers(k))
    opts = [y for y in partition[path[j]] if y != nodes[j] and st.load[y] < st.m]
    if not opts:
      return None
    nodes[j] = int(rng.choice(opts))
  elif kind == 1 and swap and k > 1:
    i, j = rng.choice(k, 2, replace=False)
    path[i], path[j] = path[j], path[i]
    nodes[i], nodes[j] = nodes[j], nodes[i]
  elif kind == 2 and 0 < k < len(partition) - 1:
    j = int(rng.integers(k))
    out = [s for s in range(1, len(partition)) if s not in path and st.visits[s] < st.c]
    if not out:
      return None
    s = int(rng.choice(out))
    opts = [y for y in partition[s] if st.load[y] < st.m]
    if not opts:
      return None
    path[j], nodes[j] = s, int(rng.choice(opts))
    if not swap:
      pairs = sorted(zip(path, nodes, strict=True))
      path, nodes = [p for p, _ in pairs], [y for _, y in pairs]
  elif kind == 3:
    opts = [x for x in partition[0] if x != origin and st.load[x] < st.m]
    if not opts:
      return None
    origin = int(rng.choice(opts))
  else:
    return None
  return b, simulate.Route(origin, tuple(path), tuple(nodes))


def schedule(
  topo: Topology,
  costs: simulate.Costs,
  partition: Partition,
  num_mb: int,
  skip: float,
  swap: bool,
  seed: int = 0,
  iters: int = 400,
  memory: int = 0,
  balance: int = 0,
) -> Plan:
  """Scheduled routes for ``num_mb`` microbatches (see the module docstring).

  Args:
    topo, costs, partition: the network, per-microbatch costs, and the nodes of each stage.
    num_mb: microbatches per iteration.
    skip: the skip ratio (``paths.path_length``).
    swap: whether a path may visit its stages out of order.
    seed: seeds tie-breaks and the local search.
    iters: local-search moves tried (each costs one simulation).
    memory, balance: ``m`` and ``c``; 0 picks the defaults of :func:`limits`.

  Returns:
    The best :class:`Plan` found: the local search's (order 'fifo') or a candidate of the full
    pipeline with stages left out (any policy, or 'replay'); its ``order`` replays to its
    ``makespan``. Two guarantees, for equal other arguments: with ``swap`` the makespan is at most
    the in-order one (that plan is a candidate); and it is at most the full pipeline's under GPipe
    and under 1F1B on the same partition (:func:`full_pipeline`) when the transfer times satisfy
    the triangle inequality (``left_out.triangle_holds(topo, costs.act_bytes)``) and some rotation
    of the lanes with stages left out meets the memory and balance bounds
    (:func:`left_out_fits`), or at skip 0 when the lanes meet them (the full pipeline is then
    itself a candidate).
  """
  s_count = len(partition)
  k = paths_lib.path_length(s_count, skip)
  c, m = limits(partition, num_mb, k, memory, balance)
  # in-order plans are swap plans too: the in-order result is a start and a candidate
  in_order = (
    schedule(topo, costs, partition, num_mb, skip, False, seed, iters, memory, balance)
    if swap
    else None
  )
  rng = np.random.default_rng(seed)
  starts = [_greedy(topo, costs, partition, num_mb, k, False, c, m, rng)]
  if swap:
    starts += [_greedy(topo, costs, partition, num_mb, k, True, c, m, rng), in_order.routes()]
  made = [simulate.simulate(topo, costs, r, partition=partition).makespan for r in starts]
  left = _left_out_plans(topo, costs, partition, num_mb, k, c, m)
  for p in left:
    if p.policy == "fifo":
      starts.append(p.routes())
      made.append(p.makespan)
  routes, best = list(starts[int(np.argmin(made))]), min(made)
  st = Loads(partition, num_mb, c, m)
  for r in routes:
    st.add(r.origin, r.path, r.nodes)
  for _ in range(iters):
    mv = _move(topo, costs, routes, partition, st, swap, rng)
    if mv is None:
      continue
    b, new = mv
    old = routes[b]
    st.add(old.origin, old.path, old.nodes, -1)
    ok = all(st.load[y] < m for y in (new.origin, *new.nodes)) and all(
      st.visits[s] < c for s in new.path
    )
    if ok:
      routes[b] = new
      t = simulate.simulate(topo, costs, routes, partition=partition).makespan
      if t <= best + 1e-12:
        best = t
        st.add(new.origin, new.path, new.nodes)
        continue
      routes[b] = old
    st.add(old.origin, old.path, old.nodes)
  found = plan_of(topo, costs, routes, partition=partition)
  return min([found, *left] + ([in_order] if swap else []), key=lambda p: p.makespan)
