"""Device prefetch: order, positions, look-ahead, errors; the trainer reads metrics a stage late."""

import threading
import time

import jax
import numpy as np
import pytest

from acco_jax import data, errors, model
from acco_jax.ckpt import meta
from acco_jax.dp.step import TrainStep
from acco_jax.run import trainer
from configs import gpt2_zero1
from tests.train_test import tiny

TOKENS = np.arange(5000, dtype=np.int32) % 97


def _stream():
  return data.batches(TOKENS, seq_len=8, global_batch_rows=4, seed=3)


def test_same_batches_and_the_position_after_each():
  direct, ahead = _stream(), _stream()
  with data.Prefetcher(ahead, jax.device_put, depth=2) as feed:
    for i in range(6):
      placed, position = next(feed)
      want = next(direct)
      assert isinstance(placed["inputs"], jax.Array)
      np.testing.assert_array_equal(placed["inputs"], want["inputs"])
      assert position == direct.get_state() and position["step"] == i + 1
  resumed = _stream()
  resumed.set_state(position)  # the consumed position resumes right after the last batch taken
  np.testing.assert_array_equal(next(resumed)["targets"], next(direct)["targets"])


def test_next_batch_is_placed_while_the_step_runs():
  placed_at, step_end = {}, {}
  count = iter(range(100))

  def put(batch):
    placed_at[next(count)] = time.perf_counter()
    return batch

  with data.Prefetcher(_stream(), put, depth=2) as feed:
    for i in range(3):
      next(feed)
      time.sleep(0.2)  # the "step"
      step_end[i] = time.perf_counter()
  for i in range(3):
    assert placed_at[i + 1] < step_end[i], "the next batch was not ready before the step ended"
  assert max(placed_at) <= 2 + 3, "read further ahead than depth + the one in hand"


def test_errors_reach_the_consumer_after_the_earlier_batches():
  def flaky():
    yield from ({"x": np.full(2, i)} for i in range(2))
    raise errors.UserValueError("bad shard")

  class Stream:
    def __init__(self):
      self.it, self.n = flaky(), 0

    def __next__(self):
      item = next(self.it)
      self.n += 1
      return item

    def get_state(self):
      return {"step": self.n}

  feed = data.Prefetcher(Stream(), lambda b: b)
  assert [int(next(feed)[0]["x"][0]) for _ in range(2)] == [0, 1]
  with pytest.raises(errors.UserValueError, match="bad shard"):
    next(feed)
  with pytest.raises(StopIteration):
    next(feed)
  feed.close()


def test_close_stops_a_thread_that_is_waiting_to_put():
  feed = data.Prefetcher(_stream(), lambda b: b, depth=1)
  time.sleep(0.1)  # the queue is full, the thread waits
  feed.close()
  assert not any(t.name == "acco-prefetch" and t.is_alive() for t in threading.enumerate())


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
  """A tiny ZeRO-1 run logging every stage, with the order of stage dispatches and metric reads."""
  events, workdir = [], tmp_path_factory.mktemp("logged")
  real_step, real_get = TrainStep.step, jax.device_get

  def step(self, *args, **kwargs):
    events.append("step")
    return real_step(self, *args, **kwargs)

  def device_get(x):
    if isinstance(x, tuple) and isinstance(x[0], dict) and "grad_norm" in x[0]:
      events.append(("read", int(real_get(x[0]["stage"]))))  # the stage's index, 0-based
    return real_get(x)

  config = tiny(
    gpt2_zero1,
    **{"train.log_every": 1, "train.eval_every": 0, "ckpt.every": 0, "train.sample_tokens": 0},
  )
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(TrainStep, "step", step)
    mp.setattr(trainer.jax, "device_get", device_get)
    trainer.train_and_evaluate(config, str(workdir))
  return config, events, workdir


def test_trainer_reads_logged_metrics_after_dispatching_the_next_stage(logged_run):
  config, events, _ = logged_run
  reads = [(i, e[1]) for i, e in enumerate(events) if isinstance(e, tuple)]
  assert len(reads) == config.train.num_updates
  for pos, index in reads[
    :-1
  ]:  # every read but the last waits for stage `index` with the next queued
    assert events[:pos].count("step") == index + 2, events
  assert events[: reads[-1][0]].count("step") == config.train.num_updates


def test_resume_with_another_vocab_padding_is_a_one_line_error(logged_run):
  config, _, workdir = logged_run
  config = tiny(gpt2_zero1, **{"model.vocab_multiple": 64})
  with pytest.raises(errors.UserValueError) as info:
    trainer.train_and_evaluate(config, str(workdir))
  msg = str(info.value)
  assert "\n" not in msg and "257 padded to 257" in msg and "padded to 320" in msg, msg
  assert "vocab_multiple=1 to resume" in msg, msg
  # a checkpoint written before the padding was recorded carries no entry: nothing to compare
  meta.check_vocab({"stage": 2}, model.get_config("tiny", V=257, vocab_multiple=64))
  saved = {"vocab": {"V": 257, "padded": 257, "multiple": 1}}
  with pytest.raises(
    errors.UserValueError, match="V=257 ids, this config's tokenizer gives V=2048"
  ):
    meta.check_vocab(saved, model.get_config("tiny", V=2048))
