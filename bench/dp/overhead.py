"""Single-device cost of the ACCO stage against a plain jitted train step, measured side by side.

On one CPU device (its own process), for the same GPT model, microbatches and AdamW:

* ``plain``: a hand-written single-device step: cast the fp32 params to bf16 once, ``value_and_grad``
  over ``k`` microbatches in a ``fori_loop`` with an fp32 accumulator, mean, ``optax.adamw`` update of
  the fp32 params; the (params, opt_state) state is donated;
* ``acco`` (and ``zero1``, ``dpu``, ``ddp``): the stage program of :func:`acco_jax.make_train_step`
  on a 1-device mesh, the state donated. With N = 1 the collectives are trivial, so what is left is
  the library's own work: the flat-layout ravel/unravel, the bf16 gradient buffer, ACCO's two-stage
  select and committed copy.

Every program is compiled ahead of time and warmed up; then the methods are timed in interleaved
rounds (each round runs ``--steps`` consecutive steps of every method; the order alternates between
rounds) so that load on a shared machine hits them alike. Reports the median step time, tokens/s and
the ratio to ``plain``: of the wall-time medians (the headline), the median of the per-round ratios,
of the fastest steps, and of the median process CPU time (all threads; the least sensitive to other
jobs on the machine, which stretch wall time but not the CPU time a program needs). Also reports each
compiled program's temp bytes and the number of ``copy`` instructions outside the microbatch loop.

Usage::

  python -m bench.dp.overhead                 # D=256, 4 layers, V=2048, L=128, k=4 x B=4; 25 rounds x 1
  python -m bench.dp.overhead --smoke --out /tmp/overhead.json   # tiny model, 2 rounds x 2 steps (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time
from pathlib import Path

from bench import common

METHODS = ("acco", "zero1", "dpu", "ddp")
DEFAULT_METHODS = ("acco", "zero1", "ddp")
TARGET = 0.95


def static_costs(compiled) -> dict:
  """XLA's static view of a compiled program: temp bytes and the copy ops outside the loop."""
  entry = compiled.as_text().split("\nENTRY", 1)[-1]
  return {
    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    "entry_copies": len(re.findall(r"= \S+ copy\(", entry)),
  }


