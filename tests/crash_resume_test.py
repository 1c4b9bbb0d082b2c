"""SIGKILL fault injection: training killed at random points resumes to a bit-identical result.

``train.py`` runs as a subprocess with a checkpoint at every update (asynchronous saves) and is
killed with SIGKILL twice, at points drawn from a seeded RNG: once a random number of stages after
it starts (plus a random fraction of a stage), and once the moment one of its asynchronous
checkpoint writes appears on disk as ``<step>.orbax-checkpoint-tmp``. After each kill the same
command is rerun; the last run finishes. An uninterrupted run of the same config in another workdir
is the reference: the final train state (every leaf, bit for bit), the checkpoint's data-iterator
position, the per-stage metrics (the last row logged for each stage: stages after the last complete
checkpoint are redone and logged again) and the final evaluation must all be identical. A kill
counts as "during a checkpoint write" when a tmp directory of that process is left behind.

One call of the trainer may span several stages (a LoCo method's overlapped phase runs ``H``
inner steps in one program, logs one row at its end and checkpoints only there), so the kill points
and the comparison count *logged rows*, not stages: the rows are the stages that end a call, the
same set in both runs (the plan is a function of the steps done, so a resumed run makes the same
calls), and a kill inside a multi-stage call resumes from the checkpoint before it.

The session's persistent compilation cache, filled by the reference run where other tests have not
already, keeps each restart to a few seconds.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from acco_jax.ckpt.checkpoint import Checkpointer
from acco_jax.dp.updates import stage_plan
from acco_jax.pipeline.build import flush_plan
from acco_jax.run import build
from configs import (
  gpt2_acco,
  gpt2_diloco,
  gpt2_pipeline,
  gpt2_skippipe,
  gpt2_sparseloco,
  gpt2_streaming_diloco,
  sft_acco,
)
from tests.train_test import SMALL

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA_CACHE = REPO / ".pytest_cache" / "acco_data"  # shared with train_test (tokenized corpus)
TMP = ".orbax-checkpoint-tmp"
RUN_TIMEOUT_S = 600  # one process, compilation included (2 busy cores; the reference run of eager
# Streaming DiLoCo compiles a phase program per fragment, over a minute each under load)
# method -> (config module, top-level overrides); "pipeline": SkipPipe's scheduled plan on 2 lanes x
# 4 stages, microbatches crossing lanes (tests/pipeline_train_test.py)
# No zero1 or zero1_muon (CI time): ZeRO-1's checkpoint is ACCO's without the gradient buffer (the
# same TrainStep saves and restores both; acco and acco_muon run it, elementwise and owner layouts),
# and its one stage per update is the pipelines' and the LoCo methods' too
MODULES = {
  "acco": (gpt2_acco, {}),
  "pipeline": (gpt2_skippipe, {"method": "pipeline"}),
  "pipeline_acco": (gpt2_pipeline, {}),
  "diloco_eager": (gpt2_diloco, {}),
  "acco_muon": (gpt2_acco, {}),
  "diloco_muon": (gpt2_diloco, {}),
  "diloco_acco": (gpt2_diloco, {}),
  "streaming_eager": (gpt2_streaming_diloco, {}),
  "sparseloco_eager": (gpt2_sparseloco, {}),
  "sft": (sft_acco, {}),
}
OVERRIDES = {  # 24 stages (acco) with a checkpoint at every update, all saved asynchronously
  "train.num_updates": 12,
  "train.log_every": 1,
  "train.eval_every": 0,  # evaluated once, at the end
  "train.sample_tokens": 0,
  # the loop's bookkeeping is under test, not what the model learns: narrow blocks on short rows,
  # one evaluation batch, one block where the method allows it (not the pipelines' stages,
  # Streaming's two fragments, Muon's matrices owned over 8 devices); compiling is most of this
  # file's time
  **SMALL,
  "ckpt.every": 1,
  "ckpt.keep": 3,
  "ckpt.async_save": True,
  "data.cache_dir": str(DATA_CACHE),
}
# group.field overrides of one method, on top of OVERRIDES. Eager DiLoCo: 4 workers x 2 devices,
# H = 3, 24 inner steps: steps 1-3 one call each, then 7 phase programs of 3 steps (the sync's
# reduction in flight across the next phase; each worker's start point, the last average and its
# own share checkpointed at phase ends), the last one ending with the blocking sync. 10 rows.
# Eager Streaming DiLoCo: the same mesh, H = 4, 2 fragments (K = H/P = 2: a fragment's reduction in
# flight for the 2 steps until the other's sync), FP4 payloads, no τ window: steps 1-2 one call
# each, then 11 phase programs of 2 steps alternating fragments, the last with the blocking flush
# of its fragment. 13 rows. Eager SparseLoCo: the same mesh, H = 3, top-k + 2-bit payloads with
# error feedback (the all-gathered sparse average in flight): 10 rows as eager DiLoCo.
# ACCO over the 4 data lanes of 2 stages of 1 and 3 blocks: 25 flushes (one fills the buffer).
METHOD_OVERRIDES = {
  "pipeline": {"model.N": 4},
  "pipeline_acco": {
    "model.N": 4,
    "pipeline.stages": 2,
    "pipeline.blocks_per_stage": "1,3",
    "pipeline.data_method": "acco",
  },
  "diloco_eager": {
    "loco.outer_overlap": "eager",
    "loco.sync_every": 3,
    "loco.workers": 4,
    "train.num_updates": 24,
  },
  # Muon on the blocks' matrices, AdamW on the rest: comm.layout=auto picks the owner layout
  # (TrainStep.owner in acco_jax/dp/step.py: vmapped init, restore, reshard)
  "acco_muon": {"opt.name": "muon", "model.N": 2},
  # MuLoCo: Muon inside 4 workers of 2 devices (each worker's matrices owned whole by one of its
  # devices), DiLoCo's blocking sync every 3 inner steps
  "diloco_muon": {
    "opt.name": "muon",
    "loco.sync_every": 3,
    "loco.workers": 4,
    "train.num_updates": 24,
  },
  # ACCO inside eager DiLoCo's 4 workers of 2 devices: every checkpoint holds an ACCO buffer in
  # flight (the g̃ of the next round) and, from the first sync on, an outer average in flight
  "diloco_acco": {
    "loco.inner": "acco",
    "loco.outer_overlap": "eager",
    "loco.sync_every": 3,
    "loco.workers": 4,
    "train.num_updates": 24,
  },
  "streaming_eager": {
    "model.N": 2,
    "loco.outer_overlap": "eager",
    "loco.overlap_steps": 0,
    "loco.sync_every": 4,
    "loco.workers": 4,
    "train.num_updates": 24,
  },
  "sparseloco_eager": {
    "loco.outer_overlap": "eager",
    "loco.sync_every": 3,
    "loco.workers": 4,
    "train.num_updates": 24,
  },
  # instruction fine-tuning from a Hugging Face directory, rows padded to buckets of 16: a resumed
  # run must read the same examples in the same buckets (the data position is the global step)
  "sft": {
    "model.D": 0,
    "model.N": 0,
    "model.H": 0,
    "data.seq_len": 48,
    "model.init": f"hf:{REPO / 'tests' / 'data' / 'hf' / 'gpt2'}",
    "data.source": f"jsonl:{REPO / 'tests' / 'data' / 'reversals.jsonl'}",
    "data.format": "prompt_completion",
    "train.exact_match": "off",
  },
}


# methods whose calls may span several stages
MULTI_STAGE_CALLS = ("diloco_eager", "streaming_eager", "sparseloco_eager", "diloco_acco")


def overrides_for(method: str) -> dict:
  """The group.field overrides of ``method``'s runs."""
  return {**OVERRIDES, **METHOD_OVERRIDES.get(method, {})}


