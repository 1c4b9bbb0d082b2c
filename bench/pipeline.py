r"""Pipelines over a ``stage`` axis: bubbles, CPU time per iteration, and GPT-2 124M compiled for GPUs.

  python bench/pipeline.py                      # all three parts (a few minutes on 2 cores)
  python bench/pipeline.py --parts bubbles      # the host-only tick table
  PYTHONPATH=<dir with jax_plugins> python bench/pipeline.py --parts aot

1. **Bubbles** (host only): for the same M microbatches, the tick count, the idle share of
   (tick, stage) cells and the activation slots per device of GPipe and 1F1B on full paths and of
   SkipPipe paths (random, skip ratio r, swaps) under both policies (:mod:`acco_jax.pipeline.ticks`).
2. **CPU**: wall-clock per iteration (loss and gradients) of the same schedules on 8 simulated devices
   (2 data lanes x 4 stages), side by side in one process; medians of ``--repeats`` calls.
3. **AOT**: GPT-2 124M's pipeline training step (schedule, gradients, AdamW) compiled by XLA:GPU for an
   abstract 8 x H100 topology (the CUDA PJRT plugin, no GPU), S = 4 (2 lanes), S = 6 and S = 8 (a
   16-block GPT-2: 12 blocks do not split into 8 equal stages),
   with XLA's per-device memory estimate (one SPMD program: every stage's device gets the same
   buffer sizes). Skipped, with the reason, where the plugin is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _schedules(S: int, M: int, seed: int = 0):
  import numpy as np

  from acco_jax.pipeline import paths, ticks

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
        rows.append({
          "S": S, "M": M, "schedule": name, "paths": paths, "ticks": s.num_ticks,
          "busy_ops": busy, "idle": f"{s.idle_fraction():.3f}", "slots": s.slots,
          "rounds": s.perm.shape[1], "perms": len(s.perms) - 1,
        })  # fmt: skip
  cols = [("S", "S"), ("M", "M"), ("schedule", "schedule"), ("paths", "paths"), ("ticks", "ticks"),
          ("busy_ops", "ops"), ("idle", "idle share"), ("slots", "act. slots/device"),
          ("rounds", "rounds/tick"), ("perms", "distinct perms")]  # fmt: skip
  return {"rows": rows, "table": common.format_table(rows, cols)}


def cpu_worker(args) -> dict:
  import jax
  import numpy as np

  from acco_jax import model
  from acco_jax.pipeline import step as pipe

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
    rows.append({"schedule": name, "paths": paths, "ticks": sched.num_ticks,
                 "ms": round(1e3 * statistics.median(times), 1), "compile_s": round(compile_s, 1)})  # fmt: skip
    common.log(f"cpu {name} {paths}: {rows[-1]['ms']} ms")
  base = rows[0]["ms"]
  for r in rows:
    r["vs_gpipe"] = f"{r['ms'] / base:.2f}"
  return {"rows": rows, "model": "D=256 N=4 H=4 L=128 V=2048 float32", "S": S, "lanes": lanes,
          "M": M, "rows_per_microbatch": B}  # fmt: skip


def aot_worker(args) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from acco_jax import model
  from acco_jax.pipeline import paths, ticks
  from acco_jax.pipeline import step as pipe
  from acco_jax.pipeline import train as pipe_train
  from acco_jax.run import optim, parallel

  if not parallel.has_cuda_plugin():
    return {"skipped": "no CUDA PJRT plugin (pip install jax-cuda12-pjrt==<jaxlib version>)"}
  devices = parallel.gpu_aot_devices(8, "h100")
  gpt2 = dict(L=1024, V=50257, vocab_multiple=128, dtype="bfloat16", attention="xla")
  cfg = model.get_config("gpt2", **gpt2)
  import ml_collections

  opt = ml_collections.ConfigDict(dict(name="adamw", lr=6e-4, b1=0.9, b2=0.95, eps=1e-8,
                                       weight_decay=0.1, clip_norm=1.0, schedule="cosine",
                                       warmup_updates=10, min_lr_ratio=0.1))  # fmt: skip
  rows = []
  M, B = args.microbatches, args.rows
  # GPT-2 124M has 12 blocks: S = 4 (2 lanes) and S = 6 (6 of the 8 devices); S = 8 needs a block
  # count divisible by 8, so that row is GPT-2's width with 16 blocks (153M parameters)
  deep = model.get_config("gpt2", N=16, **gpt2)
  for S, lanes, c in ((4, 2, cfg), (6, 1, cfg), (8, 1, deep)):
    c_shapes = jax.eval_shape(lambda c=c: model.init_params(c, 0))
    for policy in ("gpipe", "1f1b"):
      sched = ticks.build([paths.full_path(S)] * M, S, policy)
      mesh = pipe.make_mesh(S, lanes, devices)
      buffers = pipe.packing_for(c_shapes, S, lanes=lanes)
      c_tx = optim.inner_optimizer(opt, 100, buffers.decay_mask())
      train = pipe_train.PipelineTrainStep(c, c_tx, mesh, sched, c_shapes)
      state = train.abstract_state(c_shapes)
      spec = P(pipe.DATA) if lanes > 1 else P()
      batch = {k: jax.ShapeDtypeStruct((lanes * M * B, c.L), jnp.int32,
                                       sharding=NamedSharding(mesh, spec))
               for k in ("inputs", "targets")}  # fmt: skip
      t0 = time.perf_counter()
      compiled = jax.jit(train._step, donate_argnums=(0,)).lower(state, batch).compile()
      mem = compiled.memory_analysis()
      gib = lambda b: round(b / 2**30, 2)
      rows.append({
        "model": f"N={c.N}", "params_M": round(train.layout.num_params / 1e6, 1),
        "S": S, "lanes": lanes, "schedule": policy, "ticks": sched.num_ticks, "slots": sched.slots,
        "state_GiB": gib(common.shard_bytes(state)),
        "argument_GiB": gib(mem.argument_size_in_bytes), "temp_GiB": gib(mem.temp_size_in_bytes),
        "output_GiB": gib(mem.output_size_in_bytes), "compile_s": round(time.perf_counter() - t0),
      })  # fmt: skip
      common.log(f"aot S={S} {policy}: {rows[-1]}")
  return {"rows": rows, "device_kind": devices[0].device_kind, "M": M, "rows_per_microbatch": B,
          "model": "GPT-2 124M, L=1024, bf16 compute, attention=xla"}  # fmt: skip


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--parts", default="bubbles,cpu,aot")
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--rows", type=int, default=4, help="AOT: rows per microbatch")
  ap.add_argument("--worker", default=None)
  ap.add_argument("--kind", default="")
  ap.add_argument("--out", default=str(common.RESULTS / "pipeline.json"))
  args = ap.parse_args()
  if args.worker:
    fn = {"cpu": cpu_worker, "aot": aot_worker}[args.kind]
    Path(args.worker).write_text(json.dumps(fn(args)))
    return
  parts = args.parts.split(",")
  out = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
  out["command"] = "python bench/pipeline.py " + " ".join(sys.argv[1:])
  flags = ["--microbatches", str(args.microbatches), "--repeats", str(args.repeats),
           "--rows", str(args.rows)]  # fmt: skip
  if "bubbles" in parts:
    out["bubbles"] = bubbles(args)
    print("Bubbles (ticks; idle share of tick x stage cells; activation slots per device)")
    print(out["bubbles"]["table"], flush=True)
  if "cpu" in parts:
    res = common.run_worker(__file__, 8, ["--kind", "cpu", *flags], timeout=1800)
    cols = [("schedule", "schedule"), ("paths", "paths"), ("ticks", "ticks"), ("ms", "ms/iter"),
            ("vs_gpipe", "vs GPipe"), ("compile_s", "compile s")]  # fmt: skip
    res["table"] = common.format_table(res["rows"], cols)
    out["cpu"] = res
    print(f"\nCPU, 8 simulated devices, {res['lanes']} lanes x {res['S']} stages, M={res['M']}, "
          f"{res['model']}: median of {args.repeats}")  # fmt: skip
    print(res["table"], flush=True)
  if "aot" in parts:
    res = common.run_worker(__file__, 1, ["--kind", "aot", *flags], timeout=3600)
    out["aot"] = res
    if "skipped" in res:
      print(f"\nAOT: skipped: {res['skipped']}")
    else:
      cols = [("model", "blocks"), ("params_M", "params M"), ("S", "S"), ("lanes", "lanes"), ("schedule", "schedule"), ("ticks", "ticks"),
              ("slots", "slots"), ("state_GiB", "state GiB"), ("argument_GiB", "args GiB"),
              ("temp_GiB", "temp GiB"), ("output_GiB", "out GiB"), ("compile_s", "compile s")]  # fmt: skip
      res["table"] = common.format_table(res["rows"], cols)
      print(f"\nAOT, {res['model']}, abstract 8 x {res['device_kind']}, M={res['M']} x "
            f"{res['rows_per_microbatch']} rows per lane; XLA memory per device")  # fmt: skip
      print(res["table"], flush=True)
  out["machine"] = common.machine()
  print(f"wrote {common.write_json(Path(args.out), out)}")


if __name__ == "__main__":
  main()
