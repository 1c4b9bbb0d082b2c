"""The low-communication family as the run shell sees it (:mod:`acco_jax.run.registry`): one update
per stage; the builder and the checkpoints' reader (:mod:`acco_jax.loco.build`) are imported on
call."""

from acco_jax.loco import METHODS
from acco_jax.run import registry


def _build(config, tokens):
  from acco_jax.loco import build

  return build.build_run(config, tokens)


def _source_step(config, model_cfg, num_devices):
  from acco_jax.loco import build

  return build.source_step(config, model_cfg, num_devices)


# source_step exports a checkpoint's global parameters only (``export_params``): a LoCo state does
# not start another run kind (ckpt.init_from refuses it), but exports to Hugging Face
FAMILY = registry.Family("loco", METHODS, build=_build, source_step=_source_step)
