"""Which layout a method's optimizer runs on, and what an inner optimizer may do on it.

A sharded method (ZeRO-1, ACCO) runs its inner optimizer on shards. The elementwise layout
(:mod:`acco_jax.dp.flat`) cuts every leaf into ``N`` chunks, which only an elementwise optimizer
(AdamW, SGD, Lion) can take; the owner layout (:mod:`acco_jax.dp.owner`) gives each device whole
matrices (Muon, Adafactor) and runs the optimizer vmapped over each device's slots. ``layout='auto'``
(the transforms' default, as the config's ``comm.layout=auto``) takes the owner layout exactly when
the inner optimizer is not elementwise, judged by its state: state shaped unlike the parameters
(Adafactor's factored moments, Muon's split between matrices and the rest by their rank).

On the owner layout a transform that reads every leaf sees one device's slots only. The step gives
:func:`acco_jax.optim.clip_by_global_norm` the norm of the whole gradient; an
``optax.clip_by_global_norm`` that the inner optimizer applies first (``optax.chain(
optax.clip_by_global_norm(c), ...)``, found by :func:`leading_global_clip`) is applied by the step
to the whole gradient before the per-slot update, where its copy then never triggers (a slot's norm
is at most the clipped whole one); any other coupling is refused (:func:`check_per_leaf`).

This module is the one place that validates and chooses a layout: a transform's ``layout=``
(:func:`check_name`), a config's ``comm.layout`` (:func:`asked`, :func:`for_config`: one-line
errors before anything is built) and the step's resolution of ``auto`` on the actual optimizer
(:func:`choose`).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax import errors
from acco_jax.dp.flat import FlatLayout, TreeLayout
from acco_jax.dp.owner import OwnerLayout

LAYOUTS = ("auto", "elementwise", "owner")
OWNER_METHODS = ("acco", "zero1")  # the sharded methods whose optimizer can own whole matrices
SHARDED_METHODS = ("acco", "zero1", "dpu", "wp")


def check_name(layout: str, quantize: str) -> str:
  """A method transform's ``layout=`` argument, checked (one-line ``ValueError``)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} is unknown: choose one of {', '.join(LAYOUTS)}")
  if layout == "owner" and quantize != "none":
    raise ValueError(f"layout='owner' does not take quantize={quantize!r} yet: use quantize='none'")
  return layout


def asked(config) -> str:
  """The config's ``comm.layout``, a known value (every family checks it, whether it reads it or
  not: a typo is refused, never ignored)."""
  comm = config.get("comm")
  layout = "auto" if comm is None else comm.get("layout", "auto")
  if layout not in LAYOUTS:
    raise errors.UserValueError(
      f"comm.layout={layout!r} is unknown: choose one of {', '.join(LAYOUTS)}"
    )
  return layout


def optimizer_is_elementwise(config) -> bool:
  """Whether ``opt.name``'s update is elementwise: all but Muon (whose state is, so that
  :func:`is_elementwise`, which reads state shapes, would not tell)."""
  return config.opt.name != "muon"


def for_config(config, n: int, method: str | None = None) -> str:
  """``comm.layout`` resolved for ``method`` (default the config's; a LoCo run's inner step:
  ``loco.inner``) on ``n`` devices: ``owner`` (each weight matrix whole on one device) or
  ``elementwise``; ``auto`` takes ``owner`` exactly when the inner optimizer is not elementwise
  (``opt.name=muon``). One-line errors for what cannot run."""
  layout, method = asked(config), method or config.method
  if method not in SHARDED_METHODS:  # ddp: every device has every leaf
    return "elementwise"
  elementwise = optimizer_is_elementwise(config)
  if method in ("dpu", "wp"):
    if layout == "owner" or not elementwise:
      raise errors.UserValueError(
        f"method={method} shards its optimizer elementwise only: opt.name="
        f"{config.opt.name} with the owner layout runs under acco, zero1 (or ddp)"
      )
    return "elementwise"
  if layout == "elementwise" and not elementwise:
    raise errors.UserValueError(
      f"comm.layout=elementwise cuts every matrix into {n} chunks, but opt.name="
      f"{config.opt.name} updates whole matrices: set comm.layout=owner (or auto)"
    )
  resolved = layout if layout != "auto" else "elementwise" if elementwise else "owner"
  if resolved == "owner" and config.comm.quantize != "none":
    raise errors.UserValueError(
      f"comm.quantize={config.comm.quantize} does not run with the owner layout (comm.layout="
      f"{layout}, opt.name={config.opt.name}) yet: set comm.quantize=none"
    )
  return resolved


def choose(tx, plan, params_like, num_devices: int, owned, elementwise, replica_axis):
  """``(plan, layout, clip)``: the plan with its layout resolved ('auto' -> 'elementwise' or
  'owner'), the layout object, and the max norm of a leading ``optax.clip_by_global_norm`` the
  step applies for the owner layout (``None``). One-line ``ValueError`` s for what cannot run."""
  if plan.sharded and plan.layout == "auto" and plan.name in OWNER_METHODS:
    if plan.quantize == "none":
      flat = FlatLayout(params_like, num_devices)
      if not (is_elementwise(tx, params_like, flat) if elementwise is None else elementwise):
        plan = plan._replace(layout="owner")
  if plan.sharded and plan.layout == "owner":
    layout = OwnerLayout(params_like, num_devices, owned)
    clip = leading_global_clip(getattr(tx, "inner", None))
    check_per_leaf(tx, plan.name, jax.eval_shape(layout.to_shards, params_like), clip)
    return plan, layout, clip
  layout = FlatLayout(params_like, num_devices)
  if elementwise is None:
    elementwise = is_elementwise(tx, params_like, layout)
  check_elementwise(plan, elementwise)
  if not plan.sharded and replica_axis is None and not elementwise:
    layout = TreeLayout(params_like, num_devices)  # ddp(muon): whole parameters
  return plan, layout, None


