"""Reading a step's jaxpr: which collectives it holds, and whether they can overlap its loops.

:func:`dataflow_report` walks the step's jaxpr (through ``jit`` and ``shard_map``) and tells whether
any reduce-scatter, all-to-all or all-gather depends on a loop's output or feeds a loop's input,
whether a collective sits inside a loop, and lists all-reduces (``psum``) of large values, i.e. the
implicit gradient all-reduce that makes a step DDP. It reads the program as written, before XLA
schedules it; :mod:`acco_jax.analysis.hlo` reads the compiled program.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from acco_jax.analysis.hlo import Collective

COLLECTIVES = (
  "psum",
  "psum_invariant",
  "reduce_scatter",
  "all_gather",
  "all_gather_invariant",
  "ppermute",
  "all_to_all",
  "pmax",
  "pmin",
)
DATA_MOVERS = ("reduce_scatter", "all_gather", "all_gather_invariant", "all_to_all")
LOOPS = ("while", "scan")


class DataflowReport(NamedTuple):
  """Facts about a step's jaxpr.

  Attributes:
    loops: number of loops (``while``/``scan``) outside other loops (with ``loops_with``, those
      whose body holds that primitive).
    (``optimization_barrier`` is treated as what it is, an identity on each operand.)
    collectives: every collective, with ``in_loop`` set for those inside a loop body.
    loop_feeds_comm: some reduce-scatter/all-gather/large psum depends on a loop output (no overlap).
    comm_feeds_loop: some loop input depends on a reduce-scatter/all-gather/large psum output.
    large_psums: psum collectives over more than ``psum_limit`` elements (gradient all-reduces).
  """

  loops: int
  collectives: tuple[Collective, ...]
  loop_feeds_comm: bool
  comm_feeds_loop: bool
  large_psums: tuple[Collective, ...]

  @property
  def collectives_in_loop(self) -> tuple[Collective, ...]:
    return tuple(c for c in self.collectives if c.in_loop)

  @property
  def overlappable(self) -> bool:
    """The communication is independent of the loop, in both directions, and the loop is clean."""
    return (
      self.loops > 0
      and not self.loop_feeds_comm
      and not self.comm_feeds_loop
      and not self.collectives_in_loop
    )


def _is_var(v) -> bool:
  return not hasattr(v, "val")  # Literals carry .val


def _sub_jaxprs(eqn) -> list:
  out = []
  for value in eqn.params.values():
    items = value if isinstance(value, tuple | list) else (value,)
    for item in items:
      inner = getattr(item, "jaxpr", None)
      if hasattr(item, "eqns"):
        out.append(item)
      elif inner is not None and hasattr(inner, "eqns"):
        out.append(inner)
  return out


def _nbytes(aval) -> int:
  return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _collect(jaxpr, in_loop: bool, found: list):
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in COLLECTIVES:
      for v in eqn.invars:
        found.append(Collective(name, tuple(v.aval.shape), _nbytes(v.aval), in_loop))
    for sub in _sub_jaxprs(eqn):
      _collect(sub, in_loop or name in LOOPS, found)


def _over(eqn, axis: str | None) -> bool:
  """Whether a collective runs over ``axis`` (every collective when ``axis`` is None)."""
  if axis is None:
    return True
  names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
  names = names if isinstance(names, tuple | list) else (names,)
  return axis in names


def _holds(jaxpr, primitive: str) -> bool:
  """Whether ``jaxpr`` or one of its sub-jaxprs holds an equation of ``primitive``."""
  return any(
    eqn.primitive.name == primitive or any(_holds(sub, primitive) for sub in _sub_jaxprs(eqn))
    for eqn in jaxpr.eqns
  )


def dataflow_report(
  closed_jaxpr, *, psum_limit: int = 64, axis: str | None = None, loops_with: str | None = None
) -> DataflowReport:
  """Analyses ``jax.make_jaxpr(step)(...)`` (see :class:`DataflowReport`).

  ``jit``/``shard_map``/call sub-jaxprs are inlined (their variables are aliased to the outer ones),
  loops are single nodes, and every variable carries the set of loops and data-moving collectives it
  depends on. ``axis``: only collectives over that mesh axis count for ``loop_feeds_comm`` and
  ``comm_feeds_loop`` (e.g. the workers' ``replica`` axis, leaving a loop's own data-axis
  collectives out). ``loops_with``: only loops whose body holds that primitive count as loops (in
  ``loops`` and both dependence flags), e.g. ``dot_general`` for a model's inner steps; any other
  loop (SparseLoCo's decode, adding the gathered sparse rows one worker at a time) is then an
  opaque node that passes its inputs' dependences on.
  """
  deps: dict = {}  # var -> frozenset of node tags it depends on
  state = {"loops": 0, "loop_feeds": False, "comm_feeds": False}
  collectives: list[Collective] = []

  def dep(v):
    return deps.get(v, frozenset()) if _is_var(v) else frozenset()

  def walk(jaxpr, alias_in):
    for var, tags in alias_in:
      deps[var] = tags
    for i, eqn in enumerate(jaxpr.eqns):
      name = eqn.primitive.name
      ins = frozenset().union(*(dep(v) for v in eqn.invars)) if eqn.invars else frozenset()
      subs = _sub_jaxprs(eqn)
      if name == "optimization_barrier":  # identity per operand: orders, moves no data
        for iv, ov in zip(eqn.invars, eqn.outvars, strict=True):
          deps[ov] = dep(iv)
        continue
      if name in LOOPS:
        for sub in subs:
          _collect(sub, True, collectives)
        out = ins
        if loops_with is None or any(_holds(sub, loops_with) for sub in subs):
          state["loops"] += 1
          if any(t[0] == "comm" for t in ins):
            state["comm_feeds"] = True
          out = ins | {("loop", id(eqn), i)}
      elif name in COLLECTIVES:
        for v in eqn.invars:
          collectives.append(Collective(name, tuple(v.aval.shape), _nbytes(v.aval), False))
        big = name.startswith("psum") and any(
          int(np.prod(v.aval.shape)) > psum_limit for v in eqn.invars
        )
        if (name in DATA_MOVERS or big) and _over(eqn, axis):
          if any(t[0] == "loop" for t in ins):
            state["loop_feeds"] = True
          out = ins | {("comm", id(eqn), i)}
        else:
          out = ins
      elif (
        len(subs) == 1
        and len(subs[0].invars) == len(eqn.invars)
        and len(subs[0].outvars) == len(eqn.outvars)
      ):
        sub = subs[0]
        walk(sub, [(iv, dep(ov)) for iv, ov in zip(sub.invars, eqn.invars, strict=True)])
        for ov, iv in zip(eqn.outvars, sub.outvars, strict=True):
          deps[ov] = dep(iv)
        continue
      else:  # cond, custom rules, ...: opaque node
        for sub in subs:
          _collect(sub, False, collectives)
        out = ins
      for v in eqn.outvars:
        deps[v] = out

  jaxpr = closed_jaxpr.jaxpr if hasattr(closed_jaxpr, "jaxpr") else closed_jaxpr
  walk(jaxpr, [])
  large = tuple(
    c for c in collectives if c.kind.startswith("psum") and int(np.prod(c.shape)) > psum_limit
  )
  return DataflowReport(
    state["loops"], tuple(collectives), state["loop_feeds"], state["comm_feeds"], large
  )
