"""Does XLA:GPU schedule ACCO's reduce-scatter and all-gather around the microbatch loop?

Compiles the ACCO stage program of GPT-2 124M (``acco_jax.model.get_config('gpt2')``) for an
8-device data mesh, with :data:`acco_jax.parallel.GPU_OVERLAP_FLAGS`, from abstract shapes (nothing
is allocated or run), and reads the scheduled entry computation with
:func:`acco_jax.hlo.async_overlap_report`: for the flat-buffer reduce-scatter and all-gather,
whether their async start/done pair brackets the microbatch ``while`` and whether XLA marked it
synchronous. With fewer than 8 GPUs it mocks the missing ones (``MOCK_NUM_GPU_PROCESSES``, then
``JAX_MOCK_GPU_TOPOLOGY``; ``jax-notes.md`` §9): compile-only schedule evidence, no timing.

One structural fact bounds the answer: the all-gather's input is the optimizer update of the
reduce-scatter's output, so the reduce-scatter must be *done* before the all-gather *starts*; with a
single loop, at most one of the two pairs could bracket it. The step therefore runs a stage's
microbatches as two loops with the update ordered between them (``acco_jax/step.py``; needs
``--k`` >= 2). Verdicts: ``full`` (each pair brackets a loop), ``partial`` (one does, the other is
exposed), ``none``.

On CPU it says that it needs a GPU, checks what it can (the jaxpr dataflow precondition on GPT-2,
the reduce-scatter -> all-gather chain in the compiled CPU module of a small model), writes the
JSON and exits 0. Usage (on a GPU machine)::

  python bench/overlap_gpu.py      # verdict on stdout, JSON in bench/results/overlap_gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import common

TIMEOUT_S = 1200


def probe() -> dict:
  """Backend, local device count and versions, from a child process (the parent stays clean)."""
  code = ("import json, jax; print(json.dumps({'backend': jax.default_backend(), "
          "'devices': jax.local_device_count(), 'kind': jax.devices()[0].device_kind, "
          "'jax': jax.__version__}))")  # fmt: skip
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
  if out.returncode != 0:
    return {"backend": "unknown", "error": out.stderr[-2000:]}
  return json.loads(out.stdout.strip().splitlines()[-1])


def build_stage(model_name: str, devices, k: int, rows: int, seq: int):
  """(compiled-able jitted stage, abstract args, train step) of ACCO on a mesh over ``devices``."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import acco_jax
  from acco_jax import model

  cfg = model.get_config(model_name, L=seq)
  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  tx = acco_jax.acco(optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1))  # bf16 comm
  loss = lambda p, b: model.loss_fn(p, cfg, b)
  train = acco_jax.make_train_step(loss, tx, mesh, num_microbatches=k, params=shapes, has_aux=True)
  state = train.abstract_state(shapes)
  fn = train._jit("delayed", state)
  data = NamedSharding(train.mesh, P("data"))
  n = len(devices)
  batch = {key: jax.ShapeDtypeStruct((n * k * rows, seq), jnp.int32, sharding=data)
           for key in ("inputs", "targets")}  # fmt: skip
  counts = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=data)
  return fn, (state, batch, counts), train


def chain_facts(text: str) -> dict:
  """In a compiled module's entry: does the all-gather depend on the reduce-scatter, or the loop?"""
  from acco_jax import hlo

  comps, entry = hlo.parse_hlo(text)
  instrs = comps[entry]
  names = {i.name for i in instrs}
  ops = {i.name: [r for r in re.findall(r"%([\w.\-]+)", i.rest) if r in names] for i in instrs}

  def reaches(src: str, dst: str) -> bool:
    todo, seen = [dst], set()
    while todo:
      x = todo.pop()
      if x == src:
        return True
      if x not in seen:
        seen.add(x)
        todo.extend(ops.get(x, []))
    return False

  def first(pred):
    return next((i.name for i in instrs if pred(i)), None)

  rs = first(lambda i: i.opcode == "reduce-scatter")  # synchronous (CPU) form
  ag = first(lambda i: i.opcode == "all-gather")
  pairs = {}  # async (GPU) form: the largest pair of each kind; reduce-scatter done -> all-gather start
  for p in hlo.async_overlap_report(text):
    if p.bytes >= pairs.get(p.kind, p).bytes:
      pairs[p.kind] = p
  if "reduce-scatter" in pairs:
    rs = instrs[pairs["reduce-scatter"].done].name
  if "all-gather" in pairs:
    ag = instrs[pairs["all-gather"].start].name
  loop = first(lambda i: i.opcode == "while")
  return {
    "all_gather_depends_on_reduce_scatter": bool(rs and ag and reaches(rs, ag)),
    "loop_depends_on_collectives": bool(loop and any(reaches(c, loop) for c in (rs, ag) if c)),
    "collectives_depend_on_loop": bool(loop and any(reaches(loop, c) for c in (rs, ag) if c)),
    "entry_whiles": sum(i.opcode == "while" for i in instrs),
  }


