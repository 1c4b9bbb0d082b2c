r"""Streaming DiLoCo: DiLoCo that syncs one fragment of blocks at a time, overlaps the fragment's
reduction with ``τ`` inner steps, merges it with ``α`` and sends FP4 outer gradients.

Fragments ``p = 0..P-1`` are groups of transformer blocks (strided or sequential; the embeddings,
final norm and head go with fragment 0), each with its own outer optimizer state. Fragment ``p``
is applied after ``j H + (p + 1) H/P`` inner steps, so one fragment syncs every ``H/P`` steps and
each once per ``H``; peak bandwidth drops about ``P`` times. Its pseudo-gradient is snapshot ``τ``
steps earlier (the send point), quantised to FP4 E3M0, averaged over workers in float32 while the
workers run those ``τ`` steps, then

.. math::

  u_p \leftarrow \mu u_p + \Delta_p, \qquad
  \theta_g[p] \leftarrow \theta_g[p] - \eta_{out} (\Delta_p + \mu u_p), \qquad
  \theta_m[p] \leftarrow \alpha\, \theta_m[p] + (1 - \alpha)\, \theta_g[p]

With ``P = 1``, ``τ = 0``, ``α = 0`` and no quantisation it is DiLoCo.

References:
  Douillard, Donchev, Rush, Kale, Rao, Feng, ... "Streaming DiLoCo with overlapping communication:
  Towards a Distributed Free Lunch", arXiv:2501.18512, 2025.
"""

from __future__ import annotations

import optax

from acco_jax.loco.base import LocoMethod, check, default_outer
from acco_jax.loco.compress import get_compressor


def streaming_diloco(
  sync_every: int = 100,
  fragments: int = 2,
  *,
  layout: str = "strided",
  overlap_steps: int = 1,
  alpha: float = 0.5,
  quantize: str = "fp4",
  block: int = 2048,
  outer: optax.GradientTransformation | None = None,
  outer_overlap: str = "none",
) -> LocoMethod:
  """Streaming DiLoCo.

  Args:
    sync_every: ``H``, inner steps between two syncs of the same fragment.
    fragments: ``P`` (must divide ``H`` and be at most the number of blocks).
    layout: ``strided`` or ``sequential`` assignment of blocks to fragments.
    overlap_steps: ``τ`` in ``[0, H/P)``, inner steps the reduction is in flight.
    alpha: merge factor ``α`` in ``[0, 1]`` (0 replaces the local fragment, 0.5 averages).
    quantize: ``fp4`` (E3M0 with a power-of-two scale per ``block`` values) or ``none``.
    block: values per FP4 scale.
    outer: the outer optax transform; default ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
    outer_overlap: ``none``, ``delayed`` or ``eager``: each fragment's reduction runs for the
      ``H/P`` steps until the next fragment's sync (:mod:`acco_jax.loco.overlap`; needs ``τ = 0``).

  Returns:
    The :class:`acco_jax.loco.LocoMethod`.
  """
  method = LocoMethod(
    "streaming_diloco",
    int(sync_every),
    outer or default_outer(),
    int(fragments),
    layout,
    int(overlap_steps),
    float(alpha),
    get_compressor(quantize, block=int(block)),
    outer_overlap=outer_overlap,
  )
  check(method)
  return method
