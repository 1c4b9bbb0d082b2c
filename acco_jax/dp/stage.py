"""One data-parallel stage as traced code: the per-device blocks and their composition.

A step module: it owns the ``shard_map`` of every block and every collective over the data axis (its
timing probes are in :mod:`acco_jax.dp.probe`; the collectives between workers of the low-communication
methods are in :mod:`acco_jax.loco.replica`). :meth:`StageProgram.stage_fn` composes the blocks into the
function of one stage, which :class:`acco_jax.dp.step.TrainStep` jits into one XLA program per stage
kind. For a delayed method (ACCO, DPU, WP):

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
:mod:`acco_jax.dp.microbatch`. Whether XLA:GPU's scheduler then keeps each collective in flight across
its loop is checked on the compiled module (``python -m bench.gpu.overlap_gpu``, ``docs/benchmarks/dp.md``).

For a synchronous method (ZeRO-1, DDP) the same pieces run in the other order: loop, reduce, update,
gather. The optimizer step runs on the logical shards tree (see :mod:`acco_jax.dp.flat`) under GSPMD, so
``clip_by_global_norm`` and friends see global values; only the reduce-scatter, all-gather and the
all-reduce of DDP are explicit collectives.

The gradient of the loss is taken at weights cast to *varying* over the data axis
(:meth:`acco_jax.dp.microbatch.MicrobatchLoop.prepare`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from acco_jax.dp import methods, microbatch
from acco_jax.dp.flat import FlatLayout
from acco_jax.dp.microbatch import MicrobatchLoop
from acco_jax.dp.quantized_comm import QuantizedComm, all_gather_invariant


def _loop_a_size(k: int) -> int:
  """Microbatches in loop A of a delayed stage, ``ceil(k/2)``; loop B runs the rest."""
  return -(-k // 2)


class StageProgram:
  """The stage of one method: its blocks (each a ``shard_map`` over the data axis) and their order.

  Args:
    loss_fn, has_aux, num_microbatches, skip_nonfinite: as :func:`acco_jax.make_train_step`.
    tx: the method transform; plan: its :class:`acco_jax.dp.methods.CommPlan`.
    mesh: the mesh (axis types ``Auto``); layout: the flat parameter layout over the data axis.
    qcomm: the plan's :class:`acco_jax.dp.quantized_comm.QuantizedComm`.
    replica_axis: the worker axis of the low-communication methods, or ``None``.

  Attributes:
    keeps_residual: whether the state carries the residual of a quantized send (ZeRO-1 with
      quantized gradients and error feedback; ACCO keeps it in its buffer).
  """

  def __init__(
    self,
    loss_fn: Callable,
    tx,
    plan,
    mesh,
    layout: FlatLayout,
    qcomm: QuantizedComm,
    has_aux,
    num_microbatches,
    skip_nonfinite,
    replica_axis,
    global_clip: float | None = None,
  ):
    self.loss_fn, self.tx, self.plan, self.mesh, self.layout = loss_fn, tx, plan, mesh, layout
    self.has_aux, self.skip_nonfinite, self.replica_axis = has_aux, skip_nonfinite, replica_axis
    self.num_microbatches, self.global_clip = num_microbatches, global_clip
    self.num_replicas = mesh.shape[replica_axis] if replica_axis else 1
    self.comm_dtype = jnp.dtype(plan.comm_dtype)
    self.qcomm = qcomm
    self.quantized, self.quantized_reduce = qcomm.quantized, qcomm.reduce
    self.keeps_residual = qcomm.reduce and plan.error_feedback and not plan.delayed

  # -- the stage ----------------------------------------------------------------------------------

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

  def stage_fn(self, kind: str):
    """The function of one stage, ``(state, batch, counts) -> (state, metrics)`` on a
    :class:`acco_jax.dp.step.TrainState`.

    ``kind``: 'delayed' (overlapped), 'sync' (no delay) or 'fill' (accumulate only, no update).
    ``counts``: ``[N]`` per-device budgets (traced loop bounds), or ``None``: every device runs all
    ``k`` microbatches in loops of static trip count. The 'sync' and 'delayed' stages take an
    optional ``token`` (see :meth:`accumulate`; a delayed stage joins it with loop A) and then
    return it as a third result."""
    plan, k = self.plan, self.num_microbatches

    def stage(state, batch, counts, token=None):
      if plan.two_stage:
        committed, keep = methods.alternation(state.stage, plan.keep_after_commit)
      else:
        committed, keep = jnp.bool_(kind != "fill"), jnp.bool_(False)
      residual = state.residual
      if kind == "delayed":
        reduced = self.reduce(state.buf, state.buf_count)
        loop_a, reduced, *ride = self.first_loop(
          state.w, batch, counts, k, state.buf, state.buf_count, keep, reduced, token
        )
        params, opt_state, gnorm = self.update(reduced, state.opt_state, state.params)
        buf, buf_count, totals, w_next = self.second_loop(
          state.w, batch, counts, k, loop_a, self.new_rows(params, state.params)
        )
      else:
        acc, acc_count, totals, *ride = self.accumulate(state.w, batch, counts, k, token, residual)
        if kind == "fill":
          params, opt_state, w_next, gnorm = state.params, state.opt_state, state.w, jnp.float32(0)
          buf, buf_count = acc, acc_count
        else:
          g_rows, valid, rest = self.reduce(acc, acc_count)
          params, opt_state, gnorm = self.update((g_rows, valid), state.opt_state, state.params)
          w_next = self.gather(params, state.w, state.params)
          buf, buf_count = state.buf, state.buf_count
          residual = rest.astype(self.comm_dtype) if self.keeps_residual else None
      new = state._replace(
        w=w_next,
        params=params,
        opt_state=opt_state,
        buf=buf,
        buf_count=buf_count,
        stage=state.stage + 1,
        residual=residual,
      )
      out = (new, self._metrics(totals, gnorm, committed, state))
      return out if token is None else (*out, ride[0])

    return stage

  # -- the blocks (each a shard_map over the data axis) -------------------------------------------

  def spec(self, *axes) -> P:
    """A partition spec, with the worker axis in front when there is one."""
    return P(self.replica_axis, *axes) if self.replica_axis else P(*axes)

  def smap(self, local, in_specs, out_specs):
    """``shard_map`` of the per-device function ``local`` over the data axis.

    With workers (a replica axis), every argument and result carries a leading worker dimension
    sharded over that axis, which ``local`` does not see: each worker runs the same per-device
    program on its own block, and the collectives over the data axis stay inside a worker.
    """
    if self.replica_axis is None:
      return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
    prefix = lambda specs: jax.tree.map(
      lambda s: self.spec(*s), specs, is_leaf=lambda s: isinstance(s, P)
    )

    def per_worker(*args):
      out = local(*jax.tree.map(lambda x: x[0], args))
      return jax.tree.map(lambda x: x[None], out)

    return jax.shard_map(
      per_worker, mesh=self.mesh, in_specs=prefix(in_specs), out_specs=prefix(out_specs)
    )

  def loop(self, k) -> MicrobatchLoop:
    return MicrobatchLoop(
      self.loss_fn,
      self.has_aux,
      self.layout,
      self.comm_dtype,
      self.plan.axis_name,
      k,
      self.skip_nonfinite,
    )

  def _finish(self, loop, carry, count, n0):
    """The new buffer row and count, and the metrics summed over devices (one psum)."""
    row, row_count, totals = loop.finish(carry, count, n0)
    return row, row_count, lax.psum(totals, self.plan.axis_name)

  def accumulate(self, w, batch, counts, k, token=None, start=None):
    """Synchronous methods: each device sums the gradients of its first ``counts[i]`` microbatches
    (all ``k`` when ``counts`` is ``None``).

    Returns the per-device buffer ``[N, N*S]``, its counts ``[N]`` and the metrics summed over
    devices (one psum after the loop), and ``token`` after it if given. ``token``: a tree of
    ``[N, ...]`` arrays (sharded over the data axis) that an ``optimization_barrier`` joins with
    the loop's result: whatever produces it (a collective started before the stage) may finish
    during the loop, and must before the stage's own collectives start. ``start``: per-device
    ``[N, N*S]`` values the sums start from (the residual of a quantized send; no count).
    """
    loop = self.loop(k)

    def local(w_P, batch_local, count_1, start_1xP, *token_1):
      params_var, mbs = loop.prepare(w_P, batch_local)
      count = loop.count(count_1)
      carry, n0 = loop.start(params_var, mbs, rest_1xP=start_1xP)
      carry = loop.accumulate(params_var, mbs, 0, count, carry)
      if token_1:
        carry, token_1 = lax.optimization_barrier((carry, token_1))
      return (*self._finish(loop, carry, count, n0), *token_1)

    d = P(self.plan.axis_name)
    extra = () if token is None else (token,)
    specs = tuple(d for _ in extra)
    fn = self.smap(local, in_specs=(P(), d, d, d, *specs), out_specs=(d, d, P(), *specs))
    return fn(w, batch, counts, start, *extra)

  def first_loop(self, w, batch, counts, k, buf, buf_count, keep, reduced, token=None):
    """Delayed methods, loop A: microbatches ``[0, h)``, ``h = ceil(k/2)``, on top of ``buf``.

    An ``optimization_barrier`` joins the loop's result with ``reduced`` (the reduce-scatter's
    output), so the inner update, which reads ``reduced``, cannot be scheduled before this loop:
    the reduce-scatter is free to stay in flight across it (without the barrier XLA:GPU puts the
    update, hence the reduce-scatter's done, before the loop). ``token`` (as in :meth:`accumulate`:
    a collective started before the stage, e.g. a LoCo sync's reduction over workers) joins the
    same barrier. Returns the per-device loop carry (stacked ``[N, ...]``), ``reduced``, and
    ``token`` after them if given.
    """
    loop, h = self.loop(k), _loop_a_size(k)

    def local(
      w_P, batch_local, count_1, buf_1xP, buf_count_1, keep, g_1xS, valid, rest_1xP, *token_1
    ):
      params_var, mbs = loop.prepare(w_P, batch_local)
      count = loop.count(count_1)
      carry, n0 = loop.start(params_var, mbs, buf_1xP, buf_count_1, keep, rest_1xP)
      carry = loop.accumulate(params_var, mbs, 0, microbatch.loop_a_end(count, h), carry)
      if sharded:  # the barrier makes every output varying: keep invariant values out of it
        (carry, n0), g_1xS, token_1 = lax.optimization_barrier(((carry, n0), g_1xS, token_1))
      elif token_1:
        (carry, n0), token_1 = lax.optimization_barrier(((carry, n0), token_1))
      if self.quantized_reduce:  # the bytes received went through the barrier: decode them now
        g_1xS = self.qcomm.mean_of(g_1xS[0][0], g_1xS[1])[None]
      return jax.tree.map(lambda x: x[None], (carry, n0)), g_1xS, valid, *token_1

    d, sharded = P(self.plan.axis_name), self.plan.sharded
    g_spec = d if sharded else P()
    g_in = (d, P()) if self.quantized_reduce else g_spec
    extra = () if token is None else (token,)
    specs = (P(), d, d, d, d, P(), g_in, P(), d, *(d for _ in extra))
    fn = self.smap(local, in_specs=specs, out_specs=(d, g_spec, P(), *(d for _ in extra)))
    loop_a, g_rows, valid, *ride = fn(w, batch, counts, buf, buf_count, keep, *reduced, *extra)
    return (loop_a, (g_rows, valid), *ride)

  def second_loop(self, w, batch, counts, k, loop_a, rows):
    """Delayed methods, loop B: microbatches ``[h, counts[i])`` while the new weights all-gather.

    An ``optimization_barrier`` joins loop A's carry with ``rows`` (the updated ``[N, S]`` shards),
    so this loop cannot start before the update: the all-gather of ``rows`` runs during it (quantized:
    the rows are encoded before the barrier, so the all-gather's input exists when loop B starts;
    encoded after it, XLA:GPU ran the encoding and the all-gather after loop B). Returns
    the new buffer ``[N, N*S]``, its counts ``[N]``, metrics summed over devices and the gathered
    weights ``[N*S]``. ``rows``: see :meth:`new_rows`.
    """
    loop, h = self.loop(k), _loop_a_size(k)

    def local(w_P, batch_local, count_1, loop_a, rows_1xS):
      params_var, mbs = loop.prepare(w_P, batch_local)
      count = loop.count(count_1)
      rows_S = tuple(r[0] for r in rows_1xS)
      if self.quantized:  # encoded before the barrier: the all-gather's input is ready for loop B
        rows_S = (self.qcomm.encode_update(w_P, *rows_S),)
      (carry, n0), rows_S = lax.optimization_barrier((jax.tree.map(lambda x: x[0], loop_a), rows_S))
      if self.quantized:
        w_next = self.qcomm.apply_update(w_P, rows_S[0])
      else:
        w_next = all_gather_invariant(rows_S[0], self.plan.axis_name)
      carry = loop.accumulate(params_var, mbs, h, microbatch.loop_b_end(count, h), carry)
      return (*self._finish(loop, carry, count, n0), w_next)

    d = P(self.plan.axis_name)
    fn = self.smap(local, in_specs=(P(), d, d, d, d), out_specs=(d, d, P(), P()))
    return fn(w, batch, counts, loop_a, rows)

  def reduce(self, buf, buf_count):
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
    fn = self.smap(local, in_specs=(P(axis), P(axis)), out_specs=(rows, P(), P(axis)))
    return fn(buf, buf_count)

  def new_rows(self, params, old):
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

  def gather(self, params, w=None, old=None):
    """New compute weights ``[N*S]`` (replicated) from the optimizer's shards."""
    rows = self.new_rows(params, old)
    if not self.plan.sharded:
      return rows[0].reshape(*rows[0].shape[:-2], -1)
    d = P(self.plan.axis_name)
    local = lambda w_P, *r: self._gather_local(w_P, *(x[0] for x in r))
    fn = self.smap(local, in_specs=(P(), *(d for _ in rows)), out_specs=P())
    return fn(w, *rows)

  def update(self, reduced, opt_state, params):
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
    norm, update = optax.tree.norm(grads), self.tx.update
    if self.plan.sharded and self.plan.layout == "owner":  # each device's slots on their own;
      # a global-norm clip (acco_jax.optim.clip_by_global_norm) takes the whole tree's norm
      # (empty slots and padding are zeros: they add nothing to it); optax's, first in the chain,
      # is applied here to the whole gradient (dp/layouts.py): its per-slot copy does nothing
      if self.global_clip is not None:
        c = self.global_clip
        grads = jax.tree.map(lambda g: jnp.where(norm < c, g, g / norm * c), grads)
      one = lambda g, s, p: self.tx.update(g, s, p, global_norm=norm)
      update = jax.vmap(one, spmd_axis_name=self.plan.axis_name)
    updates, new_opt_state = update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), new_opt_state)
    if self.skip_nonfinite:
      new = jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, (params, opt_state))
    return *new, norm
