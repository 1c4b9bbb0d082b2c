"""The PyTorch peer of bench/gpu/gpu_throughput.py is the same model: its loss at acco_jax's weights.

Marked ``torch_peer`` and skipped without ``torch`` (``.ci/run`` installs a CPU build in its second
step). The peer is loaded with the parameters of :func:`acco_jax.model.init_params` and must give
the same float32 loss (1e-4 relative; the two frameworks sum in different orders) and the same
parameter count; one bf16 training update then runs through :func:`torch_gpt.run`.
"""

import jax
import numpy as np
import pytest

from acco_jax import model

torch = pytest.importorskip("torch", reason="the PyTorch peer needs torch: pip install torch")
from bench.gpu import torch_gpt  # noqa: E402

pytestmark = pytest.mark.torch_peer


def test_peer_is_the_same_model():
  cfg = model.get_config("tiny", V=300, L=16, D=32, H=4, N=2, dtype="float32")
  params = model.init_params(cfg, 0)
  net = torch_gpt.GPT(cfg.V, cfg.L, cfg.D, cfg.H, cfg.N)
  assert sum(p.numel() for p in net.parameters()) == model.num_params(params)
  torch_gpt.load_jax_params(net, jax.device_get(params))
  tokens = np.random.default_rng(0).integers(0, cfg.V, size=(3, cfg.L + 1), dtype=np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  want = float(model.loss_fn(params, cfg, batch)[0])
  with torch.no_grad():
    got = float(net(torch.as_tensor(tokens[:, :-1]).long(), torch.as_tensor(tokens[:, 1:]).long()))
  assert got == pytest.approx(want, rel=1e-4)


def test_peer_trains_one_bf16_update():
  out = torch_gpt.run(
    rows=128, V=100, L=16, D=32, H=4, N=1, B=2, k=2, steps=1, warmup=1, compile=False
  )
  assert out["tokens_per_s"] > 0 and np.isfinite(out["final_loss"])
  assert out["final_loss"] == pytest.approx(np.log(128), rel=0.1)  # near uniform at init
