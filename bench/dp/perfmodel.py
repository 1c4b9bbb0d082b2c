"""The step-time model (``acco_jax.analysis.perfmodel``) vs the paper's Table 3, and ACCO's speed-up curves.

For each Table 3 row (GPT-Neo 125M pre-training, GPT-Neo 2.7B fine-tuning, on A100/H100 nodes) it
predicts the wall-clock reduction of ACCO against several baselines, beside the paper's:

* ``zero1``: ZeRO-1 as this repository builds it: one bf16 reduce-scatter + all-gather per update;
* ``ref_ddp``: the reference code's baseline (acco-algorithm.md §10.2): fp32 gradients all-reduced
  after *every* microbatch, then ``ZeroRedundancyOptimizer``'s per-rank broadcasts of fp32 params;
* ``ref_ddp_bwd``: the same with each all-reduce hidden behind the backward pass as far as it fits
  (PyTorch DDP's bucketing; an upper bound on its overlap);
* ``ref_ddp_cv``: ``ref_ddp`` plus stragglers on the fine-tuning rows (Alpaca padded to the longest
  of 4: per-microbatch compute varies across workers, CV assumed 0.2; ACCO is immune).

ACCO is the reference code's adaptive ACCO (workers keep accumulating while a communication lasts,
so per microbatch it costs only compute). Two calibrations of the compute time: ``A`` from FLOPs at
a stated MFU (30%), ``B`` from the paper's own ACCO wall-clock (assuming ACCO was compute-bound).
All hardware figures are nominal datasheet numbers times a stated link efficiency; see
``ASSUMPTIONS``. The figures are drawn by ``bench/dp/perfmodel_figures.py``; ``--loco`` is
``bench/dp/perfmodel_loco.py``.

Usage::

  python -m bench.dp.perfmodel            # table on stdout, bench/results/perfmodel.json,
                                       # docs/figures/perfmodel_speedup.png (needs matplotlib)
  python -m bench.dp.perfmodel --quantized  # comm.quantize: time per update vs bandwidth on the
                                       # 4 x 8 A100 setting, the bandwidth below which ACCO stops
                                       # being compute-bound; perfmodel_quantized.{json,png}
  python -m bench.dp.perfmodel --loco     # loco.outer_overlap none vs delayed / eager for DiLoCo,
                                       # Streaming DiLoCo and SparseLoCo, 0.1 .. 400 Gbit/s, the
                                       # bandwidth below which each stops being compute-bound;
                                       # perfmodel_loco.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from acco_jax.analysis import perfmodel as pm
from acco_jax.analysis import perfmodel_quantized as pmq
from bench import common
from bench.dp import perfmodel_figures, perfmodel_loco

ASSUMPTIONS = {
  "mfu_A": 0.30,
  "link_efficiency": 0.8,  # share of the nominal link bandwidth a ring flow gets (NCCL-like)
  "latency_intra_s": 5e-6,
  "latency_inter_s": 10e-6,
  "omni_path_gbit": 100.0,  # paper §9: Omni-Path 100 Gb/s between nodes (one flow per boundary)
  "nvlink_GBps": 300.0,  # A100 NVLink, per direction (paper §9)
  "pcie5_GBps": 64.0,  # H100-PCIe: PCIe Gen5 x16 per direction (no NVLink bridge assumed)
  "peak_bf16": {"A100": 312e12, "H100-PCIe": 756e12},
  "hbm_Bps": {"A100": 2.0e12, "H100-PCIe": 2.0e12},
  "adamw_bytes_per_param": 32,  # fp32 grad, master, m, v read + written, bf16 param written
  "ft_seq_len": 512,  # 80M tokens = 3 epochs x 52,002 Alpaca rows x 512: tokens counted padded
  "ft_cv": 0.2,  # per-microbatch compute variation across workers in fine-tuning (assumed)
  # quantized communication: HBM bytes per parameter per stage of encoding the gradient rows
  # (read bf16 twice, write int8 and the float32 residual) and the weight updates (read the
  # float32 shard, decode every shard, read and write the bf16 weights): about 14
  "quant_bytes_per_param": 14,
}

# GPT-Neo: (layers, width, vocab, positions); q/k/v projections have no bias.
MODELS = {"gpt-neo-125m": (12, 768, 50257, 1024), "gpt-neo-2.7b": (32, 2560, 50257, 2048)}

ROWS = [  # paper Table 3 (acco-algorithm.md §9); times in seconds
  dict(
    row="PT 125M 1x8 H100-PCIe",
    model="gpt-neo-125m",
    gpu="H100-PCIe",
    nodes=1,
    per_node=8,
    tokens=6e9,
    k=2,
    rows=24,
    seq=1024,
    zero1_s=4 * 3600 + 41 * 60,
    acco_s=4 * 3600 + 25 * 60,
    paper=5.7,
    cv=0.0,
  ),
  dict(
    row="PT 125M 4x8 A100",
    model="gpt-neo-125m",
    gpu="A100",
    nodes=4,
    per_node=8,
    tokens=50e9,
    k=2,
    rows=24,
    seq=1024,
    zero1_s=14 * 3600 + 41 * 60,
    acco_s=10 * 3600 + 55 * 60,
    paper=25.7,
    cv=0.0,
  ),
  dict(
    row="FT 2.7B 1x8 A100",
    model="gpt-neo-2.7b",
    gpu="A100",
    nodes=1,
    per_node=8,
    tokens=80e6,
    k=4,
    rows=4,
    seq=512,
    zero1_s=43 * 60,
    acco_s=25 * 60,
    paper=42.0,
    cv=0.2,
  ),
  dict(
    row="FT 2.7B 2x4 A100",
    model="gpt-neo-2.7b",
    gpu="A100",
    nodes=2,
    per_node=4,
    tokens=80e6,
    k=4,
    rows=4,
    seq=512,
    zero1_s=3 * 3600 + 46 * 60,
    acco_s=29 * 60,
    paper=87.0,
    cv=0.2,
  ),
]
BASELINES = ("zero1", "ref_ddp", "ref_ddp_bwd", "ref_ddp_cv")


def gpt_neo_params(layers: int, width: int, vocab: int, positions: int) -> int:
  """GPT-Neo's parameter count: embeddings, 12 D² + 10 D per block (no q/k/v bias), final LN."""
  return vocab * width + positions * width + layers * (12 * width**2 + 10 * width) + 2 * width


