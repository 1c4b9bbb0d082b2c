"""GPT-2-style decoder-only transformer (Flax NNX inside, pure functions outside).

The training core works on plain pytrees, so this module exposes pure functions over a nested dict
of float32 arrays; Flax NNX modules are only used to build the parameters and to run the forward
pass (`nnx.merge` of a cached graph definition with the dict).

Architecture: learned position embeddings, pre-LayerNorm blocks (causal self-attention through
`jax.nn.dot_product_attention`, tanh-GELU MLP), final LayerNorm, output head tied to the token
embedding. GPT-2 initialisation: normal(0.02) everywhere, residual output projections normal(0.02 /
sqrt(2N)), biases 0, LayerNorm scales 1. Parameters are float32 "master" weights; `apply` casts them
(float32 or bfloat16 on input) to `cfg.dtype` and returns float32 logits.

The head returns logits in `cfg.dtype` (so its backward GEMMs stay there too); `loss_fn` takes the
log-softmax in float32 in a fused cross-entropy (`acco_jax.losses`). `vocab_multiple` pads the
embedding/head rows to `padded_vocab`: zero rows, ignored by the loss, never returned by `apply` or
sampled by `acco_jax.sampling.generate` (docs/design.md, "The head, the loss and the data feed").

Sizes (`SIZES`, parameter counts with tied embeddings):
  tiny             V=256   L=64   D=64   H=4  N=2   120,576  (CPU tests)
  tinystories-36m  V=10000 L=512  D=768  H=16 N=4   36,426,240  (ACCO's GPT-Neo-like ablation)
  gpt2             V=50257 L=1024 D=768  H=12 N=12  124,439,808
  gpt2-medium      V=50257 L=1024 D=1024 H=16 N=24  354,823,168

Usage:
  cfg = model.get_config('gpt2', dtype='bfloat16', remat=True)
  params = model.init_params(cfg, 0)           # {'wte', 'wpe', 'blocks', 'ln_f'}
  loss, aux = jax.jit(model.loss_fn, static_argnums=1)(params, cfg, batch)
  logits_BxLxV = model.apply(params, cfg, tokens_BxL)
  tx = optax.adamw(3e-4, weight_decay=0.1, mask=model.decay_mask(params))

Parameter layout (`init_params`):
  wte/embedding [padded_vocab, D] ([V, D] unless vocab_multiple pads it); wpe/embedding [L, D];
  ln_f/{scale, bias} [D];
  blocks/'<i>'/ for i in 0..N-1 (string keys):
    ln_1/{scale, bias}, attn_qkv/{kernel [D, 3D], bias}, attn_out/{kernel [D, D], bias},
    ln_2/{scale, bias}, mlp_fc/{kernel [D, F], bias}, mlp_proj/{kernel [F, D], bias}.
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from acco_jax import errors, losses

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model hyperparameters (hashable, so it can be a static jit argument)."""

  V: int  # vocabulary size
  L: int  # context length: number of learned positions
  D: int  # model width (residual stream)
  H: int  # attention heads; head width is D // H
  N: int  # number of transformer blocks
  F: int | None = None  # MLP hidden width; None means 4 * D (see `mlp_dim`)
  dtype: str = "bfloat16"  # compute dtype; params are always float32
  remat: bool = False  # rematerialise (jax.checkpoint) each block in the backward pass
  dropout: float = 0.0  # dropout on embeddings and residual branches (none on attention probs)
  attention: str = "auto"  # 'xla' | 'cudnn' | 'auto' (cudnn on GPU with 16-bit dtype, else xla)
  ln_eps: float = 1e-5  # LayerNorm epsilon (GPT-2 value)
  vocab_multiple: int = 1  # pad the embedding/head rows to a multiple of this (GPU: 128)

  def __post_init__(self):
    sizes = {"V": self.V, "L": self.L, "D": self.D, "H": self.H, "N": self.N}
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad or (self.F is not None and self.F < 1):
      bad = ", ".join(f"{k}={v}" for k, v in (bad or {"F": self.F}).items())
      raise errors.UserValueError(
        f"model sizes must be >= 1, got {bad} (in the trainer's config: L is data.seq_len, "
        "D, H, N, F are model.D, model.H, model.N, model.F)"
      )
    if self.D % self.H:
      raise errors.UserValueError(
        f"D={self.D} is not divisible by H={self.H}: choose heads that divide the width "
        "(model.D, model.H)"
      )
    if self.attention not in ("auto", "xla", "cudnn"):
      raise errors.UserValueError(
        f"attention must be 'auto', 'xla' or 'cudnn', got {self.attention!r}"
      )
    if not isinstance(self.vocab_multiple, int) or self.vocab_multiple < 1:
      raise errors.UserValueError(
        f"vocab_multiple={self.vocab_multiple!r} must be an integer >= 1 (1 = no padding; "
        "128 suits GPU matmuls): set model.vocab_multiple"
      )
    if not 0.0 <= self.dropout < 1.0:
      raise errors.UserValueError(f"dropout must be in [0, 1), got {self.dropout}")
    try:
      floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      raise errors.UserValueError(
        f"dtype={self.dtype!r} is not a floating dtype: use 'bfloat16', 'float32' or 'float16'"
      )

  @property
  def mlp_dim(self) -> int:
    return 4 * self.D if self.F is None else self.F

  @property
  def padded_vocab(self) -> int:
    """Rows of the embedding and the head: V rounded up to a multiple of `vocab_multiple`."""
    return -(-self.V // self.vocab_multiple) * self.vocab_multiple


SIZES: dict[str, dict[str, Any]] = {
  "tiny": dict(V=256, L=64, D=64, H=4, N=2),
  "tinystories-36m": dict(V=10000, L=512, D=768, H=16, N=4),
  # GPT-2 vocabulary; vocab_multiple=128 pads it to 50304 rows for faster GPU matmuls.
  "gpt2": dict(V=50257, L=1024, D=768, H=12, N=12),
  "gpt2-medium": dict(V=50257, L=1024, D=1024, H=16, N=24),
}


def get_config(name: str, **overrides) -> GPTConfig:
  """Returns the config of a named size, with fields replaced by `overrides`.

  Args:
    name: a key of `SIZES`.
    **overrides: `GPTConfig` fields to set, e.g. `dtype='float32', remat=True`.

  Returns:
    The `GPTConfig`.
  """
  if name not in SIZES:
    raise errors.UserValueError(f"unknown model size {name!r}; known sizes: {', '.join(SIZES)}")
  return GPTConfig(**{**SIZES[name], **overrides})


def attention_impl(cfg: GPTConfig) -> str:
  """The attention kernel ``cfg`` runs: cuDNN's fused one on a GPU for bf16/f16 and head widths
  it takes (multiples of 8, at most 128), else XLA's (``'auto'``); or the one ``cfg`` names."""
  if cfg.attention != "auto":
    return cfg.attention
  head_dim = cfg.D // cfg.H
  cudnn_ok = jnp.dtype(cfg.dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0
  return "cudnn" if cudnn_ok and head_dim <= 128 and jax.default_backend() == "gpu" else "xla"


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    init = nnx.initializers.normal(0.02)
    out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.N))
    ln = functools.partial(nnx.LayerNorm, cfg.D, epsilon=cfg.ln_eps, dtype=dt, rngs=rngs)
    dense = functools.partial(nnx.Linear, dtype=dt, rngs=rngs)
    self.ln_1 = ln()
    self.attn_qkv = dense(cfg.D, 3 * cfg.D, kernel_init=init)
    self.attn_out = dense(cfg.D, cfg.D, kernel_init=out_init)
    self.ln_2 = ln()
    self.mlp_fc = dense(cfg.D, cfg.mlp_dim, kernel_init=init)
    self.mlp_proj = dense(cfg.mlp_dim, cfg.D, kernel_init=out_init)
    self.dropout = nnx.Dropout(cfg.dropout)
    self.num_heads = cfg.H
    self.attention_impl = attention_impl(cfg)

  def __call__(self, x_BxLxD, key, deterministic: bool):
    B, L, D = x_BxLxD.shape
    H = self.num_heads
    keys = (None, None) if key is None else tuple(jax.random.split(key))
    qkv_BxLx3xHxK = self.attn_qkv(self.ln_1(x_BxLxD)).reshape(B, L, 3, H, D // H)
    q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
    att_BxLxHxK = jax.nn.dot_product_attention(
      q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True, implementation=self.attention_impl
    )
    att_BxLxD = self.attn_out(att_BxLxHxK.reshape(B, L, D))
    x_BxLxD = x_BxLxD + self.dropout(att_BxLxD, deterministic=deterministic, rngs=keys[0])
    h_BxLxF = jax.nn.gelu(self.mlp_fc(self.ln_2(x_BxLxD)), approximate=True)
    mlp_BxLxD = self.mlp_proj(h_BxLxF)
    return x_BxLxD + self.dropout(mlp_BxLxD, deterministic=deterministic, rngs=keys[1])


def _padded_rows_init(V: int, init):
  """`init` for the first V rows, zeros below (the same real rows whatever the padding)."""

  def padded(key, shape, dtype=jnp.float32):
    real = init(key, (V, *shape[1:]), dtype)
    return jnp.pad(real, ((0, shape[0] - V),) + ((0, 0),) * (len(shape) - 1))

  return padded


class GPT(nnx.Module):
  """Token + position embedding, N blocks, final LayerNorm, tied output head."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    init = nnx.initializers.normal(0.02)
    wte_init = _padded_rows_init(cfg.V, init) if cfg.padded_vocab > cfg.V else init
    self.wte = nnx.Embed(cfg.padded_vocab, cfg.D, dtype=dt, embedding_init=wte_init, rngs=rngs)
    self.wpe = nnx.Embed(cfg.L, cfg.D, dtype=dt, embedding_init=init, rngs=rngs)
    self.blocks = nnx.Dict({str(i): Block(cfg, rngs=rngs) for i in range(cfg.N)})
    self.ln_f = nnx.LayerNorm(cfg.D, epsilon=cfg.ln_eps, dtype=dt, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout)
    self.num_layers = cfg.N
    self.remat = cfg.remat

  def __call__(self, tokens_BxL, key, deterministic: bool):
    L = tokens_BxL.shape[1]
    keys = (
      [None] * (self.num_layers + 1) if key is None else jax.random.split(key, self.num_layers + 1)
    )
    x_BxLxD = self.wte(tokens_BxL) + self.wpe(jnp.arange(L))[None]
    x_BxLxD = self.dropout(x_BxLxD, deterministic=deterministic, rngs=keys[-1])

    def run_block(block, x_BxLxD, key):
      return block(x_BxLxD, key, deterministic)

    if self.remat:
      run_block = nnx.remat(run_block)
    for i in range(self.num_layers):
      x_BxLxD = run_block(self.blocks[str(i)], x_BxLxD, keys[i])
    x_BxLxD = self.ln_f(x_BxLxD)
    # Tied head in the compute dtype (float32 accumulation inside the GEMM), output in the compute
    # dtype too: a float32 output would make its cotangent, hence both backward GEMMs, float32.
    wte_VxD = self.wte.embedding[...].astype(x_BxLxD.dtype)
    return jnp.einsum("bld,vd->blv", x_BxLxD, wte_VxD)


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


def init_params(cfg: GPTConfig, seed_or_key) -> Params:
  """Initialises the parameters (GPT-2 scheme) as a nested dict of float32 arrays.

  Works under `jax.jit` and `jax.eval_shape`, e.g. `jax.eval_shape(lambda: init_params(cfg, 0))`.

  Args:
    cfg: model config.
    seed_or_key: an int seed or a JAX PRNG key (typed or raw uint32).

  Returns:
    A pure pytree of float32 arrays; the layout is given in the module docstring.
  """
  model = GPT(cfg, rngs=nnx.Rngs(params=to_key(seed_or_key)))
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def param_shapes(cfg: GPTConfig) -> Params:
  """:func:`init_params`'s tree as ``jax.ShapeDtypeStruct``s (a copy), traced once per config."""
  return jax.tree.map(lambda s: s, _param_shapes(cfg))


@functools.lru_cache(maxsize=32)
def _param_shapes(cfg: GPTConfig) -> Params:
  return jax.eval_shape(lambda: init_params(cfg, 0))


@functools.lru_cache(maxsize=32)
def _graphdef_and_shapes(cfg: GPTConfig):
  """Graph definition and expected flat parameter shapes (built abstractly, nothing allocated)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
  return graphdef, _flat_shapes(nnx.to_pure_dict(state))


def _flat_shapes(tree) -> dict[str, tuple[int, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): tuple(x.shape) for path, x in leaves}


def _logits(params: Params, cfg: GPTConfig, tokens_BxL, rng=None, deterministic: bool = True):
  """Logits over the padded vocabulary, in the compute dtype: [B, L', padded_vocab]."""
  graphdef, shapes = _graphdef_and_shapes(cfg)
  got = _flat_shapes(params)
  if got != shapes:  # nnx.merge of a pure dict silently accepts a mismatched tree: check here
    bad = sorted(k for k in shapes.keys() | got.keys() if shapes.get(k) != got.get(k))
    raise ValueError(
      f"params do not match {cfg}; differing leaves (expected vs got): "
      + ", ".join(f"{k}: {shapes.get(k)} vs {got.get(k)}" for k in bad[:4])
    )
  if tokens_BxL.ndim != 2 or tokens_BxL.shape[1] > cfg.L:
    raise ValueError(f"tokens must be [B, L<={cfg.L}], got shape {tokens_BxL.shape}")
  use_dropout = not deterministic and cfg.dropout > 0
  if use_dropout and rng is None:
    raise ValueError("apply(deterministic=False) with cfg.dropout > 0 needs an rng key")
  dt = jnp.dtype(cfg.dtype)
  model = nnx.merge(graphdef, jax.tree.map(lambda p: jnp.asarray(p).astype(dt), params))
  return model(tokens_BxL, to_key(rng) if use_dropout else None, not use_dropout)


def apply(params: Params, cfg: GPTConfig, tokens_BxL, *, rng=None, deterministic: bool = True):
  """Forward pass: token ids to next-token logits over the real vocabulary.

  Args:
    params: parameter dict from `init_params`; float32 or bfloat16 (any float dtype) leaves, cast to
      `cfg.dtype` here.
    cfg: model config (static under jit).
    tokens_BxL: int token ids of shape [B, L'] with L' <= cfg.L.
    rng: PRNG key for dropout; needed only if `deterministic=False` and `cfg.dropout > 0`.
    deterministic: if True, no dropout.

  Returns:
    float32 logits of shape [B, L', V] (the padded ids are dropped); position t depends on tokens
    0..t only.
  """
  logits = _logits(params, cfg, tokens_BxL, rng, deterministic)
  return logits[..., : cfg.V].astype(jnp.float32)


def loss_fn(params: Params, cfg: GPTConfig, batch: dict[str, jax.Array], *, rng=None):
  """Mean next-token cross-entropy over the weighted tokens of a batch.

  The logits stay in the compute dtype; the log-softmax is taken in float32 by
  `acco_jax.losses.token_cross_entropy` (fused, padded ids excluded).

  Args:
    params: parameter dict.
    cfg: model config (static under jit).
    batch: {'inputs': int32 [B, L], 'targets': int32 [B, L], optional 'weights': float32 [B, L]
      (0 = ignore the token; defaults to all ones)}.
    rng: if given (and cfg.dropout > 0), dropout is applied with this key.

  Returns:
    (loss, aux): loss = loss_sum / tokens (0 when no token is weighted), a float32 scalar;
    aux = {'tokens': sum of weights, 'loss_sum': weighted sum of token losses}, float32 scalars,
    so that sums over microbatches or devices give the exact global mean.
  """
  logits_BxLxV = _logits(params, cfg, batch["inputs"], rng, deterministic=rng is None)
  return loss_from_logits(cfg, logits_BxLxV, batch)


def loss_from_logits(cfg: GPTConfig, logits_BxLxV, batch: dict[str, jax.Array]):
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

  Decayed: all Linear kernels, the tied token embedding `wte` and the position embedding `wpe`.
  Not decayed: biases and LayerNorm scales/biases. Works on arrays and on `jax.eval_shape` output.

  Args:
    params: parameter dict (or any tree of arrays / ShapeDtypeStructs).

  Returns:
    A tree of Python bools with the structure of `params` (usable as `optax.adamw(mask=...)`).
  """
  return jax.tree.map(lambda p: len(p.shape) >= 2, params)


def muon_mask(params: Params) -> Params:
  """Muon's leaves: the blocks' weight matrices (every kernel of ndim >= 2 under ``blocks``).

  Embeddings, the tied head, biases and LayerNorms are False (AdamW's, as in modded-nanogpt).
  """
  blocks = jax.tree.map(lambda p: len(p.shape) >= 2, params["blocks"])
  return {**jax.tree.map(lambda _: False, params), "blocks": blocks}


def num_params(params: Params) -> int:
  """Total number of parameters (works on arrays and on ShapeDtypeStructs)."""
  return sum(math.prod(p.shape) for p in jax.tree.leaves(params))


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
  """Training FLOPs per token (forward + backward = 3 x forward) for MFU.

  6 * (matmul weights: N * (4 D^2 + 2 D F) + V D for the tied head) + 12 * N * D * seq_len for the
  attention scores and weighted values (PaLM convention: the full seq_len x seq_len square, not
  halved for causality). Biases, LayerNorm and the embedding lookups are ignored. V is the real
  vocabulary, not `padded_vocab`: the padded columns are work the model does not need, so MFU
  does not count them.

  Args:
    cfg: model config.
    seq_len: training sequence length; defaults to cfg.L.

  Returns:
    FLOPs per trained token.
  """
  seq_len = cfg.L if seq_len is None else seq_len
  matmul_weights = cfg.N * (4 * cfg.D**2 + 2 * cfg.D * cfg.mlp_dim) + cfg.V * cfg.D
  return float(6 * matmul_weights + 12 * cfg.N * cfg.D * seq_len)
