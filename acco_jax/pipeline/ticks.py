"""Tick tables: a pipeline schedule as the static program :mod:`acco_jax.pipeline.programs` runs.

Pure host code (NumPy). A microbatch ``m`` on path ``p = (p_1, ..., p_k)`` (see
:mod:`acco_jax.skippipe.paths`) is a chain of ``2k + 3`` operations, each on one device (a *column*
of the tables):

  F0 on 0,  F on p_1, ..., F on p_k,  H on 0,  B on p_k, ..., B on p_1,  B0 on 0

F0 embeds the tokens and runs stage 0's blocks; F runs a stage's blocks; H is the head, the loss
and its backward (it returns the cotangent of the last activation); B is a stage's backward
(recomputed from its saved input: only stage inputs are kept); B0 is stage 0's backward into the
embedding. Operation ``i + 1`` needs the output of operation ``i``; B on ``p_j`` also needs the input
that F on ``p_j`` saved. Operation ``i`` is step ``i`` of :mod:`acco_jax.skippipe.simulate`.

Two kinds of tables:

* **per lane** (:func:`build`): the columns are the S stages; on a ``('data', 'stage')`` mesh every
  data lane runs the same tables on its own rows of every microbatch.
* **mesh-wide** (:func:`from_plan`): the columns are all ``lanes x S`` devices, device ``l * S + s``
  (lane ``l``, stage ``s``; the row-major order of the mesh) holding node ``partition[s][l]`` of the
  path scheduler's :class:`~acco_jax.skippipe.schedule.Plan`. Each microbatch is whole and runs on
  the nodes the plan gives it, so an activation may move from lane 2 of stage 1 to lane 0 of
  stage 3; each device runs its operations in the plan's order for its node.

A schedule is a list of ticks. At each tick every column runs at most one operation; then each
output moves to the column of its microbatch's next operation, arriving for the next tick. The
transfers of one tick are split into *rounds*: each round is a partial permutation (no two sources,
no two targets alike), one static ``ppermute``. Arriving tensors go into per-column buffer *slots*,
allocated here so that a slot is reused once its tensor is consumed; the slot count is the
activation memory.

Which ready operation a column runs when several wait (a *collision*) is the policy's choice:

* ``gpipe`` (fill-drain): forward operations (F0, F, H) before backward ones, and no backward on a
  stage until all its forwards are done.
* ``1f1b``: backward operations first; a stage starts a new microbatch's forward only while fewer
  than ``max_in_flight`` microbatches (default S) hold activations on it.
* ``plan`` (:func:`from_plan`): the plan's order; a column idles until the next operation of its
  order is ready, so it never runs a step before the plan says it may.

Within a class, ops go by the microbatch's rank in ``priority[stage]`` (default: microbatch index),
the per-node processing order a path scheduler produces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from acco_jax.skippipe import paths as paths_lib

IDLE, F0, F, H, B, B0 = range(6)
KIND_NAMES = ("idle", "F0", "F", "H", "B", "B0")
POLICIES = ("gpipe", "1f1b")


class Schedule(NamedTuple):
  """Static tick tables (T ticks, C columns, R rounds per tick, ``slots`` buffer slots per column).

  The step reads, per tick ``t`` and column ``c``: ``kind[t, c]`` and ``mb[t, c]`` (the operation and
  its microbatch), ``slot_x[t, c]`` (its input: the activation for F and H, the saved stage input for
  B) and ``slot_g[t, c]`` (the cotangent for B and B0), ``local[t, c]`` (slot where the output stays
  on the same column), ``perm[t, r]`` (index into ``perms``: round ``r``'s permutation, 0 = none) and
  ``recv[t, r, c]`` (slot where column ``c`` stores what it receives in round ``r``). Unused slot
  entries point at the scratch slot ``slots``. ``op[t, c]`` is the operation's index in its
  microbatch's chain (-1 when idle), and ``columns[m]`` the column of each operation of microbatch
  ``m``'s chain. ``lanes`` is 0 for per-lane tables (columns = stages) and the lane count for
  mesh-wide ones (columns = devices, ``lane * S + stage``).
  """

  paths: tuple
  num_stages: int
  policy: str
  kind: np.ndarray  # [T, C] int32
  mb: np.ndarray  # [T, C]
  slot_x: np.ndarray  # [T, C]
  slot_g: np.ndarray  # [T, C]
  local: np.ndarray  # [T, C]
  perm: np.ndarray  # [T, R]
  recv: np.ndarray  # [T, R, C]
  perms: tuple  # distinct permutations, each a tuple of (source, target); perms[0] = ()
  slots: int
  op: np.ndarray  # [T, C]
  columns: tuple  # per microbatch, the column of each operation of its chain
  lanes: int = 0

  @property
  def num_ticks(self) -> int:
    return int(self.kind.shape[0])

  @property
  def num_columns(self) -> int:
    return int(self.kind.shape[1])

  @property
  def num_microbatches(self) -> int:
    return len(self.paths)

  @property
  def mesh_wide(self) -> bool:
    return self.lanes > 0

  def idle_fraction(self) -> float:
    """Share of (tick, column) cells with no operation."""
    return float(np.mean(self.kind == IDLE))

  def pairs(self) -> set:
    """Every (source, target) that some round of the schedule moves data over."""
    return {pair for p in self.perms for pair in p}

  def order(self, column: int) -> list[tuple[int, int]]:
    """The ``(microbatch, operation index)`` pairs column ``column`` runs, in tick order."""
    ts = np.nonzero(self.kind[:, column] != IDLE)[0]
    return [(int(self.mb[t, column]), int(self.op[t, column])) for t in ts]


def chain(path: paths_lib.Path) -> list[tuple[int, int]]:
  """The (kind, stage) operations of one microbatch on ``path``, in order."""
  k = tuple(path)
  return [(F0, 0), *((F, s) for s in k), (H, 0), *((B, s) for s in reversed(k)), (B0, 0)]


def _ranks(priority, num_stages: int, num_mb: int) -> np.ndarray:
  rank = np.tile(np.arange(num_mb), (num_stages, 1))
  if priority is None:
    return rank
  for s, order in enumerate(priority):
    order = [int(m) for m in order]
    if sorted(order) != sorted(set(order)) or any(not 0 <= m < num_mb for m in order):
      raise ValueError(f"priority[{s}]={order} must list distinct microbatches in 0..{num_mb - 1}")
    rest = [m for m in range(num_mb) if m not in order]
    for r, m in enumerate(order + rest):
      rank[s, m] = r
  return rank


class _PolicyPick:
  """GPipe's or 1F1B's choice among the ready operations (see the module docstring)."""

  def __init__(self, chains, num_stages, policy, priority, max_in_flight):
    self.policy, self.S = policy, num_stages
    self.rank = _ranks(priority, num_stages, len(chains))
    self.cap = max_in_flight or num_stages
    self.fwd_left = np.zeros(num_stages, int)  # forward-class ops not yet run, per stage
    for c in chains:
      for kind, s in c:
        self.fwd_left[s] += kind in (F0, F, H)
    self.in_flight = [set() for _ in range(num_stages)]

  def __call__(self, ready):
    pick = [None] * self.S
    for m, _, kind, s in ready:
      is_fwd = kind in (F0, F, H)
      if self.policy == "gpipe":
        if not is_fwd and self.fwd_left[s]:
          continue
        key = (0 if is_fwd else 1, self.rank[s, m])
      else:
        if kind in (F0, F) and m not in self.in_flight[s] and len(self.in_flight[s]) >= self.cap:
          continue
        key = (1 if is_fwd else 0, self.rank[s, m])
      if pick[s] is None or key < pick[s][0]:
        pick[s] = (key, m)
    picked = [None if p is None else p[1] for p in pick]
    return picked

  def ran(self, m, kind, s):
    if kind in (F0, F):
      self.in_flight[s].add(m)
    elif kind in (B, B0):
      self.in_flight[s].discard(m)
    self.fwd_left[s] -= kind in (F0, F, H)


class _OrderPick:
  """Each column runs the next ``(microbatch, op)`` of its order once that op is ready."""

  def __init__(self, orders):
    self.orders, self.ptr = [list(o) for o in orders], [0] * len(orders)

  def __call__(self, ready):
    now = {(m, i) for m, i, _, _ in ready}
    pick = []
    for c, order in enumerate(self.orders):
      head = order[self.ptr[c]] if self.ptr[c] < len(order) else None
      pick.append(head[0] if head in now else None)
    return pick

  def ran(self, m, kind, c):
    self.ptr[c] += 1


def _run(chains, num_columns, choose):
  """The tick loop shared by :func:`build` and :func:`from_plan`: the operations ``choose`` picks
  each tick, their slots and sends. ``chains[m]`` lists ``(kind, column)``."""
  C, M = num_columns, len(chains)
  nxt = [0] * M  # next op index per microbatch
  ready = [0] * M  # tick from which that op may run
  free = [[] for _ in range(C)]  # free slot ids per column
  used = [0] * C
  held_x = {}  # (m, op index of the F) -> slot holding that F's input
  arrive = {}  # m -> slot holding the input of its next op (None: none needed)
  rows = []
  t = 0
  while any(nxt[m] < len(chains[m]) for m in range(M)):
    if t > 8 * sum(len(c) for c in chains) + 8:
      raise RuntimeError("tick scheduling made no progress (an order that deadlocks?)")
    waiting = [
      (m, nxt[m], *chains[m][nxt[m]]) for m in range(M) if nxt[m] < len(chains[m]) and ready[m] <= t
    ]
    pick = choose(waiting)
    row = dict(
      kind=[IDLE] * C,
      mb=[0] * C,
      op=[-1] * C,
      slot_x=[-1] * C,
      slot_g=[-1] * C,
      local=[-1] * C,
      sends=[],
    )
    release = []
    for c in range(C):
      if pick[c] is None:
        continue
      m = pick[c]
      i = nxt[m]
      kind, col = chains[m][i]
      assert col == c, (m, i, col, c)
      row["kind"][c], row["mb"][c], row["op"][c] = kind, m, i
      if kind in (F, H):
        row["slot_x"][c] = arrive.pop(m)
        if kind == F:
          held_x[(m, i)] = row["slot_x"][c]
        else:
          release.append((c, row["slot_x"][c]))
      elif kind in (B, B0):  # the cotangent, and for B the saved input of the matching F
        row["slot_g"][c] = arrive.pop(m)
        release.append((c, row["slot_g"][c]))
        if kind == B:
          row["slot_x"][c] = held_x.pop((m, len(chains[m]) - 1 - i))
          release.append((c, row["slot_x"][c]))
      choose.ran(m, kind, c)
    for c, slot in release:  # reads happen before this tick's writes: free now
      free[c].append(slot)
    for c in range(C):
      if pick[c] is None:
        continue
      m = pick[c]
      nxt[m] += 1
      ready[m] = t + 1
      if nxt[m] == len(chains[m]):
        continue
      dst = chains[m][nxt[m]][1]
      if free[dst]:
        free[dst].sort()
        slot = free[dst].pop(0)
      else:
        slot, used[dst] = used[dst], used[dst] + 1
      arrive[m] = slot
      if dst == c:
        row["local"][c] = slot
      else:
        row["sends"].append((c, dst, slot))
    rows.append(row)
    t += 1
  return rows, max(used)


def build(
  paths: Sequence[paths_lib.Path],
  num_stages: int,
  policy: str = "gpipe",
  priority: Sequence[Sequence[int]] | None = None,
  max_in_flight: int | None = None,
) -> Schedule:
  """Per-lane tables: schedules the microbatches' chains tick by tick (greedy list scheduling, see
  the module docstring).

  Args:
    paths: one path per microbatch (``paths.full_path(S)`` for every one: the ordinary pipeline).
    num_stages: S.
    policy: ``'gpipe'`` or ``'1f1b'``.
    priority: optional per-stage processing order of microbatches (stage -> list of microbatches);
      microbatches it leaves out follow in index order.
    max_in_flight: ``1f1b`` only: microbatches that may hold activations on a stage (default S).

  Returns:
    The :class:`Schedule` (``lanes == 0``).
  """
  if policy not in POLICIES:
    raise ValueError(f"policy={policy!r}: choose one of {', '.join(POLICIES)}")
  paths = tuple(paths_lib.validate_path(p, num_stages) for p in paths)
  chains = [chain(p) for p in paths]
  pick = _PolicyPick(chains, num_stages, policy, priority, max_in_flight)
  rows, slots = _run(chains, num_stages, pick)
  columns = tuple(tuple(s for _, s in c) for c in chains)
  return _tables(paths, num_stages, policy, rows, slots, num_stages, columns, 0)


def from_plan(plan, partition: Sequence[Sequence[int]]) -> Schedule:
  """Mesh-wide tables of a path scheduler's plan (see the module docstring).

  Args:
    plan: a :class:`acco_jax.skippipe.schedule.Plan`; its nodes are those of ``partition``.
    partition: the nodes of each stage, as many on every stage (the data lanes); node
      ``partition[s][l]`` runs on device ``l * S + s``.

  Returns:
    The :class:`Schedule` (``lanes == len(partition[0])``), whose column ``c`` runs the steps of its
    node's ``plan.order`` in that order.
  """
  S, lanes = len(partition), len(partition[0])
  if any(len(p) != lanes for p in partition):
    raise ValueError(f"partition {partition} must put as many nodes on every stage")
  column = {int(x): lane * S + s for s, p in enumerate(partition) for lane, x in enumerate(p)}
  if len(plan.order) != len(column) or sorted(column) != list(range(len(column))):
    raise ValueError(f"the plan has {len(plan.order)} nodes, the partition {sorted(column)}")
  paths = tuple(paths_lib.validate_path(p, S) for p in plan.paths)
  chains, columns = [], []
  for origin, path, nodes in zip(plan.origin, paths, plan.nodes, strict=True):
    if column[origin] % S != 0 or [column[y] % S for y in nodes] != list(path):
      raise ValueError(f"route {origin}, {path}, {nodes} leaves its stages' nodes")
    hops = [column[origin], *(column[y] for y in nodes)]
    cols = [hops[0], *hops[1:], hops[0], *reversed(hops[1:]), hops[0]]
    chains.append([(k, c) for (k, _), c in zip(chain(path), cols, strict=True)])
    columns.append(tuple(cols))
  orders = [None] * len(column)
  for node, steps in enumerate(plan.order):
    orders[column[node]] = [(int(m), int(j)) for m, j in steps]
    if any(chains[m][j][1] != column[node] for m, j in orders[column[node]]):
      raise ValueError(f"the plan's order for node {node} lists a step of another node")
  want = sorted((m, j) for m, c in enumerate(chains) for j in range(len(c)))
  if sorted(x for o in orders for x in o) != want:
    raise ValueError("the plan's order must list every step of every route exactly once")
  rows, slots = _run(chains, len(column), _OrderPick(orders))
  return _tables(paths, S, "plan", rows, slots, len(column), tuple(columns), lanes)


def _tables(paths, S, policy, rows, slots, C, columns, lanes) -> Schedule:
  """Splits each tick's sends into rounds of partial permutations and packs the arrays."""
  T = len(rows)
  rounds = []
  for row in rows:
    per_dst = {}
    for src, dst, slot in row["sends"]:
      per_dst.setdefault(dst, []).append((src, dst, slot))
    n = max((len(v) for v in per_dst.values()), default=0)
    rounds.append([[v[r] for v in per_dst.values() if len(v) > r] for r in range(n)])
  R = max(1, max(len(r) for r in rounds))
  perms = [()]
  perm = np.zeros((T, R), np.int32)
  recv = np.full((T, R, C), slots, np.int32)
  for t, tick_rounds in enumerate(rounds):
    for r, sends in enumerate(tick_rounds):
      p = tuple(sorted((src, dst) for src, dst, _ in sends))
      if p not in perms:
        perms.append(p)
      perm[t, r] = perms.index(p)
      for _, dst, slot in sends:
        recv[t, r, dst] = slot

  def arr(key):
    a = np.array([row[key] for row in rows], np.int32).reshape(T, C)
    return np.where(a < 0, slots, a) if key.startswith(("slot", "local")) else a

  return Schedule(
    paths,
    S,
    policy,
    arr("kind"),
    arr("mb"),
    arr("slot_x"),
    arr("slot_g"),
    arr("local"),
    perm,
    recv,
    tuple(perms),
    slots,
    arr("op"),
    columns,
    lanes,
  )


def describe(schedule: Schedule) -> str:
  """A text grid: one line per column, one column per tick (``F3`` = a forward of microbatch 3)."""
  lines = []
  S = schedule.num_stages
  for c in range(schedule.num_columns):
    cells = []
    for t in range(schedule.num_ticks):
      k = schedule.kind[t, c]
      cells.append("." if k == IDLE else f"{KIND_NAMES[k]}{schedule.mb[t, c]}")
    name = f"lane {c // S} stage {c % S}" if schedule.mesh_wide else f"stage {c}"
    lines.append(f"{name}: " + " ".join(f"{x:>4}" for x in cells))
  return "\n".join(lines)
