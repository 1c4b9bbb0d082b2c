"""Pipeline training over stages, with SkipPipe's partial and reordered paths.

The model's N blocks are split into S stages of N/S consecutive blocks. Stage 0 holds the embedding,
its own blocks, the head and the loss: every microbatch starts there and ends there. A *path* is the
tuple of the other stages a microbatch visits, in order (:mod:`acco_jax.pipeline.paths`).

Pure host code (NumPy), no collectives:

  paths.py      a path, its layer order, skip ratios, random paths
  topology.py   nodes, regions, latency and bandwidth: presets and JSON files
  assign.py     which nodes hold which stage (local search on the round trip's transfer cost)
  simulate.py   discrete-event simulation of one iteration (fifo, GPipe, 1F1B; static replay)
  schedule.py   the path scheduler under memory, balance and collisions; its ``Plan``
  left_out.py   the full pipeline with stages left out: the scheduler's no-slower-than-full guarantee
  bounds.py     a lower bound on any plan's iteration time
  plans.py      the plan a run trains with, made from its config (topology, assignment, scheduler)
  orders.py     training on data-parallel workers: a layer order per microbatch in the batch
  ticks.py      schedules as static tick tables: GPipe and 1F1B over any paths, per lane; a
                scheduler's plan over the whole mesh (microbatches cross lanes)

The pipeline over a ``stage`` (or ``('data', 'stage')``) mesh:

  step.py       the only module with ``shard_map`` and collectives (``ppermute``, ``psum``, ``pmean``)
  train.py      the training step the trainer drives (``method=pipeline``) and its build from a config
  family.py     ``method=pipeline`` for the run shell's registry (:mod:`acco_jax.run.registry`)
"""
