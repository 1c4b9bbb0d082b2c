"""The fault benchmark's outputs for a reader: the table (one row per arm and fault), the notes
that say what happened, and the figure of every worker's progress against time."""

from __future__ import annotations

from pathlib import Path

from bench import common
from bench.loco.faults.plan import SCENARIOS

COLUMNS = [
  ("arm", "arm"),
  ("scenario", "fault"),
  ("before", "upd/min before"),
  ("during", "during"),
  ("after", "after"),
  ("victim", "victim b/d/a"),
  ("stages", "last stage"),
  ("loss", "final loss"),
  ("ref", "fault-free at equal tokens"),
  ("eval", "eval loss"),
  ("rounds", "rounds (members:count)"),
  ("wall", "wall s"),
  ("note", "note"),
]
COLORS = {"w0": "tab:blue", "w1": "tab:orange", "w2": "tab:red", "w3": "tab:green"}


def fmt(x, digits=0) -> str:
  return "-" if x is None else f"{x:.{digits}f}"


def table(results: list[dict]) -> str:
  return common.format_table([table_row(r) for r in results], COLUMNS)


def table_row(r: dict) -> dict:
  """One result's cells (a result without measurements: its note only)."""
  if "survivors" not in r:
    return {"arm": r["arm"], "scenario": r["scenario"], "note": r.get("note", "")}
  s, v = r["survivors"], r["workers"].get(r["victim"], {})
  rounds = r.get("rounds")
  return {
    "arm": r["arm"],
    "scenario": r["scenario"],
    "before": fmt(s["before"]),
    "during": fmt(s["during"]),
    "after": fmt(s["after"]),
    "victim": "/".join(fmt(v.get(k)) for k in ("before", "during", "after")) if v else "-",
    "stages": fmt(s.get("stages")),
    "loss": fmt(s["final_loss"], 3),
    "ref": fmt((r.get("equal_tokens") or {}).get("reference_loss"), 3),
    "eval": fmt(s["eval_loss"], 3),
    "rounds": "-"
    if not rounds
    else f"{rounds['closed']} ({', '.join(f'{k}:{n}' for k, n in rounds['members'].items())})",
    "wall": fmt(r["fault"].get("wall_s")),
    "note": r.get("note", ""),
  }


def store_note(r: dict) -> str:
  f = r["fault"]
  notes = [f"{n} failed: {line}" for n, line in (f.get("errors") or {}).items()]
  if f.get("straggler"):
    notes.append(
      f"the victim, at stage {f['straggler']['stage']} when the others ended, still waited for a"
      f" round {f['straggler']['waited_s']:.0f} s later: ended"
    )
  return "; ".join(notes)


def spmd_note(r: dict) -> str:
  f, w = r["fault"], r["window"]
  if r["scenario"] == "kill":
    lines = [x for x in f.get("without_victim", {}).get("lines", []) if x.startswith("error:")]
    said = lines[0][:90] + "..." if lines else str(f.get("without_victim"))
    return (
      f"watchdog: {f.get('verdict')}, exit 75 after {f['exit_s']:.1f} s; the restart without it"
      f" is refused ({f['without_victim']['answered_s']:.0f} s): {said}; the run is over"
    )
  if r["scenario"] == "kill-restart":
    back = w["end"] - w["fault"] if w["end"] else None
    return (
      f"watchdog: {f.get('verdict')}, exit 75 after {f['exit_s']:.1f} s; every process"
      f" relaunched (a spare for the victim): training again {fmt(back, 1)} s after the fault,"
      f" {f.get('lost_stages')} stages redone"
    )
  return ""


def figure(results: list[dict], path: Path) -> Path:
  """The share of its run each worker (store) and the SPMD job has done against time, one panel
  per fault (the last result of each arm and fault), the store fault's window shaded, the SPMD
  fault dotted."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  last = {(r["arm"], r["scenario"]): r for r in results if "workers" in r}
  scenarios = [s for s in SCENARIOS if any(k[1] == s for k in last)]
  fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharey=True, squeeze=False)
  for ax, scenario in zip(axes.flat, scenarios, strict=False):
    for arm in ("store", "spmd"):
      if (arm, scenario) in last:
        draw_arm(ax, last[(arm, scenario)])
    ax.set_title(scenario)
    ax.set_xlabel("seconds since the first logged step")
    ax.grid(alpha=0.3)
  for ax in axes[:, 0]:
    ax.set_ylabel("share of the run's steps done")
  for ax in axes.flat[len(scenarios) :]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  return path


def draw_arm(ax, r: dict) -> None:
  """One arm's traces on a fault's panel: the share of its steps each worker has done."""
  w, t0 = r["window"], r["window"]["t0"]
  total = max(x["stages"] for x in r["workers"].values()) or 1
  for name, worker in sorted(r["workers"].items()):
    trace = worker.get("trace") or []
    t, done = [x[0] for x in trace], [x[1] / total for x in trace]
    if r["arm"] == "spmd":
      ax.plot(t, done, "k--", lw=1.2, label=f"SPMD job, {total} steps")
    else:
      victim = " (victim)" if name == r["victim"] else ""
      ax.plot(t, done, color=COLORS.get(name), lw=1.2, label=f"store {name}{victim}, {total}")
  if w["fault"] and r["arm"] == "store":
    hi = w["end"] or w["finish"] or w["fault"]
    ax.axvspan(w["fault"] - t0, hi - t0, color="0.88", zorder=0)
  elif w["fault"]:
    ax.axvline(w["fault"] - t0, color="k", ls=":", lw=1)
