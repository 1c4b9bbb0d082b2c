"""The low-communication methods through the trainer: logging, bytes, exact resume, one-line errors."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from acco_jax import errors
from acco_jax.ckpt.checkpoint import Checkpointer
from acco_jax.loco import build as loco_build
from acco_jax.loco.accounting import SyncAccounting
from acco_jax.run import build, report, trainer
from configs import gpt2_demo, gpt2_diloco, gpt2_noloco, gpt2_sparseloco, gpt2_streaming_diloco
from tests.train_test import SMALL, rows
from tests.train_test import tiny as _tiny


def tiny(module, **overrides):
  """The tiny preset without the sample (a compile of its own) and with one evaluation."""
  return _tiny(module, **{"train.sample_tokens": 0, "train.eval_every": 0, **overrides})


def test_diloco_tiny_end_to_end(tmp_path):
  config = tiny(gpt2_diloco, **{"loco.workers": 4})  # 4 workers x 2 devices, H = 2, 6 steps
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  logged = rows(tmp_path)
  outer = [r for r in logged if "outer_fragment" in r]
  assert [r["step"] for r in outer] == [2, 4, 6]  # one outer step every H
  assert all(r["outer_delta_norm"] > 0 for r in outer)
  train_rows = [r for r in logged if "loss" in r]
  assert all(len(r["worker_loss"]) == 4 for r in train_rows)
  run = build.build(config)
  per_sync = run.step.wire_bytes(0)
  assert summary["wire_bytes_per_worker"] == pytest.approx(3 * per_sync)
  # bytes of one sync: a ring all-reduce of every (padded) float32 value, 2 (M - 1) / M of them
  assert per_sync == pytest.approx(2 * 3 / 4 * 4 * run.step.layout.padded_size)
  assert summary["updates"] == 6 and np.isfinite(summary["eval_loss"])
  assert summary["eval_loss"] < np.log(257) - 0.5


def test_summary_keys_have_one_order_however_the_values_arrived():
  """A LoCo run that evaluates only at its end gets its byte counts before the evaluation, one that
  evaluates on the way (or the rerun of a finished run) after it, and a resumed run may evaluate
  before its first log line: all print their keys in one order."""
  train = SimpleNamespace(peak_sync_bytes=lambda: 8, payload_bytes=lambda i: 4, density=lambda: 1.0)
  train.summary = lambda sent: SyncAccounting.summary(train, sent)
  first, logged = {"unigram_baseline": 5.5}, {"loss": 2.0, "tokens_per_s": 9.0}
  loco, ev = train.summary(12.0), {"eval_loss": 2.1, "eval_ppl": 8.2}
  last = {"stages": 6, "updates": 6}
  arrivals = [
    {**first, **logged, **loco, **ev, **last},  # evaluated at the end only
    {**first, **logged, **ev, **loco, **last},  # evaluated on the way
    {**first, **ev, **logged, **loco, **last},  # resumed: evaluated before the first log line
    {**first, **logged, **ev, **loco, **last, "sample": "hi", "stopped": 3},
  ]
  want = [
    "unigram_baseline",
    "loss",
    "tokens_per_s",
    "eval_loss",
    "eval_ppl",
    "wire_bytes_per_worker",
    "peak_sync_bytes",
    "payload_bytes_per_sync",
    "sent_density",
    "stages",
    "updates",
  ]
  for summary in arrivals[:3]:
    assert list(report.in_order(summary)) == want
    assert report.in_order(summary) == summary  # the same values
  assert list(report.in_order(arrivals[3]))[-2:] == ["stopped", "sample"]
  assert list(report.in_order({"other": 1, **last})) == ["stages", "updates", "other"]


def _final_state(workdir, config):
  run = build.build(config)
  with Checkpointer(str(workdir / "checkpoints")) as ckpt:
    state, extra = ckpt.restore(None, run.step.abstract_state(run.params_shapes))
  return jax.device_get(state), extra


@pytest.mark.slow  # three runs of Streaming DiLoCo (diloco's e2e runs in the fast set)
def test_streaming_resume_from_a_checkpoint_with_a_fragment_in_flight(tmp_path):
  # H = 4, 2 fragments, tau = 1: fragment 0 is sent after step 1 and applied at step 2, so a
  # stop at stage 2 leaves it in flight in the checkpoint
  # the loop's bookkeeping: narrow blocks, two of them (one per fragment)
  config = tiny(
    gpt2_streaming_diloco,
    **{**SMALL, "model.N": 2, "loco.workers": 2, "train.log_every": 1, "opt.warmup_updates": 0},
  )
  whole = trainer.train_and_evaluate(config, str(tmp_path / "whole"))
  first = trainer.train_and_evaluate(config, str(tmp_path / "split"), max_stages=2)
  assert first["stopped"] == 2
  stopped, _ = _final_state(tmp_path / "split", config)
  assert int(stopped.inflight_fragment) == 0  # the checkpoint holds the fragment in flight
  assert any(np.abs(x).max() > 0 for x in jax.tree.leaves(stopped.inflight))
  second = trainer.train_and_evaluate(config, str(tmp_path / "split"))
  again = trainer.train_and_evaluate(config, str(tmp_path / "split"))  # finished: from its files
  losses = lambda w: {r["stage"]: r["worker_loss"] for r in rows(w) if "loss" in r}
  assert losses(tmp_path / "split") == losses(tmp_path / "whole")
  assert second["eval_loss"] == whole["eval_loss"]
  assert second["wire_bytes_per_worker"] == whole["wire_bytes_per_worker"]
  assert list(second) == list(whole) == list(again)  # the summary's keys in one order
  a, _ = _final_state(tmp_path / "whole", config)
  b, _ = _final_state(tmp_path / "split", config)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)  # every worker, the outer states, the in-flight buffer


@pytest.mark.slow  # SparseLoCo through the trainer (its update: loco_family_test; a LoCo e2e: diloco's)
def test_sparseloco_logs_bytes_and_density_and_checkpoints_its_error_feedback(tmp_path):
  """Every sync logs its packed bytes and the share of values it sent, and the checkpoint holds the
  workers' error-feedback buffers. (Bit-exact resume with those buffers: loco_family_test, at the
  step level; the trainer's resume path: the Streaming DiLoCo test above.)"""
  config = tiny(gpt2_sparseloco, **{"loco.workers": 4, "train.log_every": 1})
  whole = trainer.train_and_evaluate(config, str(tmp_path))
  saved, _ = _final_state(tmp_path, config)
  assert any(np.abs(x).max() > 0 for x in jax.tree.leaves(saved.comp))
  run = build.build(config)
  outer = [r for r in rows(tmp_path) if "outer_fragment" in r]
  assert [r["step"] for r in outer] == [2, 4, 6]
  assert {r["sync_bytes_per_worker"] for r in outer} == {run.step.wire_bytes(0)}
  assert {r["sent_density"] for r in outer} == {run.step.density()} and run.step.density() < 0.1
  # an all-gather of 4 workers: each sends its packed payload on, 3 times
  assert whole["wire_bytes_per_worker"] == 3 * 3 * whole["payload_bytes_per_sync"]


