"""Sampling from the model of :mod:`acco_jax.model`: :func:`generate` (the run's ``sample.txt``).

Padded vocabulary rows (``vocab_multiple``) are never sampled: :func:`acco_jax.model.apply` does not
return them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax import model


@functools.partial(jax.jit, static_argnames=("cfg", "top_k", "greedy"))
def _sample_next(params, cfg, window_BxL, last, key, temperature, top_k, greedy):
  logits_BxV = model.apply(params, cfg, window_BxL)[:, last]
  if greedy:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV / temperature
  if top_k is not None:
    kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def generate(params, cfg, prompt_tokens, num_new, key, temperature=1.0, top_k=None, window=None):
  """Samples `num_new` tokens after a prompt (full context re-run each step; for short samples).

  Each step runs one jitted forward over a fixed [B, window] window (the last `window` tokens,
  padded on the right while shorter; causality makes the padding irrelevant), so it compiles once.

  Args:
    params: parameter dict.
    cfg: model config.
    prompt_tokens: int token ids, shape [T] or [B, T] with T >= 1.
    num_new: number of tokens to sample.
    key: PRNG key (or int seed); the same key gives the same sample.
    temperature: softmax temperature; <= 0 means greedy (argmax) decoding.
    top_k: if set, sample only among the top_k most likely tokens.
    window: tokens of context each step sees, at most (default) ``cfg.L`` (a pretrained model's
      2,048 positions cost each step a forward of that length).

  Returns:
    int32 array [T + num_new] or [B, T + num_new] (prompt followed by the sampled tokens).
  """
  prompt = np.asarray(prompt_tokens, np.int32)
  tokens_BxT = prompt[None] if prompt.ndim == 1 else prompt
  B, T = tokens_BxT.shape
  if T < 1:
    raise ValueError("generate needs a prompt of at least one token")
  out_BxS = np.zeros((B, T + num_new), np.int32)
  out_BxS[:, :T] = tokens_BxT
  key = model.to_key(key)
  W = cfg.L if window is None else min(int(window), cfg.L)
  for i in range(num_new):
    n = T + i
    seen = out_BxS[:, max(0, n - W) : n]
    padded_BxW = np.pad(seen, ((0, 0), (0, W - seen.shape[1])))
    step_key = jax.random.fold_in(key, i)
    out_BxS[:, n] = _sample_next(
      params, cfg, padded_BxW, seen.shape[1] - 1, step_key, temperature, top_k, temperature <= 0
    )
  return jnp.asarray(out_BxS[0] if prompt.ndim == 1 else out_BxS)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _greedy_next(params, cfg, tokens_BxW, last_B):
  logits_BxWxV = model.apply(params, cfg, tokens_BxW)
  return jnp.argmax(jnp.take_along_axis(logits_BxWxV, last_B[:, None, None], axis=1)[:, 0], -1)


def greedy(params, cfg, prompts, max_new: int, stop_id, window: int | None = None):
  """Greedy replies to a batch of prompts of different lengths, each until a stop id (not
  included) or ``max_new`` tokens.

  All prompts share one jitted forward over a ``[B, window]`` window: each row holds its prompt
  from position 0 and grows on the right (a row's padding lies after its last token, which
  causality makes irrelevant), so it compiles once. A prompt longer than ``window - max_new``
  keeps its last tokens.

  Args:
    params: parameter dict.
    cfg: model config.
    prompts: B lists of token ids, each at least one.
    max_new: the longest reply.
    stop_id: the id that ends a reply (the tokenizer's end-of-text), or a collection of them (a
      chat template's end-of-turn too); an empty prompt is read as the first of them.
    window: tokens of context, at most (default) ``cfg.L``.

  Returns:
    B lists of generated ids.
  """
  stops = {int(stop_id)} if np.ndim(stop_id) == 0 else {int(i) for i in stop_id}
  first_stop = int(stop_id) if np.ndim(stop_id) == 0 else int(next(iter(stop_id)))
  W = cfg.L if window is None else min(int(window), cfg.L)
  keep = max(1, W - max_new)
  tokens_BxW = np.zeros((len(prompts), W), np.int32)
  length_B = np.zeros(len(prompts), np.int32)
  for b, p in enumerate(prompts):
    p = list(p)[-keep:] or [first_stop]
    tokens_BxW[b, : len(p)] = p
    length_B[b] = len(p)
  replies, done = [[] for _ in prompts], np.zeros(len(prompts), bool)
  for _ in range(max_new):
    nxt_B = np.asarray(_greedy_next(params, cfg, tokens_BxW, jnp.asarray(length_B - 1)))
    for b in np.flatnonzero(~done):
      if int(nxt_B[b]) in stops or length_B[b] >= W:
        done[b] = True
        continue
      tokens_BxW[b, length_B[b]] = nxt_B[b]
      length_B[b] += 1
      replies[b].append(int(nxt_B[b]))
    if done.all():
      break
  return replies
