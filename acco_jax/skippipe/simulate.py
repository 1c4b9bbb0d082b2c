"""Discrete-event simulation of one pipeline iteration: the makespan of a set of routes.

A *route* sends one microbatch from its stage-0 node ``origin`` through the stages of its ``path``
(:mod:`acco_jax.skippipe.paths`), one node per stage (``nodes``), back to ``origin`` for the head and
the loss, and backward along the same nodes in reverse. With ``K = len(path)`` its chain of
``2K + 3`` *steps* is

  step 0          F  stage 0's blocks (and the embedding) on origin
  step 1..K       F  stage path[j-1] on nodes[j-1]
  step K+1        H  head and loss, forward and backward, on origin
  step K+2..2K+1  B  the path's stages in reverse order
  step 2K+2       B  stage 0's blocks on origin

Step ``j`` may start once step ``j - 1`` has ended and its activations (forward) or cotangents
(backward) have crossed the link, ``latency + bytes / bandwidth`` with ``bytes = tokens x d_model x
2`` (bf16), and once its node is free: a node computes one step at a time (*node serialisation*);
links carry transfers concurrently. Durations on a node of speed ``v``: F = ``fwd_S[s] / v``,
B = ``backward * fwd_S[s] / v``, H = ``(1 + backward) * head / v``. The pipeline ends when its
last step ends.

Then each stage all-reduces its gradients among the nodes that hold it, when ``costs.grad_bytes_S``
is given and the stage assignment is passed (``partition``): stage s starts once every node of
``partition[s]`` has finished its last step, and a ring over its ``k`` nodes (in partition order)
takes ``2 (k - 1) (latency + grad_bytes_S[s] / k / bandwidth)`` with the ring's slowest hop's
latency and bandwidth (:func:`ring_allreduce_s`). The makespan is then the time the last stage's
all-reduce ends; without them it is the pipeline's end.

Which waiting step a free node runs next is the *policy*:

  'fifo'   earliest possible start first; ties go to backward steps, then the lower microbatch
           (the collision rule SkipPipe's schedules assume)
  'gpipe'  fill-drain: a node runs every forward it hosts before any H or B step
  '1f1b'   backward first, and a forward at position j of a K-stage route (origin = 0) waits while
           its node holds ``K + 2 - j`` microbatches' activations (1F1B's warm-up bound)

The simulator records the order in which each node ran its steps, ``order[node] = ((mb, step),
...)``; :func:`replay` runs a given order as a static schedule (a tick table does the same), and
reproduces the policy's makespan from its recorded order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from acco_jax.skippipe.topology import Topology

POLICIES = ("fifo", "gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Route:
  """One microbatch's trip: its stage-0 node, the stages it visits in order, a node per stage."""

  origin: int
  path: tuple[int, ...]
  nodes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Costs:
  """Per-microbatch compute and transfer sizes.

  Attributes:
    fwd_S: forward seconds of each stage on a speed-1.0 node (stage 0 includes the embedding).
    head: forward seconds of the final LayerNorm, head and loss.
    act_bytes: bytes of one microbatch's activations (tokens x d_model x 2 for bf16).
    backward: backward / forward time ratio.
    grad_bytes_S: bytes of each stage's gradients, all-reduced among the stage's nodes after the
      pipeline (stage 0 includes the embedding and head); None leaves the all-reduce out.
  """

  fwd_S: np.ndarray
  head: float
  act_bytes: float
  backward: float = 2.0
  grad_bytes_S: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class SimResult:
  """Makespan [s] (all-reduces included when simulated); per microbatch the start and end of each
  step; per node its processing order; the pipeline's end [s], before any all-reduce."""

  makespan: float
  start: tuple[np.ndarray, ...]
  end: tuple[np.ndarray, ...]
  order: tuple[tuple[tuple[int, int], ...], ...]
  pipeline_s: float = 0.0


def _chains(topo: Topology, costs: Costs, routes: Sequence[Route]):
  """Per route: node, duration, kind ('F', 'H', 'B') and route position of each step."""
  out = []
  for r in routes:
    k = len(r.path)
    stages = (0, *r.path)
    hops = (r.origin, *r.nodes)
    node, dur, kind, pos = [], [], [], []
    for j in range(k + 1):
      node.append(hops[j])
      dur.append(costs.fwd_S[stages[j]] / topo.speed_M[hops[j]])
      kind.append("F")
      pos.append(j)
    node.append(r.origin)
    dur.append((1 + costs.backward) * costs.head / topo.speed_M[r.origin])
    kind.append("H")
    pos.append(k + 1)
    for j in range(k, -1, -1):
      node.append(hops[j])
      dur.append(costs.backward * costs.fwd_S[stages[j]] / topo.speed_M[hops[j]])
      kind.append("B")
      pos.append(j)
    out.append((node, dur, kind, pos))
  return out


