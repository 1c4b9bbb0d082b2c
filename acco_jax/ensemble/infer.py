"""Ensemble inference: the experts' token log-probabilities, perplexities, and sampling.

The experts are independent models (possibly of different sizes) over one vocabulary. Each scores
rows of tokens once (`token_log_probs`); the mixing rules of `acco_jax.ensemble.mixing` then
combine the ``[E, B, L]`` log-probabilities. `generate` samples from the mixture token by token.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax import model
from acco_jax.ensemble import mixing


@functools.partial(jax.jit, static_argnames=("cfg",))
def _row_log_probs(params, cfg: model.ModelConfig, rows_BxS):
  logits_BxLxV = model.apply(params, cfg, rows_BxS[:, :-1])
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
  return jnp.take_along_axis(logp_BxLxV, rows_BxS[:, 1:, None], axis=-1)[..., 0]


def token_log_probs(params, cfg: model.ModelConfig, rows_BxS: np.ndarray, chunk: int = 32):
  """``log p(row[t+1] | row[:t+1])`` for every row of ``S = L + 1`` tokens: float32 ``[B, L]``."""
  rows_BxS = np.asarray(rows_BxS, np.int32)
  out = []
  for start in range(0, len(rows_BxS), chunk):
    part = rows_BxS[start : start + chunk]
    pad = chunk - len(part)  # one compiled shape
    padded = np.pad(part, ((0, pad), (0, 0))) if pad else part
    out.append(np.asarray(_row_log_probs(params, cfg, padded))[: len(part)])
  return np.concatenate(out) if out else np.zeros((0, rows_BxS.shape[1] - 1), np.float32)


def perplexity(logp_BxL) -> float:
  """``exp(-mean log p)`` over every token."""
  return math.exp(min(-float(np.mean(np.asarray(logp_BxL, np.float64))), 50.0))


def ensemble_perplexities(
  logp_ExBxL: np.ndarray, dev_logp_ExN: np.ndarray | None, rules: Sequence[str], decay: float
) -> tuple[dict[str, float], list[float] | None]:
  """Perplexity of each rule on the rows scored in ``logp_ExBxL``, and the cached prior.

  Args:
    logp_ExBxL: the experts' token log-probabilities on the evaluation rows.
    dev_logp_ExN: the experts' total log-likelihood of each dev sequence (cached prior).
    rules: mixing rules to evaluate.
    decay: the cached prior's decay.

  Returns:
    ``({rule: perplexity}, cached prior probabilities or None)``.
  """
  logp = jnp.asarray(logp_ExBxL, jnp.float32)
  log_prior = None
  if "cached_prior" in rules:
    log_prior = mixing.cached_log_prior(jnp.asarray(dev_logp_ExN, jnp.float32), decay)
  ppl = {rule: perplexity(mixing.mix(rule, logp, log_prior)) for rule in rules}
  return ppl, None if log_prior is None else np.exp(np.asarray(log_prior)).tolist()


@functools.partial(jax.jit, static_argnames=("cfg",))
def _last_log_probs(params, cfg: model.ModelConfig, window_BxL, last):
  return jax.nn.log_softmax(model.apply(params, cfg, window_BxL)[:, last], axis=-1)


def generate(
  experts: Sequence[tuple[dict, model.ModelConfig]],
  prompt_tokens,
  num_new: int,
  key,
  *,
  rule: str = "uniform_prior",
  log_prior=None,
  temperature: float = 1.0,
) -> np.ndarray:
  """Samples ``num_new`` tokens from the ensemble after a prompt (full context re-run per token).

  The posterior rules weight each expert by its prior times its likelihood of everything so far
  (the prompt included); ``simple_avg`` samples from the renormalised mean log-probabilities.

  Args:
    experts: ``(params, cfg)`` of each expert; the configs share V.
    prompt_tokens: int ids ``[T]``, T >= 1.
    num_new: tokens to sample.
    key: PRNG key or int seed.
    rule: a mixing rule (`mixing.RULES`).
    log_prior: ``[E]`` log prior (``cached_prior``); uniform otherwise.
    temperature: softmax temperature; <= 0 is greedy.

  Returns:
    int32 ``[T + num_new]``.
  """
  if rule not in mixing.RULES:
    raise ValueError(f"unknown mixing rule {rule!r}: choose one of {', '.join(mixing.RULES)}")
  E = len(experts)
  L = min(cfg.L for _, cfg in experts)
  tokens = [int(t) for t in np.asarray(prompt_tokens).reshape(-1)]
  if not tokens:
    raise ValueError("generate needs a prompt of at least one token")
  prior = mixing.uniform_log_prior(E) if log_prior is None else jnp.asarray(log_prior, jnp.float32)
  prefix_E = np.zeros(E, np.float32)  # each expert's log-likelihood of tokens[1:]
  if len(tokens) > 1:
    rows = np.asarray([tokens[-(L + 1) :]], np.int32)
    prefix_E = np.array([token_log_probs(p, c, rows, chunk=1).sum() for p, c in experts])
  key = key if isinstance(key, jax.Array) else jax.random.key(key)
  for i in range(num_new):
    window = tokens[-L:]
    padded = np.zeros((1, L), np.int32)
    padded[0, : len(window)] = window
    logp_ExBxV = jnp.stack([_last_log_probs(p, c, padded, len(window) - 1) for p, c in experts])
    mixed_BxV = mixing.next_token_log_probs(rule, logp_ExBxV, jnp.asarray(prefix_E)[:, None], prior)
    if temperature <= 0:
      token = int(jnp.argmax(mixed_BxV[0]))
    else:
      token = int(jax.random.categorical(jax.random.fold_in(key, i), mixed_BxV[0] / temperature))
    prefix_E = prefix_E + np.asarray(logp_ExBxV[:, 0, token])
    tokens.append(token)
  return np.asarray(tokens, np.int32)
