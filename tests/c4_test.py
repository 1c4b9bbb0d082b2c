"""C4's diagnosis loop: the verdict (health.json), restarting without the faulty process, the slow
policy, and the SLURM script that requeues without the faulty host.

The end-to-end test runs ``train.py`` as 4 ``jax.distributed`` processes of 2 CPU devices (gloo).
It freezes one (SIGSTOP: its collectives never return) and, after resuming, kills one (SIGKILL: its
connections close); each time the other three exit 75 within the watchdog's timeout with a
``health.json`` naming the right process. The three survivors, relaunched with their original
command and ``health.exclude=auto``, resume on 6 devices; their final state equals (to float32
summation order: gloo sums across processes, XLA:CPU within one) that of this process restoring the
same checkpoint on 6 of its 8 devices and training to the same end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from acco_jax import errors
from acco_jax.run import health, monitor
from tests import health_test
from tests.multiprocess_test import free_port, worker_env

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".pytest_cache" / "acco_data"

# -- units ----------------------------------------------------------------------------------------


def write_health(workdir: Path, exclude, launched=4, hosts=None) -> None:
  hosts = hosts or {}
  procs = [{"process": p, "launch_id": p, "host": hosts.get(p, "h")} for p in range(launched)]
  health.write_atomic(
    str(workdir / "health.json"),
    {
      "verdict": "dead",
      "exclude": list(exclude),
      "launched_processes": launched,
      "processes": procs,
    },
  )


def test_exclusion_renumbers_the_remaining_processes(tmp_path):
  kw = dict(coordinator_address="10.0.0.1:1234", num_processes=4)
  launch, args = health.exclusion("auto", str(tmp_path), process_id=3, **kw)
  assert launch is None and args["process_id"] == 3  # no health.json: unchanged
  write_health(tmp_path, [2], hosts={0: "n0", 1: "n1"})
  launch, args = health.exclusion("off", str(tmp_path), process_id=3, **kw)
  assert launch is None and args["num_processes"] == 4
  launch, args = health.exclusion("auto", str(tmp_path), process_id=3, **kw)
  assert args == dict(coordinator_address="10.0.0.1:1234", num_processes=3, process_id=2)
  assert launch == health.Launch((0, 1, 3), 4, (2,))
  with pytest.raises(health.Excluded, match="process 2 is excluded by .*health.json"):
    health.exclusion("auto", str(tmp_path), process_id=2, **kw)
  write_health(tmp_path, [0, 2], hosts={1: "n1"})  # the coordinator's process is out: n1 serves
  _, args = health.exclusion("auto", str(tmp_path), process_id=1, **kw)
  assert args == dict(coordinator_address="n1:1234", num_processes=2, process_id=0)
  with pytest.raises(errors.UserValueError, match="from a launch of 4 processes, this one has"):
    health.exclusion("auto", str(tmp_path), process_id=1, **{**kw, "num_processes": 3})
  (tmp_path / "health.json").write_text("{not json")
  with pytest.raises(errors.UserValueError, match="health.json is unreadable"):
    health.exclusion("auto", str(tmp_path), process_id=1, **kw)


def test_slow_streak_needs_patience_consecutive_probes():
  streak = monitor.SlowStreak(2.0, 3)
  fast, slow = [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 5.0, 1.0]
  assert [streak.observe(t) for t in (slow, slow, fast, slow, slow)] == [[]] * 5  # interrupted
  assert streak.observe(slow) == [(2, pytest.approx(5.0))]


def test_on_slow_default_keeps_only_acco_with_adaptive_budgets():
  from configs import gpt2_acco, gpt2_zero1

  acco, zero1 = gpt2_acco.get_config("tiny"), gpt2_zero1.get_config("tiny")
  assert health.on_slow(acco) == "exclude" and health.on_slow(zero1) == "exclude"
  acco.hetero.adaptive = "balance"
  assert health.on_slow(acco) == "keep"
  zero1.health.on_slow = "keep"
  assert health.on_slow(zero1) == "keep"


class DirStore:
  """The jax.distributed key-value calls as jax 0.10.2 answers them: a directory listing returns
  the keys under ``prefix/`` only (not a key equal to the prefix), and a set without overwrite of
  an existing key raises."""

  def __init__(self):
    self.kv = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.kv and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
    self.kv[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.kv.items() if k.startswith(prefix.rstrip("/") + "/")]


def test_verdict_tells_a_gone_process_from_a_stopped_one(tmp_path):
  """Two silent peers on this host: one exited, one stopped (SIGSTOP). A process alive and
  beating is not named; the published verdict is what a second survivor adopts."""
  gone = subprocess.Popen(["true"])
  gone.wait()
  stopped = subprocess.Popen(["sleep", "30"])
  os.kill(stopped.pid, signal.SIGSTOP)
  deadline = time.time() + 10  # the signal is delivered asynchronously
  while " T " not in Path(f"/proc/{stopped.pid}/stat").read_text() and time.time() < deadline:
    time.sleep(0.01)
  try:
    store, old = DirStore(), time.time() - 60
    for p, pid, beat in ((1, gone.pid, old), (2, stopped.pid, old), (3, os.getpid(), time.time())):
      store.key_value_set(f"acco_jax/heartbeat/{p}", f"7 {beat:.3f}")
      store.key_value_set(
        f"acco_jax/identity/{p}",
        json.dumps({"host": health.host_name(), "pid": pid, "launch_id": p}),
      )
    dog = monitor.Watchdog(5, process_index=0, process_count=4, interval_s=0.05, client=store)
    rec = health.Recorder(str(tmp_path), dog, grace_s=0.01)
    rec.probed(6, [[0.01, 0.1], [0.01, 0.1], [0.01, 0.1], [0.04, 0.1]])
    verdict = rec.conclude()
  finally:
    stopped.kill()
    stopped.wait()
  written = json.loads((tmp_path / "health.json").read_text())
  assert written == verdict
  assert verdict["verdict"] == "dead" and verdict["exclude"] == [1, 2]
  reasons = {s["process"]: s["reason"] for s in verdict["suspects"]}
  assert reasons[1].startswith("dead: process gone") and reasons[2].startswith("hung: process stop")
  rows = {r["process"]: r for r in verdict["processes"]}
  assert rows[1]["heartbeat_age_s"] > 59 and rows[1]["heartbeat_stage"] == 7
  assert rows[3]["state"] == "running" and rows[3]["heartbeat_age_s"] < 1
  assert verdict["probe"]["mb_vs_median"][3] == pytest.approx(4.0)
  # a second survivor adopts the published verdict even where its own view differs
  dog2 = monitor.Watchdog(5, process_index=3, process_count=4, interval_s=0.05, client=store)
  other = tmp_path / "other"
  adopted = health.Recorder(str(other), dog2, grace_s=0.01).conclude(
    error=RuntimeError("Gloo connection closed")
  )
  assert adopted["suspects"] == verdict["suspects"] and adopted["error"].startswith("Gloo")


# -- the SLURM script, with fake scontrol, srun and sbatch ----------------------------------------

SCRIPT = REPO / "scripts" / "slurm_requeue.sbatch"


def fake_bin(tmp_path: Path, srun_exit: int, bad_hosts: str | None) -> Path:
  """``srun`` exits with ``srun_exit``, after writing a health.json naming ``bad_hosts`` if
  given; ``scontrol`` knows a job that already excludes node07 and node08; ``sbatch`` submits."""
  verdict = f'{{"verdict": "dead", "exclude": [1], "exclude_hosts": [{bad_hosts}]}}'
  write = f'mkdir -p "$C4_WORKDIR"\nprintf \'{verdict}\' > "$C4_WORKDIR/health.json"\n'
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  tools = {
    "srun": f"""#!/bin/sh
