"""The model a config names without pretrained weights: ``model.arch``'s preset ``model.size``
with the config's size overrides (``model.D/N/H/F/kv_heads/K``; 0 keeps the preset's).

Which fields are sizes and which are the run's settings is :class:`acco_jax.models.base.Field`'s
schema: :data:`SIZES` and :data:`SETTINGS` derive from it."""

from __future__ import annotations

from acco_jax import model
from acco_jax.models import base

SIZES = base.config_sizes()  # the model.* sizes a config may override: D, H, N, F, kv_heads, K
SETTINGS = base.fields_of(base.SETTING)  # dtype, remat, dropout, attention, vocab_multiple


def settings(config) -> dict:
  """The run's own model fields (those the config sets), which apply to a preset and to
  pretrained weights alike."""
  m = config.model
  return {k: m[k] for k in SETTINGS if k in m}


def named(config, vocab_size: int, **fields) -> model.ModelConfig:
  """``model.arch``'s preset ``model.size`` with the config's overrides, for ``vocab_size`` ids
  and ``data.seq_len`` positions; ``fields`` set the rest (:func:`settings`)."""
  m = config.model
  overrides = {k: m[k] for k in SIZES if m.get(k)}
  return model.get_config(
    m.size,
    arch=m.get("arch", "gpt2"),
    V=vocab_size,
    L=config.data.seq_len,
    **fields,
    **overrides,
  )
