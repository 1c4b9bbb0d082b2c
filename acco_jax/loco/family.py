"""The low-communication family as the run shell sees it (:class:`acco_jax.family_api.Family`): one
update per stage; the builder and the checkpoints' reader (:mod:`acco_jax.loco.build`) are imported
on call."""

from acco_jax import family_api
from acco_jax.loco import METHODS


def _build(config, tokens, model_cfg):
  from acco_jax.loco import build

  return build.build_run(config, tokens, model_cfg)


def _source_step(config, model_cfg, num_devices):
  from acco_jax.loco import build

  return build.source_step(config, model_cfg, num_devices)


# a call takes several stages' batches at once: every batch must have the same width
ALL_PACKED = family_api.Packing(
  True,
  "a LoCo call takes several stages' batches at once, which buckets would give different widths",
)

# source_step exports a checkpoint's global parameters only (``export_params``): a LoCo state does
# not start another run kind (ckpt.init_from refuses it), but exports to Hugging Face; its
# workers' states do not move onto another mesh, so it reads back on its own device count only
FAMILY = family_api.Family(
  "loco",
  METHODS,
  build=_build,
  source_step=_source_step,
  packing=lambda config: ALL_PACKED,
  state_stays=(
    "its state is per worker (each worker's parameters and inner optimizer) plus the outer "
    "optimizer's (the global parameters and outer momentum), which no other run kind has a place "
    "for: start from a ddp, zero1, acco, dpu, wp or pipeline run"
  ),
  reads_any_device_count=False,
)
