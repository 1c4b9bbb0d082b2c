"""Checkpoint save and restore time: leaves packed into a few arrays against one array per leaf.

Orbax's cost is per array (a TensorStore array each) and per device block (a write each), a few
milliseconds of host time apiece, so a train state of many small leaves saves slowly whatever its
bytes. :mod:`acco_jax.ckpt.pack` lays the leaves side by side per dtype and row axes before
orbax sees them. Each row here: one method's train state (random values, the method's shardings,
8 simulated CPU devices), saved ``--saves`` times asynchronously the trainer's way (each save waits
for the one before), then restored ``--restores`` times, once with the packing
(``layout=packed``, the default since metadata version 2) and once with every leaf stored alone
(``layout=alone``: every leaf its own array, as metadata version 1 stored it). Reported: the median save (``save()`` to written on
disk), the median time ``save()`` held the caller, the median restore, the arrays orbax wrote,
and whether the restore gave the state back bit for bit. The first save and the first restore of
each layout (compiling the packing, tracing the fingerprints) are left out of the medians and
reported apart.

Usage::

  python -m bench.run.checkpoint_time                     # acco, zero1, diloco_acco, pipeline_acco; tiny
  python -m bench.run.checkpoint_time --methods acco --smoke   # 2 saves, 1 restore per layout
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import common

SETTINGS = {  # method -> (config module, group.field overrides)
  "acco": ("gpt2_acco", {}),
  "zero1": ("gpt2_zero1", {}),
  # ACCO inside eager DiLoCo's 4 workers of 2 devices (the largest state of the family)
  "diloco_acco": (
    "gpt2_diloco",
    {"loco.inner": "acco", "loco.outer_overlap": "eager", "loco.workers": 4},
  ),
  # ACCO over the 4 data lanes of 2 pipeline stages
  "pipeline_acco": (
    "gpt2_pipeline",
    {"pipeline.stages": 2, "pipeline.blocks_per_stage": "1,3", "pipeline.data_method": "acco"},
  ),
}
COLUMNS = [
  ("method", "method"),
  ("layout", "layout"),
  ("leaves", "leaves"),
  ("arrays", "orbax arrays"),
  ("save_ms", "save (ms, median)"),
  ("held_ms", "save() held (ms)"),
  ("restore_ms", "restore (ms, median)"),
  ("first_save_ms", "first save (ms)"),
  ("first_restore_ms", "first restore (ms)"),
  ("exact", "bit-exact"),
]


def measure(method: str, preset: str, saves: int, restores: int) -> list[dict]:
  """The rows of ``method``: both layouts, in this process (8 devices)."""
  import importlib

  import jax
  import numpy as np

  from acco_jax.ckpt import checkpoint
  from acco_jax.ckpt import pack as ckpt_pack
  from acco_jax.run import build

  module, overrides = SETTINGS[method]
  config = importlib.import_module(f"configs.{module}").get_config(preset)
  for key, value in overrides.items():
    group, field = key.split(".")
    config[group][field] = value
  run = build.build(config)
  abstract = run.step.abstract_state(run.params_shapes)
  rng = np.random.default_rng(0)
  state = jax.tree.map(
    lambda x: jax.device_put(np.asarray(rng.normal(size=x.shape)).astype(x.dtype), x.sharding),
    abstract,
  )
  bits = lambda t: [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(t)]
  rows, plan = [], ckpt_pack.plan
  for layout in ("packed", "alone"):
    ckpt_pack.plan = plan if layout == "packed" else lambda ls: ([], list(range(len(ls))))
    save_s, held_s, restore_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp, checkpoint.Checkpointer(tmp, keep=2) as ckpt:
      for step in range(1, saves + 2):
        start = time.perf_counter()
        ckpt.save(step, state, extra={"step": step})
        held_s.append(time.perf_counter() - start)
        ckpt.wait()
        save_s.append(time.perf_counter() - start)
      groups, alone = plan(jax.tree.leaves(state))
      arrays = len(alone) + len(groups) if layout == "packed" else len(jax.tree.leaves(state))
      for _ in range(restores + 1):
        start = time.perf_counter()
        restored, _ = ckpt.restore(None, abstract)
        jax.block_until_ready(restored)
        restore_s.append(time.perf_counter() - start)
      exact = all(np.array_equal(a, b) for a, b in zip(bits(restored), bits(state), strict=True))
    ms = lambda s: round(1000 * s, 1)
    rows.append(
      {
        "method": method,
        "layout": layout,
        "leaves": len(jax.tree.leaves(state)),
        "arrays": arrays,
        "save_ms": ms(statistics.median(save_s[1:])),
        "held_ms": ms(statistics.median(held_s[1:])),
        "restore_ms": ms(statistics.median(restore_s[1:])),
        "first_save_ms": ms(save_s[0]),
        "first_restore_ms": ms(restore_s[0]),
        "exact": exact,
        "save_s": [round(s, 4) for s in save_s],
        "restore_s": [round(s, 4) for s in restore_s],
      }
    )
  ckpt_pack.plan = plan
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--methods", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
  parser.add_argument("--preset", default="tiny", help="the configs' size preset")
  parser.add_argument("--saves", type=int, default=8, help="timed saves per layout")
  parser.add_argument("--restores", type=int, default=3, help="timed restores per layout")
  parser.add_argument("--smoke", action="store_true", help="2 saves, 1 restore")
  parser.add_argument("--out", type=Path, default=common.RESULTS / "checkpoint_time.json")
  parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.smoke:
    args.saves, args.restores = 2, 1
  if args.worker:
    rows = [r for m in args.methods for r in measure(m, args.preset, args.saves, args.restores)]
    common.write_json(args.worker, {"rows": rows, "machine": common.machine()})
    return 0
  started, load_start = time.perf_counter(), common.loadavg()
  worker_args = [
    "--methods",
    *args.methods,
    "--preset",
    args.preset,
    "--saves",
    str(args.saves),
    "--restores",
    str(args.restores),
  ]
  result = common.run_worker(__spec__.name, 8, worker_args, timeout=3600)
  table = common.format_table(result["rows"], COLUMNS)
  print(table)
  print(f"1-min load average: {load_start} at start, {common.loadavg()} at end")
  common.write_json(
    args.out,
    {
      "benchmark": "checkpoint_time",
      "preset": args.preset,
      "saves": args.saves,
      "restores": args.restores,
      "machine": result["machine"],
      "rows": result["rows"],
      "table": table,
      "wall_s": round(time.perf_counter() - started, 1),
    },
  )
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