def worker(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax

  import acco_jax
  from acco_jax import model

  assert jax.device_count() == 1, jax.devices()
  cfg = model.get_config(
    "tiny", V=args.vocab, L=args.seq, D=args.width, H=args.heads, N=args.layers
  )
  k, b, seq = args.microbatches, args.rows, args.seq
  params = model.init_params(cfg, 0)
  psi = model.num_params(params)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.V, size=(k * b, seq + 1), dtype=np.int32)
  host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  loss = lambda p, mb: model.loss_fn(p, cfg, mb)
  adamw = lambda: optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)

  # -- plain single-device step ------------------------------------------------------------------
  tx = adamw()
  grad_fn = jax.value_and_grad(loss, has_aux=True)

  def plain_step(state, batch):
    p, opt_state = state
    w = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
    mbs = jax.tree.map(lambda x: x.reshape(k, b, *x.shape[1:]), batch)

    def body(j, carry):
      acc, loss_sum, tok = carry
      mb = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, j, keepdims=False), mbs)
      (value, aux), g = grad_fn(w, mb)
      acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
      return acc, loss_sum + value, tok + aux["tokens"]

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p)
    acc, loss_sum, _ = lax.fori_loop(0, k, body, (zeros, jnp.float32(0), jnp.float32(0)))
    g = jax.tree.map(lambda a: a / k, acc)
    updates, opt_state = tx.update(g, opt_state, p)
    return (optax.apply_updates(p, updates), opt_state), loss_sum / k

  batch = jax.device_put(host_batch)
  plain_state = (params, tx.init(params))
  t = time.perf_counter()
  plain = jax.jit(plain_step, donate_argnums=0).lower(plain_state, batch).compile()
  compile_s = {"plain": time.perf_counter() - t}
  static = {"plain": static_costs(plain)}
  plain_state = jax.device_put(jax.tree.map(jnp.array, plain_state))
  runners = {}

  def run_plain(state):
    return plain(state, batch)[0]

  runners["plain"] = [run_plain, plain_state]

  # -- library stages on a 1-device mesh ---------------------------------------------------------
  mesh = jax.make_mesh((1,), ("data",))
  for method in args.methods:
    train = acco_jax.make_train_step(
      loss,
      acco_jax.get_method(method, adamw()),
      mesh,
      num_microbatches=k,
      params=params,
      has_aux=True,
    )
    first = jax.tree.map(lambda x: x[:b], host_batch)
    state = train.init(params, first if train.plan.delayed else None)
    kind = "delayed" if train.plan.delayed else "sync"
    placed = train.put_batch(host_batch, per_device=k)
    t = time.perf_counter()
    compiled = train.stage_program(kind, state).lower(state, placed).compile()
    compile_s[method] = time.perf_counter() - t
    static[method] = static_costs(compiled)

    def run(state, compiled=compiled, placed=placed):
      return compiled(state, placed)[0]

    runners[method] = [run, state]

  names = list(runners)
  for name in names:  # warm-up
    fn, state = runners[name]
    for _ in range(args.warmup):
      state = fn(state)
    runners[name][1] = jax.block_until_ready(state)

  times = {name: [] for name in names}
  cpu = {name: [] for name in names}
  for r in range(args.rounds):
    for name in names if r % 2 == 0 else names[::-1]:
      fn, state = runners[name]
      t, c = time.perf_counter(), time.process_time()
      for _ in range(args.steps):
        state = fn(state)
      runners[name][1] = state = jax.block_until_ready(state)
      times[name].append((time.perf_counter() - t) / args.steps)
      cpu[name].append((time.process_time() - c) / args.steps)
    common.log(
      f"  round {r + 1}/{args.rounds}: "
      + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in names)
    )

  tokens_per_step = k * b * seq
  results = {}
  for name in names:
    med = statistics.median(times[name])
    results[name] = {
      "step_s": times[name],
      "median_step_s": med,
      "min_step_s": min(times[name]),
      "tokens_per_s": tokens_per_step / med,
      "cpu_s": cpu[name],
      "median_cpu_s": statistics.median(cpu[name]),
      "compile_s": round(compile_s[name], 2),
      "static": static[name],
    }
  for name in names:
    per_round = [p / m for p, m in zip(times["plain"], times[name], strict=True)]
    results[name]["ratio_to_plain"] = (
      results[name]["tokens_per_s"] / results["plain"]["tokens_per_s"]
    )
    results[name]["ratio_to_plain_paired_median"] = statistics.median(per_round)
    q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
    results[name]["ratio_to_plain_paired_iqr"] = [q[0], q[2]]
    results[name]["ratio_to_plain_min"] = (
      results["plain"]["min_step_s"] / results[name]["min_step_s"]
    )
    results[name]["ratio_to_plain_cpu"] = (
      results["plain"]["median_cpu_s"] / results[name]["median_cpu_s"]
    )
  return {
    "model": dataclasses.asdict(cfg),
    "psi": psi,
    "tokens_per_step": tokens_per_step,
    "results": results,
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--vocab", type=int, default=2048)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--microbatches", type=int, default=4, help="k, microbatches per step")
  p.add_argument("--rows", type=int, default=4, help="B, rows per microbatch")
  p.add_argument("--rounds", type=int, default=25)
  p.add_argument("--steps", type=int, default=1, help="steps per method per round")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
  p.add_argument("--timeout", type=float, default=900)
  p.add_argument("--smoke", action="store_true", help="tiny model, acco vs plain, 2 x 2 steps (CI)")
  p.add_argument("--out", type=Path, default=common.RESULTS / "overhead.json")
  p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    args.width, args.layers, args.heads, args.vocab, args.seq = 32, 1, 2, 128, 16
    args.microbatches, args.rows, args.rounds, args.steps, args.warmup = 2, 2, 2, 2, 1
    args.methods = ["acco"]
  if args.worker:
    common.write_json(args.worker, worker(args))
    return 0

  fwd = []
  for name in ("width", "layers", "heads", "vocab", "seq", "microbatches", "rows", "rounds"):
    fwd += [f"--{name}", str(getattr(args, name))]
  fwd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--methods", *args.methods]
  common.log(f"overhead: plain vs {', '.join(args.methods)} on 1 CPU device ...")
  started, load_start = time.perf_counter(), common.loadavg()
  run = common.run_worker(__spec__.name, 1, fwd, args.timeout)
  wall = time.perf_counter() - started

  res = run["results"]
  rows, static_rows = [], []
  for name, r in res.items():
    lo, hi = r["ratio_to_plain_paired_iqr"]
    rows.append(
      {
        "method": name,
        "median": f"{r['median_step_s'] * 1e3:.0f}",
        "min": f"{r['min_step_s'] * 1e3:.0f}",
        "tps": f"{r['tokens_per_s']:,.0f}",
        "ratio": f"{r['ratio_to_plain']:.3f}",
        "paired": f"{r['ratio_to_plain_paired_median']:.3f} [{lo:.2f}, {hi:.2f}]",
        "rmin": f"{r['ratio_to_plain_min']:.3f}",
        "cpu": f"{r['median_cpu_s'] * 1e3:.0f}",
        "rcpu": f"{r['ratio_to_plain_cpu']:.3f}",
        "compile": f"{r['compile_s']:.1f}",
      }
    )
    st = r["static"]
    static_rows.append(
      {
        "method": name,
        "temp": f"{st['temp_bytes'] / 2**20:.1f}",
        "copies": st["entry_copies"],
      }
    )
  table = common.format_table(
    rows,
    [
      ("method", "method"),
      ("median", "median ms/step"),
      ("min", "min ms"),
      ("tps", "tokens/s"),
      ("ratio", "× plain"),
      ("paired", "× plain paired [IQR]"),
      ("rmin", "× plain (min)"),
      ("cpu", "median CPU ms"),
      ("rcpu", "× plain (CPU)"),
      ("compile", "compile s"),
    ],
  )
  static_table = common.format_table(
    static_rows,
    [
      ("method", "method"),
      ("temp", "temp MiB"),
      ("copies", "copy ops outside loop"),
    ],
  )
  table += (
    "\n\nCompiled programs: temp bytes, copy instructions in the entry computation\n" + static_table
  )
  m = run["model"]
  acco = res.get("acco")
  acco_ratio = acco["ratio_to_plain"] if acco else None
  if acco is None:
    verdict = "no acco run"
  else:
    judge = lambda r: "holds" if r >= TARGET else "FAILS"
    verdict = (
      f"acco/plain tokens/s: {acco_ratio:.3f} (medians of wall time), "
      f"{acco['ratio_to_plain_paired_median']:.3f} (paired rounds), "
      f"{acco['ratio_to_plain_cpu']:.3f} (median process CPU time); target >= {TARGET}: "
      f"{judge(acco_ratio)} on wall-time medians, {judge(acco['ratio_to_plain_cpu'])} on CPU time"
    )
  print(
    f"GPT D={m['D']} layers={m['N']} H={m['H']} V={m['V']} L={args.seq} (Ψ = {run['psi']:,}), "
    f"k={args.microbatches} x B={args.rows} -> {run['tokens_per_step']} tokens/step; "
    f"{args.rounds} rounds x {args.steps} steps"
  )
  print(table)
  print(verdict)
  print(f"1-min load average: {load_start} at start, {common.loadavg()} at end")
  result = {
    "benchmark": "overhead",
    "command": "python -m bench.dp.overhead" + (" --smoke" if args.smoke else ""),
    "machine": common.machine() | {"loadavg_1m_at_start": load_start},
    "config": {k: getattr(args, k) for k in ("microbatches", "rows", "rounds", "steps", "warmup")}
    | {"methods": args.methods, "optimizer": "adamw"},
    "model": m,
    "psi": run["psi"],
    "tokens_per_step": run["tokens_per_step"],
    "wall_s": round(wall, 1),
    "results": res,
    "target": TARGET,
    "acco_ratio": acco_ratio,
    "target_holds": None if acco is None else acco_ratio >= TARGET,
    "target_holds_cpu_time": None if acco is None else acco["ratio_to_plain_cpu"] >= TARGET,
    "table": table,
  }
  common.write_json(args.out, result)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
