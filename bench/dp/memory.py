"""Per-device memory of the train state and of the compiled stage program, compile only.

For each method (ddp, zero1, dpu, wp, acco) and data-parallel size N, builds the stage program of
:func:`acco_jax.make_train_step` for GPT-2-124M-shaped parameters (``jax.eval_shape`` of
``init_params``: nothing is materialised), lowers it with ``ShapeDtypeStruct`` inputs that carry their
shardings and compiles it for N simulated CPU devices. Nothing runs. Reports:

* state bytes per device: the sum over the state's leaves of one addressable shard
  (``sharding.shard_shape``), split into compute weights ``w``, gradient buffer ``buf``, fp32 master,
  Adam moments and ACCO/WP's committed copy, next to the paper's formula (acco-algorithm.md §7) and to
  the formula of this layout;
* ``compiled.memory_analysis()``: argument, output, alias and temp bytes; the temp bytes are split by
  what the largest buffer of each region of XLA's temp allocation is (read from XLA's buffer-assignment
  dump): Ψ-long flat buffers, parameter-shaped buffers (the fp32 accumulator carry, gradients,
  optimizer temporaries) and the rest (activations, logits);
* lower and compile time, and the peak RSS of the worker process.

Each device count runs in its own process (``--xla_force_host_platform_device_count`` is read once).

Usage::

  python -m bench.dp.memory                 # GPT-2 124M, N = 8 and 64, all methods
  python -m bench.dp.memory --smoke --out /tmp/memory.json   # 1-layer tiny model, N = 2 and 4 (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import common

METHODS = ("ddp", "zero1", "dpu", "wp", "acco")
DELAYED = ("dpu", "wp", "acco")
MIB = 2**20


def paper_formula(method: str, n: int) -> float:
  """Bytes per parameter per device, acco-algorithm.md §7 (K = 12)."""
  if method == "ddp":
    return 2 + 2 + 12
  if method == "zero1":
    return 2 + 2 + 12 / n
  return 2 + 2 + 2 + 12 / n


def layout_formula(method: str, n: int) -> float:
  """Bytes per parameter per device of this library's state (padding ignored).

  bf16 compute weights ``w`` (2, replicated); bf16 gradient buffer ``buf`` (2, delayed methods only:
  each device holds its own full-length row); fp32 master (4/N, or 4 replicated for DDP); Adam m, v
  (8/N, or 8 for DDP); ACCO/WP's committed fp32 master (4/N). No persistent accumulator: the
  microbatch loop's fp32 carry is a temporary of the program.
  """
  if method == "ddp":
    return 2 + 4 + 8
  per = 2 + 12 / n
  if method in DELAYED:
    per += 2
  if method in ("acco", "wp"):
    per += 4 / n
  return per


# -- XLA buffer assignment ------------------------------------------------------------------------

_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)")
_DIMS = re.compile(r"^\w+\[([\d,]*)\]")


def _numel(shape: str) -> int:
  m = _DIMS.match(shape.strip())
  if not m:
    return 0
  return math.prod(int(d) for d in m.group(1).split(",") if d)


def temp_breakdown(text: str, psi: int, param_numels: set[int]) -> dict:
  """Splits XLA's preallocated temp buffer into regions and labels each by its largest value.

  Values whose ``[offset, offset + size)`` overlap share memory at different times; a region is a
  maximal run of overlapping values, so the regions partition the used temp bytes. Categories:
  ``flat`` (largest value has >= 0.9 Ψ elements: the flat gradient buffer, reduce-scatter input,
  all-gather output), ``param_shaped`` (its element count is that of a parameter leaf, a shard chunk
  or a shard row: fp32 accumulator carry, gradients, optimizer temporaries) and ``other``
  (activations, logits, scalars).
  """
  values, inside = [], False
  for line in text.splitlines():
    if line.startswith("allocation "):
      inside = "preallocated-temp" in line
      continue
    if inside:
      m = _VALUE.search(line)
      if m:
        size, offset = int(m.group(2)), int(m.group(3))
        values.append((offset, offset + size, size, m.group(1), m.group(4).split("{")[0]))
  values.sort()
  regions = []
  for v in values:
    if regions and v[0] < regions[-1]["end"]:
      r = regions[-1]
      r["end"] = max(r["end"], v[1])
      r["values"].append(v)
    else:
      regions.append({"start": v[0], "end": v[1], "values": [v]})
  cats = {"flat": 0, "param_shaped": 0, "other": 0}
  top = []
  for r in regions:
    big = max(r["values"], key=lambda v: v[2])
    n = _numel(big[4])
    cat = "flat" if n >= 0.9 * psi else "param_shaped" if n in param_numels else "other"
    size = r["end"] - r["start"]
    cats[cat] += size
    top.append({"bytes": size, "category": cat, "largest": f"{big[4]} {big[3]}"})
  top.sort(key=lambda t: -t["bytes"])
  return {"bytes_by_category": cats, "regions": len(regions), "top_regions": top[:6]}


# -- worker -----------------------------------------------------------------------------------------


def abstract_inputs(train, rows: int, seq: int):
  """The batch as ``ShapeDtypeStruct`` s sharded over the data axis: ``rows`` rows of ``seq``
  tokens per device (one microbatch), for lowering ``train``'s stage program."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  n, data = train.num_devices, NamedSharding(train.mesh, P("data"))
  batch = {
    k: jax.ShapeDtypeStruct((n * rows, seq), jnp.int32, sharding=data)
    for k in ("inputs", "targets")
  }
  return batch


