r"""The ACCO paper's TinyStories ablation setting (§4.3), shrunk by the argument for CPUs.

  python train.py --config configs/tinystories_acco.py --workdir runs/ts     # CPU-sized (default)
  python train.py --config configs/tinystories_acco.py:full --workdir runs/ts-36m --config.data.source=text:/path/TinyStories*.txt

``full``: the paper's 36M GPT-Neo-like model (D=768, 4 layers, 16 heads) with its own 10k BPE,
AdamW lr 5e-4 constant, wd 0.1, betas (0.9, 0.95), context 512, 8 workers. The embedded corpus
stands in for TinyStories unless ``data.source`` points at the real text. ``cpu``: the same recipe
shrunk to fit a 2-core CPU in minutes (D=128, 2 layers, 4 heads, 2k BPE, context 64).
Set ``--config.method`` to zero1 / dpu / wp to run the baselines on the same setting.
"""

from configs import common


def get_config(arg: str = "cpu"):
  arg = arg or "cpu"
  if arg not in ("cpu", "full"):
    raise ValueError(f"unknown preset {arg!r}: choose cpu or full")
  c = common.get_base("cpu", method="acco")
  c.opt.schedule, c.opt.warmup_updates, c.opt.min_lr_ratio = "constant", 0, 1.0
  c.opt.lr, c.opt.weight_decay, c.opt.decay = 5e-4, 0.1, "all"
  c.opt.clip_norm = 0.0  # the paper used no gradient clipping
  if arg == "full":
    c.model.size = "tinystories-36m"
    c.model.D = c.model.N = c.model.H = 0
    c.data.tokenizer, c.data.seq_len = "bpe:10000", 512
    c.batch.microbatch_size, c.batch.microbatches = 10, 4
    c.train.num_updates, c.mesh.cpu_devices = 2000, 0
  else:
    c.model.D, c.model.N, c.model.H = 128, 2, 4
    c.data.seq_len = 64
    c.opt.lr = 2e-3
  return c
