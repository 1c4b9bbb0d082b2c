"""A data-parallel train state to and from the portable form (``ckpt.init_from`` across run kinds).

:meth:`acco_jax.dp.step.TrainStep.export_state` and :meth:`~acco_jax.dp.step.TrainStep.import_state`
call these; the form and the contract are :mod:`acco_jax.run.portable`'s. What each part of a
:class:`~acco_jax.dp.step.TrainState` becomes:

- ``params`` (``[N, s_l]`` shards, any ``N``) and every parameter-shaped subtree of the inner
  optimizer's state: cut to the model's shapes (the padding dropped), and back (zero padding for
  this step's ``N``), bit for bit. ``w``, the compute weights, is θ in ``comm_dtype``, rebuilt as
  a fresh run builds it.
- ACCO (:class:`~acco_jax.dp.methods.AccoState`) and WP (:class:`~acco_jax.dp.methods.WpState`)
  keep the committed θ and the inner state S apart from ``params``: the form carries θ and S.

**ACCO's in-flight state.** Between stages ACCO holds, besides θ and S, the estimate θ̃ (in
``params`` and ``w``, after an estimate stage) and the gradient buffer, which holds gradients the
next commit will use but no update has used yet (at an update boundary the last stage's, at θ̃;
after an estimate stage the last two stages'). Neither is carried: they were taken at weights
and for a two-stage cycle that the other run kind does not have, and a synchronous method has no
place for them. Export keeps θ and S (the state after the last *commit*), so a checkpoint taken
after an estimate stage exports the update before it. Import into ACCO starts a fresh two-stage
cycle at an estimate stage (stage parity even) with θ and S, and primes the buffer as a fresh run
does: one microbatch gradient per device at θ, from the first batch of the priming stream
(``train.seed + 1``, not the training stream). The cost: the dropped gradients' microbatches
(their rows were read, so the data position, which is kept, stays after them) and one priming
microbatch per device. WP drops its prediction θ̂ and buffer the same way, DPU its buffer; both
prime like ACCO (DPU during its synchronous warm-up does not need to).

Also not carried: the undelivered residual of quantized sends (ZeRO-1 with ``comm.quantize``),
and the compute weights' quantization error: ``w`` restarts at θ. The owner layout is refused.
"""

from __future__ import annotations

import jax
import numpy as np

from acco_jax.dp.flat import TreeLayout, leaves_of
from acco_jax.dp.methods import AccoState, WpState
from acco_jax.dp.owner import OwnerLayout
from acco_jax.run.portable import Portable, check_fits, map_param_subtrees, place


def _check(step) -> None:
  if isinstance(step.layout, OwnerLayout):
    raise ValueError(
      "layout='owner' keeps the optimizer state per owned matrix; it cannot be carried to "
      "another run kind yet: use the elementwise layout"
    )


def _to_model(sub, layout):
  """``[n, s_l]`` chunks (any ``n``) -> numpy leaves of the parameters' shapes, dtypes kept."""
  out = [
    np.asarray(x).reshape(-1)[: s.size].reshape(s.shape)
    for x, s in zip(leaves_of(sub, layout.treedef), layout.specs, strict=True)
  ]
  return layout.treedef.unflatten(out)


def _to_shards(sub, layout):
  """Numpy leaves of the parameters' shapes -> this layout's view (zero padded), dtypes kept."""
  leaves = [np.asarray(x) for x in leaves_of(sub, layout.treedef)]
  if isinstance(layout, TreeLayout):  # the optimizer sees whole parameters
    return layout.treedef.unflatten(leaves)
  out = []
  for x, s in zip(leaves, layout.specs, strict=True):
    chunks = np.zeros(layout.num_shards * s.chunk, x.dtype)
    chunks[: s.size] = x.reshape(-1)
    out.append(chunks.reshape(layout.num_shards, s.chunk))
  return layout.treedef.unflatten(out)


