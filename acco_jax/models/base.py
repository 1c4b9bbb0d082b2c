"""What every architecture shares: its config, the context a block runs in, attention and norms.

An architecture (:mod:`acco_jax.models.gpt2`, :mod:`~acco_jax.models.gpt_neo`,
:mod:`~acco_jax.models.llama`) is three pieces over one parameter dict,

  embed(shared, cfg, tokens_BxL, ctx) -> x_BxLxD          (token ids to the residual stream)
  block(block_params, cfg, x_BxLxD, ctx, key) -> x_BxLxD  (one of the N transformer blocks)
  head(shared, cfg, x_BxLxD) -> logits_BxLxV              (final norm and the output projection)

where the parameter dict is ``{'blocks': {'0': block, ..., 'N-1': block}, **shared}``: the blocks
under ``'blocks'`` (string keys, every block the same structure and shapes), everything else
(embeddings, final norm, an untied head) in ``shared``. :mod:`acco_jax.model` composes the pieces
into the whole model; pipelines run them apart; nothing outside the architecture's module reads a
parameter name other than ``'blocks'``.

:class:`ModelConfig` is one frozen dataclass for every architecture (hashable: a static ``jit``
argument); fields that an architecture does not use must stay at their defaults, which its
``check`` enforces.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from acco_jax import errors

Params = dict[str, Any]

ARCHS = ("gpt2", "gpt_neo", "llama")  # the modules of acco_jax.models, in this order
# each architecture's check of a config, registered by acco_jax.models (importing this module runs
# the package's __init__ first, which imports and registers every architecture)
_CHECKS: dict[str, Any] = {}


def register_check(arch: str, check) -> None:
  """Makes :class:`ModelConfig` run ``check(cfg)`` for configs of ``arch``."""
  _CHECKS[arch] = check


ATTENTION_IMPLS = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model hyperparameters of any architecture (hashable, so it can be a static jit argument).

  The single-letter sizes follow the shape suffixes of the code: ``V`` vocabulary, ``L`` positions
  (the longest sequence the model takes), ``D`` width, ``H`` heads, ``N`` blocks, ``F`` MLP width.
  """

  V: int  # vocabulary size (real ids; the embedding may be padded, see vocab_multiple)
  L: int  # context length: learned positions (gpt2, gpt_neo) or the longest RoPE sequence (llama)
  D: int  # model width (residual stream)
  H: int  # attention heads; head width is D // H
  N: int  # number of transformer blocks
  F: int | None = None  # MLP hidden width; None: 4 * D (gpt2, gpt_neo); llama needs it set
  arch: str = "gpt2"  # gpt2 | gpt_neo | llama (acco_jax.models)
  kv_heads: int | None = None  # llama: key/value heads (grouped-query attention); None: H
  dtype: str = "bfloat16"  # compute dtype; params are always float32
  remat: bool = False  # rematerialise (jax.checkpoint) each block in the backward pass
  dropout: float = 0.0  # dropout on embeddings and residual branches (none on attention probs)
  attention: str = "auto"  # 'xla' | 'cudnn' | 'auto' (cudnn on GPU with 16-bit dtype, else xla)
  norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
  vocab_multiple: int = 1  # pad the embedding/head rows to a multiple of this (GPU: 128)
  tied_head: bool = True  # the output head is the token embedding (llama: may be its own matrix)
  rope_theta: float = 10000.0  # llama: RoPE base
  window: int = 256  # gpt_neo: a local layer's query i sees keys j with 0 <= i - j < window
  layer_types: str = "global,local"  # gpt_neo: attention per block, cycled over the N blocks

  def __post_init__(self):
    _check_common(self)
    _CHECKS[self.arch](self)

  @property
  def mlp_dim(self) -> int:
    return 4 * self.D if self.F is None else self.F

  @property
  def head_dim(self) -> int:
    return self.D // self.H

  @property
  def num_kv_heads(self) -> int:
    return self.H if self.kv_heads is None else self.kv_heads

  @property
  def padded_vocab(self) -> int:
    """Rows of the embedding and the head: V rounded up to a multiple of `vocab_multiple`."""
    return -(-self.V // self.vocab_multiple) * self.vocab_multiple


def _check_common(cfg: ModelConfig) -> None:
  if cfg.arch not in ARCHS:
    raise errors.UserValueError(
      f"model.arch={cfg.arch!r} is unknown: choose one of {', '.join(ARCHS)}"
    )
  sizes = {"V": cfg.V, "L": cfg.L, "D": cfg.D, "H": cfg.H, "N": cfg.N}
  bad = {k: v for k, v in sizes.items() if v < 1}
  if bad or (cfg.F is not None and cfg.F < 1):
    bad = ", ".join(f"{k}={v}" for k, v in (bad or {"F": cfg.F}).items())
    raise errors.UserValueError(
      f"model sizes must be >= 1, got {bad} (in the trainer's config: L is data.seq_len, "
      "D, H, N, F are model.D, model.H, model.N, model.F)"
    )
  if cfg.D % cfg.H:
    raise errors.UserValueError(
      f"D={cfg.D} is not divisible by H={cfg.H}: choose heads that divide the width "
      "(model.D, model.H)"
    )
  if cfg.attention not in ATTENTION_IMPLS:
    raise errors.UserValueError(
      f"attention must be 'auto', 'xla' or 'cudnn', got {cfg.attention!r}"
    )
  if not isinstance(cfg.vocab_multiple, int) or cfg.vocab_multiple < 1:
    raise errors.UserValueError(
      f"vocab_multiple={cfg.vocab_multiple!r} must be an integer >= 1 (1 = no padding; "
      "128 suits GPU matmuls): set model.vocab_multiple"
    )
  if not 0.0 <= cfg.dropout < 1.0:
    raise errors.UserValueError(f"dropout must be in [0, 1), got {cfg.dropout}")
  if not cfg.norm_eps > 0:
    raise errors.UserValueError(f"norm_eps must be > 0, got {cfg.norm_eps}")
  try:
    floating = jnp.issubdtype(jnp.dtype(cfg.dtype), jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise errors.UserValueError(
      f"dtype={cfg.dtype!r} is not a floating dtype: use 'bfloat16', 'float32' or 'float16'"
    )


def require_defaults(cfg: ModelConfig, *fields: str) -> None:
  """Refuses ``fields`` an architecture does not use when they differ from their defaults."""
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  used = [f for f in fields if getattr(cfg, f) != defaults[f]]
  if used:
    shown = ", ".join(f"{f}={getattr(cfg, f)!r}" for f in used)
    raise errors.UserValueError(
      f"model.arch={cfg.arch} does not use {shown}: leave {', '.join(used)} at the default "
      "(those fields belong to another architecture)"
    )


class Context(NamedTuple):
  """What a block needs besides its parameters and the residual stream.

  Attributes:
    layer: the block's index in the model; a traced int32 scalar when blocks run in a traced order
      (:mod:`acco_jax.layers`), a Python int otherwise.
    positions_BxL: int32 position of each token (learned positions and RoPE read it).
    segments_BxL: int32 example of each token in a packed row (attention stays within one), or
      None: one sequence a row.
    cache: the block's keys and values of earlier tokens (generation one token at a time,
      :func:`acco_jax.model.apply_cached`), which :func:`attention` reads and extends, or None.
  """

  layer: int | jax.Array
  positions_BxL: jax.Array
  segments_BxL: jax.Array | None = None
  cache: KVCache | None = None


def context(tokens_BxL, layer: int | jax.Array = 0, positions=None, segments=None) -> Context:
  """The context of rows of tokens: each one sequence from position 0, unless ``positions`` and
  ``segments`` say how examples are packed in them."""
  if positions is None:
    L = tokens_BxL.shape[1]
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), tokens_BxL.shape)
  return Context(layer, positions, segments)


