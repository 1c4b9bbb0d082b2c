"""SIGTERM/SIGINT during training: checkpoint at the next stage boundary and stop. The command line's
end to end (two processes, SIGTERM to one, exit 0, the rerun resumes to the end) is
``tests/preemption_multiprocess_test.py``; one process takes the same stop with its own flag,
which SIGINT here and the stand-in test below cover."""

import json
import os
import pathlib
import signal
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_sigint_in_process_checkpoints_at_the_stage_boundary(tmp_path):
  """Ctrl-C (SIGINT) takes the same path as SIGTERM: save at the next stage boundary and return."""
  import threading

  from acco_jax.ckpt.checkpoint import Checkpointer
  from acco_jax.run import trainer
  from configs import gpt2_acco

  config = gpt2_acco.get_config("tiny")
  config.data.cache_dir = str(REPO / ".pytest_cache" / "acco_data")
  config.train.num_updates, config.train.eval_every, config.train.sample_tokens = 400, 0, 0
  config.ckpt.every, config.ckpt.async_save = 0, False
  workdir = tmp_path / "run"
  rows = workdir / "metrics.jsonl"

  def interrupt_once_training():
    deadline = time.time() + 120
    while time.time() < deadline:  # after the first logged stage: compiled and running
      if rows.exists() and '"loss"' in rows.read_text():
        os.kill(os.getpid(), signal.SIGINT)
        return
      time.sleep(0.05)

  threading.Thread(target=interrupt_once_training, daemon=True).start()
  summary = trainer.train_and_evaluate(config, str(workdir))
  stopped = summary["stopped"]  # a KeyboardInterrupt would have ended the test instead
  assert 2 <= stopped < 800
  assert Checkpointer(workdir / "checkpoints").latest_step() == stopped
  events = [json.loads(x) for x in rows.read_text().splitlines()]
  assert {"event": "stopped", "reason": "SIGINT", "stage": stopped} in events


def test_synced_preemption_passes_every_stage_to_jax_and_leaves_sigterm_to_it(monkeypatch):
  """Across processes: JAX's handler keeps SIGTERM (a Python one would replace it), and each stage
  of a call that spans several is passed to the sync point, so that it is not stepped over."""
  from acco_jax.run import monitor

  asked = []
  sync_at = 6  # what JAX's protocol would have agreed on
  fake = lambda stage: asked.append(stage) or stage == sync_at
  monkeypatch.setattr(monitor.multihost_utils, "reached_preemption_sync_point", fake)
  monkeypatch.setattr(monitor, "jax_preemption_service", lambda: True)
  before, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  p = monitor.Preemption(synced=True)
  try:
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGINT) is not before_int  # Ctrl-C: still the flag
    p.begin(3)  # a resumed run: the stages before it too
    assert p.at_boundary(4) is None
    assert p.at_boundary(8) == "SIGTERM"  # a call of 4 stages, the sync point inside it
    assert asked == [1, 2, 3, 4, 5, 6, 7, 8]
    late = monitor.Preemption(synced=True)  # the notice came while the run was starting
    sync_at = 2
    late.begin(3)
    assert late.requested == "SIGTERM" and late.at_boundary(4) == "SIGTERM"
    late.restore()
  finally:
    p.restore()
  alone = monitor.Preemption(synced=False)  # one process: both signals are the flag's
  try:
    assert signal.getsignal(signal.SIGTERM) is not before
    alone.begin(0)
    assert alone.at_boundary(5) is None and len(asked) == 12
  finally:
    alone.restore()
  assert signal.getsignal(signal.SIGTERM) is before
