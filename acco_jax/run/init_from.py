"""``ckpt.init_from=<workdir>``: a new run starts from another run's newest checkpoint.

The trainer calls :func:`start` when ``ckpt.init_from`` is set and the run's own workdir holds no
checkpoint (with one, the run resumes from it and ``init_from`` is ignored). The source may be of
another run kind: ``ddp``, ``zero1``, ``acco``, ``dpu``, ``wp`` or ``pipeline``, on any device count
and mesh, onto any of them (:mod:`acco_jax.dp.relayout`, :mod:`acco_jax.pipeline.relayout`). The source's config is in its checkpoint (``extra['config']``):
its family builds the source's step (:attr:`acco_jax.family_api.Family.source_step`) on this
run's device count, the checkpoint is read as host arrays with the shapes it was written with
(:meth:`acco_jax.ckpt.checkpoint.Checkpointer.restore_host`, read-only: nothing in the source
workdir is written), exported to the portable form and imported into this run's state.

What carries over:

- the committed parameters and the inner optimizer's state (moments, step count, injected
  hyperparameters), bit for bit; gradient buffers, ACCO's estimate and quantization residuals do
  not (:mod:`acco_jax.dp.relayout` says why and what a delayed method starts with instead);
- the update counter: this run starts at the first stage of the source's update count ``U``
  (ACCO: stage ``2U``), so ``train.num_updates`` counts from the source's first update, like a
  resume: the learning-rate schedule continues from the carried step count, and a run of
  ``train.num_updates <= U`` has nothing to train (refused);
- the data position: the same rows follow as in the source run, in this run's global batches
  (:func:`acco_jax.data.data_state`), and ``tokens_seen`` continues.

Refused, one line each (:class:`acco_jax.errors.UserError`) before anything is written: a
missing or empty workdir, an HDEE recipe's (its experts are runs of their own), a LoCo source or
target, a source whose model differs (named), another inner optimizer, a scheduled SkipPipe plan
onto another mesh, a source whose data stream differs from this run's.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import jax
import ml_collections

from acco_jax import data, errors, family_api, model, optim, step_api
from acco_jax.ckpt.checkpoint import open_read_only
from acco_jax.run import build as build_lib
from acco_jax.run import registry, streams


class Imported(NamedTuple):
  """This run's state imported from another run's checkpoint (``ckpt.init_from``)."""

  state: Any  # this run's train state
  stage: int  # the stage it starts at
  tokens_seen: int  # the source's count, continued
  event: dict  # the metrics.jsonl event 'initialized_from'
  line: str  # what the run prints


def _refuse(path: str, message: str):
  return errors.UserValueError(f"ckpt.init_from={path}: {message}")


def _checkpoints(path: str) -> str:
  """The source's checkpoint directory, or the one-line refusal of a workdir without one."""
  if not os.path.isdir(path):
    raise errors.UserFileNotFoundError(
      f"ckpt.init_from={path}: no such directory: give the workdir of a run to start from"
    )
  if os.path.isfile(os.path.join(path, "recipe.json")):
    jobs = sorted(
      d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d, "checkpoints"))
    )
    example = os.path.join(path, jobs[0]) if jobs else os.path.join(path, "<job>")
    raise _refuse(
      path,
      "is an HDEE recipe (method=hdee), an ensemble of runs with a checkpoint each: start "
      f"from one of its jobs, e.g. ckpt.init_from={example}",
    )
  directory = os.path.join(path, "checkpoints")
  if os.path.isdir(directory):
    with open_read_only(directory) as ckpt:
      if ckpt.all_steps():
        return directory
  raise _refuse(path, "holds no checkpoint (none under checkpoints/): give the workdir of a run")


def _source_config(path: str, extra: dict):
  if "config" not in extra:
    raise _refuse(path, "its checkpoint does not record the run's config (an older version)")
  return ml_collections.ConfigDict(json.loads(extra["config"]))


_MODEL_KEYS = {
  "arch": "model.arch",
  "D": "model.D",
  "N": "model.N",
  "H": "model.H",
  "F": "model.F",
  "num_kv_heads": "model.kv_heads",
  "L": "data.seq_len",
  "V": "data.tokenizer",
  "padded_vocab": "model.vocab_multiple",
}


def _check_model(path: str, src, extra: dict, mine: model.ModelConfig) -> model.ModelConfig:
  """The source's model config; refused unless its parameters are this run's (named)."""
  if "model" in extra:  # the resolved model the source recorded (a pretrained one needs no dir)
    theirs = model.ModelConfig(**extra["model"])
  else:
    theirs = build_lib.model_config(src, extra.get("vocab", {}).get("V", mine.V))
  value = lambda cfg, key: cfg.mlp_dim if key == "F" else getattr(cfg, key)
  diff = [
    f"{key}={value(theirs, key)} there, {value(mine, key)} here ({name})"
    for key, name in _MODEL_KEYS.items()
    if value(theirs, key) != value(mine, key)
    and not (key == "F" and theirs.F is None and mine.F is None)  # 4 D: D differs already
  ]
  if diff:
    raise _refuse(
      path,
      f"the source's model is not this run's: {'; '.join(diff)}. Its parameters carry "
      "over onto the same model only",
    )
  return theirs


