"""GPT-Neo (Black et al., 2021; EleutherAI): GPT-2's layout with separate q, k, v projections, no
scaling of the attention scores, and blocks that alternate global and local attention.

As Hugging Face's ``GPTNeoForCausalLM`` computes it: learned positions; pre-LayerNorm blocks
``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``; q, k, v projections without bias and an output
projection with bias; scores ``q . k`` **without** ``1/sqrt(K)`` (in float32: XLA's and cuDNN's
kernels accumulate the bf16 products in float32, as the reference upcasts q and k); a *local*
block's query ``i`` sees keys ``j`` with ``0 <= i - j < window``, a *global* block's every
``j <= i``; tanh-GELU MLP; final LayerNorm; tied head. Which blocks are local is
``cfg.layer_types`` cycled over the blocks (``'global,local'``: every second one, as in every
published GPT-Neo). Initialisation as the reference's: normal(0.02), biases 0, LayerNorm scales 1.

Parameters::

  wte/embedding [padded_vocab, D]   wpe/embedding [L, D]   ln_f/{scale, bias} [D]
  blocks/<i>/ ln_1/{scale, bias}, attn_q/kernel, attn_k/kernel, attn_v/kernel [D, D],
              attn_out/{kernel [D, D], bias}, ln_2/{scale, bias}, mlp_fc/{kernel [D, F], bias},
              mlp_proj/{kernel [F, D], bias}
"""

from __future__ import annotations

import jax
from flax import nnx

from acco_jax import errors
from acco_jax.models import base, gpt2

# The published models (EleutherAI/gpt-neo-*: hidden, layers, heads; window 256, 2048 positions,
# GPT-2's vocabulary) and a tiny one for tests whose local window is shorter than its sequences.
SIZES = {
  "tiny": dict(V=256, L=64, D=64, H=4, N=2, window=8),
  "125m": dict(V=50257, L=2048, D=768, H=12, N=12),
  "1.3b": dict(V=50257, L=2048, D=2048, H=16, N=24),
  "2.7b": dict(V=50257, L=2048, D=2560, H=20, N=32),
}

LAYER_TYPES = ("global", "local")


def layer_types(cfg: base.ModelConfig) -> tuple[str, ...]:
  """Each block's attention, ``'global'`` or ``'local'`` (``cfg.layer_types`` cycled)."""
  pattern = [t.strip() for t in cfg.layer_types.split(",")]
  return tuple(pattern[i % len(pattern)] for i in range(cfg.N))


USES = ("window", "layer_types")  # its tied head and learned positions are GPT-2's


def check(cfg: base.ModelConfig) -> None:
  bad = sorted({t for t in cfg.layer_types.split(",") if t.strip() not in LAYER_TYPES})
  if bad or not cfg.layer_types.strip():
    raise errors.UserValueError(
      f"model.layer_types={cfg.layer_types!r}: give a comma list of 'global' and 'local' (cycled "
      "over the blocks), e.g. 'global,local'"
    )
  if cfg.window < 1:
    raise errors.UserValueError(
      f"model.window={cfg.window} must be >= 1 (tokens a local block sees)"
    )


def _dense(cfg, rngs, d_in, d_out, bias=True):
  return base.dense(cfg, rngs, d_in, d_out, bias=bias)


_layer_norm = base.layer_norm


class Block(nnx.Module):
  """Pre-LayerNorm block with global or local unscaled attention (the block's ``ctx.layer``)."""

  def __init__(self, cfg: base.ModelConfig, *, rngs: nnx.Rngs):
    self.ln_1 = _layer_norm(cfg, rngs)
    self.attn_q = _dense(cfg, rngs, cfg.D, cfg.D, bias=False)
    self.attn_k = _dense(cfg, rngs, cfg.D, cfg.D, bias=False)
    self.attn_v = _dense(cfg, rngs, cfg.D, cfg.D, bias=False)
    self.attn_out = _dense(cfg, rngs, cfg.D, cfg.D)
    self.ln_2 = _layer_norm(cfg, rngs)
    self.mlp_fc = _dense(cfg, rngs, cfg.D, cfg.mlp_dim)
    self.mlp_proj = _dense(cfg, rngs, cfg.mlp_dim, cfg.D)
    self.cfg = cfg

  def _attention(self, h_BxLxD, ctx: base.Context):
    cfg = self.cfg
    B, L, _ = h_BxLxD.shape
    heads = lambda t: t.reshape(B, L, cfg.H, cfg.head_dim)
    q, k, v = heads(self.attn_q(h_BxLxD)), heads(self.attn_k(h_BxLxD)), heads(self.attn_v(h_BxLxD))
    local_N = base.local_layers(cfg)  # a local block sees keys within cfg.window
    return base.block_attention(q, k, v, cfg, ctx, scale=1.0, local_N=local_N)

  def __call__(self, x_BxLxD, ctx: base.Context, key=None):
    cfg = self.cfg
    B, L, D = x_BxLxD.shape
    keys = (None, None) if key is None else tuple(jax.random.split(key))
    att_BxLxD = self.attn_out(self._attention(self.ln_1(x_BxLxD), ctx).reshape(B, L, D))
    x_BxLxD = x_BxLxD + base.dropout(att_BxLxD, cfg.dropout, keys[0])
    h_BxLxF = jax.nn.gelu(self.mlp_fc(self.ln_2(x_BxLxD)), approximate=True)
    return x_BxLxD + base.dropout(self.mlp_proj(h_BxLxF), cfg.dropout, keys[1])


