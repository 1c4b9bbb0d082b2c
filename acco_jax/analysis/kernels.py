"""Reading a compiled step's kernels: its GEMMs with their operand dtypes, and its fusions with the
bytes each moves and how often it runs (on the instructions :mod:`acco_jax.analysis.hlo` parses).

* :func:`gemms` lists the GEMMs: ``dot`` instructions (also inside Triton GEMM fusions) and cuBLAS
  custom calls, with their operands' shapes.
* :func:`fusion_traffic` lists the fusions with the bytes each reads and writes per run, by shapes,
  and its runs per program (the trip counts of the loops around it).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from acco_jax.analysis.hlo import _SHAPE, Instr, _shape_bytes, parse_hlo

# -- fusions: the bytes each moves --------------------------------------------------------------

_SLICING = ("slice", "dynamic-slice", "gather")


class FusionTraffic(NamedTuple):
  computation: str  # where the fusion instruction sits
  name: str
  kind: str  # XLA's fusion kind (kLoop, kInput, kCustom for a GEMM fusion, ...)
  op_name: str  # the JAX operation it came from (metadata), '' if absent
  bytes: int  # read + written per run, by shapes (see :func:`fusion_traffic`)
  runs: int  # runs per program: the trip counts of the loops around it


def _numel(shape: str) -> int:
  found = _SHAPE.search(shape)
  return int(np.prod([int(d) for d in found.group(2).split(",") if d])) if found else 0


def _bytes_taken(param: Instr, users: dict, full: int) -> int:
  """Bytes of ``param`` a fusion reads: all of it, unless every path from it (through views and
  elementwise ops, which keep its element count) ends in slices or gathers: then what they take."""
  size, taken, todo = _numel(param.shape), 0, [param.name]
  while todo:
    name = todo.pop()
    if name != param.name and not users.get(name):
      return full  # a view or elementwise op of all of it is the root: the result reads it all
    for u in users.get(name, []):
      if u.opcode in _SLICING:
        taken += full * _numel(u.shape) // max(size, 1)
      elif _numel(u.shape) == size and not u.shape.startswith("("):
        todo.append(u.name)  # a view or an elementwise op: follow it
      else:
        return full
  return taken


def _fused_bytes(comp: list[Instr], shapes: dict) -> int:
  """Bytes a fused computation reads and writes: each parameter whole, or only what the slices or
  gathers that read it (directly, or through views and elementwise ops) take; the root's result, or only the update of an in-place
  ``dynamic-update-slice`` root (its buffer is the output's, not read)."""
  users: dict[str, list[Instr]] = {}
  for i in comp:
    for op in _operand_names(i.rest):
      users.setdefault(op, []).append(i)
  root = comp[-1]
  in_place = root.opcode == "dynamic-update-slice"
  aliased = _operand_names(root.rest)[0] if in_place else None
  read = 0
  for i in comp:
    if i.opcode != "parameter" or i.name == aliased:
      continue
    full = _shape_bytes(re.sub(r"\{[^}]*\}", "", i.shape))
    read += min(full, _bytes_taken(i, users, full))
  if in_place:
    update = _operand_names(root.rest)[1]
    written = _shape_bytes(re.sub(r"\{[^}]*\}", "", shapes.get(update, "")))
  else:
    written = _shape_bytes(re.sub(r"\{[^}]*\}", "", root.shape))
  return read + written


def fusion_traffic(text: str, unknown_trips: int = 1) -> list[FusionTraffic]:
  """The fusions of compiled HLO text with the bytes each reads and writes per run and how often
  it runs per program (``while`` trip counts multiply; a loop without a known trip count counts
  ``unknown_trips``). Bytes come from shapes, not a profile: a fusion that reads a slice of a
  parameter counts the slice, an in-place update its update; caches and recomputation are not
  modelled, so ``bytes / bandwidth`` is a lower bound of a memory-bound fusion's time, good for
  comparing two compiles of one program."""
  comps, entry = parse_hlo(text)
  runs = {entry: 1}
  todo = [entry]
  while todo:  # computations reachable through whiles and calls, with their run counts
    c = todo.pop()
    for i in comps.get(c, []):
      called = re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)", i.rest)
      if i.opcode == "fusion" or not called:
        continue
      n = 1
      if i.opcode == "while":
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', i.rest)
        n = int(m.group(1)) if m else unknown_trips
      for callee in called:
        if callee in comps and callee not in runs:
          runs[callee] = runs[c] * n
          todo.append(callee)
  out = []
  for c, n in runs.items():
    for i in comps.get(c, []):
      if i.opcode != "fusion":
        continue
      callee = re.search(r"calls=%?([\w.\-]+)", i.rest).group(1)
      kind = re.search(r"kind=(\w+)", i.rest)
      op_name = re.search(r'op_name="([^"]*)"', i.rest)
      fused = comps.get(callee, [])
      out.append(
        FusionTraffic(
          c,
          i.name,
          kind.group(1) if kind else "",
          op_name.group(1) if op_name else "",
          _fused_bytes(fused, {x.name: x.shape for x in fused}) if fused else 0,
          n,
        )
      )
  return out


# -- GEMMs and their operand dtypes ---------------------------------------------------------------

GEMM_CUSTOM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


class Gemm(NamedTuple):
  computation: str  # where the instruction sits (a fused computation for a Triton GEMM fusion)
  name: str
  kind: str  # 'dot' or the cuBLAS custom-call target
  operands: tuple[str, ...]  # operand shapes, e.g. ('bf16[256,64]', 'bf16[64,1024]')
  result: str  # result shape (the first one for a tuple-shaped custom call)
  op_name: str  # the JAX operation it came from (metadata), '' if absent

  @property
  def dtypes(self) -> tuple[str, ...]:
    return tuple(s.split("[")[0] for s in self.operands)


def _operand_names(rest: str) -> list[str]:
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):  # the operand list ends at the parenthesis that closes it
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", rest[:end])


def gemms(text: str) -> list[Gemm]:
  """Every matrix multiply of compiled HLO text: ``dot`` instructions (also those inside Triton
  GEMM fusions) and cuBLAS GEMM custom calls, with their operands' shapes looked up by name."""
  comps, _ = parse_hlo(text)
  out = []
  for comp, instrs in comps.items():
    shapes = {i.name: i.shape for i in instrs}
    for i in instrs:
      target = re.search(r'custom_call_target="([^"]+)"', i.rest)
      kind = "dot" if i.opcode == "dot" else target.group(1) if target else ""
      if kind != "dot" and kind not in GEMM_CUSTOM_CALLS:
        continue
      names = _operand_names(i.rest)[: 2 if kind == "dot" else None]
      found = [_SHAPE.search(shapes.get(n, "")) for n in names]
      operands = tuple(f"{m.group(1)}[{m.group(2)}]" for m in found if m)[:2]
      result = _SHAPE.search(i.shape)
      op_name = re.search(r'op_name="([^"]*)"', i.rest)
      out.append(
        Gemm(
          comp,
          i.name,
          kind,
          operands,
          f"{result.group(1)}[{result.group(2)}]" if result else "",
          op_name.group(1) if op_name else "",
        )
      )
  return out
