"""The training loop end to end on the tiny preset: metrics, evaluation, sample, exact resume."""

import json
import math
import pathlib
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from acco_jax import errors
from acco_jax.ckpt import meta
from acco_jax.dp import quantize
from acco_jax.dp.plan import comm_bytes_per_stage
from acco_jax.dp.step import TrainStep
from acco_jax.run import build, trainer
from configs import gpt2_acco, gpt2_dpu, gpt2_zero1


def tiny(module, **overrides):
  config = module.get_config("tiny")
  config.data.cache_dir = str(pathlib.Path(__file__).parent / ".." / ".pytest_cache" / "acco_data")
  config.ckpt.async_save = False
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    (config[group] if group else config)[field] = value
  return config


# One narrow block on short rows, one evaluation batch: for the tests whose point is the loop's
# bookkeeping (stages in flight, resume, non-finite losses), not what the model learns.
SMALL = {"model.D": 16, "model.N": 1, "model.H": 1, "data.seq_len": 8, "train.eval_batches": 1}


def rows(workdir):
  lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


def test_acco_tiny_end_to_end(tmp_path):
  config = tiny(gpt2_acco)
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  logged = rows(tmp_path)
  train_rows = [r for r in logged if "loss" in r]
  evals = [r for r in logged if "eval_loss" in r]
  assert train_rows and evals
  assert {"lr", "grad_norm", "tokens_per_s", "microbatches", "comm_bytes_per_device"} <= set(
    train_rows[-1]
  )
  # the committed update count advances every second stage; the LR follows the schedule
  assert [r["update"] for r in train_rows] == [r["stage"] // 2 for r in train_rows]
  vocab = 257  # byte tokenizer + end-of-text
  assert summary["eval_loss"] < math.log(vocab) - 0.5, summary
  assert (
    summary["updates"] == config.train.num_updates
    and summary["stages"] == 2 * config.train.num_updates
  )
  assert (tmp_path / "sample.txt").read_text().startswith(config.train.sample_prompt)
  assert any(p.name.startswith("events") for p in (tmp_path / "tb").iterdir())


@pytest.mark.parametrize(
  "module,extra",
  [(gpt2_zero1, {}), pytest.param(gpt2_dpu, {"dpu_warmup_updates": 2}, marks=pytest.mark.slow)],
)  # dpu's update itself: methods_test
def test_baselines_run_through_the_trainer(tmp_path, module, extra, monkeypatch):
  # The host keeps at most one stage in flight: stage i's loss is waited for before stage i + 2 is
  # dispatched (running further ahead deadlocked XLA:CPU's simulated devices in a collective).
  events = []
  step, wait = TrainStep.step, jax.block_until_ready

  def spy_step(self, *args, **kwargs):
    state, m = step(self, *args, **kwargs)
    events.append(("step", m["loss"]))
    return state, m

  def spy_wait(x):
    events.append(("wait", x))
    return wait(x)

  monkeypatch.setattr(TrainStep, "step", spy_step)
  monkeypatch.setattr(jax, "block_until_ready", spy_wait)
  config = tiny(module, **extra, **SMALL)
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  expected_stages = config.train.num_updates + (1 if extra else 0)  # dpu: one fill stage
  assert summary["stages"] == expected_stages and summary["updates"] == config.train.num_updates
  assert np.isfinite(summary["eval_loss"])
  steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
  assert len(steps) == expected_stages
  for i, at in enumerate(steps[:-2]):
    loss = events[at][1]
    waited = [x for kind, x in events[at : steps[i + 2]] if kind == "wait"]
    assert any(x is loss for x in waited), f"stage {i} was not waited for before stage {i + 2}"


def test_resume_continues_the_identical_trajectory(tmp_path, capsys, monkeypatch):
  config = tiny(gpt2_acco, **SMALL)
  whole = trainer.train_and_evaluate(config, str(tmp_path / "whole"))
  first = trainer.train_and_evaluate(config, str(tmp_path / "split"), max_stages=5)
  assert first["stopped"] == 5
  capsys.readouterr()
  second = trainer.train_and_evaluate(config, str(tmp_path / "split"))
  shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stage ")]
  # the first stage after the resume compiles: its line has no speed or ETA; the last one has
  assert "not timed" in shown[0] and "eta" not in shown[0], shown
  assert shown[-1].startswith("stage 12/12") and " tok/s (last " in shown[-1], shown
  assert "eta" in shown[-1], shown
  losses = lambda w: {r["stage"]: r["loss"] for r in rows(w) if "loss" in r}
  split = losses(tmp_path / "split")
  assert split == losses(tmp_path / "whole")  # bit-identical losses at every logged stage
  assert second["eval_loss"] == whole["eval_loss"]

  # Rerunning the finished run: one line says so, the summary has the finished run's keys and
  # values (from its checkpoint and metrics.jsonl), no step runs and nothing is written.
  def no_step(*args, **kwargs):
    raise AssertionError("a finished run must not train")

  monkeypatch.setattr(TrainStep, "step", no_step)
  written = {p: p.read_bytes() for p in (tmp_path / "whole").rglob("*") if p.is_file()}
  capsys.readouterr()
  again = trainer.train_and_evaluate(config, str(tmp_path / "whole"))
  out = capsys.readouterr().out.splitlines()
  stages = 2 * config.train.num_updates
  # the memory prediction comes first, before the checkpoint says the run is finished
  assert out[0].startswith("memory (predicted): "), out
  out = out[1:]
  assert out[0] == (
    f"nothing to train: the run finished at stage {stages}/{stages}; final evaluation "
    f"eval_loss={whole['eval_loss']:.4f} (stage {stages}, metrics.jsonl)"
  ), out
  assert json.loads(out[1]) == {k: v for k, v in whole.items() if k != "sample"}
  assert list(json.loads(out[1])) == [k for k in whole if k != "sample"]  # same keys, same order
  assert again["sample"] == whole["sample"]
  assert {p: p.read_bytes() for p in (tmp_path / "whole").rglob("*") if p.is_file()} == written


@pytest.mark.slow  # quantized steps: quantized_step_test; resume: the test above
def test_quantized_acco_resumes_the_identical_trajectory(tmp_path, capsys):
  """int8 gradients and weight updates: the gradients' residual rides in ACCO's checkpointed
  buffer and the weights' is θ - w, so a resume is bit-exact; the log counts int8 bytes."""
  small = {
    "model.D": 16,
    "model.N": 1,
    "model.H": 1,
    "data.seq_len": 8,
    "train.eval_batches": 1,
    "train.sample_tokens": 0,
  }
  config = tiny(gpt2_acco, **{"comm.quantize": "int8", "comm.node_size": 1}, **small)
  whole = trainer.train_and_evaluate(config, str(tmp_path / "whole"))
  assert "comm=int8 blocks of 256" in capsys.readouterr().out
  trainer.train_and_evaluate(config, str(tmp_path / "split"), max_stages=3)  # after an estimate
  second = trainer.train_and_evaluate(config, str(tmp_path / "split"))
  losses = lambda w: {r["stage"]: r["loss"] for r in rows(w) if "loss" in r}
  assert losses(tmp_path / "split") == losses(tmp_path / "whole")
  assert second["eval_loss"] == whole["eval_loss"]
  sent = [r for r in rows(tmp_path / "whole") if "loss" in r][-1]["comm_bytes_per_device"]
  bf16 = build.build(tiny(gpt2_acco, **small)).step  # the same model, bf16 communication
  plain = comm_bytes_per_stage(bf16.plan, bf16.layout.padded_size, bf16.num_devices)
  n, shard = bf16.num_devices, bf16.layout.shard_size
  assert sent == 2 * (n - 1) * quantize.wire_bytes(shard, "int8", 256)  # all-to-all + all-gather
  assert sent / plain < 0.56  # int8 + a float32 scale per 256 values + padding 944 -> 1024


@pytest.mark.slow  # two more quantized runs
def test_resume_with_another_quantization_keeps_or_refuses_the_residual(tmp_path):
  """ZeRO-1 keeps the undelivered part of its int8 sends as state: a resume that would drop it
  (comm.quantize=none) or lack it is a one-line error before any array is read, and the
  checkpoint is left as it was; a resume whose state has the same leaves (int4) runs on."""
  small = {
    "model.D": 16,
    "model.N": 1,
    "model.H": 1,
    "data.seq_len": 8,
    "train.eval_batches": 1,
    "train.sample_tokens": 0,
    "comm.node_size": 1,
  }
  int8 = tiny(gpt2_zero1, **{"comm.quantize": "int8"}, **small)
  trainer.train_and_evaluate(int8, str(tmp_path / "q"), max_stages=2)
  ckpt = tmp_path / "q" / "checkpoints"
  before = sorted(p.name for p in ckpt.iterdir())
  with pytest.raises(errors.UserValueError, match=r"--config.comm.quantize=int8") as e:
    trainer.train_and_evaluate(tiny(gpt2_zero1, **small), str(tmp_path / "q"))
  assert "\n" not in str(e.value) and "would drop" in str(e.value)
  assert sorted(p.name for p in ckpt.iterdir()) == before
  int4 = tiny(gpt2_zero1, **{"comm.quantize": "int4"}, **small)
  assert trainer.train_and_evaluate(int4, str(tmp_path / "q"), max_stages=3)["stopped"] == 3
  # the other direction, and ACCO (its residual rides in the gradient buffer), without training
  plain = {"comm": meta.comm_meta(tiny(gpt2_zero1), SimpleNamespace(keeps_residual=False))}
  with pytest.raises(errors.UserValueError, match=r"written without a residual.*quantize=none"):
    meta.check_comm(plain, int8, SimpleNamespace(keeps_residual=True))
  acco_int8 = tiny(gpt2_acco, **{"comm.quantize": "int8"})
  meta.check_comm(plain, acco_int8, build.build(acco_int8).step)


def test_odd_microbatches_for_acco_is_a_clear_error(tmp_path):
  config = tiny(gpt2_acco)
  config.batch.microbatches = 3
  with pytest.raises(ValueError, match="must be an even number"):
    trainer.train_and_evaluate(config, str(tmp_path))


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  import jax

  from acco_jax.ckpt.checkpoint import Checkpointer

  config = tiny(gpt2_acco, **SMALL)
  config.ckpt.every = 1
  trainer.train_and_evaluate(config, str(tmp_path), max_stages=4)  # good checkpoints at 2 and 4
  config.opt.lr = 1e30  # resume with an exploding learning rate (same optimizer structure)
  config.train.log_every = 1000  # no log line in between: the checkpoint save itself must refuse
  with pytest.raises(FloatingPointError, match="non-finite loss"):
    trainer.train_and_evaluate(config, str(tmp_path))
  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  assert ckpt.latest_step() == 4, ckpt.all_steps()
  run = build.build(config)
  target = run.step.abstract_state(run.params_shapes)
  state, _ = ckpt.restore(None, target)
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(state))


@pytest.mark.slow  # on_nonfinite=stop runs in the default set
def test_nonfinite_skip_drops_the_bad_microbatches_and_keeps_training(tmp_path):
  import jax

  from acco_jax.ckpt.checkpoint import Checkpointer

  config = tiny(gpt2_acco)
  config.ckpt.every = 1
  trainer.train_and_evaluate(config, str(tmp_path), max_stages=4)
  config.opt.lr = 1e30  # every update now overflows: the first bad stage's microbatches are dropped
  config.train.on_nonfinite = "skip"
  config.train.log_every = 1
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["stages"] == 2 * config.train.num_updates  # finished, did not stop
  logged = [r for r in rows(tmp_path) if "loss" in r and r["stage"] > 4]
  assert any(r["skipped_microbatches"] > 0 for r in logged), logged
  run = build.build(config)
  with Checkpointer(str(tmp_path / "checkpoints")) as ckpt:
    state, _ = ckpt.restore(None, run.step.abstract_state(run.params_shapes))
  after = jax.device_get(run.step.params(state))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(after))
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(state))
