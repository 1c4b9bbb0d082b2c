"""Ensembles of independent domain experts (HDEE, Branch-Train-Merge): a new family beside dp/, loco/.

Pure modules: ``mixing`` (the mixing rules, jitted JAX, no Flax/orbax/TFDS) and ``budgets`` (the
recipe as data and each job's steps from a FLOP budget; plain Python). ``domains`` writes the
offline built-in domains as text files. ``infer`` scores rows with each expert and samples from
the mixture (uses the model). ``recipe`` and ``jobs`` are the shell: ``jobs`` runs one job through
the project's trainer (``acco_jax.run.trainer``) in its own sub-workdir and picks a run's share of
the jobs (``hdee.jobs``); ``recipe`` plans, runs the jobs in order, then evaluates. No module here
owns a collective: the experts never communicate. ``family`` registers ``method=hdee`` with the run
shell (:mod:`acco_jax.run.registry`).
"""

SHARED = ()  # no other family imports this one (tests/import_graph_test.py)
