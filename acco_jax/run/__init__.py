"""The run shell: from a config to a run, and everything a run does besides the step's math.

Entry point: :func:`acco_jax.run.trainer.train_and_evaluate` (what ``train.py`` calls);
:func:`acco_jax.run.build.build` turns a config into the mesh, tokens, model and a family's step,
through the family that ``registry`` names for ``config.method`` (the families register themselves,
:mod:`acco_jax.families`; nothing here imports one).

``parallel`` (devices, meshes, ``jax.distributed``, XLA flag presets), ``optim`` (the inner optimizer
from a config, pure optax), ``report`` (held-out evaluation, the sample, a finished run's summary),
``checkpoint`` and ``fingerprint`` (orbax I/O, leaf hashes), ``metrics``
(accounting and writers), ``monitor`` (slow workers, the hung-collective watchdog), ``health`` (the
verdict ``health.json`` and restarting without the processes it names). This is the only
folder that does I/O; it owns no collective of a training step (the families' step modules do).
"""
