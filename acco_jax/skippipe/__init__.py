"""SkipPipe's path scheduler: partial and reordered pipeline paths, pure host code (NumPy).

The model's N blocks are split into S stages. Stage 0 holds the embedding, its own blocks, the head
and the loss: every microbatch starts there and ends there. A *path* is the tuple of the other
stages a microbatch visits, in order (:mod:`acco_jax.skippipe.paths`).

This package sits below the families: the pipeline (:mod:`acco_jax.pipeline`, a ``stage`` mesh axis)
runs its plans, and the data-parallel runs train with its layer orders (``pipeline.stages`` with
``method=ddp|zero1|acco``); neither family imports the other.

  paths.py      a path, its layer order, skip ratios, random paths
  topology.py   nodes, regions, latency and bandwidth: presets and JSON files
  assign.py     which nodes hold which stage (local search on the round trip's transfer cost)
  simulate.py   discrete-event simulation of one iteration (fifo, GPipe, 1F1B; static replay)
  schedule.py   the path scheduler under memory, balance and collisions; its ``Plan``
  left_out.py   the full pipeline with stages left out: the scheduler's no-slower-than-full guarantee
  bounds.py     a lower bound on any plan's iteration time
  plans.py      the plan a run trains with, made from its config (topology, assignment, scheduler)
  orders.py     training on data-parallel workers: a layer order per microbatch in the batch
"""