def check_elementwise(plan, elementwise: bool) -> None:
  """Rejects a non-elementwise inner optimizer on the elementwise layout of a sharded method."""
  if plan.sharded and not elementwise:
    raise ValueError(
      f"method {plan.name!r} shards the optimizer elementwise (ZeRO-1), but the inner "
      "optimizer keeps state shaped differently from the parameters (e.g. Adafactor's factored "
      "moments, Muon's whole-matrix update): use the owner layout (comm.layout=owner; "
      "layout='owner' or 'auto' in acco or zero1), an elementwise optimizer (adamw, sgd, lion) or ddp"
    )


def is_elementwise(tx, params_like, layout) -> bool:
  """Whether ``tx`` keeps the same state on ``layout``'s ``[N, s_l]`` chunks as on the params."""
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.float32), params_like)
  full = jax.eval_shape(tx.init, shapes)
  flat = jax.eval_shape(tx.init, layout.shard_shapes())
  allowed = {}
  for spec in layout.specs:
    allowed.setdefault(spec.shape, set()).add((layout.num_shards, spec.chunk))
  full_leaves, full_def = jax.tree.flatten(full)
  flat_leaves, flat_def = jax.tree.flatten(flat)
  return full_def == flat_def and all(
    a.shape == b.shape or b.shape in allowed.get(a.shape, ())
    for a, b in zip(full_leaves, flat_leaves, strict=True)
  )


def leading_global_clip(tx) -> float | None:
  """The ``max_norm`` of an ``optax.clip_by_global_norm`` that ``tx`` applies before anything else
  (``tx`` itself, or the first transform of an ``optax.chain``, nested chains and optax's extra-
  argument wrappers included), else ``None``. Read off optax's closures: an optax that builds them
  otherwise gives ``None``, and :func:`check_per_leaf` then refuses the clip as any coupling."""
  fn = getattr(tx, "update", None)
  for _ in range(16):
    name = getattr(fn, "__qualname__", "")
    try:
      found = inspect.getclosurevars(fn).nonlocals
    except TypeError:
      return None
    if name.startswith("clip_by_global_norm.") and fn.__module__.startswith("optax."):
      norm = found.get("max_norm")
      return float(norm) if isinstance(norm, int | float) else None
    if name.startswith("chain.") and found.get("update_fns"):
      fn = found["update_fns"][0]
    elif name.startswith("with_extra_args_support.") and "tx" in found:
      fn = found["tx"].update
    else:
      return None
  return None


def check_per_leaf(tx, name: str, view_like, clip: float | None = None) -> None:
  """Rejects an inner optimizer whose update of one leaf reads another (for the owner layout).

  The owner layout runs the optimizer vmapped over the devices' slots, so a transform coupling
  leaves would see one device's only. Probed on ``view_like``'s structure with every dimension cut
  to 3: the update of the first and of the last leaf must not change when all the other gradients
  are scaled by 100. With a leading global clip of ``clip`` (applied by the step to the whole
  gradient), the probes stay below it, where the step's copy of that clip does nothing.
  """
  small = [
    jax.ShapeDtypeStruct(tuple(min(int(d), 3) for d in x.shape[1:]), jnp.float32)
    for x in jax.tree.leaves(view_like)
  ]
  treedef = jax.tree.structure(view_like)
  # the probes drawn on the host: an eager jax.random call compiles a program per leaf shape
  rng = np.random.default_rng(0)
  grads = [rng.standard_normal(x.shape, np.float32) for x in small]
  if clip is not None:  # every probe's norm well below the clip: 100 x the whole norm < clip / 2
    whole = float(np.sqrt(sum(float(np.sum(g * g)) for g in grads)))
    grads = [g * np.float32(clip / (200 * whole)) for g in grads]
  params = treedef.unflatten([rng.standard_normal(x.shape, np.float32) for x in small])

  @jax.jit  # one program for the three probes (run eagerly, each optax op compiles on its own)
  def update(scales):  # a global-norm clip that takes the norm as an argument reads nothing else
    g = treedef.unflatten([x * s for x, s in zip(grads, scales, strict=True)])
    return jax.tree.leaves(tx.update(g, tx.init(params), params, global_norm=jnp.float32(1e-30))[0])

  base = update(jnp.ones(len(small)))
  for i in {0, len(small) - 1}:
    other = update(jnp.asarray([1.0 if j == i else 100.0 for j in range(len(small))]))
    if not np.allclose(base[i], other[i], rtol=1e-5, atol=1e-7):
      raise ValueError(
        f"method {name!r} with layout='owner' runs the inner optimizer on each device's "
        "items alone, but its update of one leaf reads others: use per-leaf transforms "
        "(clip_by_block_rms, muon, adafactor, adamw), a global-norm clip first in the chain "
        "(optax.clip_by_global_norm or acco_jax.optim.clip_by_global_norm), or the "
        "elementwise layout"
      )
