"""What every run of the fault benchmark shares: the faults, the training flags of both arms, the
victim and the moment of the fault, and the ``train.py`` command of one worker or process."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from bench import common

SCENARIOS = ("none", "kill", "kill-restart", "stall", "join", "slow")
NO_SPMD = {"join": "no counterpart: an SPMD job's processes are fixed at its start"}
BASE = {
  "train.log_every": 1,
  "train.eval_every": 0,
  "train.eval_batches": 2,
  "train.sample_tokens": 0,
  "ckpt.async_save": False,
  "mesh.cpu_devices": 1,
  "loco.outer_momentum": 0.9,
}


def run_flags(args) -> dict:
  """The flags of the training run itself, the same in both arms."""
  return {
    **BASE,
    "method": "diloco",
    "train.num_updates": args.updates,
    "loco.sync_every": args.sync_every,
    "ckpt.every": args.ckpt_every,
    "data.cache_dir": args.data_cache,
    "train.seed": 0,
  }


def fault_plan(args) -> dict:
  """The victim (a worker in ``1..M-1``) and worker 0's stage at the fault (30-45% of the run)."""
  rng = random.Random(args.seed)
  victim = rng.randrange(1, args.workers)
  stage = max(2, int(rng.uniform(0.3, 0.45) * args.updates))
  return {"victim": victim, "stage": stage}


def train_command(config: str, workdir: Path, flags: dict) -> list[str]:
  return [
    sys.executable,
    str(common.REPO / "train.py"),
    "--config",
    config,
    "--workdir",
    str(workdir),
    *(f"--config.{k}={v}" for k, v in flags.items()),
  ]
