r"""Delayed and eager outer updates: the outer reduction of a sync overlaps the whole next phase.

Pure (no collectives): the state and the arithmetic of the start point. :mod:`acco_jax.loco.phase`
runs it on the mesh, :mod:`acco_jax.loco.replica` moves the data.

Notation, one fragment (DiLoCo has one; Streaming DiLoCo one per fragment, each on its own
schedule). ``C`` is the outer parameters (``OuterState.params``) with the outer optimizer state
``u``: under ``delayed`` committed and the same on every worker, under ``eager`` each worker's own
(``C_m``, ``u_m``, below). Phase ``t`` is the inner steps between
sync ``t − 1`` and sync ``t``; worker ``m`` starts it from its start point ``s_m(t−1)``
(``s_m(0) = θ_0``) and ends it at ``θ_m(t)``. Its pseudo-gradient is what its inner steps moved,

.. math::

  \Delta_m(t) = s_m(t-1) - \theta_m(t), \qquad \bar\Delta(t) = \frac1M \sum_m \Delta_m(t)

(after the method's compressor; SparseLoCo's decoded sparse average stands in for ``Δ̄`` and its
error feedback is unchanged). The reduction of ``Δ̄(t)`` is issued at sync ``t`` and consumed
one phase later, at sync ``t + 1``. Meanwhile the worker starts phase ``t + 1`` from

* ``none``: blocking, ``s(t) = C(t) = Outer(C(t−1), Δ̄(t))``;
* ``delayed``: ``s(t) = C(t−1)``, the model committed through the previous sync (``Δ̄(t)`` is
  committed, ``C ← Outer(C, Δ̄(t))``, when it lands);
* ``eager``: ACCO's estimate. Worker ``m`` replaces its own stale share of the last average by its
  fresh one and takes one outer step of its own with it,

  .. math::

    \tilde\Delta_m(t) = \bar\Delta(t-1) - \frac{\Delta_m(t-1)}{M} + \frac{\Delta_m(t)}{M}, \qquad
    C_m(t) = \mathrm{Outer}(C_m(t-1), \tilde\Delta_m(t); u_m), \qquad s_m(t) = C_m(t)

  a recursion on the worker's own outer parameters ``C_m`` and outer state ``u_m``: there is no
  separate commit. Summed over syncs the estimates count every contribution once (the own share
  enters now and leaves, as the stale term, at the next sync, when the others' share of the same
  average enters), so with plain averaging (outer SGD, lr 1) ``C_m(t) = C(t−1) − Δ_m(t)/M`` with
  ``C(t−1)`` the model of every average up to ``t − 1``.

then ``θ_m ← α θ_m + (1 − α) s_m(t)`` (the method's merge). The first sync has nothing older:
``Δ̄(0) = Δ_m(0) = 0``, so the first eager step is ``Outer(C(0), Δ_m(1)/M)``.

**Where the state lives and how workers drift.** Under ``delayed``, ``C`` and ``u`` are committed
and identical on every worker (every worker commits the same ``Δ̄``). Under ``eager`` every worker
holds its own ``C_m`` and ``u_m`` (``OuterState``'s worker dimension, as NoLoCo's), its start point
``s_m``, the last average ``Δ̄`` and its own share ``Δ_m`` of it (:class:`OverlapState`, one
parameters-sized tree each; ``delayed`` needs only ``s``). The workers' outer parameters differ
through their ``Δ_m(t)/M`` terms: with plain averaging by exactly ``(Δ_{m'}(t) − Δ_m(t))/M``, which
the next average removes; with momentum ``u_m`` keeps a trace of past differences, ``μ``-damped.
With ``M = 1`` the estimate is exact (``Δ̃ = Δ̄(t)``) and eager is ``none``. With identical data on
every worker all ``Δ_m`` are equal, the workers stay identical and eager is blocking DiLoCo whose
outer gradient at sync ``t`` is the others' share one sync late and its own now,

.. math::

  C(t) = \mathrm{Outer}\big(C(t-1), (1 - \tfrac1M)\,\Delta(t-1) + \tfrac1M\,\Delta(t); u\big)

At the end of a run the last phase's ``Δ_m(T)`` lands in one blocking sync: eager's last step is
``Outer(C_m, Δ̄(T−1) − Δ_m(T−1)/M + Δ̄(T); u_m)`` (the others' late share and everyone's last),
after which every worker has applied every average once; ``params()`` reports worker 0's. A JAX
program cannot keep a collective in flight across program boundaries, so one program holds a phase:
the reduction, the start point, the inner steps (and under ``delayed`` the commit). With fragments
that bounds a fragment's reduction to the ``H/P`` steps until the next fragment's sync (not the
whole ``H``), and ``loco.overlap_steps`` must be 0.

References:
  Kale, Douillard, Donchev. "Eager Updates For Overlapped Communication and Computation in
  DiLoCo", arXiv:2502.12996, 2025.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any

OVERLAPS = ("none", "delayed", "eager")


class OverlapState(NamedTuple):
  """What a worker keeps between two phases (leaves ``[M, D, s]`` shards, like ``OuterState``).

  Attributes:
    start: ``s_m``, the worker's start point of each fragment's running phase (its pending
      ``Δ_m = s_m − θ_m`` is measured from it).
    mean: ``Δ̄``, each fragment's last committed average (``eager``; ``()`` for ``delayed``).
    own: ``Δ_m``, the worker's share of it (after the compressor; ``eager``; ``()`` otherwise).
  """

  start: PyTree
  mean: PyTree = ()
  own: PyTree = ()


def init_overlap(mode: str, params: PyTree) -> OverlapState | tuple:
  """The state of an overlap ``mode`` before the first sync: ``s = θ_0``, ``Δ̄ = Δ_m = 0``
  (``()`` for ``none``, so a blocking run's checkpoint is unchanged)."""
  if mode == "none":
    return ()
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  if mode == "delayed":
    return OverlapState(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  return OverlapState(params, zeros, zeros)
