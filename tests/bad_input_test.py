"""Bad input: each mistake a user can make is a one-line error that names the problem and the fix,
raised before anything is written, and a workdir's checkpoints are never overwritten by it.

Configs and data are checked in-process through ``build.build`` / ``train_and_evaluate``; command
line flags and the environment through ``train.py`` in a subprocess (they fail before JAX starts, or
in XLA). ``docs/reliability.md`` lists every case with its message.
"""

from __future__ import annotations

import json
import pathlib
import socket
import time

import pytest

from acco_jax import parallel
from acco_jax.run import build, trainer
from configs import gpt2_acco, gpt2_skippipe, gpt2_zero1

REPO = pathlib.Path(__file__).resolve().parent.parent
CACHE = REPO / ".pytest_cache" / "acco_data"  # shared with train_test (tokenized corpus)


def tiny(module=gpt2_acco, **overrides):
  config = module.get_config("tiny")
  config.data.cache_dir = str(CACHE)
  config.ckpt.async_save = False
  config.train.sample_tokens = 0
  config.train.num_updates = 2  # 4 ACCO stages
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    (config[group] if group else config)[field] = value
  return config


def one_line(error: BaseException) -> str:
  message = str(error)
  assert message and "\n" not in message, f"not a one-line message: {message!r}"
  print(f"MESSAGE {type(error).__name__}: {message}")  # collected for docs/reliability.md
  return message


# -- configs: build.build refuses them before it touches the workdir -----------------------------