def cpu_checks(args) -> dict:
  """What a CPU can check: dataflow precondition (GPT-2), the RS -> AG chain (small model)."""
  import jax

  from acco_jax import hlo

  devices = jax.devices()[: args.devices]
  fn, fargs, train = build_stage(args.model, devices, args.k, args.rows, args.seq)
  report = hlo.dataflow_report(jax.make_jaxpr(fn)(*fargs))
  small_fn, small_args, _ = build_stage("tiny", devices, args.k, args.rows, 64)
  facts = chain_facts(small_fn.lower(*small_args).compile().as_text())
  return {
    "params": train.layout.num_params,
    "dataflow": {
      "overlappable": report.overlappable,
      "loops": report.loops,
      "loop_feeds_comm": report.loop_feeds_comm,
      "comm_feeds_loop": report.comm_feeds_loop,
      "collectives_in_loop": len(report.collectives_in_loop),
      "large_psums": len(report.large_psums),
    },  # fmt: skip
    "cpu_hlo_chain": facts,
  }


def gpu_schedule(args) -> dict:
  """Compiles on the GPU (mocked devices if fewer than 8) and reads the async schedule."""
  import jax

  devices = jax.devices()[: args.devices]
  if len(devices) < args.devices:
    raise RuntimeError(f"only {len(devices)} devices visible, need {args.devices}")
  fn, fargs, train = build_stage(args.model, devices, args.k, args.rows, args.seq)
  text = fn.lower(*fargs).compile().as_text()
  if args.dump:
    Path(args.dump).write_text(text)
  return {"params": train.layout.num_params, "devices": [str(d) for d in devices],
          **schedule_report(text)}  # fmt: skip


def schedule_report(text: str) -> dict:
  """The async pairs of the flat reduce-scatter / all-gather, the verdict and an excerpt."""
  from acco_jax import hlo

  comps, entry = hlo.parse_hlo(text)
  instrs = comps[entry]
  pairs = hlo.async_overlap_report(text)
  whiles = [i for i, x in enumerate(instrs) if x.opcode == "while"]
  big = {}
  for p in pairs:
    if p.kind in ("reduce-scatter", "all-gather") and p.bytes >= big.get(p.kind, p).bytes:
      big[p.kind] = p
  bracketing = [k for k, p in big.items() if p.brackets_loop and not p.is_sync]
  verdict = "full" if len(bracketing) == 2 else "partial" if bracketing else "none"
  marks = {p.start for p in big.values()} | {p.done for p in big.values()} | set(whiles)
  excerpt = []
  for i, x in enumerate(instrs):
    if i in marks or any(abs(i - m) <= 1 for m in marks):
      excerpt.append(f"{i:5d}  %{x.name} = {x.shape[:60]} {x.opcode}({x.rest[:160]}")
  return {
    "entry_instructions": len(instrs),
    "whiles": whiles,
    "pairs": [p._asdict() for p in pairs],
    "flat_pairs": {k: p._asdict() for k, p in big.items()},
    "bracketing": bracketing,
    "verdict": verdict,
    "excerpt": excerpt,
    "chain": chain_facts(text),
  }


def worker(args) -> int:
  import jax

  out = {"jax": jax.__version__, "backend": jax.default_backend(),
         "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
         "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "mock": {k: os.environ[k] for k in ("MOCK_NUM_GPU_PROCESSES", "JAX_MOCK_GPU_TOPOLOGY")
                  if k in os.environ}}  # fmt: skip
  out.update(gpu_schedule(args) if out["backend"] == "gpu" else cpu_checks(args))
  Path(args.worker).write_text(json.dumps(out))
  return 0


