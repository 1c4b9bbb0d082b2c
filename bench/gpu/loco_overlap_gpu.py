"""Does XLA:GPU keep Streaming DiLoCo's outer all-reduce in flight across the inner steps?

Compiles the *window* program of Streaming DiLoCo (:mod:`acco_jax.loco.programs`: the
pseudo-gradient of a fragment, its all-reduce over the workers, and the ``τ`` inner steps, one XLA
program) for ``--workers`` x ``--per-worker`` abstract GPUs (``acco_jax.parallel.gpu_aot_devices``:
the CUDA PJRT plugin, no GPU), with :data:`acco_jax.parallel.GPU_OVERLAP_FLAGS`, and reads the
scheduled entry computation (:func:`acco_jax.analysis.hlo.async_overlap_report`): for every asynchronous
all-reduce whose replica groups join devices of different workers, whether its start and done
bracket an inner-step ``while`` (the microbatch loop of the first inner step, and the loop over the
remaining ones), and whether XLA marked it synchronous. Verdict ``full`` if every such pair brackets
a loop, ``partial`` if some do, ``none`` otherwise. The control is the same fragment's ``τ = 0``
sync program, whose all-reduce has no inner step to hide behind (``none`` expected).

Usage::

  python -m bench.gpu.loco_overlap_gpu                     # GPT-2 124M, 2 workers x 4 H100, tau = 1
  python -m bench.gpu.loco_overlap_gpu --model tiny --layers 4 --overlap 2 --out /tmp/x.json   # CI
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from bench import common


def worker_pairs(text: str, per_worker: int) -> list[dict]:
  """Async all-reduce pairs of the entry whose groups span workers (device id // per_worker)."""
  from acco_jax.analysis import hlo

  comps, entry = hlo.parse_hlo(text)
  instrs = comps[entry]
  out = []
  for p in hlo.async_overlap_report(text):
    if p.kind != "all-reduce":
      continue
    start = instrs[p.start]
    rest = start.rest
    if start.opcode in ("async-start", "call-start"):  # the wrapped computation holds the groups
      called = re.findall(r"calls=%?([\w.\-]+)", rest)
      rest = " ".join(i.rest for c in called for i in comps.get(c, []))
    groups = hlo.replica_groups(rest)
    if any(len({d // per_worker for d in g}) > 1 for g in groups):
      out.append({**p._asdict(), "groups": groups[:4]})
  return out


def compile_program(args, overlap: int) -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  import acco_jax
  from acco_jax import loco, model, parallel
  from acco_jax.loco import step as loco_step

  n = args.workers * args.per_worker
  devices = parallel.gpu_aot_devices(n, args.target, hosts=args.workers)
  overrides = {"L": args.seq} | ({"N": args.layers} if args.layers else {})
  cfg = model.get_config(args.model, **overrides)
  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  mesh = loco_step.worker_mesh(args.workers, devices)
  method = loco.streaming_diloco(
    sync_every=args.fragments * (args.overlap + 1),
    fragments=args.fragments,
    overlap_steps=overlap,
    alpha=0.5,
    quantize="fp4",
  )
  inner = acco_jax.zero1(
    optax.adamw(4e-4, b1=0.9, b2=0.95, weight_decay=0.1), comm_dtype="bfloat16"
  )
  loss = lambda p, b: model.loss_fn(p, cfg, b)
  train = loco_step.make_loco_step(
    loss, inner, method, mesh, num_microbatches=args.k, params=shapes, has_aux=True
  )
  state = train.abstract_state(shapes)
  rows = n * args.k * args.rows
  batch = {
    key: jax.ShapeDtypeStruct((rows, args.seq), jnp.int32, sharding=train.batch_sharding())
    for key in ("inputs", "targets")
  }
  if overlap:
    fn = train.program("window", 0, state)
    text = fn.lower(state, [batch] * overlap).compile().as_text()
  else:
    text = train.program("sync", 0, state).lower(state).compile().as_text()
  from acco_jax.analysis import hlo

  comps, entry = hlo.parse_hlo(text)
  whiles = [i for i, x in enumerate(comps[entry]) if x.opcode == "while"]
  # the fragment's all-reduce (float32, every device its 1/D of the fragment): the tiny ones left
  # are metrics (the finiteness flag of the pseudo-gradient), not the payload
  payload = 4 * train.fragment_sizes()[0] // args.per_worker
  pairs = [p for p in worker_pairs(text, args.per_worker) if p["bytes"] >= payload // 2]
  good = [p for p in pairs if p["brackets_loop"] and not p["is_sync"]]
  verdict = "full" if pairs and len(good) == len(pairs) else "partial" if good else "none"
  if args.dump:
    Path(args.dump + (".window" if overlap else ".sync")).write_text(text)
  return {
    "program": "window" if overlap else "sync",
    "overlap_steps": overlap,
    "params": train.layout.num_params,
    "fragment_values": train.fragment_sizes()[0],
    "device_kind": devices[0].device_kind,
    "entry_instructions": len(comps[entry]),
    "whiles": whiles,
    "worker_all_reduces": pairs,
    "verdict": verdict,
  }


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="gpt2")
  ap.add_argument("--layers", type=int, default=0, help="override the number of blocks")
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--rows", type=int, default=4, help="rows per microbatch")
  ap.add_argument("--k", type=int, default=2, help="microbatches per device per inner step")
  ap.add_argument("--workers", type=int, default=2)
  ap.add_argument("--per-worker", type=int, default=4)
  ap.add_argument("--fragments", type=int, default=2)
  ap.add_argument("--overlap", type=int, default=1, help="tau of the window program")
  ap.add_argument("--target", default="h100")
  ap.add_argument("--dump", default="", help="write the compiled modules to DUMP.window/.sync")
  ap.add_argument("--out", default=str(common.RESULTS / "loco_overlap_gpu.json"))
  args = ap.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax starts: the GPUs are abstract
  from acco_jax import parallel

  if not parallel.has_cuda_plugin():
    print("skipped: needs the CUDA PJRT plugin (pip install jax-cuda12-pjrt==<jaxlib version>)")
    return 0
  parallel.configure_platform(gpu_overlap=True)
  import jax

  results = [compile_program(args, args.overlap), compile_program(args, 0)]
  data = {
    "machine": common.machine(),
    "jax": jax.__version__,
    "args": vars(args),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "results": results,
  }
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(data, indent=1))
  for r in results:
    pairs = ", ".join(
      f"{p['start']}->{p['done']} ({p['bytes']:,} B{' sync' if p['is_sync'] else ''})"
      for p in r["worker_all_reduces"]
    )
    print(
      f"{r['program']:6s} tau={r['overlap_steps']}: verdict {r['verdict']}; whiles at "
      f"{r['whiles']}; all-reduces over workers: {pairs or 'none'}"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
