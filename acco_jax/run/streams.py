"""A run's batches: training, held-out and priming, each this process's share of the config's
global batches, packed as the config says (:func:`batch_stream`).

What a built run (:class:`acco_jax.family_api.Run`) reads, apart from the builder
(:mod:`acco_jax.run.build`, a config to a run) and the loop (:mod:`acco_jax.run.trainer`).
"""

from __future__ import annotations

import jax

from acco_jax import data, errors, parallel
from acco_jax.data import examples
from acco_jax.family_api import Run


def batch_stream(
  run: Run, config, tokens, rows: int, *, seed: int, shuffle=True, epochs=None, share=(0, 1)
):
  """Batches of ``rows`` rows of ``tokens`` (this process's share), as the config packs them.

  With ``run.batch_whole`` (a pipeline) every process reads the whole batch, so that processes
  whose devices share rows hold the same ones (:func:`acco_jax.parallel.global_batch` places
  each device's part). ``share=(i, n)``: the rows are share ``i`` of a batch ``n`` times larger
  (a job that is one of ``n`` workers: ``Step.data_share``).
  """
  (index, count), procs = share, 1 if run.batch_whole else jax.process_count()
  common = dict(
    seq_len=config.data.seq_len,
    global_batch_rows=rows * count,
    seed=seed,
    process_index=index * procs + (0 if run.batch_whole else jax.process_index()),
    process_count=count * procs,
    shuffle=shuffle,
    num_epochs=epochs,
  )
  if isinstance(tokens, data.Examples):  # instruction data: packed rows, or buckets
    packing, bucket = bool(config.data.packing), int(config.data.bucket)
    return examples.batches(tokens, **common, packing=packing, bucket=bucket)
  return data.batches(tokens, **common)


def prime_batch(run: Run, config):
  """What a delayed method primes its gradient buffer with: one microbatch per device, the first
  batch of the stream seeded ``train.seed + 1`` (not the training stream), placed."""
  rows, share = run.mesh.size * config.batch.microbatch_size, run.step.data_share
  prime = next(
    batch_stream(run, config, run.tokens.train, rows, seed=config.train.seed + 1, share=share)
  )
  prime = run.step.priming_batch(prime)  # SkipPipe: each device primes with its first path
  return parallel.global_batch(prime, run.mesh, run.batch_axis, run.batch_whole)


def eval_stream(run: Run, config):
  """The held-out batches every evaluation reads from the start: one microbatch per device each, in
  order (:func:`acco_jax.run.report.evaluate`)."""
  rows = run.mesh.size * config.batch.microbatch_size
  return batch_stream(run, config, run.tokens.eval, rows, seed=0, shuffle=False)


def train_stream(run: Run, config):
  """The training batches of this process, and the rows one stage takes (a pipeline: ``M`` per
  data lane, not per device), as the step takes them (SkipPipe: with each microbatch's layer
  order)."""
  rows_per_stage = run.step.microbatches_per_stage * config.batch.microbatch_size
  rows, share = rows_per_stage, run.step.data_share
  stream = batch_stream(run, config, run.tokens.train, rows, seed=config.train.seed, share=share)
  return run.step.feed(stream), rows_per_stage


def check_held_out(run: Run, config) -> None:
  """Refuses, before any work, held-out data that gives no evaluation batch (the final
  evaluation's stream, :func:`eval_stream`, is built here and not read)."""
  try:
    eval_stream(run, config)
  except errors.UserValueError as e:
    raise errors.UserValueError(
      f"the held-out split (data.eval_fraction={config.data.eval_fraction}): {e}; or raise "
      "data.eval_fraction"
    ) from None
