"""A run's checkpoints read back, read-only: what the run recorded (its config, model, tokenizer
and device count) and its committed parameters, for ``python -m acco_jax.export`` and
``model.init=run:<workdir>`` (:mod:`acco_jax.run.pretrained`).

The metadata is plain JSON, read before JAX is imported: the export picks its platform and device
count from it (JAX reads ``JAX_PLATFORMS`` when imported), so the parameters' imports are lazy.
"""

from __future__ import annotations

import json
import os

from acco_jax import errors


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


def read_params(workdir: str, step: int | None = None):
  """The committed parameters of the newest (or ``step``'s) checkpoint of the run in ``workdir``
  (read-only), as float32 numpy leaves in the model's structure.

  Returns:
    ``(params, the model config, the checkpoint's extra)``: the model as the run recorded it
    (its dtype and vocabulary padding included).
  """
  import jax
  import ml_collections

  from acco_jax import model
  from acco_jax.run import presets, registry
  from acco_jax.run.checkpoint import open_read_only

  found = {}

  def target_of(extra: dict):
    src = ml_collections.ConfigDict(json.loads(extra["config"]))
    if "model" in extra:
      cfg = model.ModelConfig(**extra["model"])
    else:  # written before the model was recorded: from its config
      cfg = presets.named(src, extra["vocab"]["V"], **presets.settings(src))
    family = registry.lookup(src.method)
    if family.source_step is None:
      raise errors.UserValueError(f"{workdir}: checkpoints of method={src.method} do not export")
    n = int(extra.get("num_devices", 0)) or len(jax.devices())
    if not family.reads_any_device_count and n > len(jax.devices()):
      raise errors.UserValueError(
        f"{workdir}: a {src.method} checkpoint is laid out over its {n} devices, this process "
        f"has {len(jax.devices())}: read it on the CPU (JAX_PLATFORMS=cpu) or a machine with as "
        "many"
      )
    n = min(n, len(jax.devices()))  # the other families read a checkpoint of any device count
    found.update(src=src, cfg=cfg, step=family.source_step(src, cfg, n))
    return found["step"].abstract_state(model.param_shapes(cfg))

  with open_read_only(os.path.join(workdir, "checkpoints")) as ckpt:
    if not ckpt.all_steps():
      raise errors.UserValueError(f"{workdir}: holds no checkpoint to read")
    saved, extra = ckpt.restore_host(
      step, target_of, lambda shapes: found["step"].saved_like(shapes)
    )
  return found["step"].export_params(saved), found["cfg"], {**extra, "source": found["src"]}
