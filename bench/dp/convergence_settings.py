"""The settings of ``bench/dp/convergence.py`` and the trainer config of one of its runs.

:data:`SETTINGS` holds each setting's model shrink, batch per update and methods; :func:`make_config`
builds a run's config (``configs/tinystories_acco.py:cpu`` with a setting's overrides) from a method
label, seed and setting. Other benchmarks run these settings too (``bench/dp/acco_quantized.py``,
``bench/loco/loco.py``).
"""

from __future__ import annotations

# The paper's DPU warm-ups (40 = ZeRO-Offload's value, 500) are counted in updates of its TinyStories
# run, whose length is not given. We assume the 2000 updates of configs/tinystories_acco.py:full, so
# 40 and 500 are 2% and 25% of training; each setting scales them to its own num_updates.
PAPER_UPDATES = 2000
PAPER_WARMUPS = (40, 500)

# Each setting: the model shrink, the batch per update and the methods. ``microbatches`` is per
# device per update (ACCO: two stages of half). Tokens per update = devices * microbatches *
# microbatch_size * seq_len.
SETTINGS = {
  "d8": dict(
    devices=8,
    D=128,
    N=2,
    H=4,
    tokenizer="bpe:2048",
    seq_len=64,
    microbatch_size=1,
    microbatches=4,
    num_updates=160,
    eval_every=8,
    eval_batches=12,
    methods=("zero1", "acco", "dpu", "dpu-w40", "dpu-w500", "wp"),
  ),
  "d32": dict(
    devices=32,
    D=64,
    N=2,
    H=4,
    tokenizer="bpe:2048",
    seq_len=64,
    microbatch_size=1,
    microbatches=2,
    num_updates=160,
    eval_every=8,
    eval_batches=4,
    methods=("zero1", "acco", "dpu"),
  ),
  # Diagnostic (not in the default run): d8 at the paper's TinyStories learning rate.
  "d8-lr5e-4": dict(
    devices=8,
    D=128,
    N=2,
    H=4,
    tokenizer="bpe:2048",
    seq_len=64,
    microbatch_size=1,
    microbatches=4,
    num_updates=160,
    eval_every=8,
    eval_batches=12,
    lr=5e-4,
    methods=("zero1", "acco", "dpu"),
  ),
  # Diagnostic: d32 at the same learning rate (bench/dp/acco_quantized.py's quantized ACCO at 32 devices).
  "d32-lr5e-4": dict(
    devices=32,
    D=64,
    N=2,
    H=4,
    tokenizer="bpe:2048",
    seq_len=64,
    microbatch_size=1,
    microbatches=2,
    num_updates=160,
    eval_every=8,
    eval_batches=4,
    lr=5e-4,
    methods=("zero1", "acco", "dpu"),
  ),
  # Low-communication methods (bench/loco/loco.py): M workers of 8/M devices, the d8 model and batch
  # per device, longer (H = 50 needs several syncs). Labels: ddp, diloco-h<H> (the paper's outer
  # Nesterov 0.7 / 0.9), diloco-h<H>-avg (outer lr 1, no momentum: parameter averaging, the best of
  # a short sweep at this scale), streaming-h<H> (2 fragments, FP4, tau = 1, alpha = 0.5, the
  # paper's outer step). loco-m8's DDP baseline is loco-m4's (the same run).
  "loco-m4": dict(
    devices=8,
    workers=4,
    D=128,
    N=2,
    H=4,
    tokenizer="bpe:2048",
    seq_len=64,
    microbatch_size=1,
    microbatches=4,
    num_updates=400,
    eval_every=25,
    eval_batches=12,
    methods=("ddp", "diloco-h10", "diloco-h50", "diloco-h50-avg", "streaming-h50"),
  ),
  "loco-m8": dict(
    devices=8,
    workers=8,
    D=128,
    N=2,
    H=4,
    tokenizer="bpe:2048",
    seq_len=64,
    microbatch_size=1,
    microbatches=4,
    num_updates=400,
    eval_every=25,
    eval_batches=12,
    baseline="loco-m4",
    methods=("diloco-h10", "diloco-h50", "diloco-h50-avg", "streaming-h50"),
  ),
  "smoke": dict(
    devices=2,
    D=32,
    N=1,
    H=2,
    tokenizer="byte",
    seq_len=32,
    microbatch_size=1,
    microbatches=2,
    num_updates=2,
    eval_every=1,
    eval_batches=2,
    methods=("zero1", "acco"),
  ),
}
LR = 2e-3  # constant, no warm-up, no clipping (the config's CPU-shrink LR); a setting may override
SEEDS = (0, 1, 2)
FRACTIONS = (0.25, 0.5, 1.0)  # points of training at which gaps to zero1 are reported


