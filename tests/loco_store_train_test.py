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
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from acco_jax.run import saved, trainer
from configs import gpt2_diloco, gpt2_noloco, gpt2_sparseloco, gpt2_streaming_diloco
from tests import train_test
from tests.train_test import tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = str(ROOT / ".pytest_cache" / "acco_data")
SMALL = {
  **train_test.SMALL,
  "train.sample_tokens": 0,
  "train.eval_every": 0,
  "ckpt.async_save": False,
  "model.dtype": "float32",  # bfloat16 compute would turn another program's rounding into drift
  "comm_dtype": "float32",
  # SGD inside the workers: Adam would turn the mesh's and the store's last-bit differences (sums
  # in another order) into learning-rate-sized steps at near-zero gradients
  "opt.name": "sgd",
}


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
  pathlib.Path(workdir).parent.mkdir(parents=True, exist_ok=True)
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


def record(store, r) -> dict:
  """Round ``r``'s whole decision (members, decided_by, time, live)."""
  return json.loads(pathlib.Path(store, "rounds", f"{r:08d}", "set.json").read_text())


def wait_for_round(store, r, timeout=180):
  end = time.time() + timeout
  while r not in decided(store):
    assert time.time() < end, f"round {r} was not decided in {timeout} s: {decided(store)}"
    time.sleep(0.1)


@pytest.mark.slow
def test_methods_through_a_store_equal_their_spmd_run(tmp_path):
  """Streaming DiLoCo (fragments, a window in flight, FP4) and NoLoCo as two ``train.py`` worker
  processes each, all launched at once, every round with both: each worker's θ_g is the SPMD run's
  (NoLoCo: worker 0's own slow weights). SparseLoCo's is the resume test's. Every method's store
  workers equal its mesh in ``tests/loco_store_test.py`` (in one process, each method); what this
  adds is the command line, so it takes the two methods whose state differs most from DiLoCo's
  (DiLoCo and DeMo went through ``train.py`` here too until the CI budget ran short)."""
  modules = {"streaming_diloco": gpt2_streaming_diloco, "noloco": gpt2_noloco}
  extra = {"streaming_diloco": {"model.N": 2}}  # a block in each of its 2 fragments
  procs = {}
  for name in modules:
    store = tmp_path / name / "store"
    for i in (0, 1):
      work = tmp_path / name / f"w{i}"
      # every round waits for both (min_workers): a worker that has not taken its lease yet when
      # the other publishes round 0 is not live, and a grace would not wait for it
      settings = {"loco.grace_s": 300, "loco.min_workers": 2, **extra.get(name, {})}
      procs[name, i] = launch(name, store, work, i, 2, **settings)
  for name, module in modules.items():
    spmd = {"loco.workers": 2, "mesh.num_devices": 2, **extra.get(name, {})}
    config = tiny(module, **{**SMALL, **spmd})
    want = []
    trainer.train_and_evaluate(config, str(tmp_path / name / "spmd"), on_params=want.append)
    finish([procs[name, 0], procs[name, 1]])
    rounds = decided(tmp_path / name / "store")
    assert rounds and all(m == [0, 1] for m in rounds.values()), (name, rounds)
    for i in (0,) if name == "noloco" else (0, 1):
      got = saved.read_params(str(tmp_path / name / f"w{i}"))[0]
      np.testing.assert_allclose(flat(got), flat(want[0]), rtol=1e-5, atol=1e-6, err_msg=name)


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def rows_of(workdir) -> list[dict]:
  path = pathlib.Path(workdir, "metrics.jsonl")
  return [json.loads(line) for line in path.read_text().splitlines()]


def published(store, worker) -> bool:
  return any(pathlib.Path(store, "rounds").glob(f"*/w{worker}.d0.npy"))


def until(condition, what, timeout=180):
  end = time.time() + timeout
  while not condition():
    assert time.time() < end, f"not within {timeout} s: {what}"
    time.sleep(0.05)


