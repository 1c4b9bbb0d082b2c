"""Timing probes of a data-parallel step, taken apart from training (a step module: it owns the
``shard_map`` of its two programs and their collectives).

The inputs of :class:`acco_jax.dp.hetero.BudgetPolicy` and of the slow-worker warnings of
:mod:`acco_jax.run.monitor`; :meth:`acco_jax.dp.step.TrainStep.probe` calls :func:`probe`.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from acco_jax.dp.quantized_comm import all_gather_invariant


def probe(step, state, batch, repeats: int = 2) -> tuple[float, float]:
  """Seconds per microbatch on this process's devices, and seconds of one stage's communication.

  Two programs, timed apart on each process. The microbatch program runs ``repeats`` forward and
  backward passes of the first microbatches of ``batch`` at the compute weights with no
  collective, so every process times its own devices (the slowest of them) without waiting for
  the others. The communication program runs the stage's collectives on a buffer of the flat
  size (reduce-scatter and all-gather, or the all-reduce of a replicated method), after a
  separate scalar all-reduce that lines the processes up. The first call runs each program once
  untimed (compilation, warm-up); later calls time one run. Not overlapped with anything: the inputs of
  :class:`acco_jax.dp.hetero.BudgetPolicy`.
  """
  axis, k = step.plan.axis_name, step.num_microbatches
  repeats = min(repeats, k)
  batch = step.put_batch(batch, per_device=k)
  first = "probe" not in step.programs
  if first:
    loop = step.program.loop(k)

    def compute(w_P, batch_local):
      params_var, mbs = loop.prepare(w_P, batch_local)
      carry, _ = loop.start(params_var, mbs)
      acc, _, loss_sum, _ = loop.accumulate(params_var, mbs, 0, repeats, carry)
      return (loss_sum + sum(jnp.sum(x) for x in jax.tree.leaves(acc)))[None]  # keeps the backward

    def comm(buf_1xP):
      flat = buf_1xP[0]
      if step.plan.sharded:
        return all_gather_invariant(lax.psum_scatter(flat, axis, tiled=True), axis)
      return lax.psum(flat, axis)

    d = P(axis)
    sm = functools.partial(jax.shard_map, mesh=step.mesh)
    step.programs["probe"] = (
      jax.jit(sm(compute, in_specs=(P(), d), out_specs=d)),
      jax.jit(sm(comm, in_specs=d, out_specs=P())),
      jax.jit(sm(lambda x: lax.psum(x[0], axis), in_specs=d, out_specs=P())),
      jax.device_put(step.zeros_buf(), step.sharding(d)),
    )
  compute_fn, comm_fn, line_up, buf = step.programs["probe"]
  ones = step.put_counts(None, k=1)

  def timed(fn, *args):
    if first:
      jax.block_until_ready(fn(*args))
    jax.block_until_ready(line_up(ones))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start

  return timed(compute_fn, state.w, batch) / repeats, timed(comm_fn, buf)
