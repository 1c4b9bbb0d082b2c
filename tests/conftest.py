"""Test setup: 8 simulated CPU devices, set before the JAX backend starts; shared fixtures."""

import atexit
import importlib.util
import mmap
import os
import pathlib
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


def _jaxlib_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA defines ``flag`` (an unknown flag in XLA_FLAGS aborts the process)."""
  root = pathlib.Path(importlib.util.find_spec("jaxlib").origin).parent
  for lib in root.glob("*.so"):
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      if m.find(flag.encode()) >= 0:
        return True
  return False


# XLA:CPU's older elemental emitters for fusions instead of its MLIR fusion emitters: the same
# programs, compiled about a third faster (measured on tests/methods_test.py: 30 s -> 20 s). The
# same program in every process of a session (resume tests compare bits between processes);
# .ci/run's numerics rerun compiles with the default emitters.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
  if _jaxlib_knows("xla_cpu_use_fusion_emitters"):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
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


# Slow tests whose wall-clock timeouts a busy machine could trip (watchdogs that declare a peer
# dead or slow within seconds, a SIGTERM answered within a bound): .ci/run runs these one at a time
# (`-m "slow and serial" -n 0`), the other slow tests on the workers (`-m "slow and not serial"`):
# among them crash_resume_test, whose kills wait for events (a logged row, a checkpoint write on
# disk; a busy machine only makes writes longer), the benchmark smoke tests, whose timeouts are
# minutes above their runs, and the two-process runs of multiprocess_test and
# pipeline_multiprocess_test, which compare results, not times (their processes wait minutes for
# each other: dist.timeout_s 300 s at start-up, jax.distributed's heartbeats 100 s, XLA:CPU's
# collectives 900 s, a 240 s bound on a 15 s run).
SERIAL_MODULES = ("c4_test", "health_test", "preemption_test")
# The slow modules with the longest tests (half a minute to two minutes each on 2 cores), longest
# first: the slow run starts them first (the workers steal the short tests from each other's queues
# at the end), so that no long test starts last while the other workers have nothing left to run.
LONG_FIRST = (
  "crash_resume_test",
  "loco_store_train_test",
  "store_faults_bench_test",
  "loco_acco_test",
  "init_from_test",
  "pipeline_multiprocess_test",
  "preemption_multiprocess_test",
  "gpu_throughput_test",
  "loco_overlap_bench_test",
  "loco_train_test",
)


def _module(item) -> str:
  return item.module.__name__.split(".")[-1]


def pytest_collection_modifyitems(items):
  for item in items:
    if item.get_closest_marker("slow") and _module(item) in SERIAL_MODULES:
      item.add_marker(pytest.mark.serial)

  def rank(item):  # the same order in every worker (xdist checks), the rest as collected
    if not item.get_closest_marker("slow") or _module(item) not in LONG_FIRST:
      return len(LONG_FIRST)
    return LONG_FIRST.index(_module(item))

  items.sort(key=rank)
