"""The table of a ``jax.profiler`` trace: GPU kernel time by kind, the largest kernels, GPU-busy and
the host's gaps per stage.

Usage::

  python train.py --config configs/gpt2_acco.py:gpt2 --workdir runs/p --config.train.profile_stages=20:24
  python -m bench.gpu.profile_table runs/p/profile/plugins/profile/<time>/perfetto_trace.json.gz
  python -m bench.gpu.profile_table TRACE --top 30 --json out.json

Stages are the trainer's ``stage`` annotations (``train.profile_stages``), or in a trace without
them (a bare step's) the calls of its most frequent jitted function. A trace taken on CPU has no GPU
kernels (XLA:CPU runs programs on host threads): the table says so and lists the host's dispatches.
The reading is :mod:`acco_jax.analysis.trace`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from acco_jax.analysis import trace


def report(path: str, top: int = 20) -> dict:
  """Everything the table prints, as a dict."""
  events = trace.load(path)
  kernels = trace.gpu_kernels(events)
  out: dict = {"trace": path, "gpu_kernels": len(kernels), "stages": trace.stage_rows(events)}
  if kernels:
    kinds, names = trace.kernel_table(kernels)
    start, end = kernels[0].start, max(k.start + k.dur for k in kernels)
    frac, gaps = trace.busy(kernels, start, end)
    out.update(
      span_ms=(end - start) / 1e3,
      kernel_ms=sum(kinds.values()) / 1e3,
      gpu_busy=frac,
      by_kind_ms={k: v / 1e3 for k, v in kinds.items()},
      top=[{"kernel": n, "ms": t / 1e3, "count": c} for n, t, c in names[:top]],
      largest_gaps_ms=[g / 1e3 for _, g in gaps[:10]],
    )
  return out


def render(r: dict) -> str:
  lines = [f"trace: {r['trace']}"]
  if not r["gpu_kernels"]:
    lines.append(
      "no GPU kernels in this trace (a CPU run: XLA:CPU runs its programs on host threads); "
      "per stage, the host's dispatches only"
    )
  else:
    total = r["kernel_ms"]
    lines += [
      f"GPU: {r['gpu_kernels']} kernels, {total:.1f} ms of kernel time in a {r['span_ms']:.1f} ms "
      f"span: busy {r['gpu_busy']:.1%}; largest idle gaps (ms): "
      + ", ".join(f"{g:.2f}" for g in r["largest_gaps_ms"]),
      "",
      "| kind | ms | share |",
      "|---|---:|---:|",
      *(f"| {k} | {v:.1f} | {v / total:.1%} |" for k, v in r["by_kind_ms"].items()),
      "",
      "| ms | count | share | kernel |",
      "|---:|---:|---:|---|",
      *(
        f"| {t['ms']:.1f} | {t['count']} | {t['ms'] / total:.1%} | `{t['kernel'][:100]}` |"
        for t in r["top"]
      ),
    ]
  lines += [
    "",
    "| stage | dispatch ms | window ms | GPU busy | largest gap ms | D2H copies |",
    "|---:|---:|---:|---:|---:|---:|",
  ]
  for s in r["stages"]:
    gpu = (
      f"{s['gpu_busy']:.1%} | {s['largest_gap_ms']:.2f} | {s['d2h_copies']}"
      if s["gpu_busy"] is not None
      else "- | - | -"
    )
    lines.append(f"| {s['stage']} | {s['dispatch_ms']:.1f} | {s['window_ms']:.1f} | {gpu} |")
  if not r["stages"]:
    lines.append("| (no stage annotations or jitted calls in this trace) | | | | | |")
  return "\n".join(lines)


def trace_calls(one, keep: str, stages: int = 4) -> dict:
  """Traces ``stages`` calls of ``one`` (each annotated as a stage; it returns arrays), keeps the
  Perfetto file at ``keep``, prints its table and returns it (:func:`report`)."""
  import glob
  import shutil
  import tempfile

  import jax

  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for i in range(stages):
        with jax.profiler.StepTraceAnnotation("stage", step_num=i + 1):
          out = one()
      jax.block_until_ready(out)
    found = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)
    if not found:
      return {"error": "jax.profiler wrote no perfetto trace"}
    Path(keep).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(found[0], keep)
  r = report(keep, top=10)
  print(render(r), flush=True)
  return r


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("trace", help="a *.trace.json.gz / perfetto_trace.json.gz file")
  p.add_argument("--top", type=int, default=20, help="largest kernels listed")
  p.add_argument("--json", help="also write the table as JSON here")
  args = p.parse_args()
  try:
    r = report(args.trace, args.top)
  except (OSError, ValueError) as e:
    sys.exit(f"error: cannot read the trace {args.trace!r}: {e}")
  print(render(r))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(r, f, indent=1)


if __name__ == "__main__":
  main()
