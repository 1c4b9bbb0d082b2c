"""The communication plan a data-parallel method transform carries (:mod:`acco_jax.dp.methods`).

A *method* is an optax transform plus a :class:`CommPlan`: the transform is the update rule on
logical arrays, the plan tells :func:`acco_jax.make_train_step` how to move the gradients.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from acco_jax.dp import quantize as quantize_lib


class CommPlan(NamedTuple):
  """How :func:`acco_jax.make_train_step` runs a method.

  Attributes:
    name: the method's stable name (``acco``, ``ddp``, ``zero1``, ``dpu``, ``wp``).
    axis_name: the mesh axis the data parallelism runs over.
    comm_dtype: dtype of the reduced gradients and the gathered compute weights.
    sharded: ZeRO-1 — master weights and inner state live 1/N per device; gradients are
      reduce-scattered and weights all-gathered. Otherwise one all-reduce, replicated state.
    delayed: a stage's update uses the gradients accumulated in the previous stage, so its
      communication has no data dependence on the current stage's compute.
    keep_after_commit: ACCO's accumulator rule — after a commit stage the gradients just shipped (g̃,
      taken at θ̃) stay in the accumulator and the next stage adds the gradients at θ on top; after an
      estimate stage it is reset. Without it the accumulator is reset every stage.
    two_stage: stages alternate estimate (even) and commit (odd); only commits advance the optimizer.
    warmup_steps: synchronous updates before the delayed pipeline starts (DPU's warm-up).
    quantize: ``none``, ``int8`` or ``int4``: gradients reach their shard through a quantized
      all-to-all and the compute weights receive quantized updates (:mod:`acco_jax.dp.quantize`).
    block: values per scale of the quantized payloads.
    error_feedback: what a quantized send did not deliver is sent again later (gradients: it stays
      in the device's accumulator; weights: each update is taken against the weights the devices
      hold), so nothing is lost over time.
    node_size: devices per node. Within a node the gradients are reduce-scattered in
      ``comm_dtype``; only node sums are quantized and cross nodes. 1: every device quantizes.
    layout: how a sharded method splits the optimizer over the data axis: ``elementwise``
      (:mod:`acco_jax.dp.flat`, every leaf in ``N`` chunks) or ``owner`` (:mod:`acco_jax.dp.owner`,
      each weight matrix whole on one device: Muon, Adafactor). ``auto``: the owner layout for an
      inner optimizer that is not elementwise (acco, zero1; :mod:`acco_jax.dp.layouts`), else
      elementwise. :func:`acco_jax.make_train_step` resolves it.
  """

  name: str
  axis_name: str = "data"
  comm_dtype: Any = jnp.bfloat16
  sharded: bool = True
  delayed: bool = False
  keep_after_commit: bool = False
  two_stage: bool = False
  warmup_steps: int = 0
  quantize: str = "none"
  block: int = 256
  error_feedback: bool = True
  node_size: int = 1
  layout: str = "auto"

  def wire_bytes(self, values: int) -> int:
    """Bytes of ``values`` values in this plan's quantized format (integers and block scales)."""
    return quantize_lib.wire_bytes(values, self.quantize, self.block)


class MethodTransformation(optax.GradientTransformationExtraArgs):
  """An ``optax.GradientTransformationExtraArgs`` that also carries its :class:`CommPlan` as
  ``.plan`` and the inner optimizer it wraps as ``.inner``."""


def method(init_fn, update_fn, plan: CommPlan, inner=None) -> MethodTransformation:
  """A :class:`MethodTransformation` of ``init_fn``, ``update_fn``, its plan and inner optimizer."""
  tx = MethodTransformation(init_fn, update_fn)
  tx.plan, tx.inner = plan, inner
  return tx


def comm_plan(tx) -> CommPlan:
  """Returns the :class:`CommPlan` of a transform built by ``acco``/``ddp``/``zero1``/``dpu``/``wp``."""
  plan = getattr(tx, "plan", None)
  if not isinstance(plan, CommPlan):
    raise TypeError(
      "make_train_step needs a method transform (acco_jax.acco/ddp/zero1/dpu/wp) at the top; "
      "wrap your optax optimizer in one, e.g. acco_jax.acco(optax.adamw(3e-4))"
    )
  return plan