def cluster(r: dict, inter_gbit: float | None = None) -> pm.Cluster:
  a = ASSUMPTIONS
  eff = a["link_efficiency"]
  intra_gbps = a["pcie5_GBps"] if r["gpu"] == "H100-PCIe" else a["nvlink_GBps"]
  intra = pm.Link(intra_gbps * pm.GBYTE * eff, a["latency_intra_s"])
  gbit = a["omni_path_gbit"] if inter_gbit is None else inter_gbit
  inter = pm.Link(gbit * pm.GBIT * eff, a["latency_inter_s"])
  return pm.Cluster(r["nodes"], r["per_node"], intra, inter if r["nodes"] > 1 else None)


def workload(r: dict, calibration: str, **overrides) -> tuple[pm.Workload, dict]:
  a = ASSUMPTIONS
  layers, width, vocab, positions = MODELS[r["model"]]
  psi = gpt_neo_params(layers, width, vocab, positions)
  n = r["nodes"] * r["per_node"]
  tokens_mb = r["rows"] * r["seq"]
  updates = r["tokens"] / (n * r["k"] * tokens_mb)
  flops = pm.transformer_flops_per_token(layers, width, vocab, r["seq"])
  if calibration == "A":
    t_mb = pm.microbatch_time(flops, tokens_mb, a["peak_bf16"][r["gpu"]], a["mfu_A"])
  else:  # B: the paper's ACCO wall-clock is the compute
    t_mb = r["acco_s"] / (updates * r["k"])
  mfu = flops * tokens_mb / t_mb / a["peak_bf16"][r["gpu"]]
  opt = a["adamw_bytes_per_param"] * psi / n / a["hbm_Bps"][r["gpu"]]
  work = pm.Workload(params=psi, microbatch_time=t_mb, microbatches=r["k"], opt_time=opt)
  work = dataclasses.replace(work, **overrides)
  return work, {"params": psi, "updates": updates, "microbatch_s": t_mb, "mfu": mfu, "opt_s": opt}


