r"""GPT-2 trained with the `dpu` method (see acco_jax.dp.methods).

  python train.py --config configs/gpt2_dpu.py --workdir runs/dpu            # CPU quick start
  python train.py --config configs/gpt2_dpu.py:gpt2 --workdir runs/dpu-124m  # GPT-2 124M on GPUs

The argument after the colon picks a size preset (configs/common.py: cpu, tiny, gpt2, gpt2-medium).
"""

from configs import common


def get_config(arg: str = "cpu"):
  return common.get_base(arg or "cpu", method="dpu")