def warmup_updates(label: str, num_updates: int) -> int:
  """Synchronous DPU updates for a method label: ``dpu`` = 0, ``dpu-w40`` = 40 paper updates scaled."""
  if not label.startswith("dpu-w"):
    return 0
  paper = int(label.removeprefix("dpu-w"))
  return max(1, round(paper * num_updates / PAPER_UPDATES))


def tokens_per_update(s: dict) -> int:
  return s["devices"] * s["microbatches"] * s["microbatch_size"] * s["seq_len"]


# -- the trainer config of one run ------------------------------------------------------------------


def make_config(setting: str, label: str, seed: int):
  """The trainer config of one run: configs/tinystories_acco.py:cpu with the setting's overrides.

  A label ``<method>-int8`` / ``<method>-int4`` quantizes the communication (``comm`` group; every
  simulated device its own node, blocks of 256: ``bench/dp/acco_quantized.py``)."""
  from configs import tinystories_acco

  s = SETTINGS[setting]
  c = tinystories_acco.get_config("cpu")
  c.method = label.split("-")[0]
  if c.method in ("diloco", "streaming"):
    loco_overrides(c, label, s)
  parts = label.split("-")  # <method>-int8|int4[-n<devices per node>]
  if len(parts) > 1 and parts[1] in ("int8", "int4"):
    node_size = int(parts[2][1:]) if len(parts) > 2 and parts[2].startswith("n") else 1
    c.comm.quantize, c.comm.block, c.comm.node_size = parts[1], 256, node_size
  c.dpu_warmup_updates = warmup_updates(label, s["num_updates"])
  c.model.D, c.model.N, c.model.H = s["D"], s["N"], s["H"]
  c.data.tokenizer, c.data.seq_len = s["tokenizer"], s["seq_len"]
  c.batch.microbatch_size, c.batch.microbatches = s["microbatch_size"], s["microbatches"]
  c.opt.lr, c.opt.schedule = s.get("lr", LR), "constant"
  c.opt.warmup_updates, c.opt.clip_norm = 0, 0.0
  c.train.num_updates, c.train.seed = s["num_updates"], seed
  c.train.log_every = 1  # every stage; ACCO's two stages are averaged per update when collected
  c.train.eval_every, c.train.eval_batches = s["eval_every"], s["eval_batches"]
  c.train.sample_tokens = 0
  c.train.on_nonfinite = "stop"
  c.ckpt.every, c.ckpt.async_save = 0, False
  c.mesh.num_devices, c.mesh.cpu_devices = s["devices"], 0  # XLA_FLAGS is set by the parent
  return c


def loco_overrides(c, label: str, s: dict) -> None:
  """``diloco-h<H>``: DiLoCo (outer Nesterov 0.7 / 0.9); ``streaming-h<H>``: Streaming DiLoCo with
  2 fragments, FP4, tau = 1, alpha = 0.5 (the paper's final setting, 2 blocks -> 2 fragments)."""
  name, _, rest = label.partition("-h")
  h, _, variant = rest.partition("-")
  c.method = "streaming_diloco" if name == "streaming" else "diloco"
  c.loco.workers, c.loco.sync_every, c.loco.inner = s["workers"], int(h), "zero1"
  if variant == "avg":
    c.loco.outer_lr, c.loco.outer_momentum = 1.0, 0.0
  if name == "streaming":
    c.loco.fragments, c.loco.overlap_steps, c.loco.alpha, c.loco.quantize = 2, 1, 0.5, "fp4"
