"""GPU only: the compiled ACCO stage keeps its collectives asynchronous around the microbatch loop.

Runs ``bench/overlap_gpu.py`` (GPT-2 124M, 8-device data mesh, mocked devices on fewer GPUs, the
``GPU_OVERLAP_FLAGS`` set before the backend starts, so in a child process) and reads its JSON. Run
with the GPU visible, e.g. ``JAX_PLATFORMS=cuda,cpu python -m pytest -q tests/overlap_gpu_test.py``
(``tests/conftest.py`` otherwise defaults the platform to CPU and these tests skip).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a GPU: XLA:CPU runs collectives synchronously"
  ),
]


@pytest.fixture(scope="module")
def schedule(tmp_path_factory):
  out = tmp_path_factory.mktemp("overlap") / "overlap_gpu.json"
  proc = subprocess.run(
    [sys.executable, str(REPO / "bench" / "overlap_gpu.py"), "--out", str(out)],
    capture_output=True, text=True, timeout=1500, cwd=REPO,
  )  # fmt: skip
  print(proc.stdout[-6000:])
  assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads(out.read_text())
  assert data["result"] is not None, f"no schedule: {data['attempts']}"
  assert data["result"]["backend"] == "gpu"
  return data["result"]


def test_flat_collectives_are_async_and_not_sync(schedule):
  pairs = schedule["flat_pairs"]
  assert set(pairs) == {"reduce-scatter", "all-gather"}, schedule["pairs"]
  assert len(schedule["whiles"]) >= 1, "no microbatch while loop in the entry computation"
  for kind, p in pairs.items():
    assert p["start"] < p["done"], kind
    assert not p["is_sync"], f"{kind} was converted to a synchronous collective"


def test_communication_brackets_the_microbatch_loop(schedule):
  """At least one of the reduce-scatter / all-gather is in flight across the loop."""
  assert schedule["bracketing"], "neither collective brackets the microbatch loop:\n" + "\n".join(
    schedule["excerpt"]
  )


def test_both_collectives_bracket_the_loop(schedule):
  """The stage runs two microbatch loops: the reduce-scatter over the first, the all-gather over
  the second (acco_jax/step.py). On GPU each async pair should straddle one of them."""
  assert schedule["verdict"] == "full", "\n".join(schedule["excerpt"])
  assert schedule["chain"]["all_gather_depends_on_reduce_scatter"]