def _check_optimizer(path: str, src, config, shapes) -> None:
  """Refused unless the source's inner optimizer keeps the state this run's does."""
  state = lambda c: jax.eval_shape(optim.from_config(c, shapes).init, shapes)
  theirs, mine = state(src), state(config)
  same = jax.tree.structure(theirs) == jax.tree.structure(mine) and all(
    (a.shape, a.dtype) == (b.shape, b.dtype)
    for a, b in zip(jax.tree.leaves(theirs), jax.tree.leaves(mine), strict=True)
  )
  if not same:
    keys = ("name", "clip_norm", "b1", "decay")
    diff = [
      f"opt.{k}={src.opt[k]} there, {config.opt[k]} here"
      for k in keys
      if src.opt[k] != config.opt[k]
    ]
    raise _refuse(
      path,
      f"the source's inner optimizer keeps another state than this run's "
      f"({'; '.join(diff) or 'another structure'}): its state carries over to the same optimizer",
    )


def _check_source(path: str, src, extra: dict, config, step) -> family_api.Family:
  family = registry.lookup(src.method)
  if family.state_stays:
    raise _refuse(path, f"the source is a method={src.method} run: {family.state_stays}")
  if "plan" in extra:  # a pipeline's scheduled SkipPipe plan: its nodes are the source's devices
    if registry.lookup(config.method) is not family:
      raise _refuse(
        path,
        "the source trained on a scheduled SkipPipe plan (pipeline.schedule=skippipe, "
        "pipeline.paths=scheduled), which routes microbatches over the source's own mesh: it "
        "does not move onto another mesh; start from a run with pipeline.paths=random or another "
        "schedule",
      )
    step.check_checkpoint(extra)  # the same plan settings on the same mesh, or refused
  if family.source_step is None:
    raise _refuse(
      path,
      f"checkpoints of method={src.method} cannot start another run yet (its family "
      "exports none: acco_jax.ckpt.portable)",
    )
  return family


def _first_stage(run, updates: int) -> int:
  """The stage at which ``run`` has done ``updates`` updates (ACCO: ``2 * updates``)."""
  stage = 0
  while run.updates_done(stage) < updates:
    stage += 1
  return stage


def start(run, config, stream, rows_per_stage: int) -> Imported:
  """This run's state from the newest checkpoint in ``config.ckpt.init_from`` (the module).

  Args:
    run: this run (:class:`acco_jax.family_api.Run`).
    config: this run's config.
    stream: this run's training batches; set to the source's data position.
    rows_per_stage: rows of one of this run's stages (the global batch).
  """
  path = config.ckpt.init_from
  step = run.step
  if not isinstance(step, step_api.Portable):
    raise _refuse(
      path,
      f"a method={config.method} run cannot start from another run's checkpoint: its "
      "state has parts no other run kind holds (a LoCo run's outer state)",
    )
  directory = _checkpoints(path)
  found = {}

  def target_of(extra: dict):
    src = _source_config(path, extra)
    family = _check_source(path, src, extra, config, step)
    src_model = _check_model(path, src, extra, run.model_cfg)
    _check_optimizer(path, src, config, run.params_shapes)
    found.update(config=src, step=family.source_step(src, src_model, run.mesh.size))
    return found["step"].abstract_state(run.params_shapes)

  with open_read_only(directory) as ckpt:
    saved, extra = ckpt.restore_host(
      None, target_of, lambda shapes: found["step"].saved_like(shapes)
    )
  src, portable = found["config"], found["step"].export_state(saved)
  if portable.updates >= config.train.num_updates:
    raise _refuse(
      path,
      f"the source has done {portable.updates} updates and train.num_updates="
      f"{config.train.num_updates} counts from its first: raise train.num_updates above "
      f"{portable.updates}",
    )
  stage = _first_stage(run, portable.updates)
  position = data.data_state(extra["data"], rows_per_stage)
  try:
    stream.set_state(position)
  except errors.UserValueError as e:
    raise _refuse(path, f"the data position cannot be kept: {e}") from None
  try:
    state = step.import_state(portable, stage, streams.prime_batch(run, config))
  except errors.UserError:
    raise
  except ValueError as e:
    raise _refuse(path, f"the source's state does not fit this run: {e}") from None
  event = dict(
    workdir=path,
    method=src.method,
    source_stage=int(extra["stage"]),
    updates=portable.updates,
    stage=stage,
    dropped=portable.dropped,
  )
  line = (
    f"ckpt.init_from: the {src.method} run in {path} (stage {extra['stage']}, "
    f"{portable.updates} updates) continues as {config.method} at stage {stage} on "
    f"{run.mesh.size} devices; data continues at global batch {position['step']}"
    + (f"; not carried: {portable.dropped}" if portable.dropped else "")
  )
  return Imported(state, stage, int(extra.get("tokens_seen", 0)), event, line)