def predict(r: dict, calibration: str) -> dict:
  c = cluster(r)
  work, info = workload(r, calibration)
  acco = pm.step_time("acco_adaptive", work, c)
  variants = {
    "zero1": pm.step_time("zero1", work, c),
    "ref_ddp": pm.step_time("ddp_per_microbatch", work, c),
    "ref_ddp_bwd": pm.step_time(
      "ddp_per_microbatch", dataclasses.replace(work, bwd_overlap=1.0), c
    ),
    "ref_ddp_cv": pm.step_time("ddp_per_microbatch", dataclasses.replace(work, cv=r["cv"]), c),
  }
  out = {"calibration": calibration, **{k: round(v, 6) for k, v in info.items()}}
  out["acco_update_s"] = acco.time
  out["acco_h"] = acco.time * info["updates"] / 3600
  for name, base in variants.items():
    out[f"{name}_reduction"] = 100 * pm.time_reduction(base, acco)
    out[f"{name}_update_s"] = base.time
    out[f"{name}_h"] = base.time * info["updates"] / 3600
    out[f"{name}_GB_sent"] = base.bytes_sent / 1e9
  # this repository's fixed-k ACCO and DPU against its own ZeRO-1 (ideal overlap, single loop)
  static = {m: pm.step_time(m, work, c) for m in ("zero1", "dpu", "acco", "acco_single_loop")}
  out["ours_acco_vs_zero1"] = 100 * pm.time_reduction(static["zero1"], static["acco"])
  out["ours_acco_single_loop_vs_zero1"] = 100 * pm.time_reduction(
    static["zero1"], static["acco_single_loop"]
  )
  out["ours_dpu_vs_zero1"] = 100 * pm.time_reduction(static["zero1"], static["dpu"])
  for m, s in static.items():
    out[f"ours_{m}_idle"] = s.idle_fraction
  out["comm_chain_s"] = static["dpu"].comm
  return out


def sweep(gbits, workers=(2, 8, 32, 128)) -> dict:
  """ACCO / ZeRO-1 speed-up vs the inter-node bandwidth, one worker per node, A100 at 30% MFU."""
  panels = {}
  for name, r in (("PT 125M (k=2, 24x1024)", ROWS[1]), ("FT 2.7B (k=4, 4x512)", ROWS[2])):
    curves = {}
    for n in workers:
      rr = {**r, "nodes": n, "per_node": 1}
      work, _ = workload(rr, "A")
      names = ("acco", "acco_adaptive", "acco_single_loop", "dpu")
      curve = {m: [] for m in names}
      for g in gbits:
        c = cluster(rr, g)
        z = pm.step_time("zero1", work, c)
        for m in names:
          curve[m].append(pm.speedup(z, pm.step_time(m, work, c)))
      curves[n] = curve
    panels[name] = curves
  return {"gbit": list(gbits), "panels": panels}


# -- quantized communication ------------------------------------------------------------------------

QUANT_VARIANTS = {  # label -> (method, quantize, node size: None = the cluster's per node)
  "zero1": ("zero1", "none", None),
  "acco": ("acco", "none", None),
  "zero1-int8": ("zero1", "int8", None),
  "acco-int8": ("acco", "int8", None),
  "acco-int4": ("acco", "int4", None),
  "acco-int8-flat": ("acco", "int8", 1),  # every device quantizes: comm.node_size=1
}


def quantized_point(label: str, work: pm.Workload, c: pm.Cluster, t_q: float) -> dict:
  """Time per update and the network chain ``X`` (to compare with ``C/2``) of one variant."""
  method, mode, size = QUANT_VARIANTS[label]
  n, per, stages = c.workers, c.per_node, 2 if method == "acco" else 1
  ring = (n - 1) / n * work.params  # values a ring collective moves across each node boundary
  if mode == "none":
    st = pm.step_time(method, work, c)
    chain = pm.step_time("dpu", work, c).comm  # T_RS + T_opt + T_AG
    link = 2 * ring * work.comm_bytes
  else:
    st = pmq.quantized_step_time(method, work, c, mode, node_size=size, quant_time=t_q)
    wire = pmq.wire_bytes_per_value(mode)
    _, t_a2a, _ = pmq.quantized_reduce_time(c, work.params, wire, size or c.per_node)
    chain = t_a2a + work.opt_time + pm.collective_time("all_gather", c, work.params * wire)
    nodes = n // (size or per)
    a2a = (nodes - 1) / nodes if size != 1 else per * (n - per) / n
    link = (a2a * work.params + ring) * wire
  return {
    "time": st.time,
    "chain": chain,
    "sent": st.bytes_sent,
    "exposed": st.exposed,
    "link": stages * link,
  }


