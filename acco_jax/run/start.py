"""Where a run starts: this workdir's newest checkpoint, another run's (``ckpt.init_from``), or a fresh
initialisation.

Nothing is written to the workdir here: a config that cannot resume the run in it (another model,
another stream) fails with the workdir as it was. A checkpoint written on another device count is
resharded (:mod:`acco_jax.dp.reshard`): weights and optimizer state exactly, gradient buffers by
their sums. The stage count, hence the schedule, carries over; the global batch is then n/n_old
times as large, and the data continues from the same number of consumed rows
(:func:`acco_jax.data.data_state`).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import data, model
from acco_jax.ckpt import checkpoint, meta
from acco_jax.family_api import Run
from acco_jax.run import init_from as init_from_lib
from acco_jax.run import pretrained
from acco_jax.run.streams import prime_batch


@functools.lru_cache(maxsize=8)
def initializer(mesh):
  """``init_params`` as one program (eagerly, each initializer op compiles on its own: dozens of
  small programs), the seed traced, its output replicated over ``mesh``: the step's ``init`` then
  slices it into its shardings inside its own program (an array on one device would be cut into
  each device's piece by one small slicing program per leaf shape)."""
  return jax.jit(model.init_params, static_argnums=0, out_shardings=NamedSharding(mesh, P()))


class LoopStart(NamedTuple):
  """What the stage loop starts from: a restored checkpoint, an imported state or a fresh one."""

  state: Any  # the step's state, placed
  stage: int  # stages done
  tokens_seen: int
  extra: dict  # the restored checkpoint's metadata ({} otherwise)
  events: list  # (name, fields) for metrics.jsonl, written once the workdir may be
  ckpt: checkpoint.Checkpointer | None  # open on this workdir's checkpoints, if it has any


def open_checkpointer(config, workdir: str) -> checkpoint.Checkpointer:
  return checkpoint.Checkpointer(
    os.path.join(workdir, "checkpoints"), keep=config.ckpt.keep, async_save=config.ckpt.async_save
  )


def restore_or_init(
  run: Run, config, workdir: str, stream, rows_per_stage: int, init_params, lead: bool
) -> LoopStart:
  """The state the run starts from, and the data ``stream`` set to its position."""
  has_dir = os.path.isdir(os.path.join(workdir, "checkpoints"))
  ckpt = open_checkpointer(config, workdir) if has_dir else None
  if ckpt is not None and ckpt.latest_step() is not None:
    try:
      return _restore(run, config, workdir, ckpt, stream, rows_per_stage, lead)
    except BaseException:
      ckpt.close()
      raise
  if ckpt is not None:  # no step saved yet: opened again to save the first
    ckpt.close()
  events = []
  if config.ckpt.init_from:  # another run's checkpoint, maybe of another kind (init_from.py)
    imported = init_from_lib.start(run, config, stream, rows_per_stage)
    state, start, tokens_seen = imported.state, imported.stage, imported.tokens_seen
    events.append(("initialized_from", imported.event))
    if lead:
      print(imported.line, flush=True)
  else:
    start, tokens_seen = 0, 0
    state = run.step.init(_params(run, config, init_params, events, lead), prime_batch(run, config))
  events.append(("config", dict(config=json.loads(config.to_json_best_effort()))))
  return LoopStart(state, start, tokens_seen, {}, events, None)


def _restore(run: Run, config, workdir: str, ckpt, stream, rows_per_stage: int, lead) -> LoopStart:
  """The newest intact checkpoint of this workdir, on this run's mesh (another device count:
  resharded), and the data position it recorded."""
  step, n, events, moved = run.step, run.mesh.size, [], []

  def reshard(saved):
    moved.append(True)
    return step.reshard(saved)  # LoCo and pipeline steps refuse another mesh

  def check(extra):  # before any array is read: the clearest message for a config change
    meta.check_vocab(extra, run.model_cfg)
    meta.check_comm(extra, config, step)  # LoCo steps keep no residual: always the same
    step.check_checkpoint(extra)  # e.g. a pipeline's scheduled plan

  target = step.abstract_state(run.params_shapes)
  restore_t0 = time.time()
  state, extra = ckpt.restore(
    None, target, reshard=reshard, check_extra=check, saved_like=step.saved_like
  )
  start, tokens_seen = int(extra["stage"]), int(extra.get("tokens_seen", 0))
  position = extra["data"]
  if moved:
    position = data.data_state(position, rows_per_stage)
  stream.set_state(position)
  if moved:
    old = meta.recorded_devices(extra)  # None: written before the count was recorded
    events.append(("resharded", dict(stage=start, from_devices=old, to_devices=n)))
    if lead:
      print(
        f"resharded the checkpoint of stage {start} from {old or 'another count of'} to {n} "
        f"devices; data continues at global batch {position['step']}",
        flush=True,
      )
  took = time.time() - restore_t0
  events.append(("restored", dict(stage=start, workdir=workdir, restore_s=took, time=time.time())))
  if config.ckpt.init_from and lead:
    print(
      f"ckpt.init_from ignored: resuming from this workdir's checkpoint of stage {start}",
      flush=True,
    )
  return LoopStart(state, start, tokens_seen, extra, events, ckpt)


def _params(run: Run, config, init_params, events: list, lead: bool):
  """A fresh run's parameters: pretrained (``model.init``), given (``init_params``) or drawn."""
  if pretrained.source(config) is not None:  # pretrained weights (model.init)
    t0 = time.time()
    params = pretrained.load_params(config, run.model_cfg, run.mesh)
    events.append(("pretrained", dict(init=config.model.init, load_s=time.time() - t0)))
    if lead:
      took = time.time() - t0
      line = f"initialized from {config.model.init} ({run.model_cfg.arch}, {took:.1f} s)"
      print(f"{line}: update 0, a fresh optimizer", flush=True)
  else:
    params = initializer(run.mesh)(run.model_cfg, config.train.seed)
  if init_params is not None:
    params = jax.tree.map(
      lambda p, q: jax.device_put(jnp.asarray(q, p.dtype), p.sharding), params, init_params
    )
  return params
