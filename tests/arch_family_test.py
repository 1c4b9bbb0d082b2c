"""Every family trains every architecture: GPT-Neo, Llama and its variants Qwen2, Qwen3, Mistral
and Llama 3's scaled RoPE (GPT-2 is every other test's model)
through the data-parallel methods, the LoCo methods, the pipeline's schedules and data methods,
SkipPipe's paths, Muon and HDEE's experts.

Each case builds the ``tiny`` config of the family's config file with ``model.arch`` set, as
``train.py`` does (:func:`acco_jax.run.build.build`), on a narrow model (two blocks of width 32, the
architecture's own features kept: GPT-Neo's local window of 8 shorter than the 16-token rows,
Llama's grouped-query attention and untied head), and runs its step on one fixed batch until the
loss falls: the family's programs compute the architecture's loss and move its parameters the
right way. The default run trains the two new architectures under one method of each family; the
other methods are marked slow (.ci/run runs them): Llama under each, GPT-Neo too where its
features meet the family's (see ``BOTH``).
"""

import pathlib

import jax
import numpy as np
import pytest

from acco_jax import parallel, step_api
from acco_jax.run import build, streams
from configs import gpt2_acco, gpt2_diloco, gpt2_pipeline, gpt2_skippipe

ARCHS = ("gpt_neo", "llama")
NARROW = {"model.D": 32, "model.H": 4, "model.N": 2, "data.seq_len": 16}


def _config(module, arch: str, **overrides):
  config = module.get_config("tiny")
  config.data.cache_dir = str(pathlib.Path(__file__).parent / ".." / ".pytest_cache" / "acco_data")
  config.model.arch = arch
  config.model.dtype = "float32"
  config.opt.lr, config.opt.warmup_updates, config.opt.clip_norm = 3e-3, 0, 0.0
  for key, value in {**NARROW, **overrides}.items():
    group, _, field = key.rpartition(".")
    (config[group] if group else config)[field] = value
  return config


def _losses(config, stages: int) -> list[float]:
  """The loss of each of ``stages`` stages of the config's step on one fixed batch."""
  run = build.build(config)
  train = run.step
  rows = train.microbatches_per_stage * config.batch.microbatch_size
  stream = streams.batch_stream(run, config, run.tokens.train, rows, seed=0)
  stream = train.feed(stream)  # SkipPipe: each microbatch's layer order rides in the batch
  batch = next(stream)
  placed = parallel.global_batch(batch, run.mesh, run.batch_axis, run.batch_whole)
  state = train.init(jax.tree.map(np.asarray, _init(run, config)), streams.prime_batch(run, config))
  out = []
  for stage in range(stages):  # one stage a call (a LoCo schedule with no window of H stages)
    state, m = train.call(state, [placed], stage, stages)
    assert set(step_api.METRICS) <= set(m), sorted(m)  # the declared contract of Step.run
    out.append(float(np.mean(jax.device_get(m["loss"]))))
  return out


def _init(run, config):
  from acco_jax import model

  return jax.jit(model.init_params, static_argnums=0)(run.model_cfg, config.train.seed)


def _trains(config, stages=6):
  losses = _losses(config, stages)
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < losses[0] - 0.05, losses


