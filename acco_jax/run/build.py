"""From a config to the objects a run needs: mesh, tokens, model, method and compiled step.

:func:`build` is the one place that reads the config's method choice: it checks the fields every
family shares and hands the config to the family that runs the method
(:mod:`acco_jax.run.registry`). ACCO and its baselines build an :class:`acco_jax.dp.step.TrainStep`
over a ``data`` mesh (:mod:`acco_jax.dp.build`), the low-communication methods an
:class:`acco_jax.loco.step.LocoStep` over a ``(replica, data)`` mesh (:mod:`acco_jax.loco.build`),
``method=pipeline`` a step over a ``stage`` mesh (:mod:`acco_jax.pipeline.step`); the helpers here
are what they share. Every value that cannot work is refused before anything is written, with a
one-line :class:`acco_jax.errors.UserError`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from acco_jax import data, errors, model, step_api
from acco_jax.data import examples, instruct
from acco_jax.data.tokenizer import declared_vocab_size
from acco_jax.family_api import Run
from acco_jax.run import health, presets, pretrained, profile, registry


def model_config(config, vocab_size: int) -> model.ModelConfig:
  """The config's model for a tokenizer of ``vocab_size`` ids: ``model.arch``'s preset
  ``model.size`` with the config's sizes, or a pretrained model's (``model.init``,
  :mod:`acco_jax.run.pretrained`)."""
  if pretrained.source(config) is not None:
    return pretrained.model_config(config, vocab_size, presets.settings(config))
  if config.model.size == pretrained.FROM_SOURCE:
    raise errors.UserValueError(
      "model.size=init takes the sizes from model.init's checkpoint, but model.init is not set: "
      "give model.init=hf:<dir> or run:<workdir>, or a preset size"
    )
  return presets.named(config, vocab_size, **presets.settings(config))


def declared_tokens(config) -> data.TokenData:
  """No data: empty streams of the tokenizer's declared vocabulary, which a family builds its run
  against to check the config (:func:`build` with ``check_only``) before any data is prepared."""
  name = pretrained.tokenizer_name(config)
  empty = np.zeros((0,), np.int32)
  return data.TokenData(empty, empty, _Declared(name, declared_vocab_size(name)), "")


def prepare_tokens(config) -> data.TokenData:
  """The config's corpus, tokenized, split and cached (``data.prepare``)."""
  name = pretrained.tokenizer_name(config)
  cache = config.data.cache_dir or os.path.expanduser("~/.cache/acco_jax")
  # a model directory's tokenizer is keyed by its contents (a name is a path, whose file may change)
  tokenizer = data.get_tokenizer(name) if name.startswith("hf:") else name
  if instruct.is_instruction_source(config.data.source):
    return examples.prepare(
      config.data.source,
      tokenizer,
      fmt=config.data.format,
      chat_template=config.data.chat_template,
      eval_fraction=config.data.eval_fraction,
      seed=config.data.split_seed,
      cache_dir=cache,
    )
  return data.prepare(
    config.data.source,
    tokenizer,
    cache_dir=cache,
    eval_fraction=config.data.eval_fraction,
    seed=config.data.split_seed,
    data_dir=config.data.data_dir or None,
    text_key=config.data.text_key,
  )


def build(config, *, check_only: bool = False) -> Run:
  """The run of ``config``, built by the family of its method (one-line errors before that).

  Every refusal the config alone decides comes before any data is prepared or anything is
  written: the family first builds the run against the tokenizer's declared vocabulary
  (:func:`declared_tokens`: no data; the steps are built, not compiled), which is all
  ``check_only`` does, then for real from the prepared data.
  """
  family = registry.lookup(config.method)
  if family.build is None:
    raise errors.UserValueError(
      f"method={config.method} is not one training run ({family.name} runs its own): start it "
      "with train.py"
    )
  _check_config(config)
  health.check_config(config)
  declared = declared_tokens(config)
  model_cfg = model_config(config, declared.tokenizer.vocab_size)
  checked = family.build(config, declared, model_cfg)
  _check_probes(config, checked.step)
  profile.parse(config.train.get("profile_stages", ""), checked.total_stages)  # within the run
  if check_only:
    return checked
  tokens = prepare_tokens(config)
  return family.build(config, tokens, model_config(config, tokens.tokenizer.vocab_size))


def _check_probes(config, step: step_api.Step) -> None:
  """Timing probes (slow workers, adaptive budgets) need a step that times its devices apart."""
  asked = [
    k for k in ("health.probe_every", "hetero.adaptive") if config[k.split(".")[0]][k.split(".")[1]]
  ]
  if asked and not isinstance(step, step_api.Probed):
    raise errors.UserValueError(
      f"{asked[0]}: method={config.method} cannot time its devices apart from training (only "
      "the data-parallel methods probe): leave it at its default"
    )


class _Declared(NamedTuple):
  """A tokenizer known by its name and size only (:func:`prepare_tokens` while checking)."""

  name: str
  vocab_size: int


_AT_LEAST = {
  "batch.microbatches": 1,
  "batch.microbatch_size": 1,
  "train.num_updates": 1,
  "train.log_every": 1,
  "train.eval_every": 0,
  "train.eval_batches": 1,
  "ckpt.every": 0,
  "ckpt.keep": 1,
}


# Every dtype field of the config and the values it takes (floating types the step computes in).
_DTYPES = {
  "model.dtype": ("bfloat16", "float32", "float16"),
  "comm_dtype": ("bfloat16", "float32", "float16"),
}


def _check_config(config) -> None:
  """Refuses out-of-range sizes and counts before anything is built (one line naming the key)."""
  for key, low in _AT_LEAST.items():
    group, field = key.split(".")
    value = config[group][field]
    if not isinstance(value, int) or value < low:
      raise errors.UserValueError(f"{key}={value!r} must be >= {low} (an integer)")
  if config.train.on_nonfinite not in ("stop", "skip"):
    raise errors.UserValueError(
      f"train.on_nonfinite={config.train.on_nonfinite!r}: choose 'stop' or 'skip'"
    )
  _check_instruction(config)
  profile.parse(config.train.get("profile_stages", ""), float("inf"))
  for key, allowed in _DTYPES.items():
    value = config[key.split(".")[0]][key.split(".")[1]] if "." in key else config[key]
    if value not in allowed:
      raise errors.UserValueError(
        f"{key}={value!r} is not a dtype this field takes: choose one of {', '.join(allowed)}"
      )


def _check_instruction(config) -> None:
  """Instruction data's fields, and the families that take its rows (one line each)."""
  d = config.data
  if not instruct.is_instruction_source(d.source):
    return
  if d.format not in instruct.FORMATS:
    raise errors.UserValueError(
      f"data.format={d.format!r} is unknown: choose one of {', '.join(instruct.FORMATS)}"
    )
  if config.train.exact_match not in ("end", "every", "off"):
    raise errors.UserValueError(
      f"train.exact_match={config.train.exact_match!r}: choose end, every or off"
    )
  if not d.packing and (not isinstance(d.bucket, int) or d.bucket < 1):
    raise errors.UserValueError(
      f"data.bucket={d.bucket!r} must be >= 1 (positions per bucket step)"
    )
  rule = registry.lookup(config.method).packing(config)
  if rule is not None and bool(d.packing) != rule.required:
    raise errors.UserValueError(
      f"data.packing={bool(d.packing)}: {rule.why}: set data.packing={rule.required}"
    )
