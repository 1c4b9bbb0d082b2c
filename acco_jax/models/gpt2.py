"""GPT-2 (Radford et al., 2019): learned positions, pre-LayerNorm blocks, tanh-GELU, tied head.

Blocks: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; attention with one ``[D, 3D]`` projection
to q|k|v and ``1/sqrt(K)`` scaling; MLP ``D -> F -> D`` with tanh-GELU. Initialisation as GPT-2's:
normal(0.02) everywhere, residual output projections normal(0.02 / sqrt(2N)), biases 0, LayerNorm
scales 1.

Parameters::

  wte/embedding [padded_vocab, D]   wpe/embedding [L, D]   ln_f/{scale, bias} [D]
  blocks/<i>/ ln_1/{scale, bias}, attn_qkv/{kernel [D, 3D], bias}, attn_out/{kernel [D, D], bias},
              ln_2/{scale, bias}, mlp_fc/{kernel [D, F], bias}, mlp_proj/{kernel [F, D], bias}

Hugging Face (``GPT2LMHeadModel``): the same tensors under ``transformer.``; its ``Conv1D`` weights
are ``[in, out]`` like ours, ``c_attn`` is q|k|v in our order, and the head is tied.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from acco_jax.models import base

# Sizes (parameter counts with tied embeddings):
#   tiny             V=256   L=64   D=64   H=4  N=2   120,576  (CPU tests)
#   tinystories-36m  V=10000 L=512  D=768  H=16 N=4   36,426,240  (ACCO's GPT-Neo-like ablation)
#   gpt2             V=50257 L=1024 D=768  H=12 N=12  124,439,808
#   gpt2-medium      V=50257 L=1024 D=1024 H=16 N=24  354,823,168
SIZES = {
  "tiny": dict(V=256, L=64, D=64, H=4, N=2),
  "tinystories-36m": dict(V=10000, L=512, D=768, H=16, N=4),
  "gpt2": dict(V=50257, L=1024, D=768, H=12, N=12),
  "gpt2-medium": dict(V=50257, L=1024, D=1024, H=16, N=24),
}


USES: tuple[str, ...] = ()  # no architecture-specific field (a tied head, full attention)


def check(cfg: base.ModelConfig) -> None:
  """Nothing beyond the schema's checks (every specific field at its default)."""


def _dense(cfg, rngs, d_in, d_out, std):
  return base.dense(cfg, rngs, d_in, d_out, std=std)


_layer_norm = base.layer_norm


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

  def __init__(self, cfg: base.ModelConfig, *, rngs: nnx.Rngs):
    out_std = 0.02 / math.sqrt(2 * cfg.N)
    self.ln_1 = _layer_norm(cfg, rngs)
    self.attn_qkv = _dense(cfg, rngs, cfg.D, 3 * cfg.D, 0.02)
    self.attn_out = _dense(cfg, rngs, cfg.D, cfg.D, out_std)
    self.ln_2 = _layer_norm(cfg, rngs)
    self.mlp_fc = _dense(cfg, rngs, cfg.D, cfg.mlp_dim, 0.02)
    self.mlp_proj = _dense(cfg, rngs, cfg.mlp_dim, cfg.D, out_std)
    self.cfg = cfg

  def __call__(self, x_BxLxD, ctx: base.Context, key=None):
    cfg = self.cfg
    B, L, D = x_BxLxD.shape
    keys = (None, None) if key is None else tuple(jax.random.split(key))
    qkv_BxLx3xHxK = self.attn_qkv(self.ln_1(x_BxLxD)).reshape(B, L, 3, cfg.H, cfg.head_dim)
    q, k, v = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
    att = base.block_attention(q, k, v, cfg, ctx)
    att_BxLxD = self.attn_out(att.reshape(B, L, D))
    x_BxLxD = x_BxLxD + base.dropout(att_BxLxD, cfg.dropout, keys[0])
    h_BxLxF = jax.nn.gelu(self.mlp_fc(self.ln_2(x_BxLxD)), approximate=True)
    return x_BxLxD + base.dropout(self.mlp_proj(h_BxLxF), cfg.dropout, keys[1])


