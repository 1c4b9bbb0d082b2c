"""A data-parallel run from a config: ACCO, DDP, ZeRO-1, DPU or WP over a ``data`` mesh.

:func:`build_run` is what :func:`acco_jax.run.build.build` calls for these methods (through
:mod:`acco_jax.dp.family`): the method's transform with its communication format (``comm``), the
per-device microbatch budgets (``hetero``), SkipPipe's layer orders (``pipeline.stages > 0``) and
the compiled :class:`acco_jax.dp.step.TrainStep`. Values that cannot work are one-line
:class:`acco_jax.errors.UserError` s.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax import data, errors, model, optim, parallel
from acco_jax.dp import hetero, layouts, methods, quantize
from acco_jax.dp.flat import FlatLayout
from acco_jax.dp.owner import OwnerLayout
from acco_jax.dp.step import make_train_step
from acco_jax.dp.updates import stage_plan, updates_done
from acco_jax.family_api import Run
from acco_jax.skippipe import orders as pipeline_orders


def build_run(config, tokens: data.TokenData, model_cfg: model.ModelConfig) -> Run:
  """The :class:`acco_jax.family_api.Run` of a data-parallel method."""
  skippipe = config.get("pipeline") is not None and config.pipeline.stages != 0
  mesh = parallel.make_mesh(config.mesh.num_devices)
  k, per_update, total = stage_plan(config)
  shapes = model.param_shapes(model_cfg)
  tx, owned = method(config, mesh.size, shapes)
  loss = lambda p, b: model.loss_fn(p, model_cfg, b)
  budgets, k_max = _budgets(config, mesh.size, k)
  orders = None
  if skippipe:  # a layer order per microbatch, in the batch (acco_jax.skippipe.orders)
    orders = pipeline_orders.LayerOrders(
      config.pipeline, model_cfg, mesh.size * k_max, config.batch.microbatch_size
    )
    loss = pipeline_orders.ordered_loss(model_cfg)
  if config.hetero.slowdown:
    delays = hetero.parse_slowdown(config.hetero.slowdown, mesh.size)
    loss = hetero.slowed(loss, delays, tx.plan.axis_name)
  step = make_train_step(
    loss,
    tx,
    mesh,
    num_microbatches=k_max,
    params=shapes,
    has_aux=True,
    skip_nonfinite=config.train.on_nonfinite == "skip",
    owned=owned,
    elementwise=layouts.optimizer_is_elementwise(config),
  )
  _for_checkpoints(step, config, shapes)
  step.orders, step.budgets = orders, budgets
  if config.hetero.adaptive:
    step.adapt_every = config.hetero.adapt_every
    step.policy = hetero.BudgetPolicy(
      mesh.size,
      base=k,
      k_max=step.num_microbatches,
      policy=config.hetero.adaptive,
      hysteresis=config.hetero.hysteresis,
    )
  return Run(
    mesh=mesh,
    tokens=tokens,
    model_cfg=model_cfg,
    params_shapes=shapes,
    step=step,
    stages_per_update=per_update,
    total_stages=total,
    base_microbatches=k,
    updates_done=functools.partial(updates_done, config),
  )


def method(config, n: int, shapes):
  """The config's method transform on ``n`` devices, around its inner optimizer, and the leaves
  the owner layout owns whole (``None``: every leaf, or not the owner layout)."""
  layout = layouts.for_config(config, n)
  owned = model.muon_mask(shapes) if layout == "owner" and config.opt.name == "muon" else None
  view = OwnerLayout(shapes, n, owned).view if layout == "owner" else None
  inner = optim.from_config(config, shapes, view=view)
  kwargs = {"comm_dtype": jnp.dtype(config.comm_dtype), **comm_args(config, n, shapes)}
  if config.method == "dpu":
    kwargs["warmup_steps"] = int(config.dpu_warmup_updates)
  if config.method in ("acco", "zero1"):
    kwargs["layout"] = layout
  return methods.get_method(config.method, inner, **kwargs), owned


def source_step(config, model_cfg: model.ModelConfig, num_devices: int):
  """The step of a run of ``config`` on this process's first ``num_devices`` devices, never run:
  it reads that run's checkpoints (written on any device count) and exports them
  (:meth:`acco_jax.dp.step.TrainStep.export_state`; ``ckpt.init_from``)."""
  mesh = parallel.make_mesh(num_devices)
  shapes = model.param_shapes(model_cfg)
  no_loss = lambda p, b: 0.0  # the step is not run: its stage program is never traced
  tx, owned = method(config, mesh.size, shapes)
  step = make_train_step(
    no_loss,
    tx,
    mesh,
    num_microbatches=1,
    params=shapes,
    owned=owned,
    elementwise=layouts.optimizer_is_elementwise(config),
  )
  return _for_checkpoints(step, config, shapes)


def _for_checkpoints(step, config, shapes):
  """``step`` with the config's optimizers for checkpoints of other runs: the method transform
  on another device count (the owner layout's masks are in that count's view) and the inner
  optimizer on the model's tree (``ckpt.init_from`` of the owner layout)."""
  step.source_tx = lambda n: method(config, n, shapes)[0]
  step.tree_inner = optim.from_config(config, shapes)
  return step


def comm_args(config, n: int, shapes) -> dict:
  """The method's quantization arguments from the ``comm`` group (none for ``comm.quantize=none``);
  one-line errors for values that cannot work."""
  c = config.get("comm")
  if c is None or c.quantize == "none":
    return {}
  if config.method not in ("acco", "zero1"):
    raise errors.UserValueError(
      f"comm.quantize={c.quantize!r} applies to method acco or zero1, not {config.method}; set "
      "comm.quantize=none"
    )
  size = c.node_size or (jax.local_device_count() if jax.process_count() > 1 else 1)
  out = dict(quantize=c.quantize, block=c.block, error_feedback=c.error_feedback, node_size=size)
  try:
    quantize.check(**out)
    plan = methods.CommPlan(config.method, **out)
    quantize.check_plan(plan, n, FlatLayout(shapes, n).shard_size)
  except ValueError as e:  # name the config keys
    message = re.sub(r"\b(quantize|block|error_feedback|node_size)=", r"comm.\1=", str(e))
    raise errors.UserValueError(message) from None
  return out


def _budgets(config, n: int, k: int) -> tuple[np.ndarray | None, int]:
  """(fixed per-device budgets or None, the step's block of microbatches per device)."""
  h = config.hetero
  if h.budgets and h.adaptive:
    raise errors.UserValueError(
      "hetero.budgets and hetero.adaptive are exclusive: set one of them to ''"
    )
  if h.budgets:
    budgets = hetero.parse_budgets(h.budgets, n)
    return budgets, int(budgets.max())
  if h.adaptive:
    if h.adaptive not in hetero.POLICIES:
      raise errors.UserValueError(
        f"hetero.adaptive={h.adaptive!r}: choose one of {', '.join(hetero.POLICIES)} (or '')"
      )
    k_max = int(h.max_microbatches) or 4 * k
    if k_max < k or h.adapt_every < 1:
      raise errors.UserValueError(
        f"hetero.max_microbatches={k_max} must be >= the base budget {k} per stage and "
        f"hetero.adapt_every={h.adapt_every} >= 1"
      )
    return None, k_max
  return None, k
