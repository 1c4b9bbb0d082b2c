r"""Pipelines over a ``stage`` axis: bubbles, CPU time per iteration, and memory per device on GPUs.

  python -m bench.pipeline.pipeline --parts bubbles,cpu  # the host parts (a few minutes on 2 cores)
  python -m bench.pipeline.pipeline --parts bubbles      # the host-only tick table
  PYTHONPATH=.:<dir with jax_plugins> python -m bench.pipeline.pipeline --parts aot   # ~10 min on 2 cores

1. **Bubbles** (host only): for the same M microbatches, the tick count, the idle share of
   (tick, stage) cells and the activation slots per device of GPipe and 1F1B on full paths and of
   SkipPipe paths (random, skip ratio r, swaps) under both policies (:mod:`acco_jax.pipeline.ticks`).
2. **CPU**: wall-clock per iteration (loss and gradients) of the same schedules on 8 simulated devices
   (2 data lanes x 4 stages), side by side in one process; medians of ``--repeats`` calls.
3. **AOT memory**: the pipeline training step (1F1B on full paths, gradients, AdamW) of GPT-2 124M
   and gpt2-medium compiled by XLA:GPU for abstract H100s (the CUDA PJRT plugin, no GPU), for
   S = 4 and 8 stages x 1 and 2 data lanes x ``pipeline.data_method`` ddp, zero1 and acco, blocks
   split by :func:`acco_jax.pipeline.packing.balanced_counts`: the state's bytes per device and
   XLA's per-device memory estimate (one SPMD program: every device gets the same buffer sizes).
   Up to 8 devices compile on one 8-GPU host, 16 on 2 hosts x 8 (the lanes on different hosts).
   Each row compiles in its own process and ``--memory-out`` (``bench/results/
   pipeline_memory.json``) is rewritten after each; ``--resume`` keeps the rows already there.
   ``bench/pipeline/pipeline_memory_before.py`` compiles the same rows for the layout before the packed one
   (33a96f6). Skipped, with the reason, where the plugin is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench import common


def _schedules(S: int, M: int, seed: int = 0):
  import numpy as np

  from acco_jax.pipeline import ticks
  from acco_jax.skippipe import paths

  out = []
  full = [paths.full_path(S)] * M
  out.append(("gpipe", "full", ticks.build(full, S, "gpipe")))
  out.append(("1f1b", "full", ticks.build(full, S, "1f1b")))
  for skip in (0.25, 0.5):
    ps = paths.random_paths(M, S, skip, True, np.random.default_rng(seed))
    for policy in ("gpipe", "1f1b"):
      out.append((f"skippipe-{policy}", f"r={skip} swap", ticks.build(ps, S, policy)))
  return out


def bubbles(args) -> dict:
  rows = []
  for S in (4, 8):
    for M in (8, 16):
      for name, paths, s in _schedules(S, M):
        busy = int((s.kind != 0).sum())
        rows.append(
          {
            "S": S,
            "M": M,
            "schedule": name,
            "paths": paths,
            "ticks": s.num_ticks,
            "busy_ops": busy,
            "idle": f"{s.idle_fraction():.3f}",
            "slots": s.slots,
            "rounds": s.perm.shape[1],
            "perms": len(s.perms) - 1,
          }
        )
  cols = [
    ("S", "S"),
    ("M", "M"),
    ("schedule", "schedule"),
    ("paths", "paths"),
    ("ticks", "ticks"),
    ("busy_ops", "ops"),
    ("idle", "idle share"),
    ("slots", "act. slots/device"),
    ("rounds", "rounds/tick"),
    ("perms", "distinct perms"),
  ]
  return {"rows": rows, "table": common.format_table(rows, cols)}


def cpu_worker(args) -> dict:
  import jax
  import numpy as np

  from acco_jax import model
  from acco_jax.pipeline import programs as pipe

  S, lanes, M, B = 4, 2, args.microbatches, 2
  cfg = model.get_config("tiny", D=256, N=4, H=4, L=128, V=2048, dtype="float32")
  params = model.init_params(cfg, 0)
  mesh = pipe.make_mesh(S, lanes)
  rng = np.random.default_rng(0)
  tok = rng.integers(0, cfg.V, size=(M, lanes * B, cfg.L + 1), dtype=np.int32)
  batch = pipe.place_batch({"inputs": tok[..., :-1], "targets": tok[..., 1:]}, mesh)
  packing = pipe.packing_for(params, S, lanes=lanes)
  pp = pipe.place_params(packing.pack(params), mesh)
  rows = []
  for name, paths, sched in _schedules(S, M):
    fn = jax.jit(pipe.make_loss_and_grad(cfg, mesh, sched, packing))
    t0 = time.perf_counter()
    compiled = fn.lower(pp, batch).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(pp, batch))
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(pp, batch))
      times.append(time.perf_counter() - t0)
    rows.append(
      {
        "schedule": name,
        "paths": paths,
        "ticks": sched.num_ticks,
        "ms": round(1e3 * statistics.median(times), 1),
        "compile_s": round(compile_s, 1),
      }
    )
    common.log(f"cpu {name} {paths}: {rows[-1]['ms']} ms")
  base = rows[0]["ms"]
  for r in rows:
    r["vs_gpipe"] = f"{r['ms'] / base:.2f}"
  return {
    "rows": rows,
    "model": "D=256 N=4 H=4 L=128 V=2048 float32",
    "S": S,
    "lanes": lanes,
    "M": M,
    "rows_per_microbatch": B,
  }


# -- AOT memory per device -------------------------------------------------------------------------

MEMORY_MODELS = {"gpt2": "GPT-2 124M", "gpt2-medium": "gpt2-medium"}
MEMORY_METHODS = ("ddp", "zero1", "acco")
_GPT2 = dict(L=1024, V=50257, vocab_multiple=128, dtype="bfloat16", attention="xla")


def memory_plan(
  rows: str = "all",
  models=tuple(MEMORY_MODELS),
  stages=(4, 8),
  lanes=(1, 2),
  methods=MEMORY_METHODS,
  controls: bool = True,
) -> list[dict]:
  """The AOT table's rows: model x S x lanes x data method, blocks split by
  :func:`acco_jax.pipeline.packing.balanced_counts`. ``rows='lanes2'`` keeps zero1 and acco at 2
  lanes only (with one lane zero1 shards over nothing, so its state is DDP's). ``controls``: after
  each (model, S), one DDP row on 1 lane with equal stages (the old layout's split, in the packed
  layout; not possible where the blocks do not divide)."""
  out = []
  for m in models:
    for S in stages:
      for n in lanes:
        for method in methods:
          if rows == "lanes2" and method != "ddp" and n == 1:
            continue
          out.append({"preset": m, "S": S, "lanes": n, "data_method": method})
      if controls:
        out.append({"preset": m, "S": S, "lanes": 1, "data_method": "ddp", "split": "equal"})
  return out


def row_key(r: dict) -> str:
  key = f"{r['preset']}:{r['S']}:{r['lanes']}:{r['data_method']}"
  return key + (f":{r['split']}" if r.get("split", "balanced") != "balanced" else "")


def parse_row(key: str) -> dict:
  """``model:S:lanes:method[:split]``, split ``balanced`` (the default) or ``equal``."""
  m, S, n, method, *split = key.split(":")
  out = {"preset": m, "S": int(S), "lanes": int(n), "data_method": method}
  return {**out, "split": split[0]} if split and split[0] != "balanced" else out


def topology(num_devices: int) -> tuple[int, int]:
  """(devices, hosts) of the abstract H100 topology a row compiles on: one 8-GPU host, or 2 x 8
  for 16 devices (the lanes on different hosts: lane l is devices 8 l .. 8 l + 7)."""
  return (8, 1) if num_devices <= 8 else (16, 2)


def adamw():
  import ml_collections

  return ml_collections.ConfigDict(
    dict(
      name="adamw",
      lr=6e-4,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,
      clip_norm=1.0,
      schedule="cosine",
      warmup_updates=10,
      min_lr_ratio=0.1,
    )
  )


def model_config(preset: str, smoke: bool = False):
  """The preset at GPT-2's context and vocabulary; ``smoke``: its blocks at toy widths (tests)."""
  from acco_jax import model

  return model.get_config(preset, **(dict(_GPT2, L=64, V=512, D=64, H=4) if smoke else _GPT2))


def abstract_devices(num_devices: int):
  from acco_jax import parallel

  n, hosts = topology(num_devices)
  return parallel.gpu_aot_devices(n, "h100", hosts=hosts), f"{hosts}x{n // hosts}"


def compile_memory(train, state, mesh, cfg, lanes: int, M: int, B: int) -> dict:
  """Compiles ``train.stage_fn`` (state donated) for ``M`` microbatches of ``B`` rows per lane; the
  state's bytes per device (each field's) and XLA's per-device memory estimate, in GiB."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from acco_jax.pipeline import programs as pipe

  spec = P(pipe.DATA) if lanes > 1 else P()
  batch = {
    k: jax.ShapeDtypeStruct((lanes * M * B, cfg.L), jnp.int32, sharding=NamedSharding(mesh, spec))
    for k in ("inputs", "targets")
  }
  t0 = time.perf_counter()
  compiled = jax.jit(train.stage_fn, donate_argnums=(0,)).lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  gib = lambda b: round(b / 2**30, 3)
  fields = {k: gib(common.shard_bytes(v)) for k, v in state._asdict().items() if v is not None}
  args, temp = mem.argument_size_in_bytes, mem.temp_size_in_bytes
  out, alias = mem.output_size_in_bytes, mem.alias_size_in_bytes
  return {
    "state_GiB": gib(common.shard_bytes(state)),
    "state_fields_GiB": fields,
    "argument_GiB": gib(args),
    "temp_GiB": gib(temp),
    "output_GiB": gib(out),
    "alias_GiB": gib(alias),
    "total_GiB": gib(args + temp + out - alias),
    "compile_s": round(compile_s),
  }


def block_and_shared(shapes) -> tuple[int, int]:
  """Parameters of one block, and of the embedding, position embedding and final LayerNorm."""
  import jax

  size = lambda t: sum(int(x.size) for x in jax.tree.leaves(t))
  return size(shapes["blocks"]["0"]), size({k: v for k, v in shapes.items() if k != "blocks"})


def aot_worker(args) -> dict:
  """One row of the memory table, in the packed layout (this checkout)."""
  import jax
  import jax.numpy as jnp

  from acco_jax import model, optim, parallel
  from acco_jax.pipeline import packing, ticks
  from acco_jax.pipeline import programs as pipe
  from acco_jax.pipeline import step as pipe_train
  from acco_jax.skippipe import paths

  if not parallel.has_cuda_plugin():
    return {"skipped": "no CUDA PJRT plugin (pip install jax-cuda12-pjrt==<jaxlib version>)"}
  r = parse_row(args.row)
  S, lanes, M, B = r["S"], r["lanes"], args.microbatches, args.rows
  cfg = model_config(r["preset"], args.smoke)
  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  devices, topo = abstract_devices(S * lanes)
  if r.get("split") == "equal" and cfg.N % S:
    return {
      **r,
      "model": MEMORY_MODELS.get(r["preset"], r["preset"]),
      "topology": topo,
      "not_possible": f"not possible ({cfg.N} blocks on {S} equal stages)",
    }
  equal = r.get("split") == "equal"
  counts = packing.equal_counts(cfg.N, S) if equal else packing.balanced_counts(cfg, S)
  sched = ticks.build([paths.full_path(S)] * M, S, "1f1b")
  mesh = pipe.make_mesh(S, lanes, devices)
  buffers = pipe.packing_for(shapes, S, counts, lanes)
  tx = optim.inner_optimizer(adamw(), 100, buffers.decay_mask())
  train = pipe_train.PipelineStep(
    cfg, tx, mesh, sched, shapes, None, counts, r["data_method"], jnp.bfloat16
  )
  state = train.abstract_state(shapes)
  block, shared = block_and_shared(shapes)
  held = sum(train.packing.sizes.values())  # every stage's buffers have the same length
  own = [c * block + (shared if s == 0 else 0) for s, c in enumerate(counts)]
  row = {
    **r,
    "model": MEMORY_MODELS[r["preset"]],
    "layout": "packed",
    "topology": topo,
    "blocks": ",".join(map(str, counts)),
    "params_M": round(model.num_params(shapes) / 1e6, 1),
    "held_M": round(held / 1e6, 1),
    "idle_M": round((held - min(own)) / 1e6, 1),
    "ticks": sched.num_ticks,
    "slots": sched.slots,
    "device_kind": devices[0].device_kind,
    **compile_memory(train, state, mesh, cfg, lanes, M, B),
  }
  common.log(f"aot {args.row}: {row}")
  return row


MEMORY_COLUMNS = [
  ("model", "model"),
  ("S", "S"),
  ("lanes", "lanes"),
  ("topology", "topology"),
  ("data_method", "data method"),
  ("split", "split"),
  ("blocks", "blocks per stage"),
  ("held_M", "params/device M"),
  ("idle_M", "unused M"),
  ("state_GiB", "state GiB"),
  ("argument_GiB", "args GiB"),
  ("temp_GiB", "temp GiB"),
  ("output_GiB", "out GiB"),
  ("total_GiB", "sum GiB"),
  ("compile_s", "compile s"),
]


def memory_table(rows: list[dict]) -> str:
  def cell(r):
    r = {"split": "balanced", **r}
    if "not_possible" in r:
      return {**r, "blocks": r["not_possible"]}
    return {
      **r,
      **{
        k: f"{r[k]:.2f}"
        for k in ("state_GiB", "argument_GiB", "temp_GiB", "output_GiB", "total_GiB")
      },
    }

  return common.format_table([cell(r) for r in rows], MEMORY_COLUMNS)


def run_memory_rows(
  module: str, plan: list[dict], out_path: Path, flags: list[str], resume: bool, header: dict
) -> dict:
  """Runs each row of ``plan`` in its own worker process (``--kind aot --row KEY``) and rewrites
  ``out_path`` after each, so a long run keeps what it finished; with ``resume``, rows already in
  ``out_path`` (same key, same flags) are kept instead of compiled again."""
  done = {}
  if resume and out_path.exists():
    old = json.loads(out_path.read_text())
    if old.get("flags") == flags:
      done = {r["key"]: r for r in old.get("rows", []) if "key" in r}
  res = {**header, "flags": flags, "rows": []}
  for spec in plan:
    key = row_key(spec)
    if key not in done:
      row = common.run_worker(module, 1, ["--kind", "aot", "--row", key, *flags], timeout=3600)
      if "skipped" in row:
        return {**res, "skipped": row["skipped"]}
      done[key] = {"key": key, **row}
    res["rows"].append(done[key])
    res["table"] = memory_table(res["rows"])
    common.write_json(out_path, {**res, "machine": common.machine()})
  return res


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--parts", default="bubbles,cpu,aot")
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--rows", type=int, default=4, help="AOT: rows per microbatch")
  ap.add_argument("--worker", default=None)
  ap.add_argument("--kind", default="")
  ap.add_argument("--out", default=str(common.RESULTS / "pipeline.json"))
  ap.add_argument("--memory-out", default=str(common.RESULTS / "pipeline_memory.json"))
  ap.add_argument("--models", default=",".join(MEMORY_MODELS), help="AOT: model presets")
  ap.add_argument(
    "--memory-rows",
    choices=("all", "lanes2"),
    default="all",
    help="AOT: lanes2 runs zero1 and acco at 2 lanes only",
  )
  ap.add_argument("--resume", action="store_true", help="AOT: keep rows already in --memory-out")
  ap.add_argument("--row", default="", help="worker: model:S:lanes:data_method")
  ap.add_argument("--smoke", action="store_true", help="worker: toy widths (tests)")
  args = ap.parse_args()
  if args.worker:
    fn = {"cpu": cpu_worker, "aot": aot_worker}[args.kind]
    Path(args.worker).write_text(json.dumps(fn(args)))
    return
  parts = args.parts.split(",")
  out = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
  out["command"] = "python -m bench.pipeline.pipeline " + " ".join(sys.argv[1:])
  flags = [
    "--microbatches",
    str(args.microbatches),
    "--repeats",
    str(args.repeats),
    "--rows",
    str(args.rows),
  ]
  if "bubbles" in parts:
    out["bubbles"] = bubbles(args)
    print("Bubbles (ticks; idle share of tick x stage cells; activation slots per device)")
    print(out["bubbles"]["table"], flush=True)
  if "cpu" in parts:
    res = common.run_worker(__spec__.name, 8, ["--kind", "cpu", *flags], timeout=1800)
    cols = [
      ("schedule", "schedule"),
      ("paths", "paths"),
      ("ticks", "ticks"),
      ("ms", "ms/iter"),
      ("vs_gpipe", "vs GPipe"),
      ("compile_s", "compile s"),
    ]
    res["table"] = common.format_table(res["rows"], cols)
    out["cpu"] = res
    print(
      f"\nCPU, 8 simulated devices, {res['lanes']} lanes x {res['S']} stages, M={res['M']}, "
      f"{res['model']}: median of {args.repeats}"
    )
    print(res["table"], flush=True)
  if "aot" in parts:
    plan = memory_plan(args.memory_rows, args.models.split(","))
    header = {
      "command": out["command"],
      "layout": "packed (this checkout)",
      "M": args.microbatches,
      "rows_per_microbatch": args.rows,
      "schedule": "1f1b, full paths",
      "model_kwargs": _GPT2,
      "optimizer": "adamw (clip 1.0), float32 state",
      "comm_dtype": "bfloat16 (zero1, acco)",
    }
    aot_flags = ["--microbatches", str(args.microbatches), "--rows", str(args.rows)]
    res = run_memory_rows(
      __spec__.name, plan, Path(args.memory_out), aot_flags, args.resume, header
    )
    if "skipped" in res:
      print(f"\nAOT: skipped: {res['skipped']}")
    else:
      print(
        f"\nAOT memory per device (XLA:GPU, abstract H100s), 1F1B, M={args.microbatches} x "
        f"{args.rows} rows of {_GPT2['L']} tokens per lane"
      )
      print(res["table"], flush=True)
      print(f"wrote {args.memory_out}")
  if {"bubbles", "cpu"} & set(parts):  # the AOT part writes --memory-out only
    out["machine"] = common.machine()
    print(f"wrote {common.write_json(Path(args.out), out)}")


if __name__ == "__main__":
  main()
