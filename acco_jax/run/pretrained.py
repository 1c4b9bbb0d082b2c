"""``model.init``: a run that starts from pretrained weights, at update 0 with a fresh optimizer.

Two sources:

- ``hf:<dir>``, a local Hugging Face directory: its ``config.json`` sets the architecture and every
  size (:mod:`acco_jax.hf`), its weights the parameters, its tokenizer the ids;
- ``run:<workdir>``, a run of this project: the committed parameters of its newest checkpoint (any
  family, any device count: :func:`acco_jax.run.saved.read_params`), with the model and tokenizer it
  recorded. Unlike ``ckpt.init_from``, which continues a run (its optimizer state, update count
  and data position carry over), this keeps only the weights: what a fine-tune on other data
  wants.

:func:`model_config` is the run's model: the config's ``model.arch``, ``model.size`` and
``model.D/N/H/F/kv_heads`` must agree with the source's or leave it to the source (``model.size=
init``, the sizes 0), and the run's own settings (``model.dtype``, ``remat``, ``attention``,
``vocab_multiple``) apply. The tokenizer (:func:`tokenizer_name`) must give ids the source knows:
``data.tokenizer=init`` is the source's, ``hf:<dir>`` any directory's, ``gpt2`` GPT-2's BPE; one
trained on this run's corpus (``bpe:<n>``) or ``byte`` are refused, their ids mean nothing to a
pretrained embedding. Every refusal is one line, before any data is prepared (a Hugging Face
directory's weights are checked from their headers). :func:`load_params` puts the parameters on
the run's devices, replicated over its mesh (the step's ``init`` cuts them into its layout).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import errors, hf, model, models
from acco_jax.models import base
from acco_jax.run import presets

FROM_SOURCE = "init"  # model.size and data.tokenizer: the source's


class Source(NamedTuple):
  kind: str  # 'hf' | 'run'
  path: str


def source(config) -> Source | None:
  """``model.init``'s source, or None (a fresh initialisation)."""
  init = str(config.model.get("init", "") or "")
  if not init:
    return None
  kind, _, path = init.partition(":")
  if kind not in ("hf", "run") or not path:
    raise errors.UserValueError(
      f"model.init={init!r}: give hf:<dir> (a local Hugging Face directory) or run:<workdir> (a "
      "run of train.py), or '' for a fresh initialisation"
    )
  if kind == "hf":
    hf.read_config(path)  # a missing directory or config.json: named first
  elif not _recorded(path):
    raise errors.UserValueError(
      f"model.init={init}: no checkpoint there that records its model (checkpoints/ of a run of "
      "train.py): give the workdir of a run"
    )
  return Source(kind, path)


def _recorded(workdir: str) -> dict:
  from acco_jax.ckpt import meta

  if not os.path.isdir(workdir):
    raise errors.UserFileNotFoundError(
      f"model.init=run:{workdir}: no such directory: give the workdir of a run of train.py"
    )
  extra = meta.recorded(workdir)
  return extra if "model" in extra and "tokenizer" in extra else {}


def tokenizer_name(config) -> str:
  """``data.tokenizer`` with ``init`` resolved to ``model.init``'s tokenizer."""
  name, src = config.data.tokenizer, source(config)
  if name == FROM_SOURCE:
    if src is None:
      raise errors.UserValueError(
        "data.tokenizer=init names the tokenizer of model.init's source, but model.init is not "
        "set: give data.tokenizer=hf:<dir>, or model.init"
      )
    return f"hf:{src.path}" if src.kind == "hf" else _recorded(src.path)["tokenizer"]
  if src is not None and (name == "byte" or name.startswith("bpe:") and name[4:].isdigit()):
    raise errors.UserValueError(
      f"data.tokenizer={name} with pretrained weights (model.init={config.model.init}): their "
      "embedding reads the ids of their own tokenizer: set data.tokenizer=init"
    )
  return name


