"""Smoke tests of the instruction fine-tuning benchmarks (slow: a train.py process, compiles):
bench/dp/sft.py's driver and report on one 2-update run of the test fixtures, and
bench/dp/sft_rows.py's measurement of packed and bucketed rows."""

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_sft_driver_smoke(tmp_path):
  cmd = [sys.executable, "-m", "bench.dp.sft", "--smoke", "--out", str(tmp_path)]
  result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  data = json.loads((tmp_path / "sft.json").read_text())
  (run,) = data["runs"]
  assert run["variant"] == "acco" and [p["update"] for p in run["curve"]] == [1, 2]
  assert all("eval_loss" in p and "exact_match" in p for p in run["curve"])
  assert "| acco |" in (tmp_path / "sft.md").read_text()


def test_rows_measurement_smoke():
  from bench.dp import sft_rows

  source = f"jsonl:{REPO / 'tests' / 'data' / 'reversals.jsonl'}"
  packed = sft_rows.measure("reversals", source, "prompt_completion", 32, True, 2, small=True)
  bucketed = sft_rows.measure("reversals", source, "prompt_completion", 32, False, 2, small=True)
  assert packed["widths"] == [32] and set(bucketed["widths"]) <= {32}
  # packing puts several examples in a row: more of each row carries loss
  assert packed["examples_per_stage"] > bucketed["examples_per_stage"]
  assert packed["loss_share"] > bucketed["loss_share"] > 0
  assert "| reversals | packed |" in sft_rows.table([packed, bucketed])
