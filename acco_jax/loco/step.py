r"""Workers with local steps and an outer optimizer: the low-communication family on the mesh.

ACCO's path (:mod:`acco_jax.dp.step`) hides the data-parallel communication of every update behind
compute. This module is the other path: ``M`` *workers* on a ``('replica', 'data')`` mesh, each of
``D`` devices running the ordinary inner data-parallel step (DDP or ZeRO-1 over ``'data'``, the
same :class:`acco_jax.dp.step.TrainStep`, its collectives staying inside a worker) on its own rows of
the data, and an outer step every few inner steps that moves data *between* workers
(:mod:`acco_jax.loco.replica`). What the outer step does is a :class:`acco_jax.loco.LocoMethod`.

State (:class:`LocoState`, a leading worker dimension ``M`` over ``replica``): the inner
:class:`acco_jax.dp.step.TrainState` (``θ_m`` shards, inner optimizer state, compute weights;
under ACCO its buffer and committed copy), the outer state (``θ_g`` and one outer optimizer state
per fragment, per worker: NoLoCo's ``φ_i`` and ``δ_i`` differ), the mean pseudo-gradient of a
fragment in flight, and each worker's error feedback (SparseLoCo) or momentum (DeMo).

Here: the state, its shardings and initial value, the schedule (:meth:`LocoStep.schedule`), the
cache of the programs and the public API (:class:`acco_jax.step_api.Step`). The programs (stage, sync, window, apply) are in
:mod:`acco_jax.loco.programs`; a sync's cost and log fields in :mod:`acco_jax.loco.accounting`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import errors
from acco_jax.dp import methods
from acco_jax.dp.step import TrainState, TrainStep
from acco_jax.loco import base, overlap, phase, programs, replica
from acco_jax.loco.accounting import SyncAccounting
from acco_jax.loco.base import LocoMethod, OuterState
from acco_jax.loco.replica import REPLICA, ReplicaCollectives
from acco_jax.step_api import StepBase

PyTree = Any


class LocoState(NamedTuple):
  """Everything the workers and the outer step hold (a pytree; checkpoint it whole).

  Attributes:
    inner: the workers' :class:`acco_jax.dp.step.TrainState`, each leaf ``[M, ...]``.
    outer: each worker's :class:`acco_jax.loco.OuterState` (``θ_g`` as ``[M, D, s]`` shards and the
      outer optimizer states of the fragments).
    inflight: the mean pseudo-gradient of the fragment in flight, ``[M, D, s]`` shards (zeros for
      the other leaves and when none is in flight).
    inflight_fragment: int32, the fragment in flight, ``-1`` if none.
    step: int32, inner steps done.
    comp: each worker's compressor state, ``[M, D, s]`` shards: SparseLoCo's error feedback,
      DeMo's momentum (``()`` for the other methods).
    overlap: with ``loco.outer_overlap`` ``delayed`` or ``eager``, each worker's
      :class:`acco_jax.loco.overlap.OverlapState` (start point, last average, own share;
      ``[M, D, s]`` shards); ``()`` when blocking, so those checkpoints are unchanged.
    round: int32, the next round of a worker meeting the others through a store
      (:mod:`acco_jax.loco.transport`); ``()`` on the mesh, so those checkpoints are unchanged.
  """

  inner: TrainState
  outer: OuterState
  inflight: PyTree
  inflight_fragment: jax.Array
  step: jax.Array
  comp: PyTree = ()
  overlap: PyTree = ()
  round: PyTree = ()


class Call(NamedTuple):
  """What one :meth:`LocoStep.call` does, from the inner steps done (host-side, deterministic):
  :meth:`LocoStep.schedule`.

  Attributes:
    apply: the fragment whose in-flight mean is applied first, or ``None``.
    send: the fragment sent before this call's inner steps (a window), or ``None``.
    stages: inner steps this call runs (``τ`` for a window, else 1).
    sync: the fragment synced after them (``τ = 0``; with an outer overlap, the blocking sync
      that lands the run's last pseudo-gradient), or ``None``.
    land: the window's fragment is applied right after its steps (the run ends there).
    phase: the fragment whose overlapped phase this call runs (``stages`` = ``H/P`` inner steps
      with its reduction in flight, :mod:`acco_jax.loco.phase`), or ``None``.
  """

  apply: int | None
  send: int | None
  stages: int
  sync: int | None
  land: bool = False
  phase: int | None = None


class LocoStep(SyncAccounting, StepBase):
  """The programs of a low-communication method. Build it with :func:`make_loco_step`.

  What a sync costs and the log fields of an outer step: the methods of
  :class:`acco_jax.loco.accounting.SyncAccounting`.
  """

  def __init__(
    self,
    loss_fn,
    inner_tx,
    method: LocoMethod,
    mesh,
    num_microbatches,
    params_like,
    has_aux=False,
    skip_nonfinite=False,
    owned=None,
    elementwise=None,
    transport=None,
  ):
    base.check(method)
    if REPLICA not in mesh.axis_names:
      raise ValueError(f"workers need a mesh with a {REPLICA!r} axis, got {mesh.axis_names}")
    self.method = method
    # an ACCO inner step is one update: two stages of k/2 microbatches (estimate, commit)
    self.stages_per_step = 2 if methods.comm_plan(inner_tx).two_stage else 1
    if num_microbatches % self.stages_per_step:
      raise ValueError(
        f"an ACCO inner step runs its {num_microbatches} microbatches per device as two stages: "
        "use an even number"
      )
    self.inner = TrainStep(
      loss_fn,
      inner_tx,
      mesh,
      num_microbatches // self.stages_per_step,
      has_aux,
      params_like,
      skip_nonfinite,
      replica_axis=REPLICA,
      owned=owned,
      elementwise=elementwise,
    )
    super().__init__(self.inner.mesh)
    self.num_workers = self.inner.num_replicas
    self.layout = self.inner.layout
    self.num_params = self.layout.num_params
    shards = self.layout.shard_shapes(1)
    self.shard_shapes = [x.shape[1:] for x in jax.tree.leaves(shards)]  # per device, leaf order
    if self.inner.owner:
      base.check_owner(method)
    self.parts = base.partition(shards, method.fragments, method.layout)
    self.comm = ReplicaCollectives(
      self.mesh, self.inner.plan.axis_name, self.inner.plan.sharded, REPLICA
    )
    self.codec = programs.make_codec(method, self.layout)
    self.transport = transport  # a loco.transport.StoreTransport, or None on the mesh
    self.params_shapes = params_like
    self.matchings = None if transport else programs.make_matchings(method, self.num_workers)
    if transport is not None and (self.num_workers != 1 or method.outer_overlap != "none"):
      raise ValueError(
        "a worker of a store run is one job: a mesh of one worker (replica axis 1) and "
        "loco.outer_overlap='none'"
      )

  @property
  def data_share(self) -> tuple[int, int]:
    """``(index, count)``: this job's share of the global batch (a store worker reads its own
    worker's; the mesh's one job reads it all)."""
    t = self.transport
    return (0, 1) if t is None else (t.worker, t.workers)

  @property
  def num_microbatches(self) -> int:
    """``k``, microbatches per device per inner step (ACCO: both stages of its update)."""
    return self.inner.num_microbatches * self.stages_per_step

  @property
  def num_devices(self) -> int:
    """Devices per worker (the data axis)."""
    return self.inner.num_devices

  @property
  def microbatches_per_stage(self) -> int:
    """Microbatches an inner step takes from the stream: ``k`` per device of every worker."""
    return self.num_workers * self.num_devices * self.num_microbatches

  # -- shardings ---------------------------------------------------------------------------------

  def state_sharding(self, state_shape: LocoState) -> LocoState:
    inner = self.inner.state_sharding(state_shape.inner)
    leaf = self.inner.leaf_sharding
    rep = NamedSharding(self.mesh, P())
    return LocoState(
      inner=inner,
      outer=jax.tree.map(leaf, state_shape.outer),
      inflight=jax.tree.map(lambda _: self._data_sharded, state_shape.inflight),
      inflight_fragment=rep,
      step=rep,
      comp=jax.tree.map(leaf, state_shape.comp),
      overlap=jax.tree.map(leaf, state_shape.overlap),
      round=jax.tree.map(lambda _: rep, state_shape.round),
    )

  @property
  def _data_sharded(self):
    """``[M, D, ...]`` sharded over workers and the data axis (the in-flight mean, also for DDP:
    the window's barrier hands it back per device)."""
    return NamedSharding(self.mesh, P(REPLICA, self.inner.plan.axis_name))

  def batch_sharding(self) -> NamedSharding:
    """A batch's rows over the workers and their devices (worker-major)."""
    return NamedSharding(self.mesh, P((REPLICA, self.inner.plan.axis_name)))

  # -- building the state ------------------------------------------------------------------------

  def initial_state(self, params: PyTree) -> LocoState:
    one = self.inner.initial_state(params)  # a single worker's state
    copies = lambda x: jnp.broadcast_to(x, (self.num_workers, *jnp.shape(x)))
    inner = jax.tree.map(copies, one)
    outer = base.init_outer(self.method, one.params, self.parts)
    zeros = jax.tree.map(jnp.zeros_like, one.params)
    return LocoState(
      inner=inner,
      outer=jax.tree.map(copies, outer),
      inflight=jax.tree.map(copies, zeros),
      inflight_fragment=jnp.int32(-1),
      step=jnp.int32(0),
      comp=jax.tree.map(copies, zeros) if self.method.sparse else (),
      overlap=jax.tree.map(copies, overlap.init_overlap(self.method.outer_overlap, one.params)),
      round=() if self.transport is None else jnp.int32(0),
    )

  def init(self, params: PyTree, microbatch: PyTree | None = None) -> LocoState:
    """Every worker starts from ``params`` (float32, original shapes), and so does ``θ_g``.

    An ACCO inner step starts, as ACCO does, from one microbatch gradient at ``params`` per device
    in its buffer: ``microbatch`` has one microbatch per device of every worker (leading dim
    ``M * D * B``); other inner steps ignore it.
    """
    state = self.placed_state(params)
    if self.transport is not None:
      state = self.transport.join(self, state)
    if not self.inner.plan.delayed:
      return state
    if microbatch is None:
      raise ValueError(
        "an ACCO inner step starts from one microbatch gradient per device: call init(params, "
        f"microbatch) with one microbatch per device (leading dim {self.num_workers}*"
        f"{self.num_devices}*B)"
      )
    if "prime" not in self.programs:

      def prime(state, batch):
        rows = jax.tree.map(lambda x: x.reshape(self.num_workers, -1, *x.shape[1:]), batch)
        buf, count, _ = self.inner.program.accumulate(state.inner.w, rows, None, 1)
        return state._replace(inner=state.inner._replace(buf=buf, buf_count=count))

      self.programs["prime"] = jax.jit(prime, donate_argnums=(0,))
    return self.programs["prime"](state, self.put_batch(microbatch, per_device=1))

  # -- schedule ----------------------------------------------------------------------------------

  def schedule(self, steps_done: int, total: int) -> Call:
    """The call that starts after ``steps_done`` inner steps of a run of ``total``.

    A window starts only if its apply point is within the run; one whose apply point is the end
    of the run applies its fragment in the same call, so nothing is in flight after the last step.
    """
    m = self.method
    if m.outer_overlap != "none":
      return self._schedule_overlap(steps_done, total)
    apply = base.apply_fragment(m, steps_done) if m.overlap_steps and steps_done else None
    send = base.send_fragment(m, steps_done)
    if send is not None and steps_done + m.overlap_steps > total:
      send = None
    stages = m.overlap_steps if send is not None else 1
    sync = None if m.overlap_steps else base.apply_fragment(m, steps_done + stages)
    land = send is not None and steps_done + stages == total
    return Call(apply, send, stages, sync, land)

  def _schedule_overlap(self, steps_done: int, total: int) -> Call:
    """An outer overlap's schedule: from a fragment's sync point, a phase program of ``K = H/P``
    steps if it ends within the run; the sync point no phase follows (the run's last) syncs
    blocking, so nothing is pending at the end. Before the first sync: plain inner steps."""
    m, k, s = self.method, self.method.period, steps_done
    if s >= k and s % k == 0 and s + k <= total:
      last = base.apply_fragment(m, s + k) if s + 2 * k > total else None
      return Call(None, None, k, last, phase=base.apply_fragment(m, s))
    sync = base.apply_fragment(m, s + 1)
    return Call(None, None, 1, sync if sync is not None and s + 1 + k > total else None)

  # -- programs ----------------------------------------------------------------------------------

  def program(self, kind: str, p: int | None, state_like):
    """The jitted program ``kind`` of fragment ``p`` (:func:`acco_jax.loco.programs.build`), built
    on the first call; ``state_like``: a state or its ``ShapeDtypeStruct`` tree."""
    key = (kind, p)
    if key not in self.programs:
      build = phase.build if kind in ("phase", "flush") else programs.build
      self.programs[key] = build(self, kind, p, self.state_sharding(state_like))
    return self.programs[key]

  # -- public API --------------------------------------------------------------------------------

  def put_batch(self, batch, per_device: int | None = None):
    """Places a host batch (leading dim ``M * D * k * B``, worker-major) on the mesh."""
    m, n = self.num_workers, self.inner.num_devices
    k = self.num_microbatches if per_device is None else per_device
    for x in jax.tree.leaves(batch):
      if x.ndim < 1 or x.shape[0] % (m * n * k):
        raise ValueError(
          f"batch leading dim {x.shape[0] if x.ndim else 'scalar'} is not divisible by workers x "
          f"devices x microbatches = {m} x {n} x {k}"
        )
    sharding = self.batch_sharding()
    return jax.tree.map(
      lambda x: x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding),
      batch,
    )

  def call(self, state: LocoState, batches, stage: int, total: int, counts=None):
    """Runs :meth:`schedule` ``(stage, total)`` (``stage``: inner steps done): ``batches`` is a
    list of its ``stages`` batches (``counts``: workers run every microbatch; ``None`` only).

    Returns ``(state, metrics)``: the inner metrics of the last inner step, one entry per worker
    (``loss``, ``grad_norm``, ...), plus the outer metrics of an apply or sync when one ran.
    """
    if counts is not None:
      raise ValueError("LoCo workers run every microbatch (no per-device counts)")
    call = self.schedule(stage, total)
    if len(batches) != call.stages:
      raise ValueError(f"this call runs {call.stages} inner steps, got {len(batches)} batches")
    if self.transport is not None:
      last = stage + call.stages >= total
      state, metrics = self._run_store(state, batches, call, last)
      if last:
        self.transport.finish(state)
      return state, metrics
    metrics = {}
    if call.apply is not None:
      state, metrics = self.program("apply", call.apply, state)(state)
    batches = [self.put_batch(b) for b in batches]
    if call.phase is not None:
      state, inner = self.program("phase", call.phase, state)(state, batches)
    elif call.send is not None:
      state, inner = self.program("window", call.send, state)(state, batches)
    else:
      state, inner = self.program("stage", None, state)(state, batches[0])
    metrics = {**metrics, **inner}
    if call.sync is not None:
      kind = "sync" if self.method.outer_overlap == "none" else "flush"
      state, outer = self.program(kind, call.sync, state)(state)
      metrics = {**metrics, **outer}
    if call.land:
      state, outer = self.program("apply", call.send, state)(state)
      metrics = {**metrics, **outer}
    return state, metrics

  def _run_store(self, state: LocoState, batches, call: Call, last: bool):
    """:meth:`call` of a worker meeting the others through a store: the schedule's points, each
    sync a round (:class:`acco_jax.loco.transport.StoreTransport`; its fragment is the round's);
    a sync that a stop cut short finished first. ``last``: the run's last call (its sync waits
    whatever :meth:`watch_stop` says)."""
    t = self.transport
    state, metrics = t.resume(self, state)
    if call.apply is not None:
      state, metrics = t.land(self, state)
    if call.send is not None:
      state, sent = t.send(self, state)
      metrics = {**metrics, **sent}
    for batch in batches:
      state, inner = self.program("stage", None, state)(state, self.put_batch(batch))
    metrics = {**metrics, **inner}
    if call.sync is not None:
      state, outer = t.sync(self, state, stoppable=not last)
      metrics = {**metrics, **outer}
    if call.land:
      state, outer = t.land(self, state)
      metrics = {**metrics, **outer}
    return state, metrics

  def watch_stop(self, requested) -> None:
    """A store worker's wait for its round gives up once ``requested()`` is true (a preemption),
    so that the trainer checkpoints and stops; the next call finishes that sync."""
    if self.transport is not None:
      self.transport.watch_stop(requested)

  def params(self, state: LocoState) -> PyTree:
    """``θ_g`` of worker 0 (the same on every worker) as a float32 tree of the original shapes."""
    fn = lambda s: self.layout.from_shards(jax.tree.map(lambda x: x[0], s.outer.params))
    return self.helper("loco_params", fn)(state)

  # -- what the trainer calls beyond init, run and params (acco_jax.step_api.Step) ---------------

  def call_stages(self, stage: int, total: int) -> int:
    return self.schedule(stage, total).stages

  def sent_bytes(self, stage: int, total: int) -> float:
    """Bytes one worker sends in the call that starts after ``stage``: an overlapped phase sends
    one fragment, its last sync (or a window's send) another."""
    call = self.schedule(stage, total)
    sent = call.sync if call.sync is not None else call.send
    return sum(self.wire_bytes(p) for p in (call.phase, sent) if p is not None)

  def comm_bytes_per_stage(self) -> float:
    """Within a worker, per stage of its inner step (an ACCO inner step is two stages)."""
    return self.inner.comm_bytes_per_stage() * self.stages_per_step

  def optimizer_state(self, state: LocoState) -> PyTree:
    return state.inner.opt_state

  def log_fields(self, metrics: dict, sent: float) -> dict:
    """Each worker's loss, and the bytes a worker sent so far."""
    return dict(worker_loss=np.asarray(metrics["loss"]).tolist(), wire_bytes_per_worker=sent)

  def outer_metrics(self, metrics: dict) -> dict | None:
    """A call's metrics if it ran an outer step (an apply, sync or flush)."""
    return metrics if "outer_fragment" in metrics else None

  def sync_row(self, metrics: dict) -> dict:
    return self.outer_row(metrics)

  def export_params(self, saved: LocoState) -> PyTree:
    """``θ_g`` of a checkpoint read as host arrays (this mesh's shapes), worker 0's copy (the same
    on every worker), as float32 numpy leaves of the model's shapes."""
    shards = jax.tree.map(lambda x: np.asarray(x)[0], saved.outer.params)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), self.layout.from_shards(shards))

  def reshard(self, saved: LocoState):
    """Refuses a checkpoint of another mesh: workers hold diverged copies, no rule splits or
    merges them."""
    raise errors.UserValueError(replica.mesh_mismatch(saved, self.mesh))

  def worker_params(self, state: LocoState) -> PyTree:
    """Every worker's ``θ_m``, a tree of ``[M, ...]`` float32 arrays of the original shapes."""
    fn = lambda s: jax.vmap(self.layout.from_shards)(programs.worker_params(s))
    return self.helper("worker_params", fn)(state)


