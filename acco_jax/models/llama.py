"""Llama (Touvron et al., 2023): RMSNorm, rotary positions, grouped-query attention, SwiGLU, no
biases, and a head of its own unless tied.

As Hugging Face's ``LlamaForCausalLM`` computes it: blocks ``x + attn(rms_1(x))``,
``x + mlp(rms_2(x))``; RMSNorm normalises in float32 and casts back before its scale; q and k are
rotated by RoPE in the *rotate-half* convention (the first and second halves of each head's
``K`` features are the pairs, frequencies ``theta^(-2i/K)``, ``theta = cfg.rope_theta``), at each
token's position; ``cfg.kv_heads`` heads of keys and values serve ``H / kv_heads`` query heads
each; MLP ``down(silu(gate(x)) * up(x))``; final RMSNorm; the head is ``lm_head`` ``[V, D]``, or
the token embedding with ``cfg.tied_head``. Initialisation as the reference's: normal(0.02),
norm scales 1.

Parameters::

  wte/embedding [padded_vocab, D]   norm_f/scale [D]   lm_head [padded_vocab, D] (untied only)
  blocks/<i>/ attn_norm/scale [D], attn_q/kernel [D, H K], attn_k/kernel, attn_v/kernel
              [D, kv_heads K], attn_out/kernel [H K, D], mlp_norm/scale [D],
              mlp_gate/kernel, mlp_up/kernel [D, F], mlp_down/kernel [F, D]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from acco_jax import errors
from acco_jax.models import base

# A tiny one for tests (grouped-query attention, an untied head) and the shapes of a public ~1B
# Llama (TinyLlama-1.1B: 22 layers of 2048, 32 query heads over 4 key/value heads, 32000 ids).
SIZES = {
  "tiny": dict(V=256, L=64, D=64, H=4, N=2, F=128, kv_heads=2, tied_head=False),
  "1b": dict(
    V=32000, L=2048, D=2048, H=32, N=22, F=5632, kv_heads=4, tied_head=False, rope_theta=10000.0
  ),
}


def check(cfg: base.ModelConfig) -> None:
  base.require_defaults(cfg, "window", "layer_types")
  if cfg.F is None:
    raise errors.UserValueError(
      "model.arch=llama needs its MLP width: set model.F (e.g. 8/3 of model.D, rounded)"
    )
  G = cfg.num_kv_heads
  if G < 1 or cfg.H % G:
    raise errors.UserValueError(
      f"model.kv_heads={cfg.kv_heads} must divide model.H={cfg.H} (each key/value head serves "
      "H / kv_heads query heads)"
    )
  if cfg.head_dim % 2:
    raise errors.UserValueError(
      f"the head width D / H = {cfg.head_dim} must be even for rotary positions"
    )
  if not cfg.rope_theta > 0:
    raise errors.UserValueError(f"model.rope_theta={cfg.rope_theta} must be > 0")


def _dense(cfg, rngs, d_in, d_out):
  init = nnx.initializers.normal(0.02)
  return nnx.Linear(
    d_in, d_out, use_bias=False, dtype=jnp.dtype(cfg.dtype), kernel_init=init, rngs=rngs
  )


class RMSNorm(nnx.Module):
  """``scale * cast(x / rms(x))``, the root mean square taken in float32."""

  def __init__(self, cfg: base.ModelConfig):
    self.scale = nnx.Param(jnp.ones((cfg.D,), jnp.float32))
    self.eps = cfg.norm_eps

  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x_BxLxD.dtype) * normed.astype(x_BxLxD.dtype)


def rotate(x_BxLxHxK, positions_BxL, theta: float):
  """RoPE in the rotate-half convention: feature ``i < K/2`` pairs with ``i + K/2``, both turned by
  ``position * theta^(-2i/K)`` (computed in float32, returned in ``x``'s dtype)."""
  K = x_BxLxHxK.shape[-1]
  inv_freq_H = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
  angle_BxLxH = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_H
  cos, sin = (
    jnp.concatenate([f(angle_BxLxH)] * 2, axis=-1)[:, :, None] for f in (jnp.cos, jnp.sin)
  )
  x = x_BxLxHxK.astype(jnp.float32)
  half = K // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_BxLxHxK.dtype)


class Block(nnx.Module):
  """RMSNorm, rotary grouped-query attention, RMSNorm, SwiGLU MLP; residuals around both."""

  def __init__(self, cfg: base.ModelConfig, *, rngs: nnx.Rngs):
    K, G = cfg.head_dim, cfg.num_kv_heads
    self.attn_norm = RMSNorm(cfg)
    self.attn_q = _dense(cfg, rngs, cfg.D, cfg.H * K)
    self.attn_k = _dense(cfg, rngs, cfg.D, G * K)
    self.attn_v = _dense(cfg, rngs, cfg.D, G * K)
    self.attn_out = _dense(cfg, rngs, cfg.H * K, cfg.D)
    self.mlp_norm = RMSNorm(cfg)
    self.mlp_gate = _dense(cfg, rngs, cfg.D, cfg.mlp_dim)
    self.mlp_up = _dense(cfg, rngs, cfg.D, cfg.mlp_dim)
    self.mlp_down = _dense(cfg, rngs, cfg.mlp_dim, cfg.D)
    self.cfg = cfg

  def __call__(self, x_BxLxD, ctx: base.Context, key=None):
    cfg = self.cfg
    B, L, D = x_BxLxD.shape
    K, G = cfg.head_dim, cfg.num_kv_heads
    keys = (None, None) if key is None else tuple(jax.random.split(key))
    h_BxLxD = self.attn_norm(x_BxLxD)
    q_BxLxHxK = rotate(
      self.attn_q(h_BxLxD).reshape(B, L, cfg.H, K), ctx.positions_BxL, cfg.rope_theta
    )
    k_BxLxGxK = rotate(self.attn_k(h_BxLxD).reshape(B, L, G, K), ctx.positions_BxL, cfg.rope_theta)
    v_BxLxGxK = self.attn_v(h_BxLxD).reshape(B, L, G, K)
    att_BxLxHxK = base.attention(
      q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, cfg, segments_BxL=ctx.segments_BxL, cache=ctx.cache
    )
    att_BxLxD = self.attn_out(att_BxLxHxK.reshape(B, L, cfg.H * K))
    x_BxLxD = x_BxLxD + base.dropout(att_BxLxD, cfg.dropout, keys[0])
    h_BxLxD = self.mlp_norm(x_BxLxD)
    h_BxLxF = jax.nn.silu(self.mlp_gate(h_BxLxD)) * self.mlp_up(h_BxLxD)
    return x_BxLxD + base.dropout(self.mlp_down(h_BxLxF), cfg.dropout, keys[1])


class Shared(nnx.Module):
  """Token embedding, final RMSNorm and the head (its own matrix unless ``cfg.tied_head``)."""

  def __init__(self, cfg: base.ModelConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    init = nnx.initializers.normal(0.02)
    rows_init = base.padded_rows_init(cfg.V, init) if cfg.padded_vocab > cfg.V else init
    self.wte = nnx.Embed(cfg.padded_vocab, cfg.D, dtype=dt, embedding_init=rows_init, rngs=rngs)
    self.norm_f = RMSNorm(cfg)
    if not cfg.tied_head:
      self.lm_head = nnx.Param(rows_init(rngs.params(), (cfg.padded_vocab, cfg.D)))
    self.cfg = cfg

  def embed(self, tokens_BxL, ctx: base.Context, key=None):
    return base.dropout(self.wte(tokens_BxL), self.cfg.dropout, key)

  def head(self, x_BxLxD):
    rows = self.wte.embedding if self.cfg.tied_head else self.lm_head
    return base.tied_logits(rows[...], self.norm_f(x_BxLxD))


def flops_per_token(cfg: base.ModelConfig, seq_len: int) -> float:
  """6 x (matmul weights) + 12 N D seq_len, with grouped-query projections and the SwiGLU MLP's
  three matrices; the head counts once whether tied or not (it is one GEMM either way)."""
  kv = cfg.num_kv_heads * cfg.head_dim
  per_block = 2 * cfg.D * cfg.D + 2 * cfg.D * kv + 3 * cfg.D * cfg.mlp_dim
  matmul_weights = cfg.N * per_block + cfg.V * cfg.D
  return float(6 * matmul_weights + 12 * cfg.N * cfg.D * seq_len)


# -- Hugging Face ----------------------------------------------------------------------------------

HF_MODEL_TYPE = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"
HF_PREFIX = "model."
HF_IGNORED = (r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
HF_TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")  # a tied model may store it anyway

_BLOCK_NAMES = {
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_out": "self_attn.o_proj",
  "mlp_gate": "mlp.gate_proj",
  "mlp_up": "mlp.up_proj",
  "mlp_down": "mlp.down_proj",
}


def hf_tensors(cfg: base.ModelConfig) -> list[base.HFTensor]:
  """Every parameter's Hugging Face name (``nn.Linear`` weights transposed; ``lm_head`` is
  ``[V, D]`` there and here)."""
  out = [
    base.HFTensor("model.embed_tokens.weight", ("wte", "embedding"), vocab_rows=True),
    *base.hf_norm("model.norm", ("norm_f",), bias=False),
  ]
  if not cfg.tied_head:
    out.append(base.HFTensor("lm_head.weight", ("lm_head",), vocab_rows=True))
  for i in range(cfg.N):
    block, name = ("blocks", str(i)), f"model.layers.{i}"
    out += base.hf_norm(f"{name}.input_layernorm", (*block, "attn_norm"), bias=False)
    out += base.hf_norm(f"{name}.post_attention_layernorm", (*block, "mlp_norm"), bias=False)
    for ours, theirs in _BLOCK_NAMES.items():
      out += base.hf_linear(f"{name}.{theirs}", (*block, ours), bias=False)
  return out


def _rope(hf: dict) -> float:
  """``rope_theta``, from ``rope_parameters`` (transformers 5) or the top level (earlier files);
  refuses a scaled RoPE (``rope_type`` other than default)."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
  if kind != "default":
    raise errors.UserValueError(
      f"this llama checkpoint scales its rotary positions (rope_type={kind!r}), which acco_jax "
      "does not run yet: use a checkpoint with plain RoPE"
    )
  return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def from_hf_config(hf: dict) -> dict:
  """ModelConfig fields from a ``LlamaConfig``'s ``config.json``."""
  base.hf_require(hf, "llama", hidden_act=("silu",), attention_bias=(False,), mlp_bias=(False,))
  D, H = hf["hidden_size"], hf["num_attention_heads"]
  if hf.get("head_dim") not in (None, D // H):
    raise errors.UserValueError(
      f"this llama checkpoint has head_dim={hf['head_dim']}, not hidden_size / "
      f"num_attention_heads = {D // H}, which acco_jax does not run"
    )
  return dict(
    V=hf["vocab_size"],
    L=hf["max_position_embeddings"],
    D=D,
    H=H,
    N=hf["num_hidden_layers"],
    F=hf["intermediate_size"],
    kv_heads=None if hf.get("num_key_value_heads", H) == H else hf["num_key_value_heads"],
    norm_eps=hf.get("rms_norm_eps", 1e-6),
    rope_theta=_rope(hf),
    tied_head=bool(hf.get("tie_word_embeddings", False)),
  )


def to_hf_config(cfg: base.ModelConfig) -> dict:
  return dict(
    vocab_size=cfg.V,
    max_position_embeddings=cfg.L,
    hidden_size=cfg.D,
    num_attention_heads=cfg.H,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    num_hidden_layers=cfg.N,
    intermediate_size=cfg.mlp_dim,
    rms_norm_eps=cfg.norm_eps,
    rope_theta=cfg.rope_theta,
    rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=cfg.tied_head,
    attention_dropout=0.0,
  )
