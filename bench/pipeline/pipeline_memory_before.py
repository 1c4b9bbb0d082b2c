r"""The AOT memory table of ``python -m bench.pipeline.pipeline --parts aot`` for the layout before the packed one.

Before commit 762a798 (at 33a96f6) a pipeline state held the blocks stacked and sharded over
``stage`` (equal stages only) and the embedding, position embedding and final LayerNorm replicated
on every stage, with DDP over the data lanes. This script compiles the same rows (model x S x lanes,
1F1B on full paths, AdamW, the same abstract H100 topologies and batch) against a checkout of that
commit, for the "before" columns of docs/benchmarks/pipeline.md "Pipeline":

  git worktree add /tmp/old 33a96f6 --detach
  PYTHONPATH=/tmp/old:<dir with jax_plugins> python -m bench.pipeline.pipeline_memory_before --repo /tmp/old

Rows whose blocks do not split into equal stages (GPT-2 124M's 12 blocks on 8 stages) are listed as
not possible. Writes ``bench/results/pipeline_memory_before.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import common
from bench.pipeline import pipeline as bench


def use_old_checkout(repo: str) -> None:
  """Puts ``repo`` first on ``sys.path`` (before this checkout, where ``python -m`` found
  ``bench``) and checks that its
  ``acco_jax`` is the replicated layout's."""
  root = Path(repo).resolve()
  sys.path.insert(0, str(root))
  from acco_jax.pipeline import train as pipe_train

  if Path(pipe_train.__file__).resolve().parents[2] != root or not hasattr(
    pipe_train, "decay_mask"
  ):
    raise SystemExit(
      f"--repo {repo}: acco_jax there is not the replicated layout (33a96f6): got "
      f"{pipe_train.__file__}"
    )


def aot_worker(args) -> dict:
  """One row of the table in the replicated layout (equal stages, DDP lanes)."""
  use_old_checkout(args.repo)
  import jax

  from acco_jax import model, optim, parallel
  from acco_jax.pipeline import step as pipe
  from acco_jax.pipeline import ticks
  from acco_jax.pipeline import train as pipe_train
  from acco_jax.skippipe import paths

  if not parallel.has_cuda_plugin():
    return {"skipped": "no CUDA PJRT plugin (pip install jax-cuda12-pjrt==<jaxlib version>)"}
  r = bench.parse_row(args.row)
  S, lanes, M, B = r["S"], r["lanes"], args.microbatches, args.rows
  cfg = bench.model_config(r["preset"])
  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  n, hosts = bench.topology(S * lanes)
  row = {
    **r,
    "model": bench.MEMORY_MODELS[r["preset"]],
    "layout": "replicated (33a96f6)",
    "split": "equal",
    "topology": f"{hosts}x{n // hosts}",
    "params_M": round(model.num_params(shapes) / 1e6, 1),
  }
  if cfg.N % S:
    return {**row, "not_possible": f"not possible ({cfg.N} blocks on {S} equal stages)"}
  devices, _ = bench.abstract_devices(S * lanes)
  sched = ticks.build([paths.full_path(S)] * M, S, "1f1b")
  mesh = pipe.make_mesh(S, lanes, devices)
  tx = optim.inner_optimizer(bench.adamw(), 100, pipe_train.decay_mask(shapes))
  train = pipe_train.PipelineTrainStep(cfg, tx, mesh, sched, shapes)
  state = train.abstract_state(shapes)
  block, shared = bench.block_and_shared(shapes)
  row.update(
    {
      "blocks": ",".join([str(cfg.N // S)] * S),
      "held_M": round((cfg.N // S * block + shared) / 1e6, 1),
      "idle_M": round(shared / 1e6, 1),
      "ticks": sched.num_ticks,
      "slots": sched.slots,
      "device_kind": devices[0].device_kind,
      **bench.compile_memory(train, state, mesh, cfg, lanes, M, B),
    }
  )
  common.log(f"aot before {args.row}: {row}")
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repo", required=True, help="a checkout of 33a96f6 (also first on PYTHONPATH)")
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--rows", type=int, default=4, help="rows per microbatch")
  ap.add_argument("--models", default=",".join(bench.MEMORY_MODELS))
  ap.add_argument("--out", default=str(common.RESULTS / "pipeline_memory_before.json"))
  ap.add_argument("--resume", action="store_true", help="keep rows already in --out")
  ap.add_argument("--worker", default=None)
  ap.add_argument("--kind", default="")
  ap.add_argument("--row", default="")
  args = ap.parse_args()
  if args.worker:
    Path(args.worker).write_text(json.dumps(aot_worker(args)))
    return
  plan = bench.memory_plan("all", args.models.split(","), methods=("ddp",), controls=False)
  header = {
    "command": "python -m bench.pipeline.pipeline_memory_before " + " ".join(sys.argv[1:]),
    "layout": "replicated embedding and head, equal stages, DDP lanes (33a96f6)",
    "M": args.microbatches,
    "rows_per_microbatch": args.rows,
    "schedule": "1f1b, full paths",
    "optimizer": "adamw (clip 1.0), float32 state",
  }
  flags = [
    "--repo",
    str(Path(args.repo).resolve()),
    "--microbatches",
    str(args.microbatches),
    "--rows",
    str(args.rows),
  ]
  res = bench.run_memory_rows(__spec__.name, plan, Path(args.out), flags, args.resume, header)
  if "skipped" in res:
    print(f"skipped: {res['skipped']}")
    return
  print(
    f"AOT memory per device, replicated layout (33a96f6), 1F1B, M={args.microbatches} x "
    f"{args.rows} rows per lane"
  )
  print(res["table"])
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
