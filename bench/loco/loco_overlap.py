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
  (issue 47: ACCO inside the workers, at equal tokens).

``--updates`` shortens every run (the same for every mode, so the comparison stays at equal
tokens). Reported per case and mode: the final eval loss (mean ± std over seeds) and the paired
per-seed difference to ``none`` in percent.

Usage::

  python bench/loco/loco_overlap.py --jobs 2 --updates 200    # 4 cases x 3 modes x 3 seeds
  python bench/loco/loco_overlap.py --collect --updates 200   # the JSON and table only
  python bench/loco/loco_overlap.py --jobs 1 --updates 200 --seeds 1 2 --json loco_overlap_seeds12.json
  python bench/loco/loco_overlap.py --collect --updates 200 --seeds 0 1 2 \
    --merge bench/results/loco_overlap_seed0.json      # seed 0's runs from an earlier JSON
  python bench/loco/loco_overlap.py --smoke --out /tmp/lo     # CI-size: tiny model, 4 steps, 1 seed
  python bench/loco/loco_overlap.py --jobs 1 --updates 200 --modes none eager --json loco_acco_inner.json \
    --cases "diloco H=15 4x2 zero1 inside" "diloco H=15 4x2 acco inside"   # ACCO inside workers
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout: bench, acco_jax
from bench import common  # noqa: E402
from bench.dp import convergence  # noqa: E402
from bench.loco import loco_compare  # noqa: E402

MODES = ("none", "delayed", "eager")
# case -> the loco_compare label of its blocking run (the mode is appended)
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


def label(case: str, mode: str, updates: int | None) -> str:
  """The loco_compare label of ``case`` run with ``mode`` (and ``updates`` inner steps)."""
  text = f"{CASES[case]},loco.outer_overlap={mode}"
  return text if updates is None else f"{text},train.num_updates={updates}"


def collect(
  out: Path, seeds: list[int], updates: int | None, smoke: bool, earlier: dict | None = None
) -> dict:
  """Final eval losses per case and mode, and the paired per-seed differences to ``none``.

  ``earlier``: a result JSON of this script (same ``updates``) whose runs stand in for those of
  ``seeds`` with no run directory under ``out`` (a seed run elsewhere, its directory not kept)."""
  s = loco_compare.setting(smoke)
  runs: dict = {}
  for case in CASES:
    for mode in MODES:
      for seed in seeds:
        d = loco_compare.run_dir(out, label(case, mode, updates), seed)
        if (d / "result.json").exists():
          runs.setdefault(case, {}).setdefault(mode, {})[seed] = convergence.read_run(d, s)
  if earlier is not None:
    if earlier["updates"] != (updates or s["num_updates"]):
      raise SystemExit(f"--merge: its runs have {earlier['updates']} updates, these {updates}")
    for case, by_mode in earlier["runs"].items():
      for mode, by_seed in by_mode.items():
        for seed, run in by_seed.items():
          if int(seed) in seeds and case in CASES:
            runs.setdefault(case, {}).setdefault(mode, {}).setdefault(int(seed), run)
  runs = {
    case: {mode: dict(sorted(by_mode[mode].items())) for mode in MODES if mode in by_mode}
    for case, by_mode in runs.items()
  }
  summary: dict = {}
  for case, by_mode in runs.items():
    base = {k: r["final_eval_loss"] for k, r in by_mode.get("none", {}).items()}
    for mode, by_seed in by_mode.items():
      finals = {k: r["final_eval_loss"] for k, r in by_seed.items()}
      row = {"final_eval_loss": convergence._mean_std(list(finals.values()))}
      paired = [100 * (finals[k] / base[k] - 1) for k in sorted(finals) if k in base]
      row["vs_none_pct"] = paired
      row["vs_none_pct_mean"] = statistics.fmean(paired) if paired else math.nan
      summary.setdefault(case, {})[mode] = row
  return {"runs": runs, "summary": summary, "setting": s, "updates": updates or s["num_updates"]}


def table(results: dict) -> str:
  """The markdown table of docs/benchmarks.md's "Outer overlap: loss at equal tokens"."""
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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=Path, default=common.RESULTS)
  p.add_argument("--seeds", nargs="+", type=int, default=list(loco_compare.SEEDS))
  p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
  p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
  p.add_argument("--updates", type=int, help="inner steps per run (default: the setting's)")
  p.add_argument("--jobs", type=int, default=1)
  p.add_argument("--timeout", type=float, default=3600)
  p.add_argument("--collect", action="store_true")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--json", default="loco_overlap.json")
  p.add_argument(
    "--merge", type=Path, help="an earlier result JSON: its runs of --seeds with no directory here"
  )
  args = p.parse_args(argv)
  if args.smoke:
    args.seeds, args.updates = [0], None
  labels = [label(c, m, args.updates) for c in args.cases for m in args.modes]
  for text in labels:
    loco_compare.make_config(text, 0, args.smoke)  # a bad value stops here, before any run
  plan = [(text, k) for k in args.seeds for text in labels]  # seed-major
  t0 = time.time()
  failed = []
  if not args.collect:
    failed = loco_compare.run_all(args.out, plan, args.jobs, args.timeout, args.smoke)
  earlier = json.loads(args.merge.read_text()) if args.merge else None
  results = collect(args.out, args.seeds, args.updates, args.smoke, earlier)
  results.update(machine=common.machine(), wall_s=None if args.collect else time.time() - t0)
  name = "loco_overlap_smoke" if args.smoke else Path(args.json).stem
  return common.write_report(args.out, name, results, table(results), failed)


if __name__ == "__main__":
  sys.exit(main())
