"""Pipeline training over stages, with SkipPipe's partial and reordered paths.

The model's N blocks are split into S stages of N/S consecutive blocks. Stage 0 holds the embedding,
its own blocks, the head and the loss: every microbatch starts there and ends there. A *path* is the
tuple of the other stages a microbatch visits, in order (:mod:`acco_jax.pipeline.paths`). Pure host
code and pure functions here; collectives stay in the step module.

Modules:
  paths.py   paths and the layer orders they run (pure)
  ticks.py   schedules as static tick tables: GPipe and 1F1B over any paths (pure, NumPy)
  step.py    the pipeline over a ``stage`` (or ``('data', 'stage')``) mesh: the only module with
             ``shard_map`` and collectives (``ppermute``, ``psum``, ``pmean``)
  train.py   the training step the trainer drives (``method=pipeline``) and its build from a config
"""
