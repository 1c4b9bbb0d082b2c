"""DiLoCo and Streaming DiLoCo against DDP at CPU scale: convergence per token and bytes on the wire.

Two parts, both written to ``bench/results/loco.json``:

* **Convergence** (``bench/dp/convergence.py``'s settings ``loco-m4`` and ``loco-m8``): the d8 model and
  per-device batch of the ACCO convergence benchmark on 8 simulated devices, as M = 4 workers of 2
  devices or M = 8 of 1, 400 inner steps at equal tokens: DDP (one all-reduce every step), DiLoCo
  with H = 10 and 50, and Streaming DiLoCo with H = 50 (2 fragments, FP4, τ = 1, α = 0.5), 3 seeds.
  Every run is a ``train.py`` run in its own process (resumable: a run with a ``result.json`` is
  skipped); evaluation is on the global parameters ``θ_g``.
* **Communication from the compiled HLO** (``--comm``): the programs of each method are compiled on
  the CPU for the same model and mesh, and the collectives that cross workers are read from the HLO
  (for DDP: its per-step all-reduce). Bytes per worker per token and peak bytes per sync, against
  ``loco-family.md`` §6: DDP ``2 P b`` per step, DiLoCo ``2 P b`` per H steps, Streaming
  ``2 (P / P_f) 4`` bits per H/P steps. XLA:CPU runs the FP4 payload as the float32 all-reduce it
  emulates, so the HLO bytes are float32; the FP4 bytes are the payload accounting (4 bits a value
  plus one 8-bit scale per block).

Usage::

  python -m bench.loco.loco --jobs 2          # convergence (about 1 h on 2 cores) + comm + figure
  python -m bench.loco.loco --collect         # rebuild the JSON, the table and the figure
  python -m bench.loco.loco --comm-only       # only the HLO accounting
  python -m bench.loco.loco --sweep           # outer lr / momentum sweep, M = 4, 150 steps, seed 0
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import common
from bench.dp import convergence

SETTINGS = ("loco-m4", "loco-m8")
FIGURE = common.REPO / "docs" / "figures" / "loco_convergence.png"


SWEEP = (
  ("ddp", 0.7, 0.9),
  ("diloco-h10", 0.7, 0.9),
  ("diloco-h10", 1.0, 0.0),
  ("diloco-h10", 0.7, 0.5),
  ("diloco-h10", 0.3, 0.9),
  ("diloco-h10", 1.0, 0.5),
  ("diloco-h10", 1.4, 0.0),
  ("diloco-h50", 0.7, 0.9),
  ("diloco-h50", 1.0, 0.0),
)


def sweep_worker(args) -> None:
  """One sweep point in a child with 8 CPU devices: loco-m4, 150 steps, seed 0."""
  import tempfile

  from acco_jax.run import trainer

  label, lr, momentum = args.sweep_point.split(",")
  c = convergence.make_config("loco-m4", label, 0)
  c.loco.outer_lr, c.loco.outer_momentum = float(lr), float(momentum)
  c.train.num_updates = c.train.eval_every = 150
  c.train.log_every = 50
  with tempfile.TemporaryDirectory() as tmp:
    summary = trainer.train_and_evaluate(c, tmp)
  common.write_json(
    args.worker_out,
    {
      "label": label,
      "outer_lr": float(lr),
      "outer_momentum": float(momentum),
      "eval_loss": summary["eval_loss"],
    },
  )


def run_sweep() -> list[dict]:
  import subprocess
  import tempfile
  from pathlib import Path

  rows = []
  for label, lr, mom in SWEEP:
    with tempfile.TemporaryDirectory() as tmp:
      out = Path(tmp) / "point.json"
      subprocess.run(
        [
          *common.module_command(__spec__.name),
          "--worker-out",
          str(out),
          "--sweep-point",
          f"{label},{lr},{mom}",
        ],
        env=common.cpu_env(8),
        check=True,
        cwd=common.REPO,
      )
      rows.append(json.loads(out.read_text()))
      common.log(
        f"{label:12s} outer lr {lr:.1f} momentum {mom:.1f}: eval {rows[-1]['eval_loss']:.4f}"
      )
  return rows


def comm_worker(args) -> None:
  """In a child with 8 CPU devices: compile each method's programs and count cross-worker bytes."""
  import jax

  from acco_jax.analysis import hlo
  from acco_jax.loco.step import LocoStep
  from acco_jax.run import build

  out = {}
  for setting in SETTINGS:
    s = convergence.SETTINGS[setting]
    for label in s["methods"]:
      config = convergence.make_config(setting, label, 0)
      run = build.build(config)
      tokens = convergence.tokens_per_update(s)
      params = run.params_shapes
      if not isinstance(
        run.step, LocoStep
      ):  # DDP: the stage's all-reduce over every device, every step
        state = run.step.abstract_state(params)
        fn = run.step.stage_program("sync", state)
        batch = {
          k: jax.ShapeDtypeStruct(
            (tokens // s["seq_len"], s["seq_len"]),
            "int32",
            sharding=run.step._sharding(jax.P("data")),
          )
          for k in ("inputs", "targets")
        }
        text = fn.lower(state, batch).compile().as_text()
        found = [c for c in hlo.hlo_collectives(text) if c.kind == "all-reduce"]
        per_step = max(c.bytes for c in found)
        out[label] = {
          "hlo_bytes_per_sync": per_step,
          "syncs_per_step": 1.0,
          "params": run.step.layout.num_params,
          "padded": run.step.layout.padded_size,
        }
        continue
      train, m = run.step, run.step.method
      state = train.abstract_state(params)
      comps = []
      for p in range(len(train.parts)):
        text = train.program("sync", p, state).lower(state).compile().as_text()
        comps.append(hlo.bytes_across(text, train.num_devices))
      out[f"{label}@{setting}"] = {
        "workers": train.num_workers,
        "hlo_bytes_per_sync": comps,  # per fragment: float32 on the wire in the CPU module
        "accounted_bytes_per_sync": [train.wire_bytes(p) for p in range(len(train.parts))],
        "fragment_values": train.fragment_sizes(),
        "syncs_per_step": len(train.parts) / m.sync_every,
        "sync_every": m.sync_every,
        "quantize": m.compressor.name,
        "params": train.layout.num_params,
      }
  common.write_json(args.worker_out, out)


def comm_table(raw: dict, tokens_per_step: int) -> dict:
  """Bytes per worker per token and peak per sync, HLO and accounted, against §6's formulas."""
  ddp = raw["ddp"]
  ring = lambda m: 2 * (m - 1) / m  # a ring all-reduce sends 2 (M-1)/M of the payload
  p_pad = ddp["padded"]
  ddp_fp32 = ring(8) * 4 * p_pad / tokens_per_step  # DDP's fp32 all-reduce over 8 devices
  rows = {
    "ddp": {
      "bytes_per_token": ddp_fp32,
      "peak_per_sync": ring(8) * 4 * p_pad,
      "hlo_bytes_per_sync": ddp["hlo_bytes_per_sync"],
      "ratio_to_ddp_fp32": 1.0,
    }
  }
  for key, r in raw.items():
    if key == "ddp":
      continue
    m = r["workers"]
    # the HLO counts one device's buffer; a worker's D devices each send their 1/D share
    per_worker_hlo = [ring(m) * b * (8 // m) for b in r["hlo_bytes_per_sync"]]
    per_token = sum(r["accounted_bytes_per_sync"]) / r["sync_every"] / tokens_per_step
    theory_bits = 4 if r["quantize"] == "fp4" else 32
    theory = ring(m) * theory_bits / 8 * sum(r["fragment_values"]) / r["sync_every"]
    rows[key] = {
      "bytes_per_token": per_token,
      "bytes_per_token_theory": theory / tokens_per_step,
      "peak_per_sync": max(r["accounted_bytes_per_sync"]),
      "hlo_bytes_per_sync": per_worker_hlo,
      "accounted_bytes_per_sync": r["accounted_bytes_per_sync"],
      "ratio_to_ddp_fp32": per_token / ddp_fp32,
      "ratio_times_H": per_token / ddp_fp32 * r["sync_every"],
    }
  return rows


def figure(results: dict) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(SETTINGS), figsize=(11, 4), sharey=True)
  for ax, setting in zip(axes, SETTINGS, strict=True):
    r = results["settings"].get(setting)
    if not r:
      continue
    runs = dict(r["runs"])
    if "ddp" not in runs and "loco-m4" in results["settings"]:  # loco-m8 shares loco-m4's DDP
      runs = {"ddp": results["settings"]["loco-m4"]["runs"]["ddp"], **runs}
    labels = convergence.SETTINGS["loco-m4"]["methods"]  # one colour per label in both panels
    for label, seeds in runs.items():
      color = f"C{labels.index(label)}" if label in labels else None
      curves = [v["eval"] for v in seeds.values()]
      n = min(len(c["loss"]) for c in curves)
      mean = [sum(c["loss"][i] for c in curves) / len(curves) for i in range(n)]
      ax.plot(curves[0]["tokens"][:n], mean, label=label, marker=".", color=color)
    ax.set_title(f"{setting}: M = {convergence.SETTINGS[setting]['workers']}")
    ax.set_xlabel("tokens")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("eval loss (mean of seeds)")
  axes[0].legend()
  fig.tight_layout()
  FIGURE.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(FIGURE, dpi=110)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--jobs", type=int, default=1)
  ap.add_argument("--seeds", nargs="+", type=int, default=list(convergence.SEEDS))
  ap.add_argument("--collect", action="store_true")
  ap.add_argument("--comm-only", action="store_true")
  ap.add_argument("--sweep", action="store_true", help="only the outer lr / momentum sweep")
  ap.add_argument("--worker-out", help=argparse.SUPPRESS)
  ap.add_argument("--sweep-point", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker_out:
    (sweep_worker if args.sweep_point else comm_worker)(args)
    return 0
  if args.sweep:
    rows = run_sweep()
    path = common.write_json(
      common.RESULTS / "loco_outer_sweep.json",
      {"machine": common.machine(), "setting": "loco-m4, 150 steps, seed 0", "points": rows},
    )
    common.log(f"wrote {path}")
    return 0
  path = common.RESULTS / "loco.json"
  failed = 0
  if not args.comm_only:
    conv = [
      "--settings",
      *SETTINGS,
      "--seeds",
      *map(str, args.seeds),
      "--jobs",
      str(args.jobs),
      "--json",
      "loco_convergence.json",
    ] + (["--collect"] if args.collect else [])
    failed = convergence.main(conv)
  conv_file = common.RESULTS / "loco_convergence.json"
  conv_results = json.loads(conv_file.read_text()) if conv_file.exists() else None
  raw = _comm()
  s = convergence.SETTINGS["loco-m4"]
  results = {
    "machine": common.machine(),
    "convergence": conv_results,
    "comm": comm_table(raw, convergence.tokens_per_update(s)),
    "comm_raw": raw,
  }
  common.write_json(path, results)
  if conv_results:
    figure(conv_results)
  for key, r in results["comm"].items():
    common.log(
      f"{key:28s} bytes/token {r['bytes_per_token']:10.2f}  x DDP fp32 "
      f"{r['ratio_to_ddp_fp32']:.4f}  peak/sync {r['peak_per_sync']:,.0f}"
    )
  common.log(f"wrote {path}" + (f" and {FIGURE}" if conv_results else ""))
  return 1 if failed else 0


def _comm() -> dict:
  import subprocess
  import tempfile
  from pathlib import Path

  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "comm.json"
    subprocess.run(
      common.module_command(__spec__.name, "--worker-out", str(out)),
      env=common.cpu_env(8),
      check=True,
      cwd=common.REPO,
    )
    return json.loads(out.read_text())


if __name__ == "__main__":
  sys.exit(main())