@pytest.mark.slow
def test_a_worker_added_stalled_killed_or_slowed_does_not_stop_the_others(tmp_path):
  """Three workers: worker 2 joins mid-run (caught up from the rounds decided before it), worker
  1 stalls (SIGSTOP) longer than the grace and then runs 3x slow (a SIGSTOP/SIGCONT duty cycle),
  worker 2 is killed. Worker 0 is in every round and finishes; the rounds go on without whoever
  is absent; worker 1 catches up and finishes."""
  store, settings = (
    tmp_path / "store",
    {
      "train.num_updates": 400,
      "train.log_every": 1,
      # a grace that a loaded machine's scheduling never reaches: a worker let go on (SIGCONT)
      # publishes its next round within it, while a worker stopped for good is left out
      "loco.grace_s": 8,
      # a stopped worker stays live (it is not left out for being silent while the joiner
      # starts); the killed one is not, as its process is gone
      "loco.lease_s": 600,
      "loco.snapshot_every": 2,
      "loco.keep_rounds": 10_000,  # every round stays to be checked
    },
  )
  # worker 0 first: a round is decided at once when every live worker has arrived, and worker 1
  # alone would be every live worker if it published before worker 0 had taken its lease
  w = {0: launch("diloco", store, tmp_path / "w0", 0, 3, **settings)}
  until(lambda: pathlib.Path(store, "workers", "w0.p0.json").exists(), "worker 0's lease")
  w[1] = launch("diloco", store, tmp_path / "w1", 1, 3, **settings)
  wait_for_round(store, 1)
  for i in (0, 1):  # hold the run while the joiner starts, so that it joins mid-run
    w[i].send_signal(signal.SIGSTOP)
  joined_after = max(decided(store))
  w[2] = launch("diloco", store, tmp_path / "w2", 2, 3, **settings)
  until(lambda: published(store, 2), "worker 2 publishes")
  for i in (0, 1):
    w[i].send_signal(signal.SIGCONT)
  until(lambda: any(2 in m for m in decided(store).values()), "a round with worker 2")
  stalled_from = max(decided(store))
  w[1].send_signal(signal.SIGSTOP)  # stalled past the grace: the rounds go on without it
  without_1 = lambda: [r for r, m in decided(store).items() if r > stalled_from and 1 not in m]
  until(lambda: len(without_1()) >= 2, "two rounds without the stalled worker 1")
  w[1].send_signal(signal.SIGCONT)
  w[2].kill()
  w[2].wait()  # reaped: a zombie's pid would still look alive
  killed_at = max(decided(store))
  slow_until = time.time() + 6
  while time.time() < slow_until and w[1].poll() is None:  # worker 1 at a third of its speed
    w[1].send_signal(signal.SIGSTOP)
    time.sleep(0.2)
    w[1].send_signal(signal.SIGCONT)
    time.sleep(0.1)
  finish([w[0], w[1]])
  rounds = decided(store)
  # worker 0 syncs 200 times (400 steps, H = 2) and is in each of its rounds; worker 1, having
  # adopted rounds decided while it was stopped, may sync past them alone once worker 0 is done
  left_out = {r: record(store, r) for r in range(200) if 0 not in rounds[r]}
  assert not left_out, f"worker 0 is never left out: {left_out}"
  joined = [r for r in rounds if 2 in rounds[r]]
  assert joined and min(joined) > joined_after, (joined_after, joined)
  assert all(2 not in rounds[r] for r in rounds if r > killed_at + 1), rounds
  caught_up = [r["outer_caught_up"] for r in rows_of(tmp_path / "w1") if "outer_caught_up" in r]
  assert max(caught_up) >= 1  # worker 1 adopted the rounds decided while it was stopped
  assert any(r.get("outer_round", 0) > joined_after for r in rows_of(tmp_path / "w2"))


@pytest.mark.slow
def test_a_killed_worker_resumes_bit_exactly_and_all_present_is_the_spmd_run(tmp_path):
  """Two SparseLoCo workers that every round waits for (``min_workers=2``: the same arrivals
  whatever happens): worker 1 killed and restarted from its checkpoint, later both: the final
  global parameters are bit-identical to the uninterrupted run's (the same program reruns), and
  that run's are the SPMD run's (both workers in every round)."""
  settings = {
    "train.num_updates": 24,
    "loco.min_workers": 2,
    "loco.grace_s": 0,
    "ckpt.every": 4,
  }

  def run(name, kills):
    store = tmp_path / name / "store"
    work = lambda i: tmp_path / name / f"w{i}"
    w = {i: launch("sparseloco", store, work(i), i, 2, **settings) for i in (0, 1)}
    for at, who in kills:
      wait_for_round(store, at)
      for i in who:
        w[i].kill()
        w[i].wait()
      for i in who:
        w[i] = launch("sparseloco", store, work(i), i, 2, **settings)
    finish(w.values())
    return [saved.read_params(str(work(i)))[0] for i in (0, 1)]

  want = run("once", [])
  got = run("killed", [(3, [1]), (7, [0, 1])])
  for i in (0, 1):
    np.testing.assert_array_equal(flat(got[i]), flat(want[i]))
  np.testing.assert_array_equal(flat(want[0]), flat(want[1]))
  # and the run with every worker in every round is the SPMD run's, to float tolerance
  config = tiny(gpt2_sparseloco, **SMALL, **settings, **{"loco.workers": 2, "mesh.num_devices": 2})
  spmd = []
  trainer.train_and_evaluate(config, str(tmp_path / "spmd"), on_params=spmd.append)
  np.testing.assert_allclose(flat(want[0]), flat(spmd[0]), rtol=1e-5, atol=1e-6)


