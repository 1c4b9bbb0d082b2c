"""The jitted programs of a :class:`acco_jax.loco.step.LocoStep`, and the syncs without all-reduce.

A step module with no collective of its own: those between workers are :mod:`acco_jax.loco.replica`'s,
those of the inner step over the data axis :mod:`acco_jax.dp.stage`'s. Programs, each one jitted XLA
program (``s`` = inner steps done, see :meth:`acco_jax.loco.step.LocoStep.plan`), built by
:func:`build`:

.. code-block:: none

  stage      one inner step on every worker (k microbatches, the inner update)
  sync p     Δ = θ_g − θ_m on fragment p; compress; all-reduce mean over workers;     (τ = 0)
             θ_g[p] ← outer(Δ̄); θ_m[p] ← α θ_m[p] + (1 − α) θ_g[p]
  window p   Δ snapshot of fragment p; compress; all-reduce mean  } no data dependence:   (τ > 0)
             τ inner steps on every worker                         } in flight together
             the mean goes to the state (in flight)
  apply p    θ_g[p] ← outer(in-flight mean); α-merge into the θ_m of now (τ steps later)

How a sync moves data between workers is the method's aggregator (:mod:`acco_jax.loco.replica`): an
all-reduce mean, or, through :func:`exchange`, a collective-permute with one peer or an all-gather
of packed sparse bytes. No program but a sync or a window moves data between workers; their metrics
stay per worker (``[M]``, sharded over ``replica``).

A window's reduction and its ``τ`` inner steps are one program, with an ``optimization_barrier``
that makes the loop wait for the payload (not for the reduction): on a GPU the all-reduce can stay
in flight across the loop (``python -m bench.gpu.overlap_gpu --loco``). The apply runs at the start of the
next call, so a checkpoint taken between the two holds a fragment in flight.

The syncs that do not all-reduce, NoLoCo's pair exchange and SparseLoCo's and DeMo's sparse gather:
:func:`exchange` returns what the outer update of every worker takes (its own pseudo-gradient or the
workers' mean), and the outer update and the merge then run as for DiLoCo. The math is in the pure
method files (:mod:`acco_jax.loco.noloco`, :mod:`~acco_jax.loco.sparseloco`,
:mod:`~acco_jax.loco.demo`) and :mod:`acco_jax.loco.compress`; the data movement in
:mod:`acco_jax.loco.replica`:

.. code-block:: none

  pairs    g_i = consensus_gradient((Δ_i + Δ_j)/2, φ_i, (φ_i + φ_j)/2)    one collective-permute of
           j = matchings[pairing_index(seed, sync), i]                     [Δ | φ] (float32)
  sparse   e_i ← β e_i + c_t x_i; wire_i, ê_i = top-k(e_i); e_i -= ê_i    one all-gather of the
           mean = scatter-mean over workers of decode(wire_j)              packed bytes
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from acco_jax.dp import methods
from acco_jax.loco import base
from acco_jax.loco.compress import sparse as sparse_lib
from acco_jax.loco.demo import kept_gradient
from acco_jax.loco.noloco import consensus_gradient, matchings, pairing_index
from acco_jax.loco.replica import REPLICA

PyTree = Any


def make_codec(method: base.LocoMethod, layout) -> sparse_lib.SparseCodec | None:
  """The :class:`~acco_jax.loco.compress.SparseCodec` of a sparse method over ``layout``'s shard
  rows (chunks cut per device), else None."""
  s = method.sparse
  if s is None:
    return None
  plans = tuple(
    sparse_lib.plan_chunks(spec.shape, layout.num_shards, chunk=s.chunk, topk=s.topk, rule=s.rule)
    for spec in layout.specs
  )
  return sparse_lib.SparseCodec(plans, s.transform, s.bits, s.aggregate)


def make_matchings(method: base.LocoMethod, workers: int) -> np.ndarray | None:
  """NoLoCo's ``[K, M]`` static matchings (``ValueError`` for an odd number of workers)."""
  p = method.pairing
  return None if p is None else matchings(workers, p.count, p.seed)


def finite_per_worker(tree: PyTree) -> jax.Array:
  """``[M]`` bool: whether each worker's leaves are all finite (no data crosses workers)."""
  flags = [jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(flags), axis=0)


# -- the programs ----------------------------------------------------------------------------------


def _per_worker_batch(step, batch):
  m = step.num_workers
  return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)


