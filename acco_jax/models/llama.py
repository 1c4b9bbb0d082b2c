"""Llama (Touvron et al., 2023): RMSNorm, rotary positions, grouped-query attention, SwiGLU, no
biases, and a head of its own unless tied.

As Hugging Face's ``LlamaForCausalLM`` computes it: blocks ``x + attn(rms_1(x))``,
``x + mlp(rms_2(x))``; RMSNorm normalises in float32 and casts back before its scale; q and k are
rotated by RoPE in the *rotate-half* convention (the first and second halves of each head's
``K`` features are the pairs, frequencies ``theta^(-2i/K)``, ``theta = cfg.rope_theta``, scaled
as ``cfg.rope_type`` says: :func:`acco_jax.models.base.rope_frequencies`), at each token's position; ``cfg.kv_heads`` heads of keys and values serve ``H / kv_heads`` query heads
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
  # Llama-3.2-1B: a tied head and RoPE scaled as Llama 3.1 scales it
  "3.2-1b": dict(
    V=128256,
    L=131072,
    D=2048,
    H=32,
    N=16,
    F=8192,
    kv_heads=8,
    tied_head=True,
    rope_theta=500000.0,
    rope_type="llama3",
    rope_factor=32.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_L=8192,
  ),
}


# the architecture-specific fields of the Llama family (Qwen2, Qwen3 and Mistral add their own)
USES = (
  "kv_heads",
  "K",
  "tied_head",
  "rope_theta",
  "rope_type",
  "rope_factor",
  "rope_low_freq_factor",
  "rope_high_freq_factor",
  "rope_original_L",
)


def check(cfg: base.ModelConfig) -> None:
  if cfg.F is None:
    raise errors.UserValueError(
      f"model.arch={cfg.arch} needs its MLP width: set model.F (e.g. 8/3 of model.D, rounded)"
    )
  G = cfg.num_kv_heads
  if G < 1 or cfg.H % G:
    raise errors.UserValueError(
      f"model.kv_heads={cfg.kv_heads} must divide model.H={cfg.H} (each key/value head serves "
      "H / kv_heads query heads)"
    )
  base.check_rope(cfg)


def _dense(cfg, rngs, d_in, d_out, bias=False):
  return base.dense(cfg, rngs, d_in, d_out, bias=bias)


RMSNorm = base.RMSNorm


class Block(nnx.Module):
  """RMSNorm, rotary grouped-query attention, RMSNorm, SwiGLU MLP; residuals around both.

  The Llama family's variants set: ``QKV_BIAS`` (Qwen2: biases on q, k, v), ``QK_NORM`` (Qwen3:
  an RMSNorm over each head's K features of q and k, before RoPE), ``WINDOWED`` (Mistral: the
  blocks ``cfg.layer_types`` makes local see ``cfg.window`` keys)."""

  QKV_BIAS = False
  QK_NORM = False
  WINDOWED = False

  def __init__(self, cfg: base.ModelConfig, *, rngs: nnx.Rngs):
    K, G = cfg.head_dim, cfg.num_kv_heads
    self.attn_norm = RMSNorm(cfg)
    self.attn_q = _dense(cfg, rngs, cfg.D, cfg.H * K, bias=self.QKV_BIAS)
    self.attn_k = _dense(cfg, rngs, cfg.D, G * K, bias=self.QKV_BIAS)
    self.attn_v = _dense(cfg, rngs, cfg.D, G * K, bias=self.QKV_BIAS)
    self.attn_out = _dense(cfg, rngs, cfg.H * K, cfg.D)
    if self.QK_NORM:
      self.attn_q_norm = RMSNorm(cfg, K)
      self.attn_k_norm = RMSNorm(cfg, K)
    self.mlp_norm = RMSNorm(cfg)
    self.mlp_gate = _dense(cfg, rngs, cfg.D, cfg.mlp_dim)
    self.mlp_up = _dense(cfg, rngs, cfg.D, cfg.mlp_dim)
    self.mlp_down = _dense(cfg, rngs, cfg.mlp_dim, cfg.D)
    self.cfg = cfg

  def _qkv(self, h_BxLxD, ctx: base.Context):
    cfg = self.cfg
    B, L, _ = h_BxLxD.shape
    K, G = cfg.head_dim, cfg.num_kv_heads
    q_BxLxHxK = self.attn_q(h_BxLxD).reshape(B, L, cfg.H, K)
    k_BxLxGxK = self.attn_k(h_BxLxD).reshape(B, L, G, K)
    if self.QK_NORM:
      q_BxLxHxK, k_BxLxGxK = self.attn_q_norm(q_BxLxHxK), self.attn_k_norm(k_BxLxGxK)
    inv_freq = base.rope_frequencies(cfg)
    q_BxLxHxK = base.rotate(q_BxLxHxK, ctx.positions_BxL, inv_freq)
    k_BxLxGxK = base.rotate(k_BxLxGxK, ctx.positions_BxL, inv_freq)
    return q_BxLxHxK, k_BxLxGxK, self.attn_v(h_BxLxD).reshape(B, L, G, K)

  def __call__(self, x_BxLxD, ctx: base.Context, key=None):
    cfg = self.cfg
    B, L, D = x_BxLxD.shape
    keys = (None, None) if key is None else tuple(jax.random.split(key))
    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = self._qkv(self.attn_norm(x_BxLxD), ctx)
    local_N = base.local_layers(cfg) if self.WINDOWED else ()
    att_BxLxHxK = base.block_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, cfg, ctx, local_N=local_N)
    att_BxLxD = self.attn_out(att_BxLxHxK.reshape(B, L, cfg.H * cfg.head_dim))
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
  q, kv = cfg.H * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  per_block = 2 * cfg.D * q + 2 * cfg.D * kv + 3 * cfg.D * cfg.mlp_dim
  matmul_weights = cfg.N * per_block + cfg.V * cfg.D
  return float(6 * matmul_weights + 12 * cfg.N * q * seq_len)


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


def hf_tensors(cfg: base.ModelConfig, *, qkv_bias=False, qk_norm=False) -> list[base.HFTensor]:
  """Every parameter's Hugging Face name (``nn.Linear`` weights transposed; ``lm_head`` is
  ``[V, D]`` there and here); ``qkv_bias`` and ``qk_norm`` add Qwen2's and Qwen3's tensors."""
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
      bias = qkv_bias and ours in ("attn_q", "attn_k", "attn_v")
      out += base.hf_linear(f"{name}.{theirs}", (*block, ours), bias=bias)
    if qk_norm:
      out += base.hf_norm(f"{name}.self_attn.q_norm", (*block, "attn_q_norm"), bias=False)
      out += base.hf_norm(f"{name}.self_attn.k_norm", (*block, "attn_k_norm"), bias=False)
  return out


_ROPE_PARAMETERS = {  # ours: transformers' rope parameter, for each scaling that reads it
  "rope_factor": "factor",
  "rope_low_freq_factor": "low_freq_factor",
  "rope_high_freq_factor": "high_freq_factor",
  "rope_original_L": "original_max_position_embeddings",
}
_ROPE_READS = {"default": (), "linear": ("rope_factor",), "llama3": tuple(_ROPE_PARAMETERS)}


def rope_fields(hf: dict, arch: str) -> dict:
  """The RoPE fields of a ``config.json`` in either dialect: transformers 5's
  ``rope_parameters`` (``rope_type``, ``rope_theta`` and the scaling's parameters) or 4.x's
  top-level ``rope_theta`` with ``rope_scaling`` (``rope_type``, or ``type`` in older files).
  Refuses in one line a scaling other than ``linear`` and ``llama3`` (``dynamic`` rescales with the
  sequence's length, ``yarn`` and others scale the attention too): none is silently ignored."""
  params = dict(hf.get("rope_scaling") or {})
  params.update(hf.get("rope_parameters") or {})
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in _ROPE_READS:
    raise errors.UserValueError(
      f"this {arch} checkpoint scales its rotary positions with rope_type={kind!r}, which "
      f"acco_jax does not run (it runs {', '.join(_ROPE_READS)}): use such a checkpoint"
    )
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise errors.UserValueError(
      f"this {arch} checkpoint rotates only part of each head (partial_rotary_factor={partial}), "
      "which acco_jax does not run: it rotates every feature"
    )
  fields = dict(rope_theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))))
  if kind != "default":
    fields["rope_type"] = kind
  if kind == "llama3":  # as transformers: the positions the model has, unless the file says
    params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
  for ours in _ROPE_READS[kind]:
    fields[ours] = type(base.DEFAULTS[ours])(params[_ROPE_PARAMETERS[ours]])
  return fields


