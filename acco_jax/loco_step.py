r"""Workers with local steps and an outer optimizer: the low-communication family on the mesh.

ACCO's path (:mod:`acco_jax.step`) hides the data-parallel communication of every update behind
compute. This module is the other path: ``M`` *workers* on a ``('replica', 'data')`` mesh, each of
``D`` devices running the ordinary inner data-parallel step (DDP or ZeRO-1 over ``'data'``, the
same :class:`acco_jax.step.TrainStep`, its collectives staying inside a worker) on its own rows of
the data, and an outer step every few inner steps that moves data *between* workers
(:mod:`acco_jax.replica`). What the outer step does is a :class:`acco_jax.loco.LocoMethod`.

State (:class:`LocoState`; every leaf has a leading worker dimension ``M`` sharded over
``replica``): the inner :class:`acco_jax.step.TrainState` (``θ_m`` as ``[M, D, s]`` shards, the
inner optimizer state, the bf16 compute weights), the outer state (each worker's copy of ``θ_g`` and
one outer optimizer state per fragment; identical on every worker except for NoLoCo, whose ``φ_i``
and ``δ_i`` they are), the mean pseudo-gradient of a fragment in flight, and each worker's
error-feedback buffer (SparseLoCo) or momentum (DeMo).

Programs, each one jitted XLA program (``s`` = inner steps done, see :meth:`LocoStep.plan`):

.. code-block:: none

  stage      one inner step on every worker (k microbatches, the inner update)
  sync p     Δ = θ_g − θ_m on fragment p; compress; all-reduce mean over workers;     (τ = 0)
             θ_g[p] ← outer(Δ̄); θ_m[p] ← α θ_m[p] + (1 − α) θ_g[p]
  window p   Δ snapshot of fragment p; compress; all-reduce mean  } no data dependence:   (τ > 0)
             τ inner steps on every worker                         } in flight together
             the mean goes to the state (in flight)
  apply p    θ_g[p] ← outer(in-flight mean); α-merge into the θ_m of now (τ steps later)

How a sync moves data between workers is the method's aggregator (:mod:`acco_jax.replica`): an
all-reduce mean here, a collective-permute with one peer or an all-gather of packed sparse bytes in
:mod:`acco_jax.loco_programs`. No program but a sync or a window moves data between workers; their
metrics stay per worker (``[M]``, sharded over ``replica``).

A window's reduction and its ``τ`` inner steps are one program, with an ``optimization_barrier``
that makes the loop wait for the payload (not for the reduction): on a GPU the all-reduce can stay
in flight across the loop (``bench/overlap_gpu.py --loco``). The apply runs at the start of the
next call, so a checkpoint taken between the two holds a fragment in flight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import errors
from acco_jax import loco_programs as programs
from acco_jax.loco import base
from acco_jax.loco.base import LocoMethod, OuterState
from acco_jax.replica import REPLICA, ReplicaCollectives
from acco_jax.step import TrainState, TrainStep

PyTree = Any


class LocoState(NamedTuple):
  """Everything the workers and the outer step hold (a pytree; checkpoint it whole).

  Attributes:
    inner: the workers' :class:`acco_jax.step.TrainState`, each leaf ``[M, ...]``.
    outer: each worker's :class:`acco_jax.loco.OuterState` (``θ_g`` as ``[M, D, s]`` shards and the
      outer optimizer states of the fragments).
    inflight: the mean pseudo-gradient of the fragment in flight, ``[M, D, s]`` shards (zeros for
      the other leaves and when none is in flight).
    inflight_fragment: int32, the fragment in flight, ``-1`` if none.
    step: int32, inner steps done.
    comp: each worker's compressor state, ``[M, D, s]`` shards: SparseLoCo's error feedback,
      DeMo's momentum (``()`` for the other methods).
  """

  inner: TrainState
  outer: OuterState
  inflight: PyTree
  inflight_fragment: jax.Array
  step: jax.Array
  comp: PyTree = ()


class Call(NamedTuple):
  """What one :meth:`LocoStep.run` does, from the inner steps done (host-side, deterministic).

  Attributes:
    apply: the fragment whose in-flight mean is applied first, or ``None``.
    send: the fragment sent before this call's inner steps (a window), or ``None``.
    stages: inner steps this call runs (``τ`` for a window, else 1).
    sync: the fragment synced after them (``τ = 0``), or ``None``.
    land: the window's fragment is applied right after its steps (the run ends there).
  """

  apply: int | None
  send: int | None
  stages: int
  sync: int | None
  land: bool = False


class LocoStep:
  """The programs of a low-communication method. Build it with :func:`make_loco_step`."""

  def __init__(
    self, loss_fn, inner_tx, method: LocoMethod, mesh, num_microbatches, params_like,
    has_aux=False, skip_nonfinite=False,
  ):  # fmt: skip
    base.check(method)
    if REPLICA not in mesh.axis_names:
      raise ValueError(f"workers need a mesh with a {REPLICA!r} axis, got {mesh.axis_names}")
    self.method = method
    self.inner = TrainStep(
      loss_fn, inner_tx, mesh, num_microbatches, has_aux, params_like, skip_nonfinite,
      replica_axis=REPLICA,
    )  # fmt: skip
    self.mesh = self.inner.mesh
    self.num_workers = self.inner.num_replicas
    self.layout = self.inner.layout
    self.parts = base.partition(self.layout.shard_shapes(), method.fragments, method.layout)
    self.comm = ReplicaCollectives(
      self.mesh, self.inner.plan.axis_name, self.inner.plan.sharded, REPLICA
    )
    self.codec = programs.make_codec(method, self.layout)
    self.matchings = programs.make_matchings(method, self.num_workers)
    self._programs: dict = {}

  @property
  def num_microbatches(self) -> int:
    return self.inner.num_microbatches

  @property
  def num_devices(self) -> int:
    """Devices per worker (the data axis)."""
    return self.inner.num_devices

  # -- layout ------------------------------------------------------------------------------------

  def fragment_sizes(self) -> list[int]:
    """Values per fragment (the padded shard layout, all ``D`` shards of one worker)."""
    specs = self.layout.specs
    return [sum(specs[i].chunk * self.layout.num_shards for i in idx) for idx in self.parts]

  def _sharding(self, state_shape: LocoState) -> LocoState:
    inner = self.inner._state_sharding(state_shape.inner)
    leaf = self.inner.leaf_sharding
    rep = NamedSharding(self.mesh, P())
    return LocoState(
      inner=inner,
      outer=jax.tree.map(leaf, state_shape.outer),
      inflight=jax.tree.map(lambda _: self._data_sharded, state_shape.inflight),
      inflight_fragment=rep,
      step=rep,
      comp=jax.tree.map(leaf, state_shape.comp),
    )

  @property
  def _data_sharded(self):
    """``[M, D, ...]`` sharded over workers and the data axis (the in-flight mean, also for DDP:
    the window's barrier hands it back per device)."""
    return NamedSharding(self.mesh, P(REPLICA, self.inner.plan.axis_name))

  def _batch_sharding(self):
    return NamedSharding(self.mesh, P((REPLICA, self.inner.plan.axis_name)))

  # -- building the state ------------------------------------------------------------------------

  def _build(self, params: PyTree) -> LocoState:
    one = self.inner._build(params)  # a single worker's state
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
    )

  def abstract_state(self, params: PyTree) -> LocoState:
    """``jax.ShapeDtypeStruct`` tree of the state, with shardings (a checkpoint restore target)."""
    shapes = jax.eval_shape(self._build, params)
    return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      shapes,
      self._sharding(shapes),
    )

  def init(self, params: PyTree) -> LocoState:
    """Every worker starts from ``params`` (float32, original shapes), and so does ``θ_g``."""
    sharding = jax.tree.map(lambda s: s.sharding, self.abstract_state(params))
    return jax.jit(self._build, out_shardings=sharding)(params)

  # -- schedule ----------------------------------------------------------------------------------

  def plan(self, steps_done: int, total: int) -> Call:
    """The call that starts after ``steps_done`` inner steps of a run of ``total``.

    A window starts only if its apply point is within the run; one whose apply point is the end
    of the run applies its fragment in the same call, so nothing is in flight after the last step.
    """
    m = self.method
    apply = base.apply_fragment(m, steps_done) if m.overlap_steps and steps_done else None
    send = base.send_fragment(m, steps_done)
    if send is not None and steps_done + m.overlap_steps > total:
      send = None
    stages = m.overlap_steps if send is not None else 1
    sync = None if m.overlap_steps else base.apply_fragment(m, steps_done + stages)
    land = send is not None and steps_done + stages == total
    return Call(apply, send, stages, sync, land)

  # -- programs ----------------------------------------------------------------------------------

  def _counts(self):
    k, n = self.inner.num_microbatches, self.inner.num_devices
    counts = np.full((self.num_workers, n), k, np.int32)
    return jax.device_put(counts, NamedSharding(self.mesh, P(REPLICA, self.inner.plan.axis_name)))

  def _per_worker_batch(self, batch):
    m = self.num_workers
    return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)

  def _stage(self, inner: TrainState, batch, counts, token=None):
    return self.inner.program.stage_fn("sync")(inner, self._per_worker_batch(batch), counts, token)

  def _send(self, state: LocoState, p: int):
    """Fragment ``p``'s pseudo-gradient, compressed, and its mean over workers (all-reduce).

    Returns the payload, the mean as one ``[M, D, n_p]`` buffer (the fragment's shards end to end:
    one all-reduce, and one value for the window's barrier to hold) and whether all was finite.
    """
    idx = self.parts[p]
    delta = base.pseudo_gradient(
      base.select(state.outer.params, idx), base.select(state.inner.params, idx)
    )
    payload = {k: self.method.compressor.roundtrip(v)[0] for k, v in delta.items()}
    finite = programs.finite_per_worker(payload)
    flat = jnp.concatenate([payload[f"{i:04d}"] for i in idx], axis=-1)
    return payload, self.comm.mean(flat), finite

  def _split(self, p: int, flat) -> dict:
    """A fragment's ``[M, D, n_p]`` buffer back into its view (:func:`acco_jax.loco.base.select`)."""
    out, start = {}, 0
    for i in self.parts[p]:
      size = self.layout.specs[i].chunk
      out[f"{i:04d}"] = flat[..., start : start + size]
      start += size
    return out

  def _apply(self, state: LocoState, p: int, mean: dict) -> tuple[LocoState, dict]:
    """Outer update of fragment ``p`` on every worker, α-merge into ``θ_m``, new compute weights."""
    update = functools.partial(base.outer_update, self.method, fragment=p, parts=self.parts)
    outer, new_g = jax.vmap(update, spmd_axis_name=REPLICA)(state.outer, mean)
    idx = self.parts[p]
    local = base.merge(base.select(state.inner.params, idx), new_g, self.method.alpha)
    params = base.replace(state.inner.params, local)
    inner = state.inner._replace(params=params, w=self.inner.program.gather(params))
    step = base.pseudo_gradient(base.select(state.outer.params, idx), new_g)
    norm = jax.vmap(optax.tree.norm)  # per worker: no metric moves data between workers
    metrics = {
      "outer_delta_norm": norm(mean),
      "outer_step_norm": norm(step),
      "outer_fragment": jnp.int32(p),
    }
    return state._replace(inner=inner, outer=outer), metrics

  def _program(self, kind: str, p: int | None, state_like):
    key = (kind, p)
    if key in self._programs:
      return self._programs[key]
    sharding = self._sharding(state_like)
    tau = self.method.overlap_steps

    def sync(state):
      if self.method.aggregate == "mean":
        _, mean, finite = self._send(state, p)
        state, mean, extra = state, self._split(p, mean), {"outer_finite": finite}
      else:
        state, mean, extra = programs.exchange(self, state, p)
      state, metrics = self._apply(state, p, mean)
      return state, {**metrics, **extra}

    def apply(state):
      mean = base.select(state.inflight, self.parts[p])
      state, metrics = self._apply(state, p, mean)
      cleared = jax.tree.map(jnp.zeros_like, state.inflight)
      return state._replace(inflight=cleared, inflight_fragment=jnp.int32(-1)), metrics

    def stage(state, batch, counts):
      inner, metrics = self._stage(state.inner, batch, counts)
      return state._replace(inner=inner, step=state.step + 1), metrics

    def window(state, batches, counts):
      payload, mean, finite = self._send(state, p)
      # Two barriers place the all-reduce of the mean around the first inner step's microbatch
      # loop: the loop starts after the payload is computed (not after it is reduced), and the
      # step's own collectives start after the reduction (the mean joins the loop's result), so
      # the reduction is the one collective in flight while the microbatches run. The join is
      # the one that decides the schedule (without it XLA:GPU finishes the all-reduce before the
      # loop; tests/loco_overlap_gpu_test.py goes red); the first barrier only fixes an order
      # the latency-hiding scheduler already picks today.
      payload, inner = lax.optimization_barrier((payload, state.inner))
      stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)

      def body(i, carry):
        inner, _ = carry
        batch = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), stacked)
        return self._stage(inner, batch, counts)

      *first, mean = self._stage(inner, jax.tree.map(lambda x: x[0], stacked), counts, mean)
      inner, metrics = lax.fori_loop(1, tau, body, tuple(first)) if tau > 1 else first
      zeros = jax.tree.map(jnp.zeros_like, state.inflight)
      inflight = base.replace(zeros, self._split(p, mean))
      state = state._replace(
        inner=inner, inflight=inflight, inflight_fragment=jnp.int32(p), step=state.step + tau
      )
      return state, {**metrics, "outer_finite": finite}

    metric_sharding = None  # as computed: per-worker metrics stay on their workers
    if kind in ("sync", "apply"):
      fn = {"sync": sync, "apply": apply}[kind]
      jitted = jax.jit(fn, in_shardings=(sharding,), out_shardings=(sharding, metric_sharding),
                       donate_argnums=(0,))  # fmt: skip
    else:
      fn = {"stage": stage, "window": window}[kind]
      counts = NamedSharding(self.mesh, P(REPLICA, self.inner.plan.axis_name))
      jitted = jax.jit(fn, in_shardings=(sharding, self._batch_sharding(), counts),
                       out_shardings=(sharding, metric_sharding), donate_argnums=(0,))  # fmt: skip
    self._programs[key] = jitted
    return jitted

  # -- public API --------------------------------------------------------------------------------

  def put_batch(self, batch):
    """Places a host batch (leading dim ``M * D * k * B``, worker-major) on the mesh."""
    m, n, k = self.num_workers, self.inner.num_devices, self.inner.num_microbatches
    for x in jax.tree.leaves(batch):
      if x.ndim < 1 or x.shape[0] % (m * n * k):
        raise ValueError(
          f"batch leading dim {x.shape[0] if x.ndim else 'scalar'} is not divisible by workers x "
          f"devices x microbatches = {m} x {n} x {k}"
        )
    sharding = self._batch_sharding()
    return jax.tree.map(
      lambda x: x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding),
      batch,
    )

  def run(self, state: LocoState, batches, steps_done: int, total: int):
    """Runs :meth:`plan` ``(steps_done, total)``: ``batches`` is a list of ``plan.stages`` batches.

    Returns ``(state, metrics)``: the inner metrics of the last inner step, one entry per worker
    (``loss``, ``grad_norm``, ...), plus the outer metrics of an apply or sync when one ran.
    """
    call = self.plan(steps_done, total)
    if len(batches) != call.stages:
      raise ValueError(f"this call runs {call.stages} inner steps, got {len(batches)} batches")
    metrics = {}
    if call.apply is not None:
      state, metrics = self._program("apply", call.apply, state)(state)
    batches = [self.put_batch(b) for b in batches]
    if call.send is not None:
      state, inner = self._program("window", call.send, state)(state, batches, self._counts())
    else:
      state, inner = self._program("stage", None, state)(state, batches[0], self._counts())
    metrics = {**metrics, **inner}
    if call.sync is not None:
      state, outer = self._program("sync", call.sync, state)(state)
      metrics = {**metrics, **outer}
    if call.land:
      state, outer = self._program("apply", call.send, state)(state)
      metrics = {**metrics, **outer}
    return state, metrics

  def params(self, state: LocoState) -> PyTree:
    """``θ_g`` of worker 0 (the same on every worker) as a float32 tree of the original shapes."""
    fn = lambda s: self.layout.from_shards(jax.tree.map(lambda x: x[0], s.outer.params))
    return jax.jit(fn, out_shardings=NamedSharding(self.mesh, P()))(state)

  def replicated(self, x):
    """A copy of every array of ``x`` on every device (readable on every process), e.g.
    per-worker values."""
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=NamedSharding(self.mesh, P()))
    return copy(x)

  def worker_params(self, state: LocoState) -> PyTree:
    """Every worker's ``θ_m``, a tree of ``[M, ...]`` float32 arrays of the original shapes."""
    fn = lambda s: jax.vmap(self.layout.from_shards)(s.inner.params)
    return jax.jit(fn, out_shardings=NamedSharding(self.mesh, P()))(state)

  def payload_bytes(self, fragment: int) -> float:
    """Bytes of one worker's payload for a sync of ``fragment``, summed over its devices: values
    as quantised with their scales (all-reduce), the packed indices, values, shifts and tables
    (sparse), ``Δ`` and ``φ`` in float32 (pairs)."""
    size = self.fragment_sizes()[fragment]
    if self.method.aggregate == "sparse":
      return float(self.codec.row_bytes * self.layout.num_shards)
    if self.method.aggregate == "pairs":
      return 2 * 4.0 * size
    return float(self.method.compressor.payload_bytes(size))

  def wire_bytes(self, fragment: int) -> float:
    """Bytes one worker sends to sync ``fragment``, summed over its devices: a ring all-reduce
    sends ``2 (M−1)/M`` payloads, a ring all-gather ``M − 1``, a pair exchange one."""
    m = self.num_workers
    if m == 1:
      return 0.0
    fan = {"mean": 2 * (m - 1) / m, "sparse": m - 1, "pairs": 1}[self.method.aggregate]
    return fan * self.payload_bytes(fragment)

  def density(self) -> float:
    """Share of the payload's values a sync sends (1 for dense methods)."""
    return self.codec.density if self.codec is not None else 1.0

  def peak_sync_bytes(self) -> float:
    """The largest :meth:`wire_bytes` of one sync (the fragment with the embeddings and head)."""
    return max(self.wire_bytes(p) for p in range(len(self.parts)))

  def describe(self) -> str:
    """One line: workers, the schedule and what a sync costs."""
    m = self.method
    per_step = sum(self.wire_bytes(p) for p in range(len(self.parts))) / m.sync_every
    if m.sparse is not None:
      s = m.sparse
      slots = (
        f"k={s.topk} per {s.chunk}x{s.chunk} ({s.transform}), bits={s.bits}, decay={s.decay}, "
        f"{s.aggregate}, density={self.density():.4f}"
      )
    elif m.pairing is not None:
      slots = f"pairs from {m.pairing.count} matchings (seed {m.pairing.seed})"
    else:
      slots = (
        f"fragments={m.fragments} ({m.layout}), overlap={m.overlap_steps}, alpha={m.alpha}, "
        f"quantize={m.compressor.name}"
      )
    return (
      f"{m.name}: workers={self.num_workers} x {self.num_devices} devices, inner="
      f"{self.inner.plan.name}, H={m.sync_every}, {slots}; bytes/worker: peak sync "
      f"{self.peak_sync_bytes():,.0f}, per inner step {per_step:,.0f}"
    )

  def outer_row(self, metrics: dict) -> dict:
    """The outer-step fields of a call's (host) metrics, for a log line: per-worker values as their
    mean over workers, the bytes the sync sent per worker and the share of values it sent."""
    keys = ("outer_fragment", "outer_delta_norm", "outer_step_norm", "outer_pairing")
    row = {k: np.mean(np.asarray(metrics[k])).item() for k in keys if k in metrics}
    if "outer_fragment" in row:
      row["outer_fragment"] = p = int(row["outer_fragment"])
      row.update(sync_bytes_per_worker=self.wire_bytes(p), sent_density=self.density())
    if "outer_pairing" in row:
      row["outer_pairing"] = int(row["outer_pairing"])
    return row


