"""The ``--cost`` part of ``bench/dp/acco_quantized.py``: what quantizing the communication costs.

:func:`cost_worker` (a ``--worker`` child of the script on 8 simulated devices) times one ACCO /
ZeRO-1 stage of the ``d8`` model with each ``comm.quantize`` mode, interleaved repetitions;
:func:`cost_report` prints the medians as a ratio to bf16 and, with the CUDA plugin, the kernels
the quantization adds to the compiled XLA:GPU stage (:func:`gpu_kernels`), and writes
``acco_quantized_cost.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout: bench, acco_jax
from bench import common  # noqa: E402
from bench.dp.convergence_settings import SETTINGS  # noqa: E402

SCRIPT = str(Path(__file__).with_name("acco_quantized.py"))  # its --worker runs cost_worker


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
      train = acco_jax.make_train_step(loss, tx, mesh, num_microbatches=k, params=params,
                                       has_aux=True)  # fmt: skip
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


def gpu_kernels() -> dict:
  """Kernels of the compiled XLA:GPU ACCO stage (GPT-2-shaped tiny model, 8 x H100, compile only):
  entry-computation fusions and the ones that touch int8 (the quantize/dequantize fusions)."""
  import os
  import re
  import subprocess

  code = r"""
import json, os, re, sys
sys.path.insert(0, %r); sys.path.insert(0, %r)
from bench.gpu import overlap_gpu  # noqa: E402
from acco_jax.analysis import hlo
from acco_jax.run import parallel
devices = parallel.gpu_aot_devices(8, "h100")
out = {}
for label in ("acco", "acco-int8", "acco-int4"):
  fn, args, _ = overlap_gpu.build_stage("tiny", devices, 2, 4, 64, label)
  comps, entry = hlo.parse_hlo(fn.lower(*args).compile().as_text())
  ins = comps[entry]
  fusions = [i for i in ins if i.opcode == "fusion"]
  s8 = [i.name for i in fusions if "s8[" in i.shape or "s8[" in i.rest.split("calls=")[0]]
  out[label] = {"entry_instructions": len(ins), "fusions": len(fusions), "int8_fusions": s8}
print("JSON" + json.dumps(out))
""" % (str(common.REPO), str(Path(__file__).parent))  # noqa: UP031
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  from acco_jax.run import parallel

  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(parallel.GPU_OVERLAP_FLAGS))
  p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                     timeout=1800)  # fmt: skip
  line = next((x for x in p.stdout.splitlines() if x.startswith("JSON")), None)
  if line is None:
    return {"error": (p.stdout + p.stderr)[-2000:]}
  del re
  return json.loads(line[4:])


def cost_report(args) -> int:
  res = common.run_worker(SCRIPT, 8, ["--cost", "--reps", str(args.reps)], 3600)
  table = []
  for method, by_mode in res["times"].items():
    base = statistics.median(by_mode["none"])
    for mode, t in by_mode.items():
      med = statistics.median(t)
      table.append({"method": method, "mode": mode, "median": f"{1e3 * med:.1f}",
                    "spread": f"{1e3 * min(t):.1f}-{1e3 * max(t):.1f}",
                    "ratio": f"{med / base:.3f}"})  # fmt: skip
  print(common.format_table(table, [("method", "method"), ("mode", "quantize"),
        ("median", "median ms/stage"), ("spread", "min-max ms"), ("ratio", "x bf16")]))  # fmt: skip
  from acco_jax.run.parallel import has_cuda_plugin

  kernels = gpu_kernels() if has_cuda_plugin() else {"skipped": "no CUDA PJRT plugin"}
  print(json.dumps(kernels, indent=1))
  path = common.write_json(Path(args.out) / "acco_quantized_cost.json",
                           {"machine": common.machine(), **res, "table": table,
                            "gpu_kernels": kernels})  # fmt: skip
  print(f"wrote {path}")
  return 0
