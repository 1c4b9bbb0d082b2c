"""Qwen2 and Qwen2.5 (Qwen team, 2024): Llama's blocks with biases on the q, k and v projections.

As Hugging Face's ``Qwen2ForCausalLM`` computes it without its sliding window (which no published
Qwen2/2.5 model turns on: ``use_sliding_window`` false; a checkpoint that turns it on is refused).
Everything else (RMSNorm, RoPE and its scalings, grouped-query attention, SwiGLU, a tied or untied
head) is :mod:`acco_jax.models.llama`'s, and so are the parameter names, plus
``blocks/<i>/attn_{q,k,v}/bias``.
"""

from __future__ import annotations

from acco_jax.models import base, llama

# A tiny one for tests (grouped-query attention, a tied head) and Qwen2.5-0.5B's shapes.
SIZES = {
  "tiny": dict(V=256, L=64, D=64, H=4, N=2, F=128, kv_heads=2, tied_head=True),
  "0.5b": dict(
    V=151936,
    L=32768,
    D=896,
    H=14,
    N=24,
    F=4864,
    kv_heads=2,
    tied_head=True,
    rope_theta=1000000.0,
    norm_eps=1e-6,
  ),
}
USES = llama.USES
check = llama.check
Shared = llama.Shared
flops_per_token = llama.flops_per_token  # the biases are no matmul


class Block(llama.Block):
  QKV_BIAS = True


HF_MODEL_TYPE = "qwen2"
HF_ARCHITECTURE = "Qwen2ForCausalLM"
HF_PREFIX = llama.HF_PREFIX
HF_IGNORED = llama.HF_IGNORED
HF_TIED_HEAD = llama.HF_TIED_HEAD


def hf_tensors(cfg: base.ModelConfig) -> list[base.HFTensor]:
  return llama.hf_tensors(cfg, qkv_bias=True)


def from_hf_config(hf: dict) -> dict:
  """ModelConfig fields from a ``Qwen2Config``'s ``config.json``."""
  base.hf_require(hf, "qwen2", use_sliding_window=(False,))
  return llama.family_fields(hf, "qwen2")


def to_hf_config(cfg: base.ModelConfig) -> dict:
  return dict(**llama.family_config(cfg), use_sliding_window=False, sliding_window=None)
