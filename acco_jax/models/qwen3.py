"""Qwen3 (Qwen team, 2025): Llama's blocks with an RMSNorm on each head of q and k, and a head
width of its own (``K``, ``head_dim``, not D / H).

As Hugging Face's ``Qwen3ForCausalLM`` computes it without a sliding window (refused, as
Qwen2's): q and k are each normalised over their K features per head (scales
``blocks/<i>/attn_q_norm/scale``, ``attn_k_norm/scale`` [K]) before RoPE; no biases
(``attention_bias`` true is refused). Everything else is :mod:`acco_jax.models.llama`'s.
"""

from __future__ import annotations

from acco_jax.models import base, llama

# A tiny one for tests (head width 32 with D 64 and 4 heads: H K = 2 D) and Qwen3-0.6B's shapes.
SIZES = {
  "tiny": dict(V=256, L=64, D=64, H=4, K=32, N=2, F=128, kv_heads=2, tied_head=True),
  "0.6b": dict(
    V=151936,
    L=40960,
    D=1024,
    H=16,
    K=128,
    N=28,
    F=3072,
    kv_heads=8,
    tied_head=True,
    rope_theta=1000000.0,
    norm_eps=1e-6,
  ),
}
USES = llama.USES
check = llama.check
Shared = llama.Shared
flops_per_token = llama.flops_per_token


class Block(llama.Block):
  QK_NORM = True


HF_MODEL_TYPE = "qwen3"
HF_ARCHITECTURE = "Qwen3ForCausalLM"
HF_PREFIX = llama.HF_PREFIX
HF_IGNORED = llama.HF_IGNORED
HF_TIED_HEAD = llama.HF_TIED_HEAD


def hf_tensors(cfg: base.ModelConfig) -> list[base.HFTensor]:
  return llama.hf_tensors(cfg, qk_norm=True)


def from_hf_config(hf: dict) -> dict:
  """ModelConfig fields from a ``Qwen3Config``'s ``config.json``."""
  base.hf_require(hf, "qwen3", use_sliding_window=(False,), attention_bias=(False,))
  return llama.family_fields(hf, "qwen3")


def to_hf_config(cfg: base.ModelConfig) -> dict:
  return dict(
    **llama.family_config(cfg), attention_bias=False, use_sliding_window=False, sliding_window=None
  )
