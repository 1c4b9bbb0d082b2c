"""SIGTERM to one process of a two-process run: JAX's preemption sync point stops every process
at the same stage, where the collective checkpoint is written, and the rerun resumes to the end.

Not in the serial step (tests/conftest.py): its bounds hold beside other tests. The watchdog ends
a split stop (both processes exit 75) within ``HANG_S`` of the hang; the timeouts only bound a
run that neither finishes nor hangs.
"""

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.multiprocess_test import free_port, worker_env

REPO = pathlib.Path(__file__).resolve().parent.parent
HANG_S = 30  # health.hang_timeout_s: without an agreed stage, the watchdog ends the hang (exit 75)


def two_process_cmds(workdir, port: int) -> list[list[str]]:
  flags = {
    "dist.coordinator_address": f"127.0.0.1:{port}",
    "dist.num_processes": 2,
    "mesh.cpu_devices": 1,
    "train.num_updates": 100,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "ckpt.every": 0,
    "ckpt.async_save": False,
    "hetero.slowdown": "1:0.01",  # 10 ms a microbatch: the run outlasts the sync protocol
    "health.hang_timeout_s": HANG_S,
    "data.cache_dir": REPO / ".pytest_cache" / "acco_data",
  }
  base = [sys.executable, str(REPO / "train.py"), "--config", "configs/gpt2_acco.py:tiny"]
  base += ["--workdir", str(workdir), *(f"--config.{k}={v}" for k, v in flags.items())]
  return [base + [f"--config.dist.process_id={i}"] for i in range(2)]


def run_two(workdir, logs, *, signal_when=None, timeout=120) -> list[int]:
  """Both processes of the run, to their end; ``signal_when(log of process 0)``: SIGTERM to
  process 1 only, once it holds. Returns the exit codes (fails the test past ``timeout``)."""
  procs, port = [], free_port()
  try:
    for cmd, log in zip(two_process_cmds(workdir, port), logs, strict=True):
      with open(log, "w") as out:
        procs.append(
          subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stdout=out, stderr=subprocess.STDOUT)
        )
    deadline = time.time() + timeout
    if signal_when is not None:
      while not signal_when(logs[0].read_text()):
        assert time.time() < deadline and procs[1].poll() is None, tails(logs)
        time.sleep(0.1)
      procs[1].send_signal(signal.SIGTERM)
    for p in procs:
      p.wait(timeout=max(deadline - time.time(), 1))
  except subprocess.TimeoutExpired:
    pytest.fail(f"the processes did not end within {timeout} s:\n{tails(logs)}")
  finally:
    for p in procs:  # only the processes started here, by their handles
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
  return [p.returncode for p in procs]


def tails(logs) -> str:
  return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs if p.exists())


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_one_stage(tmp_path):
  """A scheduler's (or a user's) SIGTERM reaches one process: JAX's preemption sync point makes
  every process stop at the same stage, where the collective checkpoint is written."""
  workdir, logs = tmp_path / "run", [tmp_path / f"p{i}.log" for i in range(2)]
  started = lambda text: any(line.startswith("stage ") for line in text.splitlines())
  codes = run_two(workdir, logs, signal_when=started, timeout=240)
  assert codes == [0, 0], f"exit codes {codes}:\n{tails(logs)}"
  text = logs[0].read_text()
  assert "SIGTERM: checkpoint saved at stage " in text, tails(logs)
  stopped = int(text.split("checkpoint saved at stage ")[1].split(";")[0])
  assert 1 <= stopped < 200
  ckpts = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert ckpts == [stopped], ckpts

  rerun = [tmp_path / f"rerun{i}.log" for i in range(2)]
  codes = run_two(workdir, rerun, timeout=240)
  assert codes == [0, 0], f"exit codes {codes}:\n{tails(rerun)}"
  summary = json.loads(rerun[0].read_text().strip().splitlines()[-1])
  assert summary["stages"] == 200 and summary["updates"] == 100
  events = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any(e.get("event") == "restored" and e["stage"] == stopped for e in events)
