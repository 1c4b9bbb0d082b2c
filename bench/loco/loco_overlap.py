r"""Loss at equal tokens of the outer overlaps: ``loco.outer_overlap`` = none, delayed, eager.

The claim checked (Kale, Douillard, Donchev 2025, arXiv 2502.12996): eager outer updates, which
hide a sync's reduction behind the whole next inner phase, end close to blocking DiLoCo, and the
naive delayed update (one sync stale, no local proxy) ends worse.

The setting is ``bench/loco/loco_compare.py``'s (D = 128, 2 layers, 2k BPE on the embedded corpus,
context 64, 8 workers of one device, 2048 tokens per inner step, constant AdamW 2e-3); each run is a
``loco_compare`` run of the label ``<case>,loco.outer_overlap=<mode>`` (its scheduler, its run
directories ``<out>/runs/loco_compare/<label>/seed<k>/``, resumable). The cases:

* DiLoCo at H = 15 and H = 50 (the paper's Nesterov outer step, 0.7 / 0.9);
* Streaming DiLoCo at H = 50, 2 fragments, α = 0.5, FP4, with ``loco.overlap_steps=0``: the phase
  programs replace τ (a fragment's reduction runs for the ``H/P`` steps until the next fragment's
  sync), so the blocking run is the same method without τ;
* SparseLoCo at H = 15 (where it is competitive with DiLoCo in ``loco_compare``);
* DiLoCo at H = 15 with plain averaging as its outer step (``loco.outer_lr=1``, no momentum);
* DiLoCo at H = 15 on 4 workers of 2 devices, with ``loco.inner=zero1`` and ``loco.inner=acco``
  (ACCO inside the workers, at equal tokens).

``--setting long`` runs the long grid (the claims at a length that can test them), in
loco_compare's ``long`` setting: a byte-level model of D = 64 and 2 layers (121k parameters), context
64, 8 workers of one device, 1024 tokens per inner step, 2,000 inner steps (66 syncs at H = 30, 20
at H = 100), evaluated every 50; run directories ``<out>/runs/loco_long/<label>/seed<k>/``:

* DiLoCo at H = 30 and H = 100: none, delayed, eager;
* Streaming DiLoCo (2 fragments, FP4, τ = 0) and SparseLoCo at H = 30: none and eager;
* DiLoCo at H = 30 with plain averaging as its outer step: none, delayed, eager;
* NoLoCo and DeMo at their presets, and DDP at equal tokens, as references.

It reports, beside the paired difference to ``none``, the paired differences to blocking DiLoCo at
H = 30 and to DDP, the gap to ``none`` at every evaluation against the syncs done by then, and one
figure per group of curves (``docs/figures/loco_long_*.png``).

``--updates`` shortens every run (the same for every mode, so the comparison stays at equal
tokens). Reported per case and mode: the final eval loss (mean ± std over seeds) and the paired
per-seed difference to ``none`` in percent.

Usage::

  python -m bench.loco.loco_overlap --jobs 2 --updates 200    # 4 cases x 3 modes x 3 seeds
  python -m bench.loco.loco_overlap --collect --updates 200   # the JSON and table only
  python -m bench.loco.loco_overlap --jobs 1 --updates 200 --seeds 1 2 --json loco_overlap_seeds12.json
  python -m bench.loco.loco_overlap --collect --updates 200 --seeds 0 1 2 \
    --merge bench/results/loco_overlap_seed0.json      # seed 0's runs from an earlier JSON
  python -m bench.loco.loco_overlap --smoke --out /tmp/lo     # CI-size: tiny model, 4 steps, 1 seed
  python -m bench.loco.loco_overlap --jobs 1 --updates 200 --modes none eager --json loco_acco_inner.json \
    --cases "diloco H=15 4x2 zero1 inside" "diloco H=15 4x2 acco inside"   # ACCO inside workers
  python -m bench.loco.loco_overlap --setting long --jobs 2   # 16 runs x 3 seeds, 2,000 steps each
  python -m bench.loco.loco_overlap --setting long --smoke --out /tmp/ll   # CI-size, the long grid
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from bench import common
from bench.dp import convergence
from bench.loco import loco_compare

MODES = ("none", "delayed", "eager")
# case -> the loco_compare label of its blocking run (the mode is appended); setting d8, 200 steps
CASES = {
  "diloco H=15": "diloco@loco.sync_every=15",
  "diloco H=50": "diloco@loco.sync_every=50",
  "streaming_diloco H=50": "streaming_diloco@loco.sync_every=50,loco.overlap_steps=0",
  "sparseloco H=15": "sparseloco@loco.sync_every=15",
  # DiLoCo's outer step as plain averaging (SGD at lr 1, no momentum): is the staleness or its
  # interaction with the paper's Nesterov (0.7, 0.9) step what costs?
  "diloco H=15 plain averaging": (
    "diloco@loco.sync_every=15,loco.outer_lr=1.0,loco.outer_momentum=0.0"
  ),
  # the inner step of 4 workers of 2 devices: ZeRO-1 (its collectives waited for) or ACCO (hidden)
  "diloco H=15 4x2 zero1 inside": "diloco@loco.sync_every=15,loco.workers=4,loco.inner=zero1",
  "diloco H=15 4x2 acco inside": "diloco@loco.sync_every=15,loco.workers=4,loco.inner=acco",
}
# the long grid, setting ``long`` (2,000 steps): case -> (label of its blocking run, its modes).
# A case of one mode is a reference and runs its method as it is (no loco.outer_overlap).
LONG_CASES = {
  "diloco H=30": ("diloco@loco.sync_every=30", MODES),
  "diloco H=100": ("diloco@loco.sync_every=100", MODES),
  "streaming_diloco H=30": (
    "streaming_diloco@loco.sync_every=30,loco.overlap_steps=0",
    ("none", "eager"),
  ),
  "sparseloco H=30": ("sparseloco@loco.sync_every=30", ("none", "eager")),
  # the outer step as plain averaging (lr 1, no momentum): the staleness without Nesterov's 0.9
  "diloco H=30 plain averaging": (
    "diloco@loco.sync_every=30,loco.outer_lr=1.0,loco.outer_momentum=0.0",
    MODES,
  ),
  "noloco H=50": ("noloco", ("none",)),  # its preset: H = 50, heavy-ball 0.7 / 0.5
  "demo": ("demo", ("none",)),  # every step, lr 1e-3 (loco_compare's)
  "ddp": ("ddp", ("none",)),  # the reference at equal tokens
}
GRIDS = {"d8": {case: (text, MODES) for case, text in CASES.items()}, "long": LONG_CASES}
REFERENCES = {"blocking": "diloco H=30", "ddp": "ddp"}  # the long grid's other columns


def label(case: str, mode: str, updates: int | None, grid: str = "d8") -> str:
  """The loco_compare label of ``case`` of ``grid`` run with ``mode`` (and ``updates`` inner steps)."""
  text, modes = GRIDS[grid][case]
  if len(modes) > 1:
    text = f"{text},loco.outer_overlap={mode}"
  if updates is not None:
    text = f"{text}{',' if '@' in text else '@'}train.num_updates={updates}"
  return text


def plan_labels(grid: str, cases: list[str], modes: list[str], updates: int | None) -> list:
  """``(case, mode, label)`` of every run of ``cases`` x ``modes`` that ``grid`` has."""
  return [
    (case, mode, label(case, mode, updates, grid))
    for case in cases
    for mode in modes
    if mode in GRIDS[grid][case][1]
  ]


def collect(
  out: Path,
  seeds: list[int],
  updates: int | None,
  name: str,
  grid: str = "d8",
  earlier: dict | None = None,
) -> dict:
  """Final eval losses per case and mode, and the paired per-seed differences to ``none`` (and, in
  the long grid, to blocking DiLoCo and to DDP, with the gap to ``none`` at every evaluation).

  ``name``: the runs' setting (``d8``, ``long``, ``smoke``). ``earlier``: a result JSON of this
  script (same ``updates``) whose runs stand in for those of ``seeds`` with no run directory under
  ``out`` (a seed run elsewhere, its directory not kept)."""
  s = loco_compare.setting(name)
  cases = GRIDS[grid]
  runs: dict = {}
  baseline = None
  for case, mode, text in plan_labels(grid, list(cases), list(MODES), updates):
    for seed in seeds:
      d = loco_compare.run_dir(out, text, seed, name)
      if (d / "result.json").exists():
        runs.setdefault(case, {}).setdefault(mode, {})[seed] = convergence.read_run(d, s)
        if baseline is None:
          summary = json.loads((d / "result.json").read_text()).get("summary") or {}
          baseline = summary.get("unigram_baseline")
  if earlier is not None:
    if earlier["updates"] != (updates or s["num_updates"]):
      raise SystemExit(f"--merge: its runs have {earlier['updates']} updates, these {updates}")
    for case, by_mode in earlier["runs"].items():
      for mode, by_seed in by_mode.items():
        for seed, run in by_seed.items():
          if int(seed) in seeds and case in cases:
            runs.setdefault(case, {}).setdefault(mode, {}).setdefault(int(seed), run)
  runs = {
    case: {mode: dict(sorted(by_mode[mode].items())) for mode in MODES if mode in by_mode}
    for case, by_mode in runs.items()
  }
  finals = {
    (case, mode): {k: r["final_eval_loss"] for k, r in by_seed.items()}
    for case, by_mode in runs.items()
    for mode, by_seed in by_mode.items()
  }
  refs = {col: finals.get((case, "none"), {}) for col, case in REFERENCES.items()}
  summary: dict = {}
  for (case, mode), loss in finals.items():
    row = {"final_eval_loss": convergence._mean_std(list(loss.values()))}
    row["vs_none_pct"], row["vs_none_pct_mean"] = paired(loss, finals.get((case, "none"), {}))
    if grid == "long":
      for col, ref in refs.items():
        row[f"vs_{col}_pct"], row[f"vs_{col}_pct_mean"] = paired(loss, ref)
      if mode != "none" and (case, "none") in finals:
        h = loco_compare.make_config(label(case, mode, updates, grid), 0, name).loco.sync_every
        row["gap"] = gap_curve(runs[case][mode], runs[case]["none"], h)
    summary.setdefault(case, {})[mode] = row
  return {
    "runs": runs,
    "summary": summary,
    "setting": s,
    "grid": grid,
    "updates": updates or s["num_updates"],
    "unigram_baseline": baseline,
  }


def paired(loss: dict, ref: dict) -> tuple[list[float], float]:
  """Per-seed differences of ``loss`` to ``ref`` in percent (seeds both have), and their mean."""
  pct = [100 * (loss[k] / ref[k] - 1) for k in sorted(loss) if k in ref]
  return pct, statistics.fmean(pct) if pct else math.nan


def gap_curve(runs: dict, base: dict, sync_every: int) -> dict:
  """The gap of ``runs`` to the blocking ``base`` at every evaluation both have on every seed:
  the mean over seeds of ``100 (loss / loss_none - 1)``, with the syncs done by then."""
  seeds = [k for k in runs if k in base]
  common_updates = (
    sorted(
      set.intersection(
        *(set(runs[k]["eval"]["update"]) & set(base[k]["eval"]["update"]) for k in seeds)
      )
    )
    if seeds
    else []
  )
  at = lambda r, u: r["eval"]["loss"][r["eval"]["update"].index(u)]
  pct = [
    statistics.fmean(100 * (at(runs[k], u) / at(base[k], u) - 1) for k in seeds)
    for u in common_updates
  ]
  return {"update": common_updates, "syncs": [u // sync_every for u in common_updates], "pct": pct}


def table(results: dict) -> str:
  """The markdown table of docs/benchmarks/loco.md's "Outer overlap: loss at equal tokens"."""
  head = " | ".join(f"{m} (mean ± std)" for m in MODES)
  lines = [
    f"| case | {head} | delayed vs none, per seed | eager vs none, per seed |",
    "|---|" + "---|" * (len(MODES) + 2),
  ]
  for case, by_mode in results["summary"].items():
    cells = []
    for mode in MODES:
      loss = by_mode.get(mode, {}).get("final_eval_loss")
      cells.append("" if loss is None else f"{loss['mean']:.3f} ± {loss['std']:.3f} ({loss['n']})")
    for mode in ("delayed", "eager"):
      row = by_mode.get(mode)
      if row is None or not row["vs_none_pct"]:
        cells.append("")
        continue
      each = ", ".join(f"{x:+.1f}" for x in row["vs_none_pct"])
      cells.append(f"{row['vs_none_pct_mean']:+.1f}% ({each})")
    lines.append(f"| {case} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def long_table(results: dict) -> str:
  """The long grid's tables: final eval loss against the references, and the gap's trend."""
  pct = lambda row, col: (
    ""
    if not row.get(f"vs_{col}_pct")
    else f"{row[f'vs_{col}_pct_mean']:+.1f}% ({', '.join(f'{x:+.1f}' for x in row[f'vs_{col}_pct'])})"
  )
  lines = [
    "| case | mode | final eval loss (mean ± std; per seed) | vs its blocking run | "
    f"vs blocking {REFERENCES['blocking']} | vs DDP |",
    "|---|---|---|---|---|---|",
  ]
  for case, by_mode in results["summary"].items():
    for mode, row in by_mode.items():
      loss = row["final_eval_loss"]
      each = ", ".join(f"{r['final_eval_loss']:.3f}" for r in results["runs"][case][mode].values())
      lines.append(
        f"| {case} | {mode} | {loss['mean']:.3f} ± {loss['std']:.3f} ({each}) | "
        f"{pct(row, 'none') if mode != 'none' else ''} | {pct(row, 'blocking')} | {pct(row, 'ddp')} |"
      )
  total = results["updates"]
  marks = [total // 8, total // 4, total // 2, total]
  head = " | ".join(f"by step {u}" for u in marks)
  lines += [
    "",
    f"| gap to its blocking run (mean over seeds; at the last common evaluation) | {head} |",
    "|---|" + "---|" * len(marks),
  ]
  for case, by_mode in results["summary"].items():
    for mode, row in by_mode.items():
      gap = row.get("gap")
      if not gap or not gap["update"]:
        continue
      cells = []
      for u in marks:  # the last evaluation at or before u
        k = max((i for i, v in enumerate(gap["update"]) if v <= u), default=None)
        at = f"step {gap['update'][k]}, {gap['syncs'][k]} syncs" if k is not None else ""
        cells.append(f"{gap['pct'][k]:+.1f}% ({at})" if k is not None else "")
      lines.append(f"| {case} {mode} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


# figure -> the (case, mode) curves it draws (the long grid)
GROUPS = {
  "diloco_h30": [("diloco H=30", m) for m in MODES] + [("ddp", "none")],
  "diloco_h100": [("diloco H=100", m) for m in MODES] + [("ddp", "none")],
  "streaming_sparseloco_h30": [
    (case, m) for case in ("streaming_diloco H=30", "sparseloco H=30") for m in ("none", "eager")
  ],
  "diloco_h30_plain_averaging": [("diloco H=30 plain averaging", m) for m in MODES]
  + [("ddp", "none")],
  "references": [(c, "none") for c in ("ddp", "diloco H=30", "noloco H=50", "demo")],
}


def figures(results: dict, where: Path) -> list[Path]:
  """One figure per group of :data:`GROUPS` (eval loss against steps, mean over seeds and the
  band from the lowest to the highest seed), and the gap to blocking against syncs; PNGs in
  ``where`` named ``loco_long_<group>.png``."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    common.log("matplotlib is not installed: no figures (pip install matplotlib)")
    return []
  where.mkdir(parents=True, exist_ok=True)
  runs, written = results["runs"], []
  floor = results.get("unigram_baseline")
  for group, curves in GROUPS.items():
    if not runs.get(curves[0][0], {}).get(curves[0][1]):
      continue  # its own runs are not there (a subset of the grid)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lows = []
    for case, mode in curves:
      by_seed = runs.get(case, {}).get(mode)
      if not by_seed:
        continue
      evals = [r["eval"] for r in by_seed.values()]
      n = min(len(e["loss"]) for e in evals)
      x = evals[0]["update"][:n]
      ys = [[e["loss"][i] for e in evals] for i in range(n)]
      final = results["summary"][case][mode]["final_eval_loss"]["mean"]
      text = f"{case} {mode} (final {final:.2f})"
      line = ax.plot(x, [statistics.fmean(y) for y in ys], label=text)[0]
      ax.fill_between(
        x, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2
      )
      lows.append(min(min(y) for y in ys))
    if not lows:
      plt.close(fig)
      continue
    if floor is not None:
      ax.axhline(floor, color="grey", lw=0.8, ls="--", label="unigram baseline")
      ax.set_ylim(min(lows) - 0.05, floor + 2.5)  # a diverging run leaves the top: see its final
    ax.set(xlabel="inner step", ylabel="eval loss", title=f"{group}: mean and seed band")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(where / f"loco_long_{group}.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for case, by_mode in results["summary"].items():
    for mode, row in by_mode.items():
      if row.get("gap") and row["gap"]["update"]:
        ax.plot(row["gap"]["syncs"], row["gap"]["pct"], marker=".", label=f"{case} {mode}")
  ax.axhline(0, color="grey", lw=0.8)
  ax.set_yscale("symlog", linthresh=10)  # linear to 10%, then logarithmic: diverged runs fit
  ax.set(
    xlabel="syncs done",
    ylabel="eval loss above blocking (%)",
    title="gap to the blocking run, mean over seeds",
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  written.append(where / "loco_long_gap.png")
  fig.savefig(written[-1], dpi=110)
  plt.close(fig)
  return written


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=Path, default=common.RESULTS)
  p.add_argument("--setting", default="d8", choices=list(GRIDS), help="the grid and its setting")
  p.add_argument("--seeds", nargs="+", type=int, default=list(loco_compare.SEEDS))
  p.add_argument("--cases", nargs="+", help="cases of the grid (default: all)")
  p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
  p.add_argument("--updates", type=int, help="inner steps per run (default: the setting's)")
  p.add_argument("--jobs", type=int, default=1)
  p.add_argument("--timeout", type=float, default=3600)
  p.add_argument("--collect", action="store_true")
  p.add_argument("--smoke", action="store_true", help="CI-size: tiny model, 4 steps, seed 0")
  p.add_argument("--json", help="result name (default: loco_overlap.json, loco_long.json)")
  p.add_argument(
    "--merge", type=Path, help="an earlier result JSON: its runs of --seeds with no directory here"
  )
  args = p.parse_args(argv)
  grid, cases = args.setting, args.cases or list(GRIDS[args.setting])
  for case in cases:
    if case not in GRIDS[grid]:
      raise SystemExit(
        f"loco_overlap: no case {case!r} in the {grid} grid; use one of {list(GRIDS[grid])}"
      )
  name = "smoke" if args.smoke else grid
  if args.smoke:
    args.seeds, args.updates = [0], None
  runs = plan_labels(grid, cases, args.modes, args.updates)
  for _, _, text in runs:
    loco_compare.make_config(text, 0, name)  # a bad value stops here, before any run
  plan = [(text, k) for k in args.seeds for _, _, text in runs]  # seed-major
  t0 = time.time()
  failed = []
  if not args.collect:
    failed = loco_compare.run_all(args.out, plan, args.jobs, args.timeout, name)
  earlier = json.loads(args.merge.read_text()) if args.merge else None
  results = collect(args.out, args.seeds, args.updates, name, grid, earlier)
  results.update(machine=common.machine(), wall_s=None if args.collect else time.time() - t0)
  stem = Path(args.json or ("loco_long.json" if grid == "long" else "loco_overlap.json")).stem
  stem = f"{stem}_smoke" if args.smoke else stem
  text = long_table(results) if grid == "long" else table(results)
  if grid == "long":
    for path in figures(results, args.out if args.smoke else loco_compare.FIGURES):
      common.log(f"wrote {path}")
  return common.write_report(args.out, stem, results, text, failed)


if __name__ == "__main__":
  sys.exit(main())
