r"""GPT-2 trained with DiLoCo (acco_jax.loco.diloco): workers with local AdamW steps, an outer
Nesterov step on the mean pseudo-gradient every ``loco.sync_every`` inner steps.

  python train.py --config configs/gpt2_diloco.py --workdir runs/diloco            # CPU quick start
  python train.py --config configs/gpt2_diloco.py:gpt2 --workdir runs/diloco-124m  # GPT-2 124M

CPU quick start: 8 simulated devices as 8 workers of one device, H = 10 (10 syncs in 100 inner
steps). The argument after the colon picks a size preset (configs/common.py: cpu, tiny, gpt2,
gpt2-medium); the ``loco`` group is documented there.
"""

from configs import common


def get_config(arg: str = "cpu"):
  arg = arg or "cpu"
  c = common.get_base(arg, method="diloco")
  c.loco.workers = 0  # one worker per device
  c.loco.sync_every = {"tiny": 2, "cpu": 10}.get(arg, 100)  # H (the paper: 500 on C4)
  c.loco.outer_lr, c.loco.outer_momentum = 0.7, 0.9  # the paper's Nesterov outer step
  return c
