"""``model.init=hf:<dir>``: a run that starts from a Hugging Face directory's weights.

:func:`model_config` is the run's model: the directory's ``config.json`` sets the architecture and
every size (:mod:`acco_jax.hf`); the config's ``model.arch``, ``model.size`` and ``model.D/N/H/F/
kv_heads`` must agree with it or leave it to the checkpoint (``model.size=hf``, the sizes 0), and
the run's own settings (``model.dtype``, ``remat``, ``attention``, ``vocab_multiple``) apply. The
tokenizer (:func:`tokenizer_name`) must give ids the checkpoint knows: ``data.tokenizer=hf`` is
the directory's, ``hf:<dir>`` any directory's, ``gpt2`` GPT-2's BPE; one trained on the corpus
(``bpe:<n>``) or ``byte`` are refused, their ids mean nothing to a pretrained embedding. Every
refusal is one line, before any data is prepared, and :func:`check` also reads the weights'
headers (a tensor missing, left over or of another shape). :func:`load_params` reads the weights
tensor by tensor onto the run's devices, replicated over its mesh (the step's ``init`` cuts them
into its layout).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import errors, hf, model

SIZE_FROM_CHECKPOINT = "hf"
_SIZES = {"D": "D", "N": "N", "H": "H", "F": "mlp_dim", "kv_heads": "num_kv_heads"}


def directory(config) -> str | None:
  """``model.init``'s Hugging Face directory, or None (a fresh initialisation)."""
  init = str(config.model.get("init", "") or "")
  if not init:
    return None
  if not init.startswith("hf:") or len(init) <= 3:
    raise errors.UserValueError(
      f"model.init={init!r}: give hf:<dir>, a local Hugging Face directory (or '' for a fresh "
      "initialisation; another run's checkpoint is ckpt.init_from)"
    )
  return init[3:]


def tokenizer_name(config) -> str:
  """``data.tokenizer`` with ``hf`` resolved to ``model.init``'s directory."""
  name = config.data.tokenizer
  source = directory(config)
  if source is not None:
    hf.read_config(source)  # a missing directory or config.json: named first
  if name == "hf":
    if source is None:
      raise errors.UserValueError(
        "data.tokenizer=hf names the tokenizer of model.init's directory, but model.init is not "
        "set: give data.tokenizer=hf:<dir>, or model.init=hf:<dir>"
      )
    return f"hf:{source}"
  if source is not None and (name == "byte" or name.startswith("bpe:")):
    raise errors.UserValueError(
      f"data.tokenizer={name} with pretrained weights (model.init={config.model.init}): their "
      "embedding reads the ids of their own tokenizer: set data.tokenizer=hf"
    )
  return name


def _named(config, vocab_size: int) -> model.ModelConfig:
  """The config's own model (a preset and its overrides), for comparison with the checkpoint."""
  m = config.model
  overrides = {k: m[k] for k in _SIZES if m.get(k)}
  return model.get_config(
    m.size, arch=m.get("arch", "gpt2"), V=vocab_size, L=config.data.seq_len, **overrides
  )


def _contradictions(config, fields: dict, vocab_size: int) -> list[str]:
  m = config.model
  theirs = model.ModelConfig(**{**fields, "dtype": "float32"})
  if m.size == SIZE_FROM_CHECKPOINT:
    given = {k: m[k] for k in _SIZES if m.get(k)}
  else:
    mine = _named(config, vocab_size)
    given = {k: getattr(mine, attr) for k, attr in _SIZES.items()}
    if mine.arch != theirs.arch:
      return [f"model.arch={mine.arch} (config.json: {theirs.arch})"]
  return [
    f"model.{k}={v} (config.json: {getattr(theirs, _SIZES[k])})"
    for k, v in given.items()
    if v != getattr(theirs, _SIZES[k])
  ]


def model_config(config, vocab_size: int, settings: dict) -> model.ModelConfig:
  """The run's model from ``model.init``'s ``config.json`` (see the module docstring).

  Args:
    config: the run's config.
    vocab_size: the ids the run's tokenizer gives.
    settings: the run's own model fields (dtype, remat, attention, vocab_multiple).
  """
  source = directory(config)
  fields = hf.model_fields(source)
  wrong = _contradictions(config, fields, vocab_size)
  if wrong:
    raise errors.UserValueError(
      f"model.init={config.model.init}: the config's {'; '.join(wrong)} do not match the "
      "checkpoint: set --config.model.size=hf to take the architecture and every size from it, "
      "and drop the model overrides"
    )
  cfg = model.ModelConfig(**{**fields, **settings})
  if vocab_size > cfg.V:
    raise errors.UserValueError(
      f"data.tokenizer={config.data.tokenizer} gives {vocab_size} ids, more than the "
      f"{cfg.V} rows of the checkpoint's embedding (model.init={config.model.init}): use the "
      "checkpoint's tokenizer (data.tokenizer=hf)"
    )
  if config.data.seq_len > cfg.L:
    raise errors.UserValueError(
      f"data.seq_len={config.data.seq_len} is longer than the {cfg.L} positions of the "
      f"checkpoint (model.init={config.model.init}): set data.seq_len <= {cfg.L}"
    )
  hf.check_weights(source, cfg)  # the headers only: a tensor missing, left over, misshapen
  return cfg


def load_params(config, cfg: model.ModelConfig, mesh) -> dict:
  """The checkpoint's parameters, each placed on ``mesh`` replicated as it is read."""
  sharding = NamedSharding(mesh, P())

  def place(path, x):
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return hf.load_params(directory(config), cfg, place)