def program_bytes(compiled) -> dict:
  """``compiled.memory_analysis()``: argument, output, alias, temp bytes and the program's total
  (argument + output − alias + temp)."""
  ma = compiled.memory_analysis()
  mem = {
    "argument": ma.argument_size_in_bytes,
    "output": ma.output_size_in_bytes,
    "alias": ma.alias_size_in_bytes,
    "temp": ma.temp_size_in_bytes,
  }
  mem["total"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
  return mem


def worker(args) -> dict:
  import jax
  import optax

  import acco_jax
  from acco_jax import model

  n = jax.device_count()
  overrides = {"N": args.layers} if args.layers else {}
  cfg = model.get_config(args.model, **overrides)
  params = jax.eval_shape(lambda: model.init_params(cfg, 0))
  psi = model.num_params(params)
  mesh = jax.make_mesh((n,), ("data",))
  loss = lambda p, b: model.loss_fn(p, cfg, b)
  rows = []
  for method in args.methods:
    tx = acco_jax.get_method(method, optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    train = acco_jax.make_train_step(
      loss, tx, mesh, num_microbatches=1, params=params, has_aux=True
    )
    state = train.abstract_state(params)
    kind = "delayed" if train.plan.delayed else "sync"
    fn = train.stage_program(kind, state)
    batch = abstract_inputs(train, args.rows, args.seq)
    committed = acco_jax.committed_params(state.opt_state, None)
    comp = {
      "w": common.shard_bytes(state.w),
      "buf": common.shard_bytes((state.buf, state.buf_count)),
      "master": common.shard_bytes(state.params),
      "committed": 0 if committed is None else common.shard_bytes(committed),
      "stage": common.shard_bytes(state.stage),
    }
    comp["opt"] = common.shard_bytes(state.opt_state) - comp["committed"]
    state_bytes = common.shard_bytes(state)
    assert state_bytes == sum(comp.values()), (state_bytes, comp)

    t0 = time.perf_counter()
    lowered = fn.lower(state, batch)
    t1 = time.perf_counter()
    dump = Path(tempfile.mkdtemp(prefix="acco_mem_"))
    options = {"xla_dump_to": str(dump)} if args.breakdown else None
    try:
      compiled = lowered.compile(compiler_options=options)
      t2 = time.perf_counter()
      breakdown = None
      if args.breakdown:
        files = sorted(dump.glob("*jit_stage*after_optimizations-buffer-assignment.txt"))
        if files:
          layout = train.layout
          numels = {s.size for s in layout.specs} | {s.chunk for s in layout.specs}
          numels |= {n * s.chunk for s in layout.specs} | {layout.shard_size}
          breakdown = temp_breakdown(files[-1].read_text(), psi, numels)
    finally:
      shutil.rmtree(dump, ignore_errors=True)
    mem = program_bytes(compiled)
    input_bytes = common.shard_bytes(batch)
    rows.append(
      {
        "method": method,
        "N": n,
        "psi": psi,
        "state_bytes": state_bytes,
        "state_components": comp,
        "state_per_param": state_bytes / psi,
        "layout_formula_per_param": layout_formula(method, n),
        "paper_formula_per_param": paper_formula(method, n),
        "ratio_to_paper": state_bytes / (paper_formula(method, n) * psi),
        "ratio_to_layout": state_bytes / (layout_formula(method, n) * psi),
        "compiled": mem,
        "argument_minus_inputs": mem["argument"] - input_bytes,
        "temp_breakdown": breakdown,
        "lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
      }
    )
    common.log(
      f"  N={n} {method}: state {state_bytes / MIB:.1f} MiB, temp {mem['temp'] / MIB:.1f} MiB, "
      f"compile {t2 - t1:.1f} s"
    )
    del compiled, lowered
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"N": n, "model": dataclasses.asdict(cfg), "psi": psi, "max_rss_bytes": rss, "rows": rows}


# -- report -----------------------------------------------------------------------------------------


def tables(rows: list[dict]) -> str:
  fmt = lambda x: f"{x:.2f}"
  main, comps, temps = [], [], []
  for r in rows:
    psi, mem = r["psi"], r["compiled"]
    ratio = r["ratio_to_paper"]
    main.append(
      {
        "method": r["method"],
        "N": r["N"],
        "state": f"{r['state_bytes'] / MIB:.1f}",
        "state_psi": fmt(r["state_per_param"]),
        "layout": fmt(r["layout_formula_per_param"]),
        "paper": fmt(r["paper_formula_per_param"]),
        "ratio": f"{ratio:.3f}",
        "within": "yes" if abs(ratio - 1) <= 0.1 else "no",
        "le": "yes" if ratio <= 1.1 else "no",
        "temp": f"{mem['temp'] / MIB:.1f}",
        "temp_psi": fmt(mem["temp"] / psi),
        "total_psi": fmt(mem["total"] / psi),
        "compile": f"{r['compile_s']:.1f}",
      }
    )
    c = r["state_components"]
    comps.append(
      {"method": r["method"], "N": r["N"]}
      | {k: f"{c[k] / psi:.3f}" for k in ("w", "buf", "master", "opt", "committed")}
      | {"arg": "yes" if r["argument_minus_inputs"] == r["state_bytes"] else "NO"}
    )
    b = r["temp_breakdown"]
    if b:
      cat = b["bytes_by_category"]
      t = b["top_regions"][0]
      temps.append(
        {"method": r["method"], "N": r["N"]}
        | {k: f"{cat[k] / psi:.2f}" for k in ("flat", "param_shaped", "other")}
        | {"top": f"{t['bytes'] / MIB:.0f} MiB: {t['largest']}"}
      )
  out = [
    "State per device (MiB and bytes/Ψ) against acco-algorithm.md §7, and the compiled stage program",
    common.format_table(
      main,
      [
        ("method", "method"),
        ("N", "N"),
        ("state", "state MiB"),
        ("state_psi", "state/Ψ"),
        ("layout", "layout formula"),
        ("paper", "paper formula"),
        ("ratio", "state/paper"),
        ("within", "|−1| ≤ 10%"),
        ("le", "≤ 1.1×"),
        ("temp", "temp MiB"),
        ("temp_psi", "temp/Ψ"),
        ("total_psi", "program/Ψ"),
        ("compile", "compile s"),
      ],
    ),
    "",
    "State components (bytes/Ψ per device); arg = memory_analysis argument bytes − batch == state",
    common.format_table(
      comps,
      [
        ("method", "method"),
        ("N", "N"),
        ("w", "w bf16"),
        ("buf", "buf bf16"),
        ("master", "master f32"),
        ("opt", "Adam m,v"),
        ("committed", "committed f32"),
        ("arg", "arg"),
      ],
    ),
  ]
  if temps:
    out += [
      "",
      "Temp bytes by region (bytes/Ψ), from XLA's buffer assignment; largest region",
      common.format_table(
        temps,
        [
          ("method", "method"),
          ("N", "N"),
          ("flat", "flat Ψ-long"),
          ("param_shaped", "param-shaped"),
          ("other", "other"),
          ("top", "largest region"),
        ],
      ),
    ]
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, nargs="+", default=[8, 64])
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  p.add_argument("--model", default="gpt2")
  p.add_argument("--layers", type=int, default=0, help="override the number of blocks (0: keep)")
  p.add_argument("--seq", type=int, default=128, help="tokens per row")
  p.add_argument("--rows", type=int, default=1, help="rows per device (one microbatch)")
  p.add_argument("--no-breakdown", dest="breakdown", action="store_false")
  p.add_argument("--timeout", type=float, default=900, help="seconds per device count")
  p.add_argument(
    "--smoke", action="store_true", help="1-layer tiny model, zero1/acco, N = 2, 4 (CI)"
  )
  p.add_argument("--out", type=Path, default=common.RESULTS / "memory.json")
  p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    args.model, args.devices, args.seq, args.layers = "tiny", [2, 4], 32, 1
    args.methods = ["zero1", "acco"]
  if args.worker:
    common.write_json(args.worker, worker(args))
    return 0

  started, load_start = time.perf_counter(), common.loadavg()
  fwd = ["--model", args.model, "--seq", str(args.seq), "--rows", str(args.rows)]
  fwd += ["--methods", *args.methods, "--layers", str(args.layers)]
  fwd += [] if args.breakdown else ["--no-breakdown"]
  runs, failures = common.run_each(
    __spec__.name, "memory", args.devices, lambda n: fwd, lambda n: n, args.timeout
  )
  rows = [r for run in runs for r in run["rows"]]
  result = {
    "benchmark": "memory",
    "command": "python -m bench.dp.memory" + (" --smoke" if args.smoke else ""),
    "machine": common.machine() | {"loadavg_1m_at_start": load_start},
    "config": {
      "model": args.model,
      "layers": args.layers or None,
      "seq": args.seq,
      "rows_per_device": args.rows,
      "num_microbatches": 1,
      "optimizer": "adamw",
      "methods": args.methods,
      "devices": args.devices,
    },
  }
  report = tables(rows) if rows else "no results"
  return common.finish_runs(
    args.out,
    result,
    runs,
    failures,
    report,
    name_of=lambda run: f"N={run['N']}",
    psi_of=lambda run: run["psi"],
    started=started,
    load_start=load_start,
  )


if __name__ == "__main__":
  sys.exit(main())
