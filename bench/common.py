"""Shared helpers of the benchmarks: device-count subprocesses, machine info, tables and JSON.

The benchmarks are modules, run from the repository root: ``python -m bench.dp.memory``. XLA reads
``--xla_force_host_platform_device_count`` once, when the backend starts, so a benchmark that needs
several simulated device counts runs each in its own Python process: :func:`run_worker` starts the
benchmark's module again (``python -m <module> --worker ...``, the module named by its
``__spec__.name``, which is its dotted name also when it runs as ``__main__``) with the device count
set in ``XLA_FLAGS``, and reads back the JSON the worker wrote.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def module_command(module: str, *args: str) -> list[str]:
  """``python -m module *args`` with this interpreter (:func:`child_env` finds the module)."""
  return [sys.executable, "-m", module, *args]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
  """``env`` (default: this process's environment) with this checkout first on ``PYTHONPATH``, so
  a child started by :func:`module_command` imports this checkout's ``bench``, ``acco_jax`` and
  ``configs`` whatever its working directory."""
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def cpu_env(num_devices: int) -> dict[str, str]:
  """The environment for a child process with ``num_devices`` simulated CPU devices
  (:func:`child_env`'s, so it finds the benchmark modules)."""
  from acco_jax.parallel import PATIENT_CPU_COLLECTIVES

  env = child_env()
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT_FLAG)]
  patience = PATIENT_CPU_COLLECTIVES.split("=")[0]
  if not any(f.startswith(patience) for f in flags):  # the user's own setting wins
    flags.append(PATIENT_CPU_COLLECTIVES)
  env["XLA_FLAGS"] = " ".join([*flags, f"{_COUNT_FLAG}={num_devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  return env


def run_worker(module: str, num_devices: int, args: list[str], timeout: float) -> dict:
  """Runs ``python -m module --worker <out.json> *args`` on ``num_devices`` CPU devices; returns
  its JSON. A benchmark passes its own ``__spec__.name``.

  The child's stderr passes through (progress lines); a non-zero exit or a timeout raises with the
  tail of its output so the failure is visible in the benchmark's own output.
  """
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "worker.json"
    cmd = module_command(module, "--worker", str(out), *args)
    start = time.perf_counter()
    try:
      proc = subprocess.run(
        cmd, env=cpu_env(num_devices), timeout=timeout, stdout=subprocess.PIPE, text=True
      )
    except subprocess.TimeoutExpired as e:
      raise RuntimeError(
        f"worker with {num_devices} devices timed out after {timeout:.0f} s"
      ) from e
    if proc.returncode != 0:
      raise RuntimeError(
        f"worker with {num_devices} devices failed (exit {proc.returncode}) after "
        f"{time.perf_counter() - start:.0f} s; stdout tail:\n{proc.stdout[-2000:]}"
      )
    return json.loads(out.read_text())


def machine() -> dict:
  """A short description of the host and the software versions."""
  import jax

  mem_gib = None
  try:
    with open("/proc/meminfo") as f:
      kib = int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1))
    mem_gib = round(kib / 2**20, 1)
  except (OSError, AttributeError):
    pass
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      m = re.search(r"model name\s*:\s*(.+)", f.read())
    if m:
      cpu = m.group(1).strip()
  except OSError:
    pass
  return {
    "cpu": cpu,
    "arch": platform.machine(),
    "cores": os.cpu_count(),
    "mem_gib": mem_gib,
    "python": platform.python_version(),
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "loadavg_1m_at_end": loadavg(),
  }


def loadavg() -> float:
  """The 1-minute load average (other jobs on a shared machine show up here)."""
  return round(os.getloadavg()[0], 2)


def shard_bytes(tree) -> int:
  """Bytes of one device's addressable shard of every leaf (``ShapeDtypeStruct`` with shardings).

  A replicated leaf counts fully, a leaf sharded N ways counts 1/N (``sharding.shard_shape``).
  """
  import jax

  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize
  return total


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
  """A GitHub-markdown table of ``rows`` (dicts) with ``columns`` as ``(key, header)`` pairs."""
  cells = [[str(r.get(k, "")) for k, _ in columns] for r in rows]
  head = [h for _, h in columns]
  widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
  line = lambda vals: (
    "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True)) + " |"
  )
  sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
  return "\n".join([line(head), sep, *(line(c) for c in cells)])


