"""bench.loco.store_faults: its clock anchoring (bench.loco.faults.watch) and rates
(bench.loco.faults.analysis) on hand-made metrics (default suite), and its smoke run, two worker
processes meeting through a store directory (slow); bench.loco.store_faults_pace's step times."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.loco import store_faults_pace
from bench.loco.faults import analysis, watch

REPO = Path(__file__).resolve().parent.parent


def row(stage, wall_s, loss=3.0):
  return {"step": stage, "stage": stage, "loss": loss, "wall_s": wall_s, "tokens_seen": 64 * stage}


def test_rows_are_anchored_to_the_clock_per_launch():
  # launch 0 started at t = 1000 (rows seen 0.05 s to 5 s late: a stop), launch 1 at t = 2000
  seen = [(1000.0, {"event": "config"})]
  seen += [(1000 + s + 0.05, row(s, float(s))) for s in (1, 2, 3)]
  seen += [(1000 + 4 + 5.0, row(4, 4.0))]  # written late: its process was stopped
  seen += [(2000.5, {"event": "config"})]
  seen += [(2000 + 0.5 + s + 0.2, row(s + 2, 0.5 + s)) for s in (1, 2)]
  rows = watch.timeline(seen)
  assert [r["launch"] for r in rows] == [0, 0, 0, 0, 1, 1]
  assert [round(r["t"], 3) for r in rows] == [1001.05, 1002.05, 1003.05, 1004.05, 2001.7, 2002.7]
  # the same without config events: wall_s going back starts a launch
  bare = [(at, r) for at, r in seen if "event" not in r]
  assert [r["launch"] for r in watch.timeline(bare)] == [0, 0, 0, 0, 1, 1]


def test_rate_counts_stages_per_minute_in_a_window():
  rows = [{"t": 10.0 + 0.5 * i} for i in range(40)]  # 2 stages a second from t = 10 to 29.5
  assert analysis.rate(rows, 10.0, 20.0) == pytest.approx(120.0)
  assert analysis.rate(rows, 30.0, 40.0) == 0.0
  assert analysis.rate(rows, 10.0, 10.5) is None  # under a second: no rate
  assert analysis.rate(rows, 10.0, None) is None


@pytest.mark.slow
def test_store_faults_smoke(tmp_path):
  """python -m bench.loco.store_faults --smoke: 2 worker processes, 24 steps, H = 4 (7 s on the
  quiet 2-core machine with the compilation cache warm, 80 s under load with it cold)."""
  out = tmp_path / "store_faults.json"
  cmd = [sys.executable, "-m", "bench.loco.store_faults", "--smoke", "--out", str(out)]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads(out.read_text())
  assert data["benchmark"] == "store_faults" and "store" in proc.stdout
  (r,) = data["results"]
  assert (r["arm"], r["scenario"]) == ("store", "none")
  assert set(r["workers"]) == {"w0", "w1"}
  for w in r["workers"].values():
    assert w["stages"] == 24 and w["tokens"] == 24 * 64
    assert w["eval_loss"] < math.log(257) - 0.5
  # every round (24 / H) was decided with both workers
  assert [x["round"] for x in r["rounds_detail"]] == list(range(6))
  assert all(sorted(x["members"]) == [0, 1] for x in r["rounds_detail"])
  assert r["rounds"] == {"closed": 6, "members": {"2": 6}}


def test_pace_times_the_rows_from_stage_20_and_the_syncs_apart():
  # 10 ms a step, 500 ms more at every 10th stage's next row (a sync and a checkpoint), 2 s at 11
  rows, wall = [], 1.0
  for stage in range(1, 101):
    wall += 0.01 + (0.5 if stage % 10 == 1 and stage > 1 else 0.0) + (2.0 if stage == 11 else 0.0)
    rows.append({"stage": stage, "wall_s": wall, "worker_loss": [3.0, 3.0, 3.0]})
  p = store_faults_pace.pace(rows)
  assert p["workers_in_a_row"] == 3
  assert p["median_ms"] == pytest.approx(10.0)
  assert p["mean_ms_by_stage_mod_10"][1] == pytest.approx(510.0)
  assert p["mean_ms_by_stage_mod_10"][5] == pytest.approx(10.0)
  assert p["largest_gaps"][0] == [11, 2.51]  # before stage 20: not in the rate
  # stages 20 to 100: 80 steps of 10 ms and 8 syncs of 500 ms in 4.8 s
  assert p["stages_per_min"] == round(60 * 80 / 4.8)
