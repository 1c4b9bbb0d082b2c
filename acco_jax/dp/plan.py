"""The communication plan a data-parallel method transform carries (:mod:`acco_jax.dp.methods`).

A *method* is an optax transform plus a :class:`CommPlan`: the transform is the update rule on
logical arrays, the plan tells :func:`acco_jax.make_train_step` how to move the gradients.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from acco_jax.dp import quantize as quantize_lib
from acco_jax.step_api import ring_bytes


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


def comm_bytes_per_stage(plan, padded_size: int, num_devices: int) -> int:
  """Bytes one device sends per stage with ring collectives (:func:`acco_jax.step_api.ring_bytes`).

  ZeRO-1 style (reduce-scatter + all-gather of ``P`` values): ``2 (N−1)/N · P · b``; DDP's all-reduce
  moves the same ``2 (N−1)/N · P · b``. ACCO runs one such pair every stage, i.e. twice per update.
  """
  n = num_devices
  itemsize = jnp.dtype(plan.comm_dtype).itemsize
  if n <= 1:
    return 0
  if getattr(plan, "quantize", "none") != "none":
    return quantized_bytes_per_stage(plan, padded_size, n)
  return int(ring_bytes(padded_size * itemsize, n))


def quantized_bytes_per_stage(plan, padded_size: int, num_devices: int) -> int:
  r"""Bytes one device sends per stage with quantized communication (:mod:`acco_jax.dp.quantize`).

  With ``W(m)`` the encoded bytes of ``m`` values (integers and a float32 scale per block), ``S =
  P/N`` the shard size, ``L`` the node size and ``A = N/L`` nodes: the node's reduce-scatter in
  ``comm_dtype`` (``L > 1``) :math:`\frac{L-1}{L} P b`, the all-to-all of the node sums
  :math:`(A-1)\,W(S)` (nothing with one node) and the ring all-gather of the encoded weight updates
  :math:`(N-1)\,W(S)`.
  """
  n, size = num_devices, plan.node_size
  shard, nodes = padded_size // n, n // size
  wire = plan.wire_bytes(shard)
  itemsize = jnp.dtype(plan.comm_dtype).itemsize
  intra = (size - 1) * padded_size * itemsize // size if nodes > 1 else 0
  if nodes == 1:  # the gradients never leave the node: an unquantized reduce-scatter
    intra = (n - 1) * padded_size * itemsize // n
  return int(intra + (nodes - 1) * wire + (n - 1) * wire)


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
