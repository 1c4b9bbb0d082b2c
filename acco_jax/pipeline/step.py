"""Training on a pipeline mesh: the step the trainer drives (:mod:`acco_jax.pipeline.build` makes
it from a config).

:class:`PipelineStep` implements :class:`acco_jax.step_api.Step` and
:class:`~acco_jax.step_api.Portable`, so a pipeline run goes through ``train.py`` unchanged:
checkpoints, metrics, evaluation and resume.

State (:class:`PipeState`): each stage's parameters packed once into flat buffers
(:mod:`acco_jax.pipeline.packing`: the embedding and head on stage 0 only, stages of any size), the
optimizer state in the same layout, and the step counter. A step is one flush: M microbatches per
data lane through the pipeline (:func:`acco_jax.pipeline.programs.make_loss_and_grad`), and the
optimizer update. Within each stage the data lanes run ``pipeline.data_method``:

  ``ddp``: gradients averaged over the lanes, the optimizer state whole on every lane;
  ``zero1``: the stage's weights and optimizer state sharded over its lanes; gradients
    reduce-scattered, the update on each lane's shard, the weights all-gathered for the flush;
  ``acco``: ACCO (:func:`acco_jax.dp.methods.acco`, the same transform as the data-parallel
    method) with one flush as its stage. The flush computes at the weights of the state while the
    previous flushes' gradients are reduce-scattered, applied (estimate or commit) and the new
    weights all-gathered, in one program with no data dependence between the two; estimates and
    commits alternate, and the buffer keeps what it shipped, by ACCO's rule
    (:func:`acco_jax.dp.methods.alternation`, as the data-parallel stage). The first flush only fills the buffer
    (the gradient at ``θ0``, which the data-parallel method takes from a prime microbatch); then
    estimates and commits alternate, two flushes of ``batch.microbatches / 2`` per update
    (:func:`acco_jax.pipeline.build.flush_plan`).

Schedules (``pipeline.schedule``): ``gpipe`` and ``1f1b`` run the full path for every microbatch;
``skippipe`` with

  ``pipeline.paths=scheduled`` (the default) runs the path scheduler's plan for the run's devices
    (:mod:`acco_jax.skippipe.plans`): device (lane l, stage s) is node ``partition[s][l]`` of the
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
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import errors, model
from acco_jax.dp import methods
from acco_jax.pipeline import programs as pipe
from acco_jax.pipeline import relayout, ticks
from acco_jax.skippipe import plans
from acco_jax.step_api import StepBase, ring_bytes

DATA_METHODS = ("ddp", "zero1", "acco")


class PipeState(NamedTuple):
  """A pipeline run's state; every parameter-shaped tree is ``{g: [S, P_g]}`` (:mod:`.packing`).

  Attributes:
    params: the optimizer's parameters, over ``stage`` (``ddp``) or ``stage`` and ``data``
      (``zero1``, ``acco``: ZeRO-1 over the lanes; ACCO: θ̃ after an estimate, θ after a commit).
    opt_state: the optimizer's state, sharded like ``params`` (ACCO: :class:`AccoState`, with θ).
    stage: steps done.
    w: ``acco``: the weights the next flush computes at, in ``comm_dtype``, over ``stage``.
    buf: ``acco``: each lane's share of the last flushes' mean gradient, ``{g: [lanes, S, P_g]}``.
    buf_count: ``acco``: flushes in ``buf`` (0 before the first).
  """

  params: Any
  opt_state: Any
  stage: jax.Array
  w: Any = None
  buf: Any = None
  buf_count: Any = None


def build_state(packing, tx, data_method: str, lanes: int, comm_dtype, params) -> PipeState:
  """A fresh :class:`PipeState` from the model's parameters (traceable)."""
  packed = packing.pack(params)
  state = PipeState(packed, tx.init(packed), jnp.zeros((), jnp.int32))
  if data_method != "acco":
    return state
  buf = {g: jnp.zeros((lanes, *v.shape), comm_dtype) for g, v in packed.items()}
  w = jax.tree.map(lambda x: x.astype(comm_dtype), packed)
  return state._replace(w=w, buf=buf, buf_count=jnp.zeros((), jnp.int32))


