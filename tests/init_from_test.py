"""ckpt.init_from: a run starts from another run's checkpoint, across run kinds and device counts.

Three layers. The data-parallel export and import (acco_jax.dp.relayout): ``relayout_test``. Here, the
shell (acco_jax.run.init_from) on tiny trainer runs: what the new run starts with, against the source checkpoint read by the ordinary restore and
cut with the source layout's from_shards; the data position, the update counter, the refusals.
And one train.py launch.
"""

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import errors
from acco_jax.ckpt import meta, portable
from acco_jax.ckpt.checkpoint import Checkpointer
from acco_jax.dp.methods import AccoState
from acco_jax.dp.step import TrainStep
from acco_jax.run import build, streams, trainer
from acco_jax.run import init_from as init_from_lib
from configs import gpt2_acco, gpt2_diloco, gpt2_pipeline, gpt2_zero1, hdee
from tests.elastic_test import bits

REPO = pathlib.Path(__file__).resolve().parents[1]


def same_bits(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(bits(np.asarray(g)), bits(np.asarray(w)), err_msg=what)


# -- the shell: tiny runs, their checkpoints as the trainer writes them -----------------------------


def tiny(module, **overrides):
  """The tiny preset cut further (compile time dominates), no evaluation before the end."""
  config = module.get_config("tiny")
  config.data.cache_dir = str(REPO / ".pytest_cache" / "acco_data")
  config.ckpt.async_save = False
  config.model.D, config.model.N, config.model.H, config.data.seq_len = 16, 1, 1, 8
  config.train.eval_every, config.train.eval_batches, config.train.sample_tokens = 0, 1, 0
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    (config[group] if group else config)[field] = value
  return config


def snapshot(workdir) -> dict:
  """Every file under ``workdir``: bytes and modification time."""
  files = sorted(p for p in pathlib.Path(workdir).rglob("*") if p.is_file())
  return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in files}


def source_run(workdir, config, stages: int, seed: int = 0):
  """A workdir with the checkpoint a run of ``config`` writes after ``stages`` stages, its state
  random (no step is compiled): every float leaf drawn, counters and buffers as such a run has
  them. Returns the state as host numpy arrays."""
  run = build.build(config)
  rng = np.random.default_rng(seed)
  draw = lambda x: (  # small and positive: Adam's second moments, the hyperparameters
    rng.uniform(0, 0.1, x.shape)
    if jnp.issubdtype(x.dtype, jnp.floating)
    else rng.integers(1, 9, x.shape)
  ).astype(x.dtype)
  abstract = run.step.abstract_state(run.params_shapes)
  host = jax.tree.map(draw, abstract)
  host = host._replace(stage=np.int32(stages))
  if isinstance(host.opt_state, AccoState):
    host = host._replace(opt_state=host.opt_state._replace(stage=np.int32(stages)))
  if host.buf_count is not None:
    host = host._replace(buf_count=np.ones_like(host.buf_count))
  rows = run.mesh.size * run.step.num_microbatches * config.batch.microbatch_size
  stream = streams.batch_stream(run, config, run.tokens.train, rows, seed=config.train.seed)
  extra = {
    "stage": stages,
    "data": {**stream.get_state(), "step": stages},
    "tokens_seen": stages * rows * config.data.seq_len,
    "vocab": meta.vocab_meta(run.model_cfg),
    "comm": meta.comm_meta(config, run.step),
    "config": config.to_json_best_effort(),
  }
  with Checkpointer(pathlib.Path(workdir) / "checkpoints", async_save=False) as ckpt:
    ckpt.save(stages, portable.place(host, abstract), extra=extra)
  return host, run.step.layout


def view(host, layout):
  """θ and the inner optimizer state of a data-parallel state, cut to the model's shapes with the
  layout's own from_shards."""
  opt = host.opt_state
  apart = isinstance(opt, AccoState)
  cut = lambda sub: portable.to_host(layout.from_shards(sub))
  inner = opt.inner_state if apart else opt
  return {
    "theta": cut(opt.committed if apart else host.params),
    "opt": portable.map_param_subtrees(cut, inner, host.params),
  }


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """Workdirs of an acco run after 3 stages (after an estimate: 1 update) and a zero1 run after
  2 stages, on 8 devices; their states as host arrays and their layouts."""
  root = tmp_path_factory.mktemp("sources")
  made = {"acco": source_run(root / "acco", tiny(gpt2_acco), 3, seed=1)}
  made["zero1"] = source_run(root / "zero1", tiny(gpt2_zero1), 2, seed=2)
  return root, made


