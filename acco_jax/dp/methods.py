"""ACCO and its baselines as optax transforms.

A *method* is an optax transform plus a :class:`CommPlan`. The transform is the update rule, written on
logical (unsharded-looking) arrays with no collectives, so any optax chain composes with it exactly as in
single-device code: ``clip_by_global_norm`` sees the global norm, masks and ``inject_hyperparams`` work by
parameter name. The plan tells :func:`acco_jax.make_train_step` how to move gradients: all-reduce or
reduce-scatter + all-gather (ZeRO-1), and whether a stage's update consumes the *previous* stage's
gradients so that the communication overlaps the current stage's microbatches.

Notation (``acco-algorithm.md``): ``θ`` committed parameters, ``θ̃`` estimate, ``S`` inner optimizer
state, ``Opt(θ, g; S) -> (θ', S')`` one inner step, ``ḡ`` the per-microbatch mean gradient
``Σ_i g_i / Σ_i n_i`` over all devices.

References:
  Nabli, Fournier, Erbacher, Serrano, Belilovsky, Oyallon. "ACCO: Accumulate While You Communicate for
  Communication-Overlapped Sharded LLM Training", arXiv:2406.02613.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from acco_jax.dp import layouts
from acco_jax.dp import quantize as quantize_lib
from acco_jax.dp.plan import CommPlan as CommPlan
from acco_jax.dp.plan import MethodTransformation as MethodTransformation
from acco_jax.dp.plan import comm_plan as comm_plan
from acco_jax.dp.plan import method as _method
from acco_jax.optax_state import find_state

PyTree = Any

METHODS = ("acco", "ddp", "zero1", "dpu", "wp")


def _tree_select(pred, on_true: PyTree, on_false: PyTree) -> PyTree:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _tree_sub(a: PyTree, b: PyTree) -> PyTree:
  return jax.tree.map(lambda x, y: x - y.astype(x.dtype), a, b)


def _quantized(quantize: str, block: int, error_feedback: bool, node_size: int) -> dict:
  quantize_lib.check(quantize, block, error_feedback, node_size)
  return dict(quantize=quantize, block=block, error_feedback=error_feedback, node_size=node_size)


# -- ACCO -----------------------------------------------------------------------------------------


class AccoState(NamedTuple):
  """State of :func:`acco`.

  Attributes:
    inner_state: the inner optimizer's state S^(t) after the last **commit**.
    committed: the committed parameters θ^(t) (the params passed to ``update`` hold θ̃ after an
      estimate stage).
    stage: number of stages done; even = the next stage is an estimate, odd = a commit.
  """

  inner_state: PyTree
  committed: PyTree
  stage: jax.Array


# Over 80 lines for its docstring, the update rule's reference; the code is 35 lines.
def acco(
  inner: optax.GradientTransformation,
  *,
  axis_name: str = "data",
  comm_dtype=jnp.bfloat16,
  quantize: str = "none",
  block: int = 256,
  error_feedback: bool = True,
  node_size: int = 1,
  layout: str = "auto",
) -> MethodTransformation:
  r"""ACCO: two-stage (estimate, then commit) updates that hide communication without staleness.

  Each round ``t`` has two stages. Both start from the same committed ``θ`` and inner state ``S``, so
  they share the learning rate and the bias-correction step:

  .. math::

    \tilde\theta_{t+1} &= \mathrm{Opt}\big(\theta_t,\ \tilde g_t / \tilde n_t;\ S_t\big)
      \quad\text{(estimate; the new state is discarded)} \\
    (\theta_{t+1}, S_{t+1}) &= \mathrm{Opt}\big(\theta_t,\ (\tilde g_t + g_t) / (\tilde n_t + n_t);
      \ S_t\big) \quad\text{(commit)}

  where ``g̃_t`` sums the microbatch gradients taken at ``θ̃_t`` and ``g_t`` those taken at ``θ_t``, over
  all devices, and ``ñ_t``, ``n_t`` count them: the mean is per microbatch, so devices may contribute
  different numbers of microbatches. In the SGD case this is
  ``θ̃_{t+1} = θ_t − η g̃_t`` and ``θ_{t+1} = θ_t − (η/2)(g_t + g̃_t)`` for equal halves.

  This transform is the update rule only. :func:`acco_jax.make_train_step` supplies the schedule that
  makes it fast: the gradients reduced at a stage were accumulated during the *previous* stage, so the
  reduce-scatter, the sharded inner step and the all-gather overlap the current stage's microbatches;
  the accumulator keeps ``g̃`` after a commit and is reset after an estimate; the initial buffer is one
  microbatch gradient at ``θ_0``. ``update`` receives the already reduced mean gradient and returns
  ``θ̃_{t+1} − params`` or ``θ_{t+1} − params``, so ``optax.apply_updates(params, updates)`` gives the
  weights the next stage computes at.

  Args:
    inner: any elementwise optax transform or chain (``adamw``, ``sgd``, ``lion``,
      ``chain(clip_by_global_norm(1.0), adamw(schedule, mask=...))``, ``inject_hyperparams(...)``).
      Its step counter (and so any schedule) advances once per commit.
    axis_name: the data-parallel mesh axis.
    comm_dtype: dtype of the reduce-scatter and the all-gather (``jnp.bfloat16`` as in the paper,
      ``jnp.float32`` for exactness).
    quantize, block, error_feedback, node_size: quantized communication (see :class:`CommPlan`;
      ``none`` by default).
    layout: ``auto``, ``elementwise`` or ``owner`` (see :class:`CommPlan`); with ``owner`` the
      inner optimizer may be any per-leaf transform (``optax.contrib.muon``, ``adafactor``), and
      ``auto`` takes it for them by itself. An ``optax.clip_by_global_norm`` first in the inner
      chain stays global on the owner layout (:mod:`acco_jax.dp.layouts`).

  Returns:
    A :class:`MethodTransformation` with state :class:`AccoState` and plan ``acco``.

  References:
    Nabli et al., "ACCO: Accumulate While You Communicate for Communication-Overlapped Sharded LLM
    Training", arXiv:2406.02613.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return AccoState(
      inner_state=inner.init(params),
      committed=jax.tree.map(jnp.asarray, params),
      stage=jnp.zeros((), jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("acco needs params: call update(grads, state, params)")
    step, new_inner = inner.update(updates, state.inner_state, state.committed, **extra_args)
    target = optax.apply_updates(state.committed, step)
    commit, _ = alternation(state.stage)
    new_state = AccoState(
      inner_state=_tree_select(commit, new_inner, state.inner_state),
      committed=_tree_select(commit, target, state.committed),
      stage=state.stage + 1,
    )
    return _tree_sub(target, params), new_state

  plan = CommPlan(
    "acco",
    axis_name,
    comm_dtype,
    sharded=True,
    delayed=True,
    keep_after_commit=True,
    two_stage=True,
    **_quantized(quantize, block, error_feedback, node_size),
    layout=layouts.check_name(layout, quantize),
  )
  return _method(init_fn, update_fn, plan, inner)


# -- Baselines ------------------------------------------------------------------------------------


def _passthrough(inner, plan: CommPlan) -> MethodTransformation:
  inner = optax.with_extra_args_support(inner)
  return _method(inner.init, inner.update, plan, inner)


def ddp(inner, *, axis_name: str = "data", comm_dtype=jnp.bfloat16) -> MethodTransformation:
  r"""Synchronous data parallelism: ``θ_{t+1} = Opt(θ_t, ḡ(θ_t))`` with one all-reduce per update.

  Every device keeps the full inner state (no sharding). The all-reduce runs after the stage's
  microbatches, so nothing overlaps.

  Args:
    inner: any optax transform.
    axis_name: the data-parallel mesh axis.
    comm_dtype: dtype of the all-reduce.

  Returns:
    The inner transform with plan ``ddp``.
  """
  return _passthrough(inner, CommPlan("ddp", axis_name, comm_dtype, sharded=False))


def zero1(
  inner,
  *,
  axis_name: str = "data",
  comm_dtype=jnp.bfloat16,
  quantize: str = "none",
  block: int = 256,
  error_feedback: bool = True,
  node_size: int = 1,
  layout: str = "auto",
) -> MethodTransformation:
  r"""ZeRO-1: the same update as :func:`ddp`, with master weights and inner state sharded 1/N.

  ``θ_{t+1} = Opt(θ_t, ḡ(θ_t))``: reduce-scatter the stage's gradient sums, update the local shard,
  all-gather the new weights. One reduction per update (not per microbatch); no overlap.

  Args:
    inner: any elementwise optax transform.
    axis_name: the data-parallel mesh axis.
    comm_dtype: dtype of the reduce-scatter and all-gather.
    quantize, block, error_feedback, node_size: quantized communication (see :class:`CommPlan`;
      ``none`` by default).
    layout: ``auto``, ``elementwise`` or ``owner`` (see :class:`CommPlan`); with ``owner`` the
      inner optimizer may be any per-leaf transform (``optax.contrib.muon``, ``adafactor``), and
      ``auto`` takes it for them by itself. An ``optax.clip_by_global_norm`` first in the inner
      chain stays global on the owner layout (:mod:`acco_jax.dp.layouts`).

  Returns:
    The inner transform with plan ``zero1``.

  References:
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020.
  """
  quant = _quantized(quantize, block, error_feedback, node_size)
  layout = layouts.check_name(layout, quantize)
  plan = CommPlan("zero1", axis_name, comm_dtype, sharded=True, **quant, layout=layout)
  return _passthrough(inner, plan)


def dpu(
  inner, *, warmup_steps: int = 0, axis_name: str = "data", comm_dtype=jnp.bfloat16
) -> MethodTransformation:
  r"""Delayed parameter update: ``θ_{t+1} = Opt(θ_t, ḡ(θ_{t−1}))``, overlapped but one step stale.

  The update of a stage consumes the gradients accumulated in the previous stage (taken at the
  previous weights) while the current stage computes at ``θ_t``; the accumulator is reset every stage.
  The first ``warmup_steps`` updates are synchronous (ZeRO-1); then the buffer is filled with one stage
  of gradients at the current weights and the delayed pipeline starts.

  Args:
    inner: any elementwise optax transform.
    warmup_steps: synchronous updates before the delay starts (the paper tried 0, 40 and 500).
    axis_name: the data-parallel mesh axis.
    comm_dtype: dtype of the reduce-scatter and all-gather.

  Returns:
    The inner transform with plan ``dpu``.

  References:
    Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", 2021 (one-step delayed
    parameter update).
  """
  if warmup_steps < 0:
    raise ValueError(f"dpu warmup_steps must be >= 0, got {warmup_steps}")
  plan = CommPlan(
    "dpu", axis_name, comm_dtype, sharded=True, delayed=True, warmup_steps=int(warmup_steps)
  )
  return _passthrough(inner, plan)


class WpState(NamedTuple):
  """State of :func:`wp`: the committed inner state and parameters (params hold the prediction)."""

  inner_state: PyTree
  committed: PyTree


def wp(inner, *, axis_name: str = "data", comm_dtype=jnp.bfloat16) -> MethodTransformation:
  r"""Weight prediction: a delayed update, then compute at a one-step look-ahead of the weights.

  .. math::

    (\theta_{t+1}, S_{t+1}) = \mathrm{Opt}(\theta_t, \bar g;\ S_t), \qquad
    \hat\theta_{t+1} = \mathrm{Opt}(\theta_{t+1}, \bar g;\ S_{t+1})

  with ``ḡ`` the (one stage stale) mean gradient. ``θ`` and ``S`` are committed; the prediction's
  state is discarded; the next stage computes its gradients at ``θ̂``.

  Args:
    inner: any elementwise optax transform.
    axis_name: the data-parallel mesh axis.
    comm_dtype: dtype of the reduce-scatter and all-gather.

  Returns:
    A :class:`MethodTransformation` with state :class:`WpState` and plan ``wp``.

  References:
    Chen et al., "Efficient and Robust Parallel DNN Training through Model Parallelism on Multi-GPU
    Platform" (weight prediction), arXiv:1809.02839, 2019.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return WpState(inner.init(params), jax.tree.map(jnp.asarray, params))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("wp needs params: call update(grads, state, params)")
    step, new_inner = inner.update(updates, state.inner_state, state.committed, **extra_args)
    committed = optax.apply_updates(state.committed, step)
    step2, _ = inner.update(updates, new_inner, committed, **extra_args)
    predicted = optax.apply_updates(committed, step2)
    return _tree_sub(predicted, params), WpState(new_inner, committed)

  plan = CommPlan("wp", axis_name, comm_dtype, sharded=True, delayed=True)
  return _method(init_fn, update_fn, plan, inner)


def get_method(name: str, inner, **kwargs) -> MethodTransformation:
  """Builds a method transform by its stable name (``acco``, ``ddp``, ``zero1``, ``dpu``, ``wp``)."""
  factories = {"acco": acco, "ddp": ddp, "zero1": zero1, "dpu": dpu, "wp": wp}
  if name not in factories:
    raise ValueError(f"unknown method {name!r}: choose one of {', '.join(METHODS)}")
  return factories[name](inner, **kwargs)


# -- ACCO's two-stage alternation ------------------------------------------------------------------


def alternation(stage, keep_after_commit: bool = True):
  """Where an update of two stages stands at stage count ``stage`` (traced): even stages estimate,
  odd ones commit. After a commit the gradient accumulator keeps the ``g̃`` it just shipped and the
  next stage adds to it (``keep_after_commit``, ACCO's rule); otherwise it starts from zero.

  Returns:
    ``(commits, keep)``: whether this stage's update commits, and whether its accumulator starts
    from the buffer instead of zero.
  """
  commits = stage % 2 == 1
  keep = stage % 2 == 0 if keep_after_commit else jnp.bool_(False)
  return commits, keep


# -- State inspection -----------------------------------------------------------------------------


def committed_params(opt_state, params: PyTree) -> PyTree:
  """The committed parameters θ: ``params`` unless the method keeps them apart (ACCO, WP)."""
  found = find_state(opt_state, lambda s: isinstance(s, AccoState | WpState))
  return params if found is None else found.committed


def with_committed(opt_state, params: PyTree):
  """``opt_state`` with the committed parameters of an :class:`AccoState` set to ``params`` (a
  LoCo sync moving a worker's θ: its next estimate must start from there); unchanged otherwise."""
  if isinstance(opt_state, AccoState):
    return opt_state._replace(committed=params)
  if find_state(opt_state, lambda s: isinstance(s, AccoState)) is not None:
    raise ValueError("with_committed: an AccoState nested in another state is not supported")
  return opt_state