def run_worker(args, env: dict, out: Path) -> tuple[dict | None, str]:
  cmd = [sys.executable, __file__, "--worker", str(out), "--model", args.model,
         "--devices", str(args.devices), "--k", str(args.k), "--rows", str(args.rows),
         "--seq", str(args.seq)] + (["--dump", args.dump] if args.dump else [])  # fmt: skip
  try:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return None, f"timed out after {TIMEOUT_S} s"
  if p.returncode != 0 or not out.exists():
    return None, (p.stdout + p.stderr)[-3000:]
  return json.loads(out.read_text()), ""


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--model", default="gpt2")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--k", type=int, default=2, help="microbatches per device per stage")
  ap.add_argument("--rows", type=int, default=4, help="rows per microbatch")
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--out", default=str(common.RESULTS / "overlap_gpu.json"))
  ap.add_argument("--dump", help="also write the compiled GPU module's text here")
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)

  from acco_jax import parallel

  info = probe()
  print(f"backend {info.get('backend')} x{info.get('devices')} ({info.get('kind')}), "
        f"jax {info.get('jax')}")  # fmt: skip
  tmp = Path(args.out).with_suffix(".worker.tmp")
  attempts, result = [], None
  if info.get("backend") != "gpu":
    print("needs a GPU: XLA:CPU runs collectives synchronously (no async start/done to inspect).")
    print("Checking the preconditions on CPU instead (simulated devices).")
    result, err = run_worker(args, common.cpu_env(args.devices), tmp)
    attempts.append({"env": "cpu", "error": err})
    status = "pending: needs a GPU"
  else:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *parallel.GPU_OVERLAP_FLAGS])
    local = int(info["devices"])
    mocks = [{}]
    if local < args.devices:
      procs = math.ceil(args.devices / local)
      mocks = [{"MOCK_NUM_GPU_PROCESSES": str(procs)},
               {"JAX_MOCK_GPU_TOPOLOGY": f"1x{procs}x{local}"}]  # fmt: skip
    for mock in mocks:
      result, err = run_worker(args, {**env, **mock}, tmp)
      attempts.append({"env": mock, "error": err})
      if result is not None:
        break
    status = result["verdict"] if result else "error"
  tmp.unlink(missing_ok=True)
  data = {"machine": common.machine(), "probe": info, "status": status, "attempts": attempts,
          "result": result}  # fmt: skip
  if result and result.get("backend") == "gpu":
    print(
      f"device {result['device_kind']} x{result['device_count']} (mock: {result['mock'] or 'no'})"
    )
    print(f"XLA_FLAGS: {result['xla_flags']}")
    for kind, p in result["flat_pairs"].items():
      print(f"{kind:15s} start {p['start']:5d} done {p['done']:5d} brackets_loop="
            f"{p['brackets_loop']} is_sync={p['is_sync']} bytes={p['bytes']:,}")  # fmt: skip
    print(f"while loops in entry at {result['whiles']}")
    print("excerpt of the scheduled entry computation:")
    print("\n".join(result["excerpt"]))
    print(f"VERDICT: {status} (collectives bracketing the loop: {result['bracketing']})")
  elif result:
    d, c = result["dataflow"], result["cpu_hlo_chain"]
    independent = not c["loop_depends_on_collectives"] and not c["collectives_depend_on_loop"]
    print(
      f"dataflow precondition on {args.model} ({result['params']:,} params): "
      f"overlappable={d['overlappable']} (loops={d['loops']}, "
      f"loop->comm={d['loop_feeds_comm']}, comm->loop={d['comm_feeds_loop']}, "
      f"collectives in loop={d['collectives_in_loop']}, gradient psums={d['large_psums']})"
    )
    print(f"compiled CPU module (tiny model): all-gather depends on reduce-scatter="
          f"{c['all_gather_depends_on_reduce_scatter']}, loop independent={independent}, "
          f"whiles in entry={c['entry_whiles']} (two loops: each collective can bracket one)")  # fmt: skip
    print(
      f"VERDICT: {status}. Run on a GPU machine: JAX_PLATFORMS=cuda,cpu python bench/overlap_gpu.py"
    )
  else:
    print(f"VERDICT: {status}; attempts: {json.dumps(attempts)[:3000]}")
  print(f"wrote {common.write_json(Path(args.out), data)}")
  if info.get("backend") != "gpu":
    return 0 if result else 1
  return 0 if status in ("full", "partial") else 1


if __name__ == "__main__":
  sys.exit(main())