# Eager DiLoCo's resume through train.py, bit for bit with its reduction state in flight, the syncs
# it logs and their bytes: tests/crash_resume_test.py (diloco_eager), killed at random points.


def test_a_diverging_worker_stops_the_run(tmp_path):
  """The per-worker non-finite flags (kept per worker on the devices, reduced on the host at a log
  line) stop the run like the data-parallel methods' flag does."""
  config = tiny(gpt2_diloco, **SMALL, **{"loco.workers": 4, "opt.lr": 1e9})
  with pytest.raises(FloatingPointError, match="non-finite loss before stage"):
    trainer.train_and_evaluate(config, str(tmp_path))


def test_restoring_onto_other_workers_is_a_clear_error(tmp_path):
  config = tiny(gpt2_diloco, **SMALL, **{"loco.workers": 4})
  trainer.train_and_evaluate(config, str(tmp_path), max_stages=3)
  config = tiny(gpt2_diloco, **SMALL, **{"loco.workers": 2})
  with pytest.raises(errors.UserValueError, match=r"written by 4 workers x 2 devices.*workers=4"):
    trainer.train_and_evaluate(config, str(tmp_path))


BAD = [
  (
    "workers-not-dividing",
    gpt2_diloco,
    {"loco.workers": 3},
    r"loco.workers=3 does not divide the 8 devices",
  ),
  (
    "fragments-not-dividing-h",
    gpt2_streaming_diloco,
    {"loco.sync_every": 5},
    r"loco.sync_every=5 is not divisible by loco.fragments=2",
  ),
  (
    "overlap-too-long",
    gpt2_streaming_diloco,
    {"loco.overlap_steps": 2},
    r"loco.overlap_steps=2 must be in \[0, H/P = 2\)",
  ),
  ("alpha-out-of-range", gpt2_streaming_diloco, {"loco.alpha": 1.5}, r"loco.alpha=1.5 must be in"),
  ("h-zero", gpt2_diloco, {"loco.sync_every": 0}, r"loco.sync_every=0 must be >= 1"),
  (
    "unknown-quantiser",
    gpt2_streaming_diloco,
    {"loco.quantize": "fp8"},
    r"unknown quantiser 'fp8'",
  ),
  (
    "more-fragments-than-blocks",
    gpt2_streaming_diloco,
    {"loco.fragments": 4, "loco.sync_every": 8},
    r"model has 2 transformer blocks",
  ),
  (
    "diloco-with-fragments",
    gpt2_diloco,
    {"loco.fragments": 2},
    r"use method=streaming_diloco for fragments",
  ),
  (
    "unknown-inner",
    gpt2_diloco,
    {"loco.inner": "dpu"},
    r"loco.inner='dpu': choose 'zero1', 'ddp' or 'acco'",
  ),
  (
    "acco-inner-odd-microbatches",
    gpt2_diloco,
    {"loco.inner": "acco", "batch.microbatches": 3},
    r"batch.microbatches=3: loco.inner=acco runs an inner step as two stages",
  ),
  (
    "hetero-with-loco",
    gpt2_diloco,
    {"hetero.budgets": "1,1,1,1,1,1,1,1"},
    r"hetero.\* .* not to method=diloco",
  ),
  (
    "k-over-chunk",
    gpt2_sparseloco,
    {"loco.topk": 5000},
    r"loco.topk=5000 must be in \[1, loco.chunk\^2 = 4096\]",
  ),
  ("k-zero", gpt2_demo, {"loco.topk": 0}, r"loco.topk=0 must be in \[1,"),
  ("bits", gpt2_sparseloco, {"loco.bits": 3}, r"loco.bits=3: choose 2, 4 or 8"),
  ("ef-decay", gpt2_sparseloco, {"loco.ef_decay": 1.0}, r"loco.ef_decay=1.0 must be in \[0, 1\)"),
  (
    "ef-scale",
    gpt2_sparseloco,
    {"loco.ef_scale": "lr"},
    r"loco.ef_scale='lr': choose 'one' .* or 'outer_lr'",
  ),
  ("chunk-zero", gpt2_sparseloco, {"loco.chunk": 0}, r"loco.chunk=0 must be >= 1"),
  ("aggregate", gpt2_demo, {"loco.aggregate": "sum"}, r"loco.aggregate='sum': choose"),
  (
    "sparseloco-momentum",
    gpt2_sparseloco,
    {"loco.outer_momentum": 0.9},
    r"sparseloco's outer step is plain SGD",
  ),
  ("noloco-h-zero", gpt2_noloco, {"loco.sync_every": 0}, r"loco.sync_every=0 must be >= 1"),
  (
    "noloco-odd-workers",
    gpt2_noloco,
    {"loco.workers": 1},
    r"loco.workers=1: NoLoCo pairs the workers, so it needs an even number",
  ),
  ("noloco-pairings", gpt2_noloco, {"loco.pairings": 0}, r"loco.pairings=0 must be >= 1"),
  ("noloco-fragments", gpt2_noloco, {"loco.fragments": 2}, r"noloco syncs every parameter at once"),
  (
    "demo-every-step",
    gpt2_demo,
    {"loco.sync_every": 2},
    r"demo updates every step: loco.sync_every=2 must be 1",
  ),
  (
    "outer-overlap-unknown",
    gpt2_diloco,
    {"loco.outer_overlap": "late"},
    r"loco.outer_overlap='late': choose one of none, delayed, eager",
  ),
  (
    "outer-overlap-noloco",
    gpt2_noloco,
    {"loco.outer_overlap": "eager"},
    r"loco.outer_overlap='eager' applies to diloco, streaming_diloco and sparseloco, not to noloco",
  ),
  (
    "outer-overlap-demo",
    gpt2_demo,
    {"loco.outer_overlap": "delayed"},
    r"loco.outer_overlap='delayed' applies to .* not to demo",
  ),
  (
    "outer-overlap-with-tau",
    gpt2_streaming_diloco,
    {"loco.outer_overlap": "eager", "loco.overlap_steps": 1},
    r"set loco.overlap_steps=0",
  ),
]


def test_ef_scale_reaches_sparseloco():
  """loco.ef_scale picks what multiplies Δ into SparseLoCo's error feedback (1 or loco.outer_lr)."""
  for scale, want in (("one", None), ("outer_lr", 0.5)):
    config = tiny(gpt2_sparseloco, **{"loco.ef_scale": scale, "loco.outer_lr": 0.5})
    got = loco_build.loco_method(config).sparse.scale
    assert got is None if want is None else float(got(3)) == want


@pytest.mark.parametrize("module,overrides,match", [pytest.param(*c[1:], id=c[0]) for c in BAD])
def test_bad_loco_values_are_one_line_errors(module, overrides, match):
  with pytest.raises(errors.UserValueError, match=match) as info:
    build.build(tiny(module, **overrides))
  assert "\n" not in str(info.value)
