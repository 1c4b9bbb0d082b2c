r"""DeMo: decoupled momentum, DCT top-k of it sent every step, and a sign update.

No inner optimizer and no data-parallel gradient all-reduce: each worker ``i`` keeps its own
momentum ``m_i``, takes its (clipped) gradient ``g_i`` and every step

.. math::

  m_i \leftarrow \beta m_i + \eta_t g_i, \qquad
  q_i = \mathrm{IDCT}(\mathrm{topk}_{chunk}(\mathrm{DCT}(m_i))), \qquad m_i \leftarrow m_i - q_i

then the workers all-gather the sparse DCT coefficients (12-bit indices, float32 values), average
them position by position over the workers that sent each one, and all apply

.. math::

  U = \mathrm{IDCT}(\mathrm{scatter\text{-}mean}_i(\mathrm{DCT\ entries}_i)), \qquad
  \theta \leftarrow \theta (1 - \eta_t \lambda) - \eta_t\, \mathrm{sign}(U)

(``β = 0.999``, ``k = 32`` per 64 x 64 tile, ``λ = 0``: the reference's values; the DCT is the
orthonormal DCT-II per tile). The parameters stay the same on every worker because everyone
applies the same ``U``, computed with a deterministic scatter. With one worker and ``k`` = the tile,
everything is sent, ``m`` drains to 0 each step and the update is sign-SGD on ``η g``.

On the mesh, DeMo is a low-communication method with ``H = 1`` whose inner step only computes the
gradient: :func:`keep_gradient` stores it in the inner optimizer state and leaves the parameters
alone (``payload='gradient'``); the momentum is the error-feedback buffer of
:class:`acco_jax.loco.base.Sparsify` with the learning rate as its scale; the outer transform is the
sign step. A worker of ``D`` devices averages its gradient over them (reduce-scatter inside the
worker); nothing is all-reduced across workers.

References:
  Peng, Quesnelle, Kingma. "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870, 2024.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from acco_jax.loco.base import LocoMethod, Sparsify, check

PyTree = Any


def demo(
  learning_rate: float | optax.Schedule = 1e-3,
  *,
  topk: int = 32,
  chunk: int = 64,
  decay: float = 0.999,
  weight_decay: float = 0.0,
  aggregate: str = "mean_contributors",
) -> LocoMethod:
  """DeMo.

  Args:
    learning_rate: ``η`` or a schedule of the step (it scales the gradient into the momentum and
      the sign step alike).
    topk: ``k`` per chunk (at most the chunk's size, so 1-D chunks of 64 keep 32).
    chunk: the largest tile side / 1-D chunk length.
    decay: ``β``, the momentum decay.
    weight_decay: ``λ``, decoupled (``θ ← θ (1 − η λ)``), on every parameter.
    aggregate: ``mean_contributors`` (the reference) or ``mean_R``.

  Returns:
    The :class:`acco_jax.loco.LocoMethod`; run it with the inner transform :func:`keep_gradient`
    (after any clipping).
  """
  lr = learning_rate if callable(learning_rate) else optax.constant_schedule(learning_rate)
  outer = optax.chain(
    optax.scale_by_sign(), optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(lr)
  )
  sparse = Sparsify(float(decay), int(topk), int(chunk), "clamped", "dct", 32, aggregate, lr)
  method = LocoMethod("demo", 1, outer, sparse=sparse, payload="gradient")
  check(method)
  return method


class KeepGradientState(NamedTuple):
  """The last gradient the inner step saw (shaped like the parameters)."""

  grad: PyTree


def keep_gradient() -> optax.GradientTransformation:
  """An inner "optimizer" that stores the gradient and leaves the parameters unchanged.

  ``update(g, state) = (0, KeepGradientState(g))``: the inner data-parallel step then only computes
  (and, inside a worker, reduces) the gradient; the outer step reads it with :func:`kept_gradient`.
  """

  def init(params):
    return KeepGradientState(jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, updates), KeepGradientState(updates)

  return optax.GradientTransformation(init, update)


def kept_gradient(opt_state) -> PyTree:
  """The gradient a :func:`keep_gradient` (alone or inside a chain) stored in ``opt_state``."""
  found = [
    s
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, KeepGradientState))
    if isinstance(s, KeepGradientState)
  ]
  if len(found) != 1:
    raise ValueError(
      "demo needs the inner transform acco_jax.loco.demo.keep_gradient() (the inner step must "
      f"only compute the gradient); found {len(found)} in the inner optimizer state"
    )
  return found[0].grad
