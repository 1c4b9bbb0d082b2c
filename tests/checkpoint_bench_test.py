"""Smoke test of bench.run.checkpoint_time: the tiny ACCO state, two saves and a restore per layout,
its JSON checked (the packed layout writes fewer arrays, both read back bit for bit)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_checkpoint_bench_smoke(tmp_path):
  out = tmp_path / "checkpoint_time.json"
  cmd = [
    sys.executable,
    "-m",
    "bench.run.checkpoint_time",
    "--methods",
    "acco",
    "--smoke",
    "--out",
    str(out),
  ]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  data = json.loads(out.read_text())
  rows = {r["layout"]: r for r in data["rows"]}
  assert data["benchmark"] == "checkpoint_time" and set(rows) == {"packed", "alone"}
  assert all(r["exact"] for r in rows.values()), rows
  assert rows["alone"]["arrays"] == rows["alone"]["leaves"] > rows["packed"]["arrays"] >= 1
  for r in rows.values():  # two timed saves and one timed restore, after the first of each
    assert len(r["save_s"]) == 3 and len(r["restore_s"]) == 2 and r["save_ms"] > 0
  assert "orbax arrays" in data["table"] and "orbax arrays" in proc.stdout
