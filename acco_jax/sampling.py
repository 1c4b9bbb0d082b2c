"""Sampling from the model of :mod:`acco_jax.model`: :func:`generate` (the run's ``sample.txt``) and
:func:`greedy` (replies to held-out prompts).

Both run the prompt once and then one token a step against a key/value cache
(:func:`acco_jax.model.apply_cached`). The cache holds :func:`cache_length` positions: ``bucket``,
then twice that, and so on up to the window, so a reply compiles one program per length it
reaches, not one per token. ``cache=False`` re-runs the whole window for every token (the
reference the cache is tested and benchmarked against).

Padded vocabulary rows (``vocab_multiple``) are never sampled: :func:`acco_jax.model.apply` does not
return them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax import model

BUCKET = 128  # the cache's first length; it doubles as a reply outgrows it


def cache_length(n: int, cap: int, bucket: int = BUCKET) -> int:
  """Positions of a cache that holds ``n``: ``bucket`` doubled until it does, at most ``cap``."""
  length = bucket
  while length < n:
    length *= 2
  return min(length, cap)


def _pick(logits_BxV, key, temperature, top_k, greedy):
  if greedy:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV / temperature
  if top_k is not None:
    kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "top_k", "greedy"))
def _sample_next(params, cfg, window_BxW, last_B, key, temperature, top_k, greedy):
  """The next token of each row from a forward over its whole window (no cache)."""
  logits_BxWxV = model.apply(params, cfg, window_BxW)
  logits_BxV = jnp.take_along_axis(logits_BxWxV, last_B[:, None, None], axis=1)[:, 0]
  return _pick(logits_BxV, key, temperature, top_k, greedy)


@functools.partial(
  jax.jit, static_argnames=("cfg", "length", "top_k", "greedy"), donate_argnames=("cache",)
)
def _cached_next(
  params, cfg, tokens_BxL, positions_BxL, last_B, cache, length, key, temperature, top_k, greedy
):
  """The next token of each row after its tokens at ``positions_BxL`` (logits at ``last_B``), and
  the cache that holds them: the prompt's pass (``cache`` None) or one step."""
  logits_BxV, cache = model.apply_cached(
    params, cfg, tokens_BxL, positions_BxL, cache, length=length, last_B=last_B
  )
  return _pick(logits_BxV, key, temperature, top_k, greedy), cache


class _Decoder:
  """Rows of tokens at positions ``0..length_B[b]-1`` in a growing cache of at most ``cap``."""

  def __init__(self, params, cfg, cap: int, bucket: int, pick: dict):
    self.params, self.cfg, self.cap, self.bucket, self.pick = params, cfg, cap, bucket, pick
    self.cache = None

  def prompt(self, tokens_BxP, length_B, key):
    """Runs the prompts (row b's first ``length_B[b]`` tokens); the next token of each row."""
    P = cache_length(tokens_BxP.shape[1], self.cap, self.bucket)  # one program per bucket
    padded_BxP = np.zeros((tokens_BxP.shape[0], P), np.int32)
    padded_BxP[:, : tokens_BxP.shape[1]] = tokens_BxP[:, :P]
    positions_BxP = np.broadcast_to(np.arange(P, dtype=np.int32), padded_BxP.shape)
    self.length = cache_length(int(np.max(length_B)) + 1, self.cap, self.bucket)
    nxt_B, self.cache = _cached_next(
      self.params, self.cfg, padded_BxP, positions_BxP, jnp.asarray(length_B - 1), None,
      self.length, key, **self.pick,
    )  # fmt: skip
    return nxt_B

  def step(self, token_B, position_B, key):
    """Feeds each row's token at its position (below ``cap``); the next token of each row."""
    needed = int(np.max(position_B)) + 1
    if needed > self.length:
      self.length = cache_length(needed, self.cap, self.bucket)
      self.cache = model.grow_cache(self.cache, self.length)
    zeros_B = jnp.zeros(len(token_B), jnp.int32)
    nxt_B, self.cache = _cached_next(
      self.params, self.cfg, np.asarray(token_B, np.int32)[:, None],
      np.asarray(position_B, np.int32)[:, None], zeros_B, self.cache, None, key, **self.pick,
    )  # fmt: skip
    return nxt_B


