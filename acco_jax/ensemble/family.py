"""The HDEE family as the run shell sees it (:mod:`acco_jax.run.registry`): ``method=hdee`` is no
single trainer run; :func:`acco_jax.ensemble.recipe.train_and_evaluate` trains each expert as one (imported on
call)."""

from acco_jax.run import registry


def _train_and_evaluate(config, workdir: str):
  from acco_jax.ensemble import recipe

  return recipe.train_and_evaluate(config, workdir)


FAMILY = registry.Family("ensemble", ("hdee",), train_and_evaluate=_train_and_evaluate)
