"""ACCO and ZeRO-1 with quantized communication (``comm.quantize``): loss, bytes and cost.

Three measurements, each its own command:

* **convergence** (default): the settings ``d8`` and ``d32`` of ``bench/dp/convergence.py`` (same
  model, data, batch, constant LR, machinery: one process per run, resumable), for zero1 and acco
  with ``none`` / ``int8`` / ``int4`` communication, 3 seeds, equal tokens. Quantized runs treat
  every simulated device as its own node (``comm.node_size=1``: each device's gradients are
  quantized, the worst case) in blocks of 256 with error feedback. Eval loss at 25 / 50 / 100 %,
  the gap of each quantized run to the bf16 run of the same method and seed, and the bytes per
  update the trainer logged.
* ``--bytes``: the bytes one device sends per update read from the compiled stage programs
  (``acco_jax.analysis.hlo.hlo_collectives``) of the two settings' models at N = 8 and 32, against
  :func:`acco_jax.dp.plan.comm_bytes_per_stage` and the bf16 program. Compile only.
* ``--cost``: what quantizing costs in compute: CPU time of one ACCO / ZeRO-1 stage of the ``d8``
  model (8 simulated devices) with each mode, interleaved repetitions, medians, as a ratio to bf16;
  and, with the CUDA plugin, the kernels (fusions) the quantization adds to the compiled XLA:GPU
  stage for 8 x H100 (compile only). The code: :mod:`bench.dp.acco_quantized_cost`.

Usage::

  python -m bench.dp.acco_quantized --jobs 2        # convergence, d8 + d32 x 6 variants x 3 seeds
  python -m bench.dp.acco_quantized --collect       # tables and docs/figures/acco_quantized.png
  python -m bench.dp.acco_quantized --bytes         # -> bench/results/acco_quantized_bytes.json
  python -m bench.dp.acco_quantized --cost          # -> bench/results/acco_quantized_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import common
from bench.dp import convergence as conv
from bench.dp import convergence_settings as cs
from bench.dp.acco_quantized_cost import cost_report

LABELS = ("zero1", "zero1-int8", "zero1-int4", "acco", "acco-int8", "acco-int4")
# Diagnostics, not in the default plan: -n<L> sets comm.node_size=L. n8 (one node of 8): the gradients
# stay bf16 and only the weight updates are quantized, which tells the two collectives' shares
# apart; n4 (two nodes of 4): only the node sums of the gradients are quantized, as on a cluster.
DIAGNOSTIC = ("acco-int8-n8", "acco-int8-n4", "acco-int4-n4")
SETTINGS = ("d8", "d32")
EXTRA_SETTINGS = ("d8-lr5e-4", "d32-lr5e-4")  # the paper's TinyStories learning rate
OUT = common.RESULTS / "quantized"  # runs/<setting>/<label>/seed<k>/ (not in git)
TARGETS = {"int8": (0.5, 0.55), "int4": (1.0, 0.30)}  # (max |gap| %, max bytes ratio) for acco


def base_of(label: str) -> str:
  return label.split("-")[0]


def mode_of(label: str) -> str:
  return label.split("-")[1] if "-" in label else "none"


# -- convergence -------------------------------------------------------------------------------------


def bytes_per_update(run_dir: Path, label: str) -> float:
  """What the trainer logged: bytes one device sends per stage, times stages per update."""
  with open(run_dir / "metrics.jsonl") as f:
    for line in f:
      row = json.loads(line)
      if "comm_bytes_per_device" in row:
        return row["comm_bytes_per_device"] * (2 if base_of(label) == "acco" else 1)
  return float("nan")


def recorded_runs(results: dict | None, setting: str) -> dict:
  """``{label: {seed: (run, bytes per update)}}`` of a setting in an earlier JSON of this script."""
  r = (results or {}).get("settings", {}).get(setting)
  if r is None:
    return {}
  return {
    label: {int(k): (run, r["summary"][label]["bytes_per_update"]) for k, run in by_seed.items()}
    for label, by_seed in r["runs"].items()
  }


def collect(out: Path, seeds: list[int], settings=SETTINGS, recorded: dict | None = None) -> dict:
  """The runs of ``settings`` x ``seeds`` read from their directories, or, where a directory is
  gone, taken from ``recorded`` (an earlier JSON of this script)."""
  results = {"machine": common.machine(), "settings": {}}
  for setting in settings:
    s = cs.SETTINGS[setting]
    runs: dict[str, dict[int, dict]] = {}
    sent: dict[str, float] = {}
    earlier = recorded_runs(recorded, setting)
    for label in LABELS + DIAGNOSTIC:
      for seed in seeds:
        d = conv.run_dir(out, setting, label, seed)
        if (d / "result.json").exists():
          runs.setdefault(label, {})[seed] = conv.read_run(d, s)
          sent[label] = bytes_per_update(d, label)
        elif seed in earlier.get(label, {}):
          runs.setdefault(label, {})[seed], sent[label] = earlier[label][seed]
    if not runs:
      continue
    points = {f"{int(f * 100)}%": round(f * s["num_updates"]) for f in cs.FRACTIONS}
    summary = {}
    for label, by_seed in runs.items():
      m = {"final_eval_loss": conv._mean_std([r["final_eval_loss"] for r in by_seed.values()])}
      m["bytes_per_update"] = sent[label]
      base = runs.get(base_of(label), {})
      if label != base_of(label) and base:
        m["bytes_ratio"] = sent[label] / sent[base_of(label)]
        m["gap_to_bf16"] = {}
        for name, u in points.items():  # paired by seed: same init, data order and eval rows
          rel = [
            100 * (conv.eval_at(r, u) / conv.eval_at(base[k], u) - 1)
            for k, r in by_seed.items()
            if k in base
          ]
          m["gap_to_bf16"][name] = conv._mean_std(rel)
      summary[label] = m
    results["settings"][setting] = {
      "config": {k: v for k, v in s.items() if k != "methods"}
      | {"tokens_per_update": cs.tokens_per_update(s), "lr": s.get("lr", cs.LR)},
      "points": points,
      "summary": summary,
      "runs": {label: {str(k): v for k, v in r.items()} for label, r in runs.items()},
    }
  return results


def print_tables(results: dict) -> None:
  for setting, r in results["settings"].items():
    rows = []
    for label, m in r["summary"].items():
      f = m["final_eval_loss"]
      row = {
        "label": label,
        "final": f"{f['mean']:.4f} ± {f['std']:.4f} (n={f['n']})",
        "bytes": f"{m['bytes_per_update']:,.0f}",
        "ratio": f"{m['bytes_ratio']:.3f}" if "bytes_ratio" in m else "1",
      }
      for name, g in m.get("gap_to_bf16", {}).items():
        row[name] = f"{g['mean']:+.2f} ± {g['std']:.2f}%"
      rows.append(row)
    cols = [
      ("label", "variant"),
      ("final", "final eval loss"),
      ("bytes", "B/update/device"),
      ("ratio", "x bf16"),
    ] + [(p, f"gap@{p}") for p in r["points"]]
    common.log(f"\n{setting}:\n" + common.format_table(rows, cols))


def figure(results: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  settings = list(results["settings"])
  fig, axes = plt.subplots(2, len(settings), figsize=(6 * len(settings), 8), squeeze=False)
  colors = {"none": "k", "int8": "tab:blue", "int4": "tab:red"}
  for j, setting in enumerate(settings):
    r = results["settings"][setting]
    for label, by_seed in r["runs"].items():
      runs = list(by_seed.values())
      n = min(len(x["eval"]["loss"]) for x in runs)
      tokens = np.asarray(runs[0]["eval"]["tokens"][:n]) / 1e3
      loss = np.asarray([x["eval"]["loss"][:n] for x in runs])
      style = "-" if base_of(label) == "acco" else "--"
      ax = axes[0, j]
      style = (":" if label.endswith("n8") else "-.") if label in DIAGNOSTIC else style
      ax.plot(tokens, loss.mean(0), style, color=colors[mode_of(label)], label=label)
      ax.fill_between(tokens, loss.min(0), loss.max(0), color=colors[mode_of(label)], alpha=0.08)
      base = r["runs"].get(base_of(label))
      if base and label != base_of(label):
        ref = np.asarray([base[k]["eval"]["loss"][:n] for k in by_seed if k in base])
        gap = 100 * (loss[: len(ref)] / ref - 1)
        axes[1, j].plot(tokens, gap.mean(0), style, color=colors[mode_of(label)], label=label)
        axes[1, j].fill_between(
          tokens, gap.min(0), gap.max(0), color=colors[mode_of(label)], alpha=0.1
        )
    axes[0, j].set(
      title=f"{setting}: eval loss (mean over seeds, band = min..max)",
      xlabel="tokens (thousands)",
      ylabel="eval loss (nats/token)",
      ylim=(4.0, 6.2),
    )
    axes[1, j].axhline(0, color="k", lw=0.5)
    for lim in (0.5, -0.5):
      axes[1, j].axhline(lim, color="tab:blue", lw=0.5, ls=":")
    axes[1, j].set(
      title=f"{setting}: gap to the bf16 run of the same method and seed",
      xlabel="tokens (thousands)",
      ylabel="eval loss gap (%)",
    )
    for ax in axes[:, j]:
      ax.legend(fontsize=8)
      ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


# -- bytes from the compiled programs ---------------------------------------------------------------


def bytes_worker(args) -> dict:
  """On ``jax.device_count()`` devices: the settings' stage programs, their collectives and bytes."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import acco_jax
  from acco_jax import model
  from acco_jax.analysis import hlo
  from acco_jax.dp.plan import comm_bytes_per_stage

  n = jax.device_count()
  rows = []
  for setting in args.settings:
    s = cs.SETTINGS[setting]
    cfg = model.get_config("tiny", V=2048, L=s["seq_len"], D=s["D"], N=s["N"], H=s["H"])
    shapes = jax.eval_shape(lambda cfg=cfg: model.init_params(cfg, 0))
    loss = lambda p, b, cfg=cfg: model.loss_fn(p, cfg, b)
    mesh = jax.make_mesh((n,), ("data",))
    for label in LABELS:
      method, mode = base_of(label), mode_of(label)
      quant = {} if mode == "none" else {"quantize": mode, "block": 256, "node_size": 1}
      k = s["microbatches"] // (2 if method == "acco" else 1)
      tx = acco_jax.get_method(method, optax.adamw(1e-3), comm_dtype=jnp.bfloat16, **quant)
      train = acco_jax.make_train_step(
        loss, tx, mesh, num_microbatches=k, params=shapes, has_aux=True
      )
      state = train.abstract_state(shapes)
      fn = train.stage_program("delayed" if train.plan.delayed else "sync", state)
      data = NamedSharding(train.mesh, P("data"))
      batch = {
        key: jax.ShapeDtypeStruct((n * k, s["seq_len"]), jnp.int32, sharding=data)
        for key in ("inputs", "targets")
      }
      found = hlo.hlo_collectives(fn.lower(state, batch).compile().as_text())
      stages = 2 if method == "acco" else 1
      big = [c for c in found if c.bytes >= 4096]
      sent = stages * sum((c.group - 1) * c.bytes / c.group for c in big)
      small = stages * sum((c.group - 1) * c.bytes / c.group for c in found if c.bytes < 4096)
      theory = stages * comm_bytes_per_stage(train.plan, train.layout.padded_size, n)
      rows.append(
        {
          "setting": setting,
          "label": label,
          "N": n,
          "params": train.layout.num_params,
          "shard": train.layout.shard_size,
          "hlo": [f"{c.kind} {c.shape[0][0]}[{c.bytes}] x{c.group}" for c in big],
          "hlo_update": sent,
          "small_update": small,
          "theory_update": theory,
          "in_loop": sum(c.in_loop for c in found),
        }
      )
      common.log(f"N={n} {setting} {label}: {rows[-1]['hlo']} {sent:,.0f} B/update")
  return {"rows": rows}


