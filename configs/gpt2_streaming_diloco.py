r"""GPT-2 trained with Streaming DiLoCo (acco_jax.loco.streaming_diloco): fragments of blocks
synced in turn, each reduction in flight for ``loco.overlap_steps`` inner steps, merged with
``loco.alpha``, pseudo-gradients sent in FP4 (E3M0).

  python train.py --config configs/gpt2_streaming_diloco.py --workdir runs/streaming
  python train.py --config configs/gpt2_streaming_diloco.py:gpt2 --workdir runs/streaming-124m

Presets: cpu and tiny use 2 fragments of the 4- and 2-layer models (one fragment syncs every
H/2 steps); gpt2 uses 4 fragments of 3 blocks (the paper's 3 layers per fragment), H = 100.
"""

from configs import common


def get_config(arg: str = "cpu"):
  arg = arg or "cpu"
  c = common.get_base(arg, method="streaming_diloco")
  c.loco.workers = 0  # one worker per device
  c.loco.sync_every = {"tiny": 4, "cpu": 10}.get(arg, 100)  # H
  c.loco.fragments = {"tiny": 2, "cpu": 2}.get(arg, 4)  # P (gpt2: 12 blocks / 3 per fragment)
  c.loco.layout = "strided"
  c.loco.overlap_steps = 1  # tau: one inner step of overlap ("a full compute step")
  c.loco.alpha = 0.5
  c.loco.quantize = "fp4"
  return c
