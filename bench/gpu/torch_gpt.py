"""A PyTorch GPT-2 trainer in the nanoGPT style: the peer that bench/gpu/gpu_throughput.py times.

Same model as :mod:`acco_jax.model` (learned positions, pre-LayerNorm blocks, fused QKV projection,
causal scaled-dot-product attention, tanh-GELU MLP, final LayerNorm, head tied to the token
embedding; GPT-2 initialisation) and the same training recipe as the ``gpt2`` preset: bfloat16
autocast over float32 weights, ``k`` microbatches accumulated per update, global-norm clipping at
1.0, AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on the matrices and embeddings only, fused
on CUDA). ``torch.compile`` compiles the model; attention goes through
``F.scaled_dot_product_attention`` (flash on an H100).

The vocabulary: ``rows`` embedding rows (``V`` or a padded count such as 50304). As in nanoGPT, a
padded peer simply has more classes; the targets never name a padded id.

Only imported where ``torch`` is installed; :mod:`bench.gpu.gpu_throughput` skips the peer otherwise.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
  def __init__(self, D: int, H: int, F_: int, N: int):
    super().__init__()
    self.H = H
    self.ln_1 = nn.LayerNorm(D, eps=1e-5)
    self.attn_qkv = nn.Linear(D, 3 * D)
    self.attn_out = nn.Linear(D, D)
    self.ln_2 = nn.LayerNorm(D, eps=1e-5)
    self.mlp_fc = nn.Linear(D, F_)
    self.mlp_proj = nn.Linear(F_, D)
    for lin, std in ((self.attn_qkv, 0.02), (self.mlp_fc, 0.02)):
      nn.init.normal_(lin.weight, std=std)
    for lin in (self.attn_out, self.mlp_proj):  # residual outputs: GPT-2's 1/sqrt(2N)
      nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * N))
    for lin in (self.attn_qkv, self.attn_out, self.mlp_fc, self.mlp_proj):
      nn.init.zeros_(lin.bias)

  def forward(self, x):
    B, L, D = x.shape
    qkv = self.attn_qkv(self.ln_1(x)).view(B, L, 3, self.H, D // self.H)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, L, K]
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.attn_out(att.transpose(1, 2).reshape(B, L, D))
    return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
  """Token and position embeddings, ``N`` blocks, final LayerNorm, tied head."""

  def __init__(self, rows: int, L: int, D: int, H: int, N: int, F_: int | None = None):
    super().__init__()
    self.wte = nn.Embedding(rows, D)
    self.wpe = nn.Embedding(L, D)
    nn.init.normal_(self.wte.weight, std=0.02)
    nn.init.normal_(self.wpe.weight, std=0.02)
    self.blocks = nn.ModuleList(Block(D, H, F_ or 4 * D, N) for _ in range(N))
    self.ln_f = nn.LayerNorm(D, eps=1e-5)

  def forward(self, tokens, targets):
    """Mean next-token cross-entropy (float32) of ``targets`` given ``tokens`` ``[B, L]``."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    x = self.wte(tokens) + self.wpe(pos)[None]
    for block in self.blocks:
      x = block(x)
    logits = self.ln_f(x) @ self.wte.weight.T  # tied head; bf16 under autocast
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def load_jax_params(net: GPT, params) -> None:
  """Copies an :func:`acco_jax.model.init_params` tree (numpy-convertible leaves) into ``net``."""

  def put(dst, src, transpose=False):
    t = torch.from_numpy(np.array(src, dtype=np.float32))  # a writable copy
    dst.data.copy_(t.T if transpose else t)

  put(net.wte.weight, params["wte"]["embedding"])
  put(net.wpe.weight, params["wpe"]["embedding"])
  put(net.ln_f.weight, params["ln_f"]["scale"])
  put(net.ln_f.bias, params["ln_f"]["bias"])
  for i, block in enumerate(net.blocks):
    p = params["blocks"][str(i)]
    for name in ("ln_1", "ln_2"):
      put(getattr(block, name).weight, p[name]["scale"])
      put(getattr(block, name).bias, p[name]["bias"])
    for name in ("attn_qkv", "attn_out", "mlp_fc", "mlp_proj"):
      put(getattr(block, name).weight, p[name]["kernel"], transpose=True)
      put(getattr(block, name).bias, p[name]["bias"])


def make_optimizer(net: nn.Module, lr: float = 6e-4, fused: bool | None = None):
  """AdamW with decay on 2-D parameters only, as ``acco_jax.model.decay_mask``."""
  decay = [p for p in net.parameters() if p.dim() >= 2]
  no_decay = [p for p in net.parameters() if p.dim() < 2]
  groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
  fused = torch.cuda.is_available() if fused is None else fused
  return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def run(
  *,
  rows: int,
  L: int,
  D: int,
  H: int,
  N: int,
  B: int,
  k: int,
  steps: int,
  warmup: int,
  compile: bool = True,
  seed: int = 0,
  V: int | None = None,
) -> dict:
  """Trains on fixed random batches; returns tokens/s over ``steps`` updates after ``warmup``."""
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.manual_seed(seed)
  net = GPT(rows, L, D, H, N).to(device)
  opt = make_optimizer(net)
  model = torch.compile(net) if compile else net
  g = torch.Generator(device="cpu").manual_seed(seed)
  data = torch.randint(0, V or rows, (k, B, L + 1), generator=g).to(device)
  torch.backends.cuda.matmul.allow_tf32 = True

  def update():
    for j in range(k):
      with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = model(data[j, :, :-1], data[j, :, 1:]) / k
      loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  for _ in range(warmup):
    update()
  sync()
  start = time.perf_counter()
  for _ in range(steps):
    loss = update()
  sync()
  seconds = (time.perf_counter() - start) / steps
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  return {
    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    "torch": torch.__version__,
    "compiled": compile,
    "step_s": seconds,
    "tokens_per_s": k * B * L / seconds,
    "peak_bytes": peak,
    "final_loss": float(loss.detach()) * k,
    "params": sum(p.numel() for p in net.parameters()),
  }
