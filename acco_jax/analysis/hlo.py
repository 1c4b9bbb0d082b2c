"""Reading a compiled step: its collectives, its async schedule (on GPU) and its loops.

* :func:`hlo_collectives` lists the collectives of compiled HLO text with their bytes and whether they
  run inside a ``while`` body.
* :func:`async_overlap_report` reads a *scheduled* GPU module: for each async collective it finds the
  start and done instructions and whether a ``while`` (the microbatch loop) lies between them, and
  whether XLA marked the pair synchronous. CPU HLO has no async collectives (XLA:CPU runs them
  synchronously), so that check only means something on GPU.
* :func:`while_loops` lists the loops with the trip counts XLA knows for them.

Its kernels (GEMMs with their operand dtypes, fusions with the bytes they move):
:mod:`acco_jax.analysis.kernels`.

The same claims read off the program before compilation: :mod:`acco_jax.analysis.dataflow`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np


class Collective(NamedTuple):
  """One collective of a jaxpr (:mod:`acco_jax.analysis.dataflow`) or of compiled HLO text."""

  kind: str  # jaxpr primitive or HLO opcode
  shape: tuple  # operand shape (jaxpr) / result shapes as (dtype, dims) (HLO)
  bytes: int  # bytes of the full buffer: operand (jaxpr, HLO reduce-scatter), result (HLO others)
  in_loop: bool
  # HLO only: the device groups (replica_groups), or the (source, target) pairs of a
  # collective-permute; () when not parsed
  groups: tuple = ()
  group: int = 0  # devices per replica group (HLO; 0 in jaxpr reports)


_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
HLO_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    total += n * _DTYPE_BYTES.get(dtype, 4)
  return total


class Instr(NamedTuple):
  name: str
  shape: str
  opcode: str
  rest: str


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str | None]:
  """Splits HLO text into ``{computation: [instructions in printed order]}`` and the entry's name."""
  comps: dict[str, list[Instr]] = {}
  entry, current = None, None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m and not line[:1].isspace() and "->" in line:
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    if current is not None:
      mi = _INSTR.match(line)
      if mi:
        comps[current].append(Instr(*mi.groups()))
  return comps, entry


def _loop_computations(comps: dict[str, list[Instr]]) -> set[str]:
  """Computations run inside a ``while`` (bodies, conditions and everything they call)."""
  names = set(comps)
  refs = {
    c: {r for r in re.findall(r"%?([\w.\-]+)", " ".join(i.rest for i in ins)) if r in names}
    for c, ins in comps.items()
  }
  roots = set()
  for ins in comps.values():
    for i in ins:
      if i.opcode == "while":
        roots |= {r for r in re.findall(r"(?:body|condition)=%?([\w.\-]+)", i.rest)}
  seen, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    todo.extend(refs[c])
  return seen


def _group_size(attrs: str) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[\d+,(\d+)\]", attrs)  # iota form [groups,size]<=[n]
  return int(m.group(1)) if m else 1


def replica_groups(attrs: str) -> tuple[tuple[int, ...], ...]:
  """The device groups of a collective's attributes, in any of XLA's spellings: explicit
  ``{{0,1},{2,3}}``, iota ``[2,4]<=[4,2]T(1,0)``, mesh axes ``mesh['a'=4,'b'=2] {'b'}``; for a
  collective-permute, its ``source_target_pairs``. ``()`` if none is found."""
  m = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,{}]*\})\}", attrs)
  if m:
    return tuple(
      tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", m.group(1))
    )
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return tuple(tuple(int(x) for x in g) for g in ids.reshape(int(m.group(1)), int(m.group(2))))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, dims = [a for a, _ in axes], [int(d) for _, d in axes]
    chosen = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(2))]
    rest = [i for i in range(len(dims)) if i not in chosen]
    ids = np.arange(int(np.prod(dims))).reshape(dims).transpose(rest + chosen)
    size = int(np.prod([dims[i] for i in chosen]))
    return tuple(tuple(int(x) for x in g) for g in ids.reshape(-1, size))
  return ()


def crosses(c: Collective, group_of) -> bool:
  """Whether collective ``c`` moves data between devices of different groups, ``group_of(device
  id)`` (e.g. ``lambda i: i // D`` for the workers of a ``(replica, data)`` mesh)."""
  return any(len({group_of(i) for i in g}) > 1 for g in c.groups)


