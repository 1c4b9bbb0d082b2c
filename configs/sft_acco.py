r"""Instruction fine-tuning with `acco` (the ACCO paper's third experiment), from pretrained weights.

  python train.py --config configs/gpt2_acco.py --workdir runs/acco       # pre-train (quick start)
  python train.py --config configs/sft_acco.py --workdir runs/sft         # fine-tune it, CPU
  python train.py --config configs/sft_acco.py:gpt_neo-2.7b --workdir runs/sft-neo \
    --config.model.init=hf:/models/gpt-neo-2.7B --config.data.source=jsonl:/data/alpaca.jsonl

The loss is on the responses only (acco_jax.data.instruct, acco_jax.data.examples); at the end the
run answers held-out prompts greedily and prints the exact-match accuracy (samples.jsonl). Every
data-parallel method runs through --config.method (zero1, ddp, dpu with dpu_warmup_updates); the
LoCo methods with --config.data.packing=True. Presets:

  cpu           the embedded instruction set (which book is a verse from; a verse's last word),
                from the quick start's run (model.init=run:runs/acco), 150 updates, 2-core CPU; on
                fewer of the 8 simulated devices where the model would not fit the machine's
                memory (mesh.fit_memory: SmolLM2-135M on 24 GB takes 2)
  tiny          tests: a model.init of the test's
  gpt_neo-2.7b  the paper's Table 5: Alpaca (data.source=jsonl:<alpaca.jsonl>, format alpaca),
                mini-batches padded to their longest example (buckets of 64, at most 512 tokens),
                4 rows per device, ACCO 2 microbatches per stage (4 per update), AdamW lr 2e-5, no
                weight decay, betas (0.9, 0.95), cosine; 8 devices give the global batch of 128;
                --config.method=dpu takes the paper's 50 warm-up updates (dpu_warmup_updates)
"""

from configs import common


def get_config(arg: str = "cpu"):
  arg = arg or "cpu"
  if arg not in ("cpu", "tiny", "gpt_neo-2.7b"):
    raise ValueError(f"unknown preset {arg!r}: choose one of cpu, tiny, gpt_neo-2.7b")
  c = common.get_base("tiny" if arg == "tiny" else "pretrained", method="acco")
  c.model.size, c.data.tokenizer = "init", "init"  # the architecture, sizes and ids of model.init
  c.data.source = "instruct:embedded"
  c.data.packing = False  # one example a row, padded to buckets of data.bucket
  c.opt.weight_decay, c.opt.b1, c.opt.b2, c.opt.schedule = 0.0, 0.9, 0.95, "cosine"
  c.dpu_warmup_updates = 50  # the paper's DPU warm-up (used by --config.method=dpu)
  c.train.sample_tokens = 0  # the answers are the sample (samples.jsonl)
  c.train.exact_match = "end"
  if arg == "cpu":
    c.model.init = "run:runs/acco"  # the README quick start's run (or hf:<dir>)
    c.model.vocab_multiple = 1
    c.data.seq_len = 128
    c.batch.microbatch_size, c.batch.microbatches = 4, 4  # 8 devices: 128 rows per update
    c.mesh.fit_memory = True  # fewer simulated devices where a large model.init needs it
    c.opt.lr, c.opt.warmup_updates = 1e-3, 10
    c.train.num_updates, c.train.eval_every, c.train.log_every = 150, 50, 10
    c.dpu_warmup_updates = 10
    c.ckpt.every = 50
  elif arg == "tiny":
    c.data.seq_len = 48
    c.data.bucket = 16
    c.batch.microbatch_size, c.batch.microbatches = 1, 2
    c.opt.lr, c.opt.warmup_updates = 1e-3, 1
    c.train.num_updates, c.train.eval_every, c.train.eval_batches = 4, 0, 2
    c.train.answer_prompts, c.train.answer_tokens = 4, 8
    c.dpu_warmup_updates = 1
  else:  # gpt_neo-2.7b: Table 5
    c.model.init = ""  # --config.model.init=hf:<a local EleutherAI/gpt-neo-2.7B directory>
    c.model.remat, c.model.vocab_multiple, c.model.attention = True, 128, "auto"
    c.data.source, c.data.format = "jsonl:data/alpaca_data.json", "alpaca"  # Alpaca's 52k
    c.data.seq_len, c.data.bucket = 512, 64
    c.batch.microbatch_size, c.batch.microbatches = 4, 4
    c.opt.lr, c.opt.warmup_updates = 2e-5, 0
    c.train.num_updates, c.train.eval_every, c.train.log_every = 1200, 100, 10
    c.train.eval_batches, c.train.answer_prompts, c.train.answer_tokens = 20, 200, 256
    c.ckpt.every = 200
    c.mesh.cpu_devices = 0
  return c
