r"""GPT-2 trained with DeMo (acco_jax.loco.demo): no inner optimizer and no gradient all-reduce;
every step each worker folds its gradient into its own momentum (decay 0.999), sends the top 32 DCT
coefficients of every 64 x 64 tile (float32 values, 12-bit indices), and all apply the sign of the
workers' averaged coefficients, transformed back.

  python train.py --config configs/gpt2_demo.py --workdir runs/demo
  python train.py --config configs/gpt2_demo.py:gpt2 --workdir runs/demo-124m

opt.lr, opt.schedule, opt.warmup_updates, opt.clip_norm and opt.weight_decay (decoupled, on every
parameter; the reference's 0) apply to the sign step; the other opt.* fields are unused. The sign
step moves every parameter by lr, so lr is much smaller than AdamW's.
"""

from configs import common


def get_config(arg: str = "cpu"):
  arg = arg or "cpu"
  c = common.get_base(arg, method="demo")
  c.loco.workers = 0  # one worker per device
  c.loco.sync_every = 1  # every step
  c.loco.topk, c.loco.chunk = 32, 64  # 32 of 4096 per tile (0.78%), 32 of 64 for 1-D chunks
  c.loco.ef_decay = 0.999  # momentum decay
  c.loco.aggregate = "mean_contributors"  # the reference
  c.opt.weight_decay = 0.0  # the reference's OLMo runs
  c.opt.lr = {"tiny": 1e-3, "cpu": 1e-3}.get(arg, 4e-4)  # sign-step size (reference: 4e-4)
  return c
