"""The ``--loco`` part of ``bench/dp/perfmodel.py``: ``loco.outer_overlap`` none vs delayed / eager.

For DiLoCo, Streaming DiLoCo and SparseLoCo (:data:`LOCO_VARIANTS`) at 0.1 .. 400 Gbit/s between
workers, the time per inner step from the recorded accounting of ``bench/results/loco_compare.json``
(``traffic_cost.project``), and the bandwidth below which each stops being compute-bound;
:func:`loco` prints the table and writes ``perfmodel_loco.{json,md}``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

from bench import common
from bench.loco import traffic_cost

LOCO_GBITS = (0.1, 1.0, 10.0, 100.0, 400.0)
# label -> (loco_compare method, H, loco.outer_overlap, tau[, loco.inner]). delayed times like eager:
# both hide a sync's reduction behind the inner steps of the next phase (H, or H/P for P fragments).
# ACCO inside the workers hides their own reduce-scatter and all-gather too: with eager outer
# updates, nothing on the critical path.
LOCO_VARIANTS = {
  "diloco H=15 none": ("diloco", 15, "none", 0),
  "diloco H=15 eager / delayed": ("diloco", 15, "eager", 0),
  "diloco H=15 none, acco inside": ("diloco", 15, "none", 0, "acco"),
  "diloco H=15 eager, acco inside: nothing on the critical path": (
    "diloco",
    15,
    "eager",
    0,
    "acco",
  ),
  "diloco H=50 none": ("diloco", 50, "none", 0),
  "diloco H=50 eager / delayed": ("diloco", 50, "eager", 0),
  "diloco H=50 eager, acco inside: nothing on the critical path": (
    "diloco",
    50,
    "eager",
    0,
    "acco",
  ),
  "streaming_diloco H=50 P=2 none, tau=1": ("streaming_diloco", 50, "none", 1),
  "streaming_diloco H=50 P=2 none, tau=0": ("streaming_diloco", 50, "none", 0),
  "streaming_diloco H=50 P=2 eager / delayed": ("streaming_diloco", 50, "eager", 0),
  "sparseloco H=15 none": ("sparseloco", 15, "none", 0),
  "sparseloco H=15 eager / delayed": ("sparseloco", 15, "eager", 0),
  "sparseloco H=50 none": ("sparseloco", 50, "none", 0),
  "sparseloco H=50 eager / delayed": ("sparseloco", 50, "eager", 0),
}
LOCO_SLACK = 0.1  # "within 10% of compute": the exposed sync time at most this share of a step


def loco_program(programs: dict, method: str, h: int, tau: int) -> dict:
  """The recorded accounting of ``method`` (bench/results/loco_compare.json: bytes per sync of the
  CPU model, scaled to GPT-2 by ``traffic_cost.project``) at ``H = h`` and ``τ = tau``."""
  prog = copy.deepcopy(programs[method])
  prog["accounting"].update(sync_every=h, overlap_steps=tau)
  return prog


def loco_point(label: str, prog: dict, gbit: float) -> dict:
  """Time per inner step at ``gbit`` Gbit/s between workers: total, the inner step's (compute and
  what it waits for its own collectives), the sync's exposed part."""
  method, _, overlap, _, *inner = LOCO_VARIANTS[label]
  p = traffic_cost.project(method, prog, 1.0, gbit, overlap, *inner)
  return {
    "step_s": p["step_s"],
    "exposed_s": p["exposed_s"],
    "inner_s": p["step_s"] - p["exposed_s"],
    "inner_exposed_s": p["inner_exposed_s"],
  }


def loco_below(label: str, prog: dict, slack: float) -> float:
  """The bandwidth (nominal Gbit/s) below which the exposed sync time exceeds ``slack`` x the inner
  step (``slack = 0``: below which a sync is no longer hidden); ``inf`` if it is never within."""
  exceeds = lambda g: (lambda q: q["exposed_s"] > slack * q["inner_s"])(loco_point(label, prog, g))
  lo, hi = 1e-4, 1e6
  if exceeds(hi):
    return math.inf
  for _ in range(200):
    mid = (lo * hi) ** 0.5
    lo, hi = (mid, hi) if exceeds(mid) else (lo, mid)
  return hi


def loco(args) -> int:
  recorded = json.loads((common.RESULTS / "loco_compare.json").read_text())
  a = traffic_cost.PROJECTION
  rows, data = [], {}
  for label, (method, h, overlap, tau, *inner) in LOCO_VARIANTS.items():
    prog = loco_program(recorded["programs"], method, h, tau)
    hidden, slack = loco_below(label, prog, 0.0), loco_below(label, prog, LOCO_SLACK)
    points = {str(g): loco_point(label, prog, g) for g in LOCO_GBITS}
    parts = len(prog["accounting"]["sync_wire"])
    window = tau if overlap == "none" else h // parts
    own = points[str(LOCO_GBITS[0])]["inner_exposed_s"]
    data[label] = {
      "method": method,
      "H": h,
      "outer_overlap": overlap,
      "tau": tau,
      "inner": (inner or ["zero1"])[0],
      "hidden_behind_steps": window,
      "hidden_above_gbit": hidden,
      "within_slack_above_gbit": slack,
      "inner_waits_s": own,
      "points": points,
    }
    gb = lambda g: "never" if not math.isfinite(g) else f"{g:.2f}"
    row = {
      "label": label,
      "window": str(window),
      "hidden": gb(hidden),
      "slack": gb(slack),
      "own": f"{1e3 * own:.1f}",
    }
    for g, q in points.items():
      row[g] = f"{q['step_s'] / q['inner_s']:.2f}"
    rows.append(row)
  first = lambda inner: next(d for d in data.values() if d["inner"] == inner)
  step_ms = lambda inner: 1e3 * first(inner)["points"][str(LOCO_GBITS[0])]["inner_s"]
  head = (
    f"{a['model']} on {a['workers']} workers of {a['gpus_per_worker']} H100 (inner step over "
    f"NVLink: ZeRO-1 {step_ms('zero1'):.1f} ms, ACCO {step_ms('acco'):.1f} ms); a sync: hops x "
    f"{1e6 * a['latency_inter_s']:.0f} us + its bytes at {100 * a['link_efficiency']:.0f}% of "
    "the link between workers"
  )
  columns = [
    ("label", "variant"),
    ("window", "sync hidden behind (inner steps)"),
    ("hidden", "compute-bound above (Gbit/s)"),
    ("slack", f"within {100 * LOCO_SLACK:.0f}% above (Gbit/s)"),
    ("own", "inner step waits for its own collectives (ms)"),
    *((str(g), f"x inner step at {g:g} Gbit/s") for g in LOCO_GBITS),
  ]
  text = common.format_table(rows, columns)
  print(head + "\n\n" + text)
  out = {
    "machine": common.machine(),
    "projection": a,
    "gbit": LOCO_GBITS,
    "slack": LOCO_SLACK,
    "variants": data,
    "table": text,
  }
  path = common.write_json(Path(args.out), out)
  Path(args.out).with_suffix(".md").write_text(text + "\n")
  print(f"\nwrote {path}")
  return 0
