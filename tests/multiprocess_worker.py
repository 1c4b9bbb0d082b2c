"""One process of the multi-process ACCO check (``tests/multiprocess_test.py``); the shared problem.

Run as a script, it joins a ``jax.distributed`` job (gloo CPU collectives on localhost), feeds only
its process-local rows through :func:`acco_jax.parallel.global_batch` and writes the per-stage
losses and the final committed parameters (process 0 only)::

  python tests/multiprocess_worker.py --process-id 0 --num-processes 2 --local-devices 4 \
      --port 12345 --out /tmp/p0.npz

Imported, :func:`run` gives the same trajectory in one process (the test's 8-device reference). The
problem is a small MLP regression (sizes not divisible by 8, to exercise the flat layout's padding)
trained by ACCO over AdamW with global-norm clipping, whose norm is a cross-process all-reduce.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

NUM_DEVICES = 8  # global data-parallel width, both layouts
K = 2  # microbatches per device per stage
B = 2  # rows per microbatch
STAGES = 6  # 3 ACCO updates (estimate + commit)


def init_params(seed: int = 0) -> dict:
  r = np.random.default_rng(seed)
  f32 = lambda x: np.asarray(x, np.float32)
  return {
    "hidden": {"kernel": f32(r.normal(size=(5, 7)) * 0.5), "bias": f32(np.zeros(7))},
    "out": {"kernel": f32(r.normal(size=(7, 3)) * 0.5), "bias": f32(np.zeros(3))},
  }


def _rows(r, n: int) -> dict:
  x = r.normal(size=(n, 5)).astype(np.float32)
  y = np.sin(2.0 * x[:, :3]) + 0.1 * r.normal(size=(n, 3))
  return {"x": x, "y": y.astype(np.float32)}


def global_data(seed: int = 1) -> tuple[dict, list[dict]]:
  """(first microbatch: one per device, stage batches: ``N·k·B`` rows each), device-major rows."""
  r = np.random.default_rng(seed)
  first = _rows(r, NUM_DEVICES * B)
  return first, [_rows(r, NUM_DEVICES * K * B) for _ in range(STAGES)]


def loss_fn(p, mb):
  import jax.numpy as jnp

  h = jnp.tanh(mb["x"] @ p["hidden"]["kernel"] + p["hidden"]["bias"])
  return jnp.mean((h @ p["out"]["kernel"] + p["out"]["bias"] - mb["y"]) ** 2)


def local_rows(batch: dict, process_index: int, process_count: int) -> dict:
  """This process's contiguous block of the global rows (its devices come first in the mesh)."""
  return {
    key: np.split(x, process_count)[process_index] if process_count > 1 else x
    for key, x in batch.items()
  }


def run() -> dict:
  """ACCO over every visible device; each process feeds only its own rows. Returns numpy results."""
  import jax
  import jax.numpy as jnp
  import optax

  import acco_jax
  from acco_jax import parallel

  mesh = parallel.make_mesh()
  assert mesh.size == NUM_DEVICES, mesh
  inner = optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(3e-2, b1=0.9, b2=0.95, weight_decay=0.1)
  )
  tx = acco_jax.acco(inner, comm_dtype=jnp.float32)
  params = init_params()
  train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=K, params=params)
  pi, pc = jax.process_index(), jax.process_count()
  first, batches = global_data()
  state = train.init(params, parallel.global_batch(local_rows(first, pi, pc), mesh))
  losses, committed = [], []
  for batch in batches:
    state, metrics = train.step(state, parallel.global_batch(local_rows(batch, pi, pc), mesh))
    losses.append(float(metrics["loss"]))
    committed.append(bool(metrics["committed"]))
  final = jax.tree.map(np.asarray, train.params(state))
  compute = jax.tree.map(lambda x: np.asarray(x, np.float32), train.compute_params(state))
  loco_losses, loco_final = run_loco(batches, inner)
  return {
    "losses": np.array(losses),
    "committed": np.array(committed),
    "final": final,
    "compute": compute,
    "loco_losses": loco_losses,
    "loco_final": loco_final,
  }


def run_loco(batches, inner):
  """Streaming DiLoCo (P = 1, tau = 1: every fragment's all-reduce is in flight across a window)
  on 2 workers of 4 devices: with 2 processes, each worker is one process and the outer
  all-reduce crosses processes. Returns per-step per-worker losses and the final theta_g."""
  import jax
  import jax.numpy as jnp

  import acco_jax
  from acco_jax import loco, parallel
  from acco_jax.loco import step as loco_step

  mesh = loco_step.worker_mesh(2)
  method = loco.streaming_diloco(sync_every=2, fragments=1, overlap_steps=1, quantize="fp4")
  tx = acco_jax.zero1(inner, comm_dtype=jnp.float32)
  params = init_params()
  train = loco_step.make_loco_step(loss_fn, tx, method, mesh, num_microbatches=K, params=params)
  pi, pc = jax.process_index(), jax.process_count()
  axes = tuple(mesh.axis_names)
  state, s, total, losses = train.init(params), 0, len(batches), []
  while s < total:
    n = train.schedule(s, total).stages
    rows = [parallel.global_batch(local_rows(b, pi, pc), mesh, axes) for b in batches[s : s + n]]
    state, metrics = train.call(state, rows, s, total)
    losses.append(np.asarray(train.replicated(metrics["loss"])))  # per worker, across processes
    s += n
  return np.stack(losses), jax.tree.map(np.asarray, train.params(state))


def flatten(result: dict) -> dict[str, np.ndarray]:
  """``{'losses': ..., 'final/hidden/kernel': ..., ...}`` (for ``np.savez``)."""
  import jax

  out = {k: result[k] for k in ("losses", "committed", "loco_losses")}
  for name in ("final", "compute", "loco_final"):
    for path, leaf in jax.tree_util.tree_leaves_with_path(result[name]):
      out[name + "/" + "/".join(str(getattr(k, "key", k)) for k in path)] = np.asarray(leaf)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--process-id", type=int, required=True)
  ap.add_argument("--num-processes", type=int, required=True)
  ap.add_argument("--local-devices", type=int, required=True)
  ap.add_argument("--port", type=int, required=True)
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)

  import jax

  jax.config.update("jax_num_cpu_devices", args.local_devices)  # before the backend starts
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  t0 = time.perf_counter()
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{args.port}",
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=60,
  )
  try:
    assert jax.process_count() == args.num_processes and jax.local_device_count() == (
      args.local_devices
    ), (jax.process_count(), jax.local_device_count())
    t1 = time.perf_counter()
    result = run()
    t2 = time.perf_counter()
    if jax.process_index() == 0:
      arrays = flatten(result)
      arrays["timing"] = np.array([t1 - t0, t2 - t1])  # (join, train) seconds
      np.savez(args.out, **arrays)
  finally:
    jax.distributed.shutdown()
  print(f"process {args.process_id}: ok in {time.perf_counter() - t0:.1f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  sys.exit(main())
