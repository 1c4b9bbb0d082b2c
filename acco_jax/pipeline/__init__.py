"""Pipeline training over a ``stage`` (or ``('data', 'stage')``) mesh axis, with SkipPipe's partial
and reordered paths from :mod:`acco_jax.skippipe`.

  ticks.py      schedules as static tick tables: GPipe and 1F1B over any paths, per lane; a
                scheduler's plan over the whole mesh (microbatches cross lanes)
  packing.py    each stage's parameters in flat buffers (the embedding and head once; Muon's
                matrices whole in slots the lanes divide)
  programs.py   the traced programs: the only module with ``shard_map`` and collectives
                (``ppermute``, ``psum``, ``pmean``)
  step.py       the training step the trainer drives (``method=pipeline``)
  build.py      that step from a config; relayout.py its state to and from ``ckpt.init_from``'s form
  family.py     ``method=pipeline`` for the run shell's registry (:mod:`acco_jax.run.registry`)
"""

SHARED = ()  # no other family imports this one (tests/import_graph_test.py)
