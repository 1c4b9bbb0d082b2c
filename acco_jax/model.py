"""The model interface every family uses: one decoder-only transformer of any architecture, as pure
functions of a nested dict of float32 parameters.

An architecture (``cfg.arch``: ``gpt2``, ``gpt_neo``, ``llama``; :mod:`acco_jax.models`) is three
pieces, and this module composes them: :func:`embed` (token ids to the residual stream),
:func:`block` (one of the N transformer blocks) and :func:`head_logits` (final norm and output
projection). The parameter dict is ``{'blocks': {'0': ..., 'N-1': ...}, **shared}``: the blocks
under ``'blocks'``, the embeddings, final norm and an untied head in the rest (:func:`shared`).
That key is the one name the families know; pipelines run the pieces apart
(:mod:`acco_jax.layers`), the data-parallel and low-communication families only call
:func:`loss_fn`. Flax NNX modules define each piece's parameters and computation; outside them
everything is a pytree.

Parameters are float32 "master" weights; :func:`apply` casts them (float32 or bfloat16 on input)
to ``cfg.dtype`` and returns float32 logits. The head returns logits in ``cfg.dtype`` (so its
backward GEMMs stay there too); :func:`loss_fn` takes the log-softmax in float32 in a fused
cross-entropy (:mod:`acco_jax.losses`). ``vocab_multiple`` pads the embedding/head rows to
``padded_vocab``: zero rows, ignored by the loss, never returned by :func:`apply` or sampled by
:func:`acco_jax.sampling.generate` (docs/design.md, "The head, the loss and the data feed").

Usage:
  cfg = model.get_config('gpt2', dtype='bfloat16', remat=True)   # or arch='llama', 'gpt_neo'
  params = model.init_params(cfg, 0)
  loss, aux = jax.jit(model.loss_fn, static_argnums=1)(params, cfg, batch)
  logits_BxLxV = model.apply(params, cfg, tokens_BxL)
  logits_BxV, cache = model.apply_cached(params, cfg, prompt_BxP, positions_BxP, length=256,
                                         last_B=last_B)  # generation: acco_jax.sampling
  tx = optax.adamw(3e-4, weight_decay=0.1, mask=model.decay_mask(params))

Sizes: ``SIZES[arch]`` (:func:`sizes`); each architecture's module lists its presets and
parameter layout.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from acco_jax import errors, losses, models
from acco_jax.models.base import Context as Context
from acco_jax.models.base import KVCache as KVCache
from acco_jax.models.base import ModelConfig as ModelConfig
from acco_jax.models.base import attention_impl as attention_impl
from acco_jax.models.base import context as context

Params = dict[str, Any]
BLOCKS = "blocks"  # the key of the blocks in every architecture's parameter dict


def sizes(arch: str = "gpt2") -> dict[str, dict[str, Any]]:
  """The named presets of ``arch``."""
  return models.get(arch).SIZES


SIZES = sizes("gpt2")  # GPT-2's presets (tiny, tinystories-36m, gpt2, gpt2-medium)


def get_config(name: str, arch: str = "gpt2", **overrides) -> ModelConfig:
  """Returns the config of a named size of ``arch``, with fields replaced by ``overrides``.

  Args:
    name: a preset of the architecture (``sizes(arch)``), e.g. ``'tiny'``, ``'gpt2'``, ``'2.7b'``.
    arch: ``gpt2``, ``gpt_neo`` or ``llama``.
    **overrides: ``ModelConfig`` fields to set, e.g. ``dtype='float32', remat=True``.
  """
  presets = sizes(arch)
  if name not in presets:
    raise errors.UserValueError(
      f"unknown model size {name!r} for model.arch={arch}; known sizes: {', '.join(presets)}"
    )
  return ModelConfig(**{**presets[name], "arch": arch, **overrides})


def to_key(seed_or_key) -> jax.Array:
  """Typed PRNG key from an int seed (also traced), a typed key or a raw uint32[2] key."""
  x = seed_or_key
  if isinstance(x, int | np.integer):
    return jax.random.key(int(x))
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x
  if x.dtype == jnp.uint32 and x.shape == (2,):
    return jax.random.wrap_key_data(x)
  return jax.random.key(x)  # integer scalar seed, e.g. a jit argument


def _pure(module) -> Params:
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def init_params(cfg: ModelConfig, seed_or_key) -> Params:
  """Initialises the parameters (each architecture's scheme) as a nested dict of float32 arrays.

  Works under ``jax.jit`` and ``jax.eval_shape``, e.g. ``jax.eval_shape(lambda: init_params(cfg,
  0))``. The layout is given in the architecture's module (:mod:`acco_jax.models.gpt2`, ...).
  """
  arch = models.get(cfg.arch)
  rngs = nnx.Rngs(params=to_key(seed_or_key))
  shared = _pure(arch.Shared(cfg, rngs=rngs))
  blocks = {str(i): _pure(arch.Block(cfg, rngs=rngs)) for i in range(cfg.N)}
  return {**shared, BLOCKS: blocks}


def param_shapes(cfg: ModelConfig) -> Params:
  """:func:`init_params`'s tree as ``jax.ShapeDtypeStruct``s (a copy), traced once per config."""
  return jax.tree.map(lambda s: s, _param_shapes(cfg))


@functools.lru_cache(maxsize=32)
def _param_shapes(cfg: ModelConfig) -> Params:
  return jax.eval_shape(lambda: init_params(cfg, 0))


def shared(params: Params) -> Params:
  """Everything but the blocks: embeddings, final norm, an untied head."""
  return {k: v for k, v in params.items() if k != BLOCKS}


@functools.lru_cache(maxsize=32)
def _graphdefs(cfg: ModelConfig):
  """Graph definitions of the shared module and of one block (abstract, nothing allocated)."""
  arch = models.get(cfg.arch)
  shared_def, _ = nnx.split(nnx.eval_shape(lambda: arch.Shared(cfg, rngs=nnx.Rngs(0))))
  block_def, _ = nnx.split(nnx.eval_shape(lambda: arch.Block(cfg, rngs=nnx.Rngs(0))))
  return shared_def, block_def


def _cast(tree, cfg: ModelConfig):
  dt = jnp.dtype(cfg.dtype)
  return jax.tree.map(lambda p: jnp.asarray(p).astype(dt), tree)


def embed(shared_params: Params, cfg: ModelConfig, tokens_BxL, ctx=None, key=None) -> jax.Array:
  """Token ids (and positions: ``ctx``, default 0..L-1) to the residual stream, [B, L, D] in the
  compute dtype; ``key``: embedding dropout."""
  ctx = context(tokens_BxL) if ctx is None else ctx
  shared_def, _ = _graphdefs(cfg)
  return nnx.merge(shared_def, _cast(shared_params, cfg)).embed(tokens_BxL, ctx, key)


def block(block_params: Params, cfg: ModelConfig, x_BxLxD, ctx: Context, key=None) -> jax.Array:
  """Block ``ctx.layer`` of the model (its parameters ``block_params``) applied to ``x_BxLxD``."""
  _, block_def = _graphdefs(cfg)
  return nnx.merge(block_def, _cast(block_params, cfg))(x_BxLxD, ctx, key)


def head_logits(shared_params: Params, cfg: ModelConfig, x_BxLxD) -> jax.Array:
  """Final norm and output projection: logits over the padded vocabulary, in the compute dtype."""
  shared_def, _ = _graphdefs(cfg)
  return nnx.merge(shared_def, _cast(shared_params, cfg)).head(x_BxLxD)


def _flat_shapes(tree) -> dict[str, tuple[int, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): tuple(x.shape) for path, x in leaves}


@functools.lru_cache(maxsize=32)
def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  return _flat_shapes(_param_shapes(cfg))


def check_params(params: Params, cfg: ModelConfig) -> None:
  """Raises ``ValueError`` naming the leaves where ``params`` is not ``cfg``'s tree (a merge of a
  mismatched dict would otherwise be accepted silently)."""
  shapes, got = _expected_shapes(cfg), _flat_shapes(params)
  if got != shapes:
    bad = sorted(k for k in shapes.keys() | got.keys() if shapes.get(k) != got.get(k))
    raise ValueError(
      f"params do not match {cfg}; differing leaves (expected vs got): "
      + ", ".join(f"{k}: {shapes.get(k)} vs {got.get(k)}" for k in bad[:4])
    )


def _logits(
  params: Params,
  cfg: ModelConfig,
  tokens_BxL,
  rng=None,
  deterministic: bool = True,
  positions_BxL=None,
  segments_BxL=None,
):
  """Logits over the padded vocabulary, in the compute dtype: [B, L', padded_vocab]."""
  check_params(params, cfg)
  if tokens_BxL.ndim != 2 or tokens_BxL.shape[1] > cfg.L:
    raise ValueError(f"tokens must be [B, L<={cfg.L}], got shape {tokens_BxL.shape}")
  use_dropout = not deterministic and cfg.dropout > 0
  if use_dropout and rng is None:
    raise ValueError("apply(deterministic=False) with cfg.dropout > 0 needs an rng key")
  keys = jax.random.split(to_key(rng), cfg.N + 1) if use_dropout else [None] * (cfg.N + 1)
  ctx = context(tokens_BxL, 0, positions_BxL, segments_BxL)
  x_BxLxD = embed(shared(params), cfg, tokens_BxL, ctx, keys[-1])

  def run(block_params, x_BxLxD, positions_BxL, segments_BxL, key, layer: int):
    return block(block_params, cfg, x_BxLxD, Context(layer, positions_BxL, segments_BxL), key)

  if cfg.remat:
    run = jax.checkpoint(run, static_argnums=(5,))
  for i in range(cfg.N):
    x_BxLxD = run(params[BLOCKS][str(i)], x_BxLxD, ctx.positions_BxL, segments_BxL, keys[i], i)
  return head_logits(shared(params), cfg, x_BxLxD)


def apply(
  params: Params,
  cfg: ModelConfig,
  tokens_BxL,
  *,
  rng=None,
  deterministic: bool = True,
  positions_BxL=None,
  segments_BxL=None,
):
  """Forward pass: token ids to next-token logits over the real vocabulary.

  Args:
    params: parameter dict from ``init_params``; float32 or bfloat16 (any float dtype) leaves,
      cast to ``cfg.dtype`` here.
    cfg: model config (static under jit).
    tokens_BxL: int token ids of shape [B, L'] with L' <= cfg.L.
    rng: PRNG key for dropout; needed only if ``deterministic=False`` and ``cfg.dropout > 0``.
    deterministic: if True, no dropout.
    positions_BxL, segments_BxL: packed rows (several examples a row): each token's position in
      its example and the example's id; attention stays within an example. Default: one
      sequence a row from position 0.

  Returns:
    float32 logits of shape [B, L', V] (the padded ids are dropped); position t depends on
    tokens 0..t only (of its own segment).
  """
  logits = _logits(params, cfg, tokens_BxL, rng, deterministic, positions_BxL, segments_BxL)
  return logits[..., : cfg.V].astype(jnp.float32)


Cache = tuple[tuple[jax.Array, jax.Array], ...]  # each block's (keys, values), [B, C, G, K] each


def apply_cached(
  params: Params,
  cfg: ModelConfig,
  tokens_BxL,
  positions_BxL,
  cache: Cache | None = None,
  *,
  length: int | None = None,
  last_B=None,
) -> tuple[jax.Array, Cache]:
  """Forward pass of new tokens that attend to the keys and values of earlier ones (generation).

  The first call (``cache`` None) runs the prompt and keeps every block's keys and values at
  ``length`` positions; each next call runs the new tokens (one a row, typically) at their
  positions and extends the cache. A row's token at position ``p`` sees the cached positions
  ``0..p``: those must hold that row's earlier tokens (a row's padding after its last token is
  overwritten by its next ones, never seen). No dropout, no packed rows; :func:`apply` is the
  training path and stays untouched.

  Args:
    params: parameter dict.
    cfg: model config (static under jit).
    tokens_BxL: int token ids [B, L].
    positions_BxL: int32 position of each token, below the cache's length.
    cache: the previous call's cache, or None to start one.
    length: positions the new cache holds (with ``cache`` None), at most ``cfg.L``.
    last_B: if given, the logits only at position ``last_B[b]`` of each row's L tokens.

  Returns:
    (float32 logits [B, L, V], or [B, V] with ``last_B``; the cache with the new tokens).
  """
  check_params(params, cfg)
  if cache is None and (length is None or not 0 < length <= cfg.L):
    raise ValueError(f"a new cache needs a length in [1, {cfg.L}], got {length}")
  positions_BxL = jnp.asarray(positions_BxL, jnp.int32)
  x_BxLxD = embed(shared(params), cfg, tokens_BxL, Context(0, positions_BxL))
  out = []
  for i in range(cfg.N):
    kv = (None, None) if cache is None else cache[i]
    held = KVCache(positions_BxL, length, *kv)
    x_BxLxD = block(params[BLOCKS][str(i)], cfg, x_BxLxD, Context(i, positions_BxL, None, held))
    out.append((held.k_BxCxGxK, held.v_BxCxGxK))
  if last_B is not None:  # [B, 1, D]: the head only where logits are wanted
    x_BxLxD = jnp.take_along_axis(x_BxLxD, jnp.asarray(last_B)[:, None, None], axis=1)
  logits = head_logits(shared(params), cfg, x_BxLxD)[..., : cfg.V].astype(jnp.float32)
  return (logits if last_B is None else logits[:, 0]), tuple(out)


def grow_cache(cache: Cache, length: int) -> Cache:
  """``cache`` with room for ``length`` positions (zeros after the held ones)."""
  pad = lambda a: jnp.pad(a, ((0, 0), (0, length - a.shape[1]), (0, 0), (0, 0)))
  return jax.tree.map(pad, cache)


def loss_fn(params: Params, cfg: ModelConfig, batch: dict[str, jax.Array], *, rng=None):
  """Mean next-token cross-entropy over the weighted tokens of a batch.

  The logits stay in the compute dtype; the log-softmax is taken in float32 by
  ``acco_jax.losses.token_cross_entropy`` (fused, padded ids excluded).

  Args:
    params: parameter dict.
    cfg: model config (static under jit).
    batch: {'inputs': int32 [B, L], 'targets': int32 [B, L], optional 'weights': float32 [B, L]
      (0 = ignore the token; defaults to all ones), optional 'positions' and 'segments' int32
      [B, L] (packed rows: see :func:`apply`)}.
    rng: if given (and cfg.dropout > 0), dropout is applied with this key.

  Returns:
    (loss, aux): loss = loss_sum / tokens (0 when no token is weighted), a float32 scalar;
    aux = {'tokens': sum of weights, 'loss_sum': weighted sum of token losses}, float32 scalars,
    so that sums over microbatches or devices give the exact global mean.
  """
  logits_BxLxV = _logits(
    params,
    cfg,
    batch["inputs"],
    rng,
    deterministic=rng is None,
    positions_BxL=batch.get("positions"),
    segments_BxL=batch.get("segments"),
  )
  return loss_from_logits(cfg, logits_BxLxV, batch)


def loss_from_logits(cfg: ModelConfig, logits_BxLxV, batch: dict[str, jax.Array]):
  """``loss_fn``'s loss and aux from logits over the padded vocabulary (compute dtype)."""
  targets_BxL = batch["targets"]
  weights_BxL = batch.get("weights")
  if weights_BxL is None:
    weights_BxL = jnp.ones(targets_BxL.shape, jnp.float32)
  loss_sum, tokens = losses.weighted_cross_entropy(logits_BxLxV, targets_BxL, weights_BxL, cfg.V)
  loss = jnp.where(tokens > 0, loss_sum / jnp.maximum(tokens, 1e-9), 0.0)
  return loss, {"tokens": tokens, "loss_sum": loss_sum}


def decay_mask(params: Params) -> Params:
  """Weight-decay mask: True for every leaf with ndim >= 2 (GPT-2 / nanoGPT convention).

  Decayed: every weight matrix, the token and position embeddings and an untied head. Not
  decayed: biases and norm scales. The same rule for every architecture (their vectors are
  exactly their biases and norms). Works on arrays and on ``jax.eval_shape`` output.

  Returns:
    A tree of Python bools with the structure of ``params`` (usable as ``optax.adamw(mask=...)``).
  """
  return jax.tree.map(lambda p: len(p.shape) >= 2, params)


def muon_mask(params: Params) -> Params:
  """Muon's leaves: the blocks' weight matrices (every leaf of ndim >= 2 under ``blocks``).

  Embeddings, the head (tied or not), biases and norms are False (AdamW's, as in modded-nanogpt).
  """
  blocks = jax.tree.map(lambda p: len(p.shape) >= 2, params[BLOCKS])
  return {**jax.tree.map(lambda _: False, params), BLOCKS: blocks}


def num_params(params: Params) -> int:
  """Total number of parameters (works on arrays and on ShapeDtypeStructs)."""
  return sum(math.prod(p.shape) for p in jax.tree.leaves(params))


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
  """Training FLOPs per token (forward + backward = 3 x forward) for MFU.

  6 x (the weights every token multiplies: the blocks' matrices and the head) + 12 N D seq_len
  for the attention scores and weighted values (PaLM convention: the full seq_len x seq_len
  square, not halved for causality). Biases, norms and the embedding lookups are ignored. V is
  the real vocabulary, not ``padded_vocab``: the padded columns are work the model does not
  need, so MFU does not count them.

  Args:
    cfg: model config.
    seq_len: training sequence length; defaults to cfg.L.
  """
  return models.get(cfg.arch).flops_per_token(cfg, cfg.L if seq_len is None else seq_len)
