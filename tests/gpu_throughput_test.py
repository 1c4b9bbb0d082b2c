"""Smoke test of bench/gpu_throughput.py: tiny shapes on CPU, one row of each kind, JSON checked.

The PyTorch peer has its own test (tests/torch_peer_test.py, marker ``torch_peer``).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
JAX_ROWS = ("trainer:acco", "step:zero1", "fwdbwd:V1000", "fwdbwd:V1024", "adamw")

pytestmark = pytest.mark.slow


def test_smoke_measures_each_kind_of_row(tmp_path):
  out = tmp_path / "gpu_throughput.json"
  cmd = [sys.executable, str(REPO / "bench" / "gpu_throughput.py"), "--smoke", "--out", str(out),
         "--only", ",".join(JAX_ROWS)]  # fmt: skip
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads(out.read_text())
  assert data["benchmark"] == "gpu_throughput" and data["backend"] == "cpu"
  assert {"jax", "flax", "optax"} <= set(data["versions"]) and data["device"]
  assert data["command"].startswith("python bench/gpu_throughput.py --smoke")
  rows = {r["name"]: r for r in data["rows"]}
  assert list(rows) == list(JAX_ROWS)
  for name, r in rows.items():
    assert "error" not in r, (name, r)
    assert r["seconds_per_update"] > 0, name
    if name != "adamw":
      assert r["tokens_per_s"] == pytest.approx(r["tokens_per_update"] / r["seconds_per_update"])
    assert "peak_bytes" in r and "mfu" in r or name == "adamw", name
  # an update is 2 microbatches of 2 x 32 tokens (ACCO: two stages of one)
  for name in ("trainer:acco", "step:zero1"):
    assert rows[name]["tokens_per_update"] == 2 * 2 * 32, name
  assert rows["fwdbwd:V1000"]["rows"] == 1000 and rows["fwdbwd:V1024"]["rows"] == 1024
  assert rows["trainer:acco"]["rows"] == 384  # the byte tokenizer's 257 ids, padded to 3 x 128
  for name in rows:
    assert name in data["table"] and name in proc.stdout
  assert data["targets"]["trainer/step acco (>= 0.97)"] > 0
  assert data["targets"]["trainer/step zero1 (>= 0.97)"] is None  # its rows were not run