def worker_mesh(num_workers: int, devices=None) -> jax.sharding.Mesh:
  """A ``('replica', 'data')`` mesh: ``num_workers`` rows of consecutive devices.

  ``devices`` default to every device, ordered by process then id (a worker's devices are then on
  as few processes as possible).
  """
  if devices is None:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  devices = list(devices)
  if num_workers < 1 or len(devices) % num_workers:
    raise errors.UserValueError(
      f"loco.workers={num_workers} does not divide the {len(devices)} devices: choose a divisor"
    )
  grid = np.array(devices).reshape(num_workers, -1)
  return jax.sharding.Mesh(grid, (REPLICA, "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def make_loco_step(
  loss_fn: Callable,
  inner_tx,
  method: LocoMethod,
  mesh: jax.sharding.Mesh,
  *,
  num_microbatches: int,
  params: PyTree,
  has_aux: bool = False,
  skip_nonfinite: bool = False,
  owned=None,
  elementwise: bool | None = None,
  transport=None,
) -> LocoStep:
  """Builds the programs of a low-communication method over a ``('replica', 'data')`` mesh.

  Example::

    mesh = acco_jax.loco.step.worker_mesh(4)                # 4 workers of 2 devices on 8
    method = acco_jax.loco.diloco(sync_every=50)
    train = make_loco_step(loss_fn, acco_jax.zero1(optax.adamw(4e-4)), method, mesh,
                           num_microbatches=2, params=params)
    state = train.init(params)
    s = 0
    while s < total:
      n = train.schedule(s, total).stages
      state, metrics = train.call(state, [next(batches) for _ in range(n)], s, total)
      s += n
    theta_g = train.params(state)

  Args:
    loss_fn: ``loss_fn(params, microbatch)`` (or ``(loss, aux)`` with ``has_aux``).
    inner_tx: the inner step, :func:`acco_jax.ddp`, :func:`acco_jax.zero1` or :func:`acco_jax.acco`
      of an optax optimizer (ACCO: an inner step is one update, two stages of ``k/2``
      microbatches, its communication hidden behind them; pass ``init`` a microbatch).
    method: the outer method (:func:`acco_jax.loco.diloco`, ...).
    mesh: a mesh with axes ``('replica', 'data')`` (:func:`worker_mesh`).
    num_microbatches: ``k`` per device per inner step.
    params: the parameters or their ``ShapeDtypeStruct`` tree.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    skip_nonfinite: as :func:`acco_jax.make_train_step`.
    owned, elementwise: as :func:`acco_jax.make_train_step`, for an inner ``zero1(...,
      layout='owner')`` (MuLoCo: a Muon inner optimizer with each matrix whole on one device of
      its worker).
    transport: a :class:`acco_jax.loco.transport.StoreTransport`: this process is one worker of
      a run whose workers meet through a store (``mesh`` then has one worker); ``None``: every
      worker is on ``mesh``.

  Returns:
    A :class:`LocoStep`.
  """
  return LocoStep(
    loss_fn,
    inner_tx,
    method,
    mesh,
    num_microbatches,
    params,
    has_aux,
    skip_nonfinite,
    owned,
    elementwise,
    transport,
  )
