"""The jitted data-parallel stage: microbatch accumulation, collectives and the optimizer step.

This module owns every collective over the data axis (its timing probes are in :mod:`acco_jax.probe`;
the collectives between workers of the low-communication methods are in :mod:`acco_jax.replica`). One
call of :meth:`TrainStep.step` runs one *stage* of ``k`` microbatches per device as one XLA program.
For a delayed method (ACCO, DPU, WP):

.. code-block:: none

  acc     = buf if keep else 0                              # ACCO keeps g̃ after a commit
  g_rows  = reduce_scatter(buf) / psum(buf_count)        # previous stage's gradients  } run during
  acc    += Σ_{j < h} ∇loss(w, microbatch_j)                # loop A, at the *current* w   } loop A
  params' = params + tx.update(g_rows, opt_state, params)  # sharded inner step (GSPMD)
  w'      = all_gather(params')                             # next compute weights       } run during
  acc    += Σ_{h <= j < k_i} ∇loss(w, microbatch_j)         # loop B                      } loop B
  buf'    = acc;  metrics = psum(...)                       # one reduction after the loops

No collective depends on a loop and no loop on a collective. Two ``optimization_barrier`` s (each an
identity) place the update between the loops, so that each collective has a loop to hide behind:
one joins loop A's result with ``g_rows`` (the update cannot move before loop A, so the
reduce-scatter's done can sit after it) and one joins loop A's result with ``params'`` (loop B cannot
move before the update, so the all-gather can run during it). The per-device loops themselves are in
:mod:`acco_jax.microbatch`. Whether XLA:GPU's scheduler then keeps each collective in flight across
its loop is checked on the compiled module (``bench/overlap_gpu.py``, ``docs/benchmarks.md``).

For a synchronous method (ZeRO-1, DDP) the same pieces run in the other order: loop, reduce, update,
gather. The optimizer step runs on the logical shards tree (see :mod:`acco_jax.flat`) under GSPMD, so
``clip_by_global_norm`` and friends see global values; only the reduce-scatter, all-gather and the
all-reduce of DDP are explicit collectives.

The gradient of the loss is taken at weights cast to *varying* over the data axis
(:meth:`acco_jax.microbatch.MicrobatchLoop.prepare`).
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

from acco_jax import methods
from acco_jax.flat import FlatLayout
from acco_jax.microbatch import MicrobatchLoop
from acco_jax.quantized_comm import QuantizedComm, all_gather_invariant
from acco_jax.reshard import reshard_state

PyTree = Any


class TrainState(NamedTuple):
  """Everything a stage reads and writes (a pytree; checkpoint it whole).

  Attributes:
    w: ``[N*S]`` compute weights in ``comm_dtype``, replicated: θ or θ̃ as a flat buffer.
    params: the optimizer's view of the weights, a tree of ``[N, s_l]`` float32 shards, sharded over
      the data axis (replicated for DDP). For ACCO/WP this holds θ̃/θ̂; the committed θ is in the state.
    opt_state: the method transform's state over ``params``, sharded like it.
    buf: ``[N, N*S]`` per-device gradient sums waiting to be reduced (delayed methods), else ``None``.
    buf_count: ``[N]`` int32 microbatch counts of ``buf`` (delayed methods), else ``None``.
    stage: int32 number of stages run.
    residual: ``[N, N*S]`` per-device gradient values a quantized send did not deliver yet (ZeRO-1
      with quantized gradients and error feedback), else ``None``. ACCO keeps them in ``buf``.
  """

  w: jax.Array
  params: PyTree
  opt_state: PyTree
  buf: jax.Array | None
  buf_count: jax.Array | None
  stage: jax.Array
  residual: jax.Array | None = None


def _loop_a_size(k: int) -> int:
  """Microbatches in loop A of a delayed stage, ``ceil(k/2)``; loop B runs the rest."""
  return -(-k // 2)


class TrainStep:
  """A compiled data-parallel training step for one method. Build it with :func:`make_train_step`.

  Attributes:
    layout: the :class:`FlatLayout` of the parameters.
    plan: the method's :class:`acco_jax.acco.CommPlan`.
    mesh: the mesh the step runs on.
    num_microbatches: ``k``, microbatches per device per stage (the maximum when counts vary).
  """

  def __init__(
    self, loss_fn, tx, mesh, num_microbatches, has_aux, params_like, skip_nonfinite=False,
    replica_axis=None,
  ):  # fmt: skip
    self.plan = methods.comm_plan(tx)
    self.tx = tx
    axis = self.plan.axis_name
    if axis not in mesh.axis_names:
      raise ValueError(
        f"axis_name {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}; "
        f"build the mesh with an axis named {axis!r} or pass axis_name= to the method"
      )
    others = [a for a in mesh.axis_names if a not in (axis, replica_axis) and mesh.shape[a] > 1]
    if others:
      raise ValueError(f"only data parallelism over {axis!r} is supported; mesh axes {others} > 1")
    if replica_axis is not None and (self.plan.delayed or replica_axis not in mesh.axis_names):
      raise ValueError(
        f"workers over {replica_axis!r} need a synchronous inner method (ddp or zero1) and a mesh "
        f"with that axis; got {self.plan.name!r} on axes {tuple(mesh.axis_names)}"
      )
    self.replica_axis = replica_axis
    self.num_replicas = mesh.shape[replica_axis] if replica_axis else 1
    if num_microbatches < 1:
      raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    self.mesh = jax.sharding.Mesh(
      mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * mesh.devices.ndim
    )
    self.num_devices = self.mesh.shape[axis]
    self.num_microbatches = int(num_microbatches)
    self.loss_fn = loss_fn
    self.has_aux = has_aux
    self.skip_nonfinite = skip_nonfinite
    self.layout = FlatLayout(params_like, self.num_devices)
    self.comm_dtype = jnp.dtype(self.plan.comm_dtype)
    methods.check_elementwise(self.tx, self.plan, params_like, self.layout)
    self.qcomm = QuantizedComm(self.plan, self.num_devices, self.layout.shard_size, replica_axis)
    self.quantized, self.quantized_reduce = self.qcomm.quantized, self.qcomm.reduce
    self.keeps_residual = self.qcomm.reduce and self.plan.error_feedback and not self.plan.delayed
    self._sharding = functools.partial(NamedSharding, self.mesh)
    self._compiled = {}

  # -- shardings --------------------------------------------------------------------------------

  def _spec(self, *axes) -> P:
    """A partition spec, with the worker axis in front when there is one."""
    return P(self.replica_axis, *axes) if self.replica_axis else P(*axes)

  def leaf_sharding(self, x) -> NamedSharding:
    """Sharding of a state leaf: over the data axis if it is a ``[N, s]`` shard array and the method
    is ZeRO-1, else replicated (within a worker, with workers)."""
    lead = int(self.replica_axis is not None)
    if self.plan.sharded and x.ndim >= 2 + lead and x.shape[lead] == self.num_devices:
      return self._sharding(self._spec(self.plan.axis_name))
    return self._sharding(self._spec())

  def _state_sharding(self, state_shape: TrainState) -> TrainState:
    data, rep = self._sharding(self._spec(self.plan.axis_name)), self._sharding(self._spec())
    rule = self.leaf_sharding

    def buf_rule(x):
      return None if x is None else data

    return TrainState(
      w=rep,
      params=jax.tree.map(rule, state_shape.params),
      opt_state=jax.tree.map(rule, state_shape.opt_state),
      buf=buf_rule(state_shape.buf),
      buf_count=buf_rule(state_shape.buf_count),
      stage=rep,
      residual=buf_rule(state_shape.residual),
    )

  # -- building blocks (each a shard_map over the data axis) --------------------------------------

  def _smap(self, local, in_specs, out_specs):
    """``shard_map`` of the per-device function ``local`` over the data axis.

    With workers (a replica axis), every argument and result carries a leading worker dimension
    sharded over that axis, which ``local`` does not see: each worker runs the same per-device
    program on its own block, and the collectives over the data axis stay inside a worker.
    """
    if self.replica_axis is None:
      return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
    prefix = lambda specs: jax.tree.map(
      lambda s: self._spec(*s), specs, is_leaf=lambda s: isinstance(s, P)
    )

    def per_worker(*args):
      out = local(*jax.tree.map(lambda x: x[0], args))
      return jax.tree.map(lambda x: x[None], out)

    return jax.shard_map(
      per_worker, mesh=self.mesh, in_specs=prefix(in_specs), out_specs=prefix(out_specs)
    )

  def _loop(self, k) -> MicrobatchLoop:
    return MicrobatchLoop(
      self.loss_fn, self.has_aux, self.layout, self.comm_dtype, self.plan.axis_name, k,
      self.skip_nonfinite,
    )  # fmt: skip

  def _finish(self, loop, carry, count, n0):
    """The new buffer row and count, and the metrics summed over devices (one psum)."""
    row, row_count, totals = loop.finish(carry, count, n0)
    return row, row_count, lax.psum(totals, self.plan.axis_name)

  def _accumulate(self, w, batch, counts, k, token=None, start=None):
    """Synchronous methods: each device sums the gradients of its first ``counts[i]`` microbatches.

    Returns the per-device buffer ``[N, N*S]``, its counts ``[N]`` and the metrics summed over
    devices (one psum after the loop), and ``token`` after it if given. ``token``: a tree of
    ``[N, ...]`` arrays (sharded over the data axis) that an ``optimization_barrier`` joins with
    the loop's result: whatever produces it (a collective started before the stage) may finish
    during the loop, and must before the stage's own collectives start. ``start``: per-device
    ``[N, N*S]`` values the sums start from (the residual of a quantized send; no count).
    """
    loop = self._loop(k)

    def local(w_P, batch_local, count_1, start_1xP, *token_1):
      params_var, mbs = loop.prepare(w_P, batch_local)
      count = count_1[0]
      carry, n0 = loop.start(params_var, mbs, count, rest_1xP=start_1xP)
      carry = loop.run(params_var, mbs, 0, count, carry)
      if token_1:
        carry, token_1 = lax.optimization_barrier((carry, token_1))
      return (*self._finish(loop, carry, count, n0), *token_1)

    d = P(self.plan.axis_name)
    extra = () if token is None else (token,)
    specs = tuple(d for _ in extra)
    fn = self._smap(local, in_specs=(P(), d, d, d, *specs), out_specs=(d, d, P(), *specs))
    return fn(w, batch, counts, start, *extra)

  def _first_loop(self, w, batch, counts, k, buf, buf_count, keep, reduced):
    """Delayed methods, loop A: microbatches ``[0, h)``, ``h = ceil(k/2)``, on top of ``buf``.

    An ``optimization_barrier`` joins the loop's result with ``reduced`` (the reduce-scatter's
    output), so the inner update, which reads ``reduced``, cannot be scheduled before this loop:
    the reduce-scatter is free to stay in flight across it (without the barrier XLA:GPU puts the
    update, hence the reduce-scatter's done, before the loop). Returns the per-device loop carry
    (stacked ``[N, ...]``) and ``reduced``.
    """
    loop, h = self._loop(k), _loop_a_size(k)

    def local(w_P, batch_local, count_1, buf_1xP, buf_count_1, keep, g_1xS, valid, rest_1xP):
      params_var, mbs = loop.prepare(w_P, batch_local)
      count = count_1[0]
      carry, n0 = loop.start(params_var, mbs, count, buf_1xP, buf_count_1, keep, rest_1xP)
      carry = loop.run(params_var, mbs, 0, jnp.minimum(count, h), carry)
      if sharded:  # the barrier makes every output varying: keep invariant values out of it
        (carry, n0), g_1xS = lax.optimization_barrier(((carry, n0), g_1xS))
      if self.quantized_reduce:  # the bytes received went through the barrier: decode them now
        g_1xS = self.qcomm.mean_of(g_1xS[0][0], g_1xS[1])[None]
      return jax.tree.map(lambda x: x[None], (carry, n0)), g_1xS, valid

    d, sharded = P(self.plan.axis_name), self.plan.sharded
    g_spec = d if sharded else P()
    g_in = (d, P()) if self.quantized_reduce else g_spec
    specs = (P(), d, d, d, d, P(), g_in, P(), d)
    fn = self._smap(local, in_specs=specs, out_specs=(d, g_spec, P()))
    loop_a, g_rows, valid = fn(w, batch, counts, buf, buf_count, keep, *reduced)
    return loop_a, (g_rows, valid)

  def _second_loop(self, w, batch, counts, k, loop_a, rows):
    """Delayed methods, loop B: microbatches ``[h, counts[i])`` while the new weights all-gather.

    An ``optimization_barrier`` joins loop A's carry with ``rows`` (the updated ``[N, S]`` shards),
    so this loop cannot start before the update: the all-gather of ``rows`` runs during it (quantized:
    the rows are encoded before the barrier, so the all-gather's input exists when loop B starts;
    encoded after it, XLA:GPU ran the encoding and the all-gather after loop B). Returns
    the new buffer ``[N, N*S]``, its counts ``[N]``, metrics summed over devices and the gathered
    weights ``[N*S]``. ``rows``: see :meth:`_new_rows`.
    """
    loop, h = self._loop(k), _loop_a_size(k)

    def local(w_P, batch_local, count_1, loop_a, rows_1xS):
      params_var, mbs = loop.prepare(w_P, batch_local)
      count = count_1[0]
      rows_S = tuple(r[0] for r in rows_1xS)
      if self.quantized:  # encoded before the barrier: the all-gather's input is ready for loop B
        rows_S = (self.qcomm.encode_update(w_P, *rows_S),)
      (carry, n0), rows_S = lax.optimization_barrier((jax.tree.map(lambda x: x[0], loop_a), rows_S))
      if self.quantized:
        w_next = self.qcomm.apply_update(w_P, rows_S[0])
      else:
        w_next = all_gather_invariant(rows_S[0], self.plan.axis_name)
      carry = loop.run(params_var, mbs, h, jnp.maximum(count, h), carry)
      return (*self._finish(loop, carry, count, n0), w_next)

    d = P(self.plan.axis_name)
    fn = self._smap(local, in_specs=(P(), d, d, d, d), out_specs=(d, d, P(), P()))
    return fn(w, batch, counts, loop_a, rows)

  def _reduce(self, buf, buf_count):
    """Reduce per-device gradient sums to the mean gradient as ``[N, S]`` rows (sharded if ZeRO-1).

    Returns ``(rows, valid, rest)``: ``rest`` is ``[N, N*S]``, what each device's quantized send
    did not deliver (error feedback; all of it when no device had a microbatch), else ``None``.
    Quantized and delayed, ``rows`` is ``(bytes received, count)``, decoded after loop A.
    """
    axis, layout, late = self.plan.axis_name, self.layout, self.plan.delayed

    def local(buf_1xP, count_1):
      count = lax.psum(count_1[0], axis)
      total = jnp.maximum(count, 1).astype(jnp.float32)
      flat = buf_1xP[0].astype(self.comm_dtype)
      if self.quantized_reduce:
        got, rest = self.qcomm.exchange(flat)
        if rest is not None:
          rest = jnp.where(count > 0, rest, flat.astype(jnp.float32))[None]
        return (got[None], total) if late else self.qcomm.mean_of(got, total)[None], count > 0, rest
      if self.plan.sharded:
        g_S = lax.psum_scatter(flat, axis, scatter_dimension=0, tiled=True)
        return (g_S.astype(jnp.float32) / total)[None], count > 0, None
      g_P = lax.psum(flat, axis)
      g = (g_P.astype(jnp.float32) / total).reshape(layout.num_shards, layout.shard_size)
      return g, count > 0, None

    rows = (
      (P(axis), P()) if self.quantized_reduce and late else P(axis) if self.plan.sharded else P()
    )
    fn = self._smap(local, in_specs=(P(axis), P(axis)), out_specs=(rows, P(), P(axis)))
    return fn(buf, buf_count)

  def _new_rows(self, params, old):
    """What the all-gather of the new weights needs: ``(rows,)`` ``[N, S]`` in ``comm_dtype``, or,
    quantized, float32 rows (and the previous ones without error feedback)."""
    rows = self.layout.shards_to_rows(params)
    if not self.quantized:
      return (rows.astype(self.comm_dtype),)
    if self.plan.error_feedback:
      return (rows,)
    return rows, self.layout.shards_to_rows(old)

  def _gather_local(self, w_P, rows_S, old_S=None):
    """Per device, new compute weights ``[N*S]`` (invariant) from its new shard ``rows_S``."""
    if not self.quantized:
      return all_gather_invariant(rows_S, self.plan.axis_name)
    return self.qcomm.gather(w_P, rows_S, old_S)

  def _gather(self, params, w=None, old=None):
    """New compute weights ``[N*S]`` (replicated) from the optimizer's shards."""
    rows = self._new_rows(params, old)
    if not self.plan.sharded:
      return rows[0].reshape(*rows[0].shape[:-2], -1)
    d = P(self.plan.axis_name)
    local = lambda w_P, *r: self._gather_local(w_P, *(x[0] for x in r))
    fn = self._smap(local, in_specs=(P(), *(d for _ in rows)), out_specs=P())
    return fn(w, *rows)

  def _update(self, reduced, opt_state, params):
    """Inner step on the mean gradient; a stage whose microbatches were all skipped changes nothing.

    With workers, each worker updates its own parameters and state (``vmap`` over the worker
    dimension: a global-norm clip is per worker).
    """
    if self.replica_axis is None:
      return self._update_one(reduced, opt_state, params)
    if self.num_replicas == 1:  # the very same program as without workers
      out = self._update_one(*jax.tree.map(lambda x: x[0], (reduced, opt_state, params)))
      return jax.tree.map(lambda x: x[None], out)
    one = jax.vmap(self._update_one, spmd_axis_name=self.replica_axis)
    return one(reduced, opt_state, params)

  def _update_one(self, reduced, opt_state, params):
    g_rows, valid = reduced
    grads = self.layout.rows_to_shards(g_rows)
    updates, new_opt_state = self.tx.update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), new_opt_state)
    if self.skip_nonfinite:
      new = jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, (params, opt_state))
    return *new, optax.tree.norm(grads)

  # -- programs -----------------------------------------------------------------------------------

  def _metrics(self, totals, grad_norm, committed, state):
    n = totals["microbatches"]
    out = {
      "loss": totals["loss_sum"] / n,
      "microbatches": n,
      "grad_norm": grad_norm,
      "committed": committed,
      "stage": state.stage,
      "skipped": totals["skipped"],
    }
    out.update(totals["aux"])
    return out

  def _stage_fn(self, kind: str):
    """``kind``: 'delayed' (overlapped), 'sync' (no delay) or 'fill' (accumulate only, no update).

    The 'sync' stage takes an optional ``token`` (see :meth:`_accumulate`) and then returns it as
    a third result."""
    plan, k = self.plan, self.num_microbatches

    def stage(state: TrainState, batch, counts, token=None):
      if plan.two_stage:
        committed = state.stage % 2 == 1
        keep = state.stage % 2 == 0 if plan.keep_after_commit else jnp.bool_(False)
      else:
        committed, keep = jnp.bool_(kind != "fill"), jnp.bool_(False)
      residual = state.residual
      if kind == "delayed":
        reduced = self._reduce(state.buf, state.buf_count)
        loop_a, reduced = self._first_loop(
          state.w, batch, counts, k, state.buf, state.buf_count, keep, reduced
        )
        params, opt_state, gnorm = self._update(reduced, state.opt_state, state.params)
        buf, buf_count, totals, w_next = self._second_loop(
          state.w, batch, counts, k, loop_a, self._new_rows(params, state.params)
        )
      else:
        acc, acc_count, totals, *ride = self._accumulate(state.w, batch, counts, k, token, residual)
        if kind == "fill":
          params, opt_state, w_next, gnorm = state.params, state.opt_state, state.w, jnp.float32(0)
          buf, buf_count = acc, acc_count
        else:
          g_rows, valid, rest = self._reduce(acc, acc_count)
          params, opt_state, gnorm = self._update((g_rows, valid), state.opt_state, state.params)
          w_next = self._gather(params, state.w, state.params)
          buf, buf_count = state.buf, state.buf_count
          residual = rest.astype(self.comm_dtype) if self.keeps_residual else None
      new = TrainState(w_next, params, opt_state, buf, buf_count, state.stage + 1, residual)
      out = (new, self._metrics(totals, gnorm, committed, state))
      return out if token is None else (*out, ride[0])

    return stage

  def _zeros_buf(self):
    return jnp.zeros((self.num_devices, self.layout.padded_size), self.comm_dtype)

  def _zeros_count(self):
    return jnp.zeros((self.num_devices,), jnp.int32)

  def _jit(self, kind: str, state_like):
    """The jitted stage program for ``kind`` and the state's structure (``buf`` present or not).

    ``state_like``: a state or its ``ShapeDtypeStruct`` tree; shardings are built only on a miss.
    """
    key = (kind, jax.tree.structure(state_like))
    if key not in self._compiled:
      state_sharding = self._state_sharding(state_like)
      data = self._sharding(P(self.plan.axis_name))
      self._compiled[key] = jax.jit(
        self._stage_fn(kind),
        in_shardings=(state_sharding, data, data),
        out_shardings=(state_sharding, self._sharding(P())),
        donate_argnums=(0,),
      )
    return self._compiled[key]

  # -- public API ---------------------------------------------------------------------------------

  def _build(self, params: PyTree) -> TrainState:
    layout, plan = self.layout, self.plan
    shards = layout.to_shards(params, jnp.float32)
    return TrainState(
      w=layout.ravel(params, self.comm_dtype),
      params=shards,
      opt_state=self.tx.init(shards),
      buf=self._zeros_buf() if plan.delayed else None,
      buf_count=self._zeros_count() if plan.delayed else None,
      stage=jnp.zeros((), jnp.int32),
      residual=self._zeros_buf() if self.keeps_residual else None,
    )

  def abstract_state(self, params: PyTree) -> TrainState:
    """``jax.ShapeDtypeStruct`` tree of the state, with shardings (a checkpoint restore target)."""
    shapes = jax.eval_shape(self._build, params)
    shardings = self._state_sharding(shapes)
    return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )

  def init(self, params: PyTree, microbatch: PyTree | None = None) -> TrainState:
    """Builds the sharded train state from float32 parameters (original shapes).

    Delayed methods (ACCO, DPU without warm-up, WP) start with one microbatch gradient at θ_0 per
    device in the buffer (the paper's initial condition); pass that ``microbatch`` (leading dim
    ``N * B``, one microbatch per device).
    """
    plan = self.plan
    sharding = jax.tree.map(lambda s: s.sharding, self.abstract_state(params))
    state = jax.jit(self._build, out_shardings=sharding)(params)
    if plan.delayed and plan.warmup_steps == 0:
      if microbatch is None:
        raise ValueError(
          f"{plan.name} starts from one microbatch gradient at the initial weights: call "
          f"init(params, microbatch) with one microbatch per device (leading dim {self.num_devices}*B)"
        )
      state = self.prime(state, microbatch)
    return state

  def prime(self, state: TrainState, microbatch: PyTree) -> TrainState:
    """Fills the buffer with one microbatch gradient per device at the current weights."""
    batch = self._put_batch(microbatch, per_device=1)
    counts = self._put_counts(None, k=1)
    if "prime" not in self._compiled:

      def prime(state, batch, counts):
        buf, count, _ = self._accumulate(state.w, batch, counts, 1)
        return state._replace(buf=buf, buf_count=count)

      self._compiled["prime"] = jax.jit(prime, donate_argnums=(0,))
    return self._compiled["prime"](state, batch, counts)

  def step(self, state: TrainState, batch: PyTree, counts=None) -> tuple[TrainState, dict]:
    """Runs one stage; returns the new state (the input is donated) and replicated metrics.

    Args:
      state: the current :class:`TrainState`.
      batch: pytree of arrays with leading dim ``N * k * B`` (device-major: device ``i`` takes the
        ``i``-th contiguous block, split into ``k`` microbatches of ``B``).
      counts: optional ``[N]`` int microbatches per device this stage (``1 <= counts[i] <= k``);
        device ``i`` uses the first ``counts[i]`` microbatches of its block. Default: ``k`` each.

    Returns:
      ``(state, metrics)``; metrics: ``loss`` (mean over this stage's microbatches), ``microbatches``
      (summed over devices), ``grad_norm`` (of the mean gradient applied this stage), ``committed``,
      ``stage``, ``skipped`` (microbatches dropped as non-finite), plus the summed aux values of
      ``loss_fn``.
    """
    plan = self.plan
    kind = "delayed" if plan.delayed else "sync"
    if plan.warmup_steps:
      stage = int(jax.device_get(state.stage))
      kind = "sync" if stage < plan.warmup_steps else "fill" if stage == plan.warmup_steps else kind
    batch = self._put_batch(batch, per_device=self.num_microbatches)
    counts = self._put_counts(counts, k=self.num_microbatches)
    return self._jit(kind, state)(state, batch, counts)

  def params(self, state: TrainState) -> PyTree:
    """The committed parameters θ as a float32 pytree of the original shapes (replicated)."""
    fn = lambda s: self.layout.from_shards(methods.committed_params(s.opt_state, s.params))
    return jax.jit(fn, out_shardings=self._sharding(P()))(state)

  def replicated(self, x):
    """A copy of every array of ``x`` on every device (readable on every process)."""
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self._sharding(P()))
    return copy(x)

  def compute_params(self, state: TrainState) -> PyTree:
    """The weights the next stage computes at (θ̃ after an ACCO estimate), in ``comm_dtype``."""
    fn = lambda w: self.layout.unravel(w, self.comm_dtype)
    return jax.jit(fn, out_shardings=self._sharding(P()))(state.w)

  # -- elastic restore ----------------------------------------------------------------------------

  def reshard(self, saved: TrainState) -> TrainState:
    """A state saved on another device count (host numpy leaves) -> numpy leaves for this step.

    Pass it as ``reshard=`` to :meth:`acco_jax.checkpoint.Checkpointer.restore`; weights and
    optimizer state move bit for bit, the gradient buffers keep their sums over devices (see
    :mod:`acco_jax.reshard`).
    """
    return reshard_state(saved, self.layout, self.tx)

  # -- input placement ----------------------------------------------------------------------------

  def _put_batch(self, batch, per_device: int):
    n = self.num_devices
    for x in jax.tree.leaves(batch):
      if x.ndim < 1 or x.shape[0] % (n * per_device):
        raise ValueError(
          f"batch leading dim {x.shape[0] if x.ndim else 'scalar'} is not divisible by devices x "
          f"microbatches = {n} x {per_device}; use a global batch of {n}*{per_device}*B rows"
        )
    sharding = self._sharding(P(self.plan.axis_name))
    return jax.tree.map(
      lambda x: x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding),
      batch,
    )

  def _put_counts(self, counts, k: int):
    if isinstance(counts, jax.Array):
      return counts
    counts = np.full((self.num_devices,), k, np.int32) if counts is None else np.asarray(counts)
    if counts.shape != (self.num_devices,) or counts.min() < 1 or counts.max() > k:
      raise ValueError(
        f"counts must be {self.num_devices} ints in [1, {k}] (microbatches per device), got {counts}"
      )
    # placed once per distinct value: re-placing host data every stage is a cross-process check
    key = ("counts", k, tuple(int(c) for c in counts))
    if key not in self._compiled:
      counts = counts.astype(np.int32)
      self._compiled[key] = jax.device_put(counts, self._sharding(P(self.plan.axis_name)))
    return self._compiled[key]

  # -- timing probes (heterogeneous budgets, slow-worker detection) -------------------------------

  def probe(self, state: TrainState, batch: PyTree, repeats: int = 2) -> tuple[float, float]:
    """Seconds per microbatch on this process's devices and of one stage's communication
    (:func:`acco_jax.probe.probe`)."""
    from acco_jax.probe import probe

    return probe(self, state, batch, repeats)


