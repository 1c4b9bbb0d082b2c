"""The compiled XLA:GPU schedule keeps ACCO's collectives in flight across the microbatch loops.

Two ways to get a GPU schedule, both through ``bench.gpu.overlap_gpu`` in a child process (the
``GPU_OVERLAP_FLAGS`` must be in ``XLA_FLAGS`` before the backend starts):

* compile-only (``--mode aot``), on any machine with the CUDA PJRT plugin installed
  (``pip install "jax-cuda12-pjrt==<jaxlib version>"``; ``.ci/run`` installs it): XLA:GPU compiles
  the stage for an abstract 8 x H100 topology. A small GPT keeps it quick; ZeRO-1 is the control
  (its collectives cannot bracket its loop, so the checker must say ``none``).
* on a real GPU (``JAX_PLATFORMS=cuda,cpu python -m pytest -q tests/overlap_gpu_test.py``): GPT-2
  124M on 8 devices; on fewer GPUs, mocked devices or else the abstract topology of the visible
  GPU's kind (compile only), and a skip naming the reasons if neither works.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from acco_jax import parallel
from tests import cuda_plugin

REPO = Path(__file__).resolve().parent.parent
HAS_PLUGIN = parallel.has_cuda_plugin()


def run_bench(tmp_path_factory, *args) -> dict:
  out = tmp_path_factory.mktemp("overlap") / "overlap_gpu.json"
  proc = subprocess.run(
    [sys.executable, "-m", "bench.gpu.overlap_gpu", "--out", str(out), *args],
    capture_output=True,
    text=True,
    timeout=1500,
    cwd=REPO,
  )
  print(proc.stdout[-6000:])
  assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(out.read_text())


def by_name(data: dict) -> dict:
  rows = {row["name"]: row for row in data["variants"]}
  for name, row in rows.items():
    assert row["result"] is not None, f"{name} did not compile: {row['attempts']}"
  return {name: row["result"] for name, row in rows.items()}


def check_async_pairs(schedule: dict) -> None:
  pairs = schedule["flat_pairs"]
  assert set(pairs) == {"reduce-scatter", "all-gather"}, schedule["pairs"]
  for kind, p in pairs.items():
    assert p["start"] < p["done"], kind
    assert not p["is_sync"], f"{kind} was converted to a synchronous collective"


def check_brackets(schedule: dict) -> None:
  """Reduce-scatter across loop A, all-gather across loop B, each start/done around its own."""
  assert schedule["verdict"] == "full", "\n".join(schedule["excerpt"])
  first, second = schedule["whiles"][:2]
  rs, ag = schedule["flat_pairs"]["reduce-scatter"], schedule["flat_pairs"]["all-gather"]
  assert rs["start"] < first < rs["done"] < second, (rs, schedule["whiles"])
  assert first < ag["start"] < second < ag["done"], (ag, schedule["whiles"])
  assert schedule["chain"]["all_gather_depends_on_reduce_scatter"]


# .ci/run installs the plugin after the README's test command and runs `pytest -m cuda_plugin`.
needs_plugin = cuda_plugin.NEEDS_PLUGIN
needs_gpu = [
  pytest.mark.gpu,
  pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a GPU: XLA:CPU runs collectives synchronously"
  ),
]


@pytest.fixture(scope="module")
def aot_schedules(tmp_path_factory):
  data = run_bench(
    tmp_path_factory,
    "--mode",
    "aot",
    "--target",
    "h100",
    "--model",
    "tiny",
    "--seq",
    "64",
    "--variants",
    "main,zero1",
  )
  assert data["mode"] == "aot" and data["target"] == "h100"
  return by_name(data)


@pytest.mark.cuda_plugin
@needs_plugin
def test_compile_only_acco_collectives_are_async_and_bracket_the_loops(aot_schedules):
  acco = aot_schedules["main"]
  assert acco["device_kind"].startswith("NVIDIA H100") and acco["device_count"] == 8
  check_async_pairs(acco)
  check_brackets(acco)
  assert len(acco["whiles"]) == 2


@pytest.mark.cuda_plugin
@needs_plugin
def test_compile_only_zero1_control_cannot_overlap(aot_schedules):
  """ZeRO-1 reduces after its only loop: the same checker finds nothing hidden."""
  zero1 = aot_schedules["zero1"]
  check_async_pairs(zero1)
  assert zero1["verdict"] == "none" and zero1["bracketing"] == []
  (loop,) = zero1["whiles"]
  assert all(p["start"] > loop for p in zero1["flat_pairs"].values())


@pytest.fixture(scope="module")
def gpu_schedule(tmp_path_factory):
  data = run_bench(tmp_path_factory, "--mode", "gpu")
  if data["status"].startswith("skipped"):
    pytest.skip(data["status"])
  return by_name(data)["main"]


@pytest.mark.parametrize("check", [check_async_pairs, check_brackets])
@needs_gpu[0]
@needs_gpu[1]
def test_on_gpu_gpt2(gpu_schedule, check):
  check(gpu_schedule)


@pytest.fixture(scope="module")
def aot_quantized(tmp_path_factory):
  data = run_bench(
    tmp_path_factory,
    "--mode",
    "aot",
    "--target",
    "h100",
    "--model",
    "tiny",
    "--seq",
    "64",
    "--variants",
    "acco-int8,zero1-int8",
  )
  return by_name(data)


@pytest.mark.cuda_plugin
@needs_plugin
def test_compile_only_quantized_acco_keeps_full_overlap(aot_quantized):
  """comm.quantize=int8: the int8 all-to-all (the reduce-scatter's replacement) is async and in
  flight across loop A, the int8 all-gather of the weight updates across loop B."""
  acco = aot_quantized["acco-int8"]
  assert acco["verdict"] == "full", "\n".join(acco["excerpt"])
  pairs = acco["flat_pairs"]
  assert set(pairs) == {"all-to-all", "all-gather"}, acco["pairs"]
  first, second = acco["whiles"]
  a2a, ag = pairs["all-to-all"], pairs["all-gather"]
  assert not a2a["is_sync"] and not ag["is_sync"]
  assert a2a["start"] < first < a2a["done"] < second < ag["done"] and first < ag["start"]
  assert acco["chain"]["all_gather_depends_on_reduce_scatter"]  # the all-to-all feeds the update


@pytest.mark.cuda_plugin
@needs_plugin
def test_compile_only_quantized_zero1_control_cannot_overlap(aot_quantized):
  zero1 = aot_quantized["zero1-int8"]
  assert zero1["verdict"] == "none" and set(zero1["flat_pairs"]) == {"all-to-all", "all-gather"}
  (loop,) = zero1["whiles"]
  assert all(p["start"] > loop for p in zero1["flat_pairs"].values())
