"""Does XLA:GPU schedule ACCO's reduce-scatter and all-gather around the microbatch loops?

Compiles the ACCO stage program of GPT-2 124M (``acco_jax.model.get_config('gpt2')``) for an
8-device data mesh, with :data:`acco_jax.parallel.GPU_OVERLAP_FLAGS`, from abstract shapes (nothing
is allocated or run), and reads the scheduled entry computation with
:func:`acco_jax.analysis.hlo.async_overlap_report`: for the flat-buffer reduce-scatter and all-gather,
whether their async start/done pair brackets a microbatch ``while`` and whether XLA marked it
synchronous. Verdicts: ``full`` (each pair brackets a loop), ``partial`` (one does), ``none``.

Where it compiles (``--mode``, default ``auto`` = the first that applies):

* ``gpu``: on the visible GPUs. With fewer than ``--devices`` it first mocks the rest (JAX's
  ``jax_mock_gpu_topology``, then ``mock_num_gpu_processes``: config flags set with
  ``jax.config.update`` in the child; they are not read from environment variables), then falls back
  to compiling for an abstract topology of the visible GPU's kind (as ``aot``); if neither gives
  ``--devices`` devices it reports ``skipped`` with the reasons, never an error.
* ``aot``: no GPU needed, only the CUDA PJRT plugin (``pip install jax-cuda12-pjrt==<jaxlib
  version>``): XLA:GPU compiles for an abstract topology of ``--target`` GPUs
  (:func:`acco_jax.parallel.gpu_aot_devices`). Same compiler passes and scheduler as on the GPU,
  with the target's published figures in place of a queried device.
* ``cpu``: checks what a CPU can (the jaxpr dataflow precondition on GPT-2, the reduce-scatter ->
  all-gather chain in the compiled CPU module of a small model); XLA:CPU has no async collectives.

One structural fact bounds the answer: the all-gather's input is the optimizer update of the
reduce-scatter's output, so the reduce-scatter must be *done* before the all-gather *starts*; with a
single loop, at most one of the two pairs could bracket it. The step therefore runs a stage's
microbatches as two loops with the update ordered between them (``acco_jax/dp/stage.py``; the
checker needs ``--k`` >= 4: the loops have static trip counts, and XLA inlines a loop of one
microbatch, which leaves no ``while`` to find). ``--ablation`` also compiles with each overlap flag removed, with XLA's defaults, and
ZeRO-1 (a control: its collectives cannot overlap). Usage::

  python -m bench.gpu.overlap_gpu              # verdict on stdout, JSON in bench/results/overlap_gpu.json
  python -m bench.gpu.overlap_gpu --ablation --target a100
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from bench import common
from bench.gpu import overlap_report

TIMEOUT_S = 1200


def probe() -> dict:
  """Backend, local device count and versions, from a child process (the parent stays clean)."""
  code = (
    "import json, jax; print(json.dumps({'backend': jax.default_backend(), "
    "'devices': jax.local_device_count(), 'kind': jax.devices()[0].device_kind, "
    "'jax': jax.__version__}))"
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
  )
  if out.returncode != 0:
    return {"backend": "unknown", "error": out.stderr[-2000:]}
  return json.loads(out.stdout.strip().splitlines()[-1])


def parse_method(label: str) -> tuple[str, str, int]:
  """``acco``, ``zero1``, ``acco-int8``, ``acco-int4-n4`` -> (method, quantize, node_size)."""
  parts = label.split("-")
  quantize = parts[1] if len(parts) > 1 else "none"
  node_size = int(parts[2][1:]) if len(parts) > 2 else 1
  if parts[0] not in ("acco", "zero1") or quantize not in ("none", "int8", "int4"):
    raise SystemExit(f"unknown method {label!r}: acco or zero1, optionally -int8/-int4[-n<size>]")
  return parts[0], quantize, node_size


def build_stage(model_name: str, devices, k: int, rows: int, seq: int, method: str = "acco"):
  """(jitted stage, abstract args, train step) of ``method`` over ``devices``: acco or zero1, or
  with quantized communication (``acco-int8``, ``acco-int4-n4``: blocks of 256, nodes of 4)."""
  import optax

  import acco_jax
  from acco_jax import model

  inner = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
  method, quantize, node_size = parse_method(method)
  quant = {} if quantize == "none" else {"quantize": quantize, "node_size": node_size}
  tx = {"acco": acco_jax.acco, "zero1": acco_jax.zero1}[method](
    inner, comm_dtype="bfloat16", **quant
  )
  return common.abstract_stage(model.get_config(model_name, L=seq), tx, devices, k, rows)


def cpu_checks(args) -> dict:
  """What a CPU can check: dataflow precondition (GPT-2), the RS -> AG chain (small model)."""
  import jax

  from acco_jax.analysis import dataflow

  devices = jax.devices()[: args.devices]
  fn, fargs, train = build_stage(args.model, devices, args.k, args.rows, args.seq)
  report = dataflow.dataflow_report(jax.make_jaxpr(fn)(*fargs))
  small_fn, small_args, _ = build_stage("tiny", devices, args.k, args.rows, 64)
  facts = overlap_report.chain_facts(small_fn.lower(*small_args).compile().as_text())
  return {
    "params": train.layout.num_params,
    "dataflow": {
      "overlappable": report.overlappable,
      "loops": report.loops,
      "loop_feeds_comm": report.loop_feeds_comm,
      "comm_feeds_loop": report.comm_feeds_loop,
      "collectives_in_loop": len(report.collectives_in_loop),
      "large_psums": len(report.large_psums),
    },
    "cpu_hlo_chain": facts,
  }


def gpu_schedule(args) -> dict:
  """Compiles for the GPUs (real, mocked, or an abstract ``--target`` topology); reads the schedule."""
  import jax

  from acco_jax import parallel

  if args.mock:  # before the backend starts; compile-only (a mocked program does not run)
    name, _, value = args.mock.partition("=")
    jax.config.update(name, int(value) if value.isdigit() else value)
  if args.mode == "aot":
    devices = parallel.gpu_aot_devices(args.devices, args.target)
  else:
    devices = jax.devices()[: args.devices]
  if len(devices) < args.devices:
    raise RuntimeError(f"only {len(devices)} devices visible, need {args.devices}")
  fn, fargs, train = build_stage(args.model, devices, args.k, args.rows, args.seq, args.method)
  text = fn.lower(*fargs).compile().as_text()
  if args.dump:
    Path(args.dump).write_text(text)
  return {
    "params": train.layout.num_params,
    "device_kind": devices[0].device_kind,
    "device_count": len(devices),
    **overlap_report.schedule_report(text),
  }


# Flag sets compiled by --ablation: (name, flags, method). "main" is what train.py uses.
def variants(names: str) -> list[tuple[str, tuple[str, ...], str]]:
  from acco_jax import parallel

  full = parallel.GPU_OVERLAP_FLAGS
  drop = lambda *keys: tuple(f for f in full if not any(k in f for k in keys))
  table = {
    "main": (full, "acco"),
    "no-overlap-limit": (drop("parallel_collective_overlap_limit"), "acco"),
    "no-start-early": (drop("start_as_early_as_possible"), "acco"),
    "lhs-only": (drop("parallel_collective_overlap_limit", "start_as_early_as_possible"), "acco"),
    "xla-default": ((), "acco"),
    "zero1": (full, "zero1"),
    # quantized communication (comm.quantize): int8 / int4, every device its own node or nodes of 4
    "acco-int8": (full, "acco-int8"),
    "acco-int4": (full, "acco-int4"),
    "acco-int8-n4": (full, "acco-int8-n4"),
    "zero1-int8": (full, "zero1-int8"),
  }
  chosen = list(table) if names == "all" else names.split(",")
  unknown = [n for n in chosen if n not in table]
  if unknown:
    raise SystemExit(f"unknown --variants {unknown}; choose from {list(table)} or 'all'")
  return [(n, *table[n]) for n in chosen]


def worker(args) -> int:
  import jax

  out = {
    "jax": jax.__version__,
    "mode": args.mode,
    "backend": jax.default_backend(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "method": args.method,
    "mock": args.mock or None,
  }
  if args.mode == "aot":
    out["target"] = args.target
  out.update(cpu_checks(args) if args.mode == "cpu" else gpu_schedule(args))
  Path(args.worker).write_text(json.dumps(out))
  return 0


def run_worker(
  args,
  env: dict,
  out: Path,
  method: str = "acco",
  mode: str | None = None,
  target: str | None = None,
  mock: str = "",
) -> tuple[dict | None, str]:
  cmd = [
    *common.module_command(__spec__.name),
    "--worker",
    str(out),
    "--model",
    args.model,
    "--devices",
    str(args.devices),
    "--k",
    str(args.k),
    "--rows",
    str(args.rows),
    "--seq",
    str(args.seq),
    "--mode",
    mode or args.mode,
    "--target",
    target or args.target,
    "--method",
    method,
    "--mock",
    mock,
  ] + (["--dump", args.dump] if args.dump else [])
  try:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return None, f"timed out after {TIMEOUT_S} s"
  if p.returncode != 0 or not out.exists():
    return None, (p.stdout + p.stderr)[-3000:]
  return json.loads(out.read_text()), ""


def gpu_target_of(kind: str) -> str | None:
  """The abstract target (``acco_jax.parallel`` names) of a GPU's device kind, or None."""
  from acco_jax import parallel

  kind = kind.lower()
  return next((t for t in parallel.GPU_TARGETS if t in kind), None)


