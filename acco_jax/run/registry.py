"""The families the run shell dispatches to, by ``config.method``: filled by the families.

The run shell never imports a family (``dp``, ``loco``, ``pipeline``, ``ensemble``): each family's
``family.py`` describes itself as a :class:`Family`, and :mod:`acco_jax.families` registers them
all when the package is imported. A new family is one folder plus one line there.

What the shell would otherwise decide by a family's or a method's name, the family declares
(:class:`Family`'s ``packing``, ``state_stays``, ``reads_any_device_count``,
``absorbs_slow_workers``): no module of ``acco_jax/run`` names one as a value
(``tests/registry_test.py``).

A family either builds a :class:`acco_jax.run.build.Run` that the trainer drives (``build``), or
trains a config itself (``train_and_evaluate``: HDEE trains its experts as trainer runs of their own). The trainer
reaches a family only through what its build returns: ``Run.step``, a
:class:`acco_jax.step_api.Step` (the interface every family's step implements), and
``ckpt.init_from`` (:mod:`acco_jax.run.init_from`) also
through the source family's ``source_step`` and the steps' :class:`acco_jax.step_api.Portable`
capability (their state as an :class:`acco_jax.ckpt.portable.PortableState`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from acco_jax import errors


def one_update_per_stage(config, stage: int) -> int:
  """Optimizer updates completed after ``stage`` stages, when every stage is one update."""
  return stage


class Packing(NamedTuple):
  """A family's rule on ``data.packing``: it must be ``required`` (True or False) because ``why``."""

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
  # (config, its tokens: acco_jax.data.TokenData, or empty streams while checking the config) ->
  # acco_jax.run.build.Run, whose step is an acco_jax.step_api.Step
  build: Callable[[Any, Any], Any] | None = None
  # (config, workdir) -> summary: trains it instead of the trainer (the trainer's signature)
  train_and_evaluate: Callable[[Any, str], Any] | None = None
  updates_done: Callable[[Any, int], int] = one_update_per_stage  # (config, stages) -> updates
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


_BY_METHOD: dict[str, Family] = {}  # in registration order


def register(family: Family) -> Family:
  """Adds ``family``'s methods (each method belongs to one family)."""
  for method in family.methods:
    owner = _BY_METHOD.get(method)
    if owner is not None and owner.name != family.name:
      raise ValueError(f"method {method!r} is registered by family {owner.name!r} already")
  _BY_METHOD.update(dict.fromkeys(family.methods, family))
  return family


def methods() -> tuple[str, ...]:
  """Every registered method, in registration order."""
  return tuple(_BY_METHOD)


def lookup(method: str) -> Family:
  """The family that runs ``method``, or the one-line error that lists the methods."""
  family = _BY_METHOD.get(method)
  if family is None:
    raise errors.UserValueError(
      f"method={method!r} is unknown: choose one of {', '.join(methods())}"
    )
  return family
