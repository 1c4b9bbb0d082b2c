"""Streaming DiLoCo's outer all-reduce is in flight across the inner step in the compiled XLA:GPU
schedule (compile only, for an abstract 2 x 4 H100 machine; needs the CUDA PJRT plugin, which
``.ci/run`` installs after the README's test command). The control, the same fragment synced with
no overlap (``τ = 0``), has no inner step to hide behind.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cuda_plugin

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
  out = tmp_path_factory.mktemp("loco_overlap") / "loco_overlap_gpu.json"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "bench.gpu.loco_overlap_gpu",
      "--model",
      "tiny",
      "--layers",
      "4",
      "--seq",
      "64",
      "--out",
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=REPO,
  )
  print(proc.stdout[-3000:])
  assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
  return {r["program"]: r for r in json.loads(out.read_text())["results"]}


@pytest.mark.cuda_plugin
@cuda_plugin.NEEDS_PLUGIN
def test_outer_all_reduce_brackets_the_inner_step_and_the_control_does_not(schedules):
  window, sync = schedules["window"], schedules["sync"]
  assert window["device_kind"].startswith("NVIDIA H100")
  (pair,) = window["worker_all_reduces"]  # the fragment's mean, one all-reduce over the workers
  assert not pair["is_sync"]
  assert any(pair["start"] < w < pair["done"] for w in window["whiles"]), window
  assert window["verdict"] == "full"
  (control,) = sync["worker_all_reduces"]
  assert sync["whiles"] == [] and sync["verdict"] == "none"
  assert control["bytes"] == pair["bytes"]  # the same fragment, the same bytes
