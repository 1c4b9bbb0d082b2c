"""``method=pipeline`` from a config: checks, blocks per stage, the schedule or the scheduler's plan,
the mesh, the step (:class:`acco_jax.pipeline.step.PipelineStep`) and the run's stage counts;
and the step ``ckpt.init_from`` reads a pipeline run's checkpoints with."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from acco_jax import data, errors, model, optim, parallel
from acco_jax.dp import layouts, methods
from acco_jax.family_api import Run
from acco_jax.pipeline import packing as packing_lib
from acco_jax.pipeline import programs as pipe
from acco_jax.pipeline import relayout, ticks
from acco_jax.pipeline.step import PipelineStep, build_state
from acco_jax.skippipe import orders, plans
from acco_jax.skippipe import paths as paths_lib

SCHEDULES = ("gpipe", "1f1b", "skippipe")


def schedule_paths(kind: str, num_stages: int, num_mb: int, skip: float, swap: bool, seed: int):
  """The microbatches' paths and the tick policy for a ``pipeline.schedule``."""
  if kind not in SCHEDULES:
    raise errors.UserValueError(
      f"pipeline.schedule={kind!r} is unknown: choose one of {', '.join(SCHEDULES)}"
    )
  if kind != "skippipe":
    return [paths_lib.full_path(num_stages)] * num_mb, kind
  rng = np.random.default_rng(seed)
  return paths_lib.random_paths(num_mb, num_stages, skip, swap, rng), "1f1b"


def _check(config, num_devices: int) -> tuple[int, int]:
  """(stages, data lanes), or a one-line error for a pipeline config that cannot run."""
  p = config.get("pipeline")
  if p is None:
    raise errors.UserValueError(
      "method=pipeline needs a 'pipeline' config group: use configs/gpt2_pipeline.py"
    )
  stages = int(p.stages)
  if stages < 2 or num_devices % stages:
    raise errors.UserValueError(
      f"pipeline.stages={stages} must be >= 2 and divide the {num_devices} devices (each data "
      "lane holds one stage per device)"
    )
  layouts.asked(config)  # a known value, though the pipeline packs its own buffers
  for key, bad in (
    ("comm.quantize", config.comm.quantize != "none"),
    ("hetero.budgets", bool(config.hetero.budgets)),
    ("hetero.adaptive", bool(config.hetero.adaptive)),
    ("hetero.slowdown", bool(config.hetero.slowdown)),
    ("health.probe_every", bool(config.health.probe_every)),
  ):
    if bad:
      raise errors.UserValueError(
        f"{key} is not supported with method=pipeline: leave it at its default"
      )
  return stages, num_devices // stages


def flush_plan(config) -> tuple[int, int, int]:
  """(microbatches per flush and lane, flushes per update, total flushes) for ``method=pipeline``:
  one flush of ``batch.microbatches`` per update, or with ``pipeline.data_method=acco`` two flushes
  of half as many (estimate, commit: the tokens of an update as with ``ddp``) after one that only
  fills ACCO's buffer."""
  M = int(config.batch.microbatches)
  if config.pipeline.get("data_method", "ddp") != "acco":
    return M, 1, int(config.train.num_updates)
  if M < 2 or M % 2:
    raise errors.UserValueError(
      f"batch.microbatches={M}: pipeline.data_method=acco splits an update into two flushes of "
      "equal size, so it must be an even number >= 2"
    )
  return M // 2, 2, 2 * int(config.train.num_updates) + 1


def updates_done(config, stage: int) -> int:
  """Optimizer updates after ``stage`` flushes (see :func:`flush_plan`)."""
  if config.pipeline.get("data_method", "ddp") != "acco":
    return stage
  return max(stage - 1, 0) // 2


def scheduled_plan(config, model_cfg: model.ModelConfig, num_devices: int):
  """The plan ``method=pipeline`` trains on ``num_devices`` devices
  (:class:`acco_jax.skippipe.plans.Planned`), or None unless ``pipeline.schedule=skippipe`` with
  ``pipeline.paths=scheduled``. ``python -m bench.pipeline.skippipe --part plan`` prints the same."""
  p = config.pipeline
  if p.schedule != "skippipe" or p.paths != "scheduled":
    return None
  lanes = num_devices // int(p.stages)
  mbs, rows = flush_plan(config)[0] * lanes, int(config.batch.microbatch_size)
  return plans.make(p, model_cfg, num_devices, mbs, rows, equal=True)


