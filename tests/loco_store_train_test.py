"""Workers as separate ``train.py`` processes meeting through a store directory
(``loco.transport=store:<dir>``): equal to the SPMD run when nobody fails, the others go on when one
is killed, stalled, added or slowed, a killed worker resumes bit-exactly, and bad input is one
line with nothing written.

Each worker is a process with one simulated CPU device; the SPMD reference runs in this process on
as many devices as there are workers (the same rows: worker ``i`` reads share ``i`` of each global
batch on both).
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from acco_jax.run import saved, trainer
from configs import gpt2_diloco, gpt2_sparseloco
from tests.train_test import tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = str(ROOT / ".pytest_cache" / "acco_data")
SMALL = {
  "model.D": 16,
  "model.N": 1,
  "model.H": 1,
  "data.seq_len": 8,
  "train.eval_batches": 1,
  "train.sample_tokens": 0,
  "train.eval_every": 0,
  "ckpt.async_save": False,
  "model.dtype": "float32",  # bfloat16 compute would turn another program's rounding into drift
  "comm_dtype": "float32",
}
CONFIGS = {"diloco": gpt2_diloco, "sparseloco": gpt2_sparseloco}


def flags(settings: dict) -> list[str]:
  return [f"--config.{k}={v}" for k, v in settings.items()]


def launch(method, store, workdir, worker, workers, **settings):
  """One worker: ``python train.py`` on one simulated device, its output in ``workdir``.log."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  env["PYTHONPATH"] = str(ROOT)
  values = {
    **SMALL,
    "data.cache_dir": CACHE,
    "mesh.num_devices": 1,
    "loco.transport": f"store:{store}",
    "loco.workers": workers,
    "loco.worker": worker,
    **settings,
  }
  cmd = [sys.executable, str(ROOT / "train.py"), f"--config={ROOT}/configs/gpt2_{method}.py:tiny"]
  log = open(f"{workdir}.log", "a")
  return subprocess.Popen(
    [*cmd, *flags(values), f"--workdir={workdir}"], env=env, stdout=log, stderr=subprocess.STDOUT
  )


def finish(procs, timeout=240):
  for p in procs:
    assert p.wait(timeout=timeout) == 0, pathlib.Path(p.args[-1].split("=", 1)[1] + ".log")


def decided(store) -> dict:
  """Round -> its members, as recorded in the store."""
  out = {}
  for path in sorted(pathlib.Path(store, "rounds").glob("*/set.json")):
    out[int(path.parent.name)] = json.loads(path.read_text())["members"]
  return out


def wait_for_round(store, r, timeout=180):
  end = time.time() + timeout
  while r not in decided(store):
    assert time.time() < end, f"round {r} was not decided in {timeout} s: {decided(store)}"
    time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_store_workers_equal_the_spmd_run(method, tmp_path):
  """Two worker processes, every round with both (a long grace): their θ_g is the SPMD run's."""
  store = tmp_path / "store"
  workers = [
    launch(method, store, tmp_path / f"w{i}", i, 2, **{"loco.grace_s": 120}) for i in (0, 1)
  ]
  config = tiny(CONFIGS[method], **SMALL, **{"loco.workers": 2, "mesh.num_devices": 2})
  want = []
  trainer.train_and_evaluate(config, str(tmp_path / "spmd"), on_params=want.append)
  finish(workers)
  assert decided(store) and all(members == [0, 1] for members in decided(store).values())
  for i in (0, 1):
    got = saved.read_params(str(tmp_path / f"w{i}"))[0]
    np.testing.assert_allclose(flat(got), flat(want[0]), rtol=1e-5, atol=1e-6)


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])