def rope_config(cfg: base.ModelConfig) -> dict:
  """The RoPE fields of a ``config.json`` for ``cfg``, in both dialects."""
  params = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
  params.update({_ROPE_PARAMETERS[f]: getattr(cfg, f) for f in _ROPE_READS[cfg.rope_type]})
  out = dict(rope_theta=cfg.rope_theta, rope_parameters=params)
  if cfg.rope_type != "default":
    out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
  return out


def family_fields(hf: dict, arch: str) -> dict:
  """ModelConfig fields of a Llama-family ``config.json`` (Llama, Qwen2, Qwen3, Mistral)."""
  base.hf_require(hf, arch, hidden_act=("silu",), mlp_bias=(False,))
  D, H = hf["hidden_size"], hf["num_attention_heads"]
  return dict(
    V=hf["vocab_size"],
    L=hf["max_position_embeddings"],
    D=D,
    H=H,
    N=hf["num_hidden_layers"],
    F=hf["intermediate_size"],
    K=None if hf.get("head_dim") in (None, D // H) else hf["head_dim"],
    kv_heads=None if hf.get("num_key_value_heads", H) in (None, H) else hf["num_key_value_heads"],
    norm_eps=hf.get("rms_norm_eps", 1e-6),
    tied_head=bool(hf.get("tie_word_embeddings", False)),
    **rope_fields(hf, arch),
  )


def family_config(cfg: base.ModelConfig) -> dict:
  """The Llama family's fields of a ``config.json`` for ``cfg``."""
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
    **rope_config(cfg),
    hidden_act="silu",
    tie_word_embeddings=cfg.tied_head,
    attention_dropout=0.0,
  )


def from_hf_config(hf: dict) -> dict:
  """ModelConfig fields from a ``LlamaConfig``'s ``config.json``."""
  base.hf_require(hf, "llama", attention_bias=(False,))
  return family_fields(hf, "llama")


def to_hf_config(cfg: base.ModelConfig) -> dict:
  return dict(**family_config(cfg), attention_bias=False, mlp_bias=False)
