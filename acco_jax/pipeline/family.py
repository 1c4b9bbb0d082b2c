"""The pipeline family as the run shell sees it (:class:`acco_jax.family_api.Family`):
``method=pipeline``, one update per flush (``pipeline.data_method=acco``:
:func:`acco_jax.pipeline.build.updates_done`); its builder
(:func:`acco_jax.pipeline.build.build_run`) is imported on call."""

from acco_jax import family_api


def _build(config, tokens, model_cfg):
  from acco_jax.pipeline import build

  return build.build_run(config, tokens, model_cfg)


def _source_step(config, model_cfg, num_devices):
  from acco_jax.pipeline import build

  return build.source_step(config, model_cfg, num_devices)


# the stages run each row as one sequence: no segment masks cross a stage boundary
ONE_SEQUENCE_A_ROW = family_api.Packing(
  False, "the pipeline's stages run each row as one sequence, without segment masks"
)

FAMILY = family_api.Family(
  "pipeline",
  ("pipeline",),
  build=_build,
  source_step=_source_step,
  packing=lambda config: ONE_SEQUENCE_A_ROW,
)