class PipelineStep(StepBase):
  """A compiled pipeline training step (see the module docstring).

  Args:
    cfg: the model's config; tx: the inner optimizer (on the buffers of ``packing``; elementwise).
    mesh, schedule: from :func:`acco_jax.pipeline.programs.make_mesh` and :mod:`.ticks`.
    params_like: the model's parameter shapes.
    planned: the scheduler's plan the schedule was built from, or None.
    counts: blocks per stage (default: equal stages).
    data_method: ``ddp``, ``zero1`` or ``acco`` over the data lanes of each stage.
    comm_dtype: dtype of the lanes' reduce-scatter and all-gather (``zero1``, ``acco``).
    matrices: a block's mask of the matrices ``tx`` updates whole (Muon), packed apart and owned
      whole by the lanes (:mod:`acco_jax.pipeline.packing`); ``tx`` then runs on the packing's view
      (:func:`acco_jax.pipeline.packing.on_view`). None: every buffer elementwise.

  Attributes:
    schedule: the :class:`acco_jax.pipeline.ticks.Schedule` every step runs.
    planned: the scheduler's plan it was built from (:class:`acco_jax.skippipe.plans.Planned`), or
      None.
    packing: the :class:`acco_jax.pipeline.packing.StagePacking` of the state.
    num_microbatches: M, microbatches per data lane per step.
    microbatches_per_stage: M times the data lanes (rows per step / microbatch rows).
  """

  def __init__(
    self,
    cfg: model.ModelConfig,
    tx,
    mesh,
    schedule: ticks.Schedule,
    params_like,
    planned=None,
    counts=None,
    data_method: str = "ddp",
    comm_dtype=jnp.float32,
    matrices=None,
  ):
    if data_method not in DATA_METHODS:
      raise errors.UserValueError(
        f"pipeline.data_method={data_method!r} is unknown: choose one of {', '.join(DATA_METHODS)}"
      )
    super().__init__(mesh)
    self.cfg, self.schedule, self.planned = cfg, schedule, planned
    self.data_method, self.comm_dtype = data_method, jnp.dtype(comm_dtype)
    self.tx = methods.acco(tx, comm_dtype=comm_dtype) if data_method == "acco" else tx
    self.lanes = mesh.shape.get(pipe.DATA, 1)
    self.sharded = data_method != "ddp"
    per_step = schedule.num_microbatches  # mesh-wide tables: every lane's microbatches
    self.num_microbatches = per_step // self.lanes if schedule.mesh_wide else per_step
    self.microbatches_per_stage = self.num_microbatches * self.lanes
    self.num_devices = mesh.size
    self.packing = pipe.packing_for(params_like, schedule.num_stages, counts, self.lanes, matrices)
    self.params_like = params_like
    self.num_params = self.packing.num_params
    self._make_programs()

  def _make_programs(self):
    reduce = {"ddp": "mean", "zero1": "scatter", "acco": "none"}[self.data_method]
    self._loss_and_grad = pipe.make_loss_and_grad(
      self.cfg, self.mesh, self.schedule, self.packing, reduce
    )
    self.programs.clear()

  # -- state --------------------------------------------------------------------------------------

  def initial_state(self, params) -> PipeState:
    return build_state(self.packing, self.tx, self.data_method, self.lanes, self.comm_dtype, params)

  def state_sharding(self, shapes: PipeState) -> PipeState:
    named = lambda spec: jax.tree.map(lambda _: NamedSharding(self.mesh, spec), shapes.params)
    params = named(pipe.param_spec(self.mesh, self.sharded))
    rep = NamedSharding(self.mesh, P())
    if self.packing.matrix_slots:  # state in the view's structure: by shape
      opt = jax.tree.map(self._sharding_by_shape, shapes.opt_state)
    else:
      opt = optax.tree_map_params(
        self.tx, lambda _, s: s, shapes.opt_state, params, transform_non_params=lambda _: rep
      )
    out = PipeState(params, opt, rep)
    if self.data_method == "acco":
      lanes = pipe.DATA if self.lanes > 1 else None
      out = out._replace(w=named(P(pipe.STAGE)), buf=named(P(lanes, pipe.STAGE)), buf_count=rep)
    return out

  def _sharding_by_shape(self, x) -> NamedSharding:
    """An optimizer-state leaf's sharding: a buffer's ``[S, P_g]`` as the parameters, a stack of
    matrices ``[S, K', a, b]`` over ``stage`` and its slots over ``data`` (each lane owns whole
    matrices), anything else replicated."""
    S, K = self.schedule.num_stages, self.packing.matrix_slots
    if x.ndim == 2 and x.shape[0] == S and x.shape[1] in self.packing.sizes.values():
      spec = pipe.param_spec(self.mesh, self.sharded)
    elif x.ndim > 2 and x.shape[:2] == (S, K):
      spec = P(*pipe.param_spec(self.mesh, self.sharded))
    else:
      spec = P()
    return NamedSharding(self.mesh, spec)

  def init(self, params, microbatch=None) -> PipeState:
    """The sharded state from float32 parameters (``microbatch`` is not used: ACCO's first step
    fills its buffer instead of a prime)."""
    return self.placed_state(params)

  def describe(self) -> str:
    """One line on the schedule: ticks, idle share, blocks per stage, the lanes' data method, and
    for a scheduled plan its simulated time."""
    sch = self.schedule
    S = sch.num_stages
    line = (
      f"pipeline: {S} stages x {self.lanes} lanes ({self.data_method}), blocks per stage "
      f"{','.join(map(str, self.packing.counts))}, {sch.policy} tables, {sch.num_ticks} ticks, "
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
    """What a checkpoint records beyond the state: the blocks per stage, and the scheduler's plan."""
    extra = {"blocks_per_stage": list(self.packing.counts)}
    if self.planned is not None:
      extra["plan"] = plans.record(self.planned)
    return extra

  def check_checkpoint(self, extra: dict) -> None:
    """Before a restore reads arrays: a checkpoint with a plan needs this run's plan settings, and
    its plan is the one the run goes on with (see :func:`acco_jax.skippipe.plans.check_resume`)."""
    saved_counts = extra.get("blocks_per_stage")
    if saved_counts is not None and tuple(saved_counts) != self.packing.counts:
      raise errors.UserValueError(
        f"the checkpoint has blocks per stage {','.join(map(str, saved_counts))}, this run "
        f"{','.join(map(str, self.packing.counts))}: resume with "
        f"--config.pipeline.blocks_per_stage={','.join(map(str, saved_counts))}"
      )
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
      self._make_programs()

  def export_state(self, saved):
    """The portable form of a saved state (``ckpt.init_from``; :mod:`acco_jax.pipeline.relayout`)."""
    return relayout.export_state(self.packing, self.data_method, saved)

  def import_state(self, portable, stage: int, microbatch=None) -> PipeState:
    """This run's state from the portable form, at ``stage`` (:mod:`acco_jax.pipeline.relayout`;
    ``microbatch`` is not used: ACCO's first flush fills its buffer)."""
    return relayout.import_state(self, portable, stage)

  def reshard(self, saved):
    """Refuses a checkpoint of another mesh (its stages' buffers are cut for that mesh)."""
    raise errors.UserValueError(
      "the checkpoint was written on another mesh: a pipeline run resumes on the same "
      "pipeline.stages and devices only (start in a new workdir)"
    )

  def export_params(self, saved):
    """The committed parameters of a saved state, in the model's structure."""
    return self.export_state(saved).params

  # -- step ---------------------------------------------------------------------------------------

  def _microbatches(self, batch):
    M = self.schedule.num_microbatches
    mbs = jax.tree.map(lambda x: x.reshape(M, x.shape[0] // M, *x.shape[1:]), batch)
    spec = NamedSharding(self.mesh, pipe.batch_spec(self.mesh, self.schedule))
    return jax.lax.with_sharding_constraint(mbs, jax.tree.map(lambda _: spec, mbs))

  def _gathered(self, params):
    """The whole stage's weights on every lane (an all-gather over ``data`` in ``comm_dtype``)."""
    return pipe.gather_lanes(params, self.mesh, self.comm_dtype)

  def stage_fn(self, state: PipeState, batch):
    """One flush and its update, traceable: ``(state, batch) -> (state, metrics)``."""
    mbs = self._microbatches(batch)
    committed, valid = jnp.asarray(True), jnp.asarray(True)
    extra = {}
    if self.data_method == "acco":
      # the previous flushes' gradients: reduced, applied and gathered with no dependence on
      # this flush, which runs at the weights of the state (pipe.reduce_lanes' docstring)
      count = state.buf_count
      grads = pipe.reduce_lanes(state.buf, self.mesh, jnp.maximum(count, 1))
      loss, lane_grads = self._loss_and_grad(state.w, mbs)
      commits, keep = methods.alternation(state.opt_state.stage)  # ACCO's own stage count
      valid = count > 0  # the first flush only fills the buffer
      committed = valid & commits
      buf = jax.tree.map(
        lambda b, g: jnp.where(keep, b, 0).astype(jnp.float32) + g, state.buf, lane_grads
      )
      extra = dict(
        buf=jax.tree.map(lambda b: b.astype(self.comm_dtype), buf),
        buf_count=jnp.where(keep, count, 0) + 1,
      )
    elif self.data_method == "zero1":
      loss, grads = self._loss_and_grad(self._gathered(state.params), mbs)
    else:
      loss, grads = self._loss_and_grad(state.params, mbs)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    params, opt_state = jax.tree.map(
      lambda a, b: jnp.where(valid, a, b), (params, opt_state), (state.params, state.opt_state)
    )
    if self.data_method == "acco":
      extra["w"] = self._gathered(params)
    metrics = {
      "loss": loss,
      "grad_norm": optax.tree.norm(grads),
      "microbatches": jnp.asarray(self.microbatches_per_stage, jnp.float32),
      "committed": committed,
      "skipped": jnp.zeros((), jnp.float32),
      "stage": state.stage + 1,
    }
    return PipeState(params, opt_state, state.stage + 1, **extra), metrics

  def step(self, state: PipeState, batch, counts=None):
    """One schedule and one optimizer update. ``batch`` leaves: [M * lanes * B, ...] rows."""
    if counts is not None:
      raise ValueError("pipeline steps run every microbatch (no per-device counts)")
    if "step" not in self.programs:
      sharding = jax.tree.map(lambda s: s.sharding, state)
      rep = NamedSharding(self.mesh, P())
      self.programs["step"] = jax.jit(
        self.stage_fn, donate_argnums=(0,), out_shardings=(sharding, rep)
      )
    return self.programs["step"](state, batch)

  def call(self, state: PipeState, batches: list, stage: int, total: int, counts=None):
    """:meth:`step` on the one batch of a stage (the trainer's call)."""
    (batch,) = batches
    return self.step(state, batch, counts)

  def params(self, state: PipeState):
    """The model's (committed) parameters, original structure, replicated."""
    committed = lambda s: methods.committed_params(s.opt_state, s.params)
    return self.helper("params", lambda s: self.packing.unpack(committed(s)))(state)

  def optimizer_state(self, state: PipeState):
    return state.opt_state

  def comm_bytes_per_stage(self) -> float:
    """Bytes one device sends per flush to the other lanes of its stage: the all-reduce of its
    stage's gradients (``ddp``, float32) or their reduce-scatter and the weights' all-gather
    (``zero1``, ``acco``, in ``comm_dtype``), ``2 (L-1)/L`` of the stage's buffers with ring
    collectives. What crosses between stages (activations) is not counted."""
    per_stage = sum(self.packing.sizes.values())
    itemsize = self.comm_dtype.itemsize if self.sharded else 4
    return ring_bytes(per_stage * itemsize, self.lanes)
