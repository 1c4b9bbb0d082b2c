"""Wall clock of whole training runs between emulated hosts: DDP, ZeRO-1, ACCO (bf16, int8, int4),
DiLoCo, Streaming DiLoCo.

Two "hosts" (network namespaces joined by a veth pair shaped with ``tc tbf`` at both ends, the
recipe of ``environment.md`` §9, set up by ``bench/net/netns.py``'s helpers), each running one
``train.py`` process with one CPU device; the processes form a ``jax.distributed`` job (gloo). The
model and batch are the d8 convergence setting's (667k parameters, 4 microbatches of 4 x 64 tokens
per device per update). DDP and ACCO run their data axis across the two hosts; DiLoCo and Streaming
DiLoCo run 2 workers of 1 device (one per host), H = 10 (Streaming: 2 fragments, FP4, tau = 1,
alpha = 0.5; ``diloco-eager``: ``loco.outer_overlap=eager``, each sync's all-reduce in flight across
the next phase of 10 steps). Each run does ``--steps`` updates at equal tokens; the time per update is the wall
time from the first logged update after ``--skip`` (compilation) to the last, over the updates
between them (a mean: a median would hide the outer syncs). Methods run side by side at each rate,
in one invocation: the machine is shared and noisy, so compare ratios.

Usage (root)::

  python -m bench.net.netns_train                      # 100 and 1000 Mbit/s, 60 updates each
  python -m bench.net.netns_train --mbit 100 --steps 30 --methods ddp diloco
  python -m bench.net.netns_train --mbit 10 100 --methods ddp zero1 acco acco-int8 acco-int4
  python -m bench.net.netns_train --mbit 100 --methods diloco diloco-eager --steps 60 --skip 20
  python -m bench.net.netns_train --mbit 100 1000 --methods sft-ddp sft-zero1 sft-acco --steps 40

The ``sft-*`` methods fine-tune on instructions (``configs/sft_acco.py``) the model ``--sft-init``
names, ``bench/dp/sft.py``'s export of the quick start's run by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import common
from bench.net import netns

RUNS = common.RESULTS / "runs" / "netns_train"
METHODS = {
  "ddp": ("gpt2_ddp", {}),
  "zero1": ("gpt2_zero1", {}),
  "acco": ("gpt2_acco", {}),
  # quantized communication (comm.quantize): each host is its own node, so its gradients are
  # quantized before they cross the shaped link; blocks of 256, error feedback
  "acco-int8": ("gpt2_acco", {"comm.quantize": "int8", "comm.node_size": 1}),
  "acco-int4": ("gpt2_acco", {"comm.quantize": "int4", "comm.node_size": 1}),
  "diloco": ("gpt2_diloco", {"loco.sync_every": 10, "loco.workers": 2}),
  # eager outer updates: a sync's all-reduce in flight across the whole next phase of H steps
  "diloco-eager": (
    "gpt2_diloco",
    {"loco.sync_every": 10, "loco.workers": 2, "loco.outer_overlap": "eager"},
  ),
  "streaming_diloco": ("gpt2_streaming_diloco", {"loco.sync_every": 10, "loco.workers": 2}),
  # instruction fine-tuning (configs/sft_acco.py, the embedded instruction set, rows padded to
  # buckets of 64) of the model --sft-init names (bench/dp/sft.py's export of the quick start's)
  "sft-ddp": ("sft_acco", {"method": "ddp"}),
  "sft-zero1": ("sft_acco", {"method": "zero1"}),
  "sft-acco": ("sft_acco", {"method": "acco"}),
}


def overrides(method: str, steps: int, sft_init: str = "") -> list[str]:
  if method.startswith("sft-"):  # the pretrained model's own sizes, its tokenizer
    base = {
      "model.init": f"hf:{sft_init}",
      "batch.microbatch_size": 2,
      "batch.microbatches": 4,
      "train.num_updates": steps,
      "train.log_every": 2,
      "train.eval_every": 0,
      "train.eval_batches": 2,
      "train.exact_match": "off",
      "opt.warmup_updates": 5,
      "ckpt.every": 0,
      "ckpt.async_save": False,
      "mesh.cpu_devices": 1,
      **METHODS[method][1],
    }
    return [f"--config.{k}={v}" for k, v in base.items()]
  base = {
    "model.D": 128,
    "model.N": 2,
    "model.H": 4,
    "data.seq_len": 64,
    "batch.microbatch_size": 4,
    "batch.microbatches": 4,
    "train.num_updates": steps,
    "train.log_every": 2,
    "train.eval_every": 0,
    "train.eval_batches": 2,
    "train.sample_tokens": 0,
    "opt.warmup_updates": 5,
    "ckpt.every": 0,
    "ckpt.async_save": False,
    "mesh.cpu_devices": 1,
    **METHODS[method][1],
  }
  return [f"--config.{k}={v}" for k, v in base.items()]


def phase_median(per_update: dict, ups: list, h: int | None) -> float | None:
  """The median of ``wall(u + h) − wall(u)`` over the logged sync points ``u`` (multiples of
  ``h``); None for a method without outer periods."""
  if not h:
    return None
  syncs = [u for u in ups if u % h == 0]
  gaps = [
    per_update[b] - per_update[a] for a, b in zip(syncs, syncs[1:], strict=False) if b - a == h
  ]
  return statistics.median(gaps) if gaps else None


def steady(per_update: dict, ups: list, h: int | None, total: int) -> float | None:
  """Wall time per update between the first logged sync point and ``total − 2h`` (None if the
  method has no outer period or the window is empty)."""
  if not h:
    return None
  syncs = [u for u in ups if u % h == 0 and u <= total - 2 * h]
  if len(syncs) < 2:
    return None
  return (per_update[syncs[-1]] - per_update[syncs[0]]) / (syncs[-1] - syncs[0])


def run(method: str, mbit: float, args) -> dict:
  workdir = RUNS / f"{method}_{int(mbit)}mbit"
  subprocess.run(["rm", "-rf", str(workdir)], check=True)
  workdir.mkdir(parents=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONUNBUFFERED="1")
  address = f"{netns.SUBNET}.1:{netns.PORT}"
  procs = []
  for i in range(2):
    cmd = [
      "ip",
      "netns",
      "exec",
      f"{netns.PREFIX}h{i}",
      sys.executable,
      str(common.REPO / "train.py"),
      f"--config={common.REPO}/configs/{METHODS[method][0]}.py:cpu",
      f"--workdir={workdir}",
      f"--config.dist.coordinator_address={address}",
      "--config.dist.num_processes=2",
      f"--config.dist.process_id={i}",
      *overrides(method, args.steps, args.sft_init),
    ]
    log = open(workdir / f"process{i}.log", "w")
    procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
  t0 = time.time()
  codes = [p.wait(timeout=args.timeout) for p in procs]
  if any(codes):
    raise RuntimeError(
      f"{method} at {mbit} Mbit: {codes}\n{(workdir / 'process0.log').read_text()[-2000:]}"
    )
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  rows = [r for r in rows if "loss" in r and "stage" in r]
  per_update = {r["update"]: r["wall_s"] for r in rows}
  ups = sorted(u for u in per_update if u >= args.skip)
  gaps = [(per_update[b] - per_update[a]) / (b - a) for a, b in zip(ups, ups[1:], strict=False)]
  h = METHODS[method][1].get("loco.sync_every")
  return {
    "method": method,
    "mbit": mbit,
    "process_s": time.time() - t0,
    # the mean over the timed updates (wall time / updates): an outer sync every H steps is a rare
    # long interval that a median would leave out
    "s_per_update": (per_update[ups[-1]] - per_update[ups[0]]) / (ups[-1] - ups[0]),
    "s_per_update_median": statistics.median(gaps),
    "s_per_update_all": gaps,
    # LoCo methods: the median wall time of an outer period (H updates, its sync included) between
    # two sync points; an eager phase program is one call of H updates, logged only at its end
    "s_per_phase_median": phase_median(per_update, ups, h),
    # LoCo methods: wall time per update from the first sync point after --skip to the sync point
    # 2 H before the end. A row is written once the next call is dispatched, so the compilation of
    # the final call's program (eager: its flush) delays the row H before the end; none here
    "s_per_update_steady": steady(per_update, ups, h, args.steps),
    # tokens computed per update (buckets: the rows' padded width), over the timed updates
    "tokens_per_update": (rows[-1]["tokens_seen"] - rows[0]["tokens_seen"])
    / max(rows[-1]["update"] - rows[0]["update"], 1),
    "final_loss": rows[-1]["loss"],
    "wire_bytes_per_worker": rows[-1].get("wire_bytes_per_worker"),
  }


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--mbit", nargs="+", type=float, default=[100, 1000])
  ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--skip", type=int, default=10, help="updates left out of the timing")
  ap.add_argument("--timeout", type=float, default=1800)
  ap.add_argument(
    "--sft-init",
    default=str(common.RESULTS / "runs" / "sft" / "pretrain-hf"),
    help="the sft-* methods' model: a Hugging Face directory (bench/dp/sft.py writes one)",
  )
  ap.add_argument("--out", type=Path, default=common.RESULTS / "netns_train.json")
  args = ap.parse_args()
  reason = netns.netns_ok()
  if reason:
    print(f"skipped: {reason}")
    return 0
  netns.cleanup()
  results = []
  try:
    shaped = netns.setup(2)
    for mbit in args.mbit:
      netns.shape(shaped, mbit)
      for method in args.methods:
        r = run(method, mbit, args)
        results.append(r)
        common.log(f"{mbit:6.0f} Mbit {method:17s} {r['s_per_update']:.3f} s/update")
  finally:
    netns.cleanup()
  table = {}
  for mbit in args.mbit:
    ddp = next(r for r in results if r["mbit"] == mbit and r["method"] == args.methods[0])
    for r in results:
      if r["mbit"] == mbit:
        r["ratio_to_ddp"] = r["s_per_update"] / ddp["s_per_update"]
        table.setdefault(f"{int(mbit)} Mbit/s", {})[r["method"]] = round(r["ratio_to_ddp"], 3)
  table["relative_to"] = args.methods[0]
  common.write_json(
    args.out,
    {
      "machine": common.machine(),
      "runs": results,
      "ratio_to_ddp": table,
      "args": {k: str(v) for k, v in vars(args).items()},
    },
  )
  common.log(json.dumps(table, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
