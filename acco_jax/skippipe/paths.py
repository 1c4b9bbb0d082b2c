"""Paths through pipeline stages and the layer orders they run.

With S stages, stage s holds blocks ``s*N/S .. (s+1)*N/S - 1``. A microbatch runs stage 0, then the
stages of its path in the path's order, then returns to stage 0 for the head and the loss. A path is
a tuple of distinct stage indices in ``1..S-1``:

  (1, 2, 3)   S = 4, the full pipeline
  (2, 3)      stage 1 skipped (skip ratio 1/3: one of the S - 1 optional stages left out)
  (3, 1, 2)   all stages, in a swapped order

The skip ratio r is the share of the S stages that a microbatch does not visit; stage 0 is always
visited, so a path of ratio r lists ``S - 1 - round(r * S)`` stages (r = 0.5 runs half the model).
"""

from __future__ import annotations

import numpy as np

from acco_jax import errors

Path = tuple[int, ...]


def check_stages(num_blocks: int, num_stages: int) -> int:
  """Blocks per stage; a one-line error unless ``num_stages`` divides ``num_blocks``."""
  if num_stages < 1 or num_stages > num_blocks or num_blocks % num_stages:
    raise errors.UserValueError(
      f"pipeline.stages={num_stages} does not split the model's {num_blocks} blocks into equal "
      f"stages: choose a divisor of {num_blocks} (model.N) between 1 and {num_blocks}"
    )
  return num_blocks // num_stages


def path_length(num_stages: int, skip: float) -> int:
  """Stages a path of skip ratio ``skip`` visits after stage 0 (rounding half up)."""
  k = num_stages - 1 - int(np.floor(skip * num_stages + 0.5))
  if not 0.0 <= skip < 1.0 or k < 0:
    raise errors.UserValueError(
      f"pipeline.skip={skip} leaves no stage to run with pipeline.stages={num_stages}: the skip "
      f"ratio is the share of stages left out, at most {(num_stages - 1) / num_stages:.2f} here"
    )
  return k


def full_path(num_stages: int) -> Path:
  return tuple(range(1, num_stages))


def validate_path(path: Path, num_stages: int) -> Path:
  path = tuple(int(s) for s in path)
  if len(set(path)) != len(path) or any(not 1 <= s < num_stages for s in path):
    raise ValueError(f"path {path} must list distinct stages in 1..{num_stages - 1}")
  return path


def layer_order(path: Path, num_blocks: int, num_stages: int) -> np.ndarray:
  """The block indices a microbatch on ``path`` runs: stage 0's blocks, then each visited stage's."""
  per_stage = check_stages(num_blocks, num_stages)
  stages = (0, *validate_path(path, num_stages))
  return np.concatenate([np.arange(s * per_stage, (s + 1) * per_stage) for s in stages]).astype(
    np.int32
  )


def random_paths(
  num_paths: int, num_stages: int, skip: float, swap: bool, rng: np.random.Generator
) -> list[Path]:
  """Uniformly random paths of one skip ratio; in pipeline order unless ``swap``."""
  k = path_length(num_stages, skip)
  paths = []
  for _ in range(num_paths):
    chosen = rng.choice(np.arange(1, num_stages), size=k, replace=False)
    paths.append(tuple(int(s) for s in (chosen if swap else np.sort(chosen))))
  return paths
