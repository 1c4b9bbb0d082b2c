"""Smoke tests of the Hugging Face benchmarks on tiny presets, in this process (their command
lines answer --help in tests/bench_commands_test.py): bench/run/hf_load_memory.py's measurement
and bench/gpu/large_memory.py's (the CUDA PJRT plugin: .ci/run's second step)."""

import pytest

from bench.gpu import large_memory
from bench.run import hf_load_memory
from tests import cuda_plugin


def test_load_memory_smoke(tmp_path):
  directory = str(tmp_path / "ckpt")
  file_bytes = hf_load_memory.write_checkpoint("tiny", "float32", directory)
  for mode in ("loader", "contrast"):
    r = hf_load_memory.child(directory, mode)
    assert r["placed_bytes"] == pytest.approx(file_bytes, rel=0.01)  # float32 in, float32 out
    assert r["peak_bytes"] >= 0  # in this warm process a tiny load may add no page


@cuda_plugin.NEEDS_PLUGIN
@pytest.mark.cuda_plugin
def test_large_memory_smoke():
  from acco_jax import parallel

  devices = parallel.gpu_aot_devices(2, "h100")
  r = large_memory.measure("llama-tiny", large_memory.SMOKE["llama-tiny"], "acco", devices, "h100")
  assert r["params"] > 0 and r["devices"] == 2
  assert r["argument_gb"] >= r["state_formula_gb"] > 0 and r["total_gb"] > r["argument_gb"]
  assert "| llama-tiny | acco |" in large_memory.table([r])


@pytest.mark.slow
def test_sft_memory_smoke(tmp_path):
  """bench/run/sft_memory.py on the tiny preset, 1 device: a measured peak and a prediction."""
  from bench.run import sft_memory

  (r,) = sft_memory.measure("", None, 14e9, smoke=True)
  assert r["returncode"] == 0 and not r["over_limit"], r["tail"]
  assert r["peak_bytes"] > 0.1e9 and r["predicted_host_bytes"] > 0.1e9
