"""The data-parallel family as the run shell sees it (:class:`acco_jax.family_api.Family`): its
methods and the builder (:mod:`acco_jax.dp.build`, imported on call), whose run counts updates by
:mod:`acco_jax.dp.updates`."""

from acco_jax import family_api
from acco_jax.dp.methods import METHODS


def _build(config, tokens, model_cfg):
  from acco_jax.dp import build

  return build.build_run(config, tokens, model_cfg)


def _source_step(config, model_cfg, num_devices):
  from acco_jax.dp import build

  return build.source_step(config, model_cfg, num_devices)


def _packing(config) -> family_api.Packing | None:
  if config.get("pipeline") is None or config.pipeline.stages == 0:
    return None
  why = "SkipPipe's paths (pipeline.stages > 0) run each row as one sequence, without segment masks"
  return family_api.Packing(False, why)


def _absorbs_slow_workers(config) -> bool:
  """ACCO's adaptive budgets give the slow workers fewer microbatches (``hetero.adaptive``)."""
  return config.method == "acco" and bool(config.hetero.adaptive)


FAMILY = family_api.Family(
  "dp",
  METHODS,
  build=_build,
  source_step=_source_step,
  packing=_packing,
  absorbs_slow_workers=_absorbs_slow_workers,
)
