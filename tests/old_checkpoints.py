"""Checkpoints written by an earlier version of this project, for tests/old_checkpoint_test.py.

``tests/data/checkpoints_9b35d2b`` holds one run of each family stopped part-way (``max_stages``)
by the code at commit 9b35d2b, the main branch before round 6 (the model interface, the step
interface), and in ``reference.json`` the losses the same code logged running the same config
without a stop. To write them again, run this file with that commit first on the path::

  git worktree add /tmp/old 9b35d2b
  PYTHONPATH=/tmp/old python tests/old_checkpoints.py tests/data/checkpoints_9b35d2b
"""

import json
import os
import shutil
import sys
import tempfile

# (config module's name, overrides on top of COMMON, the stage the run stops at)
RUNS = {
  "acco": ("gpt2_acco", {}, 6),
  "diloco_eager": (
    "gpt2_diloco",
    {"loco.outer_overlap": "eager", "loco.sync_every": 2, "loco.workers": 4},
    4,
  ),
  "pipeline_acco": (
    "gpt2_pipeline",
    {
      "model.N": 4,
      "pipeline.stages": 2,
      "pipeline.blocks_per_stage": "1,3",
      "pipeline.data_method": "acco",
    },
    5,
  ),
}
COMMON = {  # narrow blocks on short rows (tests/train_test.py's SMALL), a checkpoint every update
  "model.D": 16,
  "model.N": 1,
  "model.H": 1,
  "data.seq_len": 8,
  "train.eval_batches": 1,
  "train.num_updates": 6,
  "train.log_every": 1,
  "train.eval_every": 0,
  "train.sample_tokens": 0,
  "ckpt.every": 1,
  "ckpt.keep": 1,
  "ckpt.async_save": False,
}


def config_of(name: str, cache_dir: str):
  import importlib

  module, extra, _ = RUNS[name]
  config = importlib.import_module(f"configs.{module}").get_config("tiny")
  for key, value in {**COMMON, **extra, "data.cache_dir": cache_dir}.items():
    group, _, field = key.rpartition(".")
    (config[group] if group else config)[field] = value
  return config


def main(out: str) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  from acco_jax.run import trainer

  cache = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".pytest_cache")
  for name, (_, _, stop) in RUNS.items():
    workdir = os.path.join(out, name)
    shutil.rmtree(workdir, ignore_errors=True)
    config = config_of(name, os.path.join(cache, "acco_data"))
    trainer.train_and_evaluate(config, workdir, max_stages=stop)
    shutil.rmtree(os.path.join(workdir, "tb"), ignore_errors=True)
    with tempfile.TemporaryDirectory() as whole:
      trainer.train_and_evaluate(config, whole)
      with open(os.path.join(whole, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    losses = {r["stage"]: r["loss"] for r in rows if "loss" in r and "stage" in r}
    with open(os.path.join(workdir, "reference.json"), "w") as f:
      json.dump({str(s): v for s, v in sorted(losses.items())}, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
