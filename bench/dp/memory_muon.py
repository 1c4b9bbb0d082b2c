r"""Optimizer state per device under Muon's owner layout (issue 39), compile only.

For each size preset, builds the data-parallel step exactly as ``train.py`` would for
``configs/gpt2_<method>.py:<preset>`` with ``opt.name`` set (:func:`acco_jax.dp.build.method`: the
inner optimizer, ``comm.layout=auto`` resolved, the owned leaves ``model.muon_mask``), on ``N``
simulated CPU devices, and reads the abstract train state's shardings (``jax.eval_shape``: nothing is
materialised, nothing runs). Rows: ddp + adamw, ddp + muon (whole leaves, ``TreeLayout``), zero1 and
acco + adamw (elementwise, ``FlatLayout``), zero1 and acco + muon (owner, ``OwnerLayout``). Reports per
device:

* state bytes (one addressable shard of every leaf, :func:`common.shard_bytes`): optimizer state
  (without ACCO's committed master, shown apart), fp32 master, bf16 compute weights ``w``, the delayed
  methods' bf16 gradient buffer, their total;
* the layout: row length ``R`` (elements each device owns; elementwise: ``S``), padding
  (``N R − Ψ`` elements; the owner layout's empty slots, :attr:`OwnerLayout.padding`, apart), bytes
  each device sends per update with ring collectives
  (:func:`acco_jax.dp.plan.comm_bytes_per_stage`, 2 stages per ACCO update), and the owner
  layout's real owned bytes per device (:attr:`OwnerLayout.loads`, max and min) against its largest
  matrix;
* for the presets in ``--compile``: ``compiled.memory_analysis()`` of the stage program lowered with
  one microbatch of ``--rows`` x ``--seq`` tokens per device (as ``bench/dp/memory.py``).

Each preset runs in its own worker process (``--xla_force_host_platform_device_count`` is read once).

Usage::

  python -m bench.dp.memory_muon             # gpt2 (compiled) and gpt2-medium (state only), N = 8
  python -m bench.dp.memory_muon --smoke --out /tmp/memory_muon.json   # tiny preset, state only (CI)
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import resource
import sys
import time
from pathlib import Path

from bench import common
from bench.dp import memory

ROWS = (
  ("ddp", "adamw"),
  ("ddp", "muon"),
  ("zero1", "adamw"),
  ("zero1", "muon"),
  ("acco", "adamw"),
  ("acco", "muon"),
)
VOCAB = {"gpt2": 50257, "byte": 257}  # the presets' tokenizers (data.tokenizer), without the corpus
MIB = 2**20


def build(preset: str, method: str, opt: str, n: int):
  """(config, model config, parameter shapes, train step): what ``train.py`` builds for
  ``configs/gpt2_<method>.py:<preset>`` with ``opt.name=opt`` on ``n`` devices (one microbatch)."""
  import jax

  from acco_jax import model, parallel
  from acco_jax.dp import build as dp_build
  from acco_jax.dp import layouts
  from acco_jax.dp.step import make_train_step
  from acco_jax.run import build as run_build

  config = importlib.import_module(f"configs.gpt2_{method}").get_config(preset)
  config.opt.name = opt
  model_cfg = run_build.model_config(config, VOCAB[config.data.tokenizer])
  shapes = jax.eval_shape(lambda: model.init_params(model_cfg, 0))
  mesh = parallel.make_mesh(n)
  tx, owned = dp_build.method(config, n, shapes)
  loss = lambda p, b: model.loss_fn(p, model_cfg, b)
  train = make_train_step(
    loss,
    tx,
    mesh,
    num_microbatches=1,
    params=shapes,
    has_aux=True,
    owned=owned,
    elementwise=layouts.optimizer_is_elementwise(config),
  )
  return config, model_cfg, shapes, train


def layout_stats(train, psi: int) -> dict:
  """Row, padding, wire bytes per update and (owner layout) owned bytes per device."""
  from acco_jax.dp.flat import TreeLayout
  from acco_jax.dp.plan import comm_bytes_per_stage

  layout, plan, n = train.layout, train.plan, train.num_devices
  stages = 2 if plan.name == "acco" else 1
  out = {
    "layout": "owner" if train.owner else "tree" if isinstance(layout, TreeLayout) else "flat",
    "row": layout.shard_size,
    "padded_size": layout.padded_size,
    "padding": layout.padded_size - psi,
    "comm_itemsize": train.comm_dtype.itemsize,
    "stages_per_update": stages,
    "wire_bytes_per_update": stages * comm_bytes_per_stage(plan, layout.padded_size, n),
  }
  if train.owner:
    out |= {
      "slot_size": layout.slot_size,
      "slot_padding": layout.padding,
      "owned_elements": layout.owned_elements,
      "groups": [list(g) for g in layout.groups],
      "slots": list(layout.slots),
      "loads": list(layout.loads),
      "largest_item_bytes": max(math.prod(g) * 4 for g in layout.groups),
    }
  return out


def worker(args) -> dict:
  import jax

  import acco_jax
  from acco_jax import model

  n, rows = jax.device_count(), []
  for method, opt in [r for r in ROWS if f"{r[0]}+{r[1]}" in args.only]:
    t0 = time.perf_counter()
    config, model_cfg, shapes, train = build(args.preset, method, opt, n)
    psi = model.num_params(shapes)
    state = train.abstract_state(shapes)
    committed = acco_jax.committed_params(state.opt_state, None)
    comp = {
      "opt": common.shard_bytes(state.opt_state),
      "committed": 0 if committed is None else common.shard_bytes(committed),
      "master": common.shard_bytes(state.params),
      "w": common.shard_bytes(state.w),
      "buf": common.shard_bytes((state.buf, state.buf_count)),
      "stage": common.shard_bytes(state.stage),
    }
    comp["opt"] -= comp["committed"]
    total = common.shard_bytes(state)
    assert total == sum(comp.values()), (total, comp)
    row = {
      "preset": args.preset,
      "method": method,
      "opt": opt,
      "N": n,
      "psi": psi,
      "model": {k: getattr(model_cfg, k) for k in ("V", "D", "N", "H")},
      "state_bytes": total,
      "state_components": comp,
      "build_s": round(time.perf_counter() - t0, 2),
    } | layout_stats(train, psi)
    if args.compile:
      row |= compile_stats(train, state, args)
    rows.append(row)
    common.log(
      f"  {args.preset} {method}+{opt} ({row['layout']}): opt {comp['opt'] / MIB:.1f} MiB, "
      f"state {total / MIB:.1f} MiB/device"
      + (f", temp {row['compiled']['temp'] / MIB:.1f} MiB" if args.compile else "")
    )
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"preset": args.preset, "N": n, "max_rss_bytes": rss, "rows": rows}


def compile_stats(train, state, args) -> dict:
  """``memory_analysis()`` of the stage program and its lower/compile times."""
  fn = train.stage_program("delayed" if train.plan.delayed else "sync", state)
  batch = memory.abstract_inputs(train, args.rows, args.seq)
  t0 = time.perf_counter()
  lowered = fn.lower(state, batch)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  mem = memory.program_bytes(compiled)
  return {
    "compiled": mem,
    "argument_minus_inputs": mem["argument"] - common.shard_bytes(batch),
    "lower_s": round(t1 - t0, 2),
    "compile_s": round(t2 - t1, 2),
  }


# -- report -----------------------------------------------------------------------------------------


def tables(rows: list[dict]) -> str:
  mib = lambda b: f"{b / MIB:.1f}"
  ddp = {
    (r["preset"], r["opt"]): r["state_components"]["opt"] for r in rows if r["method"] == "ddp"
  }
  state, lay, comp = [], [], []
  for r in rows:
    c, n, psi = r["state_components"], r["N"], r["psi"]
    key = {"preset": r["preset"], "row": f"{r['method']} + {r['opt']}", "layout": r["layout"]}
    base = ddp.get((r["preset"], r["opt"]))
    state.append(
      key
      | {k: mib(c[k]) for k in ("opt", "committed", "master", "w", "buf")}
      | {
        "vs": "" if base is None else f"{c['opt'] / (base / n):.3f}",
        "total": mib(r["state_bytes"]),
        "per": f"{r['state_bytes'] / psi:.2f}",
      }
    )
    owner = r["layout"] == "owner"
    lay.append(
      key
      | {
        "R": f"{r['row']:,}",
        "pad": f"{r['padding']:,} ({100 * r['padding'] / psi:.1f}%)",
        "slot": f"{r['slot_padding']:,} ({100 * r['slot_padding'] / (n * r['slot_size']):.1f}%)"
        if owner
        else "",
        "wire": mib(r["wire_bytes_per_update"]),
        "loads": f"{mib(max(r['loads']))} / {mib(min(r['loads']))}" if owner else "",
        "spread": f"{(max(r['loads']) - min(r['loads'])) / r['largest_item_bytes']:.2f}"
        if owner
        else "",
      }
    )
    if "compiled" in r:
      m = r["compiled"]
      comp.append(
        key
        | {k: mib(m[k]) for k in ("argument", "temp", "total")}
        | {
          "arg": f"{r['argument_minus_inputs'] - r['state_bytes']:+d}",
          "compile": f"{r['compile_s']:.1f}",
        }
      )
  head = [("preset", "preset"), ("row", "method + opt"), ("layout", "layout")]
  out = [
    "State per device (MiB); opt/(ddp/N) = optimizer state against DDP's of the same optimizer / N",
    common.format_table(
      state,
      head
      + [
        ("opt", "opt state"),
        ("vs", "opt/(ddp/N)"),
        ("committed", "committed f32"),
        ("master", "master f32"),
        ("w", "w bf16"),
        ("buf", "buf bf16"),
        ("total", "total"),
        ("per", "total/Ψ"),
      ],
    ),
    "",
    "Layout: row R per device (elements), padding N·R − Ψ (share of Ψ), the owner layout's empty "
    "slots (share of all slots), MiB sent per device per update, owned MiB per device (max / min) "
    "and (max − min) / largest matrix",
    common.format_table(
      lay,
      head
      + [
        ("R", "R"),
        ("pad", "padding"),
        ("slot", "empty slots"),
        ("wire", "wire MiB/update"),
        ("loads", "owned MiB max / min"),
        ("spread", "spread/largest"),
      ],
    ),
  ]
  if comp:
    out += [
      "",
      "Compiled stage program (memory_analysis, MiB per device); arg − state: argument − batch − "
      "state bytes (negative: unused scalars jit drops)",
      common.format_table(
        comp,
        head
        + [
          ("argument", "argument"),
          ("temp", "temp"),
          ("total", "program"),
          ("arg", "arg − state B"),
          ("compile", "compile s"),
        ],
      ),
    ]
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--presets", nargs="+", default=["gpt2", "gpt2-medium"])
  p.add_argument("--compile", nargs="*", default=["gpt2"], help="presets whose program compiles")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--seq", type=int, default=128, help="tokens per row (compiled presets)")
  p.add_argument("--rows", type=int, default=1, help="rows per device (one microbatch)")
  p.add_argument("--only", nargs="+", default=[f"{m}+{o}" for m, o in ROWS], help="method+opt")
  p.add_argument("--timeout", type=float, default=1800, help="seconds per preset")
  p.add_argument("--smoke", action="store_true", help="tiny preset, state only (CI)")
  p.add_argument("--out", type=Path, default=common.RESULTS / "memory_muon.json")
  p.add_argument("--render", action="store_true", help="only redraw --out's tables from its rows")
  p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
  p.add_argument("--preset", help=argparse.SUPPRESS)  # the worker's
  args = p.parse_args(argv)
  if args.smoke:
    args.presets, args.compile = ["tiny"], []
  if args.worker:
    common.write_json(args.worker, worker(args))
    return 0
  if args.render:
    result = json.loads(args.out.read_text())
    result["table"] = tables(result["rows"])
    print(result["table"])
    common.write_json(args.out, result)
    return 0

  started, load_start = time.perf_counter(), common.loadavg()

  def fwd(preset):
    out = ["--preset", preset, "--seq", str(args.seq), "--rows", str(args.rows)]
    out += ["--compile", preset] if preset in args.compile else ["--compile"]
    out += ["--smoke"] if args.smoke else []
    return out + ["--only", *args.only]

  runs, failures = common.run_each(
    __spec__.name, "memory_muon", args.presets, fwd, lambda _: args.devices, args.timeout
  )
  rows = [r for run in runs for r in run["rows"]]
  result = {
    "benchmark": "memory_muon",
    "command": "python -m bench.dp.memory_muon " + " ".join(sys.argv[1:] if argv is None else argv),
    "machine": common.machine() | {"loadavg_1m_at_start": load_start},
    "config": {
      "presets": args.presets,
      "compiled": [x for x in args.presets if x in args.compile],
      "devices": args.devices,
      "seq": args.seq,
      "rows_per_device": args.rows,
      "num_microbatches": 1,
      "rows": args.only,
    },
  }
  report = tables(rows) if rows else "no results"
  return common.finish_runs(
    args.out,
    result,
    runs,
    failures,
    report,
    name_of=lambda run: run["preset"],
    psi_of=lambda run: run["rows"][0]["psi"],
    started=started,
    load_start=load_start,
  )


if __name__ == "__main__":
  sys.exit(main())