def _flat(params, layout, dtype) -> np.ndarray:
  """The flat ``[N * S]`` buffer of ``params`` in ``dtype`` (:meth:`FlatLayout.ravel` on numpy)."""
  rows = []
  for x, s in zip(leaves_of(params, layout.treedef), layout.specs, strict=True):
    chunks = np.zeros(layout.num_shards * s.chunk, dtype)
    chunks[: s.size] = np.asarray(x).reshape(-1).astype(dtype)
    rows.append(chunks.reshape(layout.num_shards, s.chunk))
  return np.concatenate(rows, axis=1).reshape(-1)


def model_like(layout):
  """``ShapeDtypeStruct`` tree of the parameters in the model's structure."""
  return layout.treedef.unflatten([jax.ShapeDtypeStruct(s.shape, s.dtype) for s in layout.specs])


def _updates(plan, stage: int) -> int:
  """Optimizer updates after ``stage`` stages (:func:`acco_jax.dp.updates.updates_done`)."""
  if plan.two_stage:
    return stage // 2
  warmup = plan.warmup_steps
  return stage - 1 if warmup and stage > warmup else stage


def export_state(step, saved) -> Portable:
  """``saved`` (host numpy, written on any device count) -> :class:`Portable` (see the module)."""
  _check(step)
  layout, plan, opt = step.layout, step.plan, saved.opt_state
  apart = isinstance(opt, AccoState | WpState)
  theta = opt.committed if apart else saved.params
  inner = opt.inner_state if apart else opt
  stage = int(np.asarray(saved.stage))
  to_model = lambda sub: _to_model(sub, layout)
  dropped = []
  if plan.two_stage and stage % 2:
    dropped.append("the estimate of the round in progress")
  if isinstance(opt, WpState):
    dropped.append("the predicted weights")
  if saved.buf_count is not None and int(np.sum(saved.buf_count)):
    dropped.append(f"{int(np.sum(saved.buf_count))} microbatch gradients in flight")
  if saved.residual is not None and np.any(np.asarray(saved.residual)):
    dropped.append("the undelivered residual of quantized sends")
  return Portable(
    params=to_model(theta),
    opt=map_param_subtrees(to_model, inner, saved.params),
    updates=_updates(plan, stage),
    source=plan.name,
    dropped=", ".join(dropped),
  )


def import_state(step, portable: Portable, stage: int, microbatch=None):
  """:class:`Portable` -> this step's state, placed, at stage ``stage`` (see the module)."""
  _check(step)
  layout, plan = step.layout, step.plan
  like = model_like(layout)
  abstract = step.abstract_state(like)
  apart = isinstance(abstract.opt_state, AccoState | WpState)
  inner_like = abstract.opt_state.inner_state if apart else abstract.opt_state
  check_fits(portable, like, map_param_subtrees(lambda _: like, inner_like, abstract.params))
  to_shards = lambda sub: _to_shards(sub, layout)
  theta = to_shards(portable.params)
  inner = map_param_subtrees(to_shards, portable.opt, like)
  count = np.asarray(stage, np.int32)
  if isinstance(abstract.opt_state, AccoState):  # a fresh cycle: parity even, an estimate next
    opt = AccoState(inner, theta, count)
  elif isinstance(abstract.opt_state, WpState):
    opt = WpState(inner, theta)
  else:
    opt = inner
  zeros = lambda x: None if x is None else np.zeros(x.shape, x.dtype)
  host = abstract._replace(
    w=_flat(portable.params, layout, step.comm_dtype), params=theta, opt_state=opt,
    buf=zeros(abstract.buf), buf_count=zeros(abstract.buf_count), stage=count,
    residual=zeros(abstract.residual),
  )  # fmt: skip
  state = place(host, abstract)
  if plan.delayed and (plan.warmup_steps == 0 or stage > plan.warmup_steps):
    state = step.prime(state, microbatch, "import_state")
  return state