class Shared(nnx.Module):
  """Token and position embeddings, final LayerNorm; the head is the token embedding."""

  def __init__(self, cfg: base.ModelConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    init = nnx.initializers.normal(0.02)
    wte_init = base.padded_rows_init(cfg.V, init) if cfg.padded_vocab > cfg.V else init
    self.wte = nnx.Embed(cfg.padded_vocab, cfg.D, dtype=dt, embedding_init=wte_init, rngs=rngs)
    self.wpe = nnx.Embed(cfg.L, cfg.D, dtype=dt, embedding_init=init, rngs=rngs)
    self.ln_f = _layer_norm(cfg, rngs)
    self.cfg = cfg

  def embed(self, tokens_BxL, ctx: base.Context, key=None):
    x_BxLxD = self.wte(tokens_BxL) + self.wpe(ctx.positions_BxL)
    return base.dropout(x_BxLxD, self.cfg.dropout, key)

  def head(self, x_BxLxD):
    return base.tied_logits(self.wte.embedding[...], self.ln_f(x_BxLxD))


def flops_per_token(cfg: base.ModelConfig, seq_len: int) -> float:
  """6 x (N (4 D^2 + 2 D F) + V D) + 12 N D seq_len (see :func:`acco_jax.model.flops_per_token`)."""
  matmul_weights = cfg.N * (4 * cfg.D**2 + 2 * cfg.D * cfg.mlp_dim) + cfg.V * cfg.D
  return float(6 * matmul_weights + 12 * cfg.N * cfg.D * seq_len)


# -- Hugging Face ----------------------------------------------------------------------------------

HF_MODEL_TYPE = "gpt2"
HF_ARCHITECTURE = "GPT2LMHeadModel"
HF_PREFIX = "transformer."  # some checkpoints (the original gpt2 upload) store names without it
HF_IGNORED = (r"h\.\d+\.attn\.(bias|masked_bias)",)  # the causal masks old versions saved
HF_TIED_HEAD = ("lm_head.weight", "transformer.wte.weight")  # stored anyway by some checkpoints

_BLOCK_NAMES = {
  "ln_1": "ln_1",
  "attn_qkv": "attn.c_attn",
  "attn_out": "attn.c_proj",
  "ln_2": "ln_2",
  "mlp_fc": "mlp.c_fc",
  "mlp_proj": "mlp.c_proj",
}


def hf_shared_tensors() -> list[base.HFTensor]:
  """The Hugging Face names of :class:`Shared`'s parameters (GPT-Neo's too)."""
  return [
    base.HFTensor("transformer.wte.weight", ("wte", "embedding"), vocab_rows=True),
    base.HFTensor("transformer.wpe.weight", ("wpe", "embedding")),
    *base.hf_norm("transformer.ln_f", ("ln_f",), bias=True),
  ]


def hf_tensors(cfg: base.ModelConfig) -> list[base.HFTensor]:
  """Every parameter's Hugging Face name (Conv1D weights are ``[in, out]``: none transposed)."""
  out = hf_shared_tensors()
  for i in range(cfg.N):
    for ours, theirs in _BLOCK_NAMES.items():
      at, name = ("blocks", str(i), ours), f"transformer.h.{i}.{theirs}"
      if ours.startswith("ln"):
        out += base.hf_norm(name, at, bias=True)
      else:
        out += base.hf_linear(name, at, bias=True, transpose=False)
  return out


def from_hf_config(hf: dict) -> dict:
  """ModelConfig fields from a ``GPT2Config``'s ``config.json`` (refusing what we do not run)."""
  base.hf_require(hf, "gpt2", activation_function=("gelu_new", "gelu_pytorch_tanh"))
  base.hf_require(hf, "gpt2", scale_attn_weights=(True,), scale_attn_by_inverse_layer_idx=(False,))
  base.hf_require(hf, "gpt2", tie_word_embeddings=(True,))
  return dict(
    V=hf["vocab_size"],
    L=hf["n_positions"],
    D=hf["n_embd"],
    H=hf["n_head"],
    N=hf["n_layer"],
    F=hf.get("n_inner"),
    norm_eps=hf.get("layer_norm_epsilon", 1e-5),
  )


def to_hf_config(cfg: base.ModelConfig) -> dict:
  return dict(
    vocab_size=cfg.V,
    n_positions=cfg.L,
    n_embd=cfg.D,
    n_head=cfg.H,
    n_layer=cfg.N,
    n_inner=cfg.F,
    layer_norm_epsilon=cfg.norm_eps,
    activation_function="gelu_new",
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    tie_word_embeddings=True,
    attn_pdrop=0.0,
    embd_pdrop=0.0,
    resid_pdrop=cfg.dropout,
  )
