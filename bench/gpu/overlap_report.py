"""What a compiled stage's scheduled entry computation shows (``bench/gpu/overlap_gpu.py``): the
async pairs of its flat collectives and the verdict (:func:`schedule_report`), and which of the
collectives and the microbatch loop depend on which (:func:`chain_facts`)."""

from __future__ import annotations

import re


def chain_facts(text: str) -> dict:
  """In a compiled module's entry: does the all-gather depend on the reduce-scatter, or the loop?"""
  from acco_jax.analysis import hlo

  comps, entry = hlo.parse_hlo(text)
  instrs = comps[entry]
  names = {i.name for i in instrs}
  ops = {i.name: [r for r in re.findall(r"%([\w.\-]+)", i.rest) if r in names] for i in instrs}

  def reaches(src: str, dst: str) -> bool:
    todo, seen = [dst], set()
    while todo:
      x = todo.pop()
      if x == src:
        return True
      if x not in seen:
        seen.add(x)
        todo.extend(ops.get(x, []))
    return False

  def first(pred):
    return next((i.name for i in instrs if pred(i)), None)

  # the gradients' reduction: reduce-scatter, or with quantization the all-to-all
  kind = (
    "all-to-all" if any(i.opcode.startswith("all-to-all") for i in instrs) else "reduce-scatter"
  )
  rs = first(lambda i: i.opcode == kind)  # synchronous (CPU) form
  ag = first(lambda i: i.opcode == "all-gather")
  pairs = {}  # async (GPU) form: the largest pair of each kind; reduce-scatter done -> all-gather start
  for p in hlo.async_overlap_report(text):
    if p.bytes >= pairs.get(p.kind, p).bytes:
      pairs[p.kind] = p
  if kind in pairs:
    rs = instrs[pairs[kind].done].name
  if "all-gather" in pairs:
    ag = instrs[pairs["all-gather"].start].name
  loop = first(lambda i: i.opcode == "while")
  return {
    "all_gather_depends_on_reduce_scatter": bool(rs and ag and reaches(rs, ag)),
    "loop_depends_on_collectives": bool(loop and any(reaches(c, loop) for c in (rs, ag) if c)),
    "collectives_depend_on_loop": bool(loop and any(reaches(loop, c) for c in (rs, ag) if c)),
    "entry_whiles": sum(i.opcode == "while" for i in instrs),
  }


def schedule_report(text: str) -> dict:
  """The async pairs of the flat reduce-scatter (or, quantized, all-to-all) and all-gather, the
  verdict and an excerpt. With nodes the quantized reduction is a reduce-scatter inside each node
  (its own fast links, before loop A by design) then the all-to-all across nodes: the verdict is
  about the all-to-all and the all-gather, the collectives that cross the network."""
  from acco_jax.analysis import hlo

  comps, entry = hlo.parse_hlo(text)
  instrs = comps[entry]
  pairs = hlo.async_overlap_report(text)
  whiles = [i for i, x in enumerate(instrs) if x.opcode == "while"]
  big = {}
  for p in pairs:
    kinds = ("reduce-scatter", "all-to-all", "all-gather")
    if p.kind in kinds and p.bytes >= big.get(p.kind, p).bytes:
      big[p.kind] = p
  reduce = "all-to-all" if "all-to-all" in big else "reduce-scatter"
  bracketing = [k for k in (reduce, "all-gather") if k in big]
  bracketing = [k for k in bracketing if big[k].brackets_loop and not big[k].is_sync]
  verdict = "full" if len(bracketing) == 2 else "partial" if bracketing else "none"
  marks = {p.start for p in big.values()} | {p.done for p in big.values()} | set(whiles)
  excerpt = []
  for i, x in enumerate(instrs):
    if i in marks or any(abs(i - m) <= 1 for m in marks):
      excerpt.append(f"{i:5d}  %{x.name} = {x.shape[:60]} {x.opcode}({x.rest[:160]}")
  return {
    "entry_instructions": len(instrs),
    "whiles": whiles,
    "pairs": [p._asdict() for p in pairs],
    "flat_pairs": {k: p._asdict() for k, p in big.items()},
    "bracketing": bracketing,
    "verdict": verdict,
    "excerpt": excerpt,
    "chain": chain_facts(text),
  }