def compile_variant(args, info: dict, flags, method: str, tmp: Path) -> tuple[dict | None, list]:
  """One compile in a child process (XLA reads XLA_FLAGS once).

  On a machine with fewer GPUs than ``--devices``: mocked devices first, then the abstract topology
  of the visible GPU's kind. Returns ``(None, attempts)`` when nothing gave enough devices.
  """
  base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  user = os.environ.get("XLA_FLAGS", "")
  base["XLA_FLAGS"] = " ".join([user, *flags]).strip()
  tries = [{}]
  if args.mode == "aot":
    base["JAX_PLATFORMS"] = "cpu"  # the host runs the compiler; the target is abstract
  elif int(info.get("devices", 0)) < args.devices:
    local = int(info["devices"])
    procs = math.ceil(args.devices / local)
    tries = [
      {"mock": f"jax_mock_gpu_topology=1x{procs}x{local}"},
      {"mock": f"mock_num_gpu_processes={procs}"},
    ]
    target = gpu_target_of(info.get("kind", ""))
    if target:
      tries.append({"mode": "aot", "target": target})
  attempts = []
  for t in tries:
    env = {**base, "JAX_PLATFORMS": "cpu"} if t.get("mode") == "aot" else base
    result, err = run_worker(args, env, tmp, method, **t)
    attempts.append({**t, "error": err})
    if result is not None:
      return result, attempts
  return None, attempts