def test_acco_run_starts_a_zero1_run_on_4_devices(sources, tmp_path, capsys, monkeypatch):
  root, made = sources
  seen = {}
  original = TrainStep.import_state

  def spy(self, *args, **kwargs):  # the state as imported, before the first stage donates it
    state = original(self, *args, **kwargs)
    seen["state"], seen["layout"] = portable.to_host(state), self.layout
    return state

  monkeypatch.setattr(TrainStep, "import_state", spy)
  before = snapshot(root / "acco")
  config = tiny(gpt2_zero1, **{"ckpt.init_from": str(root / "acco"), "mesh.num_devices": 4})
  trainer.train_and_evaluate(config, str(tmp_path / "run"), max_stages=2)
  out = capsys.readouterr().out
  # acco: 3 stages of 8 rows, 1 commit; zero1 on 4 devices: 8 rows a stage, stage 1 = update 1
  assert (
    f"ckpt.init_from: the acco run in {root / 'acco'} (stage 3, 1 updates) continues as zero1 "
    "at stage 1 on 4 devices; data continues at global batch 3; not carried: the estimate of "
    "the round in progress, 8 microbatch gradients in flight"
  ) in out, out
  want = view(*made["acco"])
  got = view(seen["state"], seen["layout"])
  same_bits(got["theta"], want["theta"], "theta")
  same_bits(got["opt"], want["opt"], "inner optimizer state")
  with Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as ckpt:
    _, extra = ckpt.restore_host(None, lambda e: seen["state"])
  assert extra["stage"] == 2 and extra["data"]["step"] == 4  # one stage on from global batch 3
  assert extra["tokens_seen"] == (3 + 1) * 8 * 8  # the source's 3 stages, then one of 8 rows
  events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert events[0]["event"] == "initialized_from" and events[0]["updates"] == 1
  assert snapshot(root / "acco") == before  # nothing in the source workdir was written

  capsys.readouterr()  # the run's own checkpoint wins over init_from
  trainer.train_and_evaluate(config, str(tmp_path / "run"), max_stages=3)
  out = capsys.readouterr().out
  assert "ckpt.init_from ignored: resuming from this workdir's checkpoint of stage 2" in out


def test_zero1_run_starts_an_acco_run(sources):
  root, made = sources
  config = tiny(gpt2_acco, **{"ckpt.init_from": str(root / "zero1"), "mesh.num_devices": 4})
  run = build.build(config)
  stream = streams.batch_stream(run, config, run.tokens.train, 4, seed=config.train.seed)
  imported = init_from_lib.start(run, config, stream, rows_per_stage=4)
  assert imported.stage == 4 and stream.get_state()["step"] == 8  # 2 updates; 32 rows / 4
  assert imported.tokens_seen == 2 * 16 * 8
  state = portable.to_host(imported.state)
  got = view(state, run.step.layout)
  want = view(*made["zero1"])
  same_bits(got["theta"], want["theta"], "theta")
  same_bits(got["opt"], want["opt"], "inner optimizer state")
  same_bits(run.step.layout.from_shards(state.params), want["theta"], "params")
  assert int(state.opt_state.stage) == 4 == int(state.stage)  # an estimate next
  assert int(state.buf_count.sum()) == 4  # primed: one microbatch per device


# -- refusals: one line, nothing written ----------------------------------------------------------


def fake_source(path, module, *, preset="tiny", state=None, **extra):
  """A workdir whose checkpoint says it was written by ``module``'s config (arrays not read)."""
  config = module.get_config(preset)
  config.model.D, config.model.N, config.model.H, config.data.seq_len = 16, 1, 1, 8
  extra = {"stage": 2, "config": config.to_json_best_effort(), **extra}
  with Checkpointer(pathlib.Path(path) / "checkpoints", async_save=False) as ckpt:
    ckpt.save(2, state or {"x": jnp.zeros(3)}, extra={k: v for k, v in extra.items() if v})
  return path


def fake_with(path, **fields):
  """A zero1 source with ``fields`` (group.field) of its config changed."""
  config = tiny(gpt2_zero1, **fields)
  with Checkpointer(pathlib.Path(path) / "checkpoints", async_save=False) as ckpt:
    ckpt.save(2, {"x": jnp.zeros(3)}, extra={"stage": 2, "config": config.to_json_best_effort()})
  return path


def refused(config, tmp_path) -> str:
  """The one-line UserError of a run of ``config``; neither workdir changes."""
  source = pathlib.Path(config.ckpt.init_from)
  before = snapshot(source) if source.exists() else None
  with pytest.raises(errors.UserError) as info:
    trainer.train_and_evaluate(config, str(tmp_path / "new"))
  message = str(info.value)
  assert "\n" not in message and not (tmp_path / "new").exists()
  assert (snapshot(source) if source.exists() else None) == before
  print(f"MESSAGE {message}")
  return message


def hdee_recipe(path):
  (path / "seed-M" / "checkpoints").mkdir(parents=True)
  (path / "recipe.json").write_text("{}")
  return path


