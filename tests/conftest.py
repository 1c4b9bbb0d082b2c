"""Test setup: 8 simulated CPU devices, set before the JAX backend starts; shared fixtures."""

import atexit
import os
import shutil
import socket
import tempfile

import pytest

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU's LLVM backend without optimisation: the same HLO programs, compiled about 30% faster
# (most of the suite's time is compiling); .ci/run reruns the numerics-heavy files at the default
# level. Pass --xla_backend_optimization_level=N in XLA_FLAGS to choose another.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compilation cache for the session and the processes it starts: a resume test compiles
# the same programs for each of its runs, and compiling is most of their time on a CPU. Removed at
# the end, so every session starts cold.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="acco_jax_xla_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.fixture
def no_network(monkeypatch):
  """Every socket connection and DNS lookup fails at once (as offline, without the wait)."""

  def refuse(*args, **kwargs):
    raise OSError("network access is disabled in tests")

  monkeypatch.setattr(socket, "getaddrinfo", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)
  monkeypatch.setattr(socket.socket, "connect", refuse)


# Slow tests that start processes of their own and wait on them with wall-clock timeouts (watchdogs,
# kills, multi-process runs, benchmark scripts): .ci/run runs these one at a time
# (`-m "slow and serial" -n 0`), the other slow tests on the two workers (`-m "slow and not serial"`).
SERIAL_MODULES = (
  "bench_smoke_test", "c4_test", "convergence_smoke_test", "crash_resume_test",
  "gpu_throughput_test", "health_test", "multiprocess_test", "pipeline_multiprocess_test",
  "loco_overlap_bench_test", "preemption_test",
)  # fmt: skip


def pytest_collection_modifyitems(items):
  for item in items:
    if item.get_closest_marker("slow") and item.module.__name__.split(".")[-1] in SERIAL_MODULES:
      item.add_marker(pytest.mark.serial)
