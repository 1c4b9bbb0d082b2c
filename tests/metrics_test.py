"""The progress line: speed and ETA timed from the end of a process's first (compiling) stage."""

from acco_jax.run import metrics


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def lines(capsys):
  return capsys.readouterr().out.splitlines()


def test_a_resumed_run_times_from_its_first_stage_not_from_the_compile(monkeypatch, capsys):
  """Resumed at stage 10 of 20: the first stage compiles for 100 s, then each takes 1 s and 64
  tokens. The line of the first stage has no figure; the next ones count 1 s per stage."""
  clock = Clock()
  monkeypatch.setattr(metrics.time, "time", clock)
  progress = metrics.Progress(20, 10, every_s=0)
  clock.now = 100.0
  progress.update(11, "loss 2.000", tokens=11 * 64)  # logged before the trainer's mark
  progress.mark(11, 11 * 64)
  assert lines(capsys) == ["stage 11/20 loss 2.000 (first stage: compiling, not timed)"]
  clock.now = 101.0
  progress.update(12, "loss 1.900", tokens=12 * 64)
  progress.mark(12, 12 * 64)  # later marks change nothing
  clock.now = 104.0
  progress.update(15, "loss 1.800", tokens=15 * 64)
  clock.now = 109.0
  progress.update(20, "loss 1.700", tokens=20 * 64)
  assert lines(capsys) == [
    "stage 12/20 loss 1.900 64 tok/s eta 00:00:08",
    "stage 15/20 loss 1.800 64 tok/s eta 00:00:05",
    "stage 20/20 loss 1.700 64 tok/s eta 00:00:00",
  ]


def test_nothing_timed_prints_no_figure(monkeypatch, capsys):
  """A run with one stage left (or one whose first logged stage ends before the mark)."""
  clock = Clock()
  monkeypatch.setattr(metrics.time, "time", clock)
  progress = metrics.Progress(5, 4, every_s=0)
  clock.now = 30.0
  progress.update(5, "loss 1.000", tokens=320)
  assert lines(capsys) == ["stage 5/5 loss 1.000 (first stage: compiling, not timed)"]
  fresh = metrics.Progress(4, 0, every_s=0)
  fresh.mark(1, 64)
  clock.now = 32.0
  fresh.update(2, "loss 3.000")  # no token count: the ETA only
  assert lines(capsys) == ["stage 2/4 loss 3.000 eta 00:00:04"]
