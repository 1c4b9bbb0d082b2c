"""The HDEE family as the run shell sees it (:class:`acco_jax.family_api.Family`): ``method=hdee``
is no single trainer run; :func:`acco_jax.ensemble.recipe.train_and_evaluate` trains each expert as
one (imported on call)."""

from acco_jax import family_api


def _train_and_evaluate(config, workdir: str):
  from acco_jax.ensemble import recipe

  return recipe.train_and_evaluate(config, workdir)


FAMILY = family_api.Family("ensemble", ("hdee",), train_and_evaluate=_train_and_evaluate)
