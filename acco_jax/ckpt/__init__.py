"""Checkpoints, below the run shell and the families: writing and reading a state
(:mod:`~acco_jax.ckpt.checkpoint`, its leaves' check :mod:`~acco_jax.ckpt.leaves`, their packing
:mod:`~acco_jax.ckpt.pack`, their hashes :mod:`~acco_jax.ckpt.fingerprint`, the background
writes :mod:`~acco_jax.ckpt.settling`), what a checkpoint records beside its state
(:mod:`~acco_jax.ckpt.meta`: written, checked, read back) and the portable form a state crosses
run kinds in (:mod:`~acco_jax.ckpt.portable`). The families' layout translations (dp's
``relayout``, ``reshard``, the pipeline's ``relayout``) implement the step interface's
``Portable`` and ``reshard`` and import only from here; nothing here imports the run shell
(``tests/import_graph_test.py``).
"""