def compute_bound_below(label: str, r: dict, calibration: str, t_q: float) -> float:
  """The inter-node bandwidth (nominal Gbit/s) below which the network chain outlasts half an
  update's compute (ACCO stops hiding it): bisection on log-bandwidth."""
  work, _ = workload(r, calibration)
  half = work.microbatches * work.microbatch_time / 2
  lo, hi = 1e-3, 1e5
  for _ in range(200):
    mid = (lo * hi) ** 0.5
    if quantized_point(label, work, cluster(r, mid), t_q)["chain"] > half:
      lo = mid
    else:
      hi = mid
  return hi


def quantized(args) -> int:
  a, r = ASSUMPTIONS, ROWS[1]  # PT 125M on 4 x 8 A100 (the paper's 100 Gb/s setting)
  gbits = [round(10 ** (e / 32), 3) for e in range(0, 84)]  # 1 .. 400 Gbit/s
  out = {"machine": common.machine(), "assumptions": a, "row": r, "gbit": gbits}
  rows, thresholds = [], []
  for cal in ("A", "B"):
    work, info = workload(r, cal)
    t_q = a["quant_bytes_per_param"] * info["params"] / a["hbm_Bps"][r["gpu"]]
    curves = {
      label: [quantized_point(label, work, cluster(r, g), t_q)["time"] for g in gbits]
      for label in QUANT_VARIANTS
    }
    below = {
      label: compute_bound_below(label, r, cal, t_q)
      for label in QUANT_VARIANTS
      if label.startswith("acco")
    }
    out[cal] = {
      "info": info,
      "quant_time_s": t_q,
      "compute_s": work.microbatches * work.microbatch_time,
      "curves": curves,
      "compute_bound_below_gbit": below,
    }
    for g in (100, 10):
      pts = {label: quantized_point(label, work, cluster(r, g), t_q) for label in QUANT_VARIANTS}
      base = pts["zero1"]["time"]
      for label, p in pts.items():
        rows.append(
          {
            "cal": cal,
            "gbit": g,
            "label": label,
            "t": f"{1e3 * p['time']:.0f}",
            "vs": f"{base / p['time']:.2f}",
            "chain": f"{1e3 * p['chain']:.0f}",
            "half": f"{1e3 * out[cal]['compute_s'] / 2:.0f}",
            "gb": f"{p['sent'] / 1e9:.3f}",
            "link": f"{p['link'] / 1e9:.3f}",
          }
        )
    for label, g in below.items():
      thresholds.append(
        {
          "cal": cal,
          "mfu": f"{100 * info['mfu']:.0f}%",
          "label": label,
          "gbit": f"{g:.1f}",
          "x": f"{below['acco'] / g:.2f}",
        }
      )
  print(
    "GPT-Neo 125M pre-training on 4 x 8 A100 (NVLink inside, one inter-node link per node),"
    " k = 2 x 24 x 1024 tokens per update; quantized: blocks of 256, two-level unless flat\n"
  )
  print(
    common.format_table(
      rows,
      [
        ("cal", "cal."),
        ("gbit", "Gbit/s"),
        ("label", "variant"),
        ("t", "ms/update"),
        ("vs", "speed-up vs ZeRO-1"),
        ("chain", "network chain X ms"),
        ("half", "C/2 ms"),
        ("gb", "GB sent/device/update"),
        ("link", "GB over a node's link/update"),
      ],
    )
  )
  print(
    "\nBandwidth below which ACCO stops being compute-bound (X > C/2), and how much lower "
    "quantization moves it\n"
  )
  print(
    common.format_table(
      thresholds,
      [
        ("cal", "cal."),
        ("mfu", "MFU"),
        ("label", "variant"),
        ("gbit", "compute-bound above, Gbit/s"),
        ("x", "x lower than bf16 ACCO"),
      ],
    )
  )
  out["table"], out["thresholds"] = rows, thresholds
  drew = perfmodel_figures.plot_quantized(out, Path(args.figure))
  path = common.write_json(Path(args.out), out)
  print(f"\nwrote {path}" + (f" and {args.figure}" if drew else ""))
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="default bench/results/perfmodel[_quantized].json")
  ap.add_argument("--figure", default=None, help="default docs/figures/perfmodel_*.png")
  ap.add_argument("--quantized", action="store_true", help="the comm.quantize variants")
  ap.add_argument("--loco", action="store_true", help="the LoCo family's outer overlaps")
  args = ap.parse_args(argv)
  name = "perfmodel_quantized" if args.quantized else "perfmodel_loco" if args.loco else "perfmodel"
  args.out = args.out or str(common.RESULTS / f"{name}.json")
  figure = "perfmodel_quantized.png" if args.quantized else "perfmodel_speedup.png"
  args.figure = args.figure or str(common.REPO / "docs" / "figures" / figure)
  if args.quantized:
    return quantized(args)
  if args.loco:
    return perfmodel_loco.loco(args)

  results = []
  for cal in ("A", "B"):
    for r in ROWS:
      p = predict(r, cal)
      p.update(row=r["row"], paper=r["paper"])
      p["agree"] = {b: abs(p[f"{b}_reduction"] - r["paper"]) <= 10 for b in BASELINES}
      results.append(p)
  fmt = lambda x: f"{x:.1f}"
  table_rows, hours_rows = [], []
  for p in results:
    r = next(x for x in ROWS if x["row"] == p["row"])
    row = {
      "cal": p["calibration"],
      "row": p["row"],
      "mfu": f"{100 * p['mfu']:.0f}%",
      "paper": fmt(p["paper"]),
      "ours": fmt(p["ours_acco_vs_zero1"]),
      "ours1": fmt(p["ours_acco_single_loop_vs_zero1"]),
    }
    for b in BASELINES:
      row[b] = fmt(p[f"{b}_reduction"]) + ("" if p["agree"][b] else " ✗")
    table_rows.append(row)
    if p["calibration"] == "B":
      h = lambda x: f"{x:.2f}"
      hours_rows.append(
        {
          "row": p["row"],
          "paper_zero1": h(r["zero1_s"] / 3600),
          "paper_acco": h(r["acco_s"] / 3600),
          "zero1": h(p["zero1_h"]),
          "ref_ddp": h(p["ref_ddp_h"]),
          "ref_ddp_bwd": h(p["ref_ddp_bwd_h"]),
          "ref_ddp_cv": h(p["ref_ddp_cv_h"]),
        }
      )
  columns = [
    ("cal", "cal."),
    ("row", "Table 3 row"),
    ("mfu", "MFU"),
    ("paper", "paper %"),
    ("zero1", "vs ZeRO-1 %"),
    ("ref_ddp", "vs ref DDP %"),
    ("ref_ddp_bwd", "+bwd overlap %"),
    ("ref_ddp_cv", "+stragglers %"),
    ("ours", "ours: ACCO vs ZeRO-1, ideal %"),
    ("ours1", "ours: single loop %"),
  ]
  print("Predicted wall-clock reduction of (adaptive) ACCO, % (✗: more than 10 points off)\n")
  print(common.format_table(table_rows, columns))
  score = {b: sum(p["agree"][b] for p in results) for b in BASELINES}
  print(f"\nrows within ±10 points (of {len(results)}): {score}")
  print(
    "\nBaseline wall-clock, hours: paper vs model (calibration B: compute = paper's ACCO time)\n"
  )
  print(
    common.format_table(
      hours_rows,
      [
        ("row", "Table 3 row"),
        ("paper_acco", "paper ACCO"),
        ("paper_zero1", "paper baseline"),
        ("zero1", "ZeRO-1"),
        ("ref_ddp", "ref DDP"),
        ("ref_ddp_bwd", "+bwd overlap"),
        ("ref_ddp_cv", "+stragglers"),
      ],
    )
  )

  gbits = [round(10 ** (e / 32), 3) for e in range(0, 97)]  # 1 .. 1000 Gbit/s
  sw = sweep(gbits)
  drew = perfmodel_figures.plot(sw, Path(args.figure))
  data = {
    "machine": common.machine(),
    "assumptions": ASSUMPTIONS,
    "rows": ROWS,
    "predictions": results,
    "agreement": score,
    "sweep": sw,
    "figure": args.figure if drew else None,
  }
  path = common.write_json(Path(args.out), data)
  print(f"\nwrote {path}" + (f" and {args.figure}" if drew else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
