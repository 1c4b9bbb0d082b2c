"""HDEE mixing rules against NumPy references written here, and ensemble inference on a tiny GPT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import model, sampling
from acco_jax.ensemble import infer, mixing

# float32 JAX against float64 NumPy loops: agreement to float32 rounding of sums over <= 24 terms
TOL = dict(rtol=1e-5, atol=1e-5)


def _logp(E=3, B=2, L=6, seed=0):
  """Log-probabilities of observed tokens (each a log of a number in (0, 1))."""
  return np.log(np.random.default_rng(seed).uniform(0.01, 0.9, size=(E, B, L)))


def ref_posterior_mixture(logp, prior):
  """Token by token in probability space: w_e,t ∝ prior_e * prod_{s<t} p_e(x_s)."""
  p = np.exp(logp.astype(np.float64))
  E, B, L = p.shape
  out = np.zeros((B, L))
  for b in range(B):
    like = np.array(prior, np.float64)  # prior_e * likelihood of the prefix
    for t in range(L):
      w = like / like.sum()
      out[b, t] = np.log((w * p[:, b, t]).sum())
      like = like * p[:, b, t]
  return out


def ref_cached_prior(seq_logp, decay):
  """The running unnormalised prior of the module docstring, in probability space."""
  E, n = seq_logp.shape
  pi = np.ones(E)
  for j in range(1, n + 1):
    post = pi * np.exp(seq_logp[:, j - 1].astype(np.float64))
    post /= post.sum()
    pi = decay**j * pi + post
  return pi / pi.sum()


def test_simple_avg_is_the_mean_log_probability():
  logp = _logp()
  np.testing.assert_allclose(mixing.mix("simple_avg", jnp.asarray(logp)), logp.mean(0), **TOL)


@pytest.mark.parametrize("prior", [[1 / 3] * 3, [0.7, 0.2, 0.1]])
def test_posterior_mixture_updates_token_by_token(prior):
  logp = _logp()
  got = mixing.posterior_mixture(jnp.asarray(logp, jnp.float32), jnp.log(jnp.asarray(prior)))
  np.testing.assert_allclose(got, ref_posterior_mixture(logp, prior), **TOL)
  uniform = mixing.mix("uniform_prior", jnp.asarray(logp, jnp.float32))
  np.testing.assert_allclose(uniform, ref_posterior_mixture(logp, [1 / 3] * 3), **TOL)


def test_posterior_weights_follow_the_likelier_expert():
  """Expert 0 assigns 0.9 to every token, expert 1 0.1: the weight of expert 0 rises to 1."""
  logp = np.log(np.array([[[0.9] * 8], [[0.1] * 8]]))
  w = np.exp(np.asarray(mixing.log_posterior(jnp.asarray(logp), mixing.uniform_log_prior(2))))
  np.testing.assert_allclose(w[:, 0, 0], [0.5, 0.5], **TOL)
  np.testing.assert_allclose(w[0, 0, 1], 0.9, **TOL)  # 0.5*0.9 / (0.5*0.9 + 0.5*0.1)
  assert np.all(np.diff(w[0, 0]) > 0) and w[0, 0, -1] > 0.999


@pytest.mark.parametrize("decay", [0.3, 1.0])
def test_cached_prior_decays_old_posteriors(decay):
  seq = np.random.default_rng(1).normal(-40.0, 3.0, size=(3, 12))
  got = np.exp(np.asarray(mixing.cached_log_prior(jnp.asarray(seq, jnp.float32), decay)))
  np.testing.assert_allclose(got, ref_cached_prior(seq, decay), rtol=1e-4, atol=1e-6)
  cached = mixing.mix("cached_prior", jnp.asarray(_logp(), jnp.float32), jnp.log(jnp.asarray(got)))
  np.testing.assert_allclose(cached, ref_posterior_mixture(_logp(), got), **TOL)


def test_cached_prior_is_stable_for_long_sequences():
  """Sequence log-likelihoods of -1e4 would underflow in probability space; log space is fine."""
  seq = np.array([[-10000.0, -10000.0], [-10005.0, -10005.0]])
  got = np.exp(np.asarray(mixing.cached_log_prior(jnp.asarray(seq, jnp.float32), 0.3)))
  # a posterior does not change when every expert's log-likelihood of a sequence shifts equally
  # (float32 holds -1e4 to about 1e-3, so the prior agrees to about 1e-4)
  np.testing.assert_allclose(got, ref_cached_prior(seq - seq.max(0), 0.3), rtol=1e-4)
  assert got[0] > 0.9


@pytest.mark.parametrize("rule", mixing.RULES)
def test_one_expert_is_that_expert(rule):
  logp = _logp(E=1)
  np.testing.assert_allclose(mixing.mix(rule, jnp.asarray(logp), jnp.zeros(1)), logp[0], **TOL)


@pytest.mark.parametrize("rule", mixing.RULES)
def test_identical_experts_give_that_experts_perplexity(rule):
  one = _logp(E=1)
  logp = np.repeat(one, 4, axis=0)
  prior = jnp.log(jnp.asarray([0.1, 0.2, 0.3, 0.4]))
  assert infer.perplexity(mixing.mix(rule, jnp.asarray(logp), prior)) == pytest.approx(
    np.exp(-one.mean()), rel=1e-5
  )


def test_next_token_distribution_is_the_posterior_mixture():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(3, 2, 11))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  prefix = rng.normal(-5.0, 1.0, size=(3, 2))
  prior = np.array([0.5, 0.3, 0.2])
  w = prior[:, None] * np.exp(prefix)
  w /= w.sum(0)
  ref = np.log((w[..., None] * np.exp(logp)).sum(0))
  got = mixing.next_token_log_probs(
    "cached_prior", jnp.asarray(logp), jnp.asarray(prefix), jnp.log(jnp.asarray(prior))
  )
  np.testing.assert_allclose(got, ref, **TOL)
  avg = mixing.next_token_log_probs("simple_avg", jnp.asarray(logp), jnp.asarray(prefix), prior)
  m = logp.mean(0)
  np.testing.assert_allclose(avg, m - np.log(np.exp(m).sum(-1, keepdims=True)), **TOL)


def test_unknown_rule_is_refused():
  with pytest.raises(ValueError, match="unknown mixing rule 'mean'"):
    mixing.mix("mean", jnp.zeros((1, 1, 1)))


@pytest.fixture(scope="module")
def tiny_gpt():
  cfg = model.get_config("tiny", L=16, dtype="float32")
  return model.init_params(cfg, 0), model.init_params(cfg, 1), cfg


@pytest.mark.slow  # ~25 s: three models' log-probs against the loss
def test_token_log_probs_match_the_models_loss(tiny_gpt):
  params, _, cfg = tiny_gpt
  rows = np.random.default_rng(3).integers(0, cfg.V, size=(5, cfg.L + 1)).astype(np.int32)
  logp = infer.token_log_probs(params, cfg, rows, chunk=4)
  loss, _ = model.loss_fn(params, cfg, {"inputs": rows[:, :-1], "targets": rows[:, 1:]})
  assert logp.shape == (5, cfg.L)
  assert -logp.mean() == pytest.approx(float(loss), rel=1e-5)  # two computations: float32 rounding


def test_generate_from_identical_experts_is_that_experts_greedy_sample(tiny_gpt):
  params, other, cfg = tiny_gpt
  prompt = np.array([1, 2, 3], np.int32)
  single = np.asarray(sampling.generate(params, cfg, prompt, 6, jax.random.key(0), temperature=0))
  for rule in ("uniform_prior", "simple_avg"):
    both = infer.generate([(params, cfg), (params, cfg)], prompt, 6, 0, rule=rule, temperature=0)
    np.testing.assert_array_equal(both, single)  # argmax of the same distribution (no near-ties)
  mixed = infer.generate([(params, cfg), (other, cfg)], prompt, 6, 0, temperature=1.0)
  assert mixed.shape == (9,) and np.all((mixed >= 0) & (mixed < cfg.V))