CONFIGS = [
  (
    "unknown-method",
    {"method": "adam"},
    ValueError,
    r"method='adam' is unknown: choose one of acco",
  ),
  (
    "acco-odd-microbatches",
    {"batch.microbatches": 3},
    ValueError,
    r"batch.microbatches=3: ACCO .* must be an even number >= 2",
  ),
  ("acco-zero-microbatches", {"batch.microbatches": 0}, ValueError, r"batch.microbatches=0"),
  (
    "unknown-optimizer",
    {"opt.name": "adamx"},
    ValueError,
    r"opt.name='adamx' is unknown: choose adamw, sgd, lion or muon",
  ),
  (
    "unknown-schedule",
    {"opt.schedule": "cosin"},
    ValueError,
    r"opt.schedule='cosin' is unknown: choose one of cosine",
  ),
  (
    "unknown-decay",
    {"opt.decay": "none"},
    ValueError,
    r"opt.decay='none': choose 'matrices' or 'all'",
  ),
  (
    "unknown-on-nonfinite",
    {"train.on_nonfinite": "ignore"},
    ValueError,
    r"train.on_nonfinite='ignore': choose 'stop' or 'skip'",
  ),
  ("zero-lr", {"opt.lr": 0.0}, ValueError, r"opt.lr must be > 0, got 0.0"),
  (
    "warmup-past-the-end",
    {"opt.warmup_updates": 2},
    ValueError,
    r"opt.warmup_updates=2 must be in \[0, train.num_updates=2\); lower it",
  ),
  (
    "unknown-model-size",
    {"model.size": "huge"},
    ValueError,
    r"unknown model size 'huge' for model.arch=gpt2; known",
  ),
  (
    "heads-not-dividing-width",
    {"model.H": 3},
    ValueError,
    r"D=64 is not divisible by H=3: choose heads .*model.H",
  ),
  ("negative-width", {"model.D": -64}, ValueError, r"model sizes must be >= 1, got D=-64"),
  ("zero-seq-len", {"data.seq_len": 0}, ValueError, r"got L=0 .*L is data.seq_len"),
  ("negative-seq-len", {"data.seq_len": -5}, ValueError, r"got L=-5 .*L is data.seq_len"),
  (
    "unknown-model-dtype",
    {"model.dtype": "float33"},
    ValueError,
    r"^model.dtype='float33' is not a dtype this field takes: choose one of bfloat16, float32, ",
  ),
  (  # a dtype name, but not one the model computes in (was: a traceback from Flax's init)
    "integer-model-dtype",
    {"model.dtype": "int8"},
    ValueError,
    r"^model.dtype='int8' is not a dtype this field takes: choose one of bfloat16, float32, ",
  ),
  (
    "unknown-attention",
    {"model.attention": "flash"},
    ValueError,
    r"attention must be 'auto', 'xla' or 'cudnn', got 'flash'",
  ),
  (
    "zero-vocab-multiple",
    {"model.vocab_multiple": 0},
    ValueError,
    r"vocab_multiple=0 must be an integer >= 1 .*model.vocab_multiple",
  ),
  (
    "more-devices-than-visible",
    {"mesh.num_devices": 16},
    ValueError,
    r"mesh.num_devices=16 but only 8 devices are visible; on CPU set mesh.cpu_devices",
  ),
  ("negative-devices", {"mesh.num_devices": -1}, ValueError, r"mesh.num_devices=-1 must be >= 0"),
  (
    "eval-fraction-out-of-range",
    {"data.eval_fraction": 1.5},
    ValueError,
    r"eval_fraction=1.5 must be in \[0, 1\)",
  ),
]
CONFIGS += [  # sizes and counts (trainer._check_config); the last field: what happened before it
  (
    "zero1-zero-microbatches",
    {"method": "zero1", "batch.microbatches": 0},
    ValueError,
    r"batch.microbatches=0 must be >= 1",
    "step.py says num_microbatches, not the config key",
  ),
  (
    "zero-microbatch-size",
    {"batch.microbatch_size": 0},
    ValueError,
    r"batch.microbatch_size=0 must be >= 1",
    "fails later, as global_batch_rows=0",
  ),
  (
    "zero-updates",
    {"train.num_updates": 0},
    ValueError,
    r"train.num_updates=0 must be >= 1",
    "blames opt.warmup_updates; negative values train 0 stages silently",
  ),
  (
    "unknown-comm-dtype",
    {"comm_dtype": "int7"},
    ValueError,
    r"^comm_dtype='int7' is not a dtype this field takes: choose one of bfloat16, float32, float16",
    "a bare TypeError: data type 'int7' not understood",
  ),
  (
    "zero-log-every",
    {"train.log_every": 0},
    ValueError,
    r"train.log_every=0 must be >= 1",
    "ZeroDivisionError after compiling and running the first stage",
  ),
  (
    "zero-eval-batches",
    {"train.eval_batches": 0},
    ValueError,
    r"train.eval_batches=0 must be >= 1",
    "silently reports eval_loss=0.0",
  ),
  (
    "zero-ckpt-keep",
    {"ckpt.keep": 0},
    ValueError,
    r"ckpt.keep=0 must be >= 1",
    "'keep must be >= 1 or None, got 0' after the workdir is created",
  ),
  (
    "profile-stages-backwards",
    {"train.profile_stages": "5:3"},
    ValueError,
    r"train.profile_stages='5:3' must be 'a:b', the first and last stage to trace",
    "new key",
  ),
]
CONFIGS += [  # quantized communication (the comm group)
  (
    "unknown-comm-quantize",
    {"comm.quantize": "int2"},
    ValueError,
    r"comm.quantize='int2' is unknown: choose one of none, int8, int4",
  ),
  (
    "comm-block-zero",
    {"comm.quantize": "int8", "comm.block": 0},
    ValueError,
    r"comm.block=0 must be a positive integer \(values per scale\)",
  ),
  (
    "comm-int4-odd-block",
    {"comm.quantize": "int4", "comm.block": 255},
    ValueError,
    r"comm.block=255 is odd: int4 packs two values per byte, use an even block",
  ),
  (
    "comm-block-larger-than-shard",
    {"comm.quantize": "int8", "comm.block": 1 << 20},
    ValueError,
    r"comm.block=1048576 is larger than a device's shard of [\d,]+ values: use a block of at most",
  ),
  (
    "comm-node-size-not-dividing",
    {"comm.quantize": "int8", "comm.node_size": 3},
    ValueError,
    r"comm.node_size=3 does not divide the 8 devices of the 'data' axis",
  ),
  (
    "comm-quantize-with-dpu",
    {"method": "dpu", "comm.quantize": "int8"},
    ValueError,
    r"comm.quantize='int8' applies to method acco or zero1, not dpu; set comm.quantize=none",
  ),
  (
    "unknown-comm-layout",
    {"comm.layout": "rows"},
    ValueError,
    r"comm.layout='rows' is unknown: choose one of auto, elementwise, owner",
  ),
  (
    "muon-elementwise-layout",
    {"opt.name": "muon", "comm.layout": "elementwise"},
    ValueError,
    r"opt.name=muon updates whole matrices: set comm.layout=owner \(or auto\)",
  ),
]
CONFIGS += [  # health (acco_jax.run.health.check_config)
  (
    "unknown-on-slow",
    {"health.on_slow": "drop"},
    ValueError,
    r"health.on_slow='drop': choose 'keep', 'exclude' or 'auto'",
  ),
  (
    "unknown-exclude",
    {"health.exclude": "yes"},
    ValueError,
    r"health.exclude='yes': choose 'off' or 'auto'",
  ),
  (
    "zero-slow-patience",
    {"health.slow_patience": 0},
    ValueError,
    r"health.slow_patience=0 must be >= 1 \(probes\)",
  ),
]

