"""What a checkpoint records beside its state, in one place: written (:func:`written`, which
``Loop.save`` stores as the checkpoint's ``extra``), checked before a resume reads any array
(:func:`check_vocab`, :func:`check_comm`) and read back (:func:`recorded`, :func:`meta_steps`,
:func:`recorded_devices`: plain JSON, before JAX is imported, so that ``python -m
acco_jax.export`` picks its platform and device count from it).

The record (every key optional on read: checkpoints written before it was added lack it):
``stage``, ``data`` (the data position), ``tokens_seen``, ``wire_bytes``, ``vocab``
(:func:`vocab_meta`), ``comm`` (:func:`comm_meta`), ``model``, ``tokenizer`` and ``num_devices``
(:func:`model_meta`), ``config`` (its JSON) and the step's own entries (``checkpoint_extra``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

from acco_jax import errors

if TYPE_CHECKING:
  from acco_jax import model

Run = Any  # a family_api.Run: its model_cfg, tokens and mesh


def written(
  run: Run, config, step, *, stage: int, data: dict, tokens_seen: int, wire_bytes
) -> dict:
  """The ``extra`` a checkpoint of ``stage`` records: the data position, the counters, the
  vocabulary, the communication format, the model, the config and the step's own entries."""
  return {
    "stage": stage,
    "data": data,
    "tokens_seen": tokens_seen,
    "vocab": vocab_meta(run.model_cfg),
    "wire_bytes": wire_bytes,
    "comm": comm_meta(config, step),
    **model_meta(run),
    "config": config.to_json_best_effort(),
    **step.checkpoint_extra(),
  }


def model_meta(run: Run) -> dict:
  """What a checkpoint records of the model, so that it reads back without the config's sources
  (a Hugging Face directory, a tokenizer trained on the corpus): the resolved model config, the
  tokenizer's name (``bpe:<its file>``, ``hf:<dir>``, ...) and the devices the state is laid out
  over (``python -m acco_jax.export``)."""
  return {
    "model": dataclasses.asdict(run.model_cfg),
    "tokenizer": run.tokens.tokenizer.name,
    "num_devices": int(run.mesh.size),
  }


def vocab_meta(cfg: model.ModelConfig) -> dict:
  return {"V": cfg.V, "padded": cfg.padded_vocab, "multiple": cfg.vocab_multiple}


def check_vocab(extra: dict, cfg: model.ModelConfig) -> None:
  """Refuses a checkpoint whose embedding padding differs from the config's, before reading it.

  Checkpoints written before the padding was recorded carry no ``vocab`` entry and restore as
  long as their shapes match.
  """
  saved, now = extra.get("vocab"), vocab_meta(cfg)
  if saved is None or saved == now:
    return
  if saved["V"] != now["V"]:
    raise errors.UserValueError(
      f"the checkpoint's model has a vocabulary of V={saved['V']} ids, this config's tokenizer "
      f"gives V={now['V']}: resume with the data.tokenizer it was written with, or start in a "
      "new workdir"
    )
  raise errors.UserValueError(
    f"the checkpoint holds V={saved['V']} padded to {saved['padded']} rows "
    f"(model.vocab_multiple={saved['multiple']}), this config V={now['V']} padded to "
    f"{now['padded']} (model.vocab_multiple={now['multiple']}): set "
    f"--config.model.vocab_multiple={saved['multiple']} to resume, or start in a new workdir"
  )


def comm_meta(config, step) -> dict:
  """What a checkpoint records of the communication format (read back by :func:`check_comm`)."""
  return {
    "quantize": config.comm.quantize,
    "error_feedback": bool(config.comm.error_feedback),
    "residual": bool(step.keeps_residual),
  }


