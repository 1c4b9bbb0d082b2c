"""HDEE at CPU scale: three ensembles at one FLOP budget, three mixing rules, a dense reference.

  python -m bench.ensemble.hdee                    # configs/hdee.py:cpu, 3 training seeds
  python -m bench.ensemble.hdee --seeds 0 --smoke  # the tiny preset, one seed (a minute)
  python -m bench.ensemble.hdee --compare bench/results/hdee.json bench/results/hdee_measured.json

For each training seed, runs the whole recipe (acco_jax.ensemble.recipe) with ``hdee.dense=True``
in ``<workdir>/seed<s>``: seed models, then M_Ho-I_Ho, M_Ho-I_He and M_He-I_Ho (3 experts x 3
iterations each) and one dense model on the mixture, all at ``hdee.budget_flops``. Reports, per
domain (trained and held-out), the median perplexity over seeds of every ensemble under every
rule, the dense model and the seed, counts the domains where a heterogeneous ensemble is lowest,
writes ``bench/results/hdee.json`` and the figure ``docs/figures/hdee.png``. Rerunning resumes
(each seed's workdir is a recipe workdir).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench import common

LABELS = ("M_Ho-I_Ho", "M_Ho-I_He", "M_He-I_Ho")
HETERO = ("M_Ho-I_He", "M_He-I_Ho")


def summarize(per_seed: list[dict]) -> dict:
  """Medians over seeds, the lowest ensemble per domain and rule, and the counts."""
  first = per_seed[0]
  rules = list(first["ppl"][LABELS[0]])
  med = lambda xs: statistics.median(xs)  # noqa: E731
  rows, wins = [], {r: 0 for r in rules + ["best_rule"]}
  dense_wins = {r: 0 for r in rules + ["best_rule"]}
  for name, d in first["domains"].items():
    row = {"domain": name, "group": d["group"], "iteration": d["iteration"]}
    for lab in LABELS:
      for r in rules:
        row[f"{lab}/{r}"] = med([s["ppl"][lab][r][name] for s in per_seed])
      row[f"{lab}/best_rule"] = min(row[f"{lab}/{r}"] for r in rules)
    for other in ("dense", "seed-M"):
      row[other] = med([s["ppl"][other][name] for s in per_seed])
    row["seeds_hetero_lowest"] = {}
    for r in rules + ["best_rule"]:
      vals = {lab: row[f"{lab}/{r}"] for lab in LABELS}
      row[f"lowest/{r}"] = min(vals, key=vals.get)
      wins[r] += row[f"lowest/{r}"] in HETERO
      dense_wins[r] += min(vals.values()) < row["dense"]
      per = (
        [min(LABELS, key=lambda lab: s["ppl"][lab][r][name]) in HETERO for s in per_seed]
        if r != "best_rule"
        else []
      )  # noqa: E501
      row["seeds_hetero_lowest"][r] = sum(per)
    rows.append(row)
  return {
    "rules": rules,
    "rows": rows,
    "hetero_lowest": wins,
    "ensemble_beats_dense": dense_wins,
    "domains": len(rows),
  }


def table(summary: dict, rule: str) -> str:
  head = ["domain", "group", "it", *LABELS, "dense", "seed-M", "lowest"]
  lines = [f"rule: {rule}", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in summary["rows"]:
    vals = [row[f"{lab}/{rule}"] for lab in LABELS]
    best = min(vals)
    cells = [row["domain"], row["group"], str(row["iteration"] or "held-out")]
    cells += [f"**{v:.3f}**" if v == best else f"{v:.3f}" for v in vals]
    cells += [f"{row['dense']:.3f}", f"{row['seed-M']:.3f}", row[f"lowest/{rule}"]]
    lines.append("| " + " | ".join(cells) + " |")
  n = summary["domains"]
  lines.append(
    f"heterogeneous ensemble lowest in {summary['hetero_lowest'][rule]} of {n} domains; "
    f"the lowest ensemble beats the dense model in {summary['ensemble_beats_dense'][rule]} of {n}"
  )
  return "\n".join(lines)


def figure(summary: dict, path: Path) -> str:
  """Perplexity per domain per ensemble (best rule of each) and the dense model."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib not installed: no figure"
  rows = summary["rows"]
  names = [r["domain"] + ("*" if not r["iteration"] else "") for r in rows]
  series = [(lab, [r[f"{lab}/best_rule"] for r in rows]) for lab in LABELS]
  series.append(("dense", [r["dense"] for r in rows]))
  fig, ax = plt.subplots(figsize=(12, 4.2))
  width = 0.8 / len(series)
  for i, (lab, vals) in enumerate(series):
    ax.bar(
      [x + (i - (len(series) - 1) / 2) * width for x in range(len(rows))], vals, width, label=lab
    )
  ax.set_xticks(range(len(rows)), names, rotation=35, ha="right")
  ax.set_ylabel("perplexity (bytes), median over seeds")
  lo = min(min(v) for _, v in series)
  ax.set_ylim(lo * 0.9, max(max(v) for _, v in series) * 1.02)
  ax.set_title("HDEE at CPU scale: best mixing rule of each ensemble, equal FLOPs (* = held-out)")
  ax.legend(ncol=4, fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  return str(path)


def compare(base: dict, other: dict) -> str:
  """Per domain: the lowest ensemble's perplexity (any ensemble, any rule) in each seed of two
  benchmark results (e.g. configured and measured difficulty), its median over seeds, the change
  of the medians and of each seed."""

  def best(result: dict, domain: str) -> float:
    return min(v[domain] for lab in LABELS for v in result["ppl"][lab].values())

  lines = [
    "| domain | group -> other's group (iteration) | base | other | change | per seed |",
    "|---|---|---|---|---|---|",
  ]
  a_seeds, b_seeds = base["per_seed"], other["per_seed"]
  for name in a_seeds[0]["domains"]:
    a = [best(r, name) for r in a_seeds]
    b = [best(r, name) for r in b_seeds]
    ga, gb = a_seeds[0]["domains"][name], b_seeds[0]["domains"][name]
    it = gb["iteration"] or "held-out"
    per = " ".join(f"{y / x - 1:+.1%}" for x, y in zip(a, b, strict=True))
    lines.append(
      f"| {name} | {ga['group']} -> {gb['group']} ({it}) | {statistics.median(a):.3f} | "
      f"{statistics.median(b):.3f} | {statistics.median(b) / statistics.median(a) - 1:+.1%} | "
      f"{per} |"
    )
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--seeds", default="0,1,2", help="training seeds (comma separated)")
  ap.add_argument("--workdir", default="/tmp/acco_jax_bench_hdee")
  ap.add_argument("--smoke", action="store_true", help="tiny preset (tests)")
  ap.add_argument("--out", default=str(common.RESULTS / "hdee.json"))
  ap.add_argument("--figure", default=str(common.REPO / "docs" / "figures" / "hdee.png"))
  ap.add_argument("--set", action="append", default=[], help="config override key=value")
  ap.add_argument(
    "--compare",
    nargs=2,
    metavar=("BASE", "OTHER"),
    help="print the per-domain comparison of two result files and exit",
  )
  args = ap.parse_args()
  if args.compare:
    import json

    base, other = (json.loads(Path(p).read_text()) for p in args.compare)
    print(compare(base, other))
    return

  import jax

  # every job of one size compiles the same programs: compile each once
  jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  from acco_jax.ensemble import recipe
  from configs import hdee

  per_seed, start = [], time.time()
  for s in [int(x) for x in args.seeds.split(",")]:
    c = hdee.get_config("tiny" if args.smoke else "cpu")
    c.hdee.dense, c.train.seed, c.train.sample_tokens = True, s, 0
    for kv in args.set:
      key, _, value = kv.partition("=")
      group, _, field = key.rpartition(".")
      target = c[group] if group else c
      target[field] = type(target[field])(value)
    t0 = time.time()
    per_seed.append(recipe.train_and_evaluate(c, os.path.join(args.workdir, f"seed{s}")))
    common.log(f"seed {s}: {time.time() - t0:.0f} s")
  summary = summarize(per_seed)
  tables = "\n\n".join(table(summary, r) for r in [*summary["rules"], "best_rule"])
  print(tables, flush=True)
  fig = figure(summary, Path(args.figure))
  print(f"figure: {fig}")
  common.write_json(
    Path(args.out),
    {
      "benchmark": "hdee",
      "machine": common.machine(),
      "seconds": time.time() - start,
      "seeds": args.seeds,
      "overrides": args.set,
      "summary": summary,
      "per_seed": per_seed,
      "tables": tables,
    },
  )


if __name__ == "__main__":
  main()
