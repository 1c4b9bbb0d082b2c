r"""The programs of an overlapped outer step (``loco.outer_overlap`` = ``delayed`` | ``eager``).

No collective of its own: the reduction over workers goes through :mod:`acco_jax.loco.programs`
(``send`` / ``exchange``, hence :mod:`acco_jax.loco.replica`). The math and the state are in
:mod:`acco_jax.loco.overlap`. Two programs per fragment ``p`` (``K = H/P`` inner steps between two
fragment syncs):

.. code-block:: none

  phase p   Δ_m = s_m − θ_m on fragment p; compress; reduce over workers   } no data dependence:
            start point s_m ← C (delayed) | C_m ← Outer(C_m, Δ̃_m; u_m) (eager)} in flight together
            θ_m ← α θ_m + (1 − α) s_m; K inner steps on every worker       }
            delayed: C ← Outer(C, Δ̄), u updated; keep s_m (and Δ̄, Δ_m: eager)
  flush p   Δ_m = s_m − θ_m; compress; reduce; C ← Outer(C, Δ̄) (delayed) | C_m ← Outer(C_m,
            Δ̄(T−1) − Δ_m(T−1)/M + Δ̄(T); u_m) (eager); θ_m ← α θ_m + (1 − α) C; s_m ← C,
            Δ̄ = Δ_m = 0 (blocking: the last sync of a run lands)

The phase program is Streaming DiLoCo's window (:func:`acco_jax.loco.programs.build`) stretched
to the whole period: an ``optimization_barrier`` lets the inner steps start once the payload and
the start point are computed, and the reduction's result joins the first inner step's microbatch
loop (the ``token`` of :meth:`acco_jax.dp.stage.StageProgram.stage_fn`), so it is the one
collective over workers in flight while the steps run and nothing of the steps waits for it. The
commit reads it after the loop. Nothing is in flight between two programs: a checkpoint holds
``s_m``, ``Δ̄`` and ``Δ_m`` (:class:`acco_jax.loco.overlap.OverlapState`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax

from acco_jax.loco import base, programs
from acco_jax.loco.replica import REPLICA


def _reduce(step, state, p: int, ref: dict):
  """Issues fragment ``p``'s reduction. Returns ``(state, payload view, token, mean_of(token),
  metrics)``: ``token`` the collective's raw result (for the barrier), ``mean_of`` its view."""
  if step.method.aggregate == "mean":
    payload, flat, finite = programs.send(step, state, p, ref)
    return state, payload, flat, lambda t: programs.split(step, p, t), {"outer_finite": finite}
  new, mean, extra = programs.exchange(step, state, p, ref)
  own = programs.sparse_share(step, state, new, p, ref)
  return new, own, mean, lambda t: t, extra


def _commit(step, state, p: int, mean: dict):
  """``C ← Outer(C, Δ̄)`` on fragment ``p`` with the committed outer state (every worker)."""
  update = functools.partial(base.outer_update, step.method, fragment=p, parts=step.parts)
  outer, new_g = jax.vmap(update, spmd_axis_name=REPLICA)(state.outer, mean)
  old = base.select(state.outer.params, step.parts[p])
  norm = jax.vmap(optax.tree.norm)  # per worker: no metric moves data between workers
  metrics = {
    "outer_delta_norm": norm(mean),
    "outer_step_norm": norm(base.pseudo_gradient(old, new_g)),
    "outer_fragment": jnp.int32(p),
  }
  return state._replace(outer=outer), new_g, metrics


def _move(step, state, p: int, point: dict):
  """``θ_m ← α θ_m + (1 − α) point`` on fragment ``p``, and the new compute weights."""
  theta = programs.worker_params(state)
  local = base.merge(base.select(theta, step.parts[p]), point, step.method.alpha)
  return programs.set_worker_params(step, state, base.replace(theta, local))


def build(step, kind: str, p: int, sharding):
  """The jitted program ``kind`` (``phase`` or ``flush``) of fragment ``p``; the state is donated."""
  method, idx, m = step.method, step.parts[p], step.num_workers
  k = method.period

  eager = method.outer_overlap == "eager"

  def estimate(state, fresh):
    """Eager: ``Δ̃_m = Δ̄(t−1) − Δ_m(t−1)/M + fresh`` (``fresh``: its own ``Δ_m(t)/M`` in a phase,
    the landed ``Δ̄(T)`` in the flush)."""
    ov = state.overlap
    return jax.tree.map(
      lambda a, o, f: a - o / m + f, base.select(ov.mean, idx), base.select(ov.own, idx), fresh
    )

  def keep(state, start, mean=None, own=None):
    ov = state.overlap._replace(start=base.replace(state.overlap.start, start))
    if eager:
      ov = ov._replace(mean=base.replace(ov.mean, mean), own=base.replace(ov.own, own))
    return state._replace(overlap=ov)

  def phase(state, batches):
    ref = base.select(state.overlap.start, idx)
    state, own, token, mean_of, extra = _reduce(step, state, p, ref)
    outer = {}
    if eager:  # each worker's own outer step on its estimate: the start point
      fresh = jax.tree.map(lambda x: x / m, own)
      state, start, outer = _commit(step, state, p, estimate(state, fresh))
    else:  # delayed: the model committed through the previous sync
      start = base.select(state.outer.params, idx)
    state = _move(step, state, p, start)
    # The inner steps start once the payload and the start point exist (not the reduction), and
    # the reduction joins the first step's microbatch loop: in flight across it, as in a window.
    own, inner = lax.optimization_barrier((own, state.inner))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)

    def body(i, carry):
      inner, _ = carry
      batch = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), stacked)
      return programs.inner_step(step, inner, batch)

    first = jax.tree.map(lambda x: x[0], stacked)
    *first, token = programs.inner_step(step, inner, first, token)
    inner, metrics = lax.fori_loop(1, k, body, tuple(first)) if k > 1 else first
    state = state._replace(inner=inner, step=state.step + k)
    mean = mean_of(token)
    if not eager:  # delayed: the average lands one phase late, committed for the next start
      state, _, outer = _commit(step, state, p, mean)
    state = keep(state, start, mean, own)
    return state, {**metrics, **outer, **extra}

  def flush(state):
    ref = base.select(state.overlap.start, idx)
    state, _, token, mean_of, extra = _reduce(step, state, p, ref)
    mean = mean_of(token)
    # eager: the last step lands the others' late share and everyone's last one, so that every
    # worker has applied every average once; delayed: the last average, committed
    state, new_g, outer = _commit(step, state, p, estimate(state, mean) if eager else mean)
    state = _move(step, state, p, new_g)
    zeros = {key: jnp.zeros_like(v) for key, v in new_g.items()}
    return keep(state, new_g, zeros, zeros), {**outer, **extra}

  if kind == "flush":
    return jax.jit(
      flush, in_shardings=(sharding,), out_shardings=(sharding, None), donate_argnums=(0,)
    )
  return jax.jit(
    phase,
    in_shardings=(sharding, step.batch_sharding()),
    out_shardings=(sharding, None),
    donate_argnums=(0,),
  )
