r"""GPT-2 trained with SparseLoCo (acco_jax.loco.sparseloco): every ``loco.sync_every`` inner steps
each worker adds its pseudo-gradient to an error-feedback buffer (decay 0.95) and sends the top 64
of every 64 x 64 tile (1.56%), quantised to 2 bits, with 12-bit indices; the workers all-gather and
average them, and step with plain SGD at lr 1.

  python train.py --config configs/gpt2_sparseloco.py --workdir runs/sparseloco
  python train.py --config configs/gpt2_sparseloco.py:gpt2 --workdir runs/sparseloco-124m

CPU quick start: 8 simulated devices as 8 workers of one device, H = 10. Tiles are cut from each
device's shard (see acco_jax.loco.compress.sparse); with one device per worker they are the
reference's 64 x 64 tiles.
"""

from configs import common


def get_config(arg: str = "cpu"):
  arg = arg or "cpu"
  c = common.get_base(arg, method="sparseloco")
  c.loco.workers = 0  # one worker per device
  c.loco.sync_every = {"tiny": 2, "cpu": 10}.get(arg, 50)  # H (the paper: 15 to 100)
  c.loco.outer_lr, c.loco.outer_momentum = 1.0, 0.0  # plain SGD, lr 1
  c.loco.topk, c.loco.chunk = 64, 64  # 64 of 4096 per tile: 1.56%
  c.loco.bits = 2  # 2-bit values: per-tensor shift and 4-entry lookup
  c.loco.ef_decay = 0.95
  c.loco.aggregate = "mean_contributors"  # the reference code's scatter-mean
  return c
