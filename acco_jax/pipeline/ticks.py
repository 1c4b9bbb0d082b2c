"""Tick tables: a pipeline schedule as the static program :mod:`acco_jax.pipeline.step` runs.

Pure host code (NumPy). A microbatch ``m`` on path ``p = (p_1, ..., p_k)`` (see
:mod:`acco_jax.pipeline.paths`) is a chain of ``2k + 3`` operations, each on one stage (one device of
the ``stage`` mesh axis):

  F0 on 0,  F on p_1, ..., F on p_k,  H on 0,  B on p_k, ..., B on p_1,  B0 on 0

F0 embeds the tokens and runs stage 0's blocks; F runs a stage's blocks; H is the head, the loss
and its backward (it returns the cotangent of the last activation); B is a stage's backward
(recomputed from its saved input: only stage inputs are kept); B0 is stage 0's backward into the
embedding. Operation ``i + 1`` needs the output of operation ``i``; B on ``p_j`` also needs the input
that F on ``p_j`` saved.

A schedule is a list of ticks. At each tick every stage runs at most one operation; then each output
moves to the stage of its microbatch's next operation, arriving for the next tick. The transfers of
one tick are split into *rounds*: each round is a partial permutation (no two sources, no two
targets alike), one static ``ppermute``. Arriving tensors go into per-stage buffer *slots*, allocated
here so that a slot is reused once its tensor is consumed; the slot count is the activation memory.

Which ready operation a stage runs when several wait (a *collision*) is the policy's choice:

* ``gpipe`` (fill-drain): forward operations (F0, F, H) before backward ones, and no backward on a
  stage until all its forwards are done.
* ``1f1b``: backward operations first; a stage starts a new microbatch's forward only while fewer
  than ``max_in_flight`` microbatches (default S) hold activations on it.

Within a class, ops go by the microbatch's rank in ``priority[stage]`` (default: microbatch index),
the per-node processing order a path scheduler produces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from acco_jax.pipeline import paths as paths_lib

IDLE, F0, F, H, B, B0 = range(6)
KIND_NAMES = ("idle", "F0", "F", "H", "B", "B0")
POLICIES = ("gpipe", "1f1b")


class Schedule(NamedTuple):
  """Static tick tables (T ticks, S stages, R rounds per tick, ``slots`` buffer slots per stage).

  The step reads, per tick ``t`` and stage ``s``: ``kind[t, s]`` and ``mb[t, s]`` (the operation and
  its microbatch), ``slot_x[t, s]`` (its input: the activation for F and H, the saved stage input for
  B) and ``slot_g[t, s]`` (the cotangent for B and B0), ``local[t, s]`` (slot where the output stays
  on the same stage), ``perm[t, r]`` (index into ``perms``: round ``r``'s permutation, 0 = none) and
  ``recv[t, r, s]`` (slot where stage ``s`` stores what it receives in round ``r``). Unused slot
  entries point at the scratch slot ``slots``.
  """

  paths: tuple
  num_stages: int
  policy: str
  kind: np.ndarray  # [T, S] int32
  mb: np.ndarray  # [T, S]
  slot_x: np.ndarray  # [T, S]
  slot_g: np.ndarray  # [T, S]
  local: np.ndarray  # [T, S]
  perm: np.ndarray  # [T, R]
  recv: np.ndarray  # [T, R, S]
  perms: tuple  # distinct permutations, each a tuple of (source, target); perms[0] = ()
  slots: int

  @property
  def num_ticks(self) -> int:
    return int(self.kind.shape[0])

  @property
  def num_microbatches(self) -> int:
    return len(self.paths)

  def idle_fraction(self) -> float:
    """Share of (tick, stage) cells with no operation."""
    return float(np.mean(self.kind == IDLE))

  def pairs(self) -> set:
    """Every (source, target) that some round of the schedule moves data over."""
    return {pair for p in self.perms for pair in p}


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


def build(
  paths: Sequence[paths_lib.Path],
  num_stages: int,
  policy: str = "gpipe",
  priority: Sequence[Sequence[int]] | None = None,
  max_in_flight: int | None = None,
) -> Schedule:
  """Schedules the microbatches' chains tick by tick (greedy list scheduling, see module docstring).

  Args:
    paths: one path per microbatch (``paths.full_path(S)`` for every one: the ordinary pipeline).
    num_stages: S.
    policy: ``'gpipe'`` or ``'1f1b'``.
    priority: optional per-stage processing order of microbatches (stage -> list of microbatches);
      microbatches it leaves out follow in index order.
    max_in_flight: ``1f1b`` only: microbatches that may hold activations on a stage (default S).

  Returns:
    The :class:`Schedule`.
  """
  if policy not in POLICIES:
    raise ValueError(f"policy={policy!r}: choose one of {', '.join(POLICIES)}")
  S, M = num_stages, len(paths)
  paths = tuple(paths_lib.validate_path(p, S) for p in paths)
  chains = [chain(p) for p in paths]
  rank = _ranks(priority, S, M)
  cap = max_in_flight or S
  nxt = [0] * M  # next op index per microbatch
  ready = [0] * M  # tick from which that op may run
  fwd_left = np.zeros(S, int)  # forward-class ops not yet run, per stage
  for c in chains:
    for kind, s in c:
      fwd_left[s] += kind in (F0, F, H)
  in_flight = [set() for _ in range(S)]
  free = [[] for _ in range(S)]  # free slot ids per stage
  used = [0] * S
  held_x = {}  # (m, op index of the F) -> slot holding that F's input
  arrive = {}  # m -> slot holding the input of its next op (None: none needed)
  rows = []
  t = 0
  while any(nxt[m] < len(chains[m]) for m in range(M)):
    if t > 8 * sum(len(c) for c in chains) + 8:
      raise RuntimeError("tick scheduling made no progress")
    pick = [None] * S
    for m in range(M):
      if nxt[m] >= len(chains[m]) or ready[m] > t:
        continue
      kind, s = chains[m][nxt[m]]
      is_fwd = kind in (F0, F, H)
      if policy == "gpipe":
        if not is_fwd and fwd_left[s]:
          continue
        key = (0 if is_fwd else 1, rank[s, m])
      else:
        if kind in (F0, F) and m not in in_flight[s] and len(in_flight[s]) >= cap:
          continue
        key = (1 if is_fwd else 0, rank[s, m])
      if pick[s] is None or key < pick[s][0]:
        pick[s] = (key, m)
    row = dict(
      kind=[IDLE] * S, mb=[0] * S, slot_x=[-1] * S, slot_g=[-1] * S, local=[-1] * S, sends=[]
    )
    release = []
    for s in range(S):
      if pick[s] is None:
        continue
      m = pick[s][1]
      i = nxt[m]
      kind, _ = chains[m][i]
      row["kind"][s], row["mb"][s] = kind, m
      if kind == F:
        row["slot_x"][s] = arrive.pop(m)
        held_x[(m, i)] = row["slot_x"][s]
        in_flight[s].add(m)
      elif kind == F0:
        in_flight[s].add(m)
      elif kind == H:
        row["slot_x"][s] = arrive.pop(m)
        release.append((s, row["slot_x"][s]))
      else:  # B, B0: the cotangent, and for B the saved input of the matching F
        row["slot_g"][s] = arrive.pop(m)
        release.append((s, row["slot_g"][s]))
        if kind == B:
          row["slot_x"][s] = held_x.pop((m, len(chains[m]) - 1 - i))
          release.append((s, row["slot_x"][s]))
        in_flight[s].discard(m)
      fwd_left[s] -= kind in (F0, F, H)
    for s, slot in release:  # reads happen before this tick's writes: free now
      free[s].append(slot)
    for s in range(S):
      if pick[s] is None:
        continue
      m = pick[s][1]
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
      if dst == s:
        row["local"][s] = slot
      else:
        row["sends"].append((s, dst, slot))
    rows.append(row)
    t += 1
  return _tables(paths, S, policy, rows, max(used))


def _tables(paths, S, policy, rows, slots) -> Schedule:
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
  recv = np.full((T, R, S), slots, np.int32)
  for t, tick_rounds in enumerate(rounds):
    for r, sends in enumerate(tick_rounds):
      p = tuple(sorted((src, dst) for src, dst, _ in sends))
      if p not in perms:
        perms.append(p)
      perm[t, r] = perms.index(p)
      for _, dst, slot in sends:
        recv[t, r, dst] = slot

  def arr(key):
    a = np.array([row[key] for row in rows], np.int32).reshape(T, S)
    return np.where(a < 0, slots, a) if key.startswith(("slot", "local")) else a

  return Schedule(
    paths, S, policy, arr("kind"), arr("mb"), arr("slot_x"), arr("slot_g"), arr("local"), perm,
    recv, tuple(perms), slots,
  )  # fmt: skip


def describe(schedule: Schedule) -> str:
  """A text grid: one line per stage, one column per tick (``F3`` = a forward of microbatch 3)."""
  lines = []
  for s in range(schedule.num_stages):
    cells = []
    for t in range(schedule.num_ticks):
      k = schedule.kind[t, s]
      cells.append("." if k == IDLE else f"{KIND_NAMES[k]}{schedule.mb[t, s]}")
    lines.append(f"stage {s}: " + " ".join(f"{c:>4}" for c in cells))
  return "\n".join(lines)