def simulate(
  topo: Topology,
  costs: Costs,
  routes: Sequence[Route],
  policy: str = "fifo",
  partition: Sequence[Sequence[int]] | None = None,
) -> SimResult:
  """Runs one iteration under ``policy`` (see the module docstring) and returns its makespan.

  Each event chooses, over all microbatches, the waiting step with the earliest possible start
  ``max(ready, node free, policy gate)``; no later choice can start earlier, so the schedule is
  causal and non-delay. With ``partition`` (the nodes of each stage) and ``costs.grad_bytes_S``,
  each stage's gradient all-reduce follows its nodes' last steps.
  """
  if policy not in POLICIES:
    raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
  chains = _chains(topo, costs, routes)
  xfer = topo.transfer_MxM(costs.act_bytes)
  n, m = len(routes), topo.num_nodes
  nxt = [0] * n
  ready = [0.0] * n
  free = [0.0] * m
  start = [np.zeros(len(c[0])) for c in chains]
  end = [np.zeros(len(c[0])) for c in chains]
  order = [[] for _ in range(m)]
  fwd_left = [0] * m
  fwd_done = [0.0] * m
  for node, _, kind, _ in chains:
    for x, kd in zip(node, kind, strict=True):
      fwd_left[x] += kd == "F"
  held = [dict() for _ in range(m)]  # node -> {mb: release time (inf until its B step ends)}
  remaining = sum(len(c[0]) for c in chains)
  while remaining:
    best, best_key = -1, None
    for b in range(n):
      j = nxt[b]
      node, dur, kind, pos = chains[b]
      if j >= len(node):
        continue
      x, kd = node[j], kind[j]
      t = max(ready[b], free[x])
      if policy == "gpipe" and kd != "F":
        t = max(t, fwd_done[x]) if fwd_left[x] == 0 else math.inf
      if policy == "1f1b" and kd == "F":
        cap = len(routes[b].path) + 2 - pos[j]
        rel = sorted(held[x].values())
        if len(rel) >= cap:
          t = max(t, rel[len(rel) - cap])
      if t == math.inf:
        continue
      key = (t, kd == "F", b)
      if best_key is None or key < best_key:
        best, best_key = b, key
    if best < 0:
      raise RuntimeError(f"policy {policy!r} deadlocks on these routes")
    b, t = best, best_key[0]
    node, dur, kind, pos = chains[b]
    j = nxt[b]
    x = node[j]
    start[b][j], end[b][j] = t, t + dur[j]
    free[x] = end[b][j]
    order[x].append((b, j))
    if kind[j] == "F":
      fwd_left[x] -= 1
      fwd_done[x] = max(fwd_done[x], end[b][j])
      held[x][(b, pos[j])] = math.inf
    elif kind[j] == "B":
      held[x][(b, pos[j])] = end[b][j]
    nxt[b] = j + 1
    if j + 1 < len(node):
      ready[b] = end[b][j] + xfer[x, node[j + 1]]
    remaining -= 1
  return _result(topo, costs, partition, start, end, order, free)


def _result(topo: Topology, costs: Costs, partition, start, end, order, node_free) -> SimResult:
  """Packs one simulated iteration: the pipeline ends with its last step, the iteration with the
  last stage's all-reduce (:func:`allreduce_end_s`)."""
  pipeline_s = max((float(e[-1]) for e in end), default=0.0)
  return SimResult(
    max(pipeline_s, allreduce_end_s(topo, costs, partition, node_free)),
    tuple(start),
    tuple(end),
    tuple(tuple(o) for o in order),
    pipeline_s,
  )


def ring_allreduce_s(topo: Topology, nodes: Sequence[int], num_bytes: float) -> float:
  """Seconds of a ring all-reduce of ``num_bytes`` among ``nodes`` (in this order): ``2 (k - 1)``
  steps of ``num_bytes / k`` each, every step paced by the ring's slowest hop."""
  k = len(nodes)
  if k < 2 or num_bytes <= 0:
    return 0.0
  hops = [(nodes[i], nodes[(i + 1) % k]) for i in range(k)]
  latency = max(topo.latency_MxM[a, b] for a, b in hops)
  bandwidth = min(topo.bandwidth_MxM[a, b] for a, b in hops)
  return 2 * (k - 1) * (latency + num_bytes / k / bandwidth)


def allreduce_end_s(topo: Topology, costs: Costs, partition, node_free) -> float:
  """When the last stage's gradient all-reduce ends, given when each node ran its last step
  (0 when there is no partition or no gradient sizes)."""
  if partition is None or costs.grad_bytes_S is None:
    return 0.0
  return max(
    max(float(node_free[x]) for x in nodes) + ring_allreduce_s(topo, nodes, costs.grad_bytes_S[s])
    for s, nodes in enumerate(partition)
  )


