r"""Step-time model of ``zero1`` and ``acco`` with quantized communication (``comm.quantize``).

The same alpha-beta model as :mod:`acco_jax.analysis.perfmodel`, for the communication of
:mod:`acco_jax.dp.quantized_comm`: int8 or int4 blocks with one float32 scale per block, reduced in
two levels (a reduce-scatter inside each node, then one all-to-all of the node sums between nodes)
or in one (every device's chunks to every other device), and an all-gather of the encoded weight
updates. Pure Python (no JAX).
"""

from __future__ import annotations

from acco_jax.analysis.perfmodel import Cluster, StepTime, Workload, collective_time, ring_bytes

QUANTIZE_BITS = {"int8": 8, "int4": 4}


def wire_bytes_per_value(quantize: str, block: int = 256, scale_bytes: int = 4) -> float:
  """Bytes on the wire per value of a quantized payload: the code and a share of its block's scale
  (int8, blocks of 256: 1.0156; int4: 0.5156)."""
  if quantize not in QUANTIZE_BITS or block < 1:
    raise ValueError(
      f"need quantize in {tuple(QUANTIZE_BITS)} and block >= 1, got {quantize}, {block}"
    )
  return QUANTIZE_BITS[quantize] / 8 + scale_bytes / block


def quantized_reduce_time(
  cluster: Cluster, params: float, wire: float, node_size: int, comm_bytes: float = 2
) -> tuple[float, float, float]:
  r"""``(T_node, T_a2a, bytes sent)`` of the quantized reduce-scatter of ``params`` values.

  With ``L = node_size`` > 1 (= ``cluster.per_node``), each node first reduce-scatters in
  ``comm_bytes`` per value on its own links, :math:`T_{node} = (L-1)(\alpha_i + Pb/(L\beta_i))`,
  then the :math:`A = n/L` nodes exchange their node sums, quantized (:math:`b_q` bytes a value),
  with one all-to-all: each node's link carries :math:`\frac{A-1}{A} P b_q`, so
  :math:`T_{a2a} = (A-1)\alpha_e + \frac{A-1}{A} P b_q/\beta_e`. With ``L = 1`` every device sends
  its own quantized chunks to every other device: :math:`(n-1)\alpha` plus the busier of a node's
  network link, which carries :math:`L_n \frac{n-L_n}{n} P b_q` for :math:`L_n` devices per node
  (``per_node`` times a ring's volume when there are many nodes), and a device's link inside the
  node, :math:`\frac{L_n-1}{n} P b_q`. One node (``A = 1``): nothing is quantized, a plain
  reduce-scatter in ``comm_bytes``.
  """
  n, per = cluster.workers, cluster.per_node
  if node_size not in (1, per):
    raise ValueError(
      f"node_size must be 1 or the cluster's {per} devices per node, got {node_size}"
    )
  nodes = n // node_size
  if nodes == 1:
    t = collective_time("reduce_scatter", cluster, params * comm_bytes)
    return 0.0, t, ring_bytes("reduce_scatter", n, params * comm_bytes)
  if node_size > 1:
    inside = Cluster(1, node_size, cluster.intra)
    t_node = collective_time("reduce_scatter", inside, params * comm_bytes)
    sent_node = ring_bytes("reduce_scatter", node_size, params * comm_bytes)
    link = cluster.inter
    share = (nodes - 1) / nodes * params * wire
    return (
      t_node,
      (nodes - 1) * link.latency + share / link.bandwidth,
      sent_node + share / node_size,
    )
  if cluster.nodes == 1:
    link = cluster.intra
    return (
      0.0,
      (n - 1) * (link.latency + params * wire / (n * link.bandwidth)),
      (n - 1) / n * params * wire,
    )
  link = cluster.ring_link()
  across = per * (n - per) / n * params * wire / cluster.inter.bandwidth
  inside = (per - 1) / n * params * wire / cluster.intra.bandwidth if per > 1 else 0.0
  return 0.0, (n - 1) * link.latency + max(across, inside), (n - 1) / n * params * wire


def quantized_step_time(
  method: str,
  work: Workload,
  cluster: Cluster,
  quantize: str = "int8",
  block: int = 256,
  node_size: int | None = None,
  quant_time: float = 0.0,
) -> StepTime:
  r"""One update of ``zero1`` or ``acco`` with quantized communication (``comm.quantize``).

  The gradients take :func:`quantized_reduce_time` (``node_size`` defaults to the cluster's
  devices per node), the new weights a ring all-gather of the encoded updates,
  :math:`T_{AG}(P b_q)`; :math:`t_q` (``quant_time``) is the compute of encoding and decoding per
  stage. The node's reduce-scatter and the encoding come before the network collectives start, on
  the compute stream:

  .. math::

    X_q = T_{a2a} + T_{opt} + T_{AG}(P b_q), \qquad
    T_{zero1} = C + T_{node} + t_q + X_q, \qquad
    T_{acco} = 2\,\big(T_{node} + t_q + \max(C/2,\ X_q)\big).
  """
  if method not in ("zero1", "acco"):
    raise ValueError(f"quantized communication is modelled for zero1 and acco, not {method!r}")
  size = cluster.per_node if node_size is None else node_size
  wire = wire_bytes_per_value(quantize, block)
  t_node, t_a2a, sent_reduce = quantized_reduce_time(
    cluster, work.params, wire, size, work.comm_bytes
  )
  n, compute = cluster.workers, work.microbatches * work.microbatch_time
  t_ag = collective_time("all_gather", cluster, work.params * wire)
  chain = t_a2a + work.opt_time + t_ag
  sent = sent_reduce + ring_bytes("all_gather", n, work.params * wire)
  lead = t_node + quant_time
  if method == "zero1":
    total, stages = compute + lead + chain, 1
  else:
    total, stages = 2 * (lead + max(compute / 2, chain)), 2
  exposed = max(0.0, total - compute)  # communication and encoding not hidden behind compute
  idle = 1.0 - compute / total if total > 0 else 0.0
  return StepTime(
    f"{method}-{quantize}", total, compute, stages * (t_node + chain), exposed, idle, stages * sent
  )