def whole_matrices(config, shapes):
  """The block's matrices an optimizer updates whole (``opt.name=muon``: Muon's), or None."""
  return model.muon_mask(shapes)[model.BLOCKS]["0"] if config.opt.name == "muon" else None


def _split_and_tx(config, model_cfg, stages: int, lanes: int):
  """The run's blocks per stage, the parameters' shapes and the inner optimizer on the buffers
  (Muon: on the view of whole matrices, :func:`acco_jax.pipeline.packing.on_view`)."""
  p = config.pipeline
  # SkipPipe's paths skip whole stages: equal stages where they divide the blocks (the paper's)
  counts = packing_lib.stage_counts(
    model_cfg, stages, p.get("blocks_per_stage", "auto"), equal=p.schedule == "skippipe"
  )
  shapes = model.param_shapes(model_cfg)
  matrices = whole_matrices(config, shapes)
  buffers = pipe.packing_for(shapes, stages, counts, lanes, matrices)
  tx = optim.from_config(config, shapes, view=buffers.view_mask)
  return counts, shapes, tx if matrices is None else packing_lib.on_view(tx, buffers)


def source_step(config, model_cfg: model.ModelConfig, num_devices: int) -> relayout.SourceStep:
  """The step of a pipeline run of ``config`` as ``ckpt.init_from`` reads its checkpoints: the
  state's structure and its export (no mesh: it is never run)."""
  stages = int(config.pipeline.stages)
  counts, shapes, tx = _split_and_tx(config, model_cfg, stages, 1)
  data_method = config.pipeline.get("data_method", "ddp")
  if data_method == "acco":
    tx = methods.acco(tx)
  packing = pipe.packing_for(shapes, stages, counts, matrices=whole_matrices(config, shapes))
  comm = jnp.dtype(config.comm_dtype)
  build = lambda params: build_state(packing, tx, data_method, 1, comm, params)
  return relayout.SourceStep(packing, tx, data_method, build)


def build_run(config, tokens: data.TokenData, model_cfg: model.ModelConfig) -> Run:
  """A :class:`acco_jax.family_api.Run` for ``method=pipeline`` (through
  :mod:`acco_jax.pipeline.family`)."""
  devices = parallel.make_mesh(config.mesh.num_devices).devices.flatten()
  stages, lanes = _check(config, len(devices))
  M, per_update, total = flush_plan(config)
  p = config.pipeline
  if p.paths not in orders.MODES:
    raise errors.UserValueError(
      f"pipeline.paths={p.paths!r} is unknown: choose one of {', '.join(orders.MODES)}"
    )
  planned = scheduled_plan(config, model_cfg, stages * lanes)
  if (
    planned is not None
  ):  # node i is the run's device i: device (lane l, stage s) is partition[s][l]
    part = planned.partition
    devices = [devices[part[s][lane]] for lane in range(lanes) for s in range(stages)]
    schedule = ticks.from_plan(planned.plan, part)
  else:
    paths, policy = schedule_paths(p.schedule, stages, M, float(p.skip), bool(p.swap), int(p.seed))
    schedule = ticks.build(paths, stages, policy)
  mesh = pipe.make_mesh(stages, lanes, devices)
  counts, shapes, tx = _split_and_tx(config, model_cfg, stages, lanes)
  step = PipelineStep(
    model_cfg,
    tx,
    mesh,
    schedule,
    shapes,
    planned,
    counts,
    p.get("data_method", "ddp"),
    jnp.dtype(config.comm_dtype),
    whole_matrices(config, shapes),
  )
  axis = pipe.DATA if lanes > 1 and not schedule.mesh_wide else None
  return Run(
    mesh=mesh,
    tokens=tokens,
    model_cfg=model_cfg,
    params_shapes=shapes,
    step=step,
    stages_per_update=per_update,
    total_stages=total,
    base_microbatches=M,
    updates_done=functools.partial(updates_done, config),
    batch_axis=axis,
    batch_whole=True,
  )