def config_for(method: str):
  module, top = MODULES[method]
  config = module.get_config("tiny")
  for key, value in top.items():
    config[key] = value
  for key, value in overrides_for(method).items():
    group, field = key.split(".")
    config[group][field] = value
  return config


def train_cmd(method: str, workdir: pathlib.Path) -> list[str]:
  module, top = MODULES[method]
  config = f"{REPO / 'configs' / (module.__name__.split('.')[-1] + '.py')}:tiny"
  flags = [
    f"--config.{k}={str(v).lower() if isinstance(v, bool) else v}"
    for k, v in {**top, **overrides_for(method)}.items()
  ]
  return [
    sys.executable,
    str(REPO / "train.py"),
    "--config",
    config,
    "--workdir",
    str(workdir),
    *flags,
  ]


def train_env(compile_cache: pathlib.Path) -> dict[str, str]:
  """The runs' environment: 8 CPU devices, every program cached in the session's compilation cache
  (tests/conftest.py; programs of the same shapes compiled by other tests are reused) or, outside
  a session, in ``compile_cache``."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(compile_cache))
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  return env


def tmp_dirs(workdir: pathlib.Path) -> dict[str, int]:
  """``{name: mtime_ns}`` of the checkpoint saves in flight (or left behind by a kill)."""
  out = {}
  try:
    with os.scandir(workdir / "checkpoints") as entries:
      for e in entries:
        if TMP in e.name:
          try:
            out[e.name] = e.stat().st_mtime_ns
          except FileNotFoundError:  # renamed (finalized) between listing and stat
            pass
  except FileNotFoundError:
    pass
  return out


def count_stage_rows(workdir: pathlib.Path) -> int:
  """Training rows logged so far (each has a "loss"; evaluation rows have "eval_loss")."""
  try:
    return (workdir / "metrics.jsonl").read_text().count('"loss": ')
  except FileNotFoundError:
    return 0


def tail(path: pathlib.Path) -> str:
  return path.read_text()[-3000:] if path.exists() else "(no output)"


def start(method, workdir, env, log_path):
  with open(log_path, "w") as log:
    return subprocess.Popen(
      train_cmd(method, workdir), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
    )


def finish(proc, log_path) -> dict:
  """Waits for a run to end by itself; returns its summary (the last stdout line)."""
  try:
    proc.wait(timeout=RUN_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    pytest.fail(f"run did not finish in {RUN_TIMEOUT_S} s:\n{tail(log_path)}")
  assert proc.returncode == 0, tail(log_path)
  return json.loads(log_path.read_text().strip().splitlines()[-1])


def latest_finalized(workdir: pathlib.Path) -> int:
  """The newest complete checkpoint step on disk (0 if none): where the next run resumes."""
  try:
    return max(
      (int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()), default=0
    )
  except FileNotFoundError:
    return 0


def run_and_kill(method, workdir, env, log_path, kind: str, count: int, delay: float) -> dict:
  """Starts a run and SIGKILLs it ``delay`` seconds after ``kind`` 'rows': this process has logged
  ``count`` stages, or 'ckpt': the ``count``-th checkpoint write of this process is on disk (as a
  tmp directory). Returns where the kill landed."""
  leftovers = tmp_dirs(workdir)  # saves killed by earlier kills, still on disk
  rows_before = count_stage_rows(workdir)
  resumed_from = latest_finalized(workdir)
  t0 = time.time_ns()
  proc = start(method, workdir, env, log_path)
  deadline = time.monotonic() + RUN_TIMEOUT_S
  new_saves: set[str] = set()  # writes of steps without a leftover: this process's own

  def ready():
    if kind == "rows":
      return count_stage_rows(workdir) - rows_before >= count
    new_saves.update(name for name in tmp_dirs(workdir) if name not in leftovers)
    return len(new_saves) >= count

  try:
    while not ready():
      assert proc.poll() is None, f"run ended before the planned kill:\n{tail(log_path)}"
      assert time.monotonic() < deadline, f"no kill point in {RUN_TIMEOUT_S} s:\n{tail(log_path)}"
      time.sleep(0.001)
    time.sleep(delay)
    assert proc.poll() is None, f"run ended before the planned kill:\n{tail(log_path)}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:  # only the process started here, by its handle
      proc.kill()
      proc.wait(timeout=30)
  assert proc.returncode == -signal.SIGKILL, tail(log_path)
  # a checkpoint directory this process was writing is still a tmp directory: killed mid-write
  in_flight = sorted(n for n, mtime in tmp_dirs(workdir).items() if mtime >= t0)
  return {
    "kind": f"{kind}={count}+{delay:.2f}s",
    "resumed_from": resumed_from,
    "new_rows": count_stage_rows(workdir) - rows_before,
    "killed_mid_checkpoint_write": in_flight,
  }


def per_stage(workdir: pathlib.Path) -> tuple[dict, list, list]:
  """(stage -> last logged train metrics, evaluation rows, stages restored from), from the JSONL."""
  stages, evals, restored = {}, [], []
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row.get("event") == "restored":
      restored.append(row["stage"])
    elif "loss" in row:
      keep = ("update", "loss", "grad_norm", "lr", "committed", "microbatches", "tokens_seen")
      stages[row["stage"]] = {k: row.get(k) for k in keep}
    elif "eval_loss" in row:
      evals.append(row)
  return stages, evals, restored


def final_state(config, workdir: pathlib.Path, step: int | None = None):
  """(step, train state, extra) of the checkpoint at ``step`` (default: the latest)."""
  run = build.build(config)
  with Checkpointer(workdir / "checkpoints") as ckpt:
    step = ckpt.latest_step() if step is None else step
    state, extra = ckpt.restore(step, run.step.abstract_state(run.params_shapes))
  return step, state, extra


def bits(x) -> np.ndarray:
  return np.asarray(jax.device_get(x)).reshape(-1).view(np.uint8)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(MODULES))
def test_sigkill_at_random_points_resumes_bit_exactly(tmp_path, method):
  t_start = time.perf_counter()
  env = train_env(tmp_path / "compile_cache")
  rng = random.Random(f"crash-resume-{method}")

  ref_dir, crash_dir = tmp_path / "reference", tmp_path / "crashed"
  ref_summary = finish(start(method, ref_dir, env, tmp_path / "ref.log"), tmp_path / "ref.log")
  # the stages that end a call (one row each): every stage, or fewer where a call spans several
  row_stages = sorted(per_stage(ref_dir)[0])

  # Two kills, one of each kind, in an order drawn per method. The first run (from scratch) dies
  # either a random time after its row 2u+1..2u+4 (u stages per update) or the moment its second
  # or third checkpoint write appears: its first checkpoint is complete either way (a save waits for
  # the one before it), so the next run resumes. That run dies by the other kind: the moment its
  # first or second write appears, or a random time after a random number of its rows (never past
  # the end). The last run resumes from what that kill left.
  config = config_for(method)
  spu, total = (flush_plan if config.method == "pipeline" else stage_plan)(config)[1:]
  if rng.random() < 0.5:
    plan = [
      ("rows", rng.randint(2 * spu + 1, 2 * spu + 4), rng.uniform(0, 0.25)),
      ("ckpt", rng.randint(1, 2), 0.0),
    ]
  else:
    plan = [("ckpt", rng.randint(2, 3), 0.0), ("rows", None, rng.uniform(0, 0.25))]
  kills = []
  for i, (kind, count, delay) in enumerate(plan):
    if count is None:  # rows the resumed run logs: those after its checkpoint
      left = sum(s > latest_finalized(crash_dir) for s in row_stages)
      count = rng.randint(1, min(8, left - 2))
    log = tmp_path / f"kill{i}.log"
    kills.append(run_and_kill(method, crash_dir, env, log, kind, count, delay))
  last_log = tmp_path / "last.log"
  summary = finish(start(method, crash_dir, env, last_log), last_log)
  elapsed = time.perf_counter() - t_start
  mid_write = sum(bool(k["killed_mid_checkpoint_write"]) for k in kills)
  print(
    f"\n{method}: {len(kills)} kills survived, {mid_write} during a checkpoint write, "
    f"{elapsed:.1f} s in all; kills: {kills}"
  )
  assert mid_write >= 1, kills

  config = config_for(method)
  # the final metrics, per stage and at the end, are identical
  ref_stages, ref_evals, ref_restored = per_stage(ref_dir)
  stages, evals, restored = per_stage(crash_dir)
  assert ref_restored == [] and len(restored) >= 1, restored
  if method in MULTI_STAGE_CALLS:  # phase calls of K = H/P stages after the first K single steps
    k = config.loco.sync_every // config.loco.fragments
    assert sorted(ref_stages) == [*range(1, k + 1), *range(2 * k, total + 1, k)], ref_stages
  else:
    assert sorted(ref_stages) == list(range(1, total + 1))
  assert sorted(stages) == sorted(ref_stages), (sorted(stages), sorted(ref_stages))
  diff = {s: (ref_stages[s], stages.get(s)) for s in ref_stages if stages.get(s) != ref_stages[s]}
  assert not diff, f"per-stage metrics differ after the kills {kills}: {diff}"
  assert evals[-1] == ref_evals[-1]
  for key in ("loss", "eval_loss", "stages", "updates"):
    assert summary[key] == ref_summary[key], (key, summary, ref_summary)
  # a save killed mid-write is ignored, then replaced when its step is saved again
  assert tmp_dirs(crash_dir) == {}, tmp_dirs(crash_dir)

  # the final train states are identical bit for bit, as is the data-iterator position
  ref_step, ref_state, ref_extra = final_state(config, ref_dir)
  step, state, extra = final_state(config, crash_dir)
  assert step == ref_step == total
  assert extra == ref_extra
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert jax.tree.structure(state) == jax.tree.structure(ref_state)
  differ = [
    p
    for p, a, b in zip(paths, jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True)
    if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(bits(a), bits(b))
  ]
  assert not differ, f"final state leaves differ: {differ}"
  if method in MULTI_STAGE_CALLS:  # between two phases a checkpoint holds the sync still to land
    _, mid, _ = final_state(config, ref_dir, row_stages[-2])  # the last sync clears it at the end
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(mid.overlap.own))
  if method == "diloco_eager":  # a sync is logged at the end of the phase it lands in: from 2H on
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(mid.overlap.mean))
    h = config.loco.sync_every
    synced = [
      json.loads(r)["step"]
      for r in (ref_dir / "metrics.jsonl").read_text().splitlines()
      if '"outer_fragment"' in r
    ]
    assert synced == list(range(2 * h, total + 1, h)), synced
    one_sync = build.build(config).step.wire_bytes(0)  # every sync's bytes, the last included
    assert summary["wire_bytes_per_worker"] == pytest.approx(total // h * one_sync)
