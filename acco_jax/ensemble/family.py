"""The HDEE family as the run shell sees it (:mod:`acco_jax.run.registry`): ``method=hdee`` is no
single trainer run; :func:`acco_jax.ensemble.recipe.run` trains each expert as one (imported on
call)."""

from acco_jax.run import registry


def _run(config, workdir: str):
  from acco_jax.ensemble import recipe

  return recipe.run(config, workdir)


FAMILY = registry.Family("ensemble", ("hdee",), run=_run)