echo "srun $*" >> "{tmp_path}/calls"
{write if bad_hosts else ""}exit {srun_exit}
""",
    "scontrol": f"""#!/bin/sh
echo "scontrol $*" >> "{tmp_path}/calls"
case "$1 $2" in
  "show job") echo "JobId=$3 JobName=c4 ExcNodeList=node[07-08] NumNodes=4" ;;
  "show hostnames") echo "$3" | sed -e 's/node\\[07-08\\]/node07,node08/' | tr ',' '\\n' ;;
esac
""",
    "sbatch": f"""#!/bin/sh
echo "sbatch $*" >> "{tmp_path}/calls"
echo "Submitted batch job 43"
""",
  }
  for name, text in tools.items():
    path = bin_dir / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
  return bin_dir


@pytest.mark.parametrize(
  "srun_exit,verdict",
  [(75, True), (137, True), (0, False), (1, False)],
  ids=["verdict-75", "verdict-task-killed", "finished", "failed-without-verdict"],
)
def test_slurm_script_resubmits_without_the_named_hosts(tmp_path, srun_exit, verdict):
  """srun reports its worst task: a killed one's code while the survivors exit 75."""
  bin_dir = fake_bin(tmp_path, srun_exit, '"node03", "node07"' if verdict else None)
  env = dict(
    os.environ,
    PATH=f"{bin_dir}:{os.environ['PATH']}",
    SLURM_JOB_ID="42",
    SLURM_JOB_NUM_NODES="4",
    C4_WORKDIR=str(tmp_path / "run"),
    C4_RESTARTS="1",
    C4_PYTHON=sys.executable,
  )
  done = subprocess.run(
    ["bash", str(SCRIPT), "--config.train.num_updates=5"],
    env=env,
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=30,
  )
  calls = (tmp_path / "calls").read_text().splitlines()
  assert calls[0].startswith("srun ") and "--config.train.num_updates=5" in calls[0], calls
  assert f"--workdir={tmp_path / 'run'}" in calls[0], calls
  sbatch = [c for c in calls if c.startswith("sbatch")]
  if not verdict:
    assert done.returncode == srun_exit and not sbatch, (calls, done.stderr)
    return
  assert done.returncode == 0, done.stderr
  assert len(sbatch) == 1, calls
  args = sbatch[0].split()
  # the hosts already excluded, and health.json's, each once; one node fewer than before
  assert "--exclude=node03,node07,node08" in args and "--nodes=3" in args, args
  assert "--export=ALL,C4_RESTARTS=2" in args and args[-2:] == [
    str(SCRIPT),
    "--config.train.num_updates=5",
  ], args
  assert "resubmitted without node03,node07,node08" in done.stdout, done.stdout


