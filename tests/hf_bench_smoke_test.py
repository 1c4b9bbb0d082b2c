"""Smoke tests of the Hugging Face benchmarks: bench/run/hf_load_memory.py (slow: two processes)
and bench/gpu/large_memory.py (the CUDA PJRT plugin: .ci/run's second step), on tiny presets."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cuda_plugin

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, out: Path, *args) -> dict:
  cmd = [sys.executable, str(REPO / "bench" / script), "--smoke", "--out", str(out), *args]
  result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  return json.loads(out.read_text())


@pytest.mark.slow
def test_load_memory_smoke(tmp_path):
  data = _run("run/hf_load_memory.py", tmp_path / "m.json", "--contrast")
  rows = {r["mode"]: r for r in data["rows"]}
  assert set(rows) == {"loader", "contrast"}
  for r in rows.values():  # float32 weights become float32 parameters of the same bytes
    assert r["placed_bytes"] == pytest.approx(r["file_bytes"], rel=0.01)
    assert r["peak_bytes"] > 0 and r["peak_over_file"] == r["peak_bytes"] / r["file_bytes"]


@cuda_plugin.NEEDS_PLUGIN
@pytest.mark.cuda_plugin
def test_large_memory_smoke(tmp_path):
  # one compile (the four of the smoke preset take a minute): the script's path, not the models
  data = _run(
    "gpu/large_memory.py", tmp_path / "m.json", "--presets", "llama-tiny", "--methods", "acco"
  )
  rows = data["rows"]
  assert [(r["preset"], r["method"]) for r in rows] == [("llama-tiny", "acco")]
  for r in rows:  # the state is the arguments but the batch, as the formula says
    assert r["argument_gb"] >= r["state_formula_gb"] > 0 and r["total_gb"] > r["argument_gb"]