def bytes_across(text: str, per_group: int, kinds=("all-reduce",)) -> int:
  """Bytes (as :func:`hlo_collectives` counts them) of the collectives of ``kinds`` in compiled HLO
  ``text`` whose device groups join devices of different blocks of ``per_group`` consecutive ids
  (e.g. the workers of a ``(replica, data)`` mesh)."""
  group_of = lambda i: i // per_group
  return sum(c.bytes for c in hlo_collectives(text) if c.kind in kinds and crosses(c, group_of))


def hlo_collectives(text: str) -> list[Collective]:
  """Collectives in compiled HLO text: opcode (without -start/-done), result shape, bytes, in a loop,
  and the device groups.

  Async pairs are counted once (at the start, or at the op wrapped by an ``async-start``).
  """
  comps, _ = parse_hlo(text)
  in_loop = _loop_computations(comps)
  out = []
  for comp, instrs in comps.items():
    for i in instrs:
      op = i.opcode.removesuffix("-start")
      if op in HLO_COLLECTIVES and not i.opcode.endswith("-done"):
        shapes = _SHAPE.findall(i.shape)
        # an all-gather/collective-permute start is (operand, result, ...): keep the result; an
        # all-reduce start is its results (a tuple when XLA combined several)
        if i.opcode.endswith("-start") and op != "all-reduce" and len(shapes) > 1:
          shapes = shapes[1:2] if op == "collective-permute" else shapes[-1:]
        nbytes = _shape_bytes(" ".join(f"{d}[{s}]" for d, s in shapes))
        group = _group_size(i.rest)
        if op == "reduce-scatter":  # the operand is group-size times the result
          nbytes *= group
        out.append(
          Collective(op, tuple(shapes), nbytes, comp in in_loop, replica_groups(i.rest), group)
        )
  return out


def count_collectives(cs: Iterable[Collective], kind: str, *, min_bytes: int = 0) -> int:
  return sum(1 for c in cs if c.kind == kind and c.bytes >= min_bytes)


class AsyncPair(NamedTuple):
  kind: str  # collective opcode (reduce-scatter, all-gather, ...)
  start: int  # index of the start instruction in the entry computation's schedule
  done: int  # index of the done instruction
  brackets_loop: bool  # a while op lies strictly between start and done
  is_sync: bool  # XLA marked the pair synchronous
  bytes: int


def async_overlap_report(text: str) -> list[AsyncPair]:
  """Async collective pairs of a scheduled (GPU) module's entry computation, in schedule order."""
  comps, entry = parse_hlo(text)
  if entry is None:
    return []
  instrs = comps[entry]
  whiles = [k for k, i in enumerate(instrs) if i.opcode == "while"]
  pairs = []
  for k, ins in enumerate(instrs):
    if not ins.opcode.endswith("-start"):
      continue
    kind = ins.opcode.removesuffix("-start")
    if kind in ("async", "call"):
      called = re.findall(r"calls=%?([\w.\-]+)", ins.rest)
      wrapped = [i.opcode for c in called for i in comps.get(c, [])]
      kinds = [op for op in wrapped if op in HLO_COLLECTIVES]
      if not kinds:
        continue
      kind = kinds[0]
    elif kind not in HLO_COLLECTIVES:
      continue
    done = next(
      (
        j
        for j in range(k + 1, len(instrs))
        if instrs[j].opcode.endswith("-done")
        and re.search(rf"%?{re.escape(ins.name)}\b", instrs[j].rest)
      ),
      None,
    )
    if done is None:
      continue
    pairs.append(
      AsyncPair(
        kind,
        k,
        done,
        any(k < w < done for w in whiles),
        '"is_sync":true' in ins.rest.replace(" ", ""),
        _shape_bytes(ins.shape),
      )
    )
  return pairs


# -- loops: what XLA knows of their trip counts ---------------------------------------------------


class WhileLoop(NamedTuple):
  computation: str  # where the ``while`` sits
  name: str
  trip_count: int | None  # XLA's ``known_trip_count``, ``None`` when it has none
  body: str  # the body computation's name


def while_loops(text: str) -> list[WhileLoop]:
  """Every ``while`` of compiled HLO text with the trip count XLA knows for it.

  On XLA:GPU a loop without a known trip count is steered from the host: the GPU copies its
  predicate to the host after every iteration, and the host's call returns only after the loop.
  """
  comps, _ = parse_hlo(text)
  out = []
  for comp, instrs in comps.items():
    for i in instrs:
      if i.opcode != "while":
        continue
      n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', i.rest)
      body = re.search(r"body=%?([\w.\-]+)", i.rest)
      out.append(
        WhileLoop(comp, i.name, int(n.group(1)) if n else None, body.group(1) if body else "")
      )
  return out
