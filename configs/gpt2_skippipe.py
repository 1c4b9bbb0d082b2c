r"""GPT-2 trained with SkipPipe paths (acco_jax.pipeline) on the `zero1` method.

  python train.py --config configs/gpt2_skippipe.py --workdir runs/skippipe            # CPU
  python train.py --config configs/gpt2_skippipe.py:gpt2 --workdir runs/skippipe-124m  # GPUs
  python train.py --config configs/gpt2_skippipe.py --workdir runs/skippipe-pipe \
    --config.method=pipeline   # the scheduler's plan on a ('data', 'stage') pipeline mesh
  python -m bench.pipeline.skippipe --part plan --config configs/gpt2_skippipe.py:tiny   # print that plan

With method=pipeline every device is a node of the topology (a preset drawn with the device count),
each stage has one node per data lane, and microbatches cross lanes on the routes the scheduler
picks (acco_jax.skippipe.plans, ticks.from_plan).

Every microbatch runs stage 0's blocks and then a scheduled path through the other stages, with a
quarter of the stages left out and swaps allowed; the path scheduler plans for the geo preset.
Every worker holds the whole model (data parallel), as SkipPipe's convergence runs do; evaluation
runs the full model. The argument after the colon picks a size preset (configs/common.py).
"""

from configs import common


def get_config(arg: str = "cpu"):
  c = common.get_base(arg or "cpu", method="zero1")
  if (arg or "cpu") == "tiny":
    c.model.N = 4  # four one-block stages (the tiny model has 2 blocks)
  c.pipeline.stages = {"cpu": 4, "tiny": 4, "gpt2": 6, "gpt2-medium": 8}.get(arg or "cpu", 4)
  c.pipeline.skip = 0.25
  c.pipeline.swap = True
  c.pipeline.schedule = "skippipe"  # used with method=pipeline: paths on a 'stage' mesh axis
  return c
