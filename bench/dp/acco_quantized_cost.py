"""The ``--cost`` part of ``python -m bench.dp.acco_quantized``: what quantizing the communication
costs.

:func:`cost_report` (what ``--cost`` runs) starts this module's :func:`main` as a worker: on 8
simulated devices, :func:`cost_worker` times one ACCO / ZeRO-1 stage of the ``d8`` model with each
``comm.quantize`` mode, interleaved repetitions; and, with the CUDA plugin, in a process of its own
with XLA:GPU's flags, :func:`gpu_kernels_worker` lists the kernels the quantization adds to the
compiled XLA:GPU stage. :func:`cost_report` prints the medians as a ratio to bf16 and the kernels,
and writes ``acco_quantized_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.dp.convergence_settings import SETTINGS


def cost_worker(args) -> dict:
  """CPU time of one stage per mode (interleaved repetitions, medians), d8 model, 8 devices."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import acco_jax
  from acco_jax import model

  s = SETTINGS["d8"]
  n = jax.device_count()
  cfg = model.get_config("tiny", V=2048, L=s["seq_len"], D=s["D"], N=s["N"], H=s["H"])
  params = model.init_params(cfg, 0)
  loss = lambda p, b: model.loss_fn(p, cfg, b)
  mesh = jax.make_mesh((n,), ("data",))
  r = np.random.default_rng(0)
  out = {}
  for method in ("acco", "zero1"):
    k = s["microbatches"] // (2 if method == "acco" else 1)
    rows = n * k * s["microbatch_size"]
    tokens = r.integers(0, 2048, size=(rows, s["seq_len"] + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    steps = {}
    for mode in ("none", "int8", "int4"):
      quant = {} if mode == "none" else {"quantize": mode, "block": 256, "node_size": 1}
      tx = acco_jax.get_method(method, optax.adamw(1e-3), comm_dtype=jnp.bfloat16, **quant)
      train = acco_jax.make_train_step(
        loss, tx, mesh, num_microbatches=k, params=params, has_aux=True
      )
      first = jax.tree.map(lambda x: x[: n * s["microbatch_size"]], batch)
      state = train.init(params, first)
      for _ in range(2):  # compile, warm up
        state, m = train.step(state, batch)
      jax.block_until_ready(m["loss"])
      steps[mode] = [train, state, []]
    for _ in range(args.reps):
      for entry in steps.values():
        t0 = time.perf_counter()
        entry[1], m = entry[0].step(entry[1], batch)
        jax.block_until_ready((entry[1].w, m["loss"]))
        entry[2].append(time.perf_counter() - t0)
    out[method] = {mode: e[2] for mode, e in steps.items()}
    med = {mode: statistics.median(t) for mode, t in out[method].items()}
    common.log(f"{method}: " + ", ".join(f"{m} {v * 1e3:.1f} ms" for m, v in med.items()))
  return {"times": out, "reps": args.reps, "devices": n}


def gpu_kernels_worker() -> dict:
  """Kernels of the compiled XLA:GPU ACCO stage (GPT-2-shaped tiny model, 8 x H100, compile only):
  entry-computation fusions and the ones that touch int8 (the quantize/dequantize fusions). Runs
  in a process started with XLA:GPU's flags (:func:`gpu_kernels`)."""
  from acco_jax import parallel
  from acco_jax.analysis import hlo
  from bench.gpu import overlap_gpu

  devices = parallel.gpu_aot_devices(8, "h100")
  out = {}
  for label in ("acco", "acco-int8", "acco-int4"):
    fn, args, _ = overlap_gpu.build_stage("tiny", devices, 2, 4, 64, label)
    comps, entry = hlo.parse_hlo(fn.lower(*args).compile().as_text())
    ins = comps[entry]
    fusions = [i for i in ins if i.opcode == "fusion"]
    s8 = [i.name for i in fusions if "s8[" in i.shape or "s8[" in i.rest.split("calls=")[0]]
    out[label] = {"entry_instructions": len(ins), "fusions": len(fusions), "int8_fusions": s8}
  return out


def gpu_kernels() -> dict:
  """:func:`gpu_kernels_worker` in a child process whose XLA flags are the GPU overlap flags."""
  from acco_jax import parallel

  env = {k: v for k, v in common.child_env().items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(parallel.GPU_OVERLAP_FLAGS))
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "kernels.json"
    cmd = common.module_command(__spec__.name, "--worker", str(out), "--part", "gpu_kernels")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0 or not out.exists():
      return {"error": (p.stdout + p.stderr)[-2000:]}
    return json.loads(out.read_text())


def cost_report(args) -> int:
  res = common.run_worker(__spec__.name, 8, ["--part", "times", "--reps", str(args.reps)], 3600)
  table = []
  for method, by_mode in res["times"].items():
    base = statistics.median(by_mode["none"])
    for mode, t in by_mode.items():
      med = statistics.median(t)
      table.append(
        {
          "method": method,
          "mode": mode,
          "median": f"{1e3 * med:.1f}",
          "spread": f"{1e3 * min(t):.1f}-{1e3 * max(t):.1f}",
          "ratio": f"{med / base:.3f}",
        }
      )
  print(
    common.format_table(
      table,
      [
        ("method", "method"),
        ("mode", "quantize"),
        ("median", "median ms/stage"),
        ("spread", "min-max ms"),
        ("ratio", "x bf16"),
      ],
    )
  )
  from acco_jax.parallel import has_cuda_plugin

  kernels = gpu_kernels() if has_cuda_plugin() else {"skipped": "no CUDA PJRT plugin"}
  print(json.dumps(kernels, indent=1))
  path = common.write_json(
    Path(args.out) / "acco_quantized_cost.json",
    {"machine": common.machine(), **res, "table": table, "gpu_kernels": kernels},
  )
  print(f"wrote {path}")
  return 0


def main(argv=None) -> int:
  """The workers of :func:`cost_report` (``python -m bench.dp.acco_quantized --cost`` starts them)."""
  ap = argparse.ArgumentParser(
    description="the workers of python -m bench.dp.acco_quantized --cost"
  )
  ap.add_argument("--worker", required=True, help="the JSON file to write")
  ap.add_argument("--part", choices=("times", "gpu_kernels"), default="times")
  ap.add_argument("--reps", type=int, default=20, help="times: timed stages per mode")
  args = ap.parse_args(argv)
  result = cost_worker(args) if args.part == "times" else gpu_kernels_worker()
  Path(args.worker).write_text(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
