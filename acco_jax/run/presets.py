"""The model a config names without pretrained weights: ``model.arch``'s preset ``model.size``
with the config's size overrides (``model.D/N/H/F/kv_heads``; 0 keeps the preset's)."""

from __future__ import annotations

from acco_jax import model

SIZES = ("D", "N", "H", "F", "kv_heads")  # the model.* sizes a config may override


def settings(config) -> dict:
  """The run's own model fields, which apply to a preset and to pretrained weights alike."""
  m = config.model
  return dict(
    dtype=m.dtype,
    remat=m.remat,
    attention=m.attention,
    vocab_multiple=m.get("vocab_multiple", 1),
  )


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