REFUSALS = [
  ("missing-workdir", lambda p: p / "nowhere", r"no such directory"),
  ("empty-workdir", lambda p: p, r"holds no checkpoint"),
  ("hdee-recipe", hdee_recipe, r"is an HDEE recipe .* ckpt.init_from=.*seed-M$"),
  (
    "loco-source",
    lambda p: fake_source(p, gpt2_diloco),
    r"method=diloco run: its state is per worker .* outer optimizer's",
  ),
  (
    "another-model",
    lambda p: fake_with(p, **{"model.D": 32, "data.seq_len": 16}),
    r"the source's model is not this run's: D=32 there, 16 here \(model.D\); L=16 there, 8 here "
    r"\(data.seq_len\)",
  ),
  (
    "another-optimizer",
    lambda p: fake_with(p, **{"opt.name": "sgd"}),
    r"inner optimizer keeps another state .*\(opt.name=sgd there, adamw here\)",
  ),
  (
    "skippipe-plan",
    lambda p: fake_source(p, gpt2_pipeline, plan={"settings": {}}),
    r"scheduled SkipPipe plan .* does not move onto another mesh",
  ),
  (
    "no-config",
    lambda p: fake_source(p, gpt2_zero1, config=None),
    r"does not record the run's config",
  ),
]


