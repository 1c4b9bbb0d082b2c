r"""GPT-2 trained with NoLoCo (acco_jax.loco.noloco): no all-reduce; every ``loco.sync_every``
inner steps each worker averages with one random peer, with a heavy-ball outer step and a
consensus term (beta = 0.5, gamma = 0.7, H = 50 as the reference code).

  python train.py --config configs/gpt2_noloco.py --workdir runs/noloco            # CPU quick start
  python train.py --config configs/gpt2_noloco.py:gpt2 --workdir runs/noloco-124m  # GPT-2 124M

CPU quick start: 8 simulated devices as 8 workers of one device, H = 10 (10 pair averages in 100
inner steps). Inner Adam without weight decay, clipped at 1.0 (the reference). The workers must be
an even number: pairs are perfect matchings (loco.pairings of them, drawn from loco.pairing_seed).
The evaluated model is worker 0's slow weights.
"""

from configs import common


def get_config(arg: str = "cpu"):
  arg = arg or "cpu"
  c = common.get_base(arg, method="noloco")
  c.loco.workers = 0  # one worker per device (must be even)
  c.loco.sync_every = {"tiny": 2, "cpu": 10}.get(arg, 50)  # H (the reference: 50)
  c.loco.outer_lr, c.loco.outer_momentum = 0.7, 0.5  # gamma, beta (heavy-ball)
  c.loco.pairings, c.loco.pairing_seed = 16, 0
  c.opt.weight_decay = 0.0  # inner Adam, no weight decay
  return c
