"""The inner optimizer and learning-rate schedule from a config (pure optax).

Schedules count optimizer *updates* (commits), never microbatches or stages, so ACCO, ZeRO-1 and DPU
runs with the same ``num_updates`` see the same learning rate at the same update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from acco_jax import errors, model
from acco_jax.optax_state import find_state

SCHEDULES = ("cosine", "constant", "linear")
# Muon orthogonalises the last two axes of a leaf; leading axes (stacked blocks) are batch axes.
MUON_DIMS = optax.contrib.MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)


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


def inner_optimizer(
  opt, num_updates: int, decay_mask=None, muon_mask=None
) -> optax.GradientTransformation:
  """:func:`clip_by_global_norm` (if ``opt.clip_norm > 0``) then ``opt.name``'s optimizer, with the
  LR injected for logging.

  Args:
    opt: the ``config.opt`` dict: ``lr``, ``b1``, ``b2``, ``eps``, ``weight_decay``, ``clip_norm``,
      ``schedule``, ``warmup_updates``, ``min_lr_ratio``, ``name`` (``adamw`` | ``sgd`` | ``lion``
      | ``muon``); for ``muon`` also ``muon_lr``, ``momentum``, ``ns_steps``.
    num_updates: total optimizer updates (the schedule's horizon).
    decay_mask: a pytree of bools shaped like the tree the optimizer sees (weight decay where
      True), or None for all. Muon's leaves are all decayed.
    muon_mask: ``muon`` only: a pytree of bools shaped like that tree, True for Muon's leaves
      (:func:`acco_jax.model.muon_mask`), False for AdamW's.

  Returns:
    An optax transform; ``acco_jax.hyperparams(state)['learning_rate']`` reads the current LR
    (AdamW's under ``muon``; Muon's is ``muon_learning_rate``).
  """
  lr = schedule(opt, num_updates)
  if opt.name == "adamw":
    base = optax.inject_hyperparams(optax.adamw)(
      learning_rate=lr,
      b1=opt.b1,
      b2=opt.b2,
      eps=opt.eps,
      weight_decay=opt.weight_decay,
      mask=decay_mask,
    )
  elif opt.name == "sgd":
    base = optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=opt.b1 or None)
  elif opt.name == "lion":
    base = optax.inject_hyperparams(optax.lion)(
      learning_rate=lr, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask
    )
  elif opt.name == "muon":
    if muon_mask is None:
      raise errors.UserValueError("opt.name=muon needs to know the blocks' matrices (muon_mask)")
    if opt.muon_lr <= 0 or opt.ns_steps < 1:
      raise errors.UserValueError(
        f"opt.muon_lr={opt.muon_lr} must be > 0 and opt.ns_steps={opt.ns_steps} >= 1"
      )
    # One schedule for both: Muon's LR is opt.muon_lr / opt.lr times AdamW's at every update.
    # Muon's orthogonalised update has every singular value ~1 whatever the gradient's scale, so
    # it takes a far larger LR than AdamW (modded-nanogpt: ~0.02-0.05 for Muon, ~1e-3 for Adam).
    ratio = opt.muon_lr / opt.lr
    base = optax.inject_hyperparams(muon_adamw, static_args=("ns_steps",))(
      learning_rate=lr,
      muon_learning_rate=lambda t: lr(t) * ratio,
      momentum=opt.momentum,
      ns_steps=int(opt.ns_steps),
      b1=opt.b1,
      b2=opt.b2,
      eps=opt.eps,
      weight_decay=opt.weight_decay,
      muon_mask=muon_mask,
      decay_mask=decay_mask,
    )
  else:
    raise errors.UserValueError(
      f"opt.name={opt.name!r} is unknown: choose adamw, sgd, lion or muon"
    )
  if opt.clip_norm and opt.clip_norm > 0:
    return optax.chain(clip_by_global_norm(opt.clip_norm), base)
  return base


def muon_adamw(
  learning_rate,
  muon_learning_rate,
  muon_mask,
  *,
  momentum=0.95,
  ns_steps=5,
  b1=0.9,
  b2=0.95,
  eps=1e-8,
  weight_decay=0.0,
  decay_mask=None,
) -> optax.GradientTransformation:
  """``optax.contrib.muon`` on the leaves ``muon_mask`` marks, ``optax.adamw`` on the others.

  Muon (momentum ``momentum``, ``ns_steps`` Newton–Schulz iterations on the last two axes of each
  leaf, decoupled weight decay on all its leaves) at ``muon_learning_rate``; AdamW (``b1``,
  ``b2``, ``eps``, ``weight_decay`` where ``decay_mask``) at ``learning_rate``. Every transform
  here is per leaf, so the owner layout may run it on each device's matrices alone.

  References:
    Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024
    (modded-nanogpt).
  """
  dims = lambda tree: jax.tree.map(lambda _: MUON_DIMS, tree)
  muon = optax.contrib.muon(
    muon_learning_rate,
    ns_steps=ns_steps,
    beta=momentum,
    weight_decay=weight_decay,
    muon_weight_dimension_numbers=dims,
  )
  adamw = optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay, mask=decay_mask)
  labels = jax.tree.map(lambda m: "muon" if m else "adamw", muon_mask)
  return optax.partition({"muon": muon, "adamw": adamw}, labels)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """``optax.clip_by_global_norm``, whose norm a caller that sees only part of the tree may give.

  ``update(..., global_norm=n)`` scales by ``max_norm / n`` when ``n >= max_norm``; without it, the
  norm is the updates' own, exactly as optax's. The owner layout
  (:meth:`acco_jax.dp.stage.StageProgram.update`) runs the optimizer vmapped over each device's
  items and passes the norm of the whole reduced gradient, so the clip stays global.
  """

  def update_fn(updates, state, params=None, *, global_norm=None, **extra_args):
    del params, extra_args
    norm = optax.tree.norm(updates) if global_norm is None else jnp.asarray(global_norm)
    trigger = jnp.squeeze(norm < max_norm)
    clip = lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)
    return jax.tree.map(clip, updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def hyperparams(opt_state) -> dict:
  """The ``hyperparams`` dict of the first ``optax.inject_hyperparams`` state inside ``opt_state``.

  For ACCO these are the values of the last commit. Returns ``{}`` when nothing is injected.
  """
  found = find_state(
    opt_state, lambda s: hasattr(s, "hyperparams") and isinstance(s.hyperparams, dict)
  )
  return {} if found is None else dict(found.hyperparams)


def from_config(config, shapes, decay_mask=model.decay_mask, view=None):
  """The inner optimizer of a run's ``config`` (its ``opt`` group, over ``train.num_updates``).

  ``decay_mask`` maps the parameters' shapes to the weight-decay mask of ``opt.decay=matrices``
  (its layout is the step's). ``view`` maps a per-leaf tree like the parameters (a mask) to the
  structure the optimizer sees (the owner layout's :meth:`acco_jax.dp.owner.OwnerLayout.view`);
  default: that structure is the parameters'."""
  if config.opt.decay not in ("matrices", "all"):
    raise errors.UserValueError(f"opt.decay={config.opt.decay!r}: choose 'matrices' or 'all'")
  view = view or (lambda tree: tree)
  mask = view(decay_mask(shapes)) if config.opt.decay == "matrices" else None
  muon = view(model.muon_mask(shapes)) if config.opt.name == "muon" else None
  return inner_optimizer(config.opt, config.train.num_updates, mask, muon)