def test_slurm_script_stops_after_max_restarts(tmp_path):
  bin_dir = fake_bin(tmp_path, 75, '"node03"')
  env = dict(
    os.environ,
    PATH=f"{bin_dir}:{os.environ['PATH']}",
    SLURM_JOB_ID="42",
    SLURM_JOB_NUM_NODES="4",
    C4_WORKDIR=str(tmp_path / "run"),
    C4_RESTARTS="3",
    C4_MAX_RESTARTS="3",
    C4_PYTHON=sys.executable,
  )
  done = subprocess.run(
    ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, cwd=REPO, timeout=30
  )
  assert done.returncode == 75 and "C4_MAX_RESTARTS=3" in done.stderr, done.stderr
  assert not any(c.startswith("sbatch") for c in (tmp_path / "calls").read_text().splitlines())


# -- 4 real processes -----------------------------------------------------------------------------

TIMEOUT_S = 12  # above a checkpoint save of 4 processes on 2 loaded cores (over 6 s seen)
PROCESSES = 4
UPDATES = 8  # 16 ACCO stages
SMALL = {
  "model.D": 16,
  "model.N": 1,
  "model.H": 1,
  "data.seq_len": 8,
  "model.dtype": "float32",
  "comm_dtype": "float32",
  "train.num_updates": UPDATES,
  "train.log_every": 1,
  "train.eval_every": 0,
  "train.eval_batches": 1,
  "train.sample_tokens": 0,
  "ckpt.every": 2,
  "ckpt.async_save": False,
  "data.cache_dir": str(CACHE),
  "opt.name": "sgd",
}
# SGD: the resumed runs are compared with another program (gloo across processes, XLA within one);
# AdamW would turn a last-bit difference in a near-zero gradient into an lr-sized step.


