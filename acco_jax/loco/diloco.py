r"""DiLoCo: ``H`` local inner steps per worker, then one outer step on the mean pseudo-gradient.

.. math::

  \Delta = \frac1M \sum_m (\theta_g - \theta_m), \qquad
  u \leftarrow \mu u + \Delta, \qquad
  \theta_g \leftarrow \theta_g - \eta_{out} (\Delta + \mu u), \qquad
  \theta_m \leftarrow \theta_g

with the defaults ``η_out = 0.7``, ``μ = 0.9`` (Nesterov). The inner optimizer (AdamW) keeps its
state across syncs. One all-reduce of the parameters' size every ``H`` inner steps.

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen. "DiLoCo: Distributed
  Low-Communication Training of Language Models", arXiv:2311.08105, 2023.
"""

from __future__ import annotations

import optax

from acco_jax.loco.base import LocoMethod, check, default_outer


def diloco(
  sync_every: int = 500,
  outer: optax.GradientTransformation | None = None,
  *,
  outer_overlap: str = "none",
) -> LocoMethod:
  """DiLoCo.

  Args:
    sync_every: ``H``, inner steps between outer steps.
    outer: the outer optax transform; default ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
    outer_overlap: ``none``, ``delayed`` or ``eager`` (:mod:`acco_jax.loco.overlap`).

  Returns:
    The :class:`acco_jax.loco.LocoMethod` (one fragment, no overlap, replace).
  """
  method = LocoMethod(
    "diloco", int(sync_every), outer or default_outer(), outer_overlap=outer_overlap
  )
  check(method)
  return method
