"""Mistral (Jiang et al., 2023): Llama's blocks with a sliding window of attention.

As Hugging Face's ``MistralForCausalLM`` computes it: with ``sliding_window`` w, every block's
query ``i`` sees keys ``j`` with ``0 <= i - j < w`` (transformers' mask keeps ``j > i - w``), the
local-attention path GPT-Neo's local blocks take (:func:`acco_jax.models.base.block_attention`):
``cfg.window`` w and ``cfg.layer_types`` ``'local'``; without one (``sliding_window`` null, as
Mistral-7B-v0.2 on), ``'global'``. Everything else is :mod:`acco_jax.models.llama`'s, and so are
the parameter names.
"""

from __future__ import annotations

from acco_jax import errors
from acco_jax.models import base, llama

# A tiny one for tests (a window of 8 shorter than its sequences) and Mistral-7B-v0.1's shapes.
SIZES = {
  "tiny": dict(
    V=256, L=64, D=64, H=4, N=2, F=128, kv_heads=2, tied_head=False, window=8, layer_types="local"
  ),
  "7b": dict(
    V=32000,
    L=32768,
    D=4096,
    H=32,
    N=32,
    F=14336,
    kv_heads=8,
    tied_head=False,
    window=4096,
    layer_types="local",
  ),
}
USES = (*llama.USES, "window", "layer_types")
Shared = llama.Shared
flops_per_token = llama.flops_per_token  # as GPT-Neo: the window is not counted cheaper


def check(cfg: base.ModelConfig) -> None:
  llama.check(cfg)
  if cfg.layer_types not in ("local", "global"):
    raise errors.UserValueError(
      f"model.arch=mistral has model.layer_types={cfg.layer_types!r}: give 'local' (every block "
      "sees model.window keys) or 'global' (no sliding window)"
    )
  if cfg.window < 1:
    raise errors.UserValueError(f"model.window={cfg.window} must be >= 1 (keys a query sees)")


class Block(llama.Block):
  WINDOWED = True


HF_MODEL_TYPE = "mistral"
HF_ARCHITECTURE = "MistralForCausalLM"
HF_PREFIX = llama.HF_PREFIX
HF_IGNORED = llama.HF_IGNORED
HF_TIED_HEAD = llama.HF_TIED_HEAD
hf_tensors = llama.hf_tensors


def from_hf_config(hf: dict) -> dict:
  """ModelConfig fields from a ``MistralConfig``'s ``config.json``."""
  base.hf_require(hf, "mistral", attention_bias=(False,))
  if hf.get("layer_types"):
    raise errors.UserValueError(
      "this mistral checkpoint sets layer_types (alternating attention, a Ministral model), which "
      "acco_jax does not run"
    )
  window = hf.get("sliding_window", 4096)
  local = dict(window=window, layer_types="local") if window else dict(layer_types="global")
  return dict(**llama.family_fields(hf, "mistral"), **local)


def to_hf_config(cfg: base.ModelConfig) -> dict:
  window = cfg.window if cfg.layer_types == "local" else None
  return dict(**llama.family_config(cfg), sliding_window=window, attention_bias=False)