def write_json(path: Path, data: dict) -> Path:
  """Writes ``data`` to ``path`` whole or not at all (a temporary file, then a rename)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.tmp")
  tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
  os.replace(tmp, path)
  return path


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


# -- the drivers' shared loops: workers per setting, a training run, the report -------------------


def run_each(module: str, label: str, items: list, worker_args, num_devices, timeout: float):
  """``run_worker`` once per item (``worker_args(item)``, ``num_devices(item)``): the runs that
  finished, each with its ``wall_s``, and ``{'item', 'error'}`` for those that failed."""
  runs, failures = [], []
  for item in items:
    log(f"{label}: {item} on {num_devices(item)} CPU devices ...")
    start = time.perf_counter()
    try:
      run = run_worker(module, num_devices(item), worker_args(item), timeout)
    except RuntimeError as e:
      log(f"{label}: {item} failed: {e}")
      failures.append({"item": item, "error": str(e)})
      continue
    run["wall_s"] = round(time.perf_counter() - start, 1)
    runs.append(run)
  return runs, failures


def finish_runs(
  out: Path,
  result: dict,
  runs: list,
  failures: list,
  report: str,
  *,
  name_of,
  psi_of,
  started: float,
  load_start,
) -> int:
  """Prints the table ``report``, one line per run (``name_of(run)``, its parameters
  ``psi_of(run)``, wall time and peak RSS) and per failure, and the load; writes ``result`` with
  the runs, their rows and the table to ``out``. The exit status: 1 when a run failed."""
  print(report)
  for run in runs:
    print(
      f"{name_of(run)}: Ψ = {psi_of(run):,}; worker wall {run['wall_s']} s, "
      f"peak RSS {run['max_rss_bytes'] / 2**30:.2f} GiB"
    )
  for f in failures:
    print(f"{f['item']} FAILED: {f['error']}")
  print(f"1-min load average: {load_start} at start, {loadavg()} at end")
  write_json(
    out,
    {
      **result,
      "wall_s": round(time.perf_counter() - started, 1),
      "runs": [{k: v for k, v in run.items() if k != "rows"} for run in runs],
      "failures": failures,
      "rows": [r for run in runs for r in run["rows"]],
      "table": report,
    },
  )
  print(f"wrote {out}")
  return 1 if failures else 0


def train_run(config, workdir, result: dict, start: float) -> dict:
  """``trainer.train_and_evaluate`` of ``config`` in ``workdir``: ``result`` with the status, the
  final eval loss (NaN for a run that diverged: what it logged is kept), the wall time and the
  config, written to ``workdir/result.json``; the checkpoints are removed.

  A run a signal stopped (SIGTERM, SIGINT: the trainer checkpoints and returns early) is not a
  result: it exits with a one-line error, writes no ``result.json`` and keeps its checkpoint."""
  from acco_jax.run import trainer

  try:
    summary = trainer.train_and_evaluate(config, str(workdir))
    if "stopped" in summary:
      raise SystemExit(
        f"{workdir}: stopped by a signal at stage {summary['stopped']}: no result.json written"
      )
    result.update(status="ok", final_eval_loss=summary.get("eval_loss"), summary=summary)
  except FloatingPointError as e:  # non-finite loss: the run diverged
    result.update(status="diverged", error=str(e), final_eval_loss=float("nan"))
  result["wall_s"] = time.perf_counter() - start
  result["config"] = json.loads(config.to_json_best_effort())
  shutil.rmtree(Path(workdir) / "checkpoints", ignore_errors=True)
  write_json(Path(workdir) / "result.json", result)
  return result


def write_report(out: Path, stem: str, results: dict, text: str, failed: list[str]) -> int:
  """``<stem>.json`` and ``<stem>.md`` (the table ``text``) in ``out``; the exit status (1 when a
  run failed)."""
  path = write_json(out / f"{stem}.json", results)
  (out / f"{stem}.md").write_text(text + "\n")
  log(f"wrote {path} and {stem}.md:\n{text}")
  if failed:
    log(f"{len(failed)} runs failed: {', '.join(failed)}")
  return 1 if failed else 0


def abstract_stage(cfg, tx, devices, k: int, rows: int, seq: int | None = None):
  """(jitted stage, abstract args, train step): the stage of method transform ``tx`` for the model
  of ``cfg`` over ``devices`` (real or abstract), ``k`` microbatches of ``rows`` x ``seq`` tokens
  (default ``cfg.L``) per device, for :meth:`jax.stages.Wrapped.lower` without any array
  (parameters and state as shapes)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import acco_jax
  from acco_jax import model

  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  loss = lambda p, b: model.loss_fn(p, cfg, b)
  train = acco_jax.make_train_step(loss, tx, mesh, num_microbatches=k, params=shapes, has_aux=True)
  state = train.abstract_state(shapes)
  fn = train.stage_program("delayed" if train.plan.delayed else "sync", state)
  data = NamedSharding(train.mesh, P("data"))
  n = len(devices)
  seq = cfg.L if seq is None else seq
  batch = {
    key: jax.ShapeDtypeStruct((n * k * rows, seq), jnp.int32, sharding=data)
    for key in ("inputs", "targets")
  }
  return fn, (state, batch), train
