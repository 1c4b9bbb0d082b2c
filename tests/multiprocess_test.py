"""ACCO and Streaming DiLoCo across real processes: 2 processes x 4 CPU devices (gloo) against
1 process x 8 devices (for Streaming DiLoCo, 2 workers of 4 devices: one worker per process).

The two workers (``tests/multiprocess_worker.py``) each see 4 local devices and feed only their own
rows through ``acco_jax.parallel.global_batch``; the reference runs the same code in this process on
its 8 simulated devices (``tests/conftest.py``). With fp32 communication the trajectories agree up
to the summation order of the reductions (gloo sums across processes, XLA:CPU within one process).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests import multiprocess_worker as worker

REPO = Path(__file__).resolve().parent.parent
PROCESSES, LOCAL_DEVICES = 2, 4
TIMEOUT_S = 240  # a 10 s run on a quiet machine; the slow tests run beside it on the workers


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict[str, str]:
  env = dict(os.environ)
  flags = [
    f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
  ]
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def run_workers(tmp_path: Path) -> tuple[dict, float, list[str]]:
  port, out = free_port(), tmp_path / "p0.npz"
  logs = [tmp_path / f"worker{i}.log" for i in range(PROCESSES)]
  procs = []
  start = time.perf_counter()
  try:
    for i in range(PROCESSES):
      cmd = [
        sys.executable,
        str(REPO / "tests" / "multiprocess_worker.py"),
        "--process-id",
        str(i),
        "--num-processes",
        str(PROCESSES),
        "--local-devices",
        str(LOCAL_DEVICES),
        "--port",
        str(port),
        "--out",
        str(out),
      ]
      with open(logs[i], "w") as log:
        procs.append(
          subprocess.Popen(cmd, env=worker_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        )
    deadline = start + TIMEOUT_S
    for p in procs:
      p.wait(timeout=max(deadline - time.perf_counter(), 0.1))
  except subprocess.TimeoutExpired:
    pytest.fail(f"workers did not finish in {TIMEOUT_S} s:\n" + _tails(logs))
  finally:
    for p in procs:  # only the processes started here, by their handles
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
  elapsed = time.perf_counter() - start
  codes = [p.returncode for p in procs]
  assert codes == [0] * PROCESSES, f"worker exit codes {codes}:\n" + _tails(logs)
  with np.load(out) as z:
    return {k: z[k] for k in z.files}, elapsed, [log.read_text() for log in logs]


def _tails(logs) -> str:
  return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs if p.exists())


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  assert jax.device_count() == worker.NUM_DEVICES and jax.process_count() == 1
  multi, elapsed, logs = run_workers(tmp_path)
  single = worker.flatten(worker.run())
  assert sorted(k for k in multi if k != "timing") == sorted(single)
  np.testing.assert_array_equal(multi["committed"], single["committed"])
  assert list(single["committed"]) == [False, True] * (worker.STAGES // 2)
  np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(multi["loco_losses"], single["loco_losses"], rtol=1e-5, atol=1e-7)
  for key in single:
    if key.startswith(("final/", "compute/", "loco_final/")):
      np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, atol=1e-6, err_msg=key)
  # guard: the run moved the parameters, so equality is not trivial
  for prefix in ("final/", "loco_final/"):
    moved = float(
      np.max(np.abs(single[prefix + "hidden/kernel"] - worker.init_params()["hidden"]["kernel"]))
    )
    assert moved > 1e-2, prefix
  assert any("connected to" in log for log in logs), "gloo did not report its peers"
  worst = max(
    float(np.max(np.abs(multi[k] - single[k]) / (np.abs(single[k]) + 1e-12)))
    for k in single
    if k != "committed"
  )
  print(
    f"2x4 multi-process ACCO: {elapsed:.1f} s wall (join {multi['timing'][0]:.1f} s, train "
    f"{multi['timing'][1]:.1f} s); max relative difference to 1x8: {worst:.2e}"
  )