# -- bad input: one line, before any work, the workdir never created (default suite: no compile) --


def store_config(store, **overrides):
  settings = {"loco.transport": f"store:{store}", "loco.workers": 2, "loco.worker": 0}
  return tiny(gpt2_diloco, **SMALL, **{"mesh.num_devices": 1, **settings, **overrides})


def recorded_by_another_worker(store, **overrides):
  """The store as a first worker of a run with ``overrides`` left it (its record, no lease)."""
  from acco_jax.loco import build as loco_build
  from acco_jax.loco.store import RoundStore

  RoundStore(str(store), 1).check_run(loco_build.run_record(store_config(store, **overrides)))


def held_by_this_process(store):
  """Worker 0's lease held by a live process (this one, through another store object)."""
  from acco_jax.loco.store import RoundStore

  holder = RoundStore(str(store), 0)
  holder.acquire()
  return holder


STORE_REFUSALS = {
  "worker-out-of-range": ({"loco.worker": 2}, r"loco.worker=2 with loco.workers=2"),
  "no-worker-slots": ({"loco.workers": 0}, r"numbered 0..loco.workers-1"),
  "outer-overlap": ({"loco.outer_overlap": "eager"}, r"runs on the mesh only"),
  "quorum-above-the-slots": ({"loco.min_workers": 3}, r"1 <= min_workers <= loco.workers=2"),
  "snapshots-past-the-kept-rounds": (
    {"loco.snapshot_every": 9, "loco.keep_rounds": 8},
    r"need 1 <= snapshot_every <= keep_rounds",
  ),
  "unknown-transport": ({"loco.transport": "s3://bucket"}, r"choose 'mesh' .* or 'store:<url>'"),
  "unknown-protocol": ({"loco.transport": "store:nope://bucket/run"}, r"nope"),
  "unreachable": ({"loco.transport": "store:{file}/run"}, r"cannot be reached"),
}


@pytest.mark.parametrize("case", list(STORE_REFUSALS))
def test_bad_store_settings_are_one_line_before_any_write(case, tmp_path):
  from tests.refusals_test import refused_before_any_write

  overrides, match = STORE_REFUSALS[case]
  (tmp_path / "file").write_text("a file, not a directory")
  if "loco.transport" in overrides:
    overrides = {
      **overrides,
      "loco.transport": overrides["loco.transport"].format(file=tmp_path / "file"),
    }
  refused_before_any_write(store_config(tmp_path / "store", **overrides), match, tmp_path)


def test_a_store_of_another_run_or_config_or_a_taken_id_is_refused_before_any_write(tmp_path):
  from tests.refusals_test import refused_before_any_write

  cases = [
    ("seed", {"train.seed": 7}, r"holds another run \(data embedded, train.seed 7\)"),
    ("sync", {"loco.sync_every": 4}, r"loco.sync_every=2 differs from the run's 4 recorded in"),
    ("compression", {"loco.topk": 3}, r"loco.topk=64 differs from the run's 3"),
  ]
  for name, theirs, match in cases:
    store = tmp_path / name
    recorded_by_another_worker(store, **theirs)
    before = sorted(p.name for p in store.rglob("*"))
    refused_before_any_write(store_config(store), match, tmp_path / name)
    assert sorted(p.name for p in store.rglob("*")) == before  # nothing written to the store
  store = tmp_path / "taken"
  holder = held_by_this_process(store)
  refused_before_any_write(store_config(store), r"worker 0 is already running", tmp_path / "taken")
  holder.release()
