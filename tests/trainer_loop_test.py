"""The stage loop of ``train.py`` for every family: it compiles nothing after its first stage, and the
speed it reports is the one its own metrics give.

One run per family (ddp, zero1, acco, DiLoCo, the pipeline): 10 stages, a log row every stage,
two checkpoints on the way. JAX's trace, lowering and compile events are recorded with the stage
completions and the checkpoint saves between them:

* after the first stage has finished (under DiLoCo: the first outer sync, whose programs first run
  at stage H), nothing is traced or compiled, except by the first checkpoint save (its fingerprint
  and orbax's copies, once per run). A jitted helper built per call (``jax.jit(lambda ...)``, as
  ``replicated`` was for the learning rate) retraces at every logged stage and fails this.
* ``train.profile_stages=4:5`` (the ZeRO-1 run) leaves a trace of stages 4 and 5 in the workdir;
* the summary's ``tokens_per_s`` is the run's, from the end of the first stage to the end of the
  last: within 2 % of what ``metrics.jsonl``'s ``wall_s`` and ``tokens_seen`` give over the same
  span (the summary used to repeat the last row's rate, measured between two host flushes); every
  row's rate is over the stages since the row before, by its own ``wall_s``; and the run's rate is
  at least the tokens trained after the first stage over the test's own clock around the whole run
  (compile included).
"""

from __future__ import annotations

import time

import jax
import pytest
from jax._src import dispatch

from acco_jax.ckpt import checkpoint
from acco_jax.run import metrics, trainer
from bench.gpu import profile_table  # noqa: E402
from configs import gpt2_acco, gpt2_ddp, gpt2_diloco, gpt2_pipeline, gpt2_zero1
from tests.train_test import SMALL, rows, tiny

EVENTS = (
  dispatch.JAXPR_TRACE_EVENT,
  dispatch.JAXPR_TO_MLIR_MODULE_EVENT,
  dispatch.BACKEND_COMPILE_EVENT,
)

# (config module, overrides, updates for 10 stages, the stage after which every program has run)
FAMILIES = {
  "ddp": (gpt2_ddp, {}, 10, 1),
  "zero1": (gpt2_zero1, {"train.profile_stages": "4:5"}, 10, 1),
  "acco": (gpt2_acco, {}, 5, 1),  # an update is two stages
  "diloco": (gpt2_diloco, {"loco.workers": 4, "loco.sync_every": 2}, 10, 2),
  "pipeline": (gpt2_pipeline, {"model.N": 4}, 10, 1),
}


# the README command's time is bounded: zero1's run in it (the data-parallel step's helpers, which
# every method's run shares), the others in .ci/run's slow step
SLOW = ("ddp", "acco", "diloco", "pipeline")


@pytest.fixture(
  scope="module",
  params=[pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in FAMILIES],
)
def traced_run(request, tmp_path_factory):
  module, overrides, updates, settled = FAMILIES[request.param]
  config = tiny(
    module,
    **{**SMALL, **overrides, "train.log_every": 1, "train.eval_every": 0, "train.sample_tokens": 0},
  )
  config.train.num_updates = updates
  config.ckpt.every = 2 if request.param == "acco" else 3
  log = []

  def on_event(event, _secs, **kw):
    if event in EVENTS:
      log.append(("compile", kw.get("fun_name")))

  done, save = metrics.StageClock.done, checkpoint.Checkpointer.save

  def on_done(self, stage, tokens, when=None):
    log.append(("done", stage))
    return done(self, stage, tokens, when)

  def on_save(self, *args, **kwargs):
    log.append(("save", None))
    try:
      return save(self, *args, **kwargs)
    finally:
      log.append(("saved", None))

  workdir = tmp_path_factory.mktemp(request.param)
  mp = pytest.MonkeyPatch()
  mp.setattr(metrics.StageClock, "done", on_done)
  mp.setattr(checkpoint.Checkpointer, "save", on_save)
  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    t0 = time.time()
    summary = trainer.train_and_evaluate(config, str(workdir))
    elapsed = time.time() - t0
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
    mp.undo()
  return request.param, settled, log, summary, rows(workdir), elapsed, workdir


def test_nothing_compiles_after_the_first_stage(traced_run):
  name, settled, log, summary, *_ = traced_run
  assert summary["stages"] == 10, summary
  stages = [v for kind, v in log if kind == "done"]
  assert stages[0] == 1 and stages[-1] == 10, stages
  start = log.index(("done", settled))
  end = log.index(("done", 10))
  saves = [i for i, e in enumerate(log) if e[0] == "save"]
  assert len(saves) >= 2 and start < saves[0] < end, log  # a checkpoint in the window, then another
  first_save = range(saves[0], log.index(("saved", None), saves[0]))
  late = [
    e for i, e in enumerate(log[start:end], start) if e[0] == "compile" and i not in first_save
  ]
  assert not late, f"{name}: traced or compiled after stage {settled}: {late}"
  assert any(e[0] == "compile" for e in log[:start])  # the events are seen at all


def test_reported_speed_is_the_runs_own(traced_run):
  name, _, log, summary, logged, elapsed, _ = traced_run
  train_rows = [r for r in logged if "loss" in r]
  assert [r["stage"] for r in train_rows] == list(range(1, 11)), name
  first, last = train_rows[0], train_rows[-1]
  assert "tokens_per_s" not in first  # the first stage compiles: it has no rate
  span = (last["tokens_seen"] - first["tokens_seen"]) / (last["wall_s"] - first["wall_s"])
  assert summary["tokens_per_s"] == pytest.approx(span, rel=0.02), (name, summary, span)
  for before, row in zip(train_rows, train_rows[1:], strict=False):
    own = (row["tokens_seen"] - before["tokens_seen"]) / (row["wall_s"] - before["wall_s"])
    assert row["tokens_per_s"] == pytest.approx(own, rel=1e-6), (name, row["stage"])
  floor = (last["tokens_seen"] - first["tokens_seen"]) / elapsed  # the test's clock, compile too
  assert summary["tokens_per_s"] >= floor, (name, summary["tokens_per_s"], floor)
  (event,) = [r for r in logged if r.get("event") == "throughput"]
  assert (event["from_stage"], event["to_stage"]) == (1, 10)
  assert event["tokens_per_s"] == summary["tokens_per_s"]


def test_profile_of_the_chosen_stages(traced_run):
  """``train.profile_stages=4:5`` (the ZeRO-1 run): a Perfetto trace in the workdir whose stage
  annotations are stages 4 and 5, read by ``bench/gpu/profile_table.py`` (on a CPU, no GPU kernels)."""
  name, *_, workdir = traced_run
  found = sorted(workdir.glob("profile/**/perfetto_trace.json.gz"))
  if name != "zero1":
    assert not found
    return
  (path,) = found
  report = profile_table.report(str(path))
  assert [s["stage"] for s in report["stages"]] == [4, 5], report["stages"]
  assert all(s["dispatch_ms"] > 0 for s in report["stages"])
  if jax.default_backend() == "cpu":
    assert report["gpu_kernels"] == 0
    assert "no GPU kernels in this trace" in profile_table.render(report)
