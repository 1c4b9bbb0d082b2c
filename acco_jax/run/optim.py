"""The inner optimizer and learning-rate schedule from a config (pure optax).

Schedules count optimizer *updates* (commits), never microbatches or stages, so ACCO, ZeRO-1 and DPU
runs with the same ``num_updates`` see the same learning rate at the same update.
"""

from __future__ import annotations

import optax

from acco_jax import errors

SCHEDULES = ("cosine", "constant", "linear")


def schedule(opt, num_updates: int) -> optax.Schedule:
  """Linear warm-up over ``opt.warmup_updates``, then ``opt.schedule`` down to ``lr * min_lr_ratio``."""
  if opt.schedule not in SCHEDULES:
    raise errors.UserValueError(
      f"opt.schedule={opt.schedule!r} is unknown: choose one of {', '.join(SCHEDULES)}"
    )
  if opt.lr <= 0:
    raise errors.UserValueError(f"opt.lr must be > 0, got {opt.lr}")
  warmup = int(opt.warmup_updates)
  if not 0 <= warmup < max(num_updates, 1):
    raise errors.UserValueError(
      f"opt.warmup_updates={warmup} must be in [0, train.num_updates={num_updates}); lower it"
    )
  peak, floor = opt.lr, opt.lr * opt.min_lr_ratio
  decay_steps = max(num_updates - warmup, 1)
  if opt.schedule == "constant":
    after = optax.constant_schedule(peak)
  elif opt.schedule == "linear":
    after = optax.linear_schedule(peak, floor, decay_steps)
  else:
    after = optax.cosine_decay_schedule(peak, decay_steps, alpha=opt.min_lr_ratio)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def inner_optimizer(opt, num_updates: int, decay_mask=None) -> optax.GradientTransformation:
  """``clip_by_global_norm`` (if ``opt.clip_norm > 0``) then AdamW, with the LR injected for logging.

  Args:
    opt: the ``config.opt`` dict: ``lr``, ``b1``, ``b2``, ``eps``, ``weight_decay``, ``clip_norm``,
      ``schedule``, ``warmup_updates``, ``min_lr_ratio``, ``name`` (``adamw`` | ``sgd`` | ``lion``).
    num_updates: total optimizer updates (the schedule's horizon).
    decay_mask: a pytree of bools shaped like the params (weight decay where True), or None for all.

  Returns:
    An optax transform; ``acco_jax.hyperparams(state)['learning_rate']`` reads the current LR.
  """
  lr = schedule(opt, num_updates)
  if opt.name == "adamw":
    base = optax.inject_hyperparams(optax.adamw)(
      learning_rate=lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
      mask=decay_mask,
    )  # fmt: skip
  elif opt.name == "sgd":
    base = optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=opt.b1 or None)
  elif opt.name == "lion":
    base = optax.inject_hyperparams(optax.lion)(
      learning_rate=lr, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask
    )
  else:
    raise errors.UserValueError(f"opt.name={opt.name!r} is unknown: choose adamw, sgd or lion")
  if opt.clip_norm and opt.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(opt.clip_norm), base)
  return base


def find_state(state, predicate):
  """The first node of an optax state (tuples, lists and dicts, depth first) that ``predicate``
  accepts, or None."""
  if predicate(state):
    return state
  if isinstance(state, tuple | list):
    for s in state:
      found = find_state(s, predicate)
      if found is not None:
        return found
  if isinstance(state, dict):
    for s in state.values():
      found = find_state(s, predicate)
      if found is not None:
        return found
  return None


def hyperparams(opt_state) -> dict:
  """The ``hyperparams`` dict of the first ``optax.inject_hyperparams`` state inside ``opt_state``.

  For ACCO these are the values of the last commit. Returns ``{}`` when nothing is injected.
  """
  found = find_state(
    opt_state, lambda s: hasattr(s, "hyperparams") and isinstance(s.hyperparams, dict)
  )
  return {} if found is None else dict(found.hyperparams)