def inner_step(step, inner, batch, token=None):
  """One inner step of every worker (:meth:`acco_jax.dp.stage.StageProgram.stage_fn`): all ``k``
  microbatches on every device, in loops of static trip count.

  ``ddp``/``zero1``: one 'sync' stage. ``acco``: one ACCO update, its estimate stage on the first
  ``k/2`` microbatches of each device's rows and its commit stage on the others (so ``H`` counts
  ACCO updates); ``token`` joins the estimate stage's first loop. Returns ``(inner, metrics)``, and
  ``token`` after them if given.
  """
  program, batch = step.inner.program, _per_worker_batch(step, batch)
  if not program.plan.delayed:
    return program.stage_fn("sync")(inner, batch, None, token)
  delayed = program.stage_fn("delayed")
  first, second = _halves(step, batch)
  inner, estimate, *ride = delayed(inner, first, None, token)
  inner, commit = delayed(inner, second, None)
  return (inner, round_metrics(estimate, commit), *ride)


def _halves(step, batch):
  """Each device's rows ``[M, D*k*B, ...]`` cut into its first and last ``k/2`` microbatches."""
  d = step.num_devices

  def half(x, i):
    rows = x.reshape(x.shape[0], d, 2, x.shape[1] // (2 * d), *x.shape[2:])[:, :, i]
    return rows.reshape(x.shape[0], x.shape[1] // 2, *x.shape[2:])

  return jax.tree.map(lambda x: half(x, 0), batch), jax.tree.map(lambda x: half(x, 1), batch)


def round_metrics(estimate: dict, commit: dict) -> dict:
  """The metrics of an ACCO update from its two stages': counts and sums added, the loss the mean
  over both stages' microbatches, the rest (gradient norm, committed, stage) the commit's."""
  n = estimate["microbatches"] + commit["microbatches"]
  summed = {
    k: estimate[k] + v
    for k, v in commit.items()
    if k not in ("loss", "grad_norm", "committed", "stage")
  }
  both = estimate["loss"] * estimate["microbatches"] + commit["loss"] * commit["microbatches"]
  return {**commit, **summed, "loss": both / jnp.maximum(n, 1)}


def worker_params(state) -> PyTree:
  """Each worker's committed ``θ_m``: the inner step's parameters, or under ACCO the commit's (an
  estimate's are held only between its two stages)."""
  return methods.committed_params(state.inner.opt_state, state.inner.params)


def set_worker_params(step, state, params):
  """``θ_m ← params`` on every worker: the inner step's parameters, ACCO's committed copy (its next
  estimate starts there) and the compute weights. ACCO's gradient buffer is kept (docs/design.md,
  "ACCO inside the workers")."""
  inner = state.inner
  inner = inner._replace(
    params=params,
    opt_state=methods.with_committed(inner.opt_state, params),
    w=step.inner.program.gather(params),
  )
  return state._replace(inner=inner)


def send(step, state, p: int, ref=None):
  """Fragment ``p``'s pseudo-gradient, compressed, and its mean over workers (all-reduce).

  The pseudo-gradient is measured from ``ref`` (fragment ``p``'s view of each worker's start
  point; default ``θ_g``). Returns the payload, the mean as one ``[M, D, n_p]`` buffer (the
  fragment's shards end to end: one all-reduce, and one value for the window's barrier to hold)
  and whether all was finite.
  """
  payload, flat, finite = mean_encode(step, state, p, ref)
  return payload, step.comm.mean(flat), finite


def mean_encode(step, state, p: int, ref=None):
  """What a worker of an all-reduce method sends for fragment ``p`` (the collective's and the
  store's): its pseudo-gradient from ``ref`` (default ``θ_g``) through the compressor's round
  trip. Returns ``(payload view, the view as one [M, D, n_p] buffer, whether it was finite)``."""
  idx = step.parts[p]
  ref = base.select(state.outer.params, idx) if ref is None else ref
  delta = base.pseudo_gradient(ref, base.select(worker_params(state), idx))
  payload = {k: step.method.compressor.roundtrip(v)[0] for k, v in delta.items()}
  return payload, concat([payload[k] for k in fragment_keys(idx)]), finite_per_worker(payload)


def fragment_keys(idx) -> list[str]:
  """The keys of a fragment's view (:func:`acco_jax.loco.base.select`) in leaf order."""
  return [f"{i:04d}" for i in idx]


def concat(leaves: list) -> jax.Array:
  """Per-worker shards ``[M, D, ...]`` end to end as one ``[M, D, n]`` buffer (each leaf's trailing
  dims raveled: a flat chunk, or an owned matrix of the owner layout)."""
  return jnp.concatenate([x.reshape(*x.shape[:2], -1) for x in leaves], axis=-1)


def split(step, p: int, flat) -> dict:
  """A fragment's ``[M, D, n_p]`` buffer back into its view (:func:`acco_jax.loco.base.select`)."""
  out, start = {}, 0
  for i in step.parts[p]:
    shape = step.shard_shapes[i]
    size = math.prod(shape)
    out[f"{i:04d}"] = flat[..., start : start + size].reshape(*flat.shape[:-1], *shape)
    start += size
  return out


def apply_outer(step, state, p: int, mean: dict):
  """Outer update of fragment ``p`` on every worker, α-merge into ``θ_m``, new compute weights.

  Returns ``(state, metrics)``.
  """
  update = functools.partial(base.outer_update, step.method, fragment=p, parts=step.parts)
  outer, new_g = jax.vmap(update, spmd_axis_name=REPLICA)(state.outer, mean)
  idx = step.parts[p]
  theta = worker_params(state)
  local = base.merge(base.select(theta, idx), new_g, step.method.alpha)
  state = set_worker_params(step, state, base.replace(theta, local))
  outer_step = base.pseudo_gradient(base.select(state.outer.params, idx), new_g)
  norm = jax.vmap(optax.tree.norm)  # per worker: no metric moves data between workers
  metrics = {
    "outer_delta_norm": norm(mean),
    "outer_step_norm": norm(outer_step),
    "outer_fragment": jnp.int32(p),
  }
  return state._replace(outer=outer), metrics


def build(step, kind: str, p: int | None, sharding):
  """The jitted program ``kind`` ('stage', 'window', 'sync' or 'apply') of fragment ``p``.

  ``sharding``: the :class:`acco_jax.loco.step.LocoState` shardings (the state is donated).
  """
  tau = step.method.overlap_steps

  def sync(state):
    if step.method.aggregate == "mean":
      _, mean, finite = send(step, state, p)
      state, mean, extra = state, split(step, p, mean), {"outer_finite": finite}
    else:
      state, mean, extra = exchange(step, state, p)
    state, metrics = apply_outer(step, state, p, mean)
    return state, {**metrics, **extra}

  def apply(state):
    mean = base.select(state.inflight, step.parts[p])
    state, metrics = apply_outer(step, state, p, mean)
    cleared = jax.tree.map(jnp.zeros_like, state.inflight)
    return state._replace(inflight=cleared, inflight_fragment=jnp.int32(-1)), metrics

  def stage(state, batch):
    inner, metrics = inner_step(step, state.inner, batch)
    return state._replace(inner=inner, step=state.step + 1), metrics

  def window(state, batches):
    payload, mean, finite = send(step, state, p)
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
      return inner_step(step, inner, batch)

    *first, mean = inner_step(step, inner, jax.tree.map(lambda x: x[0], stacked), mean)
    inner, metrics = lax.fori_loop(1, tau, body, tuple(first)) if tau > 1 else first
    zeros = jax.tree.map(jnp.zeros_like, state.inflight)
    inflight = base.replace(zeros, split(step, p, mean))
    state = state._replace(
      inner=inner, inflight=inflight, inflight_fragment=jnp.int32(p), step=state.step + tau
    )
    return state, {**metrics, "outer_finite": finite}

  metric_sharding = None  # as computed: per-worker metrics stay on their workers
  if kind in ("sync", "apply"):
    fn = {"sync": sync, "apply": apply}[kind]
    return jax.jit(
      fn, in_shardings=(sharding,), out_shardings=(sharding, metric_sharding), donate_argnums=(0,)
    )
  fn = {"stage": stage, "window": window}[kind]
  return jax.jit(
    fn,
    in_shardings=(sharding, step.batch_sharding()),
    out_shardings=(sharding, metric_sharding),
    donate_argnums=(0,),
  )


# -- the syncs that do not all-reduce --------------------------------------------------------------


def payload(step, state, idx, ref=None) -> dict:
  """The view of what a worker sends: ``Δ = θ_g − θ_m`` (or ``ref − θ_m``, ``ref`` a view of the
  worker's start point), or the gradient its inner step kept."""
  if step.method.payload == "gradient":
    return base.select(kept_gradient(state.inner.opt_state), idx)
  ref = base.select(state.outer.params, idx) if ref is None else ref
  return base.pseudo_gradient(ref, base.select(worker_params(state), idx))


def sync_index(step, state) -> jax.Array:
  """The index of the sync running now (0 for the first): after ``s`` inner steps, ``s/H − 1``."""
  return state.step // step.method.sync_every - 1


def exchange(step, state, p: int, ref=None):
  """Returns ``(state, the outer update's input view per worker, metrics)`` for fragment ``p``
  (``ref``: as :func:`payload`, sparse methods only)."""
  if step.method.aggregate == "pairs":
    return _pairs(step, state, p)
  return _sparse(step, state, p, ref)


def _pairs(step, state, p):
  pairing = step.method.pairing
  which = pairing_index(pairing.seed, sync_index(step, state), pairing.count)
  wire, finite = pairs_encode(step, state, p)
  theirs = step.comm.partner(wire, step.matchings, which)
  grad = pairs_decode(step, state, p, theirs)
  return state, grad, {"outer_finite": finite, "outer_pairing": which}


def _sparse(step, state, p, ref=None):
  idx = step.parts[p]
  x = payload(step, state, idx, ref)
  keys = fragment_keys(idx)
  encode = functools.partial(sparse_encode, step, keys)
  decode = functools.partial(sparse_decode, step, keys)
  t = sync_index(step, state)
  kept, mean = step.comm.gather(encode, decode, (x, base.select(state.comp, idx)), (t,))
  state = state._replace(comp=base.replace(state.comp, kept))
  return state, mean, {"outer_finite": finite_per_worker(x)}


# -- each method's encode and decode: the collective's (above) and the store's -------------------
# (acco_jax.loco.transport) call these, so that a formula exists once


def pairs_encode(step, state, p: int):
  """NoLoCo's payload of fragment ``p``: ``[Δ | φ]`` end to end per worker (``[M, D, 2 n_p]``,
  what its peer receives), and whether ``Δ`` was finite (``[M]``)."""
  idx = step.parts[p]
  delta = payload(step, state, idx)
  phi = base.select(state.outer.params, idx)
  return concat([*delta.values(), *phi.values()]), finite_per_worker(delta)


def pairs_decode(step, state, p: int, theirs) -> dict:
  """Each worker's outer-update input for fragment ``p`` from its peer's payload ``theirs``
  (:func:`pairs_encode`, ``[..., D, 2 n_p]``): ``consensus_gradient((Δ_i + Δ_j)/2, φ_i,
  (φ_i + φ_j)/2)``."""
  idx = step.parts[p]
  delta, phi = payload(step, state, idx), base.select(state.outer.params, idx)
  n = theirs.shape[-1] // 2  # Δ and φ have the same leaves
  their_delta, their_phi = split(step, p, theirs[..., :n]), split(step, p, theirs[..., n:])
  half = lambda a, b: jax.tree.map(lambda x, y: (x + y) / 2, a, b)
  return consensus_gradient(half(delta, their_delta), phi, half(phi, their_phi))


def ef_scale(step, t):
  """``c_t``: the scale of the payload in a sparse method's error feedback at sync ``t``."""
  spec = step.method.sparse
  return spec.scale(t) if spec.scale is not None else 1.0


def accumulate(step, x: dict, buffers: dict, t) -> dict:
  """``β e + c_t x``: the error feedback ``buffers`` with payload ``x`` added, before its top-k
  is sent (what a worker whose payload was not taken keeps)."""
  keys = list(buffers)
  summed = sparse_lib.accumulate(
    [x[k] for k in keys], [buffers[k] for k in keys], step.method.sparse.decay, ef_scale(step, t)
  )
  return dict(zip(keys, summed, strict=True))


def sparse_encode(step, keys: list, rows: dict, buffers: dict, t):
  """Per device, on its own blocks (leading dims ``[1, d]``): the error feedback around the
  top-k, ``e ← β e + c_t x``, the wire of ``top-k(e)``, ``e ← e − sent``. Returns ``(wire
  uint8 [1, d, n], the new buffers)``."""
  spec = step.method.sparse
  wire, new = sparse_lib.feedback_compress(
    step.codec, [rows[k] for k in keys], [buffers[k] for k in keys], spec.decay, ef_scale(step, t)
  )
  return wire, dict(zip(keys, new, strict=True))


def sparse_decode(step, keys: list, everyone) -> dict:
  """Per device: the scatter-mean of the wires ``everyone`` (``[S, 1, d, n]``, in the order of
  the senders) as the fragment's view."""
  return dict(zip(keys, step.codec.mean(everyone), strict=True))


def sparse_share(step, state_before, state_after, p: int, ref=None) -> dict:
  """What worker ``m`` put into the sparse average of fragment ``p``: the decoded ``ê_m`` it sent,
  ``β e + c_t x − e_new`` (the error feedback before and after the sync)."""
  idx = step.parts[p]
  x = payload(step, state_before, idx, ref)
  old, new = base.select(state_before.comp, idx), base.select(state_after.comp, idx)
  before = accumulate(step, x, old, sync_index(step, state_before))
  return jax.tree.map(lambda a, n: a - n, before, new)