def attention_impl(cfg: ModelConfig) -> str:
  """The attention kernel ``cfg`` runs: cuDNN's fused one on a GPU for bf16/f16 and head widths
  it takes (multiples of 8, at most 128), else XLA's (``'auto'``); or the one ``cfg`` names."""
  if cfg.attention != "auto":
    return cfg.attention
  cudnn_ok = jnp.dtype(cfg.dtype) in (jnp.bfloat16, jnp.float16) and cfg.head_dim % 8 == 0
  return "cudnn" if cudnn_ok and cfg.head_dim <= 128 and jax.default_backend() == "gpu" else "xla"


def attention(
  q_BxLxHxK,
  k_BxLxGxK,
  v_BxLxGxK,
  cfg: ModelConfig,
  *,
  scale=None,
  window: int | None = None,
  segments_BxL=None,
  cache: KVCache | None = None,
):
  """Causal attention, grouped-query when ``G < H`` heads of keys and values; with ``window``,
  query ``i`` sees only keys ``j`` with ``0 <= i - j < window``; with ``segments_BxL``, only keys
  of its own segment (packed examples; a mask both XLA's and cuDNN's kernels take); with
  ``cache``, the new tokens' keys and values join the earlier ones' (:func:`cached_attention`).

  Scores and softmax are float32 whatever the inputs' dtype (XLA's and cuDNN's kernels both
  accumulate the products of bf16 inputs in float32); ``scale`` defaults to ``1/sqrt(K)``.
  """
  if cache is not None:
    return cached_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, cache, scale=scale, window=window)
  local = None if window is None else (window - 1, 0)
  mask = None
  if segments_BxL is not None:
    mask = segments_BxL[:, None, :, None] == segments_BxL[:, None, None, :]  # [B, 1, L, L]
  return jax.nn.dot_product_attention(
    q_BxLxHxK,
    k_BxLxGxK,
    v_BxLxGxK,
    mask=mask,
    scale=scale,
    is_causal=True,
    local_window_size=local,
    implementation=attention_impl(cfg),
  )


