"""Devices, meshes, multi-host start-up and XLA flag presets.

Everything here must run before or right after the JAX backend starts, so it is kept apart from the
algorithm. The data axis name lives here (:data:`DATA`) and is what every method uses by default.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import errors, optional

DATA = "data"

# Simulated devices share the host's cores: on a loaded 2-core machine one device can reach a
# collective a minute after the others (DeMo's first all-gather did), and XLA:CPU aborts the process
# after 40 s by default. Wait up to 15 minutes instead (train.py, the tests' and benchmarks' children).
PATIENT_CPU_COLLECTIVES = "--xla_cpu_collective_call_terminate_timeout_seconds=900"

# XLA:GPU flags for overlapping communication with compute (docs/benchmarks/dp.md, "GPU schedule", has
# the compiled schedules with and without each). The latency-hiding scheduler is off by default in
# XLA:GPU and is what lets an async reduce-scatter / all-gather stay in flight across a microbatch
# loop. Its default limit of one collective in flight keeps the all-gather out of loop B (the small
# psum of the stage's metrics after that loop would overlap it); a limit of 2 lets both hide. Starting
# collectives as early as possible stops the scheduler from starting the all-gather late once its
# cost model deems the latency covered (it did so for an A100 target).
GPU_OVERLAP_FLAGS = (
  "--xla_gpu_enable_latency_hiding_scheduler=true",
  "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
  "--xla_gpu_experimental_collective_start_as_early_as_possible=true",
  "--xla_gpu_enable_highest_priority_async_stream=true",
  "--xla_gpu_enable_command_buffer=",
  "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
  "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
  "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
)

# Compile-only GPU targets (XLA's GpuTargetConfigProto as text), from the vendors' public figures:
# enough for XLA to compile and schedule a program for N such GPUs on a machine without any GPU.
GPU_TARGETS = {
  "h100": dict(
    cc=(9, 0),
    sms=132,
    fpus=128,
    smem_sm=233472,
    smem_optin=232448,
    l2=52428800,
    bw=3352000000000,
    ghz=1.98,
    mem=85899345920,
    name="NVIDIA H100 80GB HBM3",
  ),
  "a100": dict(
    cc=(8, 0),
    sms=108,
    fpus=64,
    smem_sm=167936,
    smem_optin=166912,
    l2=41943040,
    bw=2039000000000,
    ghz=1.41,
    mem=85899345920,
    name="NVIDIA A100-SXM4-80GB",
  ),
}
# the H200: the H100's chip with more and faster memory (HBM3e)
GPU_TARGETS["h200"] = dict(
  GPU_TARGETS["h100"], bw=4800000000000, mem=150323855360, name="NVIDIA H200"
)


def gpu_target_config(target: str) -> str:
  """The text ``GpuTargetConfigProto`` of a named GPU (a key of :data:`GPU_TARGETS`)."""
  if target not in GPU_TARGETS:
    raise errors.UserValueError(
      f"unknown GPU target {target!r}; choose one of {sorted(GPU_TARGETS)}"
    )
  t = GPU_TARGETS[target]
  return (
    f"gpu_device_info {{ cuda_compute_capability {{ major: {t['cc'][0]} minor: {t['cc'][1]} }} "
    "threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
    f"shared_memory_per_block_optin: {t['smem_optin']} shared_memory_per_core: {t['smem_sm']} "
    f"threads_per_core_limit: 2048 core_count: {t['sms']} fpus_per_core: {t['fpus']} "
    "block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
    f"memory_bandwidth: {t['bw']} l2_cache_size: {t['l2']} clock_rate_ghz: {t['ghz']} "
    f"device_memory_size: {t['mem']} registers_per_core_limit: 65536 "
    'registers_per_block_limit: 65536 } platform_name: "CUDA" '
    f'dnn_version_info {{ major: 9 minor: 8 }} device_description_str: "{t["name"]}"'
  )


def has_cuda_plugin() -> bool:
  """Whether a CUDA PJRT plugin is installed (found without importing it or starting a backend).

  ``False``, not an error, when the ``jax_plugins`` namespace itself is missing (no plugin at all).
  """
  return any(optional.installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13))


def gpu_aot_devices(num_devices: int, target: str = "h100", hosts: int = 1) -> list:
  """Devices of an abstract ``hosts`` x ``num_devices/hosts`` GPU topology, to compile for.

  No GPU is needed, only the CUDA PJRT plugin (``pip install jax-cuda12-pjrt==<jaxlib version>``,
  a part of ``jax[cuda12]``). A mesh over these devices lowers and compiles like a real one (set
  :data:`GPU_OVERLAP_FLAGS` in ``XLA_FLAGS`` first); nothing can run on them.
  """
  from jax.experimental import topologies

  if not has_cuda_plugin():
    raise errors.UserRuntimeError(
      "compiling for a GPU target needs the CUDA PJRT plugin: "
      'pip install "jax-cuda12-pjrt==<your jaxlib version>"'
    )
  if num_devices % hosts:
    raise errors.UserValueError(f"{num_devices} devices do not split over {hosts} hosts")
  topo = topologies.get_topology_desc(
    f"{target}x{num_devices}",
    "cuda",
    target_config=gpu_target_config(target),
    topology=f"1x{hosts}x{num_devices // hosts}",
  )
  return list(topo.devices)


def _add_xla_flags(flags) -> None:
  current = os.environ.get("XLA_FLAGS", "")
  names = {f.split("=")[0] for f in current.split()}
  extra = [f for f in flags if f.split("=")[0] not in names]  # the user's own settings win
  os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()


# XLA flags the project sets or the tests pass (8 simulated devices, an optimisation level):
# not probed by :func:`check_xla_flags`
_OWN_FLAGS = frozenset(
  [f.split("=")[0] for f in GPU_OVERLAP_FLAGS]
  + ["--xla_force_host_platform_device_count", "--xla_backend_optimization_level"]
)


def check_xla_flags(*, remember_in: str | None = None) -> None:
  """Raises :class:`~acco_jax.errors.UserError` when ``XLA_FLAGS`` would end the process.

  XLA ends the process on an unknown flag or a value it cannot parse, with its own log line, when
  the backend starts: before Python can catch anything. Unless every flag is one of the project's
  own, the backend is started first in a CPU-only child process (about a second), so that a typo
  is a one-line error. A setting that passed is remembered in ``remember_in`` (the compilation
  cache's directory; None: not remembered), keyed by the jaxlib and the flags: the next launch with
  the same flags skips the child. Call it before the backend starts.
  """
  given = os.environ.get("XLA_FLAGS", "").split()
  if all(f.split("=")[0] in _OWN_FLAGS for f in given):
    return
  passed = None
  if remember_in:
    try:
      jaxlib = [importlib.metadata.version("jaxlib"), importlib.util.find_spec("jaxlib").origin]
    except (ImportError, AttributeError, ValueError):  # no jaxlib to name: probe every time
      jaxlib = None
    if jaxlib:
      key = hashlib.sha256(json.dumps([*jaxlib, *sorted(given)]).encode()).hexdigest()[:20]
      passed = os.path.join(remember_in, "xla-flags-passed", key)
      if os.path.exists(passed):
        return
  probe = subprocess.run(
    [sys.executable, "-c", "import jax; jax.devices()"],
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  if probe.returncode:
    reason = [line for line in probe.stderr.splitlines() if "XLA_FLAGS" in line]
    reason = reason[-1].split("] ", 1)[-1] if reason else probe.stderr.strip()[-300:]
    raise errors.UserError(f"{reason}: remove or correct it in the XLA_FLAGS environment variable")
  if passed:
    try:
      os.makedirs(os.path.dirname(passed), exist_ok=True)
      with open(passed, "w") as f:
        f.write(" ".join(given) + "\n")
    except OSError:  # an unwritable cache: probe again next time
      pass


def configure_platform(*, cpu_devices: int = 0, gpu_overlap: bool = True) -> None:
  """Sets XLA flags; call before the first JAX operation (train.py does).

  Args:
    cpu_devices: if > 0, the host (CPU) platform exposes this many devices (simulated data
      parallelism on one machine; it does nothing on GPU, where the GPUs are the devices).
    gpu_overlap: add :data:`GPU_OVERLAP_FLAGS` (read by XLA:GPU only; harmless elsewhere).
  """
  if cpu_devices > 0:
    _add_xla_flags(
      [f"--xla_force_host_platform_device_count={cpu_devices}", PATIENT_CPU_COLLECTIVES]
    )
  if gpu_overlap:
    _add_xla_flags(GPU_OVERLAP_FLAGS)


def initialize_distributed(
  mode: str = "auto",
  *,
  coordinator_address: str = "",
  num_processes: int = 0,
  process_id: int = -1,
  timeout_s: int = 300,
  heartbeat_timeout_s: int = 0,
) -> bool:
  """Starts ``jax.distributed`` for multi-host runs. Returns whether it was initialised.

  Args:
    mode: ``'off'`` (single process), ``'auto'`` (initialise when a cluster environment is detected:
      SLURM with more than one task, or ``JAX_COORDINATOR_ADDRESS`` set; JAX reads the rest), or
      ``'on'`` (always; with the explicit arguments below when given).
    coordinator_address: ``host:port`` of process 0.
    num_processes: total processes.
    process_id: this process's index.
    timeout_s: how long to wait for all processes to join.
    heartbeat_timeout_s: after how long without heartbeats ``jax.distributed`` declares a process
      dead and aborts every process (0: JAX's default, 100 s in jax 0.10.2). ``train.py`` keeps it
      above ``health.hang_timeout_s``, so that the watchdog, which writes the verdict, fires first.
  """
  if mode not in ("auto", "on", "off"):
    raise errors.UserValueError(f"dist.initialize must be 'auto', 'on' or 'off', got {mode!r}")
  if mode == "off":
    return False
  in_slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
  explicit = bool(coordinator_address)
  if mode == "auto" and not (in_slurm or explicit or os.environ.get("JAX_COORDINATOR_ADDRESS")):
    return False
  kwargs = {"initialization_timeout": timeout_s}
  if heartbeat_timeout_s > 0:
    kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s)
  if not explicit and (num_processes > 0 or process_id >= 0):  # JAX reads only the address
    kwargs.update(
      num_processes=num_processes or None, process_id=None if process_id < 0 else process_id
    )
  if explicit:
    if num_processes < 1 or process_id < 0:
      raise errors.UserValueError(
        "dist.coordinator_address needs dist.num_processes >= 1 and dist.process_id >= 0 as well"
      )
    kwargs.update(
      coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    if process_id > 0:  # process 0 serves the coordinator; JAX aborts if it cannot reach it
      _wait_for_coordinator(coordinator_address, timeout_s)
  try:
    jax.distributed.initialize(**kwargs)
  except ValueError as e:  # JAX found no cluster environment to fill in what is missing
    raise errors.UserValueError(
      f"jax.distributed.initialize: {e} Set dist.coordinator_address, dist.num_processes and "
      "dist.process_id, or launch under SLURM; dist.initialize=off runs a single process"
    ) from None
  return True


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Returns once something listens at ``address``; raises a one-line error after ``timeout_s``.

  Without it, a process that cannot reach the coordinator dies in XLA's client (a C++ check failure
  that blames "another task"), with no Python exception.
  """
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise errors.UserValueError(f"dist.coordinator_address={address!r} must be host:port")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), max(min(timeout_s, 5), 0.1)):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise errors.UserTimeoutError(
          f"dist.coordinator_address={address}: no coordinator answered in {timeout_s} s ({e}); "
          "start process 0 (it serves the coordinator), or fix the address or dist.timeout_s"
        ) from None
      time.sleep(0.2)


