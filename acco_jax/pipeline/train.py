"""Training on a pipeline mesh: the step the trainer drives, and its construction from a config.

:class:`PipelineTrainStep` has the interface of :class:`acco_jax.dp.step.TrainStep` that
:mod:`acco_jax.run.trainer` uses (``init``, ``step``, ``params``, ``abstract_state``, ...), so a
pipeline run goes through ``train.py`` unchanged: checkpoints, metrics, evaluation and resume.

State: the parameters split by :func:`acco_jax.pipeline.step.split_params` (blocks stacked and
sharded over ``stage``, embedding and head replicated), the optimizer state sharded like them, and
the stage counter. A step is one schedule: M microbatches per data lane through the pipeline
(:func:`acco_jax.pipeline.step.make_loss_and_grad`), then the optimizer update, each stage on its own
shard. Within a stage, data lanes average their gradients (DDP); ZeRO-1 over the lanes is not
implemented here.

Schedules (``pipeline.schedule``): ``gpipe`` and ``1f1b`` run the full path for every microbatch;
``skippipe`` with

  ``pipeline.paths=scheduled`` (the default) runs the path scheduler's plan for the run's devices
    (:mod:`acco_jax.pipeline.plans`): device (lane l, stage s) is node ``partition[s][l]`` of the
    topology, each microbatch goes through the nodes its route gives, across lanes, and each device
    runs its steps in the plan's order (:func:`acco_jax.pipeline.ticks.from_plan`). The plan is
    stored in every checkpoint and a resumed run keeps it;
  ``pipeline.paths=random`` draws one path per microbatch (``pipeline.skip``, ``pipeline.swap``,
    seeded by ``pipeline.seed``) and runs them in every lane under the 1F1B policy.

Either way the paths are made once per run, so one compiled program serves the whole run.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import errors, model
from acco_jax.pipeline import orders, plans, ticks
from acco_jax.pipeline import paths as paths_lib
from acco_jax.pipeline import step as pipe
from acco_jax.run import build as build_lib
from acco_jax.run import parallel

SCHEDULES = ("gpipe", "1f1b", "skippipe")


class PipeState(NamedTuple):
  params: Any  # {'blocks': [N, ...] sharded over stage, 'shared': replicated}
  opt_state: Any
  stage: jax.Array


class _Layout(NamedTuple):
  num_params: int
  padded_size: int


class _Plan(NamedTuple):
  comm_dtype: Any = jnp.float32
  quantize: str = "none"
  name: str = "pipeline"


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


class PipelineTrainStep:
  """A compiled pipeline training step (see the module docstring).

  Attributes:
    schedule: the :class:`acco_jax.pipeline.ticks.Schedule` every step runs.
    planned: the scheduler's plan it was built from (:class:`acco_jax.pipeline.plans.Planned`), or
      None.
    num_microbatches: M, microbatches per data lane per step.
    microbatches_per_stage: M times the data lanes (rows per step / microbatch rows).
  """

  quantized = False
  keeps_residual = False

  def __init__(
    self, cfg: model.GPTConfig, tx, mesh, schedule: ticks.Schedule, params_like, planned=None
  ):
    self.cfg, self.tx, self.mesh, self.schedule = cfg, tx, mesh, schedule
    self.planned = planned
    self.lanes = mesh.shape.get(pipe.DATA, 1)
    per_step = schedule.num_microbatches  # mesh-wide tables: every lane's microbatches
    self.num_microbatches = per_step // self.lanes if schedule.mesh_wide else per_step
    self.microbatches_per_stage = self.num_microbatches * self.lanes
    self.num_devices = mesh.size
    self.plan = _Plan()
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params_like))
    self.layout = _Layout(n, n)
    self._loss_and_grad = pipe.make_loss_and_grad(cfg, mesh, schedule)
    self._compiled = {}

  # -- state --------------------------------------------------------------------------------------

  def _build(self, params) -> PipeState:
    split = pipe.split_params(params)
    return PipeState(split, self.tx.init(split), jnp.zeros((), jnp.int32))

  def _state_sharding(self, shapes: PipeState) -> PipeState:
    specs = pipe.param_specs(shapes.params)
    named = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
    rep = NamedSharding(self.mesh, P())
    opt = optax.tree_map_params(
      self.tx, lambda _, s: s, shapes.opt_state, named, transform_non_params=lambda _: rep
    )
    return PipeState(named, opt, rep)

  def abstract_state(self, params) -> PipeState:
    shapes = jax.eval_shape(self._build, params)
    shardings = self._state_sharding(shapes)
    return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )

  def init(self, params, microbatch=None) -> PipeState:
    """The sharded state from float32 parameters (``microbatch`` is not used)."""
    sharding = jax.tree.map(lambda s: s.sharding, self.abstract_state(params))
    return jax.jit(self._build, out_shardings=sharding)(params)

  def describe(self) -> str:
    """One line on the schedule: ticks, idle share, and for a scheduled plan its simulated time."""
    sch = self.schedule
    S = sch.num_stages
    line = (
      f"pipeline: {S} stages x {self.lanes} lanes, {sch.policy} tables, {sch.num_ticks} ticks, "
      f"{sch.idle_fraction():.0%} idle, {sch.slots} activation slots"
    )
    if self.planned is not None:
      crossing = sum(len({c // S for c in cols}) > 1 for cols in sch.columns)
      line += (
        f"; plan on {self.planned.topology.name} ({self.planned.topology.num_nodes} nodes): "
        f"{self.planned.plan.makespan:.4g} s simulated, {crossing}/{sch.num_microbatches} "
        "microbatches change lanes"
      )
    return line

  def checkpoint_extra(self) -> dict:
    """What a checkpoint records beyond the state: the scheduler's plan, if any."""
    return {"plan": plans.record(self.planned)} if self.planned is not None else {}

  def check_checkpoint(self, extra: dict) -> None:
    """Before a restore reads arrays: a checkpoint with a plan needs this run's plan settings, and
    its plan is the one the run goes on with (see :func:`acco_jax.pipeline.plans.check_resume`)."""
    saved = extra.get("plan")
    if self.planned is None:
      if saved is not None:
        raise errors.UserValueError(
          "the checkpoint was written with a scheduled plan (pipeline.schedule=skippipe, "
          "pipeline.paths=scheduled): resume with those settings, or start in a new workdir"
        )
      return
    planned = plans.check_resume(saved, self.planned)
    if planned.partition != self.planned.partition:  # the mesh is laid out by the partition
      raise errors.UserValueError(
        f"the checkpoint's stage assignment {[list(p) for p in planned.partition]} is not the one "
        f"this version makes for the same settings ({[list(p) for p in self.planned.partition]}): "
        "resume with the version that wrote it, or start in a new workdir"
      )
    if planned.plan != self.planned.plan:
      self.planned = planned
      self.schedule = ticks.from_plan(planned.plan, planned.partition)
      self._loss_and_grad = pipe.make_loss_and_grad(self.cfg, self.mesh, self.schedule)
      self._compiled.clear()

  def reshard(self, saved):
    raise errors.UserValueError(
      "the checkpoint was written on another mesh: a pipeline run resumes on the same "
      "pipeline.stages and devices only (start in a new workdir)"
    )

  # -- step ---------------------------------------------------------------------------------------

  def _step(self, state: PipeState, batch):
    M = self.schedule.num_microbatches
    mbs = jax.tree.map(lambda x: x.reshape(M, x.shape[0] // M, *x.shape[1:]), batch)
    mbs = jax.lax.with_sharding_constraint(
      mbs,
      jax.tree.map(
        lambda _: NamedSharding(self.mesh, pipe.batch_spec(self.mesh, self.schedule)), mbs
      ),
    )
    loss, grads = self._loss_and_grad(state.params, mbs)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
      "loss": loss, "grad_norm": optax.tree.norm(grads),
      "microbatches": jnp.asarray(self.microbatches_per_stage, jnp.float32),
      "committed": jnp.asarray(True), "skipped": jnp.zeros((), jnp.float32),
      "stage": state.stage + 1,
    }  # fmt: skip
    return PipeState(params, opt_state, state.stage + 1), metrics

  def step(self, state: PipeState, batch, counts=None):
    """One schedule and one optimizer update. ``batch`` leaves: [M * lanes * B, ...] rows."""
    if counts is not None:
      raise ValueError("pipeline steps run every microbatch (no per-device counts)")
    if "step" not in self._compiled:
      sharding = jax.tree.map(lambda s: s.sharding, state)
      rep = NamedSharding(self.mesh, P())
      self._compiled["step"] = jax.jit(
        self._step, donate_argnums=(0,), out_shardings=(sharding, rep)
      )
    return self._compiled["step"](state, batch)

  def params(self, state: PipeState):
    """The model's parameters (original structure), replicated."""
    rep = NamedSharding(self.mesh, P())
    return jax.jit(pipe.merge_params, out_shardings=rep)(state.params)

  def replicated(self, x):
    rep = NamedSharding(self.mesh, P())
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=rep)(x)

  def probe(self, state, batch, repeats: int = 2):
    raise errors.UserValueError("health.probe_every is not supported with method=pipeline: set 0")


