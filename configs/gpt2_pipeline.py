r"""GPT-2 on a pipeline: blocks sharded over a 'stage' mesh axis (acco_jax.pipeline).

  python train.py --config configs/gpt2_pipeline.py --workdir runs/pipeline            # CPU, 1F1B
  python train.py --config configs/gpt2_pipeline.py --workdir runs/gpipe \
    --config.pipeline.schedule=gpipe
  python train.py --config configs/gpt2_pipeline.py --workdir runs/skippipe \
    --config.pipeline.schedule=skippipe --config.pipeline.skip=0.25 --config.pipeline.swap=True
  python train.py --config configs/gpt2_pipeline.py --workdir runs/pipe-acco \
    --config.pipeline.data_method=acco           # ACCO over each stage's data lanes
  python train.py --config configs/gpt2_pipeline.py:gpt2 --workdir runs/pipeline-124m  # GPUs

Each step runs batch.microbatches microbatches of batch.microbatch_size rows per data lane through
the schedule; the devices form (devices / pipeline.stages) data lanes of pipeline.stages stages.
pipeline.blocks_per_stage (auto: balanced by time, stage 0 also runs the head) and
pipeline.data_method (ddp | zero1 | acco over each stage's lanes) are in configs/common.py.
"""

from configs import common


def get_config(arg: str = "cpu"):
  c = common.get_base(arg or "cpu", method="pipeline")
  # The pipeline group is configs/common.py's (shared with SkipPipe on data-parallel workers).
  c.pipeline.stages = 4  # S, devices per data lane; divides the device count, at most model.N
  c.pipeline.schedule = "1f1b"  # gpipe | 1f1b (full paths) | skippipe (partial, reordered paths)
  c.pipeline.skip = 0.25  # skippipe: share of the S stages a microbatch leaves out
  c.pipeline.swap = True  # skippipe: paths visit their stages in any order
  c.pipeline.seed = 0  # skippipe: the paths, drawn once per run
  c.batch.microbatches = 8  # M per data lane per update (more: smaller pipeline bubbles)
  if (arg or "cpu") == "tiny":
    c.model.N = 4
    c.batch.microbatches = 4
  return c