@pytest.mark.parametrize("case,make,pattern", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_what_cannot_move_is_a_one_line_refusal(tmp_path, case, make, pattern):
  source = make(tmp_path / "source")
  (tmp_path / "source").mkdir(exist_ok=True)
  config = tiny(gpt2_zero1, **{"ckpt.init_from": str(source)})
  assert re.search(pattern, refused(config, tmp_path)), case


@pytest.mark.parametrize(
  "case,module,overrides,pattern",
  [
    ("loco-target", gpt2_diloco, {}, r"a method=diloco run cannot start .* outer state"),
    (
      "too-few-updates",
      gpt2_zero1,
      {"train.num_updates": 2},
      r"has done 2 updates and train.num_updates=2 counts from its first: raise",
    ),
    (
      "another-stream",
      gpt2_zero1,
      {"train.seed": 1},
      r"the data position cannot be kept: the saved data position is for another stream",
    ),
  ],
  ids=["loco-target", "too-few-updates", "another-stream"],
)
def test_what_cannot_start_is_a_one_line_refusal(
  sources, tmp_path, case, module, overrides, pattern
):
  config = tiny(module, **{"ckpt.init_from": str(sources[0] / "zero1"), **overrides})
  assert re.search(pattern, refused(config, tmp_path)), case


def test_an_hdee_recipe_refuses_init_from(tmp_path):
  from acco_jax.ensemble import recipe

  config = hdee.get_config("tiny")
  config.ckpt.init_from = str(tmp_path)
  with pytest.raises(errors.UserValueError, match="does not apply to method=hdee"):
    recipe.train_and_evaluate(config, str(tmp_path / "new"))
  assert not (tmp_path / "new").exists()


# -- train.py --------------------------------------------------------------------------------------


def train_py(workdir, config: str, **flags):
  return subprocess.run(
    [
      sys.executable,
      str(REPO / "train.py"),
      "--config",
      config,
      "--workdir",
      str(workdir),
      *[f"--config.{k}={v}" for k, v in flags.items()],
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1"),
  )


SMALL = {
  "model.D": 16,
  "model.N": 1,
  "model.H": 1,
  "data.seq_len": 8,
  "train.eval_every": 0,
  "train.eval_batches": 1,
  "train.sample_tokens": 0,
  "ckpt.async_save": "false",
  "data.cache_dir": REPO / ".pytest_cache" / "acco_data",
}


def test_train_py_refuses_in_one_line(sources, tmp_path):
  proc = train_py(
    tmp_path / "run",
    "configs/gpt2_zero1.py:tiny",
    **SMALL,
    **{"ckpt.init_from": sources[0] / "zero1", "train.num_updates": 2},
  )
  assert proc.returncode == 2 and proc.stderr.splitlines() == [
    f"error: ckpt.init_from={sources[0] / 'zero1'}: the source has done 2 updates and "
    "train.num_updates=2 counts from its first: raise train.num_updates above 2"
  ], proc.stderr[-3000:]
  assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two train.py runs: about 40 s of compilation on 2 cores
def test_train_py_starts_from_another_runs_checkpoint(tmp_path):
  source = train_py(
    tmp_path / "acco", "configs/gpt2_acco.py:tiny", **SMALL, **{"train.num_updates": 3}
  )
  assert source.returncode == 0, source.stderr[-3000:]
  flags = {"ckpt.init_from": tmp_path / "acco", "mesh.num_devices": 4, "train.num_updates": 5}
  proc = train_py(tmp_path / "run", "configs/gpt2_zero1.py:tiny", **SMALL, **flags)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert (
    f"ckpt.init_from: the acco run in {tmp_path / 'acco'} (stage 6, 3 updates) continues as "
    "zero1 at stage 3 on 4 devices; data continues at global batch 6; not carried: 8 "
    "microbatch gradients in flight"
  ) in proc.stdout, proc.stdout
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["updates"] == 5 and summary["stages"] == 5 and np.isfinite(summary["eval_loss"])
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert rows[0]["event"] == "initialized_from" and rows[0]["updates"] == 3
  # the source's 6 stages of 8 rows of 8 tokens, then stages 3 and 4 of this run (8 rows each)
  assert [r["tokens_seen"] for r in rows if "loss" in r][-1] == (6 + 2) * 8 * 8


@pytest.mark.slow  # three train.py runs
def test_train_py_acco_to_pipeline_and_back(tmp_path):
  """configs/gpt2_acco.py's checkpoint continues as a pipeline-ACCO run of 2 stages (1 and 3
  blocks) x 4 lanes, whose checkpoint continues as an acco run again."""
  small = {**SMALL, "model.N": 4}
  source = train_py(
    tmp_path / "acco", "configs/gpt2_acco.py:tiny", **small, **{"train.num_updates": 2}
  )
  assert source.returncode == 0, source.stderr[-3000:]
  pipe = {"pipeline.stages": 2, "pipeline.blocks_per_stage": "1,3", "pipeline.data_method": "acco"}
  proc = train_py(
    tmp_path / "pipe",
    "configs/gpt2_pipeline.py:tiny",
    **small,
    **pipe,
    **{"ckpt.init_from": tmp_path / "acco", "train.num_updates": 4},
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert (
    f"ckpt.init_from: the acco run in {tmp_path / 'acco'} (stage 4, 2 updates) continues "
    "as pipeline at stage 5" in proc.stdout
  ), proc.stdout
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["updates"] == 4 and np.isfinite(summary["eval_loss"])
  back = train_py(
    tmp_path / "back",
    "configs/gpt2_acco.py:tiny",
    **small,
    **{"ckpt.init_from": tmp_path / "pipe", "train.num_updates": 6},
  )
  assert back.returncode == 0, back.stdout[-2000:] + back.stderr[-3000:]
  assert (
    f"ckpt.init_from: the pipeline run in {tmp_path / 'pipe'} (stage 9, 4 updates) "
    "continues as acco at stage 8" in back.stdout
  ), back.stdout
  assert json.loads(back.stdout.strip().splitlines()[-1])["updates"] == 6


@pytest.mark.slow  # two trainer runs with Muon; the moves themselves: relayout_owner_test (default)
def test_owner_layout_run_starts_an_owner_run_on_4_devices(tmp_path, capsys, monkeypatch):
  """opt.name=muon: a zero1 run's owner-layout checkpoint on 8 devices (Muon's momentum per owned
  matrix) continues as acco on 4, whose owners are others: θ and the inner state arrive bit for
  bit in the model's structure (acco_jax.dp.relayout_owner; against the plain layout:
  relayout_owner_test)."""
  muon = {"opt.name": "muon", "train.num_updates": 2, "ckpt.every": 2}
  trainer.train_and_evaluate(tiny(gpt2_zero1, **muon), str(tmp_path / "src"))
  source = build.build(tiny(gpt2_zero1, **muon)).step
  assert source.owner
  with Checkpointer(tmp_path / "src" / "checkpoints", read_only=True) as ckpt:
    saved, _ = ckpt.restore_host(None, lambda e: source.abstract_state(source_shapes(source)))
  want = source.export_state(saved)
  seen = {}
  original = TrainStep.import_state

  def spy(self, *args, **kwargs):
    state = original(self, *args, **kwargs)
    seen["export"] = self.export_state(portable.to_host(state))
    return state

  monkeypatch.setattr(TrainStep, "import_state", spy)
  config = tiny(
    gpt2_acco,
    **{
      **muon,
      "train.num_updates": 3,
      "mesh.num_devices": 4,
      "ckpt.init_from": str(tmp_path / "src"),
    },
  )
  trainer.train_and_evaluate(config, str(tmp_path / "run"), max_stages=5)
  out = capsys.readouterr().out
  assert (
    f"the zero1 run in {tmp_path / 'src'} (stage 2, 2 updates) continues as acco at stage 4 "
    "on 4 devices" in out
  ), out
  same_bits(seen["export"].params, want.params, "theta")
  same_bits(seen["export"].opt, want.opt, "inner optimizer state")


def source_shapes(step):
  layout = step.layout
  return layout.treedef.unflatten(
    [jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes, strict=True)]
  )
