"""Stage assignment: which nodes hold which stage.

The ``M`` nodes are split into ``S`` partitions; every node of partition ``s`` holds stage ``s``.
Stage 0 gets the most nodes (every microbatch starts and ends there): ``M // S`` per stage and the
remainder on stage 0 (:func:`stage_sizes`).

The objective is the expected communication cost of one microbatch's round trip. Each stage-0 node
starts a lane; the lane takes, stage by stage, the nearest node of the next partition that still
has room (:func:`acco_jax.skippipe.simulate.lanes`), and returns to its origin:

  cost(P) = mean over lanes l of  sum_{s=0}^{S-1} transfer(y_l[s], y_l[s+1 mod S])

with ``transfer = latency + activation bytes / bandwidth``. When the costs give gradient sizes
(``costs.grad_bytes_S``), the slowest stage's gradient all-reduce among its nodes is added,
``max_s simulate.ring_allreduce_s(P[s])``: a stage whose nodes sit far apart pays for it once an
iteration, where a lane pays per microbatch. :func:`assign` minimises it by local
search from seeded random starts: move one node to another partition by swapping it with a node
there, keep the swap when the cost falls, restart a few times and keep the best (a simpler
relative of the genetic algorithm GCMA that SkipPipe borrows from DT-FM). It is deterministic given
the seed.
"""

from __future__ import annotations

import numpy as np

from acco_jax import errors
from acco_jax.skippipe import simulate
from acco_jax.skippipe.topology import Topology

Partition = tuple[tuple[int, ...], ...]


def stage_sizes(num_nodes: int, num_stages: int, equal: bool = False) -> list[int]:
  """Nodes per stage: ``num_nodes // num_stages`` each, the remainder on stage 0; with ``equal``
  (a pipeline mesh, whose every stage has one device per data lane) a remainder is an error."""
  if num_nodes < num_stages:
    raise errors.UserValueError(
      f"{num_nodes} nodes cannot hold pipeline.stages={num_stages} stages: give the topology at "
      "least one node per stage or lower pipeline.stages"
    )
  if equal and num_nodes % num_stages:
    raise errors.UserValueError(
      f"{num_nodes} nodes do not split into pipeline.stages={num_stages} equal stages: use a "
      f"multiple of {num_stages} nodes"
    )
  base = num_nodes // num_stages
  return [base + num_nodes % num_stages] + [base] * (num_stages - 1)


def cost(topo: Topology, costs: simulate.Costs, partition: Partition) -> float:
  """Mean round-trip transfer time [s] of a microbatch on the partition's lanes, plus the slowest
  stage's gradient all-reduce when ``costs.grad_bytes_S`` is given."""
  xfer = topo.transfer_MxM(costs.act_bytes)
  routes = simulate.lanes(topo, costs, partition, len(partition[0]))
  total = 0.0
  for r in routes:
    hops = (r.origin, *r.nodes, r.origin)
    total += sum(xfer[a, b] for a, b in zip(hops[:-1], hops[1:], strict=True))
  allreduce = 0.0
  if costs.grad_bytes_S is not None:
    allreduce = max(
      simulate.ring_allreduce_s(topo, nodes, costs.grad_bytes_S[s])
      for s, nodes in enumerate(partition)
    )
  return total / len(routes) + allreduce


def random_partition(
  num_nodes: int, num_stages: int, rng: np.random.Generator, equal: bool = False
) -> Partition:
  perm = rng.permutation(num_nodes)
  out, i = [], 0
  for size in stage_sizes(num_nodes, num_stages, equal):
    out.append(tuple(int(x) for x in sorted(perm[i : i + size])))
    i += size
  return tuple(out)


def assign(
  topo: Topology,
  costs: simulate.Costs,
  num_stages: int,
  seed: int = 0,
  restarts: int = 4,
  sweeps: int = 6,
  equal: bool = False,
) -> Partition:
  """The partition of lowest :func:`cost` found by swap local search (see the module docstring).

  Args:
    topo: the nodes and links.
    costs: per-microbatch costs (``act_bytes`` prices a transfer).
    num_stages: S.
    seed: seeds the random starts; equal seeds give equal partitions.
    restarts: random starts.
    sweeps: passes over all node pairs per start (a pass that improves nothing ends the start).
    equal: as many nodes on every stage (a pipeline mesh's lanes); swaps keep the sizes.

  Returns:
    ``S`` tuples of node ids, sorted; stage 0 first.
  """
  rng = np.random.default_rng(seed)
  m = topo.num_nodes
  best, best_cost = None, np.inf
  for _ in range(restarts):
    part = [list(p) for p in random_partition(m, num_stages, rng, equal)]
    where = {x: (s, i) for s, p in enumerate(part) for i, x in enumerate(p)}
    cur = cost(topo, costs, tuple(tuple(p) for p in part))
    for _ in range(sweeps):
      improved = False
      for a in range(m):
        for b in rng.permutation(m):
          (sa, ia), (sb, ib) = where[a], where[int(b)]
          if sa == sb:
            continue
          part[sa][ia], part[sb][ib] = int(b), a
          c = cost(topo, costs, tuple(tuple(p) for p in part))
          if c < cur - 1e-12:
            cur, improved = c, True
            where[a], where[int(b)] = (sb, ib), (sa, ia)
          else:
            part[sa][ia], part[sb][ib] = a, int(b)
      if not improved:
        break
    if cur < best_cost:
      best, best_cost = tuple(tuple(sorted(p)) for p in part), cur
  return best
