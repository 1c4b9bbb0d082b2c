"""The syncs that do not all-reduce: NoLoCo's pair exchange, SparseLoCo's and DeMo's sparse gather.

:class:`acco_jax.loco_step.LocoStep` calls :func:`exchange` inside its jitted sync program for a
method whose aggregator is ``pairs`` or ``sparse``; it returns what the outer update of every
worker takes (its own pseudo-gradient or the workers' mean), and the outer update and the merge
then run as for DiLoCo. The math is in the pure method files (:mod:`acco_jax.loco.noloco`,
:mod:`~acco_jax.loco.sparseloco`, :mod:`~acco_jax.loco.demo`) and :mod:`acco_jax.loco.compress`;
the data movement in :mod:`acco_jax.replica`:

.. code-block:: none

  pairs    g_i = consensus_gradient((Δ_i + Δ_j)/2, φ_i, (φ_i + φ_j)/2)    one collective-permute of
           j = matchings[pairing_index(seed, sync), i]                     [Δ | φ] (float32)
  sparse   e_i ← β e_i + c_t x_i; wire_i, ê_i = top-k(e_i); e_i -= ê_i    one all-gather of the
           mean = scatter-mean over workers of decode(wire_j)              packed bytes
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax.loco import base
from acco_jax.loco.compress import sparse as sparse_lib
from acco_jax.loco.demo import kept_gradient
from acco_jax.loco.noloco import consensus_gradient, matchings, pairing_index

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


def payload(step, state, idx) -> dict:
  """The view of what a worker sends: ``Δ = θ_g − θ_m``, or the gradient its inner step kept."""
  if step.method.payload == "gradient":
    return base.select(kept_gradient(state.inner.opt_state), idx)
  return base.pseudo_gradient(
    base.select(state.outer.params, idx), base.select(state.inner.params, idx)
  )


def sync_index(step, state) -> jax.Array:
  """The index of the sync running now (0 for the first): after ``s`` inner steps, ``s/H − 1``."""
  return state.step // step.method.sync_every - 1


def exchange(step, state, p: int):
  """Returns ``(state, the outer update's input view per worker, metrics)`` for fragment ``p``."""
  if step.method.aggregate == "pairs":
    return _pairs(step, state, p)
  return _sparse(step, state, p)


def _pairs(step, state, p):
  idx = step.parts[p]
  delta = payload(step, state, idx)
  phi = base.select(state.outer.params, idx)
  keys = list(delta)
  sizes = [delta[k].shape[-1] for k in keys]
  flat = jnp.concatenate([delta[k] for k in keys] + [phi[k] for k in keys], axis=-1)
  pairing = step.method.pairing
  which = pairing_index(pairing.seed, sync_index(step, state), pairing.count)
  other = step.comm.partner(flat, step.matchings, which)

  def split(x):
    cuts = np.cumsum(sizes * 2)[:-1]
    parts = jnp.split(x, cuts, axis=-1)
    n = len(keys)
    return dict(zip(keys, parts[:n], strict=True)), dict(zip(keys, parts[n:], strict=True))

  their_delta, their_phi = split(other)
  half = lambda a, b: jax.tree.map(lambda x, y: (x + y) / 2, a, b)
  grad = consensus_gradient(half(delta, their_delta), phi, half(phi, their_phi))
  return state, grad, {"outer_finite": finite_per_worker(delta), "outer_pairing": which}


def _sparse(step, state, p):
  idx = step.parts[p]
  x = payload(step, state, idx)
  buffers = base.select(state.comp, idx)
  keys, spec, codec = list(x), step.method.sparse, step.codec

  def encode(rows, bufs, t):
    scale = spec.scale(t) if spec.scale is not None else 1.0
    wire, new = sparse_lib.feedback_compress(
      codec, [rows[k] for k in keys], [bufs[k] for k in keys], spec.decay, scale
    )
    return wire, dict(zip(keys, new, strict=True))

  def decode(everyone):
    return dict(zip(keys, codec.mean(everyone), strict=True))

  kept, mean = step.comm.gather(encode, decode, (x, buffers), (sync_index(step, state),))
  state = state._replace(comp=base.replace(state.comp, kept))
  return state, mean, {"outer_finite": finite_per_worker(x)}
