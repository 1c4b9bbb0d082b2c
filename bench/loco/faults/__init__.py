"""The parts of ``python -m bench.loco.store_faults`` (:mod:`bench.loco.store_faults`, its command
line): the run's settings and fault plan, the worker processes and their metrics, the stores, the
two arms, the analysis and the table and figure."""
