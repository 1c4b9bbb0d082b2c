"""SIGTERM during training: checkpoint at the next stage boundary, exit cleanly, resume to the end."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def train_cmd(workdir, cache):
  return [
    sys.executable,
    str(REPO / "train.py"),
    "--config",
    str(REPO / "configs" / "gpt2_acco.py") + ":tiny",
    "--workdir",
    str(workdir),
    f"--config.data.cache_dir={cache}",
    "--config.train.num_updates=150",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.ckpt.every=0",
    "--config.train.sample_tokens=0",
  ]


@pytest.mark.slow
def test_sigterm_checkpoints_and_resumes(tmp_path):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  cache = tmp_path / "cache"
  proc = subprocess.Popen(
    train_cmd(tmp_path / "run", cache),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
    cwd=REPO,
  )
  lines = []
  try:
    deadline = time.time() + 240
    for line in proc.stdout:  # wait until training is under way
      lines.append(line)
      if line.startswith("stage "):  # the first progress line: compiled and running
        proc.send_signal(signal.SIGTERM)
        break
      assert time.time() < deadline, "".join(lines[-20:])
    out, _ = proc.communicate(timeout=120)
  finally:
    proc.kill()
  lines.append(out)
  text = "".join(lines)
  assert proc.returncode == 0, text[-3000:]
  assert "SIGTERM: checkpoint saved at stage" in text, text[-3000:]
  stopped = int(text.split("checkpoint saved at stage ")[1].split(";")[0])
  assert 1 <= stopped < 300
  ckpts = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()]
  assert str(stopped) in ckpts, ckpts

  done = subprocess.run(
    train_cmd(tmp_path / "run", cache),
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=600,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  assert summary["stages"] == 300 and summary["updates"] == 150
  events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert any(e.get("event") == "restored" and e["stage"] == stopped for e in events)


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