def _source_fields(src: Source) -> dict:
  if src.kind == "hf":
    return hf.model_fields(src.path)
  fields = dict(_recorded(src.path)["model"])
  return {k: v for k, v in fields.items() if k not in presets.SETTINGS}


def _contradictions(config, fields: dict, vocab_size: int) -> list[str]:
  m, where = config.model, "config.json" if source(config).kind == "hf" else "the run's"
  theirs = model.ModelConfig(**{**fields, "dtype": "float32"})
  if m.size == FROM_SOURCE:
    given = {k: m[k] for k in presets.SIZES if m.get(k)}
  else:
    mine = presets.named(config, vocab_size)
    given = {k: base.resolved(mine, k) for k in presets.SIZES}
    if mine.arch != theirs.arch:
      return [f"model.arch={mine.arch} ({where}: {theirs.arch})"]
  return [
    f"model.{k}={v} ({where}: {base.resolved(theirs, k)})"
    for k, v in given.items()
    if v != base.resolved(theirs, k)
  ]


def model_config(config, vocab_size: int, settings: dict) -> model.ModelConfig:
  """The run's model from ``model.init``'s source (see the module docstring).

  Args:
    config: the run's config.
    vocab_size: the ids the run's tokenizer gives.
    settings: the run's own model fields (dtype, remat, attention, vocab_multiple).
  """
  src = source(config)
  fields = _source_fields(src)
  wrong = _contradictions(config, fields, vocab_size)
  if wrong:
    raise errors.UserValueError(
      f"model.init={config.model.init}: the config's {'; '.join(wrong)} do not match the "
      "checkpoint: set --config.model.size=init to take the architecture and every size from "
      "it, and drop the model overrides"
    )
  cfg = model.ModelConfig(**{**fields, **settings})
  if vocab_size > cfg.V:
    raise errors.UserValueError(
      f"data.tokenizer={config.data.tokenizer} gives {vocab_size} ids, more than the "
      f"{cfg.V} rows of the checkpoint's embedding (model.init={config.model.init}): use the "
      "checkpoint's tokenizer (data.tokenizer=init)"
    )
  if config.data.seq_len > cfg.L:
    raise errors.UserValueError(
      f"data.seq_len={config.data.seq_len} is longer than the {cfg.L} positions of the "
      f"checkpoint (model.init={config.model.init}): set data.seq_len <= {cfg.L}"
    )
  if src.kind == "hf":
    hf.check_weights(src.path, cfg)  # the headers only: a tensor missing, left over, misshapen
  return cfg


def _repadded(params, theirs: model.ModelConfig, cfg: model.ModelConfig):
  """A run's parameters with their vocabulary rows padded to ``cfg.padded_vocab`` (the source may
  have padded to another multiple)."""
  if theirs.padded_vocab == cfg.padded_vocab:
    return params
  out = jax.tree.map(lambda x: x, params)
  for t in models.get(cfg.arch).hf_tensors(cfg):
    if t.vocab_rows:
      node = out
      for k in t.path[:-1]:
        node = node[k]
      x = np.asarray(node[t.path[-1]])[: cfg.V]
      node[t.path[-1]] = np.pad(x, ((0, cfg.padded_vocab - cfg.V),) + ((0, 0),) * (x.ndim - 1))
  return out


def load_params(config, cfg: model.ModelConfig, mesh) -> dict:
  """The source's parameters, each placed on ``mesh`` replicated (a Hugging Face directory's as
  each tensor is read)."""
  sharding = NamedSharding(mesh, P())

  def place(path, x):
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  src = source(config)
  if src.kind == "hf":
    return hf.load_params(src.path, cfg, place)
  from acco_jax.run import saved

  params, theirs, _ = saved.read_params(src.path)
  params = _repadded(params, theirs, cfg)
  return jax.tree.map(lambda x: place(None, np.asarray(x, np.float32)), params)