DEFAULT = {  # one method of each family
  "acco": (gpt2_acco, {}),
  "diloco-acco": (gpt2_diloco, {"loco.workers": 4, "loco.inner": "acco", "loco.sync_every": 2}),
  "pipeline-1f1b-acco": (gpt2_pipeline, {"pipeline.data_method": "acco", "model.N": 4}),
  "skippipe-paths-zero1": (gpt2_skippipe, {"model.N": 4}),
  "zero1-muon": (gpt2_acco, {"method": "zero1", "opt.name": "muon", "opt.muon_lr": 0.02}),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", DEFAULT)
def test_each_family_trains_the_architecture(case, arch):
  module, overrides = DEFAULT[case]
  _trains(_config(module, arch, **overrides))


SLOW = {  # the rest of each family
  "ddp": (gpt2_acco, {"method": "ddp"}),
  "zero1": (gpt2_acco, {"method": "zero1"}),
  "dpu": (gpt2_acco, {"method": "dpu"}),
  "wp": (gpt2_acco, {"method": "wp"}),
  "diloco": (gpt2_diloco, {"loco.workers": 4, "loco.sync_every": 2}),
  "streaming_diloco": (
    gpt2_diloco,
    {"method": "streaming_diloco", "loco.workers": 4, "loco.sync_every": 2, "loco.fragments": 2},
  ),
  "noloco": (gpt2_diloco, {"method": "noloco", "loco.workers": 4, "loco.sync_every": 2}),
  "sparseloco": (
    gpt2_diloco,
    {
      "method": "sparseloco",
      "loco.workers": 4,
      "loco.sync_every": 2,
      "loco.outer_lr": 1.0,
      "loco.outer_momentum": 0.0,
      "loco.chunk": 16,
      "loco.topk": 64,
    },
  ),
  "demo": (
    gpt2_diloco,
    {"method": "demo", "loco.workers": 4, "loco.sync_every": 1, "loco.chunk": 16, "opt.lr": 1e-3},
  ),
  "pipeline-gpipe-ddp": (gpt2_pipeline, {"pipeline.schedule": "gpipe", "model.N": 4}),
  "pipeline-1f1b-zero1": (gpt2_pipeline, {"pipeline.data_method": "zero1", "model.N": 4}),
  "pipeline-skippipe-acco": (
    gpt2_pipeline,
    {"pipeline.schedule": "skippipe", "pipeline.data_method": "acco", "model.N": 4},
  ),
  "skippipe-paths-acco": (gpt2_skippipe, {"method": "acco", "model.N": 4}),
  "acco-muon": (gpt2_acco, {"opt.name": "muon"}),
  "muloco": (gpt2_diloco, {"loco.workers": 4, "loco.sync_every": 2, "opt.name": "muon"}),
  "pipeline-muon": (gpt2_pipeline, {"opt.name": "muon", "model.N": 4}),
}


# Where an architecture's own features meet a family's: blocks run apart in a traced order
# (GPT-Neo's local blocks by their model index), whole matrices (Muon), the pipeline's shared
# leaves (Llama's untied head). The other methods see the model only as a loss and a tree of
# leaves, which the default run's method of each family exercises with both: they run with
# Llama (grouped-query projections of another shape, an untied head, a three-matrix MLP).
BOTH = (
  "pipeline-gpipe-ddp",
  "pipeline-1f1b-zero1",
  "pipeline-skippipe-acco",
  "skippipe-paths-acco",
  "pipeline-muon",
)
CASES = [(case, arch) for case in SLOW for arch in (ARCHS if case in BOTH else ("llama",))]


@pytest.mark.slow
@pytest.mark.parametrize("case,arch", CASES)
def test_every_method_trains_the_architecture(case, arch):
  module, overrides = SLOW[case]
  _trains(_config(module, arch, **overrides))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_hdee_experts_of_the_architecture(tmp_path, arch):
  """HDEE's recipe (seed model, two experts continued from it, their mixture evaluated) with
  experts of ``arch``: every job's parameters are the architecture's, and the trained experts
  beat the vocabulary's uniform guess on their domains."""
  from acco_jax.ensemble import jobs, recipe
  from configs import hdee

  c = hdee.get_config("tiny")
  c.data.cache_dir = _config(gpt2_acco, arch).data.cache_dir
  c.ckpt.async_save, c.train.sample_tokens = False, 0
  c.model.arch, c.model.D, c.model.H, c.model.N = arch, 32, 4, 2
  c.hdee.modes, c.hdee.budget_flops = "steps", 1.5e9
  c.hdee.domains = "hard:1:code_asyncio,hard:0:code_unittest,easy:1:kjv_law,easy:0:kjv_gospels"
  results = recipe.train_and_evaluate(c, str(tmp_path))
  plan = recipe.make_plan(c)
  for job in results["plan"]:
    cfg = plan.model_cfgs[job["size"]]
    assert cfg.arch == arch
    jobs.load_params(str(tmp_path / job["name"] / "params.npz"), cfg)  # the architecture's tree
  ppl = results["experts"]["M_Ho-I_He"]
  assert all(np.isfinite(v) for by in ppl.values() for v in by.values()), ppl


# The Llama family's variants, each with what it adds: Qwen2's q/k/v biases, Qwen3's q/k norms and
# head width of its own (32, with D 32 and 4 heads), Mistral's sliding window (8 of 16 tokens), and
# Llama with RoPE scaled as Llama 3.1 scales it. The default run trains each new architecture under
# ACCO (about 3.5 s each on 2 idle cores, mostly compiling); the scaled RoPE (constants of Llama's own
# program) and the other families (VARIANT_CASES) are slow.
VARIANTS = {
  "qwen2": ("qwen2", {}),
  "qwen3": ("qwen3", {}),
  "mistral": ("mistral", {}),
  "llama-rope-llama3": (
    "llama",
    {"model.size": "3.2-1b", "model.F": 64, "model.kv_heads": 2, "model.N": 2},
  ),
}
# Each variant under one method of every other family (a family sees the model as a loss and a tree
# of leaves: the variants differ from Llama inside attention); Mistral's window also where blocks run
# in a traced order. Every method with every variant measured 10.5 min of CI: this keeps 2.
VARIANT_CASES = [
  (case, variant)
  for variant in VARIANTS
  for case in ("diloco-acco", "pipeline-1f1b-acco", "skippipe-paths-zero1")
] + [("pipeline-skippipe-acco", "mistral")]


def _variant(case: str, variant: str):
  arch, sizes = VARIANTS[variant]
  module, overrides = DEFAULT.get(case) or SLOW[case]
  return _config(module, arch, **{**sizes, **overrides})


@pytest.mark.parametrize(
  "variant",
  [v if VARIANTS[v][0] != "llama" else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS],
)
def test_each_llama_variant_trains_under_acco(variant):
  _trains(_variant("acco", variant))


@pytest.mark.slow
@pytest.mark.parametrize("case,variant", VARIANT_CASES)
def test_each_family_trains_the_llama_variant(case, variant):
  _trains(_variant(case, variant))
