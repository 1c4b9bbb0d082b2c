"""A lower bound on the iteration time of any SkipPipe plan: how far a schedule can still improve.

:func:`lower_bound` holds for every plan of ``n`` microbatches whose paths visit ``K`` distinct
stages after stage 0 (in any order, on any nodes, under any processing order: a simulator policy or
a replayed static order), priced as :mod:`acco_jax.skippipe.simulate` prices them. It is the largest
of three bounds, each a time some stage's all-reduce cannot end before:

  stage 0   every microbatch runs stage 0's forward, the head and stage 0's backward on one
            stage-0 node, ``w0 = (1 + backward) (fwd_S[0] + head)`` seconds of speed-1 work. A node
            of speed ``v`` that hosts ``a`` microbatches is busy ``a w0 / v``; the ``a`` are
            integers summing to ``n``, so the last stage-0 node finishes no earlier than the least
            ``T0`` with ``sum_x floor(T0 v_x / w0) >= n``. Every microbatch's chain also ends on a
            stage-0 node, no earlier than the fastest possible single route (:func:`fastest_route_s`).
            Stage 0's all-reduce starts when all its nodes are done: ``T >= max(T0, route) + AR_0``.
  the rest  the ``n K`` visits to stages ``1..S-1`` split into counts ``lo <= a_s <= hi``: ``hi =
            min(n, c)`` (a path visits a stage at most once; ``c`` the balance bound, when the
            plans meet one) and ``lo = n K - (S - 2) hi`` (the other stages take the rest). When
            ``lo >= 1`` every stage is visited, and a route through each stage joins the
            route bound of stage 0 above. Stage ``s``'s nodes split ``a_s`` into integer shares; stage
            ``s`` then finishes no earlier than its busiest node and its all-reduce ends at least
            ``AR_s`` later. Whatever the split, some stage ends its all-reduce at or after the least
            ``T`` with ``sum_s min(hi, N_s(T)) >= n K`` and every ``N_s(T) >= lo``, where
            ``N_s(T) = sum_{x in s} floor((T - AR_s) v_x / w_s)`` and ``w_s = (1 + backward)
            fwd_S[s]``: at the plan's own ``T`` each stage holds its ``a_s`` visits, so that ``T``
            meets both conditions.
  any stage every stage all-reduces after its nodes' last step (at time 0 when none ran):
            ``T >= max_s AR_s``.

``lo`` and ``hi`` apply to plans that meet the balance bound ``c`` (every plan
:func:`acco_jax.skippipe.schedule.schedule` and ``random_plan`` make, and the full pipeline at skip
0, where ``c = n``); ``balance=None`` bounds any plan. ``AR_s`` is
:func:`acco_jax.skippipe.simulate.ring_allreduce_s` over the stage's nodes, 0 when the
costs give no gradient sizes. Each argument lower-bounds a node's busy time or a chain's length,
which no waiting, collision or processing order can shorten, so the maximum is a valid bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from acco_jax.skippipe import paths as paths_lib
from acco_jax.skippipe import simulate
from acco_jax.skippipe.topology import Topology


def _least_time(demand: int, groups) -> float:
  """The least ``T`` at which ``groups`` can absorb ``demand`` units of work.

  Args:
    demand: units to place (microbatches or stage visits).
    groups: ``(offset, speeds, work, floor, cap)`` per group: a node of speed ``v`` absorbs
      ``floor((T - offset) v / work)`` units by ``T``, a group at most ``cap`` in all, and a group
      must absorb at least ``floor`` units.

  Returns:
    The least such ``T`` (rounded down by a relative 1e-9, so it stays a lower bound).
  """
  if demand <= 0:
    return 0.0

  def absorbed(t):
    total = 0
    for offset, speeds, work, least, cap in groups:
      if t < offset:
        here = 0
      elif work <= 0:
        here = cap
      else:
        here = min(cap, sum(math.floor((t - offset) * v / work * (1 + 1e-9)) for v in speeds))
      if here < least:
        return -1
      total += here
    return total

  times = sorted(
    {
      offset + a * work / v
      for offset, speeds, work, _, cap in groups
      for v in speeds
      for a in range(0 if work <= 0 else 1, min(cap, demand) + 1)
    }
  )
  lo, hi = 0, len(times) - 1
  if absorbed(times[hi]) < demand:
    return math.inf
  while lo < hi:
    mid = (lo + hi) // 2
    if absorbed(times[mid]) >= demand:
      hi = mid
    else:
      lo = mid + 1
  return times[lo] * (1 - 1e-9)


def fastest_route_s(
  topo: Topology,
  costs: simulate.Costs,
  partition: Sequence[Sequence[int]],
  k: int,
  through: int | None = None,
) -> float:
  """A lower bound on one microbatch's chain alone: origin, ``k`` hops, back, backward the same way.

  The chain's steps run one after another, each hop paying ``xfer[a, b]`` forward and
  ``xfer[b, a]`` backward, so its length is the compute of its nodes plus those transfers. The
  least such length is found over walks of ``k`` nodes of stages >= 1 (consecutive ones on
  different stages) that start and end at a stage-0 node; a walk may repeat a stage, which a path
  may not, so the walk's minimum is at most any route's length.

  Args:
    topo, costs, partition: as :func:`lower_bound`.
    k: stages a path visits after stage 0.
    through: when given, only routes that visit this stage count.

  Returns:
    Seconds.
  """
  xfer = topo.transfer_MxM(costs.act_bytes)
  both = xfer + xfer.T
  speed = topo.speed_M
  w = 1 + costs.backward
  rest = [x for s in range(1, len(partition)) for x in partition[s]]
  stage = {x: s for s, p in enumerate(partition) for x in p}
  comp = np.array([w * costs.fwd_S[stage[y]] / speed[y] for y in rest])
  hop = both[np.ix_(rest, rest)]
  same = np.array([[stage[a] == stage[b] for b in rest] for a in rest], bool)
  hop = np.where(same, np.inf, hop)
  hit = np.array([through is None or stage[y] == through for y in rest], bool)
  best = math.inf
  for o in partition[0]:
    here = w * (costs.fwd_S[0] + costs.head) / speed[o]
    if k == 0 or not rest:
      best = min(best, here if k == 0 else math.inf)
      continue
    # d[0]: walks that have not met stage `through` yet, d[1]: walks that have (or need not)
    d = np.full((2, len(rest)), np.inf)
    d[hit.astype(int), np.arange(len(rest))] = both[o, rest] + comp
    for _ in range(k - 1):
      step = np.min(d[:, :, None] + hop[None], axis=1) + comp
      d = np.stack(
        [np.where(hit, np.inf, step[0]), np.minimum(step[1], np.where(hit, step[0], np.inf))]
      )
    best = min(best, here + float(np.min(d[1] + both[rest, o])))
  return best


def default_balance(num_mb: int, k: int, num_stages: int) -> int:
  """The scheduler's default balance bound: visits per stage >= 1, ``ceil(n K / (S - 1))``."""
  return -(-num_mb * k // (num_stages - 1)) if num_stages > 1 else 0


def lower_bound(
  topo: Topology,
  costs: simulate.Costs,
  partition: Sequence[Sequence[int]],
  num_mb: int,
  skip: float,
  balance: int | None = 0,
) -> float:
  """A lower bound on the makespan of every plan (see the module docstring for the proof).

  Args:
    topo: the nodes and links.
    costs: per-microbatch costs; with ``grad_bytes_S`` each stage's all-reduce is included.
    partition: the nodes of each stage.
    num_mb: microbatches per iteration.
    skip: the skip ratio (``paths.path_length``).
    balance: the plans' balance bound ``c`` (visits per stage >= 1); 0 the scheduler's default
      (:func:`default_balance`), None no bound (any paths).

  Returns:
    Seconds; no plan of these microbatches on this partition that meets ``balance`` simulates or
    replays faster.
  """
  s_count = len(partition)
  k = paths_lib.path_length(s_count, skip)
  w = 1 + costs.backward
  grads = costs.grad_bytes_S
  ar = [
    0.0 if grads is None else simulate.ring_allreduce_s(topo, nodes, grads[s])
    for s, nodes in enumerate(partition)
  ]
  most = num_mb if balance is None else min(num_mb, balance or default_balance(num_mb, k, s_count))
  least = max(0, num_mb * k - (s_count - 2) * most)
  speeds = [[float(topo.speed_M[x]) for x in p] for p in partition]
  stage0 = _least_time(num_mb, [(0.0, speeds[0], w * (costs.fwd_S[0] + costs.head), 0, num_mb)])
  routes = [fastest_route_s(topo, costs, partition, k)]
  if least and k:  # every stage is visited: by a microbatch whose chain ends on stage 0
    routes += [fastest_route_s(topo, costs, partition, k, s) for s in range(1, s_count)]
  stage0 = max(stage0, *routes) + ar[0]
  rest = _least_time(
    num_mb * k,
    [(ar[s], speeds[s], w * costs.fwd_S[s], least, most) for s in range(1, s_count)],
  )
  return max(stage0, rest, max(ar))