def make_train_step(
  loss_fn: Callable,
  tx,
  mesh: jax.sharding.Mesh,
  *,
  num_microbatches: int,
  params: PyTree,
  has_aux: bool = False,
  skip_nonfinite: bool = False,
) -> TrainStep:
  """Builds the data-parallel training step of a method.

  Example::

    tx = acco_jax.acco(optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=4, params=params)
    state = train.init(params, first_microbatch)
    for batch in batches:
      state, metrics = train.step(state, batch)
    final = train.params(state)

  Args:
    loss_fn: ``loss_fn(params, microbatch) -> loss`` (or ``(loss, aux)`` with ``has_aux``): the mean
      loss of one microbatch; aux is a dict of scalars summed over microbatches and devices.
      ``params`` arrive in the method's ``comm_dtype``.
    tx: a method transform (:func:`acco_jax.acco`, ``ddp``, ``zero1``, ``dpu``, ``wp``).
    mesh: a mesh with the method's data axis (other axes must have size 1).
    num_microbatches: ``k``, microbatches per device per stage. An ACCO update spans two stages
      (``2k`` microbatches per device); the others update every stage.
    params: the parameters, or a tree of ``jax.ShapeDtypeStruct`` with their shapes.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    skip_nonfinite: drop every microbatch whose loss or gradient is not finite (its gradient and
      its count), so buffers and ACCO's accumulator stay finite and the mean is over the good
      microbatches; a stage with no good microbatch anywhere leaves weights and optimizer state
      unchanged. Off by default (a non-finite loss then shows in the metrics).

  Returns:
    A :class:`TrainStep` with ``init``, ``step``, ``params`` and ``compute_params``.
  """
  return TrainStep(loss_fn, tx, mesh, num_microbatches, has_aux, params, skip_nonfinite)
