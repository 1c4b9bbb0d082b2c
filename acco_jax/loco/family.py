"""The low-communication family as the run shell sees it (:mod:`acco_jax.run.registry`): one update
per stage; the builder (:mod:`acco_jax.loco.build`) is imported on call."""

from acco_jax.loco import METHODS
from acco_jax.run import registry


def _build(config):
  from acco_jax.loco import build

  return build.build_run(config)


FAMILY = registry.Family("loco", METHODS, build=_build)