def generate(
  params,
  cfg,
  prompt_tokens,
  num_new,
  key,
  temperature=1.0,
  top_k=None,
  window=None,
  *,
  cache: bool = True,
  bucket: int = BUCKET,
):
  """Samples `num_new` tokens after a prompt.

  The prompt runs once, then each token is one step against the key/value cache, while the
  sequence fits the window. Past ``window`` tokens each step re-runs the last ``window`` tokens
  over a fixed ``[B, window]`` array (positions restart in the window, which a cache cannot
  give), as every step does with ``cache=False`` (padded on the right while shorter; causality
  makes the padding irrelevant, so it compiles once).

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
    cache: use the key/value cache (False: the whole window every token).
    bucket: the cache's first length (:func:`cache_length`).

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
  pick = dict(temperature=temperature, top_k=top_k, greedy=temperature <= 0)
  decoder = _Decoder(params, cfg, W, bucket, pick) if cache else None
  for i in range(num_new):
    n = T + i
    step_key = jax.random.fold_in(key, i)
    if decoder is not None and n <= W and i == 0:
      out_BxS[:, n] = decoder.prompt(tokens_BxT, np.full(B, T), step_key)
    elif decoder is not None and n <= W:
      out_BxS[:, n] = decoder.step(out_BxS[:, n - 1], np.full(B, n - 1), step_key)
    else:
      seen = out_BxS[:, max(0, n - W) : n]
      padded_BxW = np.pad(seen, ((0, 0), (0, W - seen.shape[1])))
      last_B = jnp.full(B, seen.shape[1] - 1)
      out_BxS[:, n] = _sample_next(params, cfg, padded_BxW, last_B, step_key, **pick)
  return jnp.asarray(out_BxS[0] if prompt.ndim == 1 else out_BxS)


def greedy(
  params,
  cfg,
  prompts,
  max_new: int,
  stop_id,
  window: int | None = None,
  *,
  cache: bool = True,
  bucket: int = BUCKET,
):
  """Greedy replies to a batch of prompts of different lengths, each until a stop id (not
  included) or ``max_new`` tokens.

  Each row holds its prompt from position 0 and grows on the right (a row's padding lies after
  its last token, never seen by it). The prompts run once, then one token a row a step against
  the key/value cache; with ``cache=False`` every step is a forward over the whole ``[B, window]``
  array (compiled once). A prompt longer than ``window - max_new`` keeps its last tokens.

  Args:
    params: parameter dict.
    cfg: model config.
    prompts: B lists of token ids, each at least one.
    max_new: the longest reply.
    stop_id: the id that ends a reply (the tokenizer's end-of-text), or a collection of them (a
      chat template's end-of-turn too); an empty prompt is read as the first of them.
    window: tokens of context, at most (default) ``cfg.L``.
    cache: use the key/value cache (False: the whole window every token).
    bucket: the cache's first length (:func:`cache_length`).

  Returns:
    B lists of generated ids.
  """
  stops = {int(stop_id)} if np.ndim(stop_id) == 0 else {int(i) for i in stop_id}
  first_stop = int(stop_id) if np.ndim(stop_id) == 0 else int(next(iter(stop_id)))
  W = cfg.L if window is None else min(int(window), cfg.L)
  keep = max(1, W - max_new)
  rows = [list(p)[-keep:] or [first_stop] for p in prompts]
  length_B = np.array([len(p) for p in rows], np.int32)
  tokens_BxW = np.zeros((len(rows), W), np.int32)
  for b, p in enumerate(rows):
    tokens_BxW[b, : len(p)] = p
  pick = dict(temperature=1.0, top_k=None, greedy=True)
  decoder = _Decoder(params, cfg, W, bucket, pick) if cache else None
  replies, done = [[] for _ in rows], np.zeros(len(rows), bool)
  for i in range(max_new):
    if decoder is None:
      nxt_B = _sample_next(params, cfg, tokens_BxW, jnp.asarray(length_B - 1), None, **pick)
    elif i == 0:
      nxt_B = decoder.prompt(tokens_BxW[:, : int(length_B.max())], length_B, None)
    else:
      last_B = tokens_BxW[np.arange(len(rows)), length_B - 1]
      nxt_B = decoder.step(last_B, length_B - 1, None)
    nxt_B = np.asarray(nxt_B)
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