CONFIGS += [  # SkipPipe paths (the pipeline group; the tiny model has 2 blocks)
  (
    "pipeline-more-stages-than-blocks",
    {"pipeline.stages": 4},
    ValueError,
    r"pipeline.stages=4 does not split the model's 2 blocks into equal stages",
  ),
  (
    "pipeline-skip-leaves-no-stage",
    {"pipeline.stages": 2, "pipeline.skip": 0.9},
    ValueError,
    r"pipeline.skip=0.9 leaves no stage to run with pipeline.stages=2",
  ),
  (
    "pipeline-negative-memory",
    {"pipeline.stages": 2, "pipeline.memory": -1},
    ValueError,
    r"pipeline.memory=-1 and pipeline.balance=0 must be >= 1 microbatch",
  ),
  (
    "pipeline-memory-too-small",
    {"pipeline.stages": 2, "pipeline.memory": 1},
    ValueError,
    r"pipeline.memory=1 microbatches per node cannot hold 8 microbatches",
  ),
  (
    "pipeline-unknown-paths",
    {"pipeline.stages": 2, "pipeline.paths": "astar"},
    ValueError,
    r"pipeline.paths='astar' is unknown: choose one of scheduled, random",
  ),
  (
    "pipeline-unknown-topology",
    {"pipeline.stages": 2, "pipeline.topology": "moon"},
    ValueError,
    r"pipeline.topology='moon' is neither a preset nor a .json file",
  ),
  (
    "pipeline-missing-topology-file",
    {"pipeline.stages": 2, "pipeline.topology": "/no/such.json"},
    FileNotFoundError,
    r"topology file /no/such.json does not exist",
  ),
  (
    "pipeline-with-loco",
    {"method": "diloco", "pipeline.stages": 2},
    ValueError,
    r"pipeline.stages=2: SkipPipe paths run with the data-parallel methods",
  ),
  (
    "pipeline-split-not-summing",
    {"method": "pipeline", "pipeline.stages": 2, "pipeline.blocks_per_stage": "2,1"},
    ValueError,
    r"pipeline.blocks_per_stage='2,1' must list 2 block counts .* sum to the model's 2 blocks",
  ),
  (
    "pipeline-unknown-data-method",
    {"method": "pipeline", "pipeline.stages": 2, "pipeline.data_method": "fsdp"},
    ValueError,
    r"pipeline.data_method='fsdp' is unknown: choose one of ddp, zero1, acco",
  ),
  (
    "pipeline-acco-odd-microbatches",
    {
      "method": "pipeline",
      "pipeline.stages": 2,
      "pipeline.data_method": "acco",
      "batch.microbatches": 3,
    },
    ValueError,
    r"batch.microbatches=3: pipeline.data_method=acco splits an update into two flushes",
  ),
]


