"""method=pipeline across processes: ``train.py`` as 2 ``jax.distributed`` processes of 4 CPU devices
(gloo) trains the same run as one process of 8, to float tolerance (gloo's collectives against
XLA:CPU's in-process ones: another program, so not bits):

* SkipPipe's scheduled plan on 2 lanes x 4 stages: node ``i`` is device ``i``, so lanes and routes
  span both processes, and every process reads the whole batch (each microbatch is whole on its
  origin);
* the 1F1B pipeline on 2 lanes: each lane's rows must be the same on the processes that hold its
  stages (every process reads the whole batch and places its devices' rows).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiprocess_test import free_port, worker_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240
COMMON = [
  "--config.method=pipeline",
  "--config.train.num_updates=3",
  "--config.train.log_every=1",
  "--config.train.eval_every=0",
  "--config.train.eval_batches=1",
  "--config.train.sample_tokens=0",
  "--config.ckpt.async_save=False",
  "--config.model.dtype=float32",
  f"--config.data.cache_dir={REPO / '.pytest_cache' / 'acco_data'}",
]


def _run(workdir: Path, flags: list[str], processes: int) -> dict[int, float]:
  port, procs, logs = free_port(), [], []
  devices = 8 // processes
  env = worker_env()
  if processes == 1:
    env["XLA_FLAGS"] = (env["XLA_FLAGS"] + " --xla_force_host_platform_device_count=8").strip()
  for i in range(processes):
    cmd = [
      sys.executable,
      str(REPO / "train.py"),
      "--config",
      "configs/gpt2_skippipe.py:tiny",
      "--workdir",
      str(workdir),
      *COMMON,
      *flags,
    ]
    if processes > 1:
      cmd += [
        f"--config.dist.coordinator_address=127.0.0.1:{port}",
        f"--config.dist.num_processes={processes}",
        f"--config.dist.process_id={i}",
        f"--config.mesh.cpu_devices={devices}",
      ]
    logs.append(workdir.parent / f"{workdir.name}-p{i}.log")
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for p in procs:
      p.wait(timeout=max(deadline - time.monotonic(), 0.1))
  except subprocess.TimeoutExpired:
    pytest.fail(f"no end in {TIMEOUT_S} s:\n" + "\n".join(p.read_text()[-1500:] for p in logs))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
  codes = [p.returncode for p in procs]
  assert codes == [0] * processes, "\n".join(p.read_text()[-2000:] for p in logs)
  rows = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
  return {r["stage"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize(
  "flags",
  [[], ["--config.pipeline.schedule=1f1b"]],
  ids=["scheduled-plan", "1f1b-two-lanes"],
)
def test_two_processes_train_as_one(tmp_path, flags):
  one = _run(tmp_path / "one", flags, 1)
  two = _run(tmp_path / "two", flags, 2)
  assert sorted(one) == [1, 2, 3] and sorted(two) == [1, 2, 3]
  for stage in one:
    assert two[stage] == pytest.approx(one[stage], rel=1e-5), (stage, one, two)
  assert one[3] < one[1]
