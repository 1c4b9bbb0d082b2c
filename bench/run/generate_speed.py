"""Greedy generation speed before and after the key/value cache: tokens/s of
:func:`acco_jax.sampling.greedy` re-running the whole window for every token (``cache=False``, as
before issue 68) and with the cache (the prompt once, then one token a step), side by side.

For each prompt length and reply length: B prompts of random ids, replies of exactly ``new``
tokens (no stop id), the window ``prompt + new`` rounded up to a multiple of 64 (what
``report.answers`` passes: the run's ``data.seq_len``). One untimed run compiles, then
``--repeats`` timed runs; the table gives the median tokens/s (B x new / seconds), the first run's
extra seconds (compiling), and whether both paths gave the same replies.

Usage::

  python -m bench.run.generate_speed                          # GPT-2 124M, float32
  python -m bench.run.generate_speed --hf /work/smollm2       # a Hugging Face directory
  python -m bench.run.generate_speed --smoke --out /tmp/g.json   # the tiny preset (tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench import common

SETTINGS = ((32, 32), (32, 96), (224, 32))  # (prompt, new) tokens
SMOKE_SETTINGS = ((8, 8), (20, 30))


def load(args):
  """(params, cfg) of the preset or the Hugging Face directory, float32."""
  import jax

  from acco_jax import hf, model

  if args.hf:
    cfg = hf.model_config(args.hf, dtype="float32")
    return jax.device_put(hf.load_params(args.hf, cfg)), cfg  # not numpy: copied in every call
  cfg = model.get_config(args.size, arch=args.arch, dtype="float32")
  return jax.jit(model.init_params, static_argnums=0)(cfg, 0), cfg


def timed(fn) -> tuple[float, object]:
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def measure(params, cfg, prompt: int, new: int, batch: int, repeats: int) -> dict:
  """Both paths on one setting: median tokens/s, first-run extra seconds, same replies."""
  import numpy as np

  from acco_jax import sampling

  rng = np.random.default_rng(prompt * 1000 + new)
  prompts = [[int(t) for t in rng.integers(0, cfg.V, prompt)] for _ in range(batch)]
  window = min(cfg.L, -(-(prompt + new) // 64) * 64)
  row = {"prompt": prompt, "new": new, "batch": batch, "window": window}
  replies = {}
  for name, cache in (("full", False), ("cache", True)):
    run = lambda cache=cache: sampling.greedy(
      params, cfg, prompts, new, stop_id=-1, window=window, cache=cache
    )
    first, replies[name] = timed(run)
    seconds = [timed(run)[0] for _ in range(repeats)]
    median = statistics.median(seconds)
    row[f"{name}_tok_s"] = round(batch * new / median, 1)
    row[f"{name}_compile_s"] = round(max(first - median, 0.0), 1)
    row[f"{name}_seconds"] = [round(s, 3) for s in seconds]
    common.log(f"{prompt}+{new} {name}: {row[f'{name}_tok_s']} tokens/s")
  row["speedup"] = round(row["cache_tok_s"] / row["full_tok_s"], 2)
  row["same_replies"] = replies["full"] == replies["cache"]
  return row


COLUMNS = [
  ("prompt", "prompt"),
  ("new", "new"),
  ("batch", "B"),
  ("window", "window"),
  ("full_tok_s", "full window tok/s"),
  ("cache_tok_s", "cache tok/s"),
  ("speedup", "speedup"),
  ("full_compile_s", "full compile s"),
  ("cache_compile_s", "cache compile s"),
  ("same_replies", "same replies"),
]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--arch", default="gpt2")
  p.add_argument("--size", default="gpt2", help="a preset of --arch")
  p.add_argument("--hf", help="a Hugging Face model directory instead of a preset")
  p.add_argument("--batch", type=int, default=1, help="prompts a call (B)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument(
    "--settings",
    default=",".join(f"{a}:{b}" for a, b in SETTINGS),
    help="prompt:new pairs, comma-separated",
  )
  p.add_argument("--smoke", action="store_true", help="the tiny preset, one repeat (tests)")
  p.add_argument("--out", type=Path, default=common.RESULTS / "generate_speed.json")
  args = p.parse_args(argv)
  settings = [tuple(int(v) for v in s.split(":")) for s in args.settings.split(",")]
  if args.smoke:
    args.size, args.hf, args.repeats, settings = "tiny", None, 1, list(SMOKE_SETTINGS)
  params, cfg = load(args)
  rows = [measure(params, cfg, a, b, args.batch, args.repeats) for a, b in settings]
  model_name = args.hf or f"{args.arch}:{args.size}"
  common.write_json(args.out, {"model": model_name, "rows": rows, "machine": common.machine()})
  print(f"{model_name}, float32, greedy replies (median of {args.repeats})")
  print(common.format_table(rows, COLUMNS))
  return 0


if __name__ == "__main__":
  sys.exit(main())
