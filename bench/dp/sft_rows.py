"""Rows of instruction examples, packed or one a row in buckets: the share of computed positions
that carry loss, and the training throughput, on the embedded set and on an Alpaca-like length
distribution.

For each data set and mode (``data.packing`` true, or false with buckets of 64), the rows of
``--stages`` stages of an ``acco`` run (8 simulated CPU devices, 2 rows per device per microbatch,
4 microbatches per update; GPT-2 of width 256 and 4 blocks, random weights: only time is
measured) are read as the trainer reads them: *loss share* = positions with a weight / positions
computed (a bucketed batch computes its padding), *examples per stage*; then the same stages run,
and *tokens/s* counts computed positions, *loss tokens/s* the weighted ones (what trains).

* ``embedded``: the built-in set (``instruct:embedded``), GPT-2's BPE, ``data.seq_len=128``.
* ``alpaca-like``: synthetic prompt/completion pairs of random words whose lengths follow a
  log-normal fitted to the shape of Alpaca's (prompt median 20 words, response median 40, a long
  tail cut at 400), ``data.seq_len=512``, the paper's cut. Not Alpaca's text: its lengths' shape.

Usage::

  python -m bench.dp.sft_rows                 # about 20 min on 2 cores (half of it building and compiling)
  python -m bench.dp.sft_rows --smoke --out /tmp/rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench import common


def alpaca_like(path: Path, n: int, seed: int = 0) -> str:
  import numpy as np

  rng = np.random.default_rng(seed)
  words = [f"w{i}" for i in range(2000)]
  with open(path, "w") as f:
    for _ in range(n):
      p = int(np.clip(rng.lognormal(np.log(20), 0.6), 3, 400))
      r = int(np.clip(rng.lognormal(np.log(40), 0.9), 1, 400))
      prompt = " ".join(rng.choice(words, p)) + "\nAnswer:"
      f.write(json.dumps({"prompt": prompt, "completion": " " + " ".join(rng.choice(words, r))}))
      f.write("\n")
  return f"jsonl:{path}"


def config_for(source: str, fmt: str, seq_len: int, packing: bool, stages: int, small=False):
  """The measured run's config; ``small``: one narrow block and byte ids (the smoke test)."""
  from configs import gpt2_acco

  c = gpt2_acco.get_config("cpu")
  c.data.source, c.data.format, c.data.tokenizer = source, fmt, "byte" if small else "gpt2"
  if small:
    c.model.D, c.model.N, c.model.H = 32, 1, 2
  c.data.seq_len, c.data.packing, c.data.bucket = seq_len, packing, 64
  c.data.cache_dir = str(common.RESULTS / "runs" / "sft_rows" / "cache")
  c.batch.microbatch_size, c.batch.microbatches = 2, 4
  c.model.dtype = "float32"
  c.train.num_updates, c.train.eval_every, c.train.exact_match = 1000, 0, "off"
  c.train.sample_tokens, c.train.log_every, c.ckpt.every = 0, 10, 0
  return c


def measure(
  name: str, source: str, fmt: str, seq_len: int, packing: bool, stages: int, small=False
) -> dict:
  import jax

  from acco_jax import parallel
  from acco_jax.run import build, start, streams

  config = config_for(source, fmt, seq_len, packing, stages, small)
  run = build.build(config)
  rows = run.mesh.size * run.step.num_microbatches * config.batch.microbatch_size
  stream = streams.batch_stream(run, config, run.tokens.train, rows, seed=0)
  batches = [next(stream) for _ in range(stages)]
  computed = sum(b["weights"].size for b in batches)
  weighted = sum(float(b["weights"].sum()) for b in batches)
  # a packed row's segments are 1..k: its examples are its largest segment id
  examples = sum(
    int(b["segments"].max(axis=1).sum()) if "segments" in b else len(b["inputs"]) for b in batches
  )
  params = start.initializer(run.mesh)(run.model_cfg, 0)
  state = run.step.init(params, streams.prime_batch(run, config))
  placed = [parallel.global_batch(b, run.mesh, run.batch_axis) for b in batches]
  for b in placed[:4]:  # every bucket's program compiled before the clock starts
    state, m = run.step.step(state, b)
  widths = {b["inputs"].shape[1] for b in batches}
  for w in widths:
    b = next(p for p, raw in zip(placed, batches, strict=True) if raw["inputs"].shape[1] == w)
    state, m = run.step.step(state, b)
  jax.block_until_ready(m["loss"])
  t0 = time.perf_counter()
  for b in placed:
    state, m = run.step.step(state, b)
  jax.block_until_ready(m["loss"])
  elapsed = time.perf_counter() - t0
  return {
    "data": name,
    "packing": packing,
    "seq_len": seq_len,
    "stages": stages,
    "loss_share": weighted / computed,
    "examples_per_stage": examples / stages,
    "widths": sorted(widths),
    "tokens_per_s": computed / elapsed,
    "loss_tokens_per_s": weighted / elapsed,
    "s": elapsed,
  }


def table(rows: list[dict]) -> str:
  lines = [
    "| data | rows | seq_len | widths | loss share | examples per stage | tokens/s | loss tokens/s |",
    "|---|---|---:|---|---:|---:|---:|---:|",
  ]
  for r in rows:
    mode = "packed" if r["packing"] else "buckets of 64"
    lines.append(
      f"| {r['data']} | {mode} | {r['seq_len']} | {','.join(map(str, r['widths']))} | "
      f"{r['loss_share']:.1%} | {r['examples_per_stage']:.1f} | {r['tokens_per_s']:,.0f} | "
      f"{r['loss_tokens_per_s']:,.0f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--stages", type=int, default=8)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--out", type=Path, default=common.RESULTS / "sft_rows.json")
  args = p.parse_args(argv)
  from acco_jax import parallel

  parallel.configure_platform(cpu_devices=8)
  root = common.RESULTS / "runs" / "sft_rows"
  root.mkdir(parents=True, exist_ok=True)
  stages = 4 if args.smoke else args.stages
  sets = [("embedded", "instruct:embedded", "prompt_completion", 128)]
  if not args.smoke:
    sets.append(
      ("alpaca-like", alpaca_like(root / "alpaca_like.jsonl", 4000), "prompt_completion", 512)
    )
  rows = []
  for name, source, fmt, seq in sets:
    for packing in (True, False):
      rows.append(measure(name, source, fmt, seq, packing, stages))
      common.log(f"{name} packing={packing}: {rows[-1]['tokens_per_s']:,.0f} tok/s")
  text = table(rows)
  print(text)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(
    json.dumps({"rows": rows, "table": text, "machine": common.machine()}, indent=2)
  )
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
