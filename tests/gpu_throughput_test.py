"""Smoke test of bench.gpu.gpu_throughput: tiny shapes on CPU, one row of each kind, JSON checked.

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
  cmd = [
    sys.executable,
    "-m",
    "bench.gpu.gpu_throughput",
    "--smoke",
    "--profile",
    "--out",
    str(out),
    "--only",
    ",".join(JAX_ROWS),
  ]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads(out.read_text())
  assert data["benchmark"] == "gpu_throughput" and data["backend"] == "cpu"
  assert {"jax", "flax", "optax"} <= set(data["versions"]) and data["device"]
  assert data["command"].startswith("python -m bench.gpu.gpu_throughput --smoke --profile")
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
  assert rows["adamw"]["seconds_in_program"] > 0  # the device's time per update, no dispatch
  assert rows["fwdbwd:V1000"]["rows"] == 1000 and rows["fwdbwd:V1024"]["rows"] == 1024
  assert rows["trainer:acco"]["rows"] == 384  # the byte tokenizer's 257 ids, padded to 3 x 128
  for name in rows:
    assert name in data["table"] and name in proc.stdout
  assert data["targets"]["trainer/step acco (>= 0.98)"] is None  # step:acco was not run
  # --profile: the step row's 4 traced stages, kept beside the JSON, read on a CPU (no GPU kernels)
  profile = rows["step:zero1"]["profile"]
  assert profile["gpu_kernels"] == 0 and [s["stage"] for s in profile["stages"]] == [1, 2, 3, 4]
  assert Path(profile["trace"]) == tmp_path / "gpu_throughput_step_zero1.trace.json.gz"
  assert Path(profile["trace"]).exists() and "profile" not in rows["trainer:acco"]

  # --append: a second run adds its rows to the file and replaces the ones it measures again
  again = subprocess.run(
    cmd[:-1] + ["step:acco,adamw", "--append"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  merged = json.loads(out.read_text())
  assert [r["name"] for r in merged["rows"]] == [*JAX_ROWS, "step:acco"]
  assert merged["rows"][0] == data["rows"][0]  # kept as measured, with the command that did
  assert merged["rows"][-1]["command"].endswith("step:acco,adamw --append")
  assert merged["targets"]["trainer/step acco (>= 0.98)"] == pytest.approx(
    rows["trainer:acco"]["tokens_per_s"] / merged["rows"][-1]["tokens_per_s"]
  )
  # ... but only onto a run of the same setup, and it leaves the file as it was
  before = out.read_text()
  other = subprocess.run(
    cmd[:-1] + ["adamw", "--append", "--steps", "3"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert other.returncode != 0 and "another steps" in other.stderr, other.stderr[-2000:]
  assert out.read_text() == before


def test_targets_are_the_ratios_of_the_rows():
  from bench.gpu import gpu_throughput

  rate = lambda x: {"tokens_per_s": x}
  rows = {
    "trainer:zero1": {"tokens_per_s": 480.0, "mfu": 0.41},
    "step:zero1": rate(490.0),
    "trainer:acco": rate(450.0),
    "step:acco": rate(460.0),
    "torch:V50304": rate(424.0),
    "torch:V50257": rate(388.0),
  }
  rows["step:acco"]["profile"] = {"gpu_busy": 0.97}
  rows["trainer:zero1+cb"] = rate(500.0)
  t = gpu_throughput.summarise(rows)
  assert t["trainer/step zero1 (>= 0.98)"] == pytest.approx(480 / 490)
  assert t["trainer/step acco (>= 0.98)"] == pytest.approx(450 / 460)
  assert t["trainer acco/zero1 (>= 0.95)"] == pytest.approx(450 / 480)
  assert t["bare step GPU busy, acco (>= 0.99)"] == 0.97
  assert t["bare step GPU busy, zero1 (>= 0.99)"] is None  # not profiled
  assert t["command buffers on / off, trainer zero1"] == pytest.approx(500 / 480)
  assert t["trainer zero1/torch padded (>= 1.1)"] == pytest.approx(480 / 424)
  assert t["trainer zero1 MFU (>= 0.40)"] == 0.41
  key = "f32 x f32 GEMMs in the steps, xla attention's scores apart (== 0)"
  assert t[key] is None  # no hlo row
  hlo = lambda total, scores: {
    "gemms": {},
    "f32_gemms": total,
    "f32_gemms_outside_attention_scores": total - scores,
  }
  rows.update({"hlo:zero1": hlo(4, 4), "hlo:acco": hlo(9, 8)})
  assert gpu_throughput.summarise(rows)[key] == 1
