"""Stages and optimizer updates of the data-parallel methods (pure).

A *stage* is one call of the step; ACCO splits an update into two stages (estimate, commit), DPU
adds one fill stage after its warm-up, the other methods make one update per stage.
"""

from acco_jax import errors


def stage_plan(config) -> tuple[int, int, int]:
  """(microbatches per stage, stages per update, total stages) for the method in ``config``."""
  k = int(config.batch.microbatches)
  if config.method == "acco":
    if k < 2 or k % 2:
      raise errors.UserValueError(
        f"batch.microbatches={k}: ACCO splits an update into two stages of equal size, so it "
        "must be an even number >= 2"
      )
    return k // 2, 2, 2 * config.train.num_updates
  warmup = int(config.dpu_warmup_updates) if config.method == "dpu" else 0
  return k, 1, config.train.num_updates + (1 if warmup else 0)  # dpu: one fill stage after warm-up


def updates_done(config, stage: int) -> int:
  """Optimizer updates completed after ``stage`` stages."""
  if config.method == "acco":
    return stage // 2
  warmup = int(config.dpu_warmup_updates) if config.method == "dpu" else 0
  return stage - 1 if warmup and stage > warmup else stage
