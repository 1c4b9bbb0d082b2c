"""One HDEE job and which jobs a run trains.

A job (a seed model, one expert on one domain, the dense reference) is an ordinary run of the
project's trainer in ``<workdir>/<job name>``; its final parameters go to ``params.npz`` (written
atomically), which the next job of the same expert starts from. ``hdee.jobs`` gives a run a share
of the recipe's jobs, so runs on other processes or hosts can share one workdir.
"""

from __future__ import annotations

import fnmatch
import os
import uuid

import jax
import ml_collections
import numpy as np

from acco_jax import errors, model
from acco_jax.ensemble import budgets

# -- parameters on disk ----------------------------------------------------------------------------


def save_params(path: str, params) -> None:
  leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(jax.device_get(params))]
  tmp = f"{path}.{uuid.uuid4().hex}.npz"
  np.savez(tmp, *leaves)
  os.replace(tmp, path)  # a kill leaves no half-written params.npz


def load_params(path: str, cfg: model.ModelConfig):
  shapes = model.param_shapes(cfg)
  with np.load(path) as f:
    leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
  return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


# -- jobs ------------------------------------------------------------------------------------------


def job_config(config, job: budgets.Job, source: str, overrides: dict[str, int]):
  """The trainer config of one job: the recipe's, with its data, size and steps."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.method = config.hdee.method
  c.data.source = source
  for k, v in overrides.items():
    c.model[k] = v
  c.train.num_updates = job.steps
  c.opt.warmup_updates = min(config.opt.warmup_updates, job.steps // 10)
  c.train.eval_every, c.train.sample_tokens = 0, 0
  return c


def run_job(plan, workdir: str, job: budgets.Job, source: str, max_stages=None) -> bool:
  """Trains ``job`` unless done; True once its ``params.npz`` exists."""
  from acco_jax.run import trainer  # the shell: orbax, TFDS

  jobdir = os.path.join(workdir, job.name)
  out = os.path.join(jobdir, "params.npz")
  if os.path.isfile(out):
    return True
  cfg = plan.model_cfgs[job.size]
  init = load_params(os.path.join(workdir, job.init, "params.npz"), cfg) if job.init else None
  print(
    f"hdee: {job.name}: size {job.size}, {job.steps} steps on {job.domain}, {job.flops:.3g} FLOPs",
    flush=True,
  )
  trainer.train_and_evaluate(
    job_config(plan.config, job, source, plan.sizes[job.size]),
    jobdir,
    max_stages=max_stages,
    init_params=init,
    on_params=lambda p: save_params(out, p),
  )
  return os.path.isfile(out)


def done(workdir: str, job: budgets.Job) -> bool:
  return os.path.isfile(os.path.join(workdir, job.name, "params.npz"))


def selector(globs: list[str], jobs: list[budgets.Job], workdir: str):
  """Which of the recipe's ``jobs`` (in recipe order) this run trains: those whose name matches
  one of ``globs`` (``hdee.jobs``; none = all). Checked before anything is written: every glob
  names a job, and a selected job's parent is done already or selected too (it runs first)."""
  if not globs:
    return lambda job: True
  names = [j.name for j in jobs]
  for g in globs:
    if not any(fnmatch.fnmatchcase(n, g) for n in names):
      raise errors.UserValueError(
        f"hdee.jobs: {g!r} matches no job of this recipe ({', '.join(names)}): fix the glob"
      )
  chosen = {n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)}
  for job in jobs:
    parent = next((j for j in jobs if j.name == job.init), None)
    if job.name in chosen and parent and parent.name not in chosen and not done(workdir, parent):
      raise errors.UserValueError(
        f"hdee.jobs: job {job.name!r} starts from {parent.name!r}, which is neither done in "
        f"{workdir!r} nor selected: run it first, or add it to hdee.jobs"
      )
  return lambda job: job.name in chosen


def left_to_others(pending: list[str], why: str) -> dict:
  print(
    f"hdee: this run's jobs are done; {len(pending)} job(s) of the recipe are not: "
    f"{', '.join(pending)}; {why} (rerun with their hdee.jobs, or without it)",
    flush=True,
  )
  return {}
