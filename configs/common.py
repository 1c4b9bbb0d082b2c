"""Shared defaults for every config; each config file sets its method and size preset.

Every field is documented inline. Override anything on the command line, e.g.
``--config.opt.lr=1e-3 --config.train.num_updates=500``.
"""

import ml_collections

# Size presets selected by the argument after the colon: configs/gpt2_acco.py:<preset>.
#   cpu    the README's quick start: a 4-layer d256 GPT on the embedded corpus, 8 simulated CPU
#          devices, finishes in a few minutes on a 2-core machine
#   tiny   the smallest run (tests and CI smoke)
#   gpt2   GPT-2 124M, 1024 tokens, GPT-2 BPE (GPU)
#   gpt2-medium  GPT-2 355M (GPU)
#   gpt_neo-125m, gpt_neo-2.7b, llama-1b   the other architectures at those sizes, from scratch
#          with GPT-2's BPE (GPU; acco_jax.model.sizes(arch))
#   pretrained   from pretrained weights: pass --config.model.init=hf:<dir> or run:<workdir>;
#          the source sets the architecture and sizes, its tokenizer the ids (GPU or CPU)
PRESETS = (
  "cpu",
  "tiny",
  "gpt2",
  "gpt2-medium",
  "gpt_neo-125m",
  "gpt_neo-2.7b",
  "llama-1b",
  "pretrained",
)
GPU_PRESETS = ("gpt2", "gpt2-medium", "gpt_neo-125m", "gpt_neo-2.7b", "llama-1b")


