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
argument). Its field schema (:data:`FIELDS`) says what each field is: a size, a run setting or a
form of the architecture, common to all or used by the architectures whose ``USES`` names it;
the others must leave it at its default (:func:`_check_unused`, before the architecture's own
``check``). The presets' overridable sizes, the run settings a pretrained model takes from the run
and the sizes it must agree on derive from it (:func:`config_sizes`, :func:`fields_of`).
Shared layers (dense, LayerNorm, RMSNorm, RoPE with its scalings, attention) live here too.

A new architecture is one module (implementing :class:`Architecture`) and one line in
``acco_jax/models/__init__.py`` and :data:`ARCHS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from acco_jax import errors

Params = dict[str, Any]

ARCHS = ("gpt2", "gpt_neo", "llama", "qwen2", "qwen3", "mistral")  # acco_jax.models' modules
# each architecture's check of a config and the fields it uses beyond the common ones, registered
# by acco_jax.models (importing this module runs the package's __init__ first, which imports and
# registers every architecture)
_CHECKS: dict[str, Any] = {}
_USES: dict[str, tuple[str, ...]] = {}


def register(arch: str, check, uses: tuple[str, ...]) -> None:
  """Makes :class:`ModelConfig` run ``check(cfg)`` for configs of ``arch``, which may set the
  architecture-specific fields ``uses`` (the others must stay at their defaults)."""
  unknown = [f for f in uses if f not in FIELDS or FIELDS[f].common]
  assert not unknown, f"{arch} uses {unknown}, which are not architecture-specific fields"
  _CHECKS[arch], _USES[arch] = check, tuple(uses)


ATTENTION_IMPLS = ("auto", "xla", "cudnn")

# -- the field schema --------------------------------------------------------------------------------

SIZE, SETTING, FORM = "size", "setting", "form"


class Field(NamedTuple):
  """What a :class:`ModelConfig` field is.

  Attributes:
    kind: ``size`` (a shape: a checkpoint fixes it, a preset names it), ``setting`` (how a run
      computes: dtype, remat, ...; a run's own, never a checkpoint's) or ``form`` (the
      architecture's maths: norm epsilon, RoPE base, attention window).
    common: every architecture uses it; otherwise only those whose module's ``USES`` names it
      (:func:`users`), and the others refuse a value other than the default.
    given_by: for the sizes a config does not set as ``model.<name>``, what sets them.
    resolved: the property that resolves a size's default (``F`` None is ``mlp_dim`` 4 D).
  """

  kind: str
  common: bool = True
  given_by: str = ""
  resolved: str = ""


def _field(default=dataclasses.MISSING, **schema):
  return dataclasses.field(default=default, metadata={"schema": Field(**schema)})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model hyperparameters of any architecture (hashable, so it can be a static jit argument).

  The single-letter sizes follow the shape suffixes of the code: ``V`` vocabulary, ``L`` positions
  (the longest sequence the model takes), ``D`` width, ``H`` heads, ``N`` blocks, ``F`` MLP width,
  ``K`` head width. Each field's :class:`Field` (``FIELDS``) says whether it is a size, a run
  setting or a form of the architecture, and whether every architecture uses it.
  """

  V: int = _field(kind=SIZE, given_by="the tokenizer")  # vocabulary (real ids; see vocab_multiple)
  L: int = _field(kind=SIZE, given_by="data.seq_len")  # learned positions, or the longest sequence
  D: int = _field(kind=SIZE)  # model width (residual stream)
  H: int = _field(kind=SIZE)  # attention heads
  N: int = _field(kind=SIZE)  # number of transformer blocks
  F: int | None = _field(None, kind=SIZE, resolved="mlp_dim")  # MLP width; None: 4 D
  arch: str = _field("gpt2", kind=FORM)  # acco_jax.models.ARCHS
  kv_heads: int | None = _field(None, kind=SIZE, common=False, resolved="num_kv_heads")  # None: H
  dtype: str = _field("bfloat16", kind=SETTING)  # compute dtype; params are always float32
  remat: bool = _field(False, kind=SETTING)  # rematerialise (jax.checkpoint) each block
  dropout: float = _field(0.0, kind=SETTING)  # on embeddings and residual branches
  attention: str = _field("auto", kind=SETTING)  # 'xla' | 'cudnn' | 'auto' (cudnn on GPU, 16-bit)
  norm_eps: float = _field(1e-5, kind=FORM)  # LayerNorm / RMSNorm epsilon
  vocab_multiple: int = _field(1, kind=SETTING)  # pad embedding/head rows to a multiple (GPU: 128)
  tied_head: bool = _field(True, kind=FORM, common=False)  # the head is the token embedding
  rope_theta: float = _field(10000.0, kind=FORM, common=False)  # RoPE base
  # a local layer's query i sees keys j with 0 <= i - j < window
  window: int = _field(256, kind=FORM, common=False)
  # attention per block, 'global' or 'local', cycled over the N blocks
  layer_types: str = _field("global,local", kind=FORM, common=False)
  K: int | None = _field(None, kind=SIZE, common=False, resolved="head_dim")  # None: D // H
  # RoPE scaling as transformers computes it: 'default' (none), 'linear' (every frequency divided
  # by rope_factor) or 'llama3' (the low frequencies divided, a smooth ramp between the wavelengths
  # rope_original_L / rope_low_freq_factor and rope_original_L / rope_high_freq_factor)
  rope_type: str = _field("default", kind=FORM, common=False)
  rope_factor: float = _field(1.0, kind=FORM, common=False)
  rope_low_freq_factor: float = _field(1.0, kind=FORM, common=False)
  rope_high_freq_factor: float = _field(4.0, kind=FORM, common=False)
  rope_original_L: int = _field(0, kind=FORM, common=False)  # positions the model was trained on

  def __post_init__(self):
    _check_common(self)
    _check_unused(self)
    _CHECKS[self.arch](self)

  @property
  def mlp_dim(self) -> int:
    return 4 * self.D if self.F is None else self.F

  @property
  def head_dim(self) -> int:
    return self.D // self.H if self.K is None else self.K

  @property
  def num_kv_heads(self) -> int:
    return self.H if self.kv_heads is None else self.kv_heads

  @property
  def padded_vocab(self) -> int:
    """Rows of the embedding and the head: V rounded up to a multiple of `vocab_multiple`."""
    return -(-self.V // self.vocab_multiple) * self.vocab_multiple


FIELDS: dict[str, Field] = {f.name: f.metadata["schema"] for f in dataclasses.fields(ModelConfig)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def fields_of(kind: str) -> tuple[str, ...]:
  """The names of the fields of ``kind`` (``SIZE``, ``SETTING``, ``FORM``), in order."""
  return tuple(name for name, f in FIELDS.items() if f.kind == kind)


def config_sizes() -> tuple[str, ...]:
  """The sizes a run's config may set (``model.D`` ...): all but those the data gives (V, L)."""
  return tuple(name for name in fields_of(SIZE) if not FIELDS[name].given_by)


def resolved(cfg: ModelConfig, name: str):
  """Field ``name`` of ``cfg`` with its default resolved (``F`` None: 4 D)."""
  return getattr(cfg, FIELDS[name].resolved or name)


def users(name: str) -> tuple[str, ...]:
  """The architectures that use field ``name``."""
  if FIELDS[name].common:
    return ARCHS
  return tuple(a for a in ARCHS if name in _USES.get(a, ()))


def uses(arch: str, name: str) -> bool:
  """Whether ``arch`` uses field ``name``."""
  return FIELDS[name].common or name in _USES.get(arch, ())


def _check_unused(cfg: ModelConfig) -> None:
  """Refuses architecture-specific fields ``cfg.arch`` does not use set to other than defaults."""
  unused = [n for n in FIELDS if not uses(cfg.arch, n) and getattr(cfg, n) != DEFAULTS[n]]
  if unused:
    shown = ", ".join(f"{n}={getattr(cfg, n)!r}" for n in unused)
    owners = "; ".join(f"{n} is {', '.join(users(n)) or 'no architecture'}'s" for n in unused)
    raise errors.UserValueError(
      f"model.arch={cfg.arch} does not use {shown}: leave {', '.join(unused)} at the default "
      f"({owners})"
    )


def _check_common(cfg: ModelConfig) -> None:
  if cfg.arch not in ARCHS:
    raise errors.UserValueError(
      f"model.arch={cfg.arch!r} is unknown: choose one of {', '.join(ARCHS)}"
    )
  sizes = {"V": cfg.V, "L": cfg.L, "D": cfg.D, "H": cfg.H, "N": cfg.N}
  optional = {k: getattr(cfg, k) for k in ("F", "K") if getattr(cfg, k) is not None}
  bad = {k: v for k, v in {**sizes, **optional}.items() if v < 1}
  if bad:
    bad = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise errors.UserValueError(
      f"model sizes must be >= 1, got {bad} (in the trainer's config: L is data.seq_len, "
      "D, H, N, F, K are model.D, model.H, model.N, model.F, model.K)"
    )
  if cfg.K is None and cfg.D % cfg.H:
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


def local_layers(cfg: ModelConfig) -> tuple[bool, ...]:
  """Whether each block's attention is local (``cfg.layer_types`` cycled over the N blocks)."""
  pattern = [t.strip() for t in cfg.layer_types.split(",")]
  return tuple(pattern[i % len(pattern)] == "local" for i in range(cfg.N))


def block_attention(
  q_BxLxHxK,
  k_BxLxGxK,
  v_BxLxGxK,
  cfg: ModelConfig,
  ctx: Context,
  *,
  scale=None,
  local_N: tuple[bool, ...] = (),
):
  """:func:`attention` of the block ``ctx.layer``: the one call every architecture's block makes,
  with the block's context (its packed segments, its cache). Where ``local_N[layer]`` (GPT-Neo's
  local blocks, Mistral's sliding window), query ``i`` sees keys ``j`` with
  ``0 <= i - j < cfg.window``; a traced ``ctx.layer`` (blocks run in a traced order,
  :mod:`acco_jax.layers`) picks between the two with ``lax.cond``."""

  def attend(window):
    return attention(
      q_BxLxHxK,
      k_BxLxGxK,
      v_BxLxGxK,
      cfg,
      scale=scale,
      window=window,
      segments_BxL=ctx.segments_BxL,
      cache=ctx.cache,
    )

  keys = q_BxLxHxK.shape[1] if ctx.cache is None else ctx.cache.length  # keys a query may see
  if not any(local_N) or cfg.window >= keys:  # a local block sees every earlier key
    return attend(None)
  if isinstance(ctx.layer, int):
    return attend(cfg.window if local_N[ctx.layer] else None)
  local = jnp.asarray(np.array(local_N))  # the order is traced
  return jax.lax.cond(local[ctx.layer], lambda: attend(cfg.window), lambda: attend(None))


# -- layers ----------------------------------------------------------------------------------------


def dense(cfg: ModelConfig, rngs: nnx.Rngs, d_in: int, d_out: int, *, bias=True, std=0.02):
  """A linear layer in the compute dtype: kernel normal(``std``) ``[d_in, d_out]``, bias 0."""
  init = nnx.initializers.normal(std)
  return nnx.Linear(
    d_in, d_out, use_bias=bias, dtype=jnp.dtype(cfg.dtype), kernel_init=init, rngs=rngs
  )


def layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  """LayerNorm over D (scale 1, bias 0) in the compute dtype."""
  return nnx.LayerNorm(cfg.D, epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype), rngs=rngs)


class RMSNorm(nnx.Module):
  """``scale * cast(x / rms(x))`` over the last axis (``dim``, D by default), the root mean
  square taken in float32 (as transformers' Llama, Qwen and Mistral norms)."""

  def __init__(self, cfg: ModelConfig, dim: int | None = None):
    self.scale = nnx.Param(jnp.ones((cfg.D if dim is None else dim,), jnp.float32))
    self.eps = cfg.norm_eps

  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x_BxLxD.dtype) * normed.astype(x_BxLxD.dtype)


ROPE_TYPES = ("default", "linear", "llama3")


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
  """RoPE's K/2 inverse frequencies ``theta^(-2i/K)`` (float32), scaled by ``cfg.rope_type`` as
  transformers' rope init functions scale them: ``linear`` divides each by ``rope_factor``;
  ``llama3`` divides those whose wavelength ``2 pi / f`` exceeds ``rope_original_L /
  rope_low_freq_factor``, keeps those under ``rope_original_L / rope_high_freq_factor``, and
  between the two mixes both, weight ``(rope_original_L / wavelength - low) / (high - low)`` on
  the kept one. Neither scales the cosines and sines (their attention factor is 1)."""
  K = cfg.head_dim
  inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, K, 2, dtype=np.float64) / K)
  if cfg.rope_type == "linear":
    inv_freq = inv_freq / cfg.rope_factor
  elif cfg.rope_type == "llama3":
    low, high, old_L = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_L
    wavelength = 2 * np.pi / inv_freq
    divided = np.where(wavelength > old_L / low, inv_freq / cfg.rope_factor, inv_freq)
    kept = (old_L / wavelength - low) / (high - low)
    mixed = (1 - kept) * divided / cfg.rope_factor + kept * divided
    between = (wavelength >= old_L / high) & (wavelength <= old_L / low)
    inv_freq = np.where(between, mixed, divided)
  return inv_freq.astype(np.float32)


def check_rope(cfg: ModelConfig) -> None:
  """Refuses (one line) RoPE fields that do not describe a rotation :func:`rope_frequencies`
  computes."""
  if cfg.head_dim % 2:
    raise errors.UserValueError(
      f"the head width {cfg.head_dim} must be even for rotary positions (model.K, or D / H)"
    )
  if not cfg.rope_theta > 0:
    raise errors.UserValueError(f"model.rope_theta={cfg.rope_theta} must be > 0")
  if cfg.rope_type not in ROPE_TYPES:
    raise errors.UserValueError(
      f"model.rope_type={cfg.rope_type!r} is not one of {', '.join(ROPE_TYPES)}"
    )
  if cfg.rope_type != "default" and not cfg.rope_factor > 0:
    raise errors.UserValueError(f"model.rope_factor={cfg.rope_factor} must be > 0")
  if cfg.rope_type == "llama3" and not (
    cfg.rope_original_L > 0 and 0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor
  ):
    raise errors.UserValueError(
      "rope_type='llama3' needs model.rope_original_L > 0 and 0 < model.rope_low_freq_factor < "
      f"model.rope_high_freq_factor (got {cfg.rope_original_L}, {cfg.rope_low_freq_factor}, "
      f"{cfg.rope_high_freq_factor})"
    )


def rotate(x_BxLxHxK, positions_BxL, inv_freq_K2):
  """RoPE in the rotate-half convention: feature ``i < K/2`` pairs with ``i + K/2``, both turned by
  ``position * inv_freq[i]`` (computed in float32, returned in ``x``'s dtype)."""
  K = x_BxLxHxK.shape[-1]
  angle_BxLxK2 = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_K2)
  cos, sin = (
    jnp.concatenate([f(angle_BxLxK2)] * 2, axis=-1)[:, :, None] for f in (jnp.cos, jnp.sin)
  )
  x = x_BxLxHxK.astype(jnp.float32)
  half = K // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_BxLxHxK.dtype)


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
  USES: tuple[str, ...]  # the architecture-specific ModelConfig fields it reads (FIELDS)
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
