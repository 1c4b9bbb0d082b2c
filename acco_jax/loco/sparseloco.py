r"""SparseLoCo: DiLoCo whose outer momentum is a per-worker error feedback, sent as a 2-bit top-k.

Every ``H`` inner steps, per worker ``r`` (``θ_g`` is the same on every worker):

.. math::

  \Delta_r = \theta_g - \theta_r, \qquad e_r \leftarrow \beta e_r + \Delta_r, \qquad
  \hat e_r = \mathrm{deQ}(Q(\mathrm{topk}_{chunk}(e_r))), \qquad e_r \leftarrow e_r - \hat e_r

then the workers all-gather their ``ê_r`` (indices in 12 bits, 2-bit codes, a shift and a 4-entry
lookup per tensor), average them position by position and step

.. math::

  D = \mathrm{scatter\text{-}mean}_r(\hat e_r), \qquad \theta_g \leftarrow \theta_g - \alpha D,
  \qquad \theta_r \leftarrow \theta_g

with ``β = 0.95``, ``α = 1``, ``k = 64`` per 64 x 64 tile (1.56%), ``mean_contributors`` (divide a
position by the number of workers that sent it, the reference code's rule; ``mean_R`` divides by
all, the paper's). The residual ``e_r − ê_r`` stays on its worker. With ``k`` = the chunk, no
quantiser, ``β = 0`` and ``α = 1`` it is DiLoCo with a momentum-free outer SGD.

**The error feedback's scale** (``ef_scale``, ``loco.ef_scale``). The paper accumulates the
pseudo-gradient itself, and so does the default ``ef_scale="one"``:

.. math::

  e_r \leftarrow \beta e_r + \Delta_r

The reference code accumulates it scaled by the outer learning rate, ``ef_scale="outer_lr"``:

.. math::

  e_r \leftarrow \beta e_r + \alpha \Delta_r

and both then step ``θ_g ← θ_g − α D``. At ``α = 1`` (``loco.outer_lr``, the published setting)
the two are the same; at another ``α`` the second scales the buffer, what is sent and the residual
by ``α`` (top-k and the quantiser commute with a positive scale), so its outer step is ``α² D``.

Chunks are cut from each device's shard (:mod:`acco_jax.loco.compress.sparse`). The scatter is
deterministic, so ``θ_g`` stays bit-identical on every worker.

References:
  Sarfi, Thérien, Lidin, Belilovsky. "Communication Efficient LLM Pre-training with SparseLoCo",
  arXiv:2508.15706, 2025.
"""

from __future__ import annotations

import optax

from acco_jax.loco.base import LocoMethod, Sparsify, check

EF_SCALES = ("one", "outer_lr")  # what multiplies the pseudo-gradient into the error feedback


def sparseloco(
  sync_every: int = 50,
  *,
  topk: int = 64,
  chunk: int = 64,
  bits: int = 2,
  decay: float = 0.95,
  aggregate: str = "mean_contributors",
  outer_lr: float = 1.0,
  ef_scale: str = "one",
  outer_overlap: str = "none",
) -> LocoMethod:
  """SparseLoCo.

  Args:
    sync_every: ``H``, inner steps between outer steps.
    topk: ``k`` per tile of ``chunk²`` values (1-D chunks keep the same share).
    chunk: the largest tile side / 1-D chunk length.
    bits: the value quantiser: 2, 4 or 8 bits with a per-tensor shift and lookup; 32 = float32.
    decay: ``β``, the error-feedback decay.
    aggregate: ``mean_contributors`` or ``mean_R``.
    outer_lr: ``α`` of the outer SGD (no momentum).
    ef_scale: what multiplies ``Δ`` into the error feedback: ``one`` (``e ← β e + Δ``, the paper)
      or ``outer_lr`` (``e ← β e + α Δ``, the reference code).
    outer_overlap: ``none``, ``delayed`` or ``eager``; the decoded sparse average stands in for
      ``Δ̄`` (:mod:`acco_jax.loco.overlap`).

  Returns:
    The :class:`acco_jax.loco.LocoMethod`.
  """
  if ef_scale not in EF_SCALES:
    raise ValueError(
      f"loco.ef_scale={ef_scale!r}: choose 'one' (e <- b e + delta, the paper) or 'outer_lr' "
      "(e <- b e + outer_lr delta, the reference code)"
    )
  scale = optax.constant_schedule(float(outer_lr)) if ef_scale == "outer_lr" else None
  sparse = Sparsify(
    float(decay), int(topk), int(chunk), "scaled", "none", int(bits), aggregate, scale
  )
  method = LocoMethod(
    "sparseloco", int(sync_every), optax.sgd(outer_lr), sparse=sparse, outer_overlap=outer_overlap
  )
  check(method)
  return method