def make_mesh(num_devices: int = 0, axis: str = DATA) -> jax.sharding.Mesh:
  """A 1-D mesh over ``num_devices`` devices (0 = all), ordered so that each process's devices are
  contiguous (process-local batches then map to contiguous global rows)."""
  if num_devices < 0:
    raise errors.UserValueError(
      f"mesh.num_devices={num_devices} must be >= 0 (0 = all visible devices)"
    )
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if num_devices:
    if num_devices > len(devices):
      raise errors.UserValueError(
        f"mesh.num_devices={num_devices} but only {len(devices)} devices are visible; "
        "on CPU set mesh.cpu_devices (simulated devices) or lower mesh.num_devices"
      )
    if jax.process_count() > 1 and num_devices != len(devices):
      raise errors.UserValueError("multi-host runs must use all devices (mesh.num_devices=0)")
    devices = devices[:num_devices]
  return jax.sharding.Mesh(np.array(devices), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


def global_batch(
  local_batch: dict, mesh: jax.sharding.Mesh, axis: str = DATA, whole: bool = False
) -> dict:
  """Process-local rows -> global arrays sharded over ``axis`` (rows concatenated over processes);
  with ``whole`` every process holds the whole global batch and each device takes its part."""
  sharding = NamedSharding(mesh, P(axis))

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(sharding, x, x.shape if whole else None)

  return jax.tree.map(put, local_batch)