def print_schedule(name: str, r: dict) -> None:
  spans = "  ".join(
    f"{k} {p['start']}->{p['done']}{' sync' if p['is_sync'] else ''}"
    for k, p in r["flat_pairs"].items()
  )
  print(f"{name:17s} {r['method']:12s} {r['verdict']:8s} whiles at {r['whiles']}  {spans}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--mode", choices=["auto", "gpu", "aot", "cpu"], default="auto")
  ap.add_argument(
    "--target", choices=["h100", "h200", "a100"], default="h100", help="GPU for --mode aot"
  )
  ap.add_argument("--method", default="acco", help=argparse.SUPPRESS)
  ap.add_argument("--variants", default="main", help="comma list of flag sets, or 'all'")
  ap.add_argument("--ablation", action="store_true", help="same as --variants all")
  ap.add_argument("--model", default="gpt2")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument(
    "--k",
    type=int,
    default=4,
    help="microbatches per device per stage (ACCO: two loops of k/2; with one "
    "microbatch each XLA inlines the loop bodies and the checker finds no "
    "loop)",
  )
  ap.add_argument("--rows", type=int, default=4, help="rows per microbatch")
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--out", default=str(common.RESULTS / "overlap_gpu.json"))
  ap.add_argument("--dump", help="also write the compiled GPU module's text here")
  ap.add_argument("--mock", default="", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)

  from acco_jax.parallel import has_cuda_plugin

  info = probe()
  if args.mode == "auto":
    args.mode = "gpu" if info.get("backend") == "gpu" else "aot" if has_cuda_plugin() else "cpu"
  print(
    f"backend {info.get('backend')} x{info.get('devices')} ({info.get('kind')}), "
    f"jax {info.get('jax')}; mode {args.mode}"
  )
  tmp = Path(args.out).with_suffix(".worker.tmp")
  data = {"machine": common.machine(), "probe": info, "mode": args.mode}
  if args.mode == "cpu":
    print("no GPU and no CUDA PJRT plugin: XLA:CPU runs collectives synchronously (nothing async")
    print("to inspect). Checking the preconditions on CPU (simulated devices); for the schedule,")
    print('pip install "jax-cuda12-pjrt==<jaxlib version>" (compiles for a GPU target, no GPU).')
    result, err = run_worker(args, common.cpu_env(args.devices), tmp)
    tmp.unlink(missing_ok=True)
    data.update(status="pending: needs a GPU or the CUDA plugin", result=result, error=err)
    if result:
      report_cpu(args, result)
    else:
      print(f"VERDICT: error: {err}")
    print(f"wrote {common.write_json(Path(args.out), data)}")
    return 0 if result else 1

  rows = []
  for name, flags, method in variants("all" if args.ablation else args.variants):
    result, attempts = compile_variant(args, info, flags, method, tmp)
    rows.append(
      {"name": name, "flags": list(flags), "method": method, "result": result, "attempts": attempts}
    )
    if result:
      print_schedule(name, result)
    else:
      print(f"{name:17s} {method:6s} error: {attempts[-1]['error'][-600:]}")
  tmp.unlink(missing_ok=True)
  main_row = rows[0]
  result = main_row["result"]
  status = result["verdict"] if result else "error"
  if not result and args.mode == "gpu":  # too few GPUs, and neither mock nor abstract target worked
    last_line = lambda text: ([x for x in text.splitlines() if x.strip()] or [""])[-1].strip()
    reasons = "; ".join(
      f"{a.get('mock') or a.get('target')}: {last_line(a['error'])}" for a in main_row["attempts"]
    )
    status = f"skipped: {info.get('devices')} GPU(s) visible, {args.devices} needed ({reasons})"
  data.update(
    target=result.get("target") if result else None, status=status, variants=rows, result=result
  )
  if result:
    where = (
      f"abstract {args.devices} x {result['device_kind']} (compile only, --mode aot)"
      if result["mode"] == "aot"
      else f"{result['device_kind']} x{result['device_count']} (mock: {result['mock'] or 'no'})"
    )
    print(f"device: {where}; jax {result['jax']}")
    print(f"XLA_FLAGS ({main_row['name']}): {result['xla_flags']}")
    print(f"excerpt of the scheduled entry computation ({main_row['name']}):")
    print("\n".join(result["excerpt"]))
    print(f"VERDICT: {status} (collectives bracketing a loop: {result['bracketing']})")
  else:
    print(f"VERDICT: {status}")
  print(f"wrote {common.write_json(Path(args.out), data)}")
  ok = status in ("full", "partial") or status.startswith("skipped")
  return 0 if ok or main_row["method"].startswith("zero1") else 1


def report_cpu(args, result: dict) -> None:
  d, c = result["dataflow"], result["cpu_hlo_chain"]
  independent = not c["loop_depends_on_collectives"] and not c["collectives_depend_on_loop"]
  print(
    f"dataflow precondition on {args.model} ({result['params']:,} params): "
    f"overlappable={d['overlappable']} (loops={d['loops']}, "
    f"loop->comm={d['loop_feeds_comm']}, comm->loop={d['comm_feeds_loop']}, "
    f"collectives in loop={d['collectives_in_loop']}, gradient psums={d['large_psums']})"
  )
  print(
    f"compiled CPU module (tiny model): all-gather depends on reduce-scatter="
    f"{c['all_gather_depends_on_reduce_scatter']}, loop independent={independent}, "
    f"whiles in entry={c['entry_whiles']}"
  )
  print("VERDICT: pending: needs a GPU or the CUDA plugin")


if __name__ == "__main__":
  sys.exit(main())
