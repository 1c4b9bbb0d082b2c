r"""NoLoCo: no all-reduce; every ``H`` inner steps each worker averages with one random peer.

Each worker ``i`` keeps its own slow weights ``φ_i`` and outer momentum ``δ_i``. At a sync the
workers are paired at random (a perfect matching, group size ``n = 2``), and with ``G`` the pair of
``i`` and ``Δ_j = φ_j − θ_j`` each member's pseudo-gradient:

.. math::

  \bar\phi = \tfrac1n \textstyle\sum_{j \in G} \phi_j, \qquad
  \bar d = \tfrac1n \textstyle\sum_{j \in G} (\theta_j - \phi_j), \qquad
  \delta_i \leftarrow \beta \delta_i + \gamma \bar d + \gamma (\bar\phi - \phi_i), \qquad
  \phi_i \leftarrow \phi_i + \delta_i, \qquad \theta_i \leftarrow \phi_i

(``β = 0.5``, ``γ = 0.7``, ``H = 50``). The last term is the *consensus* term: it pulls ``φ_i``
toward the pair's mean and sums to zero over the pair. Written as an optax step, ``δ_i = −γ u_i``
with the heavy-ball trace ``u_i ← β u_i + g_i`` of

.. math::

  g_i = \tfrac1n \textstyle\sum_{j \in G} \Delta_j + (\phi_i - \bar\phi)

so the outer transform is ``optax.sgd(γ, momentum=β)`` (heavy-ball, as the reference code applies
it, although the paper calls it a Nesterov variant) on :func:`consensus_gradient`. With one group of
all ``N`` workers and equal ``φ`` it is DiLoCo with a heavy-ball outer step. Each worker sends its
``Δ`` and ``φ`` (two parameter-sized tensors) to its peer.

**Pairings.** ``lax.ppermute`` needs a static permutation, so :func:`matchings` draws ``K`` random
perfect matchings from a seed once, and each sync picks one with :func:`pairing_index` from the seed
and the sync index: every worker computes the same choice without talking, and a resumed run
continues the same stream. (The reference draws a fresh permutation each sync; with ``K`` fixed
matchings a worker meets only the partners those matchings give it.)

References:
  Kolehmainen, Blagoev, Donaghy, Ersoy, Nies. "NoLoCo: No-all-reduce Low Communication Training
  Method for Large Models", arXiv:2506.10911, 2025.
"""

from __future__ import annotations

import jax
import numpy as np

from acco_jax.loco.base import LocoMethod, Pairing, check, default_outer


def noloco(
  sync_every: int = 50,
  *,
  outer_lr: float = 0.7,
  momentum: float = 0.5,
  pairings: int = 16,
  seed: int = 0,
) -> LocoMethod:
  """NoLoCo.

  Args:
    sync_every: ``H``, inner steps between two pairwise averages.
    outer_lr: ``γ``.
    momentum: ``β`` (heavy-ball).
    pairings: ``K``, random perfect matchings drawn once; one is picked per sync.
    seed: the shared seed of the matchings and of the choice per sync.

  Returns:
    The :class:`acco_jax.loco.LocoMethod` (the workers must be an even number, checked where the
    mesh is known).
  """
  outer = default_outer(outer_lr, momentum, nesterov=False)
  method = LocoMethod("noloco", int(sync_every), outer, pairing=Pairing(int(pairings), int(seed)))
  check(method)
  return method


def matchings(workers: int, count: int, seed: int) -> np.ndarray:
  """``[count, workers]``: ``partner[k, i]``, worker ``i``'s peer in matching ``k``.

  Matching ``k`` draws a permutation ``π`` of the workers and pairs ``π[j]`` with
  ``π[j + workers/2]`` (element ``j`` of the permutation joins group ``j mod workers/2``).
  """
  if workers < 2 or workers % 2:
    raise ValueError(
      f"loco.workers={workers}: NoLoCo pairs the workers, so it needs an even number >= 2"
    )
  rng = np.random.default_rng(seed)
  half = workers // 2
  out = np.empty((count, workers), np.int32)
  for k in range(count):
    perm = rng.permutation(workers)
    out[k, perm[:half]] = perm[half:]
    out[k, perm[half:]] = perm[:half]
  return out


def pairing_index(seed: int, sync: jax.Array, count: int) -> jax.Array:
  """Which matching sync ``sync`` uses: ``randint(fold_in(key(seed), sync), 0, count)``."""
  key = jax.random.fold_in(jax.random.key(seed), sync)
  return jax.random.randint(key, (), 0, count)


def consensus_gradient(delta_mean, phi, phi_mean):
  """``g_i = mean_G Δ + (φ_i − φ̄)``: the pair's mean pseudo-gradient plus the consensus term."""
  return jax.tree.map(lambda d, p, m: d + (p - m), delta_mean, phi, phi_mean)
