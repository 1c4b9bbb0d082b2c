"""Fused next-token cross-entropy: float32 statistics from 16-bit logits, one pass each way.

The language-model loss reads logits ``[B, L, V]`` that the head produced in the compute dtype
(bfloat16 on GPU). Plain autodiff of ``log_softmax`` in float32 converts them to a float32
``[B, L, V]`` array and keeps several more of that size (the log-probabilities, the softmax, the
scatter-add of ``take_along_axis``'s transpose), and hands the head a float32 cotangent, so both of
the head's backward GEMMs run in float32 (TF32 at best). :func:`token_cross_entropy` is a
``jax.custom_vjp`` whose forward reduces the logits to a float32 ``logsumexp`` per token (the
conversion happens inside the reductions, no float32 ``[B, L, V]`` array is written) and whose
backward writes the logits' cotangent in the logits' dtype in one elementwise pass, the one-hot
target a comparison with an iota rather than a scatter. The forward's ``logsumexp`` reads the logits
once (:func:`logsumexp_one_pass`), not once for the maximum and once more for the sum.

Libraries looked at before writing this (2026-11): ``optax.softmax_cross_entropy_with_integer_labels``
is plain autodiff (the float32 materialisations above); levanter's fused cross-entropy and the
``tokamax`` kernel library fuse the head matmul and the loss in Pallas kernels written for TPU
(Mosaic), with a reference fallback elsewhere, and levanter brings haliax and equinox with it;
MaxText's vocabulary tiling lives inside MaxText (Linen), not in a library. None is a dependency
worth taking for a GPU elementwise pass of a dozen lines.

Padded vocabularies (``model.vocab_multiple``): columns ``>= num_classes`` are excluded, i.e. their
logits count as ``-inf`` in the forward and get a zero cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _column_ids(x: jax.Array) -> jax.Array:
  return lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)


def _masked_f32(logits: jax.Array, num_classes: int) -> jax.Array:
  x = logits.astype(jnp.float32)
  if num_classes < logits.shape[-1]:
    x = jnp.where(_column_ids(logits) < num_classes, x, -jnp.inf)
  return x


def _max_and_sum(a, b):
  """Combines two ``(max, Σ e^(x − max))`` pairs (an online softmax's running statistics)."""
  (ma, sa), (mb, sb) = a, b
  m = jnp.maximum(ma, mb)
  empty = m == -jnp.inf  # both hold no column yet: exp(-inf - -inf) would be nan
  scale = lambda mx, sx: jnp.where(empty, 0.0, sx * jnp.exp(mx - jnp.where(empty, 0.0, m)))
  return m, scale(ma, sa) + scale(mb, sb)


def logsumexp_one_pass(x: jax.Array) -> jax.Array:
  r"""``log Σ_v e^{x_v}`` over the last axis of float32 ``x`` in one pass over it.

  A variadic reduction of the pairs ``(m, s)``, each column entering as ``(x_v, 1)`` and two pairs
  combining as :math:`m = \max(m_a, m_b)`, :math:`s = s_a e^{m_a - m} + s_b e^{m_b - m}`: the
  running maximum and the sum of exponentials shifted by it, as an online softmax keeps them. The
  two-pass form (a maximum, then the shifted sum) reads the logits twice; on a GPU each pass over
  ``[B, L, V]`` bfloat16 logits is one of the stage's largest kernels. Columns of ``-inf`` add
  nothing.
  """
  m, s = lax.reduce(
    (x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0)), _max_and_sum, (x.ndim - 1,)
  )
  return m + jnp.log(s)


def _forward(logits, targets, num_classes):
  logz = logsumexp_one_pass(_masked_f32(logits, num_classes))
  target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
  return logz - target, logz


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_cross_entropy(logits: jax.Array, targets: jax.Array, num_classes: int) -> jax.Array:
  r"""Per-token cross-entropy of logits against integer targets, in float32.

  .. math::

    \ell_t = \log \sum_{v < V} e^{z_{t,v}} - z_{t, y_t},
    \qquad \frac{\partial \ell_t}{\partial z_{t,v}} = [v < V] \, (\mathrm{softmax}(z_t)_v - [v = y_t])

  with :math:`V` = ``num_classes`` and :math:`z` the logits; the sum and the softmax are computed in
  float32 whatever the logits' dtype, the cotangent is returned in the logits' dtype.

  Args:
    logits: ``[..., V_padded]`` logits, any float dtype (bfloat16 from the model's head).
    targets: ``[...]`` integer class ids in ``[0, num_classes)``.
    num_classes: the real number of classes ``V <= V_padded``; columns beyond it are ignored.

  Returns:
    float32 ``[...]`` token losses.
  """
  return _forward(logits, targets, num_classes)[0]


def _fwd(logits, targets, num_classes):
  loss, logz = _forward(logits, targets, num_classes)
  return loss, (logits, targets, logz)


def _bwd(num_classes, residuals, g):
  logits, targets, logz = residuals
  cols = _column_ids(logits)
  p = jnp.exp(logits.astype(jnp.float32) - logz[..., None])
  d = p - (cols == targets[..., None]).astype(jnp.float32)
  if num_classes < logits.shape[-1]:
    d = jnp.where(cols < num_classes, d, 0.0)
  return (d * g[..., None].astype(jnp.float32)).astype(logits.dtype), None


token_cross_entropy.defvjp(_fwd, _bwd)


def weighted_cross_entropy(logits, targets, weights, num_classes: int):
  """``(loss_sum, tokens)``: the weighted sum of token losses and the sum of weights, float32."""
  token_loss = token_cross_entropy(logits, targets, num_classes)
  weights = weights.astype(jnp.float32)
  return jnp.sum(token_loss * weights), jnp.sum(weights)