def check_comm(extra: dict, config, step) -> None:
  """Refuses a checkpoint whose ZeRO-1 residual of quantized sends the config would drop or lack.

  Another ``comm.quantize`` is otherwise fine to resume with: ACCO's residual rides in its
  gradient buffer, and the compute weights are resent whole (bf16) or as updates against the
  weights every device holds (int8, int4). Checkpoints without the record restore as long as
  their leaves match.
  """
  saved, now = extra.get("comm"), comm_meta(config, step)
  if saved is None or saved["residual"] == now["residual"]:
    return
  was = f"comm.quantize={saved['quantize']}, comm.error_feedback={saved['error_feedback']}"
  if saved["residual"]:
    raise errors.UserValueError(
      f"the checkpoint holds the undelivered residual of ZeRO-1's quantized sends ({was}), "
      f"which comm.quantize={now['quantize']}, comm.error_feedback={now['error_feedback']} would "
      f"drop: resume with --config.comm.quantize={saved['quantize']} "
      "--config.comm.error_feedback=True, or start in a new workdir"
    )
  raise errors.UserValueError(
    f"the checkpoint was written without a residual of quantized sends ({was}), this config "
    f"keeps one (comm.quantize={now['quantize']} with error feedback): resume with "
    f"--config.comm.quantize={saved['quantize']} or --config.comm.error_feedback=False, or "
    "start in a new workdir"
  )


def meta_steps(checkpoints: str) -> list[tuple[int, dict]]:
  """``(step, extra)`` of every checkpoint whose metadata reads, newest first (plain JSON: read
  before JAX starts, to know the devices the state needs)."""
  out = []
  steps = sorted((int(d) for d in os.listdir(checkpoints) if d.isdigit()), reverse=True)
  for step in steps:
    path = os.path.join(checkpoints, str(step), "meta", "metadata")
    try:
      with open(path) as f:
        out.append((step, json.load(f)["extra"]))
    except (OSError, ValueError, KeyError):
      continue
  return out


def recorded(workdir: str) -> dict:
  """The ``extra`` of the newest checkpoint of the run in ``workdir`` whose metadata reads (its
  config, model, tokenizer and device count), read as plain JSON; ``{}`` if none."""
  checkpoints = os.path.join(workdir, "checkpoints")
  metas = meta_steps(checkpoints) if os.path.isdir(checkpoints) else []
  return metas[0][1] if metas else {}


def runs_of(workdir: str) -> list[tuple[str, str]]:
  """``(name, run workdir)`` of what ``workdir`` holds: itself, or each job of an HDEE recipe."""
  if not os.path.isdir(workdir):
    raise errors.UserFileNotFoundError(f"{workdir}: no such directory: give a run's workdir")
  if os.path.isfile(os.path.join(workdir, "recipe.json")):
    jobs = sorted(  # job names may hold a slash (steps/hard-1)
      os.path.relpath(root, workdir)
      for root, dirs, _ in os.walk(workdir)
      if "checkpoints" in dirs and root != workdir
    )
    if not jobs:
      raise errors.UserValueError(f"{workdir}: an HDEE recipe whose jobs hold no checkpoint yet")
    return [(job, os.path.join(workdir, job)) for job in jobs]
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise errors.UserValueError(
      f"{workdir}: holds no checkpoints/ directory: give the workdir of a run of train.py"
    )
  return [("", workdir)]


def devices_needed(workdir: str, step: int | None = None) -> int:
  """The devices the newest (or ``step``'s) checkpoint of each run in ``workdir`` is laid out over."""
  need = 1
  for _, run_dir in runs_of(workdir):
    metas = meta_steps(os.path.join(run_dir, "checkpoints"))
    extra = next((e for s, e in metas if step is None or s == step), {})
    need = max(need, recorded_devices(extra) or 1)
  return need


def recorded_devices(extra: dict) -> int | None:
  """The devices a checkpoint's state is laid out over, as its metadata records them (before the
  count was recorded: its config's mesh, when that named a count), or ``None``."""
  if extra.get("num_devices"):
    return int(extra["num_devices"])
  mesh = json.loads(extra.get("config", "{}")).get("mesh", {})
  return int(mesh.get("num_devices") or mesh.get("cpu_devices") or 0) or None
