r"""Bytes each device sends per optimizer update, read from the compiled stage programs, vs theory.

For every method (ddp, zero1, dpu, wp, acco) and data-parallel width ``N`` (one process per ``N``,
simulated CPU devices), it builds the stage program that :func:`acco_jax.make_train_step` runs,
lists its collectives and converts each to the bytes one device sends with ring algorithms:

.. math::

  \text{reduce-scatter, all-gather of } M \text{ bytes: } \tfrac{N-1}{N} M, \qquad
  \text{all-reduce: } 2\,\tfrac{N-1}{N} M,

then multiplies by the stages per update (2 for ACCO: estimate + commit; 1 otherwise). Theory is
``2 (N−1)/N · P · b`` per stage (:func:`acco_jax.dp.plan.comm_bytes_per_stage`, what the trainer
logs as ``comm_bytes_per_device``), with ``P`` the padded flat length and ``b`` the bytes per value.

Two readings, because XLA:CPU computes bf16 collectives in f32:

* **HLO** (``fn.lower(...).compile().as_text()``, :func:`acco_jax.analysis.hlo.hlo_collectives`) of the fp32
  program: what the compiler really emits, including the small collectives GSPMD adds (count psum,
  metrics, the global gradient norm). The bf16 program's HLO is shown too: it moves f32.
* **jaxpr** (:func:`acco_jax.analysis.dataflow.dataflow_report`) of the bf16 program: the dtype the program asks
  for (explicit ``shard_map`` collectives only).

Usage::

  python -m bench.dp.comm_accounting                      # tiny GPT, N = 2, 4, 8
  python -m bench.dp.comm_accounting --model gpt2 --devices 8   # GPT-2 124M, compile only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import common

METHODS = ("ddp", "zero1", "dpu", "wp", "acco")
TARGET = 0.01  # measured within 1% of theory


def ring_sent(kind: str, nbytes: float, n: int) -> float:
  """Bytes one device sends for a collective whose *full* buffer is ``nbytes``."""
  one = (n - 1) / n * nbytes
  return 2 * one if kind in ("all-reduce", "psum", "psum_invariant") else one


def jaxpr_full_bytes(c, n: int) -> float:
  """Full-buffer bytes of a jaxpr collective (``all_gather`` operands are one device's shard)."""
  return c.bytes * n if c.kind.startswith("all_gather") else c.bytes


def worker(args) -> dict:
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import acco_jax
  from acco_jax import model
  from acco_jax.analysis import dataflow, hlo
  from acco_jax.dp.plan import comm_bytes_per_stage

  n = jax.device_count()
  cfg = model.get_config(args.model)
  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  loss = lambda p, b: model.loss_fn(p, cfg, b)
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95))
  mesh = jax.make_mesh((n,), ("data",))
  rows = []
  for method in args.methods:
    for dtype in ("float32", "bfloat16"):
      tx = acco_jax.get_method(method, inner, comm_dtype=jnp.dtype(dtype))
      train = acco_jax.make_train_step(
        loss, tx, mesh, num_microbatches=args.k, params=shapes, has_aux=True
      )
      state = train.abstract_state(shapes)
      kind = "delayed" if train.plan.delayed else "sync"
      fn = train.stage_program(kind, state)
      data = NamedSharding(train.mesh, P("data"))
      batch = {
        key: jax.ShapeDtypeStruct((n * args.k * args.rows, cfg.L), jnp.int32, sharding=data)
        for key in ("inputs", "targets")
      }
      stages = 2 if train.plan.two_stage else 1
      padded = train.layout.padded_size
      item = jnp.dtype(dtype).itemsize
      theory_stage = comm_bytes_per_stage(train.plan, padded, n)  # = trainer's log
      flat = padded * 4  # bytes of the flat buffer in f32 (XLA:CPU's collective dtype)
      found = hlo.hlo_collectives(fn.lower(state, batch).compile().as_text())
      big = [c for c in found if c.bytes >= flat]
      small = [c for c in found if c.bytes < flat]
      report = dataflow.dataflow_report(jax.make_jaxpr(fn)(state, batch))
      movers = [c for c in report.collectives if jaxpr_full_bytes(c, n) >= padded * item]
      row = {
        "method": method,
        "N": n,
        "comm_dtype": dtype,
        "params": train.layout.num_params,
        "padded": padded,
        "stages_per_update": stages,
        "hlo": [f"{c.kind} {','.join(f'{d}[{s}]' for d, s in c.shape)}" for c in big],
        "hlo_small": len(small),
        "hlo_in_loop": sum(c.in_loop for c in found),
        "hlo_update": stages * sum(ring_sent(c.kind, c.bytes, n) for c in big),
        "hlo_small_update": stages * sum(ring_sent(c.kind, c.bytes, n) for c in small),
        "jaxpr": [f"{c.kind} {c.bytes}B" for c in movers],
        "jaxpr_update": stages * sum(ring_sent(c.kind, jaxpr_full_bytes(c, n), n) for c in movers),
        "theory_update": stages * theory_stage,
        "trainer_log_stage": theory_stage,
        "theory_f32_update": stages * 2 * (n - 1) * padded * 4 / n,
      }
      rows.append(row)
      common.log(f"N={n} {method} {dtype}: {row['hlo']} jaxpr {row['jaxpr']}")
  return {"rows": rows, "model": args.model}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--model", default="tiny", help="acco_jax.model.SIZES name")
  ap.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
  ap.add_argument("--methods", nargs="+", default=list(METHODS))
  ap.add_argument("--k", type=int, default=2, help="microbatches per device per stage")
  ap.add_argument("--rows", type=int, default=2, help="rows per microbatch")
  ap.add_argument("--out", default=str(common.RESULTS / "comm_accounting.json"))
  args = ap.parse_args(argv)
  if args.worker:
    Path(args.worker).write_text(json.dumps(worker(args)))
    return 0

  passthrough = [
    "--model",
    args.model,
    "--k",
    str(args.k),
    "--rows",
    str(args.rows),
    "--methods",
    *args.methods,
  ]
  rows = []
  for n in args.devices:
    rows += common.run_worker(__spec__.name, n, passthrough, timeout=1800)["rows"]
  table, ok = [], True
  for r in rows:
    if r["comm_dtype"] != "float32":
      continue
    bf16 = next(x for x in rows if x["method"] == r["method"] and x["N"] == r["N"] and x is not r)
    err = r["hlo_update"] / r["theory_update"] - 1
    err16 = bf16["jaxpr_update"] / bf16["theory_update"] - 1
    ok &= abs(err) <= TARGET and abs(err16) <= TARGET
    ok &= bf16["trainer_log_stage"] * bf16["stages_per_update"] == bf16["theory_update"]
    table.append(
      {
        "method": r["method"],
        "N": r["N"],
        "P": f"{r['padded']:,}",
        "colls": " + ".join(h.split()[0] for h in r["hlo"]),
        "hlo": f"{r['hlo_update']:,.0f}",
        "theory": f"{r['theory_update']:,.0f}",
        "err": f"{100 * err:+.3f}%",
        "small": f"{r['hlo_small_update']:,.0f}",
        "jaxpr16": f"{bf16['jaxpr_update']:,.0f}",
        "theory16": f"{bf16['theory_update']:,.0f}",
        "err16": f"{100 * err16:+.3f}%",
        "hlo16": f"{bf16['hlo_update']:,.0f}",
        "log": f"{bf16['trainer_log_stage']:,} x {bf16['stages_per_update']}",
        "ratio": f"{r['hlo_update'] / r['padded'] / 4:.3f}",
      }
    )
  columns = [
    ("method", "method"),
    ("N", "N"),
    ("P", "P (padded)"),
    ("colls", "large collectives"),
    ("hlo", "HLO f32 B/update"),
    ("theory", "theory f32"),
    ("err", "err"),
    ("small", "+ small colls B"),
    ("jaxpr16", "jaxpr bf16 B/update"),
    ("theory16", "theory bf16"),
    ("err16", "err"),
    ("hlo16", "HLO of bf16 program"),
    ("log", "trainer log bf16 (B/stage x stages)"),
    ("ratio", "f32 B/update / 4P"),
  ]
  print(f"Bytes sent per device per optimizer update (ring), model {args.model}\n")
  print(common.format_table(table, columns))
  verdict = "PASS" if ok else "FAIL"
  print(
    f"\n{verdict}: HLO (f32) and jaxpr (bf16) within {100 * TARGET:.0f}% of theory, "
    "trainer log = theory"
  )
  data = {
    "machine": common.machine(),
    "model": args.model,
    "k": args.k,
    "rows": rows,
    "table": table,
    "pass": bool(ok),
  }
  print(f"wrote {common.write_json(Path(args.out), data)}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
