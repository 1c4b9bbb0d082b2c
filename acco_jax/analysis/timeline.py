"""What each node of a pipeline does and when: intervals from the simulator, and a picture of them.

:func:`node_intervals` turns one simulated iteration (``simulate.SimResult``: start and end of each
step of each microbatch, steps numbered as in :mod:`acco_jax.skippipe.simulate`) into per-node
intervals of forward, backward and head steps, and each stage's gradient all-reduce (which starts
when the stage's last node is done and lasts ``simulate.ring_allreduce_s``). :func:`plot_timelines`
draws them, one row per node and one panel per schedule; it imports matplotlib when called, so a
notebook or a benchmark can import this module without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from acco_jax.skippipe import simulate
from acco_jax.skippipe.topology import Topology

COLORS = {"F": "#4c72b0", "B": "#dd8452", "H": "#55a868", "allreduce": "#8172b3"}
LABELS = {"F": "forward", "B": "backward", "H": "head + loss", "allreduce": "stage all-reduce"}


class Interval(NamedTuple):
  """One busy interval of a node: ``kind`` is 'F', 'B', 'H' or 'allreduce'; ``mb`` the microbatch
  (-1 for an all-reduce)."""

  node: int
  start: float
  end: float
  kind: str
  mb: int


def step_kind(step: int, k: int) -> str:
  """'F', 'H' or 'B' for step ``step`` of a route visiting ``k`` stages after stage 0."""
  return "F" if step <= k else "H" if step == k + 1 else "B"


def step_node(route: simulate.Route, step: int) -> int:
  """The node that runs step ``step`` of ``route``."""
  k = len(route.path)
  hops = (route.origin, *route.nodes)
  if step <= k:
    return hops[step]
  return route.origin if step in (k + 1, 2 * k + 2) else hops[2 * k + 2 - step]


def node_intervals(
  topo: Topology,
  costs: simulate.Costs,
  routes: Sequence[simulate.Route],
  result: simulate.SimResult,
  partition: Sequence[Sequence[int]] | None = None,
) -> list[Interval]:
  """Every node's busy intervals in one simulated or replayed iteration.

  Args:
    topo, costs: the network and costs the iteration was simulated with.
    routes: its routes (``Plan.routes()``).
    result: ``simulate.simulate`` or ``simulate.replay`` of those routes.
    partition: the nodes of each stage; with it and ``costs.grad_bytes_S``, each stage's
      all-reduce is an interval on each of its nodes.

  Returns:
    The intervals, steps first, all-reduces last.
  """
  out, last = [], [0.0] * topo.num_nodes
  for b, r in enumerate(routes):
    k = len(r.path)
    for j in range(2 * k + 3):
      x = step_node(r, j)
      t0, t1 = float(result.start[b][j]), float(result.end[b][j])
      out.append(Interval(x, t0, t1, step_kind(j, k), b))
      last[x] = max(last[x], t1)
  if partition is not None and costs.grad_bytes_S is not None:
    for s, nodes in enumerate(partition):
      t0 = max(last[x] for x in nodes)
      dur = simulate.ring_allreduce_s(topo, nodes, costs.grad_bytes_S[s])
      out += [Interval(x, t0, t0 + dur, "allreduce", -1) for x in nodes if dur > 0]
  return out


def plot_timelines(panels, partition: Sequence[Sequence[int]], path: str, title: str = "") -> None:
  """Draws one panel per schedule, a row per node (grouped by stage), into ``path``.

  Args:
    panels: ``(name, intervals, makespan)`` per schedule; idle time is the gaps up to the makespan.
    partition: the nodes of each stage (the rows' order and labels).
    path: the image file to write (a .png).
    title: the figure's title.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [(s, x) for s, nodes in enumerate(partition) for x in nodes]
  row_of = {x: i for i, (_, x) in enumerate(rows)}
  fig, axes = plt.subplots(
    len(panels), 1, figsize=(11, 1.2 + 0.22 * len(rows) * len(panels)), sharex=True, squeeze=False
  )
  for ax, (name, intervals, makespan) in zip(axes[:, 0], panels, strict=True):
    ax.barh(range(len(rows)), makespan, left=0, height=0.8, color="#eeeeee")  # idle
    for kind, color in COLORS.items():
      bars = [iv for iv in intervals if iv.kind == kind]
      ax.barh(
        [row_of[iv.node] for iv in bars],
        [iv.end - iv.start for iv in bars],
        left=[iv.start for iv in bars],
        height=0.8,
        color=color,
        edgecolor="white",
        linewidth=0.3,
        label=LABELS[kind],
      )
    ax.set_yticks(range(len(rows)), [f"s{s} n{x}" for s, x in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_title(f"{name}: {makespan:.2f} s", fontsize=9, loc="left")
  axes[-1, 0].set_xlabel("seconds into the iteration")
  handles, labels = axes[0, 0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
  if title:
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
  fig.tight_layout(rect=(0, 0.03, 1, 0.97))
  fig.savefig(path, dpi=110)
  plt.close(fig)
