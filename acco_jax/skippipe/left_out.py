"""The full pipeline with stages left out: why skipping need not be slower than GPipe or 1F1B.

Take the full pipeline's lanes (``simulate.lanes``) and its recorded processing order under 'gpipe'
or '1f1b'. Leave out ``S - 1 - K`` stages of every microbatch, in rotation (microbatch ``b`` leaves
out stages ``1 + (b (S - 1 - K) + r + i) mod (S - 1)``, ``i < S - 1 - K``, for a rotation ``r``):
every stage is then left out by ``floor`` or ``ceil`` of ``n (S - 1 - K) / (S - 1)`` microbatches,
so its visits meet the scheduler's default balance bound ``ceil(n K / (S - 1))``. Delete the
left-out steps from the order and run what remains as a static order (``simulate.replay``).

Claim: when transfer times satisfy the triangle inequality (:func:`triangle_holds`: sending from
``a`` straight to ``c`` is never slower than through ``b``), every remaining step ends no later than
in the full pipeline, so the iteration (all-reduces included: a node's last step ends no later) is
no longer. Proof, by induction over the steps in the full pipeline's start order: a remaining step
``u`` on node ``x`` starts at ``max(ready, free)``. Its input comes from the microbatch's previous
remaining step ``p``, which by induction ends no later than before; in the full pipeline ``u``
started after ``p`` ended plus the transfers and compute of the left-out steps between them, at
least the direct transfer ``xfer[node(p), x]`` by the triangle inequality. ``free`` is the end of the
step before ``u`` in ``x``'s order, which by induction ends no later than before, and before it
ended before ``u`` started. So ``u`` starts no later. The order stays valid (no deadlock): it is a
subsequence of one that ran.

Without the triangle inequality no guarantee is possible: when the links that skip a stage are
slow (stage 0 -> 2 and 1 -> 0 of a 3-stage pipeline), every plan that skips pays for them, while
the full pipeline never crosses them (``tests/skippipe_sim_test.py`` builds such a case).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from acco_jax.skippipe import simulate
from acco_jax.skippipe.topology import Topology


def triangle_holds(topo: Topology, num_bytes: float, rtol: float = 1e-12) -> bool:
  """Whether sending ``num_bytes`` straight from any node to another is no slower than via a third.

  Args:
    topo: the nodes and links.
    num_bytes: the message size (a microbatch's activations).
    rtol: relative slack for rounding.

  Returns:
    True when ``xfer[a, c] <= xfer[a, b] + xfer[b, c]`` for all nodes ``a, b, c``.
  """
  t = topo.transfer_MxM(num_bytes)
  via = np.min(t[:, :, None] + t[None, :, :], axis=1)
  return bool(np.all(t <= via * (1 + rtol)))


def left_out_stages(num_stages: int, num_mb: int, k: int, rotation: int) -> list[set[int]]:
  """Per microbatch, the stages it leaves out of the full pipeline (see the module docstring)."""
  drop = num_stages - 1 - k
  if drop <= 0:
    return [set() for _ in range(num_mb)]
  return [
    {1 + (b * drop + rotation + i) % (num_stages - 1) for i in range(drop)} for b in range(num_mb)
  ]


def lane_routes(full: Sequence[simulate.Route], left_out: Sequence[set[int]]):
  """The full pipeline's routes with each microbatch's ``left_out`` stages removed."""
  out = []
  for r, gone in zip(full, left_out, strict=True):
    keep = [(s, y) for s, y in zip(r.path, r.nodes, strict=True) if s not in gone]
    out.append(simulate.Route(r.origin, tuple(s for s, _ in keep), tuple(y for _, y in keep)))
  return out


def _step_map(full_len: int, kept: Sequence[bool]) -> list[int | None]:
  """Step ``j`` of a full route -> its step in the route that keeps ``kept`` hops (None: removed);
  steps numbered as in :mod:`acco_jax.skippipe.simulate`."""
  k = sum(kept)
  rank, r = [], 0
  for keep in kept:
    rank.append(r if keep else None)
    r += keep
  out: list[int | None] = [0]
  out += [None if rank[i] is None else 1 + rank[i] for i in range(full_len)]
  out.append(k + 1)
  out += [None if rank[i] is None else 2 * k + 1 - rank[i] for i in range(full_len - 1, -1, -1)]
  out.append(2 * k + 2)
  return out


def order_without(
  full: Sequence[simulate.Route], order, left_out: Sequence[set[int]]
) -> tuple[tuple[tuple[int, int], ...], ...]:
  """A full pipeline's per-node ``order`` with the left-out steps deleted, renumbered for the
  routes of :func:`lane_routes`."""
  maps = [
    _step_map(len(r.path), [s not in gone for s in r.path])
    for r, gone in zip(full, left_out, strict=True)
  ]
  return tuple(
    tuple((b, maps[b][j]) for b, j in steps if maps[b][j] is not None) for steps in order
  )