class KVCache:
  """One block's keys and values for generation: ``k_BxCxGxK``, ``v_BxCxGxK`` at C positions.

  A mutable holder (as an ``nnx.Cache`` variable is): :func:`cached_attention` writes the new
  tokens' keys and values at ``positions_BxL`` and replaces the arrays, inside the trace of
  :func:`acco_jax.model.apply_cached`, which reads them back out. With no arrays yet (``k`` None:
  the prompt's first pass), the first write allocates ``length`` zero positions.
  """

  def __init__(self, positions_BxL, length: int, k_BxCxGxK=None, v_BxCxGxK=None):
    self.positions_BxL = positions_BxL
    self.length = length if k_BxCxGxK is None else k_BxCxGxK.shape[1]
    self.k_BxCxGxK, self.v_BxCxGxK = k_BxCxGxK, v_BxCxGxK


def cached_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, cache: KVCache, *, scale=None, window=None):
  """:func:`attention` of L new tokens at ``cache.positions_BxL`` over every cached position up to
  each query's own (and within ``window``), after writing the new keys and values there.

  Positions past a row's last written token are masked, so what they hold (zeros, or padding of a
  shorter prompt) never counts.
  """
  B, L, G, K = k_BxLxGxK.shape
  if cache.k_BxCxGxK is None:
    cache.k_BxCxGxK = cache.v_BxCxGxK = jnp.zeros((B, cache.length, G, K), k_BxLxGxK.dtype)
  rows_Bx1, at_BxL = jnp.arange(B)[:, None], cache.positions_BxL
  cache.k_BxCxGxK = cache.k_BxCxGxK.at[rows_Bx1, at_BxL].set(k_BxLxGxK)
  cache.v_BxCxGxK = cache.v_BxCxGxK.at[rows_Bx1, at_BxL].set(v_BxLxGxK)
  behind_BxLxC = at_BxL[:, :, None] - jnp.arange(cache.length)  # query's position - key's
  seen_BxLxC = behind_BxLxC >= 0
  if window is not None:
    seen_BxLxC &= behind_BxLxC < window
  return jax.nn.dot_product_attention(
    q_BxLxHxK,
    cache.k_BxCxGxK,
    cache.v_BxCxGxK,
    mask=seen_BxLxC[:, None],
    scale=scale,
    implementation="xla",
  )


def dropout(x, rate: float, key) -> jax.Array:
  """Inverted dropout of ``x`` with ``key``; the identity when ``key`` is None or the rate 0."""
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def cast(tree, cfg: ModelConfig):
  """Every leaf of ``tree`` in the compute dtype."""
  dt = jnp.dtype(cfg.dtype)
  return jax.tree.map(lambda p: jnp.asarray(p).astype(dt), tree)