# Over 80 lines: every field of a run's config with its default and a comment, one group after
# another (big_vision's configs as code); the presets' overrides are at the end.
def get_base(preset: str = "cpu", method: str = "acco") -> ml_collections.ConfigDict:
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
  c = ml_collections.ConfigDict()
  c.method = method  # acco | zero1 | ddp | dpu | wp | diloco | streaming_diloco | noloco |
  #                    sparseloco | demo | hdee (an expert ensemble: configs/hdee.py) |
  #                    pipeline (blocks over a 'stage' mesh axis: configs/gpt2_pipeline.py)
  c.comm_dtype = "bfloat16"  # dtype of the reduce-scatter / all-gather / all-reduce
  c.dpu_warmup_updates = 0  # dpu only: synchronous updates before the delay starts

  # Quantized communication (acco and zero1; acco_jax.dp.quantize): the gradients reach their shard
  # through an all-to-all of int8/int4 blocks, the compute weights get quantized updates.
  c.comm = ml_collections.ConfigDict()
  c.comm.quantize = "none"  # none | int8 | int4
  c.comm.block = 256  # values per float32 scale (a device's shard is zero-padded to a multiple)
  c.comm.error_feedback = True  # what a quantized send did not deliver is sent again later
  # Devices per node: gradients are reduce-scattered within a node in comm_dtype, and only node
  # sums are quantized and cross the network (1 = every device quantizes its own gradients;
  # 0 = the devices of one process when there are several processes, else 1).
  c.comm.node_size = 0
  # How the sharded methods (acco, zero1, dpu, wp) split the optimizer over the data axis:
  # elementwise (acco_jax.dp.flat: every leaf cut into N chunks; any elementwise optimizer) or
  # owner (acco_jax.dp.owner: each weight matrix whole on one device, for Muon and Adafactor).
  # auto: owner for an inner optimizer that is not elementwise (opt.name=muon), else elementwise
  # (acco_jax.dp.layouts.choose).
  c.comm.layout = "auto"  # auto | elementwise | owner

  c.model = ml_collections.ConfigDict()
  c.model.arch = "gpt2"  # gpt2 | gpt_neo | llama | qwen2 | qwen3 | mistral (acco_jax.models)
  c.model.size = "tiny"  # a preset of the arch (acco_jax.model.sizes(arch)); fields below override
  #                        it when > 0; 'init': every size from model.init's source
  c.model.D = 0  # width
  c.model.N = 0  # layers
  c.model.H = 0  # heads
  c.model.F = 0  # MLP width (0: the preset's; gpt2, gpt_neo: 4*D)
  c.model.kv_heads = 0  # llama family: key/value heads of grouped-query attention (0: the preset's)
  c.model.K = 0  # llama family: head width (0: the preset's; D / H unless it sets one, as qwen3)
  # Start from pretrained weights (acco_jax/run/pretrained.py): 'hf:<dir>', a local Hugging Face
  # directory (config.json, model.safetensors or its index), or 'run:<workdir>', a run of train.py
  # (its newest checkpoint's committed parameters). The source sets the architecture and sizes:
  # model.arch/size/D/N/H/F/kv_heads must agree with it, or be left to it (model.size=init). The
  # run starts at update 0 with a fresh optimizer (ckpt.init_from instead continues a run);
  # data.tokenizer=init takes the source's tokenizer.
  c.model.init = ""
  c.model.dtype = "bfloat16"  # compute dtype (params stay float32)
  c.model.remat = False  # rematerialise each block in the backward pass
  c.model.attention = "auto"  # auto | xla | cudnn
  # Pad the embedding and the tied head to a multiple of this many rows (1 = none). The padded
  # rows start at zero and are masked out of the loss and of sampling; only speed changes
  # (GPT-2's 50257 -> 50304 with 128). Checkpoints record it; resuming needs the same value.
  c.model.vocab_multiple = 1

  c.data = ml_collections.ConfigDict()
  c.data.source = "embedded"  # embedded | text:<path or glob> | tfds:<name>[:<split>]
  # byte | gpt2 | bpe:<vocab size> (trained on the corpus, cached) | bpe:<path.json> |
  # hf:<dir> (a Hugging Face directory's tokenizer.json) | init (model.init's source's)
  c.data.tokenizer = "bpe:2048"
  c.data.seq_len = 128  # tokens per row (the model's context; at most a pretrained model's)
  c.data.eval_fraction = 0.05  # share of documents held out for evaluation
  c.data.split_seed = 0  # which documents are held out (fixed across training seeds)
  c.data.cache_dir = ""  # token / tokenizer cache ('' = ~/.cache/acco_jax)
  c.data.data_dir = ""  # TFDS data dir ('' = TFDS default)
  c.data.text_key = "text"  # TFDS text feature
  # Instruction data (data.source=jsonl:<path or glob> or instruct:embedded; acco_jax.data.instruct):
  # the loss is on the responses only
  c.data.format = "alpaca"  # jsonl: alpaca | prompt_completion | chat
  c.data.chat_template = "builtin"  # chat: builtin | hf (the tokenizer's own, marked or not)
  c.data.packing = False  # several examples a row (segment masks) | one a row, padded to buckets
  c.data.bucket = 64  # packing=False: rows padded to a multiple of this (one program per bucket)

  c.batch = ml_collections.ConfigDict()
  c.batch.microbatch_size = 2  # rows per device per microbatch
  c.batch.microbatches = (
    4  # microbatches per device per optimizer update (ACCO: two stages of half)
  )

  # Heterogeneous workers: per-device microbatch budgets per stage (acco_jax.dp.hetero). The update
  # is the mean over all microbatches of all devices, whatever each device's budget.
  c.hetero = ml_collections.ConfigDict()
  c.hetero.budgets = ""  # fixed budgets, one per device: "4,4,4,1" ('' = the same for all)
  c.hetero.adaptive = ""  # '' | balance (fixed total, split by speed) | fill (fill the window)
  c.hetero.max_microbatches = 0  # largest adaptive budget per stage (0 = 4x the base)
  c.hetero.adapt_every = 20  # stages between timing probes of the adaptive policy
  c.hetero.hysteresis = 0.1  # ignore plans that move less than this share of the microbatches
  c.hetero.slowdown = ""  # simulate stragglers: "device:seconds,..." of sleep per microbatch

  # Workers with local steps and an outer optimizer (method diloco | streaming_diloco | noloco |
  # sparseloco | demo; acco_jax.loco, acco_jax.loco.step). An update is one inner step of every
  # worker.
  c.loco = ml_collections.ConfigDict()
  c.loco.workers = (
    0  # M, workers on the 'replica' axis, each of devices/M devices (0 = one per device)
  )
  c.loco.inner = "zero1"  # the inner data-parallel step within a worker: zero1 | ddp | acco
  c.loco.sync_every = 10  # H, inner steps between two syncs of a fragment (all of it for diloco)
  c.loco.outer_lr = 0.7  # outer SGD learning rate
  c.loco.outer_momentum = 0.9  # outer momentum (Nesterov); 0 = plain SGD
  c.loco.fragments = 1  # P, fragments of blocks synced in turn every H/P steps (streaming_diloco)
  c.loco.layout = "strided"  # strided (block l in fragment l mod P) | sequential
  c.loco.overlap_steps = 0  # tau in [0, H/P): inner steps a fragment's reduction is in flight
  c.loco.alpha = 0.0  # merge: local <- alpha * local + (1 - alpha) * global (0 = replace)
  c.loco.outer_overlap = "none"  # none (blocking) | delayed | eager: a sync's reduction runs
  # during the next phase (diloco, streaming_diloco, sparseloco; acco_jax.loco.overlap)
  c.loco.quantize = "none"  # outer pseudo-gradients on the wire: none (float32) | fp4 (E3M0)
  c.loco.quantize_block = 2048  # values per FP4 power-of-two scale (within a device's shard)
  # sparseloco / demo: top-k per chunk of a device's shard, error feedback, all-gather
  c.loco.topk = 64  # k per chunk of chunk^2 values (sparseloco: 1-D chunks keep the same share)
  c.loco.chunk = 64  # largest tile side of 2-D leaves / length of 1-D chunks
  c.loco.bits = 2  # sparseloco value quantiser: 2 | 4 | 8 bits (shift + lookup) | 32 (float32)
  c.loco.ef_decay = 0.95  # error-feedback decay (sparseloco) / momentum decay (demo: 0.999)
  c.loco.ef_scale = "one"  # sparseloco: e <- b e + delta (one, the paper) | + outer_lr delta (code)
  c.loco.aggregate = "mean_contributors"  # mean_contributors | mean_R (divide by all workers)
  # noloco: each worker averages with one random peer
  c.loco.pairings = 16  # K random perfect matchings drawn once; one is picked per sync
  c.loco.pairing_seed = 0  # the shared seed of the matchings and of the pick per sync
  # workers as separate jobs meeting through a store (acco_jax.loco.transport; docs/workers.md)
  c.loco.transport = "mesh"  # mesh (one SPMD program) | store:<url> (a directory or a bucket)
  c.loco.worker = 0  # store: this job's worker id in [0, loco.workers) (its share of the data)
  c.loco.grace_s = 30.0  # store: a round closes this long after its first payload (or when all
  # live workers have sent theirs)
  c.loco.min_workers = 1  # store: payloads a round waits for, whatever the grace
  c.loco.lease_s = 120.0  # store: a worker silent this long is no longer waited for
  c.loco.keep_rounds = 8  # store: rounds kept for workers that catch up (older ones collected)
  c.loco.snapshot_every = 4  # store: rounds between two snapshots of the global state (joiners)

  # SkipPipe paths (acco_jax.pipeline): every microbatch runs stage 0's blocks, then the stages of
  # its path in path order, skipping some and (with swap) reordering them; every worker holds the
  # whole model (data parallel: ddp, zero1, acco, dpu, wp). Evaluation runs the full model.
  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.stages = 0  # S, stages of model.N / S blocks (0 = off: every block, in order)
  c.pipeline.skip = 0.0  # share of the S stages a microbatch leaves out (stage 0 always runs)
  c.pipeline.swap = False  # paths may visit their stages out of order
  c.pipeline.paths = "scheduled"  # scheduled (the path scheduler's plan) | random (each iteration)
  c.pipeline.topology = "geo"  # single-cluster | multi-cluster | geo | path of a JSON topology
  c.pipeline.memory = 0  # m, microbatches a node may host per iteration (0 = least + 1)
  c.pipeline.balance = 0  # c, microbatches a stage may take per iteration (0 = equal share)
  c.pipeline.seed = 0  # topology preset, stage assignment, scheduler and random paths
  c.pipeline.search_iters = 400  # the scheduler's local-search moves
  # method=pipeline (configs/gpt2_pipeline.py): blocks sharded over a 'stage' mesh axis
  c.pipeline.schedule = "1f1b"  # gpipe | 1f1b (full paths) | skippipe (partial, reordered paths)
  # blocks per stage: auto (balanced by time, stage 0 runs the head too; skippipe: equal where
  # they divide) or a comma list, e.g. "1,4,4,3"
  c.pipeline.blocks_per_stage = "auto"
  c.pipeline.data_method = "ddp"  # ddp | zero1 | acco over the data lanes of each stage

  # Health of multi-process runs (acco_jax.run.monitor).
  c.health = ml_collections.ConfigDict()
  c.health.hang_timeout_s = 600.0  # no progress this long: end the run, name the peer (0 = off)
  c.health.probe_every = 0  # stages between speed probes that name slow workers (0 = off)
  c.health.slow_factor = 2.0  # warn about processes this many times slower than the others
  # A process slow in slow_patience probes in a row: keep it (ACCO's adaptive budgets absorb it) or
  # exclude it (checkpoint, health.json names it, exit 75); auto = keep for acco with
  # hetero.adaptive, exclude otherwise (docs/reliability.md, "Restarting without a faulty process")
  c.health.on_slow = "auto"  # auto | keep | exclude
  c.health.slow_patience = 3
  # auto: on start, leave out the processes <workdir>/health.json names (explicit launches with
  # dist.coordinator_address; under SLURM, scripts/slurm_requeue.sbatch excludes the hosts)
  c.health.exclude = "off"  # off | auto

  c.opt = ml_collections.ConfigDict()
  c.opt.name = "adamw"  # adamw | sgd | lion | muon
  c.opt.lr = 2e-3  # peak learning rate
  c.opt.b1 = 0.9
  c.opt.b2 = 0.95
  c.opt.eps = 1e-8
  c.opt.weight_decay = 0.1
  c.opt.decay = "matrices"  # matrices (2-D weights) | all (the paper's reference code)
  c.opt.clip_norm = 1.0  # global-norm clipping; 0 = off
  c.opt.schedule = "cosine"  # cosine | linear | constant, after the warm-up
  c.opt.warmup_updates = 20  # linear LR warm-up, in optimizer updates
  c.opt.min_lr_ratio = 0.1  # final LR / peak LR
  # opt.name=muon: Muon (optax.contrib.muon) on the blocks' weight matrices, AdamW (lr, b1, b2, eps,
  # weight_decay, decay) on embeddings, the tied head, biases and LayerNorms (modded-nanogpt).
  # Needs the owner layout under acco and zero1, and in LoCo workers (loco.inner=zero1: MuLoCo);
  # comm.layout=auto picks it. One schedule: Muon's LR is muon_lr / lr times AdamW's at every update.
  c.opt.muon_lr = 0.02  # Muon's peak LR (orthogonalised updates take ~10-30x AdamW's)
  c.opt.momentum = 0.95  # Muon's (Nesterov) momentum
  c.opt.ns_steps = 5  # Newton–Schulz iterations per matrix and update

  c.train = ml_collections.ConfigDict()
  c.train.num_updates = 100  # optimizer updates (ACCO: commits; each spans two stages)
  c.train.seed = 0  # parameter init and data order
  c.train.log_every = 10  # stages between metric lines
  c.train.eval_every = 25  # updates between evaluations (0 = only at the end)
  c.train.eval_batches = 8  # held-out batches per evaluation
  c.train.sample_tokens = 64  # tokens generated at the end (0 = none)
  c.train.sample_prompt = "And God said"  # prompt of the final sample
  # instruction data: exact match of greedy replies to held-out prompts, at the end | every
  # evaluation | off; written to <workdir>/samples.jsonl
  c.train.exact_match = "end"
  c.train.answer_prompts = 32  # held-out prompts answered
  c.train.answer_tokens = 32  # the longest reply
  c.train.on_nonfinite = (
    "stop"  # stop: a non-finite loss ends the run; the last good checkpoint stays
  )
  # 'a:b': a jax.profiler trace of stages a to b into <workdir>/profile (Perfetto JSON; read it with
  # ui.perfetto.dev or `python -m bench.gpu.profile_table TRACE`); '' = none
  c.train.profile_stages = ""
  # before any work: the predicted peak memory per device and on the host (acco_jax/run/memory.py),
  # one line; a run predicted not to fit the machine is refused (False: printed, not refused)
  c.train.memory_check = True

  c.ckpt = ml_collections.ConfigDict()
  c.ckpt.every = 50  # updates between checkpoints (0 = only at the end)
  c.ckpt.keep = 3  # newest checkpoints kept
  c.ckpt.async_save = True  # write checkpoints in the background
  # Start from the newest checkpoint of another run's workdir (read only), when this workdir has
  # none: ddp, zero1, acco, dpu, wp onto any of them, any device count; parameters and optimizer
  # state exactly, update count and data position kept (acco_jax/run/init_from.py). '' = off
  c.ckpt.init_from = ""

  c.mesh = ml_collections.ConfigDict()
  c.mesh.num_devices = 0  # devices on the data axis (0 = all)
  c.mesh.cpu_devices = 8  # simulated host devices (CPU only; ignored where GPUs are the devices)
  # CPU: use the most of those devices (halving) whose predicted host peak fits in 80% of the
  # machine's memory (acco_jax/run/memory.py); sets mesh.num_devices
  c.mesh.fit_memory = False

  c.dist = ml_collections.ConfigDict()
  c.dist.initialize = "auto"  # auto (SLURM / JAX_COORDINATOR_ADDRESS) | on | off
  c.dist.coordinator_address = ""  # host:port of process 0 (explicit launch)
  c.dist.num_processes = 0
  c.dist.process_id = -1
  c.dist.timeout_s = 300  # how long processes wait for each other at start-up

  # Persistent XLA compilation cache (acco_jax.run.compile_cache): a restarted or resumed run loads
  # the programs compiled before instead of compiling them again. auto = $JAX_COMPILATION_CACHE_DIR
  # or ~/.cache/acco_jax/xla ($XDG_CACHE_HOME); a path; '' = off. Shared by the processes of a host.
  c.compile = ml_collections.ConfigDict()
  c.compile.cache_dir = "auto"

  if preset == "cpu":
    c.model.size, c.model.D, c.model.N, c.model.H = "tiny", 256, 4, 4
  elif preset == "tiny":
    c.model.size = "tiny"
    c.data.tokenizer, c.data.seq_len = "byte", 32
    c.batch.microbatch_size, c.batch.microbatches = 1, 2
    c.train.num_updates, c.train.log_every, c.train.eval_every = 6, 2, 3
    c.train.eval_batches, c.train.sample_tokens = 2, 8
    c.opt.warmup_updates = 1
    c.ckpt.every = 3
  elif preset == "pretrained":
    c.model.size = "init"  # the architecture and every size from model.init's source
    c.data.tokenizer = "init"  # and its tokenizer
    c.model.vocab_multiple = 128  # aligned GEMMs on GPUs (the padded rows are not exported)
    c.opt.lr, c.opt.warmup_updates, c.opt.weight_decay = 2e-5, 20, 0.0  # fine-tuning
  elif preset in GPU_PRESETS:
    other = preset.startswith(("gpt_neo-", "llama-"))
    c.model.arch, c.model.size = preset.split("-", 1) if other else ("gpt2", preset)
    c.model.remat = preset in ("gpt_neo-2.7b", "llama-1b")
    c.model.attention = "auto"
    c.model.vocab_multiple = 128  # aligned GEMMs on GPUs
    c.data.tokenizer, c.data.seq_len = "gpt2", 1024
    c.batch.microbatch_size, c.batch.microbatches = 8, 6
    c.opt.lr, c.opt.warmup_updates = 6e-4, 200
    c.train.num_updates, c.train.log_every, c.train.eval_every = 5000, 10, 250
    c.train.eval_batches, c.train.sample_tokens = 20, 64
    c.ckpt.every = 500
    c.mesh.cpu_devices = 0
  return c
