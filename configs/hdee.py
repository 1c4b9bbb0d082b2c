"""HDEE: an ensemble of independent domain experts of different sizes and training lengths.

  python train.py --config configs/hdee.py:cpu --workdir runs/hdee

runs the whole recipe (acco_jax.ensemble.recipe): seed models on the mixture of the trained
domains, then each expert continues on one domain of its difficulty group per iteration, for each
ensemble of ``hdee.modes`` at the same FLOP budget, then per-domain perplexities of every ensemble
under every mixing rule (``<workdir>/results.md``). Rerunning the command resumes.

Presets: ``tiny`` (tests: 2 experts, 2 iterations, ~1 min on 2 cores), ``cpu`` (the benchmark:
3 experts, 3 iterations, 12 built-in domains), ``gpt2`` (GPUs: GPT-2-width experts of about
96M/115M/129M parameters, the paper's "small, close" ratio; bring larger domains with
``name=tfds:...`` in ``hdee.domains``).
"""

import ml_collections

from configs import common

# group:iteration:name[=source]; iteration 0 = held out (evaluated, never trained)
DOMAINS = (
  "hard:1:code_asyncio,hard:2:code_email,hard:3:code_web,hard:0:code_unittest,"
  "medium:1:py_reference,medium:2:py_docstrings_am,medium:3:idle_docs,medium:0:py_docstrings_nz,"
  "easy:1:kjv_law,easy:2:kjv_history,easy:3:kjv_prophets,easy:0:kjv_gospels"
)


def get_config(preset: str = "cpu") -> ml_collections.ConfigDict:
  base = {"tiny": "tiny", "cpu": "tiny", "gpt2": "gpt2"}.get(preset)
  if base is None:
    raise ValueError(f"unknown preset {preset!r}: choose one of tiny, cpu, gpt2")
  c = common.get_base(base, method="hdee")
  h = c.hdee = ml_collections.ConfigDict()
  h.method = "ddp"  # how each expert trains (any data-parallel method of configs/common.py)
  h.modes = "homogeneous,steps,sizes"  # ensembles: M_Ho-I_Ho, M_Ho-I_He, M_He-I_Ho
  h.experts = "hard:L,medium:M,easy:S"  # one expert per group, hardest first: group:size
  h.sizes = "S:F=336;M:F=512;L:F=640"  # size classes: model overrides D/N/H/F (mode 'sizes')
  h.homogeneous_size = "M"  # every expert's size in modes homogeneous and steps (and dense)
  h.domains = DOMAINS
  h.difficulty = "groups"  # groups (as configured) | measured (ranked by the seed's loss)
  h.step_weights = "hard:1.25,medium:1,easy:0.75"  # relative steps per group (mode 'steps')
  h.budget_flops = 1.5e12  # training FLOPs of each ensemble, summed over its jobs
  h.seed_updates = 100  # steps of each seed model (not counted in the budget)
  h.dense = False  # also train one homogeneous-size model on the mixture at the same budget
  h.mixing = "simple_avg,uniform_prior,cached_prior"  # rules evaluated
  h.prior_sequences = 100  # dev sequences of the cached prior
  h.prior_decay = 0.3  # the cached prior's decay
  h.eval_sequences = 64  # evaluation rows per domain
  h.max_domain_chars = 300_000  # cap of each built-in domain's text
  # this run's share of the jobs, comma-separated globs over job names ('' = all): runs on other
  # processes or hosts share the workdir, e.g. 'seed-*', then 'steps/hard-*' on one host and
  # 'steps/easy-*' on another; a run without it trains what is left and evaluates
  h.jobs = ""

  c.model.dtype = "float32"
  c.mesh.num_devices = 1  # each expert on one device; the jobs are independent runs
  c.ckpt.every, c.ckpt.keep = 0, 1  # a checkpoint at the end of each job (and on preemption)
  if preset == "tiny":
    h.experts, h.sizes = "hard:L,easy:S", "S:F=128;M:F=256;L:F=384"
    h.domains = (
      "hard:1:code_asyncio,hard:2:code_email,hard:0:code_unittest,"
      "easy:1:kjv_law,easy:2:kjv_history,easy:0:kjv_gospels"
    )
    h.step_weights = "hard:1.5,easy:0.5"
    h.budget_flops, h.seed_updates = 2.5e9, 4
    h.prior_sequences, h.eval_sequences, h.max_domain_chars = 8, 8, 30_000
    c.batch.microbatch_size, c.batch.microbatches = 2, 2
    c.train.log_every = 4
  elif preset == "cpu":
    c.model.D, c.model.N, c.model.H = 128, 4, 4
    c.data.tokenizer, c.data.seq_len = "byte", 64
    c.batch.microbatch_size, c.batch.microbatches = 8, 1
    c.opt.warmup_updates = 10
    c.train.log_every, c.train.sample_tokens = 50, 64
  else:  # gpt2: GPT-2 width and depth, MLP widths give 96M / 115M / 129M parameters
    h.sizes = "S:F=1536;M:F=2560;L:F=3328"
    h.budget_flops, h.seed_updates = 6e17, 2000
    h.eval_sequences, h.max_domain_chars = 64, 10_000_000
    c.mesh.num_devices = 0
    c.ckpt.every, c.ckpt.keep = 500, 2
  return c