def padded_rows_init(V: int, init):
  """``init`` for the first V rows, zeros below (the same real rows whatever the padding)."""

  def padded(key, shape, dtype=jnp.float32):
    real = init(key, (V, *shape[1:]), dtype)
    return jnp.pad(real, ((0, shape[0] - V),) + ((0, 0),) * (len(shape) - 1))

  return padded


def tied_logits(wte_VxD, x_BxLxD) -> jax.Array:
  """``x @ wte.T`` in ``x``'s dtype: a float32 output would make its cotangent, hence both of the
  head's backward GEMMs, float32."""
  return jnp.einsum("bld,vd->blv", x_BxLxD, wte_VxD.astype(x_BxLxD.dtype))


class Architecture(Protocol):
  """What an architecture's module defines (:mod:`acco_jax.models.gpt2` is the smallest)."""

  SIZES: dict[str, dict[str, Any]]  # named presets: ModelConfig fields
  Block: type  # nnx.Module(cfg, rngs=...); __call__(x_BxLxD, ctx, key=None) -> x_BxLxD
  Shared: type  # nnx.Module(cfg, rngs=...); embed(tokens_BxL, ctx, key=None), head(x_BxLxD)
  HF_MODEL_TYPE: str  # config.json's model_type
  HF_ARCHITECTURE: str  # config.json's architectures[0]
  HF_PREFIX: str  # the prefix of the base model's tensors, which some checkpoints leave out
  HF_IGNORED: tuple[str, ...]  # regexes of tensors a checkpoint may hold that we do not read
  # (the head, the embedding) where a tied model's checkpoint may store the head anyway: the
  # loader reads it only to check it equals the embedding (None: the architecture has no such)
  HF_TIED_HEAD: tuple[str, str] | None

  def check(self, cfg: ModelConfig) -> None:
    """Refuses (one line) a config this architecture cannot run."""

  def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward)."""

  def hf_tensors(self, cfg: ModelConfig) -> list[HFTensor]:
    """Every parameter's tensor in a Hugging Face checkpoint."""

  def from_hf_config(self, hf: dict) -> dict[str, Any]:
    """ModelConfig fields from a ``config.json`` (one-line refusals of what we do not run)."""

  def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
    """The architecture's fields of a ``config.json`` for ``cfg``."""


# -- Hugging Face names -----------------------------------------------------------------------------


class HFTensor(NamedTuple):
  """One parameter as a Hugging Face checkpoint stores it.

  Attributes:
    name: the tensor's name there, with the base model's prefix (``transformer.h.0.ln_1.weight``).
    path: its keys in this project's parameter dict (``('blocks', '0', 'ln_1', 'scale')``).
    transpose: ``nn.Linear`` weights are ``[out, in]`` there and ``[in, out]`` here.
    vocab_rows: its rows are token ids (embedding, head): ``padded_vocab`` here, ``V`` there.
  """

  name: str
  path: tuple[str, ...]
  transpose: bool = False
  vocab_rows: bool = False


def hf_linear(name: str, path: tuple, *, bias: bool, transpose: bool = True) -> list[HFTensor]:
  """A linear layer: ``<name>.weight`` (and ``.bias``) as ``<path>/kernel`` (and ``/bias``)."""
  out = [HFTensor(f"{name}.weight", (*path, "kernel"), transpose=transpose)]
  return out + ([HFTensor(f"{name}.bias", (*path, "bias"))] if bias else [])


def hf_norm(name: str, path: tuple, *, bias: bool) -> list[HFTensor]:
  """A LayerNorm (``bias``) or RMSNorm: ``<name>.weight`` as ``<path>/scale``."""
  out = [HFTensor(f"{name}.weight", (*path, "scale"))]
  return out + ([HFTensor(f"{name}.bias", (*path, "bias"))] if bias else [])


def hf_require(hf: dict, arch: str, **allowed: tuple) -> None:
  """Refuses a ``config.json`` whose ``key`` is not one of ``allowed[key]`` (an absent key takes
  the first allowed value, Hugging Face's default)."""
  for key, values in allowed.items():
    value = hf.get(key, values[0])
    if value not in values:
      raise errors.UserValueError(
        f"this {arch} checkpoint has {key}={value!r}, which acco_jax does not run (it runs "
        f"{' or '.join(repr(v) for v in values)})"
      )
