"""A data-parallel train state to and from the portable form (``ckpt.init_from`` across run kinds).

:meth:`acco_jax.dp.step.TrainStep.export_state` and :meth:`~acco_jax.dp.step.TrainStep.import_state`
call these; the form and the contract are :mod:`acco_jax.ckpt.portable`'s. What each part of a
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
and the compute weights' quantization error: ``w`` restarts at θ.

**The owner layout** (``layout='owner'``, Muon): θ is put back into the model's shapes from the
owners' shards of the saved device count, and the inner state becomes the state the same optimizer
holds on the model's tree (:mod:`acco_jax.dp.relayout_owner`); import cuts both for this run's owners.
"""

from __future__ import annotations

import jax
import numpy as np

from acco_jax.ckpt.portable import PortableState, check_fits, map_param_subtrees, place
from acco_jax.dp import relayout_owner, reshard_owner
from acco_jax.dp.flat import TreeLayout, leaves_of
from acco_jax.dp.methods import AccoState, WpState
from acco_jax.dp.owner import OwnerLayout
from acco_jax.dp.reshard import saved_num_devices


class _OwnerView:
  """The owner layout's conversions for one device count, with :func:`export_state`'s and
  :func:`import_state`'s signatures: θ and the inner state to the model's structure and back."""

  def __init__(self, step, num_devices: int):
    self.layout = reshard_owner.source_layout(step.layout, num_devices)
    self.inner_tx, self.tree_tx = step.source_tx(num_devices).inner, step.tree_inner
    self.like = self.layout.treedef.unflatten(
      [
        jax.ShapeDtypeStruct(s, d)
        for s, d in zip(self.layout.shapes, self.layout.dtypes, strict=True)
      ]
    )

  def theta_to_model(self, shards):
    return jax.tree.map(np.asarray, self.layout.from_shards(shards))

  def theta_to_shards(self, tree):
    return jax.tree.map(np.asarray, self.layout.to_shards(tree))

  def inner_to_model(self, inner):
    return relayout_owner.to_model(inner, self.layout, self.inner_tx, self.tree_tx, self.like)

  def inner_to_shards(self, tree_state):
    return relayout_owner.to_owner(tree_state, self.layout, self.inner_tx, self.tree_tx, self.like)

  def inner_like(self):
    return jax.eval_shape(self.tree_tx.init, self.like)


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


def export_state(step, saved) -> PortableState:
  """``saved`` (host numpy, written on any device count) -> :class:`PortableState` (see the module)."""
  layout, plan, opt = step.layout, step.plan, saved.opt_state
  apart = isinstance(opt, AccoState | WpState)
  theta = opt.committed if apart else saved.params
  inner = opt.inner_state if apart else opt
  stage = int(np.asarray(np.ravel(saved.stage)[0]))
  to_model = lambda sub: _to_model(sub, layout)
  if isinstance(layout, OwnerLayout):
    owner = _OwnerView(step, saved_num_devices(saved))
    theta_model, inner_model = owner.theta_to_model(theta), owner.inner_to_model(inner)
  else:
    theta_model, inner_model = to_model(theta), map_param_subtrees(to_model, inner, saved.params)
  dropped = []
  if plan.two_stage and stage % 2:
    dropped.append("the estimate of the round in progress")
  if isinstance(opt, WpState):
    dropped.append("the predicted weights")
  if saved.buf_count is not None and int(np.sum(saved.buf_count)):
    dropped.append(f"{int(np.sum(saved.buf_count))} microbatch gradients in flight")
  if saved.residual is not None and np.any(np.asarray(saved.residual)):
    dropped.append("the undelivered residual of quantized sends")
  return PortableState(
    params=theta_model,
    opt=inner_model,
    updates=_updates(plan, stage),
    source=plan.name,
    dropped=", ".join(dropped),
  )


def import_state(step, portable: PortableState, stage: int, microbatch=None):
  """:class:`PortableState` -> this step's state, placed, at stage ``stage`` (see the module)."""
  layout, plan = step.layout, step.plan
  owner = _OwnerView(step, layout.num_shards) if isinstance(layout, OwnerLayout) else None
  like = owner.like if owner else model_like(layout)
  abstract = step.abstract_state(like)
  apart = isinstance(abstract.opt_state, AccoState | WpState)
  inner_like = abstract.opt_state.inner_state if apart else abstract.opt_state
  if owner:
    check_fits(portable, like, owner.inner_like())
    theta = owner.theta_to_shards(portable.params)
    inner = owner.inner_to_shards(portable.opt)
    w = np.asarray(layout.ravel(portable.params, step.comm_dtype))
  else:
    check_fits(portable, like, map_param_subtrees(lambda _: like, inner_like, abstract.params))
    to_shards = lambda sub: _to_shards(sub, layout)
    theta = to_shards(portable.params)
    inner = map_param_subtrees(to_shards, portable.opt, like)
    w = _flat(portable.params, layout, step.comm_dtype)
  opt_stage = getattr(abstract.opt_state, "stage", None)
  count = np.full(np.shape(opt_stage) if opt_stage is not None else (), stage, np.int32)
  if isinstance(abstract.opt_state, AccoState):  # a fresh cycle: parity even, an estimate next
    opt = AccoState(inner, theta, count)
  elif isinstance(abstract.opt_state, WpState):
    opt = WpState(inner, theta)
  else:
    opt = inner
  zeros = lambda x: None if x is None else np.zeros(x.shape, x.dtype)
  host = abstract._replace(
    w=w,
    params=theta,
    opt_state=opt,
    buf=zeros(abstract.buf),
    buf_count=zeros(abstract.buf_count),
    stage=np.asarray(stage, np.int32),
    residual=zeros(abstract.residual),
  )
  state = place(host, abstract)
  if plan.delayed and (plan.warmup_steps == 0 or stage > plan.warmup_steps):
    state = step.prime(state, microbatch, "import_state")
  return state
