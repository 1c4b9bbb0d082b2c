"""method=pipeline through the trainer: SkipPipe's scheduled plan (configs/gpt2_skippipe.py:tiny) on 2
data lanes x 4 stages (8 simulated devices), with microbatches that change lanes between stages,
trains, stores its plan in the checkpoint and refuses, in one line, a resume that would make another
plan (bit-exact resume after SIGKILLs: crash_resume_test.py, slow)."""

import json
import pathlib
import subprocess
import sys

import jax
import pytest

from acco_jax import errors
from acco_jax.ckpt.checkpoint import Checkpointer
from acco_jax.pipeline import ticks
from acco_jax.run import build, trainer
from acco_jax.skippipe import plans, schedule
from configs import gpt2_skippipe


def _config():
  config = gpt2_skippipe.get_config("tiny")
  config.method = "pipeline"
  config.data.cache_dir = str(pathlib.Path(__file__).parent / ".." / ".pytest_cache" / "acco_data")
  config.ckpt.async_save = False
  config.pipeline.search_iters = 40
  config.train.num_updates, config.train.log_every = 2, 1
  config.train.eval_every, config.train.eval_batches, config.train.sample_tokens = 0, 1, 0
  return config


def _losses(workdir):
  lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return {r["stage"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_scheduled_plan_trains_and_refuses_another_plan(tmp_path):
  config = _config()
  run = build.build(config)
  sched, planned = run.step.schedule, run.step.planned
  assert sched.mesh_wide and sched.lanes == 2 and planned is not None
  # the plan is the one plans.make gives for this config, and some microbatch changes lanes
  again = plans.make(config.pipeline, run.model_cfg, 8, sched.num_microbatches, 1, equal=True)
  assert again.plan == planned.plan
  assert any(len({c // 4 for c in cols}) > 1 for cols in sched.columns), sched.columns

  # one launch of 2 updates (resumes, bit-exact after SIGKILLs: crash_resume_test.py, slow)
  trainer.train_and_evaluate(config, str(tmp_path / "run"))
  losses = _losses(tmp_path / "run")
  assert sorted(losses) == [1, 2] and losses[2] < losses[1]
  # the checkpoint holds the plan; the state holds each stage's buffers on that stage's devices
  with Checkpointer(tmp_path / "run" / "checkpoints") as ckpt:
    _, extra = ckpt.restore(None, run.step.abstract_state(run.params_shapes))
  assert extra["plan"] == json.loads(json.dumps(plans.record(planned)))
  state = run.step.abstract_state(run.params_shapes)
  spec = jax.tree.leaves(state.params)[0].sharding.spec
  assert spec[0] == "stage", spec

  # another skip ratio would make another plan: refused before anything is read or written
  changed = _config()
  changed.pipeline.skip = 0.5
  changed.train.num_updates = 6
  before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
  with pytest.raises(errors.UserValueError, match=r"made with pipeline.skip=0.25, this run's with"):
    trainer.train_and_evaluate(changed, str(tmp_path / "run"))
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_resume_keeps_the_saved_plan():
  """A checkpoint's plan is the one a resumed run trains with, even where this version of the
  scheduler would now make another for the same settings (here: the plan of another search seed,
  recorded with this run's settings)."""
  config = _config()
  run = build.build(config)
  planned, p = run.step.planned, config.pipeline
  other = schedule.schedule(
    planned.topology,
    planned.costs,
    planned.partition,
    run.step.schedule.num_microbatches,
    p.skip,
    p.swap,
    seed=7,
    iters=3,
  )
  assert other != planned.plan
  with pytest.raises(errors.UserValueError, match="without a scheduled plan"):
    run.step.check_checkpoint({})
  run.step.check_checkpoint(
    {"plan": json.loads(json.dumps(plans.record(planned._replace(plan=other))))}
  )
  assert run.step.planned.plan == other
  assert run.step.schedule.columns == ticks.from_plan(other, planned.partition).columns
  moved = plans.record(planned)
  moved["partition"] = moved["partition"][::-1]  # another stage assignment: another device layout
  with pytest.raises(
    errors.UserValueError, match="stage assignment .* is not the one this version"
  ):
    run.step.check_checkpoint({"plan": moved})
  broken = plans.record(planned)
  broken["plan"]["order"][0] = broken["plan"]["order"][0][1:]  # a step left out
  with pytest.raises(ValueError, match="every step of every route exactly once"):
    run.step.check_checkpoint({"plan": broken})


def test_bench_reports_the_plan_train_trains(tmp_path):
  """``python -m bench.pipeline.skippipe --part plan`` prints and writes the plan ``train.py`` trains for the same
  config (configs/gpt2_skippipe.py:tiny, method=pipeline, 8 devices)."""
  repo = pathlib.Path(__file__).resolve().parent.parent
  cmd = [
    sys.executable,
    "-m",
    "bench.pipeline.skippipe",
    "--part",
    "plan",
    "--config",
    "configs/gpt2_skippipe.py:tiny",
    "--devices",
    "8",
    "--out",
    str(tmp_path),
  ]
  proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  reported = json.loads((tmp_path / "skippipe_plan.json").read_text())
  config = gpt2_skippipe.get_config("tiny")
  config.method = "pipeline"
  planned = build.build(config).step.planned
  assert reported["plan"] == json.loads(json.dumps(plans.record(planned)))["plan"]
  assert reported["partition"] == [list(p) for p in planned.partition]