def mesh_mismatch(saved: LocoState, mesh) -> str:
  """The one-line error for a checkpoint written on another ``workers x devices`` mesh."""
  m, d = saved.inner.w.shape[0], jax.tree.leaves(saved.inner.params)[0].shape[1]
  return (
    f"the checkpoint was written by {m} workers x {d} devices; this run has "
    f"{mesh.shape[REPLICA]} x {mesh.shape['data']}: resume with loco.workers={m} on {m * d} devices "
    "(workers hold their own parameters, so a LoCo run does not move to another mesh)"
  )


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
) -> LocoStep:
  """Builds the programs of a low-communication method over a ``('replica', 'data')`` mesh.

  Example::

    mesh = acco_jax.loco_step.worker_mesh(4)                # 4 workers of 2 devices on 8
    method = acco_jax.loco.diloco(sync_every=50)
    train = make_loco_step(loss_fn, acco_jax.zero1(optax.adamw(4e-4)), method, mesh,
                           num_microbatches=2, params=params)
    state = train.init(params)
    s = 0
    while s < total:
      n = train.plan(s, total).stages
      state, metrics = train.run(state, [next(batches) for _ in range(n)], s, total)
      s += n
    theta_g = train.params(state)

  Args:
    loss_fn: ``loss_fn(params, microbatch)`` (or ``(loss, aux)`` with ``has_aux``).
    inner_tx: the inner step, :func:`acco_jax.ddp` or :func:`acco_jax.zero1` of an optax optimizer.
    method: the outer method (:func:`acco_jax.loco.diloco`, ...).
    mesh: a mesh with axes ``('replica', 'data')`` (:func:`worker_mesh`).
    num_microbatches: ``k`` per device per inner step.
    params: the parameters or their ``ShapeDtypeStruct`` tree.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    skip_nonfinite: as :func:`acco_jax.make_train_step`.

  Returns:
    A :class:`LocoStep`.
  """
  return LocoStep(
    loss_fn, inner_tx, method, mesh, num_microbatches, params, has_aux, skip_nonfinite
  )