def bytes_report(args) -> int:
  rows = []
  for n in (8, 32):
    settings = ["d8", "d32"]
    rows += common.run_worker(__spec__.name, n, ["--bytes", "--settings", *settings], 1800)["rows"]
  table, ok = [], True
  for r in rows:
    bf16 = next(
      x
      for x in rows
      if x["setting"] == r["setting"] and x["N"] == r["N"] and x["label"] == base_of(r["label"])
    )
    # XLA:CPU moves bf16 collectives as f32: the bf16 reference is its theory (exact in f32 HLO,
    # bench/dp/comm_accounting.py); the quantized programs move int8, exactly what they ask for.
    ratio = r["hlo_update"] / bf16["theory_update"]
    err = r["hlo_update"] / r["theory_update"] - 1 if mode_of(r["label"]) != "none" else 0.0
    ok &= abs(err) < 1e-9
    mode = mode_of(r["label"])
    if mode != "none" and base_of(r["label"]) == "acco":
      ok &= ratio <= TARGETS[mode][1]
    table.append(
      {
        "setting": r["setting"],
        "N": r["N"],
        "label": r["label"],
        "S": f"{r['shard']:,}",
        "colls": " + ".join(r["hlo"]),
        "hlo": f"{r['hlo_update']:,.0f}",
        "theory": f"{r['theory_update']:,.0f}",
        "err": f"{100 * err:+.3f}%" if mode != "none" else "(f32 on CPU)",
        "ratio": f"{ratio:.3f}",
        "small": f"{r['small_update']:,.0f}",
      }
    )
  cols = [
    ("setting", "setting"),
    ("N", "N"),
    ("label", "variant"),
    ("S", "shard S"),
    ("colls", "large collectives (bytes x group)"),
    ("hlo", "HLO B/update"),
    ("theory", "theory"),
    ("err", "err"),
    ("ratio", "x bf16 theory"),
    ("small", "+ small"),
  ]
  print(common.format_table(table, cols))
  print(
    f"\n{'PASS' if ok else 'FAIL'}: quantized HLO bytes = theory; ACCO int8 <= 0.55x and "
    "int4 <= 0.30x of bf16 ACCO"
  )
  path = common.write_json(
    Path(args.out) / "acco_quantized_bytes.json",
    {"machine": common.machine(), "rows": rows, "table": table, "pass": ok},
  )
  print(f"wrote {path}")
  return 0 if ok else 1


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  ap.add_argument(
    "--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS + EXTRA_SETTINGS
  )
  ap.add_argument("--labels", nargs="+", default=list(LABELS), choices=LABELS + DIAGNOSTIC)
  ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
  ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
  ap.add_argument("--collect", action="store_true", help="only collect existing runs")
  ap.add_argument("--bytes", action="store_true", help="bytes from the compiled programs")
  ap.add_argument("--cost", action="store_true", help="compute cost of quantizing")
  ap.add_argument("--reps", type=int, default=20, help="--cost: timed stages per mode")
  ap.add_argument("--out", default=str(common.RESULTS))
  ap.add_argument("--json", default="acco_quantized.json", help="results file in --out")
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    Path(args.worker).write_text(json.dumps(bytes_worker(args)))
    return 0
  if args.bytes:
    return bytes_report(args)
  if args.cost:
    return cost_report(args)
  path = Path(args.out) / args.json
  recorded = json.loads(path.read_text()) if path.exists() else None  # kept where runs are gone
  done = lambda s, label, k: k in recorded_runs(recorded, s).get(label, {})
  plan = [(s, label, k) for s in args.settings for k in args.seeds for label in args.labels]
  plan = [p for p in plan if not done(*p)]
  t0 = time.time()
  failed = [] if args.collect else conv.run_all(OUT, plan, args.jobs, args.timeout)
  results = collect(OUT, args.seeds, args.settings, recorded)
  if not args.collect:
    results["wall_s"] = time.time() - t0
  common.write_json(path, results)
  print_tables(results)
  if results["settings"]:
    extra = [s for s in args.settings if s not in SETTINGS]  # diagnostics get their own figure
    name = "_".join(["acco_quantized", *extra])
    figure(results, common.REPO / "docs" / "figures" / f"{name}.png")
  common.log(f"wrote {path}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
