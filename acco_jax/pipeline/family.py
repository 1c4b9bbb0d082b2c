"""The pipeline family as the run shell sees it (:mod:`acco_jax.run.registry`): ``method=pipeline``,
one update per stage; its builder (:func:`acco_jax.pipeline.train.build_run`) is imported on
call."""

from acco_jax.run import registry


def _build(config):
  from acco_jax.pipeline import train

  return train.build_run(config)


FAMILY = registry.Family("pipeline", ("pipeline",), build=_build)
