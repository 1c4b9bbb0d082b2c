"""JAX's persistent compilation cache, on by default for every run (``compile.cache_dir``).

A restarted run (a resume after a fault, a SIGKILLed run's rerun, an HDEE job after its parent, an
elastic restart) compiles the programs that it or a run before it compiled minutes ago; with the
cache it loads them from disk instead, so the first step after a restore costs seconds, not a
compile.

What keys an entry. JAX hashes, for each program: the program itself (its StableHLO, so any change
of model, shapes, method, mesh size or hyperparameter that the program bakes in), the jaxlib
version, the backend's platform version, ``XLA_FLAGS`` (``--xla_cpu_max_isa`` included), the
compile options (device count and assignment, partitioning) and the compression. A changed program
therefore never reuses a stale entry. Two things JAX's key leaves out are in the directory's name
instead: the devices' platform and kind (``gpu-NVIDIA_H100_80GB_HBM3``, ``cpu``) and, on CPUs, a
hash of the processor's feature flags, so a home directory shared by machines of other kinds keeps
their executables apart.

Size. The directory is bounded (``max_bytes``, 8 GB): when a process points the cache at it, the
least recently written entries beyond the bound are deleted, once. JAX's own bound
(``jax_compilation_cache_max_size``) is left off: with it, every entry JAX writes scans and stats
the whole directory under a file lock, so a session's thousands of small programs (every eager op
of a test, every tiny run's helpers) cost a time quadratic in the entries: the test suite ran
several times slower with it on.

Several processes. Every process of a multi-process run reads the cache; JAX writes only from
process 0. On CPU (jax 0.10.2) the other processes never hit it: JAX's key includes the devices'
topology fingerprint, which differs between the processes of one job, so every process but 0
compiles every program at every launch and restart (measured with 3 processes: 19 hits on process 0,
19 misses each on 1 and 2, 39-42 s of compiles; docs/benchmarks/loco.md). GPU jobs were not
measured. Runs that are independent of each other (two jobs on one host) may write the same entry at
once (the same bytes: compilation is deterministic); an entry that cannot be read is reported by JAX
as a warning and compiled anew.

An unwritable directory costs one warning line; the run goes on without the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

DEFAULT_MAX_BYTES = 8 << 30  # the least recently written entries are deleted beyond this


def default_dir() -> str:
  """``$JAX_COMPILATION_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/acco_jax/xla`` (default
  ``~/.cache/acco_jax/xla``)."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "acco_jax", "xla")


def base_dir(cache_dir: str) -> str | None:
  """The directory that ``compile.cache_dir`` names (``auto``: :func:`default_dir`; ``''``: None),
  absolute, ``~`` expanded. The executables go in a subdirectory per :func:`machine_tag`."""
  if not cache_dir:
    return None
  base = default_dir() if cache_dir == "auto" else os.path.expanduser(cache_dir)
  return os.path.abspath(base)


def machine_tag() -> str:
  """The devices' platform and kind, and on CPUs a hash of the processor's feature flags."""
  device = jax.devices()[0]
  tag = device.platform
  if device.platform != "cpu":
    tag += "-" + re.sub(r"[^A-Za-z0-9.]+", "_", device.device_kind).strip("_")
  else:
    try:
      with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
      flags = ""
    if flags:
      tag += "-" + hashlib.sha256(flags.encode()).hexdigest()[:12]
  return tag


def _writable(path: str) -> str | None:
  """None when ``path`` can be created and written, else the reason."""
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
      pass
  except OSError as e:
    return e.strerror or str(e)
  return None


def configure(cache_dir: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> str | None:
  """Points JAX's persistent compilation cache at ``cache_dir`` for this process.

  Call it before the first compilation and after the backend can start (it reads the device
  kind). Calling it again with the same setting does nothing; another directory takes effect for
  the programs compiled after it.

  Args:
    cache_dir: ``auto`` (:func:`default_dir`), a path (``~`` expanded), or ``''`` (off: no cache
      for this process).
    max_bytes: the cache's size bound: the least recently written entries beyond it are deleted
      now (:func:`prune`).

  Returns:
    The directory the cache uses (``cache_dir`` / :func:`machine_tag`), or None when it is off.
  """
  base = base_dir(cache_dir)
  if base is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  path = os.path.join(base, machine_tag())
  if jax.config.jax_compilation_cache_dir == path and jax.config.jax_enable_compilation_cache:
    return path
  reason = _writable(path)
  if reason is not None:
    print(
      f"warning: compile cache off: cannot write {path} ({reason}); set "
      "--config.compile.cache_dir to a writable directory, or '' to turn it off",
      file=sys.stderr,
      flush=True,
    )
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  prune(path, max_bytes)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_compilation_cache_max_size", -1)  # no scan of the directory per entry
  # every program, not only those over a second: a CPU step compiles in under one
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax_cache.reset_cache()  # the next compilation opens the cache at ``path``
  return path


def prune(path: str, max_bytes: int) -> int:
  """Deletes the least recently written files of the cache directory ``path`` until the rest fit
  in ``max_bytes``; returns the bytes deleted. A file another process deletes first is skipped."""
  entries = []
  with os.scandir(path) as it:
    for entry in it:
      try:
        if entry.is_file() and not entry.name.startswith("."):
          stat = entry.stat()
          entries.append((stat.st_mtime, stat.st_size, entry.path))
      except OSError:
        continue
  total, freed = sum(size for _, size, _ in entries), 0
  for _, size, file in sorted(entries):
    if total - freed <= max_bytes:
      break
    try:
      os.remove(file)
      freed += size
    except OSError:
      continue
  return freed