# Learned positions, the final LayerNorm and the tied head: GPT-2's own module (the same names and
# initial values; only the blocks and the Hugging Face names differ).
Shared = gpt2.Shared


def flops_per_token(cfg: base.ModelConfig, seq_len: int) -> float:
  """As GPT-2 (:func:`acco_jax.models.gpt2.flops_per_token`): the PaLM convention counts the full
  square of scores, so a local block is not counted cheaper."""
  return gpt2.flops_per_token(cfg, seq_len)


# -- Hugging Face ----------------------------------------------------------------------------------

HF_MODEL_TYPE = "gpt_neo"
HF_ARCHITECTURE = "GPTNeoForCausalLM"
HF_PREFIX = "transformer."
HF_IGNORED = (r"h\.\d+\.attn\.attention\.(bias|masked_bias)",)  # old uploads' causal masks
HF_TIED_HEAD = ("lm_head.weight", "transformer.wte.weight")

_BLOCK_NAMES = {
  "attn_q": "attn.attention.q_proj",
  "attn_k": "attn.attention.k_proj",
  "attn_v": "attn.attention.v_proj",
  "attn_out": "attn.attention.out_proj",
  "mlp_fc": "mlp.c_fc",
  "mlp_proj": "mlp.c_proj",
}


def hf_tensors(cfg: base.ModelConfig) -> list[base.HFTensor]:
  """Every parameter's Hugging Face name (``nn.Linear`` weights, ``[out, in]``: transposed)."""
  out = gpt2.hf_shared_tensors()  # Shared is GPT-2's
  for i in range(cfg.N):
    block, name = ("blocks", str(i)), f"transformer.h.{i}"
    out += base.hf_norm(f"{name}.ln_1", (*block, "ln_1"), bias=True)
    out += base.hf_norm(f"{name}.ln_2", (*block, "ln_2"), bias=True)
    for ours, theirs in _BLOCK_NAMES.items():
      bias = ours not in ("attn_q", "attn_k", "attn_v")
      out += base.hf_linear(f"{name}.{theirs}", (*block, ours), bias=bias)
  return out


def _period(types: list[str]) -> list[str]:
  """The shortest pattern that, cycled, gives ``types``."""
  for k in range(1, len(types) + 1):
    if all(t == types[i % k] for i, t in enumerate(types)):
      return types[:k]
  return types


def from_hf_config(hf: dict) -> dict:
  """ModelConfig fields from a ``GPTNeoConfig``'s ``config.json``."""
  base.hf_require(hf, "gpt_neo", activation_function=("gelu_new", "gelu_pytorch_tanh"))
  base.hf_require(hf, "gpt_neo", tie_word_embeddings=(True,))
  types = hf.get("attention_layers")
  if not types:  # older files: only the grouped form [[pattern, repeats], ...]
    types = [t for pattern, repeats in hf["attention_types"] for t in list(pattern) * repeats]
  if len(types) != hf["num_layers"] or not set(types) <= set(LAYER_TYPES):
    raise errors.UserValueError(
      f"this gpt_neo checkpoint's attention_layers {types} are not one of 'global' / 'local' per "
      f"layer for its {hf['num_layers']} layers"
    )
  return dict(
    V=hf["vocab_size"],
    L=hf["max_position_embeddings"],
    D=hf["hidden_size"],
    H=hf["num_heads"],
    N=hf["num_layers"],
    F=hf.get("intermediate_size"),
    norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    window=hf.get("window_size", 256),
    layer_types=",".join(_period(list(types))),
  )


def to_hf_config(cfg: base.ModelConfig) -> dict:
  types = list(layer_types(cfg))
  pattern = _period(types)
  grouped = [[pattern, cfg.N // len(pattern)]] if cfg.N % len(pattern) == 0 else [[types, 1]]
  return dict(
    vocab_size=cfg.V,
    max_position_embeddings=cfg.L,
    hidden_size=cfg.D,
    num_heads=cfg.H,
    num_layers=cfg.N,
    intermediate_size=cfg.F,
    layer_norm_epsilon=cfg.norm_eps,
    window_size=cfg.window,
    attention_types=grouped,
    attention_layers=types,
    activation_function="gelu_new",
    tie_word_embeddings=True,
    embed_dropout=0.0,
    attention_dropout=0.0,
    resid_dropout=cfg.dropout,
  )