@pytest.mark.parametrize(
  "overrides,error,match",
  [pytest.param(*c[1:4], id=c[0]) for c in CONFIGS],
)
def test_bad_config_is_refused_before_anything_runs(overrides, error, match, tmp_path):
  """Refused before any data is prepared: an empty data cache stays empty."""
  config = tiny(gpt2_zero1 if overrides.get("method") == "zero1" else gpt2_acco, **overrides)
  config.data.cache_dir = str(tmp_path / "cache")
  with pytest.raises(error, match=match) as info:
    build.build(config)
  one_line(info.value)
  assert not list((tmp_path / "cache").rglob("*")), "data was prepared before the refusal"


def test_topology_file_that_does_not_parse(tmp_path):
  path = tmp_path / "cluster.json"
  path.write_text('{"speed": [1, 1], "region": ["a", "b"], "latency_ms": [[0, 1], [1, 0]')
  config = tiny(gpt2_zero1, **{"pipeline.stages": 2, "pipeline.topology": str(path)})
  with pytest.raises(
    ValueError, match=r"topology file .*cluster.json does not parse as JSON"
  ) as info:
    build.build(config)
  one_line(info.value)


def test_pipeline_topology_file_of_another_size(tmp_path):
  """On the pipeline mesh every device is a node: a 6-node file for 8 devices names the size."""
  path = tmp_path / "six.json"
  m = 6
  path.write_text(
    json.dumps(
      {
        "speed": [1] * m,
        "region": ["a"] * m,
        "latency_ms": [[1] * m] * m,
        "bandwidth_gbps": [[10] * m] * m,
      }
    )
  )
  config = tiny(gpt2_skippipe, **{"method": "pipeline", "pipeline.topology": str(path)})
  with pytest.raises(
    ValueError,
    match=r"six.json has 6 nodes, this pipeline has 8 devices \(one "
    r"node each\): write a topology of 8 nodes or run on 6 devices",
  ) as info:
    build.build(config)
  one_line(info.value)


# -- data ------------------------------------------------------------------------------------------


def data_cases(tmp: pathlib.Path):
  (tmp / "empty.txt").write_text("")
  (tmp / "one.txt").write_text("a single paragraph\nof two lines\n")
  (tmp / "texts").mkdir()
  return {
    "missing-text-file": (f"text:{tmp}/missing.txt", FileNotFoundError, r"no file matches .*ing"),
    "empty-glob": (f"text:{tmp}/nothing/*.txt", FileNotFoundError, r"no file matches .*nothing"),
    "text-directory": (f"text:{tmp}/texts", IsADirectoryError, r"is a directory: use 'text:.*/\*"),
    "empty-text-file": (f"text:{tmp}/empty.txt", ValueError, r"hold no text \(empty or blank"),
    "one-paragraph": (f"text:{tmp}/one.txt", ValueError, r"cannot hold out 1 of 1 document"),
    "unknown-source-prefix": ("hf:wikitext", ValueError, r"unknown source 'hf:wikitext': use"),
    "unknown-tfds-dataset": ("tfds:no_such_dataset_xyz", ValueError, r"unknown TFDS dataset"),
  }


@pytest.mark.parametrize(
  "case",
  [
    "missing-text-file",
    "empty-glob",
    "text-directory",
    "empty-text-file",
    "one-paragraph",
    "unknown-source-prefix",
    "unknown-tfds-dataset",
  ],
)
def test_bad_data_source(tmp_path, case, no_network):
  source, error, match = data_cases(tmp_path)[case]
  config = tiny(**{"data.source": source, "data.data_dir": str(tmp_path / "prepared")})
  config.data.cache_dir = str(tmp_path / "cache")
  with pytest.raises(error, match=match) as info:
    build.build(config)
  one_line(info.value)


def test_tfds_dataset_without_network_fails_fast(tmp_path, no_network):
  """A registered dataset that is not prepared: TFDS itself would retry for 3.5 minutes."""
  config = tiny(**{"data.source": "tfds:tiny_shakespeare", "data.data_dir": str(tmp_path)})
  config.data.cache_dir = str(tmp_path / "cache")
  start = time.monotonic()
  with pytest.raises(
    RuntimeError, match=r"'tiny_shakespeare' is not prepared .* cannot download"
  ) as info:
    build.build(config)
  assert time.monotonic() - start < 30
  assert "data.data_dir" in one_line(info.value)