def replay(
  topo: Topology,
  costs: Costs,
  routes: Sequence[Route],
  order: Sequence[Sequence[tuple[int, int]]],
  partition: Sequence[Sequence[int]] | None = None,
) -> SimResult:
  """Runs a static schedule: node ``x`` runs the steps ``order[x]`` in that order, each as soon as
  its input has arrived and the previous step on ``x`` has ended; all-reduces as in
  :func:`simulate`.

  Raises:
    ValueError: when the order misses a step, or deadlocks (a node waits on a step that waits on it).
  """
  chains = _chains(topo, costs, routes)
  xfer = topo.transfer_MxM(costs.act_bytes)
  n, m = len(routes), topo.num_nodes
  want = sorted((b, j) for b in range(n) for j in range(len(chains[b][0])))
  if sorted(s for o in order for s in o) != want or len(order) != m:
    raise ValueError("the order must list every step of every route exactly once, per node")
  nxt, ready, free, ptr = [0] * n, [0.0] * n, [0.0] * m, [0] * m
  start = [np.zeros(len(c[0])) for c in chains]
  end = [np.zeros(len(c[0])) for c in chains]
  progress = True
  while progress:
    progress = False
    for x in range(m):
      while ptr[x] < len(order[x]):
        b, j = order[x][ptr[x]]
        node, dur = chains[b][0], chains[b][1]
        if node[j] != x:
          raise ValueError(f"step {j} of microbatch {b} runs on node {node[j]}, not {x}")
        if nxt[b] != j:
          break
        t = max(ready[b], free[x])
        start[b][j], end[b][j] = t, t + dur[j]
        free[x] = end[b][j]
        nxt[b] = j + 1
        if j + 1 < len(node):
          ready[b] = end[b][j] + xfer[x, node[j + 1]]
        ptr[x] += 1
        progress = True
  if any(p < len(o) for p, o in zip(ptr, order, strict=True)):
    raise ValueError("the order deadlocks: a node waits on a step that waits on it")
  return _result(topo, costs, partition, start, end, order, free)


def lanes(topo: Topology, costs: Costs, partition: Sequence[Sequence[int]], num_mb: int):
  """Full-pipeline routes on fixed lanes: one lane per stage-0 node, microbatch b on lane b mod L.

  Lane l starts at stage-0 node l and takes, stage by stage, the free node of the next partition
  closest to its previous node (each node serves at most ceil(L / partition size) lanes).
  """
  xfer = topo.transfer_MxM(costs.act_bytes)
  origins = list(partition[0])
  s_count = len(partition)
  lane_nodes = [[] for _ in origins]
  prev = list(origins)
  for s in range(1, s_count):
    cap = -(-len(origins) // len(partition[s]))
    load = dict.fromkeys(partition[s], 0)
    pairs = sorted((xfer[prev[i], y], i, y) for i in range(len(origins)) for y in partition[s])
    done = set()
    for _, i, y in pairs:
      if i in done or load[y] >= cap:
        continue
      lane_nodes[i].append(y)
      load[y] += 1
      done.add(i)
      prev[i] = y
  path = tuple(range(1, s_count))
  return [
    Route(origins[b % len(origins)], path, tuple(lane_nodes[b % len(origins)]))
    for b in range(num_mb)
  ]


def transformer_costs(
  num_stages: int,
  num_layers: int,
  d_model: int,
  vocab: int,
  seq_len: int,
  mb_size: int,
  flops_per_s: float,
  grad_bytes: int = 0,
) -> Costs:
  """Costs of a decoder-only transformer: ``24 T D^2 + 4 T L D`` forward FLOPs per layer and
  ``2 T D V`` for the head, ``T = mb_size x seq_len`` tokens; bf16 activations of ``2 T D`` bytes.
  ``grad_bytes`` > 0 (2 for bf16) adds gradient sizes: ``12 D^2`` values per layer, and the tied
  embedding's ``V D`` on stage 0.
  """
  tokens = mb_size * seq_len
  layer = (24 * tokens * d_model**2 + 4 * tokens * seq_len * d_model) / flops_per_s
  per_stage = num_layers / num_stages
  return Costs(
    fwd_S=np.full(num_stages, per_stage * layer),
    head=2 * tokens * d_model * vocab / flops_per_s,
    act_bytes=2.0 * tokens * d_model,
    grad_bytes_S=None
    if not grad_bytes
    else grad_bytes
    * (
      np.full(num_stages, per_stage * 12.0 * d_model**2) + np.eye(num_stages)[0] * vocab * d_model
    ),
  )