def decay_mask(params_like) -> dict:
  """``model.decay_mask`` in the layout of :func:`acco_jax.pipeline.step.split_params`."""
  mask = model.decay_mask(params_like)
  return {"blocks": mask["blocks"]["0"], "shared": {k: v for k, v in mask.items() if k != "blocks"}}


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


def scheduled_plan(config, model_cfg: model.GPTConfig, num_devices: int):
  """The plan ``method=pipeline`` trains on ``num_devices`` devices
  (:class:`acco_jax.pipeline.plans.Planned`), or None unless ``pipeline.schedule=skippipe`` with
  ``pipeline.paths=scheduled``. ``bench/skippipe.py --part plan`` prints the same."""
  p = config.pipeline
  if p.schedule != "skippipe" or p.paths != "scheduled":
    return None
  lanes = num_devices // int(p.stages)
  mbs, rows = int(config.batch.microbatches) * lanes, int(config.batch.microbatch_size)
  return plans.make(p, model_cfg, num_devices, mbs, rows, equal=True)


def build_run(config) -> build_lib.Run:
  """A :class:`acco_jax.run.build.Run` for ``method=pipeline`` (through
  :mod:`acco_jax.pipeline.family`)."""
  devices = parallel.make_mesh(config.mesh.num_devices).devices.flatten()
  stages, lanes = _check(config, len(devices))
  tokens = build_lib.prepare_tokens(config)
  model_cfg = build_lib.model_config(config, tokens.tokenizer.vocab_size)
  paths_lib.check_stages(model_cfg.N, stages)
  M = int(config.batch.microbatches)
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
  shapes = jax.eval_shape(lambda: model.init_params(model_cfg, 0))
  tx = build_lib.inner_optimizer(config, shapes, decay_mask)
  train = PipelineTrainStep(model_cfg, tx, mesh, schedule, shapes, planned)
  axis = pipe.DATA if lanes > 1 and not schedule.mesh_wide else None
  return build_lib.Run(
    mesh,
    tokens,
    model_cfg,
    shapes,
    train,
    1,
    config.train.num_updates,
    M,
    None,
    batch_axis=axis,
    batch_whole=True,
  )
