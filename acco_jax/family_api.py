"""What a family gives the run shell: :class:`Family`, how it describes itself, and :class:`Run`,
what its build returns.

Like :mod:`acco_jax.step_api`, this sits below both the shell (``acco_jax/run``) and the families
(``dp``, ``loco``, ``pipeline``, ``ensemble``), so that a family describes itself and builds its
run without importing the shell: the shell asks the family (:mod:`acco_jax.run.registry` looks it
up by ``config.method``), never the other way round (``tests/import_graph_test.py``). Each
family's ``family.py`` fills a :class:`Family`, and :mod:`acco_jax.families` registers them all.

What the shell would otherwise decide by a family's or a method's name, the family declares
(``packing``, ``state_stays``, ``reads_any_device_count``, ``absorbs_slow_workers``): no module of
``acco_jax/run`` names one as a value (``tests/registry_test.py``).

A family either builds a :class:`Run` that the trainer drives (``build``, handed the config, its
tokens and the model's config, which the shell reads from ``model.*`` and ``model.init``), or
trains a config itself (``train_and_evaluate``: HDEE trains its experts as trainer runs of their
own). The trainer reaches a family only through what its build returns: ``Run.step``, a
:class:`acco_jax.step_api.Step`, and ``ckpt.init_from`` (:mod:`acco_jax.run.init_from`) also
through the source family's ``source_step`` and the steps' :class:`acco_jax.step_api.Portable`
capability (their state as an :class:`acco_jax.ckpt.portable.PortableState`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from acco_jax import data, model, parallel, step_api


def one_update_per_stage(stage: int) -> int:
  """Optimizer updates completed after ``stage`` stages, when every stage is one update."""
  return stage


class Packing(NamedTuple):
  """A family's rule on ``data.packing``: it must be ``required`` (True or False), for ``why``."""

  required: bool
  why: str


def no_packing_rule(config) -> Packing | None:
  """Either ``data.packing`` works."""
  return None


def keeps_no_slow_workers(config) -> bool:
  """Slow workers hold the others up (``health.on_slow=auto`` excludes them)."""
  return False


class Family(NamedTuple):
  """One family as the run shell sees it; the callables import the family's heavy modules on call,
  so that registering every family costs no import."""

  name: str  # its folder under acco_jax/
  methods: tuple[str, ...]  # the values of config.method it runs
  # (config, its tokens: acco_jax.data.TokenData, or empty streams while checking the config,
  # the model's acco_jax.model.ModelConfig) -> a Run, whose step is an acco_jax.step_api.Step
  build: Callable[[Any, Any, Any], Run] | None = None
  # (config, workdir) -> summary: trains it instead of the trainer (the trainer's signature)
  train_and_evaluate: Callable[[Any, str], Any] | None = None
  # (config, model_cfg, num_devices) -> a step of this family's run of ``config`` on this
  # process's first num_devices devices, never run: it reads a checkpoint of that run
  # (``abstract_state``) and exports it (``export_state``; acco_jax.ckpt.portable). None: this
  # family's checkpoints cannot start another run (ckpt.init_from)
  source_step: Callable[[Any, Any, int], Any] | None = None
  # What the shell would otherwise decide by the family's name:
  # (config) -> the data.packing this family's run of ``config`` needs and why, or None
  packing: Callable[[Any], Packing | None] = no_packing_rule
  # why its checkpoints' state cannot start another run kind (ckpt.init_from), or '': it can
  state_stays: str = ""
  # its checkpoints read back on any device count (model.init=run:, the export); False: on as
  # many devices as they were written on, at most
  reads_any_device_count: bool = True
  # (config) -> whether the run absorbs slow workers (health.on_slow=auto keeps them)
  absorbs_slow_workers: Callable[[Any], bool] = keeps_no_slow_workers


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
  """Everything built from the config before the loop starts (a family's build returns it)."""

  mesh: Any
  tokens: data.TokenData
  model_cfg: model.ModelConfig
  params_shapes: Any  # ShapeDtypeStruct tree of the model's parameters
  step: step_api.Step  # the family's step: dp.step.TrainStep, loco.step.LocoStep, ...
  stages_per_update: int
  total_stages: int
  base_microbatches: int  # per device per stage without heterogeneous budgets
  # (stages) -> optimizer updates completed after that many stages (ACCO: two stages an update)
  updates_done: Callable[[int], int] = one_update_per_stage
  batch_axis: Any = parallel.DATA  # the mesh axes a batch's rows are sharded over
  # every process reads the whole global batch (a pipeline: a lane's devices sit on several
  # processes, which must hold the same rows)
  batch_whole: bool = False
