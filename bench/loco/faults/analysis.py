"""From the rows each arm's workers logged: updates per minute before, during and after the fault,
final losses, rounds and their members, and the loss of the fault-free run at equal tokens."""

from __future__ import annotations

import collections
import statistics

from bench.loco.faults.watch import summaries, timeline

SMOOTH = 20  # rows averaged for a loss


def rate(rows: list[dict], lo: float, hi: float) -> float | None:
  """Stages completed per minute within [lo, hi)."""
  if hi is None or lo is None or hi - lo < 1:
    return None
  n = sum(lo <= r["t"] < hi for r in rows)
  return 60 * n / (hi - lo)


def thin(points: list, at_most: int = 400) -> list:
  """Every k-th point (and the last) so that at most about ``at_most`` remain."""
  k = max(1, -(-len(points) // at_most))
  return points[::k] + ([points[-1]] if points and (len(points) - 1) % k else [])


def smoothed(rows: list[dict], upto: int | None = None) -> float | None:
  """Mean loss over the last SMOOTH rows (at or before stage ``upto``)."""
  picked = [r["loss"] for r in rows if upto is None or r["stage"] <= upto]
  return statistics.fmean(picked[-SMOOTH:]) if picked else None


def mean_of(values):
  values = [v for v in values if v is not None]
  return statistics.fmean(values) if values else None


def fault_end(arm: str, fault: dict, lines: dict[str, list[dict]]) -> float | None:
  """When the fault ended: as recorded, or else the victim's (SPMD: the restarted job's) first
  row after it; records the SPMD job's stages done again (``lost_stages``)."""
  t_fault, end = fault.get("t"), fault.get("end")
  if end is not None or t_fault is None:
    return end
  target = fault["victim"] if arm == "store" else "job"
  since = fault.get("restarted", t_fault)
  later = [r for r in lines.get(target, []) if r["t"] > since]
  if arm == "spmd" and later:
    before = [r["stage"] for r in lines["job"] if r["t"] <= since]
    fault["lost_stages"] = max(before) - (later[0]["stage"] - 1)
  return later[0]["t"] if later else None


def window(arm: str, fault: dict, lines: dict[str, list[dict]]) -> dict:
  """The times the rates are counted between: ``begin`` (every first launch past its compile),
  ``fault``, ``end``, ``finish`` (the first survivor's last row), and ``t0`` (the first row)."""
  t_fault = fault.get("t")
  end = fault_end(arm, fault, lines)
  started = (t_fault or float("inf")) - 1
  starts = [rows[1]["t"] for rows in lines.values() if len(rows) > 1 and rows[0]["t"] < started]
  victim = fault["victim"] if arm == "store" else None
  finish = [rows[-1]["t"] for n, rows in lines.items() if rows and n != victim]
  return {
    "begin": max(starts) if starts else None,
    "fault": t_fault,
    "end": end,
    "finish": min(finish) if finish else None,
    "t0": min((rows[0]["t"] for rows in lines.values() if rows), default=0.0),
  }


def worker_summary(rows: list[dict], seen: list, w: dict) -> dict:
  """One worker's (or the SPMD job's) rates, losses, last stage, tokens and thinned trace."""
  t_begin, t_fault, end, t_finish = w["begin"], w["fault"], w["end"], w["finish"]
  return {
    "before": rate(rows, t_begin, t_fault) if t_fault else rate(rows, t_begin, t_finish),
    "during": rate(rows, t_fault, end) if t_fault else None,
    "after": rate(rows, end, t_finish) if t_fault and end else None,
    "final_loss": smoothed(rows),
    "stages": rows[-1]["stage"] if rows else 0,
    "tokens": rows[-1]["tokens_seen"] if rows else 0,
    "eval_loss": ([s["eval_loss"] for s in summaries(seen)][-1:] or [None])[0],
    "trace": thin([[round(r["t"] - w["t0"], 2), r["stage"], round(r["loss"], 4)] for r in rows]),
  }


def analyse(arm: str, scenario: str, res: dict, args, reference: dict | None) -> dict:
  """One scenario's result: its window, every worker's summary, the survivors' means, the rounds
  (store) and the loss at equal tokens (against ``reference``, the arm's fault-free run)."""
  fault, seen = res["fault"], res["seen"]
  lines = {n: timeline(s) for n, s in seen.items()}
  w = window(arm, fault, lines)
  workers = {n: worker_summary(rows, seen[n], w) for n, rows in lines.items()}
  survivors = [n for n in workers if n != fault["victim"]]
  out = {
    "arm": arm,
    "scenario": scenario,
    "victim": fault["victim"],
    "fault": {k: v for k, v in fault.items() if k != "rounds"},
    "window": w,
    "workers": workers,
  }
  keys = ("before", "during", "after", "final_loss", "eval_loss", "stages")
  out["survivors"] = {k: mean_of([workers[n][k] for n in survivors]) for k in keys}
  if arm == "store":
    out["tokens_all"] = sum(x["tokens"] for x in workers.values())
    out.update(rounds_of(fault.get("rounds", [])))
  else:
    out["tokens_all"] = workers["job"]["tokens"] * args.workers if workers else 0
  if reference is not None:
    out["equal_tokens"] = equal_tokens(out, reference)
  return out


def rounds_of(rounds: list[dict]) -> dict:
  """How many rounds closed, how many had each member count, and every round's record."""
  sizes = collections.Counter(len(r["members"]) for r in rounds if r.get("members") is not None)
  return {
    "rounds": {"closed": len(rounds), "members": dict(sorted(sizes.items()))},
    "rounds_detail": rounds,
  }


def equal_tokens(out: dict, reference: dict) -> dict:
  """This run's final loss against the fault-free run's at the same tokens summed over workers."""
  per_stage = reference["tokens_per_stage_all"]
  stage = int(out["tokens_all"] / per_stage) if per_stage else None
  ref = mean_of([smoothed(rows, stage) for rows in reference["lines"].values()])
  return {"reference_stage": stage, "reference_loss": ref, "loss": out["survivors"]["final_loss"]}


def reference(lines: dict[str, list[dict]], last: dict[str, tuple[int, int]], workers: int) -> dict:
  """The fault-free run's rows per worker and its tokens a stage summed over workers, from each
  worker's ``last`` (stage, tokens seen); the SPMD job's (``job``) tokens are one worker's."""
  tokens = sum(t for _, t in last.values()) * (workers if "job" in lines else 1)
  stages = max((s for s, _ in last.values()), default=1)
  return {"lines": lines, "tokens_per_stage_all": tokens / stages}


def reference_of(res: dict, args) -> dict:
  """:func:`reference` of a fault-free run just measured."""
  lines = {n: timeline(s) for n, s in res["seen"].items()}
  last = {n: (rows[-1]["stage"], rows[-1]["tokens_seen"]) for n, rows in lines.items() if rows}
  return reference(lines, last, args.workers)


def fill_equal_tokens(results: list[dict], args) -> None:
  """``equal_tokens`` of results rendered from files whose run had no fault-free reference, from
  the traces of another file's ``none`` of the same arm."""
  for arm in ("store", "spmd"):
    ref = [r for r in results if r["arm"] == arm and r["scenario"] == "none" and "workers" in r]
    if not ref or not all(w.get("trace") for w in ref[0]["workers"].values()):
      continue
    workers = ref[0]["workers"]
    lines = {n: [{"stage": s, "loss": x} for _, s, x in w["trace"]] for n, w in workers.items()}
    last = {n: (w["stages"], w["tokens"]) for n, w in workers.items()}
    traced = reference(lines, last, args.workers)
    for r in results:
      if r["arm"] == arm and r["scenario"] != "none" and "workers" in r:
        if not r.get("equal_tokens"):
          r["equal_tokens"] = equal_tokens(r, traced)
