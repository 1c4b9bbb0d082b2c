"""Mixing the next-token predictions of independent experts (pure JAX: no Flax, orbax or TFDS).

E experts score the same tokens. ``logp_ExBxL[e, b, t] = log p_e(x_{b,t} | x_{b,<t})`` is expert e's
log-probability of the token that follows; every rule maps it to the ensemble's log-probability
``BxL``. All sums over experts are taken in log space with ``logsumexp``.

* ``simple_avg``: the mean of the experts' log-probabilities,
  ``log q(x_t) = (1/E) sum_e log p_e(x_t)`` (a geometric mean of the probabilities; as evaluated
  by the HDEE reference it is not renormalised over the vocabulary, which could only raise it).
* ``uniform_prior`` and ``cached_prior``: the domain posterior of each sequence. With a prior
  ``pi`` over experts, the weight of expert e at token t is its posterior given the prefix,

      log w_{e,t} = log pi_e + sum_{s<t} log p_e(x_s) - logsumexp_e'(log pi_e' + sum_{s<t} log p_e'(x_s))

  and the ensemble predicts the posterior-weighted mixture
  ``log q(x_t) = logsumexp_e(log w_{e,t} + log p_e(x_t))``. At t = 0 the weights are the prior.
  ``uniform_prior`` takes ``pi_e = 1/E``.
* ``cached_prior`` estimates ``pi`` once per evaluation domain from n dev sequences with total
  log-likelihoods ``l_{j,e} = sum_t log p_e(x_{j,t})``. Starting from ``log pi = 0``, sequence
  j = 1..n folds its posterior into an unnormalised running prior with decay d:

      post_j = softmax(log pi + l_j),    pi <- d^j * pi + post_j,

  and the prior used is ``softmax(log pi)``. The old prior's factor d^j shrinks with j, so after
  a few sequences the prior is dominated by the latest posteriors (the HDEE reference's rule,
  with n = 100 and d = 0.3).

References:
  Ersoy, Kolehmainen, Passamani Andrade, "HDEE: Heterogeneous Domain Expert Ensemble", 2025,
  arXiv:2502.19385. Li et al., "Branch-Train-Merge: Embarrassingly Parallel Training of Expert
  Language Models", 2022, arXiv:2208.03306 (the posterior mixture and the cached prior).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

RULES = ("simple_avg", "uniform_prior", "cached_prior")


def uniform_log_prior(num_experts: int) -> jax.Array:
  """``log(1/E)`` for every expert: float32 ``[E]``."""
  return jnp.full((num_experts,), -jnp.log(float(num_experts)), jnp.float32)


@jax.jit
def simple_avg(logp_ExBxL: jax.Array) -> jax.Array:
  """The mean over experts of their log-probabilities: ``[B, L]``."""
  return jnp.mean(logp_ExBxL, axis=0)


@jax.jit
def log_posterior(logp_ExBxL: jax.Array, log_prior_E: jax.Array) -> jax.Array:
  """``log w_{e,b,t}``, each expert's posterior given the prefix ``x_{b,<t}``: ``[E, B, L]``.

  Args:
    logp_ExBxL: the experts' log-probabilities of the tokens.
    log_prior_E: log prior over experts (need not be normalised).

  Returns:
    Log weights that sum (in probability) to one over experts at every (b, t).
  """
  prefix_ExBxL = jnp.cumsum(logp_ExBxL, axis=-1) - logp_ExBxL  # sum over s < t
  scores_ExBxL = prefix_ExBxL + log_prior_E[:, None, None]
  return scores_ExBxL - jax.nn.logsumexp(scores_ExBxL, axis=0, keepdims=True)


@jax.jit
def posterior_mixture(logp_ExBxL: jax.Array, log_prior_E: jax.Array) -> jax.Array:
  """The ensemble's log-probabilities under the posterior weights: ``[B, L]``."""
  return jax.nn.logsumexp(log_posterior(logp_ExBxL, log_prior_E) + logp_ExBxL, axis=0)


@jax.jit
def cached_log_prior(seq_logp_ExN: jax.Array, decay: float) -> jax.Array:
  """The cached prior from n dev sequences (module docstring): normalised log prior ``[E]``.

  Args:
    seq_logp_ExN: ``l_{j,e}``, expert e's total log-likelihood of dev sequence j.
    decay: d, the factor of the old prior at sequence j is ``d**j`` (j from 1).

  Returns:
    ``log softmax(log pi)`` after the n sequences.
  """
  E, n = seq_logp_ExN.shape
  log_decay = jnp.log(jnp.asarray(decay, jnp.float32))

  def fold(log_pi_E, j_and_l):
    j, l_E = j_and_l
    log_post_E = jax.nn.log_softmax(log_pi_E + l_E)
    return jnp.logaddexp(j * log_decay + log_pi_E, log_post_E), None

  steps = (jnp.arange(1, n + 1, dtype=jnp.float32), seq_logp_ExN.T.astype(jnp.float32))
  log_pi_E, _ = jax.lax.scan(fold, jnp.zeros((E,), jnp.float32), steps)
  return jax.nn.log_softmax(log_pi_E)


def mix(rule: str, logp_ExBxL: jax.Array, log_prior_E: jax.Array | None = None) -> jax.Array:
  """The ensemble's token log-probabilities ``[B, L]`` under ``rule``.

  Args:
    rule: one of `RULES`.
    logp_ExBxL: the experts' log-probabilities of the tokens.
    log_prior_E: ``cached_prior`` only: the prior from `cached_log_prior`.
  """
  if rule == "simple_avg":
    return simple_avg(logp_ExBxL)
  if rule == "uniform_prior":
    return posterior_mixture(logp_ExBxL, uniform_log_prior(logp_ExBxL.shape[0]))
  if rule == "cached_prior":
    if log_prior_E is None:
      raise ValueError("cached_prior needs log_prior_E (from cached_log_prior)")
    return posterior_mixture(logp_ExBxL, log_prior_E)
  raise ValueError(f"unknown mixing rule {rule!r}: choose one of {', '.join(RULES)}")


@functools.partial(jax.jit, static_argnames=("rule",))
def next_token_log_probs(
  rule: str, logp_ExBxV: jax.Array, prefix_ExB: jax.Array, log_prior_E: jax.Array
) -> jax.Array:
  """The ensemble's next-token distribution for sampling: normalised log-probabilities ``[B, V]``.

  Args:
    rule: one of `RULES`; ``simple_avg`` renormalises the mean log-probabilities over the
      vocabulary (a distribution to sample from), the posterior rules weight the experts by
      ``log_prior_E + prefix_ExB``.
    logp_ExBxV: each expert's next-token log-probabilities.
    prefix_ExB: each expert's log-likelihood of the sequence so far.
    log_prior_E: the prior (uniform for ``uniform_prior`` and ``simple_avg``).
  """
  if rule == "simple_avg":
    return jax.nn.log_softmax(jnp.mean(logp_ExBxV, axis=0), axis=-1)
  scores_ExB = prefix_ExB + log_prior_E[:, None]
  log_w_ExB = scores_ExB - jax.nn.logsumexp(scores_ExB, axis=0, keepdims=True)
  return jax.nn.logsumexp(log_w_ExB[..., None] + logp_ExBxV, axis=0)