TOKENIZERS = {
  "unknown-tokenizer": (
    "sentencepiece",
    ValueError,
    r"unknown tokenizer 'sentencepiece': use 'byte', 'gpt2'",
  ),
  "tiny-bpe-vocab": ("bpe:10", ValueError, r"tokenizer 'bpe:10': vocab size must be >= 258"),
  "missing-bpe-file": (
    "bpe:/nonexistent/tok.json",
    FileNotFoundError,
    r"no such tokenizer JSON file",
  ),
}


@pytest.mark.parametrize("tokenizer,error,match", list(TOKENIZERS.values()), ids=list(TOKENIZERS))
def test_bad_tokenizer(tmp_path, tokenizer, error, match):
  config = tiny(**{"data.tokenizer": tokenizer, "data.cache_dir": str(tmp_path)})
  with pytest.raises(error, match=match) as info:
    build.build(config)
  one_line(info.value)


def test_seq_len_longer_than_the_corpus_allows(tmp_path):
  """The model's position table follows data.seq_len, so the limit is the data: no full row."""
  config = tiny(**{"data.seq_len": 10_000_000})
  with pytest.raises(ValueError, match=r"packs into 0 rows of seq_len\+1=10000001.*lower") as info:
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  one_line(info.value)
  assert not (tmp_path / "run").exists()


# -- distributed start-up (in-process: these fail before jax.distributed starts) -------------------


def test_unknown_dist_mode():
  with pytest.raises(
    ValueError, match=r"dist.initialize must be 'auto', 'on' or 'off', got 'yes'"
  ) as info:
    parallel.initialize_distributed("yes")
  one_line(info.value)


def test_coordinator_without_process_count():
  with pytest.raises(
    ValueError, match=r"needs dist.num_processes >= 1 and dist.process_id >= 0"
  ) as info:
    parallel.initialize_distributed("on", coordinator_address="localhost:1234")
  one_line(info.value)


def test_unreachable_coordinator_is_an_error_not_an_abort():
  with socket.socket() as s:  # a port with nothing listening
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  start = time.monotonic()
  with pytest.raises(
    TimeoutError, match=rf"127.0.0.1:{port}: no coordinator answered in 1 s"
  ) as info:
    parallel.initialize_distributed(
      "on", coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=1, timeout_s=1
    )
  assert time.monotonic() - start < 10
  one_line(info.value)


# -- pipeline configs (method=pipeline, configs/gpt2_pipeline.py) ----------------------------------

PIPELINE_CONFIGS = [
  (
    "pipeline-stages-not-dividing-devices",
    {"pipeline.stages": 3},
    r"pipeline.stages=3 must be >= 2 and divide the 8 devices",
  ),
  (
    "pipeline-more-stages-than-blocks",
    {"pipeline.stages": 8},
    r"pipeline.stages=8 must be between 1 and the model's 4 blocks \(each stage holds one or more\)",
  ),
  (
    "pipeline-unknown-schedule",
    {"pipeline.schedule": "zb"},
    r"pipeline.schedule='zb' is unknown: choose one of gpipe, 1f1b, skippipe",
  ),
  (
    "pipeline-skip-leaves-no-stage",
    {"pipeline.schedule": "skippipe", "pipeline.skip": 1.0},
    r"pipeline.skip=1.0 leaves no stage to run",
  ),
  (
    "pipeline-quantized-comm",
    {"comm.quantize": "int8"},
    r"comm.quantize is not supported with method=pipeline",
  ),
]


@pytest.mark.parametrize(
  "overrides,match", [pytest.param(*c[1:], id=c[0]) for c in PIPELINE_CONFIGS]
)
def test_bad_pipeline_config_is_refused(overrides, match, tmp_path):
  from configs import gpt2_pipeline

  config = tiny(gpt2_pipeline, **overrides)
  config.data.cache_dir = str(tmp_path / "cache")  # stays empty: refused before any data
  with pytest.raises(ValueError, match=match) as info:
    build.build(config)
  one_line(info.value)
  assert not list((tmp_path / "cache").rglob("*")), "data was prepared before the refusal"
