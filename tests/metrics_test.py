"""The run's speed: stage completions (:class:`metrics.StageClock`), the rates of the log rows, the
summary and the progress line, timed from the end of a process's first (compiling) stage."""

import jax.numpy as jnp
import pytest

from acco_jax.run import metrics


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


@pytest.fixture
def fake_time(monkeypatch):
  clock = Clock()
  monkeypatch.setattr(metrics.time, "time", clock)
  return clock


def lines(capsys):
  return capsys.readouterr().out.splitlines()


def test_a_resumed_run_times_from_its_first_stage_not_from_the_compile(fake_time, capsys):
  """Resumed at stage 10 of 20: the first stage compiles for 100 s, then each takes 1 s and 64
  tokens. The line of the first stage has no figure; the next ones a rate over the stages the clock
  holds (saying how many) and the ETA from the stage rate since the first completion."""
  clock = metrics.StageClock(window=3)
  progress = metrics.Progress(20, 10, every_s=0)
  fake_time.now = 100.0
  clock.done(11, 11 * 64)
  progress.update(11, "loss 2.000", clock)
  assert lines(capsys) == ["stage 11/20 loss 2.000 (first stage: compiling, not timed)"]
  for s in range(12, 21):
    fake_time.now = 100.0 + (s - 11)
    clock.done(s, s * 64)
    if s in (12, 15, 20):
      progress.update(s, f"loss {3 - s / 10:.3f}", clock)
  assert lines(capsys) == [
    "stage 12/20 loss 1.800 64 tok/s (last 1 stage) eta 00:00:08",
    "stage 15/20 loss 1.500 64 tok/s (last 3 stages) eta 00:00:05",
    "stage 20/20 loss 1.000 64 tok/s (last 3 stages) eta 00:00:00",
  ]


def test_the_progress_rate_is_the_recent_one(fake_time, capsys):
  """After a slow start (10 s a stage) the stages take 1 s: the line shows the last window's rate,
  not the run's average."""
  clock = metrics.StageClock(window=2)
  progress = metrics.Progress(10, 0, every_s=0)
  times = [0, 10, 20, 21, 22]  # stages 1..5 done at these times (stage 1: the compile)
  for s, t in enumerate(times, start=1):
    fake_time.now = float(t)
    clock.done(s, s * 100)
  progress.update(5, "loss 1.000", clock)
  (line,) = lines(capsys)
  assert "100 tok/s (last 2 stages)" in line, line


def test_rows_count_their_own_stages_and_the_summary_spans_the_run(fake_time):
  """Stages of 1 s and 10 tokens; a 5 s checkpoint write after stage 3 delays stage 4's end. A row
  every stage: the first has no rate (its stage compiled), the row of stage 4 pays the write, the
  others read 10 tok/s; the run's rate is every token after the first stage over the whole span."""
  clock = metrics.StageClock()
  ends = {1: 50.0, 2: 51.0, 3: 52.0, 4: 58.0, 5: 59.0, 6: 60.0}
  rates = {}
  for s, t in ends.items():
    fake_time.now = t
    clock.done(s, 10 * s)
    rates[s] = clock.row_rate(s)
  assert rates[1] is None
  assert rates[2] == rates[3] == rates[5] == rates[6] == pytest.approx(10.0)
  assert rates[4] == pytest.approx(10 / 6)
  run = clock.run_rate()
  assert run["tokens_per_s"] == pytest.approx(50 / 10.0)
  assert (run["from_stage"], run["to_stage"], run["seconds"], run["tokens"]) == (1, 6, 10.0, 50)


def test_rows_every_few_stages_cover_all_of_them(fake_time):
  """A row every 3 stages of 2 s and 8 tokens: each row's rate covers its 3 stages."""
  clock = metrics.StageClock()
  for s in range(1, 8):
    fake_time.now = 2.0 * s
    clock.done(s, 8 * s)
    if s in (1, 4, 7):
      rate = clock.row_rate(s)
      assert rate == (None if s == 1 else pytest.approx(4.0)), s


def test_wait_records_a_stage_when_its_results_are_ready(fake_time):
  """A stage the loop has not waited for yet (a flush before an evaluation): ``wait`` blocks on its
  results, then records it; a stage recorded already keeps its time."""
  clock = metrics.StageClock()
  fake_time.now = 5.0
  clock.done(1, 10)
  fake_time.now = 7.0
  assert clock.wait(2, 20, jnp.ones(3)) == 7.0
  fake_time.now = 9.0
  assert clock.wait(2, 20, jnp.ones(3)) == 7.0  # already recorded
  assert clock.done(1, 10) == 5.0  # an older stage: its own time, nothing recorded again
  assert clock.run_rate()["tokens_per_s"] == pytest.approx(10 / 2.0)


def test_one_stage_has_no_rate(fake_time):
  clock = metrics.StageClock()
  assert clock.run_rate() is None and clock.window_rate() is None and clock.stage_rate() is None
  clock.done(3, 30)
  assert clock.run_rate() is None and clock.row_rate(3) is None