def command(workdir: Path, port: int, pid: int, exclude: str) -> list[str]:
  flags = {
    **SMALL,
    "mesh.cpu_devices": 2,
    "dist.coordinator_address": f"127.0.0.1:{port}",
    "dist.num_processes": PROCESSES,
    "dist.process_id": pid,
    "dist.timeout_s": 30,
    "health.hang_timeout_s": TIMEOUT_S,
    "health.exclude": exclude,
  }
  return [
    sys.executable,
    str(REPO / "train.py"),
    "--config",
    "configs/gpt2_acco.py:tiny",
    "--workdir",
    str(workdir),
    *(f"--config.{k}={v}" for k, v in flags.items()),
  ]


def launch(workdir: Path, tag: str, pids, port: int, exclude="off") -> dict[int, subprocess.Popen]:
  procs = {}
  for i in pids:
    log = open(workdir.parent / f"{tag}-p{i}.log", "w")
    procs[i] = subprocess.Popen(
      command(workdir, port, i, exclude),
      cwd=REPO,
      env=worker_env(),
      stdout=log,
      stderr=subprocess.STDOUT,
    )
  return procs


def stages(workdir: Path) -> list[int]:
  path = workdir / "metrics.jsonl"
  rows = (
    [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
  )
  return [r["stage"] for r in rows if "loss" in r]


def fault(workdir: Path, tmp_path: Path, tag: str, pids, victim: int, sig) -> tuple[dict, float]:
  """Launches ``pids`` (health.exclude=auto) and, once a new checkpoint is written and a stage
  after it logged, sends ``sig`` to launch index ``victim``. Returns health.json and the seconds
  from the signal to the last survivor's exit (each must exit 75)."""
  before = health.last_checkpoint_step(str(workdir)) or 0
  procs = launch(workdir, tag, pids, free_port(), exclude="auto")
  try:
    deadline = time.time() + 200
    while True:
      saved = health.last_checkpoint_step(str(workdir)) or 0
      if saved > before and max(stages(workdir), default=0) > saved:
        break
      assert time.time() < deadline and all(p.poll() is None for p in procs.values()), tag
      time.sleep(0.2)
    os.kill(procs[victim].pid, sig)
    start = time.time()
    codes = {i: p.wait(timeout=TIMEOUT_S + 40) for i, p in procs.items() if i != victim}
    took = time.time() - start
  finally:
    for p in procs.values():  # only the processes started here, by their handles
      if p.poll() is None:
        p.kill()
      p.wait(timeout=30)
  logs = "\n".join((tmp_path / f"{tag}-p{i}.log").read_text()[-1500:] for i in procs)
  assert codes == {i: monitor.HANG_EXIT_CODE for i in codes}, logs
  return json.loads((workdir / "health.json").read_text()), took


def final_state(workdir: Path, step: int) -> dict[str, np.ndarray]:
  from acco_jax.ckpt.checkpoint import Checkpointer

  with Checkpointer(str(workdir / "checkpoints"), async_save=False) as ckpt:
    saved, _ = ckpt._read_meta(step)
    entries = list(saved.values())
    return {e["path"]: x for e, x in zip(entries, ckpt._read_host(step, entries), strict=True)}


@pytest.mark.slow
def test_faulty_process_is_named_and_the_run_resumes_without_it(tmp_path):
  """Launch 4 processes, SIGKILL launch index 2; relaunch the same command for 0, 1, 3 (they
  renumber and resume on 6 devices), SIGSTOP launch index 1 once they have checkpointed."""
  import jax

  from acco_jax.run import trainer
  from configs import gpt2_acco

  workdir, reference = tmp_path / "run", tmp_path / "reference"
  workdir.mkdir()
  killed, killed_s = fault(workdir, tmp_path, "killed", range(PROCESSES), 2, signal.SIGKILL)
  assert killed["verdict"] == "dead" and killed["exclude"] == [2], killed
  assert [s["process"] for s in killed["suspects"]] == [2], killed
  assert killed["suspects"][0]["host"] == health.host_name(), killed  # an error or a hang: both
  rows = {r["process"]: r for r in killed["processes"]}
  assert rows[2]["heartbeat_age_s"] > 3 * killed["heartbeat_interval_s"], rows
  step = killed["last_checkpoint_step"]
  shutil.copytree(workdir, reference)

  frozen, frozen_s = fault(workdir, tmp_path, "resumed", (0, 1, 3), 1, signal.SIGSTOP)
  log = (tmp_path / "resumed-p0.log").read_text()
  assert f"resharded the checkpoint of stage {step} from 8 to 6 devices" in log, log[-3000:]
  assert frozen["verdict"] == "hung" and frozen["exclude"] == [1, 2], frozen  # both verdicts
  assert frozen["launched_processes"] == PROCESSES, frozen
  assert frozen["suspects"][0]["reason"].startswith("hung: process stopped"), frozen
  assert frozen_s < TIMEOUT_S + 15, frozen_s  # the watchdog, not a transport or XLA timeout
  resumed_step = frozen["last_checkpoint_step"]
  assert resumed_step > step

  # the same checkpoint restored on 6 of this process's 8 devices, trained to the same stage
  assert jax.device_count() == 8
  config = gpt2_acco.get_config("tiny")
  for key, value in SMALL.items():
    group, _, field = key.rpartition(".")
    (config[group] if group else config)[field] = value
  config.mesh.num_devices = 6
  trainer.train_and_evaluate(config, str(reference), max_stages=resumed_step)
  got, want = final_state(workdir, resumed_step), final_state(reference, resumed_step)
  assert sorted(got) == sorted(want)
  for path in want:  # float32 sums in another order (gloo across processes, XLA within one)
    np.testing.assert_allclose(got[path], want[path], rtol=2e-4, atol=2e-6, err_msg=path)
  assert step < resumed_step <= max(stages(reference))  # both trained after the restore
  print(
    f"4x2 processes: SIGKILL -> exit 75 in {killed_s:.1f} s; 3x2 resumed at stage {step} on "
    f"6 devices; SIGSTOP -> exit 75 in {frozen_s:.1f} s (timeout {TIMEOUT_S} s)"
  )


@pytest.mark.slow
def test_slow_worker_is_excluded_after_a_checkpoint(tmp_path):
  """2 processes x 1 device; process 1 sleeps 20 ms per microbatch. With on_slow=exclude and a
  patience of 2 probes (every 4 stages), both hold a checkpoint at the second probe, write a
  `slow` verdict naming process 1 and exit 75 together: the restart loses no stage. The launch is
  tests/health_test.py's but for the policy and no watchdog (a probe's compilation on a loaded
  machine outlasted its 6 s), so one of the two compiles for the other."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  procs = health_test.launch(workdir, "slow", hang_timeout_s=0, on_slow="exclude", slow_patience=2)
  try:
    codes = [p.wait(timeout=240) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait(timeout=30)
  log = (tmp_path / "slow-p0.log").read_text() + (tmp_path / "slow-p1.log").read_text()
  assert codes == [monitor.HANG_EXIT_CODE] * 2, log[-3000:]
  verdict = json.loads((workdir / "health.json").read_text())
  assert verdict["verdict"] == "slow" and verdict["exclude"] == [1], verdict
  assert verdict["suspects"][0]["reason"].endswith("x the others' microbatch time"), verdict
  assert verdict["probe"]["mb_vs_median"][1] > 2, verdict["probe"]
  events = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  (excluded,) = [e for e in events if e.get("event") == "excluded"]
  assert excluded["stage"] == 4 == verdict["last_checkpoint_step"]  # probes at stages 0 and 4
  assert "health.on_slow=exclude" in log


def test_jax_heartbeat_timeout_stays_above_the_watchdog(monkeypatch):
  """jax.distributed aborts every process when a peer misses heartbeats for its timeout (100 s by
  default): above health.hang_timeout_s, so that the watchdog writes the verdict first."""
  import jax

  from acco_jax import parallel

  seen = {}
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
  parallel.initialize_distributed(
    "on", coordinator_address="127.0.0.1:1", num_processes=1, process_id=0, heartbeat_timeout_s=660
  )
  assert seen["heartbeat_timeout_seconds"] == 660
  seen.clear()
  parallel.initialize_distributed(
    "on", coordinator_address="127.0.0.1:1", num_processes=1, process_id=0
  )
  assert "heartbeat_timeout_seconds" not in seen  # JAX's default
